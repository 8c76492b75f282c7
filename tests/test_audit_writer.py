"""The audit's batch write (idempotent, one transaction) and the report over its rows, without a
JVM.

The rows go through the real HistoryStore into a real DuckDB file; the Parquet file has the
columns the audit's Parquet sink writes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.harness.handmade import ROWS, US, T, progress
from wmwatch._audit.report.advice import (
    WindowGrid,
    extra_windows_in_state,
    state_advice_from_quantile,
    window_grid,
)
from wmwatch._audit.report.folders import parquet_late_column
from wmwatch._audit.sinks import BatchLateRows, _batch_writer, _pending_writer
from wmwatch._report.build import build_report
from wmwatch._report.reading import open_history
from wmwatch._report.render import report_dict
from wmwatch._store.writer import HistoryStore


def write(
    store: HistoryStore,
    batch_id: int,
    found: BatchLateRows,
    wm_s: int | None = T + 25,
    sink: str = "duckdb",
) -> None:
    store.submit(
        _batch_writer(
            query_id="q-1",
            query_name="clicks",
            run_id="run-1",
            batch_id=batch_id,
            late_wm_ms=None if wm_s is None else wm_s * 1000,
            found=found,
            sink=sink,
        ),
        description=f"test batch {batch_id}",
    )


def stage(store: HistoryStore, batch_id: int, attempt: str, rows: list[Any]) -> None:
    store.submit(_pending_writer("q-1", batch_id, attempt, rows), description="staged chunk")


@pytest.mark.parametrize("shape", ["one_write", "staged_chunks"])
def test_batch_write_is_idempotent_and_exact(tmp_path: Path, shape: str) -> None:
    with HistoryStore(tmp_path / "h.duckdb") as store:
        for attempt in ("first", "second"):  # a retried write, or a re-audit after a crash
            if shape == "one_write":
                found = BatchLateRows(total=3, rows=list(ROWS))
            else:
                stage(store, 4, attempt, ROWS[:2])
                stage(store, 4, attempt, ROWS[2:])
                found = BatchLateRows(total=3, attempt=attempt, staged=3)
            write(store, 4, found)
        write(store, 5, BatchLateRows.nothing())
        assert store.flush(10)
        got = store.read(
            lambda con: con.execute(
                "SELECT batch_id, epoch(event_time_at), epoch(watermark_at), lateness_seconds, "
                "epoch(window_start_at), epoch(window_end_at), operator_kind, source_file, "
                "row_data::VARCHAR, run_id, query_name FROM late_rows ORDER BY event_time_at"
            ).fetchall()
        )
        marks = store.read(
            lambda con: con.execute(
                "SELECT batch_id, late_rows, epoch(late_watermark_at), sink FROM audit_batches "
                "ORDER BY 1"
            ).fetchall()
        )
    assert [r[0] for r in got] == [4, 4, 4]
    first = got[0]
    assert first[1:9] == (T + 3, T + 25, 22.0, T, T + 10, "window", "/in/a.json", '{"id":5}')
    assert first[9:] == ("run-1", "clicks")
    assert marks == [(4, 3, T + 25, "duckdb"), (5, 0, T + 25, "duckdb")]


def test_interrupted_replay_leaves_nothing_and_storm_counts_are_kept(tmp_path: Path) -> None:
    """A crash between chunks leaves staged rows of an attempt that never got its marker: they
    never reach late_rows, and the next attempt's rows replace them. A batch over the cap
    records how many rows it found, kept and only counted."""
    path = tmp_path / "h.duckdb"
    with HistoryStore(path) as store:
        for batch_id in range(5):
            store.record_progress(progress(batch_id))
        stage(store, 4, "crashed", ROWS)  # no marker: the driver died here
        assert store.flush(10)
        assert store.read(lambda con: con.execute("SELECT count(*) FROM late_rows").fetchone()) == (
            0,
        )
        stage(store, 4, "retry", ROWS[:1])
        write(store, 4, BatchLateRows(total=1_000, attempt="retry", staged=1))
        assert store.flush(10)
        kept = store.read(
            lambda con: con.execute("SELECT row_data::VARCHAR FROM late_rows").fetchall()
        )
        left = store.read(
            lambda con: con.execute("SELECT count(*) FROM late_rows_pending").fetchone()
        )
        marks = store.read(
            lambda con: con.execute(
                "SELECT late_rows, rows_kept, rows_over_cap, overflow_location FROM audit_batches"
            ).fetchall()
        )
    assert kept == [('{"id":5}',)]
    assert left == (0,)
    assert marks == [(1_000, 1, 999, None)]
    with open_history(path) as con:
        doc = report_dict(build_report(con, db=str(path), now=datetime(2026, 1, 2, tzinfo=UTC)))
    section = next(q for q in doc["queries"] if q["query"] == "clicks")["late_rows"]
    assert (section["late_rows"], section["late_rows_kept"], section["late_rows_not_kept"]) == (
        1_000,
        1,
        999,
    )
    assert section["batches_over_cap"] == 1


def test_batch_zero_marker_has_no_watermark(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h.duckdb") as store:
        write(store, 0, BatchLateRows.nothing(), wm_s=None)
        assert store.flush(10)
        marks = store.read(
            lambda con: con.execute(
                "SELECT batch_id, late_watermark_at FROM audit_batches"
            ).fetchall()
        )
    assert marks == [(0, None)]


def test_report_reads_duckdb_and_parquet_audit_rows(tmp_path: Path) -> None:
    path = tmp_path / "h.duckdb"
    parquet_dir = tmp_path / "late" / "q-1" / "batch-000000000005"
    parquet_dir.mkdir(parents=True)
    # what the Parquet sink writes for one batch: instants as integer microseconds
    pq.write_table(
        pa.table(
            {
                "query_id": ["q-1"],
                "query_name": ["clicks"],
                "run_id": ["run-1"],
                "batch_id": pa.array([5], pa.int64()),
                "event_time_us": pa.array([(T + 21) * US], pa.int64()),
                "watermark_us": pa.array([(T + 40) * US], pa.int64()),
                "lateness_seconds": [19.0],
                "window_start_us": pa.array([(T + 20) * US], pa.int64()),
                "window_end_us": pa.array([(T + 30) * US], pa.int64()),
                "operator_kind": ["window"],
                "source_file": ["/in/c.json"],
                "row_data": ['{"id":11}'],
                "audited_at_us": pa.array([T * US], pa.int64()),
            }
        ),
        parquet_dir / "part-0.parquet",
    )
    with HistoryStore(path) as store:
        for batch_id in range(6):
            store.record_progress(progress(batch_id))
        write(store, 4, BatchLateRows(total=3, rows=list(ROWS)))
        write(
            store, 5, BatchLateRows.all_in_parquet(1, str(parquet_dir)), wm_s=T + 40, sink="parquet"
        )
    with open_history(path) as con:
        doc = report_dict(build_report(con, db=str(path), now=datetime(2026, 1, 2, tzinfo=UTC)))
    section = next(q for q in doc["queries"] if q["query"] == "clicks")["late_rows"]
    assert section["late_rows"] == 4
    assert section["audited_batches"] == 2
    assert {s["source_file"] for s in section["top_sources"]} == {
        "/in/a.json",
        "/in/b.json",
        "/in/c.json",
    }
    assert section["lateness_max_seconds"] == 22.0
    # needed extra delays (watermark - window end): 15, 15, 5, 10 s -> 16 s keeps them all;
    # 10 s tumbling windows -> 2 more windows per key
    assert section["state_advice"] == (
        "a watermark delay of 16s more would have kept about 99% of these rows; "
        "state would hold about 2 more windows per key"
    )


def test_parquet_column_mapping() -> None:
    present = {"query_id", "event_time_us"}
    assert parquet_late_column("query_id", present) == "query_id"
    assert "to_microseconds(event_time_us)" in parquet_late_column("event_time_at", present)
    assert parquet_late_column("window_end_at", present) == "NULL AS window_end_at"


def test_delay_advice_rules() -> None:
    assert window_grid([(0, 10), (5, 15), (20, 30)]) == WindowGrid(10, 5)
    assert window_grid([(0, 60)]) == WindowGrid(60, 60)
    assert window_grid([]) is None
    assert extra_windows_in_state(16, 5) == 4
    # a row needing N seconds is kept only by a delay strictly larger than N
    assert state_advice_from_quantile(9.5, WindowGrid(10, 5)) == (
        "a watermark delay of 10s more would have kept about 99% of these rows; "
        "state would hold about 2 more windows per key"
    )
    assert state_advice_from_quantile(9.0, None) == (
        "a watermark delay of 10s more would have kept about 99% of these rows; "
        "state would keep each key about 10s longer"
    )
    assert state_advice_from_quantile(None, None) is None
    assert state_advice_from_quantile(59.2, WindowGrid(60, 60)) == (
        "a watermark delay of 1m more would have kept about 99% of these rows; "
        "state would hold about 1 more window per key"
    )
