"""Kill the driver with SIGKILL in the middle of an audited stream, restart it on the same
checkpoints: the audit table still balances against the query's output, with no duplicates."""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests.harness.audited import late_rows
from tests.harness.checks import assert_windows_balance, batch_window_counts
from tests.harness.crash import (
    ensure_stopped,
    finish,
    sigkill,
    start_driver,
    status_lines,
    wait_for_status,
)
from tests.harness.joins import PAIRS, write_pair
from tests.harness.streams import stream_files, write_events
from wmwatch._checkpoint.reader import CheckpointReader

pytestmark = [pytest.mark.spark, pytest.mark.slow]

DRIVER = "tests.audit_crash_driver"


def _committed_batch_reading(
    checkpoint: Path, written: Path, proc: subprocess.Popen[str], source_index: int = 0
) -> int:
    """Wait until a committed batch of the query read ``written``; that batch's id."""
    deadline = time.monotonic() + 240  # guards against a hang only
    while True:
        assert proc.poll() is None, "the driver stopped before committing the new file"
        reader = CheckpointReader(str(checkpoint))
        for batch_id in reversed(reader.committed_batches()):
            files = reader.batch_files(batch_id, source_index)
            if any(Path(f.path).name == written.name for f in files):
                return batch_id
        assert time.monotonic() < deadline, f"no committed batch read {written.name}"
        time.sleep(0.05)


def _kill_after_commit(
    folder: Path,
    shape: str,
    write_more: Callable[[], Path],
    checkpoint: Path,
    *,
    audited: int,
    source_index: int = 0,
) -> None:
    """Run the driver until ``audited`` batches are audited, write one more file, and SIGKILL
    it right after a committed batch read that file: the audit of that batch may not have
    started, be under way or be written; each must end balanced after the restart."""
    first = start_driver(DRIVER, str(folder), "run", shape)
    try:
        wait_for_status(status_lines(first), lambda status: status["batches_audited"] >= audited)
        written = write_more()
        _committed_batch_reading(checkpoint, written, first, source_index)
        sigkill(first)
    finally:
        ensure_stopped(first)


@pytest.mark.slow(minutes=2.2)
def test_sigkill_mid_stream_then_restart_balances(spark: Any, stream_dir: Path) -> None:
    files = stream_files()
    for f in files[:3]:
        write_events(stream_dir / "in", f)
    _kill_after_commit(
        stream_dir,
        "window",
        lambda: write_events(stream_dir / "in", files[3]),
        stream_dir / "checkpoint",
        audited=2,
    )
    written = 4
    with duckdb.connect(str(stream_dir / "history.duckdb"), read_only=True) as con:
        marked_at_kill = {
            r[0] for r in con.execute("SELECT batch_id FROM audit_batches").fetchall()
        }
    for f in files[written:]:
        write_events(stream_dir / "in", f)
    finished = finish(DRIVER, str(stream_dir), "finish", "window")
    committed = CheckpointReader(str(stream_dir / "checkpoint")).committed_batches()
    # the restarted audit resumed after what the killed one had written, and redid nothing else
    assert finished["batches_audited"] == len(set(committed) - marked_at_kill) > 0

    late = late_rows(stream_dir / "history.duckdb")
    with duckdb.connect(str(stream_dir / "history.duckdb"), read_only=True) as con:
        marks = dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())
    assert len(late) == len(set(late)), "duplicated audit rows"
    assert sorted(marks) == CheckpointReader(str(stream_dir / "checkpoint")).committed_batches()
    assert Counter(r[0] for r in late) == Counter({b: n for b, n in marks.items() if n})
    output = [
        r.asDict(recursive=True) for r in spark.read.parquet(str(stream_dir / "out")).collect()
    ]
    reader = CheckpointReader(str(stream_dir / "checkpoint"))
    last = reader.committed_batches()[-1]
    last_offsets = reader.offsets(last)
    assert last_offsets is not None
    # windows ending at or before the last batch's watermark have been emitted or dropped
    expected = batch_window_counts(spark, stream_dir, "10 seconds", "10 seconds")
    assert_windows_balance(expected, output, late, last_offsets.watermark_ms)


@pytest.mark.slow(minutes=2.2)
def test_sigkill_mid_join_then_restart_balances(spark: Any, stream_dir: Path) -> None:
    """The same for a stream-stream join: per side, every late row once, and every batch whose
    progress reached the history (a batch the kill interrupted before its progress was posted
    has no count from Spark) has exactly as many late rows as Spark counted."""
    (stream_dir / "l").mkdir()
    (stream_dir / "r").mkdir()
    for index in range(2):
        write_pair(stream_dir, index)
    _kill_after_commit(
        stream_dir, "join", lambda: write_pair(stream_dir, 2), stream_dir / "checkpoint", audited=1
    )
    for index in range(3, len(PAIRS)):
        write_pair(stream_dir, index)
    finish(DRIVER, str(stream_dir), "finish", "join")
    with duckdb.connect(str(stream_dir / "history.duckdb"), read_only=True) as con:
        late = con.execute(
            "SELECT batch_id, join_side, row_data::VARCHAR FROM late_rows"
        ).fetchall()
        dropped = dict(
            con.execute(
                "SELECT batch_id, sum(rows_dropped_by_watermark) FROM operators "
                "WHERE rows_dropped_by_watermark IS NOT NULL GROUP BY batch_id"
            ).fetchall()
        )
        marks = sorted(r[0] for r in con.execute("SELECT batch_id FROM audit_batches").fetchall())
    assert marks == CheckpointReader(str(stream_dir / "checkpoint")).committed_batches()
    ids = [json.loads(data)["lid" if side == "left" else "rid"] for _, side, data in late]
    assert len(ids) == len(set(ids)), "duplicated audit rows"
    assert {side for _, side, _ in late} == {"left", "right"}
    per_batch = Counter(batch for batch, _, _ in late)
    assert sum(dropped.values()) > 0
    for batch, count in dropped.items():
        assert per_batch.get(batch, 0) == count, batch
    output = spark.read.parquet(str(stream_dir / "out")).collect()
    assert not {r["lid"] for r in output} & set(ids)


@pytest.mark.slow(minutes=3.5)
def test_sigkill_mid_stream_then_restart_balances_every_kind(spark: Any, stream_dir: Path) -> None:
    """Six audited queries in one driver (a session window, an aggregation keyed by the event
    time, applyInPandasWithState with an event-time timeout, transformWithStateInPandas in
    event-time mode, a deduplication over a Python data source, a union of two sources into a
    deduplication), killed and restarted: each late row once, every committed batch marked,
    and every batch whose progress reached the history has as many late rows (state functions,
    deduplication) or late groups (aggregations, as Spark counts them after partial
    aggregation) as Spark counted. A batch the kill interrupted after its sink wrote it is run
    again without running its operators (the sink skips it): its progress has no count (NULL),
    not 0."""
    files = stream_files()
    for f in files[:3]:
        write_events(stream_dir / "in", f)
    _kill_after_commit(
        stream_dir,
        "kinds",
        lambda: write_events(stream_dir / "in", files[3]),
        stream_dir / "checkpoint-state",
        audited=2,
    )
    for f in files[4:]:
        write_events(stream_dir / "in", f)
    finish(DRIVER, str(stream_dir), "finish", "kinds")
    rows = {r["id"]: r for f in files for r in f}
    with duckdb.connect(str(stream_dir / "history.duckdb"), read_only=True) as con:
        ids = dict(con.execute("SELECT query_name, query_id FROM queries").fetchall())
        for name, group in (
            ("state", lambda batch, source, row: (batch, row["id"])),
            ("tws", lambda batch, source, row: (batch, row["id"])),
            ("union", lambda batch, source, row: (batch, source, row["id"])),
            ("pysource", lambda batch, source, row: (batch, row["id"])),
            ("aggregate", lambda batch, source, row: (batch, row["user"], row["ts"])),
            ("session", lambda batch, source, row: (batch, source, row["user"], row["ts"])),
        ):
            query_id = ids[name]
            late = con.execute(
                "SELECT batch_id, source_file || '#' || source_index, row_data::VARCHAR, "
                "operator_kind FROM late_rows WHERE query_id = ?",
                [query_id],
            ).fetchall()
            late_ids = [(src, json.loads(data)["id"]) for _, src, data, _ in late]
            assert late_ids and len(late_ids) == len(set(late_ids)), name
            marks = sorted(
                r[0]
                for r in con.execute(
                    "SELECT batch_id FROM audit_batches WHERE query_id = ?", [query_id]
                ).fetchall()
            )
            checkpoint = CheckpointReader(str(stream_dir / f"checkpoint-{name}"))
            assert marks == checkpoint.committed_batches(), name
            dropped = dict(
                con.execute(
                    "SELECT batch_id, sum(rows_dropped_by_watermark) FROM operators "
                    "WHERE query_id = ? AND rows_dropped_by_watermark IS NOT NULL "
                    "GROUP BY batch_id",
                    [query_id],
                ).fetchall()
            )
            assert sum(dropped.values()) > 0, name
            distinct = Counter(
                key[0]
                for key in {
                    group(batch, source, rows[json.loads(data)["id"]])
                    for batch, source, data, _ in late
                }
            )
            for batch, count in dropped.items():
                assert distinct.get(batch, 0) == count, (name, batch)


def test_a_batch_its_sink_had_written_has_no_count_from_spark(spark: Any, stream_dir: Path) -> None:
    """A crash after the file sink wrote batch N but before Spark wrote commits/N (simulated:
    commits/N removed): the restart runs N again, the sink skips it, and Spark's progress says
    0 rows dropped though its operators never ran. The history keeps that as no count (NULL),
    and the audit still finds N's late rows."""
    from pyspark.sql import functions as F

    import wmwatch

    files = stream_files()
    for f in files[:3]:
        write_events(stream_dir / "in", f)
    watch = wmwatch.attach(spark, db=str(stream_dir / "history.duckdb"), metrics_port=None)

    def run(more: list[dict[str, Any]] | None) -> None:
        events = (
            spark.readStream.schema("id int, user string, ts timestamp")
            .json(str(stream_dir / "in"))
            .withWatermark("ts", "10 seconds")
        )
        query = (
            events.groupBy("user", F.session_window("ts", "5 seconds"))
            .count()
            .writeStream.format("parquet")
            .outputMode("append")
            .option("path", str(stream_dir / "out"))
            .option("checkpointLocation", str(stream_dir / "checkpoint"))
            .start()
        )
        handle = watch.audit(query, events, poll_interval_seconds=0.2)
        try:
            query.processAllAvailable()
            if more is not None:
                write_events(stream_dir / "in", more)
                query.processAllAvailable()
            assert handle.sync(120)
        finally:
            handle.stop()
            query.stop()

    try:
        run(files[3])
        commits = stream_dir / "checkpoint" / "commits"
        offsets = stream_dir / "checkpoint" / "offsets"
        reader = CheckpointReader(str(stream_dir / "checkpoint"))
        batch = next(b for b in reversed(reader.committed_batches()) if reader.batch_files(b, 0))
        for later in reader.committed_batches():
            if later >= batch:
                (commits / str(later)).unlink()
                (commits / f".{later}.crc").unlink(missing_ok=True)
                if later > batch:
                    (offsets / str(later)).unlink()
                    (offsets / f".{later}.crc").unlink(missing_ok=True)
        run(None)
        assert watch.flush(30)
    finally:
        watch.close()
    with duckdb.connect(str(stream_dir / "history.duckdb"), read_only=True) as con:
        counted = con.execute(
            "SELECT o.rows_dropped_by_watermark, b.rows_dropped_by_watermark, b.input_rows "
            "FROM operators o JOIN batches b USING (query_id, batch_id) WHERE batch_id = ?",
            [batch],
        ).fetchall()
        late = con.execute("SELECT count(*) FROM late_rows WHERE batch_id = ?", [batch]).fetchone()
    assert counted == [(None, None, 0)]
    assert late is not None and late[0] > 0
