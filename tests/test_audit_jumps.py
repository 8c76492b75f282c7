"""Who moved the watermark, without a JVM: the detection per batch, the incident it records and
the rows the jump cost, through a real checkpoint folder, the real HistoryStore (DuckDB file)
and the real report renderers. The Spark side (reading the rows again) is proven in
``test_audit_jumps_spark.py``; here the rows come from a plain function.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tests.harness.handmade import progress
from wmwatch._audit.jumps.rules import (
    BatchTimes,
    Thresholds,
    TopRow,
    ahead_seconds,
    flags,
    jump_seconds,
    kafka_position,
    top_rows_of,
)
from wmwatch._audit.jumps.table import JumpHistory
from wmwatch._audit.jumps.watch import JumpWatch
from wmwatch._audit.sinks import BatchLateRows, _batch_writer
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch._errors import ConfigError
from wmwatch._report.build import build_report
from wmwatch._report.reading import open_history
from wmwatch._report.render import render_csv, render_table, report_dict
from wmwatch._store.writer import HistoryStore

T_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
S = 1000
H = 3600 * S
US = 1000  # microseconds per millisecond


def test_thresholds_refuse_what_is_not_a_positive_duration() -> None:
    with pytest.raises(ConfigError, match=r"watermark_ahead_seconds=0: pass a positive"):
        Thresholds(ahead_seconds=0)
    with pytest.raises(ConfigError, match="watermark_jump_seconds=nan"):
        Thresholds(jump_seconds=float("nan"))
    assert Thresholds() == Thresholds(ahead_seconds=600.0, jump_seconds=3600.0)


def test_a_batch_is_flagged_ahead_of_its_time_or_for_a_jump() -> None:
    t = Thresholds()
    six_hours = BatchTimes(batch_at_ms=T_MS, event_time_max_ms=T_MS + 6 * H)
    behind = BatchTimes(batch_at_ms=T_MS, event_time_max_ms=T_MS - 30 * S)
    skewed = BatchTimes(batch_at_ms=T_MS, event_time_max_ms=T_MS + 9 * 60 * S)
    assert ahead_seconds(six_hours) == 6 * 3600
    assert flags(ahead_seconds(six_hours), None, t) == (True, False)
    assert flags(ahead_seconds(behind), None, t) == (False, False)
    assert flags(ahead_seconds(skewed), None, t) == (False, False)  # 9 min: clock skew
    assert ahead_seconds(BatchTimes(batch_at_ms=T_MS, event_time_max_ms=None)) is None
    # the first watermark is set from the epoch: no jump
    assert jump_seconds(T_MS, 0) is None
    assert flags(None, jump_seconds(T_MS + 2 * H, T_MS), t) == (False, True)
    assert flags(None, jump_seconds(T_MS + H // 2, T_MS), t) == (False, False)


def test_top_rows_are_newest_first_and_carry_their_kafka_position() -> None:
    rows = [
        (5 * US, 0, None, '{"id":1}', '{"topic":"t","partition":2,"offset":14}'),
        (9 * US, 1, "/in/a.json", '{"id":2}', None),
        (None, 0, None, '{"id":3}', None),
        (7 * US, 0, None, '{"id":4}', "not json"),
    ]
    top = top_rows_of(rows, limit=3)
    assert [(r.rank, r.row_data) for r in top] == [
        (1, '{"id":2}'),
        (2, '{"id":4}'),
        (3, '{"id":1}'),
    ]
    assert (top[2].kafka_topic, top[2].kafka_partition, top[2].kafka_offset) == ("t", 2, 14)
    assert top[1].kafka_partition is None
    assert kafka_position(None) == (None, None, None)


def write_offsets(folder: Path, batch_id: int, watermark_ms: int, timestamp_ms: int) -> None:
    (folder / "offsets").mkdir(parents=True, exist_ok=True)
    (folder / "commits").mkdir(parents=True, exist_ok=True)
    meta = {"batchWatermarkMs": watermark_ms, "batchTimestampMs": timestamp_ms, "conf": {}}
    (folder / "offsets" / str(batch_id)).write_text(
        f'v1\n{json.dumps(meta)}\n{{"logOffset":{batch_id}}}\n'
    )
    (folder / "commits" / str(batch_id)).write_text(
        f'v1\n{{"nextBatchWatermarkMs":{watermark_ms}}}\n'
    )


def late_row(event_ms: int) -> tuple[Any, ...]:
    return (
        event_ms * US,
        None,
        None,
        "/in/b.json",
        f'{{"ts":{event_ms}}}',
        "dedupe",
        0,
        None,
        0,
        None,
    )


DELAY = 60 * S
POISON_MS = T_MS + 20 * S + 6 * H


def run_batches(store: HistoryStore, checkpoint: Path, reads: list[int]) -> JumpWatch:
    """Six batches of a dedupe over files: batch 2 reads a row dated 6 hours ahead, so
    offsets/3 holds a watermark 6 hours up; batches 4 and 5 drop ordinary rows."""
    watermarks = [
        0,
        T_MS - DELAY,
        T_MS - 50 * S,
        POISON_MS - DELAY,
        POISON_MS - DELAY,
        POISON_MS - DELAY,
    ]
    late = {4: [T_MS + 5 * S, T_MS + 15 * S, T_MS - 100 * S], 5: [T_MS + 25 * S]}
    history = JumpHistory(store, query_id="q-1", query_name="clicks", label="clicks")
    watch = JumpWatch(thresholds=Thresholds(), history=history, label="clicks")
    watch.start()
    reader = CheckpointReader(str(checkpoint))

    def read_top(batch_id: int) -> tuple[tuple[TopRow, ...], int | None]:
        reads.append(batch_id)
        rows = top_rows_of(
            [
                (POISON_MS * US, 0, "/in/poison.json", '{"id":99}', None),
                ((T_MS + 19 * S) * US, 0, "/in/poison.json", '{"id":98}', None),
            ]
        )
        return rows, 0

    for batch_id, wm in enumerate(watermarks):
        at = T_MS + 10 * S * batch_id
        write_offsets(checkpoint, batch_id, wm, at)
        top = POISON_MS if batch_id == 2 else at - 30 * S
        watch.note(batch_id, BatchTimes(at, top, ("FileStreamSource[file:/in]",)))
        rows = [late_row(ms) for ms in late.get(batch_id, [])]
        # the auditor's order: the jump check, the batch's rows and marker, then the cost
        watch.after_batch(batch_id, "run-1", reader, read_top)
        store.submit(
            _batch_writer(
                query_id="q-1",
                query_name="clicks",
                run_id="run-1",
                batch_id=batch_id,
                late_wm_ms=watermarks[batch_id - 1] if batch_id else None,
                found=BatchLateRows(total=len(rows), rows=rows),
                sink="duckdb",
            ),
            description="test batch",
        )
        store.record_progress(progress(batch_id))
        watch.after_recorded(batch_id, reader)
    return watch


def test_the_batch_that_moved_the_watermark_and_its_cost(tmp_path: Path) -> None:
    reads: list[int] = []
    db = tmp_path / "h.duckdb"
    with HistoryStore(db) as store:
        watch = run_batches(store, tmp_path / "checkpoint", reads)
        assert store.flush(10)
        got = store.read(
            lambda con: con.execute(
                "SELECT batch_id, reasons, jump_batch_id, ahead_seconds, jump_seconds, "
                "epoch_ms(watermark_before_at), epoch_ms(watermark_after_at), source_index, "
                "source_description, rows_dropped_since, counted_through_batch "
                "FROM watermark_jumps"
            ).fetchall()
        )
        rows = store.read(
            lambda con: con.execute(
                "SELECT row_rank, epoch_ms(event_time_at), source_file, row_data::VARCHAR "
                "FROM watermark_jump_rows ORDER BY row_rank"
            ).fetchall()
        )
    # flagged twice (ahead in batch 2, the jump in batch 3), recorded once, read once
    assert reads == [2]
    assert watch.status() == {"watermark_incidents": 1, "last_watermark_incident_batch": 2}
    jump = (POISON_MS - DELAY - (T_MS - 50 * S)) / 1000
    assert got == [
        (2, "ahead,jump", 3, 6 * 3600.0, jump, T_MS - 50 * S, POISON_MS - DELAY, 0,
         "FileStreamSource[file:/in]", 3, 5)
    ]  # fmt: skip
    # batch 4's row 100 s behind was late before the jump too: not its cost
    assert rows[0] == (1, POISON_MS, "/in/poison.json", '{"id":99}')
    assert len(rows) == 2

    # the report names the row, the batch and the cost, in every format
    with open_history(db) as con:
        report = build_report(con, db=str(db))
    doc = report_dict(report)
    incident = doc["queries"][0]["watermark_jumps"]["incidents"][0]
    assert incident["batch_id"] == 2 and incident["rows_dropped_since"] == 3
    assert incident["rows"][0]["row_data"] == '{"id":99}'
    assert incident["summary"].startswith(
        'the watermark was moved by {"id":99} (event time 2026-01-01 06:00:20 UTC; input 0, '
        "/in/poison.json) in batch 2 at 2026-01-01 00:00:20 UTC"
    )
    assert incident["summary"].endswith("it dropped 3 rows since")
    csv_text = render_csv(report)
    header, line = csv_text.splitlines()[:2]
    assert "watermark_jump_rows_dropped" in header.split(",")
    assert ",1,3," in line and "it dropped 3 rows since" in line
    out = io.StringIO()
    render_table(report, Console(file=out, width=300, color_system=None))
    assert "who moved the watermark" in out.getvalue()
    assert "it dropped 3 rows since" in out.getvalue()


def test_a_restarted_audit_keeps_counting_and_keeps_the_rows(tmp_path: Path) -> None:
    """The incident taken up from the history (without its rows) keeps them, and its cost
    goes on with the batches the new audit writes."""
    reads: list[int] = []
    db = tmp_path / "h.duckdb"
    with HistoryStore(db) as store:
        run_batches(store, tmp_path / "checkpoint", reads)
        assert store.flush(10)
        history = JumpHistory(store, query_id="q-1", query_name="clicks", label="clicks")
        again = JumpWatch(thresholds=Thresholds(), history=history, label="clicks")
        again.start()
        assert [i.batch_id for i in again.incidents()] == [2]
        reader = CheckpointReader(str(tmp_path / "checkpoint"))
        write_offsets(tmp_path / "checkpoint", 6, POISON_MS - DELAY, T_MS + 60 * S)
        rows = [late_row(T_MS + 40 * S)]
        store.submit(
            _batch_writer(
                query_id="q-1",
                query_name="clicks",
                run_id="run-2",
                batch_id=6,
                late_wm_ms=POISON_MS - DELAY,
                found=BatchLateRows(total=1, rows=rows),
                sink="duckdb",
            ),
            description="test batch",
        )
        again.after_batch(6, "run-2", reader, lambda b: pytest.fail("nothing new to read"))
        again.after_recorded(6, reader)
        assert store.flush(10)
        got = store.read(
            lambda con: con.execute(
                "SELECT rows_dropped_since, counted_through_batch, "
                "(SELECT count(*) FROM watermark_jump_rows) FROM watermark_jumps"
            ).fetchall()
        )
    assert got == [(4, 6, 2)]


def test_rows_that_cannot_be_read_leave_the_incident_with_the_reason(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    write_offsets(checkpoint, 0, T_MS, T_MS)
    watch = JumpWatch(thresholds=Thresholds(), history=None, label="clicks")
    watch.note(0, BatchTimes(T_MS, T_MS + 2 * H))

    def broken(batch_id: int) -> tuple[tuple[TopRow, ...], int | None]:
        raise OSError("the input file is gone")

    watch.after_batch(0, None, CheckpointReader(str(checkpoint)), broken)
    (incident,) = watch.incidents()
    assert incident.rows == () and incident.rows_error == "OSError: the input file is gone"
    assert incident.ahead_seconds == 2 * 3600


def test_the_cost_stops_once_the_clock_passes_the_watermark_the_jump_set(tmp_path: Path) -> None:
    """Six hours on, rows that late would be late without the jump: they are not its cost."""
    reads: list[int] = []
    with HistoryStore(tmp_path / "h.duckdb") as store:
        watch = run_batches(store, tmp_path / "checkpoint", reads)
        checkpoint = tmp_path / "checkpoint"
        write_offsets(checkpoint, 6, POISON_MS - DELAY, POISON_MS + H)
        store.submit(
            _batch_writer(
                query_id="q-1",
                query_name="clicks",
                run_id="run-1",
                batch_id=6,
                late_wm_ms=POISON_MS - DELAY,
                found=BatchLateRows(total=1, rows=[late_row(T_MS + 40 * S)]),
                sink="duckdb",
            ),
            description="test batch",
        )
        watch.after_batch(6, "run-1", CheckpointReader(str(checkpoint)), lambda b: ((), None))
        watch.after_recorded(6, CheckpointReader(str(checkpoint)))
        assert store.flush(10)
        got = store.read(
            lambda con: con.execute(
                "SELECT rows_dropped_since, counted_through_batch FROM watermark_jumps"
            ).fetchall()
        )
    assert got == [(3, 5)]


def test_rows_a_sliding_window_repeated_count_once() -> None:
    from wmwatch._audit.jumps.rules import distinct_rows

    row = (5, 0, "/in/a.json", '{"id": 1}', None)
    other = (4, 0, "/in/a.json", '{"id": 2}', None)
    assert distinct_rows([row, row, row, other, other]) == [row, other]


def test_a_poison_dated_2100_adds_each_batch_to_the_cost_once(tmp_path: Path) -> None:
    """A row dated 2100 keeps the incident costing for good: each later batch adds its own late
    rows to the count and never reads the earlier batches' again, so the work per batch stays
    one batch's, and rows the history's retention removed since stay counted."""
    far_ms = 4_102_444_800_000  # 2100-01-01T00:00:00Z
    checkpoint = tmp_path / "checkpoint"
    reader = CheckpointReader(str(checkpoint))
    with HistoryStore(tmp_path / "h.duckdb") as store:
        history = JumpHistory(store, query_id="q-1", query_name="clicks", label="clicks")
        watch = JumpWatch(thresholds=Thresholds(), history=history, label="clicks")
        watch.start()
        watermarks = {0: 0, 1: T_MS - DELAY, 2: T_MS - 50 * S}

        def batch(batch_id: int) -> None:
            at = T_MS + 10 * S * batch_id
            wm = watermarks.get(batch_id, far_ms - DELAY)
            write_offsets(checkpoint, batch_id, wm, at)
            watch.note(batch_id, BatchTimes(at, far_ms if batch_id == 2 else at - 30 * S))
            rows = [late_row(at), late_row(at + S)] if batch_id > 3 else []
            watch.after_batch(batch_id, "run-1", reader, lambda b: ((), None))
            store.submit(
                _batch_writer(
                    query_id="q-1",
                    query_name="clicks",
                    run_id="run-1",
                    batch_id=batch_id,
                    late_wm_ms=watermarks.get(batch_id - 1, far_ms - DELAY) if batch_id else None,
                    found=BatchLateRows(total=len(rows), rows=rows),
                    sink="duckdb",
                ),
                description="test batch",
            )
            watch.after_recorded(batch_id, reader)

        def cost() -> tuple[int, int]:
            assert store.flush(120)  # a guard against a hang only
            got = store.read(
                lambda con: con.execute(
                    "SELECT rows_dropped_since, counted_through_batch FROM watermark_jumps"
                ).fetchall()
            )
            assert len(got) == 1
            return got[0]

        for batch_id in range(21):
            batch(batch_id)
        assert cost() == (2 * 17, 20)  # batches 4 to 20, two rows each
        # the history's retention removes the late rows of the older batches
        store.submit(
            lambda con: con.execute("DELETE FROM late_rows WHERE batch_id <= 15"),
            description="retention",
        )
        batch(21)
        assert cost() == (2 * 18, 21)
