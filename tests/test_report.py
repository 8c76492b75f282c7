"""The report's queries and rendering over real history files written by the real store."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest
from rich.console import Console
from typer.testing import CliRunner

from tests.harness.handmade import REPO, T0, progress
from wmwatch._audit.report.advice import watermark_delay_advice
from wmwatch._errors import UnknownQueryError
from wmwatch._events import parse_terminated
from wmwatch._report.build import build_report, parse_since
from wmwatch._report.reading import open_history
from wmwatch._report.render import render_csv, render_json, render_table, report_dict
from wmwatch._report.sections import SECTIONS
from wmwatch._section import Section
from wmwatch._store.writer import HistoryStore, open_readonly
from wmwatch._time import format_duration
from wmwatch.cli import app

NOW = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("15m", NOW - timedelta(minutes=15)),
        ("2h", NOW - timedelta(hours=2)),
        ("7d", NOW - timedelta(days=7)),
        ("1h30m", NOW - timedelta(minutes=90)),
        ("90s", NOW - timedelta(seconds=90)),
        ("2026-02-01", datetime(2026, 2, 1, tzinfo=UTC)),
        ("2026-02-01T08:30:00Z", datetime(2026, 2, 1, 8, 30, tzinfo=UTC)),
        ("2026-02-01T10:30:00+02:00", datetime(2026, 2, 1, 8, 30, tzinfo=UTC)),
    ],
)
def test_parse_since_accepts_durations_and_iso_times(text: str, expected: datetime) -> None:
    assert parse_since(text, now=NOW) == expected


@pytest.mark.parametrize("text", ["yesterday", "15", "m15", "2026-13-01", "", "-5m"])
def test_parse_since_rejects_anything_else_with_a_clear_message(text: str) -> None:
    with pytest.raises(
        ValueError, match=r"neither a duration \(15m, 2h, 7d\) nor an ISO timestamp"
    ):
        parse_since(text, now=NOW)


def test_format_duration() -> None:
    assert [format_duration(s) for s in (None, 0.25, 12.34, 75, 7260, 90_000)] == [
        "-",
        "250ms",
        "12.3s",
        "1m 15s",
        "2h 1m",
        "1d 1h",
    ]


def test_advice_names_the_delay_that_would_have_kept_the_rows() -> None:
    advice = watermark_delay_advice(60.0, 30.0, 90.0)
    assert advice is not None
    assert "about 1m 30s (now ~1m 0s) would have kept 95%" in advice
    assert "2m 30s 99%" in advice
    assert watermark_delay_advice(None, None, None) is None


@pytest.fixture
def history(tmp_path: Path) -> Path:
    """Two queries: 'clicks' (6 batches, drops, failed at the end) and an unnamed one."""
    path = tmp_path / "history.duckdb"
    with HistoryStore(path) as store:
        for batch_id in range(6):
            store.record_progress(
                progress(batch_id, input_rows=100, dropped=2 if batch_id == 4 else 0)
            )
        store.record_query_terminated(
            parse_terminated(
                {
                    "id": "q-1",
                    "runId": "run-1",
                    "exception": "boom\nat line",
                    "errorClassOnException": "X",
                }
            )
        )
        for batch_id in range(3):
            store.record_progress(
                progress(batch_id, query_id="q-2", run_id="run-9", name=None, operators=0)
            )
    return path


def report_for(path: Path, **kwargs: Any) -> dict[str, Any]:
    with open_history(path) as con:
        return report_dict(build_report(con, db=str(path), **kwargs))


def test_core_summary_per_query(history: Path) -> None:
    doc = report_for(history)
    by_name = {q["query"]: q for q in doc["queries"]}
    assert set(by_name) == {"clicks", "q-2"}
    clicks = by_name["clicks"]
    assert clicks["status"] == "failed" and clicks["error_class"] == "X"
    assert clicks["exception"] == "boom"
    assert clicks["batches"] == 6 and (clicks["first_batch_id"], clicks["last_batch_id"]) == (0, 5)
    assert clicks["first_batch_at"] == "2026-01-01T00:00:00Z"
    assert clicks["last_batch_at"] == "2026-01-01T00:00:50Z"
    assert clicks["watermark_lag_p50_seconds"] == 60.0
    assert clicks["watermark_lag_max_seconds"] == 60.0
    assert clicks["input_rows"] == 600
    assert clicks["rows_dropped_by_watermark"] == 2
    assert clicks["drops_count_groups"] is True
    assert "groups" in clicks["rows_dropped_note"]
    assert (clicks["state_rows_first"], clicks["state_rows_last"], clicks["state_rows_growth"]) == (
        100,
        105,
        5,
    )
    assert clicks["state_rows_growth_per_hour"] == pytest.approx(5 / (50 / 3600))
    assert clicks["state_memory_bytes_last"] == 4096
    assert clicks["operators"] == [
        {
            "operator_id": 0,
            "operator_name": "stateStoreSave",
            "rows_dropped_by_watermark": 2,
            "state_rows_last": 105,
            "state_memory_bytes_last": 4096,
        }
    ]
    assert clicks["late_rows"] is None and clicks["findings"] is None
    unnamed = by_name["q-2"]
    assert unnamed["status"] == "active" and unnamed["batches"] == 3
    assert unnamed["rows_dropped_by_watermark"] is None and unnamed["state_rows_last"] is None


def test_query_and_since_filters(history: Path) -> None:
    doc = report_for(history, query="q-1", since_at=T0 + timedelta(seconds=30))
    (only,) = doc["queries"]
    assert only["query"] == "clicks"
    assert (only["batches"], only["first_batch_id"], only["input_rows"]) == (3, 3, 300)
    assert doc["since"] == "2026-01-01T00:00:30Z"
    with pytest.raises(UnknownQueryError, match=r"'nope'.*known: clicks, q-2"):
        report_for(history, query="nope")


def _add_audit(path: Path, parquet_dir: Path) -> None:
    con = duckdb.connect(str(path))
    try:
        con.execute("SET TimeZone = 'UTC'")
        wm = "2026-01-01 00:00:00+00"
        con.execute(
            f"""
            INSERT INTO late_rows (query_id, batch_id, event_time_at, watermark_at,
                                   lateness_seconds, window_start_at, window_end_at,
                                   operator_kind, source_file, audited_at)
            SELECT 'q-1', 4, TIMESTAMPTZ '{wm}' - to_seconds(l), TIMESTAMPTZ '{wm}', l,
                   TIMESTAMPTZ '{wm}' - INTERVAL 2 MINUTE, TIMESTAMPTZ '{wm}' - INTERVAL 1 MINUTE,
                   'window', 'file:///in/a.json', now()
            FROM (VALUES (70.0), (80.0), (90.0)) t(l)
            """
        )
        parquet_dir.mkdir(parents=True)
        con.execute(
            f"""
            COPY (SELECT 'q-1' AS query_id, 5::BIGINT AS batch_id,
                         TIMESTAMPTZ '{wm}' - INTERVAL 2 HOUR AS event_time_at,
                         TIMESTAMPTZ '{wm}' AS watermark_at, 7200.0 AS lateness_seconds,
                         'file:///in/b.json' AS source_file, 'extra' AS some_audit_column)
            TO '{parquet_dir / "part-0.parquet"}' (FORMAT parquet)
            """
        )
        con.execute(
            "INSERT INTO audit_batches (query_id, batch_id, run_id, late_watermark_at, "
            "late_rows, sink, location, audited_at) "
            "VALUES ('q-1', 4, 'run-1', NULL, 3, 'duckdb', NULL, now()), "
            "('q-1', 5, 'run-1', NULL, 1, 'parquet', ?, now()), "
            "('q-1', 6, 'run-1', NULL, 1, 'parquet', ?, now())",
            (f"file://{parquet_dir}", str(parquet_dir.parent / "batch-000000000006")),
        )
        con.execute(
            """
            INSERT INTO findings (finding_id, query_id, query_name, operator_id, side, kind,
                                  severity, status, message, evidence, fix, first_seen_at,
                                  last_seen_at, first_batch_id, last_batch_id, occurrences)
            VALUES
              ('f1', 'q-1', 'clicks', 0, 'left', 'join_state_unbounded', 'critical', 'active',
               'left state grows every batch', '{}', 'add a time-range condition', now(), now(),
               1, 5, 5),
              ('f2', 'q-1', 'clicks', NULL, NULL, 'watermark_stalled', 'warning', 'resolved',
               'old', '{}', NULL, now(), now(), 1, 2, 1)
            """
        )
    finally:
        con.close()


def test_late_rows_from_duckdb_and_parquet_and_active_findings(
    history: Path, tmp_path: Path
) -> None:
    _add_audit(history, tmp_path / "late" / "q-1" / "batch-000000000005")
    doc = report_for(history)
    clicks = next(q for q in doc["queries"] if q["query"] == "clicks")
    late = clicks["late_rows"]
    assert late["late_rows"] == 4 and late["batches_with_late_rows"] == 2
    assert late["audited_batches"] == 3
    assert late["lateness_histogram"]["1-10m"] == 3 and late["lateness_histogram"][">= 1h"] == 1
    assert late["lateness_max_seconds"] == 7200.0
    assert late["top_batches"][0] == {"batch_id": 4, "late_rows": 3}
    assert late["top_windows"] == [
        {
            "window_start_at": "2025-12-31T23:58:00Z",
            "window_end_at": "2025-12-31T23:59:00Z",
            "late_rows": 3,
        }
    ]
    assert late["top_sources"][0] == {"source_file": "file:///in/a.json", "late_rows": 3}
    assert late["missing_parquet_locations"] == 1
    # window rows needed the watermark to wait 60 s more (watermark - window end)
    assert late["extra_delay_p95_seconds"] is not None and late["advice"].startswith(
        "a watermark delay"
    )
    # the row without a window needed its lateness: 2 h
    assert late["extra_delay_max_seconds"] == 7200.0
    (finding,) = clicks["findings"]
    assert finding["kind"] == "join_state_unbounded" and finding["severity"] == "critical"
    other = next(q for q in doc["queries"] if q["query"] == "q-2")
    assert other["late_rows"] is None and other["findings"] is None

    with open_history(history) as con:
        report = build_report(con, db=str(history))
    console = Console(file=io.StringIO(), width=120, color_system=None)
    render_table(report, console)
    text = console.file.getvalue()  # type: ignore[attr-defined]  # a StringIO console
    assert "late rows audited" in text and "join_state_unbounded" in text
    assert "Parquet audit folders listed in audit_batches are gone" in text
    table = list(csv.DictReader(io.StringIO(render_csv(report))))
    clicks_row = next(r for r in table if r["query"] == "clicks")
    assert clicks_row["late_rows"] == "4" and clicks_row["findings_critical"] == "1"
    assert next(r for r in table if r["query"] == "q-2")["late_rows"] == "0"


def test_an_added_section_shows_up_everywhere(history: Path) -> None:
    def load(con: duckdb.DuckDBPyConnection, scope: Any) -> dict[str, Any]:
        got = con.execute(
            "SELECT query_id, count(*) FROM sources "
            "WHERE query_id IN (SELECT unnest($1::VARCHAR[])) GROUP BY 1",
            (list(scope.query_ids),),
        ).fetchall()
        return {qid: {"sources_seen": n} for qid, n in got}

    section = Section(
        key="source_check",
        title="sources",
        load=load,
        render=lambda data: f"sources seen: {data['sources_seen']}",
        csv_columns=("sources_seen",),
        csv_values=lambda data: {"sources_seen": data["sources_seen"] if data else 0},
    )
    with open_readonly(history) as con:
        report = build_report(con, db=str(history), sections=(*SECTIONS, section))
    assert json.loads(render_json(report))["queries"][0]["source_check"] == {"sources_seen": 6}
    assert "sources_seen" in render_csv(report).splitlines()[0]


@pytest.fixture
def busy_store(tmp_path: Path) -> Iterator[HistoryStore]:
    """A store whose writer flushes continuously, as a busy job's would."""
    store = HistoryStore(tmp_path / "live.duckdb", flush_interval_seconds=0.01).start()
    stop = threading.Event()

    def produce() -> None:
        batch_id = 0
        while not stop.is_set():
            store.record_progress(progress(batch_id, at=datetime.now(UTC)))
            batch_id += 1
            time.sleep(0.005)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    try:
        assert store.flush(timeout=10)
        yield store
    finally:
        stop.set()
        producer.join(5)
        store.close()


def test_report_works_while_the_writer_is_active(busy_store: HistoryStore) -> None:
    runner = CliRunner()
    seen: list[int] = []
    for _ in range(5):
        # A generous --timeout: on a loaded CI machine each flush holds the file longer.
        result = runner.invoke(
            app, ["report", "--db", str(busy_store.path), "--format", "json", "--timeout", "30"]
        )
        assert result.exit_code == 0, result.output
        seen.append(json.loads(result.stdout)["queries"][0]["batches"])
    # Another process reading, as `wmwatch report` from a shell would.
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "wmwatch.cli",
            "report",
            "--db",
            str(busy_store.path),
            "--format",
            "csv",
            "--timeout",
            "30",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    rows = list(csv.DictReader(io.StringIO(done.stdout)))
    assert int(rows[0]["batches"]) >= seen[-1]
    assert seen == sorted(seen) and seen[-1] > seen[0]
    health = busy_store.health
    assert health.up and health.errors_total == 0 and health.dropped_total == 0
