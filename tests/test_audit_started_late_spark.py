"""An audit started on a query that has run for months: real Spark, batch ids above 5,000,000.

A real query (a windowed count over files, RocksDB state, as production queries run) runs and
stops; its checkpoint's batch ids are all moved up by 5,000,000, the way a query that ran two
months at one batch a second numbers them (:mod:`tests.shifted_checkpoint`); the query restarts
on it and Spark goes on at 5,000,0xx. The audit attached then finds the late rows of the new
batches exactly, counts the five million batches it can no longer read as lost in one range,
and what it holds stays that of an audit of a young query (the allocations of wmwatch's own
code, traced, under 16 MiB; a list and a set of five million ids held 280 MiB). So does the
sidecar over the same checkpoint.
"""

from __future__ import annotations

import logging
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry

import wmwatch
from tests.harness.streams import write_events
from tests.shifted_checkpoint import shift_checkpoint
from wmwatch._checkpoint.reader import CheckpointReader

pytestmark = [pytest.mark.spark, pytest.mark.slow]

SHIFT = 5_000_000
SCHEMA = "id int, ts timestamp"
PROVIDER = "spark.sql.streaming.stateStore.providerClass"
ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
MiB = 1024 * 1024


def ts(second: int) -> str:
    return f"2026-01-01T00:{second // 60:02d}:{second % 60:02d}Z"


@pytest.fixture
def rocksdb(spark: Any) -> Iterator[None]:
    """Queries started in this test keep their state in RocksDB (the session is reset)."""
    before = spark.conf.get(PROVIDER, None)
    spark.conf.set(PROVIDER, ROCKSDB)
    try:
        yield
    finally:
        if before is None:
            spark.conf.unset(PROVIDER)
        else:
            spark.conf.set(PROVIDER, before)


def _events(spark: Any, folder: Path) -> Any:
    return (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(folder / "in"))
        .withWatermark("ts", "10 seconds")
    )


def _window(frame: Any) -> Any:
    from pyspark.sql import functions as F

    return frame.groupBy(F.window("ts", "10 seconds")).count()


def _start(spark: Any, folder: Path) -> tuple[Any, Any]:
    events = _events(spark, folder)
    query = (
        _window(events)
        .writeStream.format("noop")
        .outputMode("append")
        .queryName("started_late")
        .option("checkpointLocation", str(folder / "checkpoint"))
        .start()
    )
    return query, events


def _held_by_wmwatch() -> int:
    """Bytes still held, since tracing started, by what wmwatch's own code allocated (Spark's
    and py4j's allocations in the same process are theirs, whatever the checkpoint)."""
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, "*/wmwatch/*")])
    return sum(stat.size for stat in snapshot.statistics("filename"))


def _late_rows(db: Path) -> list[tuple[int, int]]:
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute(
            "SELECT batch_id, CAST(json_extract(row_data, '$.id') AS INTEGER) FROM late_rows "
            "ORDER BY 2"
        ).fetchall()
    return [(int(b), int(i)) for b, i in rows]


def test_an_audit_of_a_query_whose_batches_begin_above_five_million(
    spark: Any, stream_dir: Path, rocksdb: None, caplog: pytest.LogCaptureFixture
) -> None:
    query, _ = _start(spark, stream_dir)
    try:
        # eleven files, one on-time row each: the file source's log compacts at its tenth
        # entry, as a long-running query's log has
        for k in range(11):
            write_events(stream_dir / "in", [{"id": k, "ts": ts(10 * k)}])
            query.processAllAvailable()
    finally:
        query.stop()
    checkpoint = stream_dir / "checkpoint"
    before = CheckpointReader(str(checkpoint)).committed_batches()
    shift_checkpoint(checkpoint, SHIFT)
    shifted = CheckpointReader(str(checkpoint)).committed_batches()
    assert shifted == [b + SHIFT for b in before]

    query, events = _start(spark, stream_dir)
    watch = wmwatch.attach(
        spark, db=str(stream_dir / "h.duckdb"), metrics_port=None, registry=CollectorRegistry()
    )
    try:
        tracemalloc.start()
        with caplog.at_level(logging.WARNING, logger="wmwatch.audit"):
            audit = watch.audit(query, events, poll_interval_seconds=0.2)
            # two rows far behind the watermark (ids 100, 101) and one on time
            write_events(
                stream_dir / "in",
                [{"id": 100, "ts": ts(1)}, {"id": 101, "ts": ts(2)}, {"id": 102, "ts": ts(200)}],
            )
            query.processAllAvailable()
            assert audit.sync(900)  # a guard against a hang only: it replays every batch
        held = _held_by_wmwatch()
        tracemalloc.stop()
        last_batch = query.lastProgress["batchId"]
        status = audit.status()
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        query.stop()
        watch.close()
    # Spark went on numbering where the checkpoint left off
    assert last_batch > shifted[-1] > SHIFT
    late = _late_rows(stream_dir / "h.duckdb")
    assert [i for _, i in late] == [100, 101]
    assert all(b > shifted[-1] for b, _ in late)
    # without a history, the audit answers from batch 0: the five million batches before the
    # checkpoint's first, and that first one (its watermark was in offsets/4,999,999), are lost
    assert status["batches_lost"] == SHIFT + 1
    assert status["last_lost_batch"] == SHIFT
    assert status["last_audited_batch"] >= max(b for b, _ in late)
    assert status["errors"] == 0, status["last_error"]
    lost = [r.getMessage() for r in caplog.records if " lost " in r.getMessage()]
    assert any("lost batches 0 to 4999999 (5000000 batches)" in line for line in lost), lost
    assert len(lost) == 2, lost
    assert held < 16 * MiB, f"the audit holds {held / MiB:.0f} MiB"

    # the sidecar over the same checkpoint, the query stopped: the same rows, as little memory
    side = wmwatch.attach(
        spark, db=str(stream_dir / "side.duckdb"), metrics_port=None, registry=CollectorRegistry()
    )
    try:
        tracemalloc.start()
        definition = _events(spark, stream_dir)
        sidecar = side.audit_checkpoint(
            checkpoint,
            definition,
            _window(definition),
            name="started_late",
            poll_interval_seconds=0.2,
        )
        sidecar.finish()
        assert sidecar.sync(900)  # a guard against a hang only
        side_held = _held_by_wmwatch()
        side_status = sidecar.status()
    finally:
        if tracemalloc.is_tracing():
            tracemalloc.stop()
        side.close()
    assert _late_rows(stream_dir / "side.duckdb") == late
    assert side_status["batches_lost"] == SHIFT + 1
    assert side_status["errors"] == 0, side_status["last_error"]
    assert side_held < 16 * MiB, f"the sidecar holds {side_held / MiB:.0f} MiB"
