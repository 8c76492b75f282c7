"""An audit that falls behind Spark's checkpoint retention (``minBatchesToRetain``).

Spark purges offsets and commits older than ``minBatchesToRetain`` batches. The audit exports
how many batches remain before it loses the offsets it needs, and every batch whose entries are
gone is logged (one line, with the reason), counted and passed over, while the batches the
checkpoint still holds are audited. The Spark tests run a query with ``minBatchesToRetain=3``
and start (or resume) its audit only after the checkpoint dropped some batches.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry

import wmwatch
from tests.harness.streams import write_events
from wmwatch._checkpoint.reader import (
    DEFAULT_MIN_BATCHES_TO_RETAIN,
    MIN_BATCHES_TO_RETAIN_KEY,
    CheckpointReader,
    batches_until_purge,
    min_batches_to_retain,
)

RETAIN = 3
SCHEMA = "id int, ts timestamp"
_LOST_LINE = re.compile(
    r"audit of (\S+) lost batch(?:es)? (\d+)(?: to (\d+) \((\d+) batches\))?, not audited: (.*)"
)


def ts(second: int) -> str:
    return f"2026-01-01T00:{second // 60:02d}:{second % 60:02d}Z"


# -- pure logic -----------------------------------------------------------------------------------


def test_retention_comes_from_the_offset_log_then_the_session_then_the_default() -> None:
    assert min_batches_to_retain({MIN_BATCHES_TO_RETAIN_KEY: "7"}, "50") == 7
    assert min_batches_to_retain({}, "50") == 50
    assert min_batches_to_retain({}, None) == DEFAULT_MIN_BATCHES_TO_RETAIN == 100
    # unusable values never make the estimate up
    assert min_batches_to_retain({MIN_BATCHES_TO_RETAIN_KEY: "lots"}, " 12 ") == 12
    assert min_batches_to_retain({MIN_BATCHES_TO_RETAIN_KEY: "0"}, "-4") == 100


def test_batches_until_purge_counts_the_plans_left_before_offsets_of_n_minus_1_go() -> None:
    # planning batch C purges offsets below C - retain; batch 10 needs offsets/9
    assert batches_until_purge(10, 10, 3) == 2  # plans 11 and 12 keep offsets/9, 13 drops it
    assert batches_until_purge(10, 12, 3) == 0
    assert batches_until_purge(10, 13, 3) == -1
    # caught up: the next batch to audit is the next one the query plans
    assert batches_until_purge(13, 12, 3) == 3


# -- against real Spark ---------------------------------------------------------------------------


@pytest.fixture
def retain_three(spark: Any) -> Iterator[None]:
    """Queries started in this test keep 3 batches of checkpoint (the shared session is reset)."""
    before = spark.conf.get(MIN_BATCHES_TO_RETAIN_KEY, None)
    spark.conf.set(MIN_BATCHES_TO_RETAIN_KEY, str(RETAIN))
    try:
        yield
    finally:
        if before is None:
            spark.conf.unset(MIN_BATCHES_TO_RETAIN_KEY)
        else:
            spark.conf.set(MIN_BATCHES_TO_RETAIN_KEY, before)


def _start(spark: Any, folder: Path, name: str) -> tuple[Any, Any]:
    from pyspark.sql import functions as F

    events = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(folder / "in"))
        .withWatermark("ts", "10 seconds")
    )
    query = (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.format("noop")
        .outputMode("append")
        .queryName(name)
        .option("checkpointLocation", str(folder / "checkpoint"))
        .start()
    )
    return query, events


def _feed(query: Any, folder: Path, first_second: int, files: int) -> None:
    """One on-time row per file, each file its own batch (plus the no-data batch it causes)."""
    for k in range(files):
        write_events(folder / "in", [{"id": k, "ts": ts(first_second + 10 * k)}])
        query.processAllAvailable()


def _unauditable(reader: CheckpointReader, after: int) -> list[int]:
    """Batches after ``after`` the checkpoint can no longer give an audit: the definition, read
    from the files (a batch needs its commit and the offsets of the batch before it)."""
    committed = set(reader.committed_batches())
    offsets = set(reader.offset_batches())
    return [
        b
        for b in range(after + 1, max(committed) + 1)
        if b not in committed or (b > 0 and b - 1 not in offsets)
    ]


def _lost_lines(caplog: pytest.LogCaptureFixture, label: str) -> dict[int, str]:
    lines: dict[int, str] = {}
    for record in caplog.records:
        m = _LOST_LINE.search(record.getMessage())
        if m and m.group(1) == label:
            first = int(m.group(2))
            last = int(m.group(3)) if m.group(3) else first
            if m.group(4):  # a run of batches, one line with its first and last id and count
                assert int(m.group(4)) == last - first + 1
            for batch_id in range(first, last + 1):
                assert batch_id not in lines, f"batch {batch_id} was logged as lost twice"
                lines[batch_id] = m.group(5)
    return lines


def _eventually(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _audited_batches(db: Path) -> dict[int, int]:
    with duckdb.connect(str(db), read_only=True) as con:
        return dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())


@pytest.mark.spark
def test_audit_started_after_the_purge_logs_counts_and_skips_lost_batches(
    spark: Any, stream_dir: Path, retain_three: None, caplog: pytest.LogCaptureFixture
) -> None:
    query, events = _start(spark, stream_dir, "retention_late_start")
    watch = wmwatch.attach(
        spark, db=str(stream_dir / "h.duckdb"), metrics_port=None, registry=CollectorRegistry()
    )
    try:
        _feed(query, stream_dir, 0, 6)
        reader = CheckpointReader(str(stream_dir / "checkpoint"))
        lost = _unauditable(reader, -1)
        still_held = [b for b in reader.committed_batches() if b not in lost]
        assert lost and still_held, "the scenario needs both lost and auditable batches"
        with caplog.at_level(logging.WARNING, logger="wmwatch.audit"):
            audit = watch.audit(query, events, poll_interval_seconds=0.2)
            assert audit.sync(90)
            # the audit goes on: a batch after the loss with two rows behind the watermark
            write_events(
                stream_dir / "in",
                [{"id": 100, "ts": ts(1)}, {"id": 101, "ts": ts(2)}, {"id": 102, "ts": ts(70)}],
            )
            query.processAllAvailable()
            assert audit.sync(90)
        status = audit.status()
        assert status["batches_lost"] == len(lost)
        assert status["last_lost_batch"] == max(lost)
        assert "minBatchesToRetain" in str(status["last_lost_reason"])
        assert status["errors"] == 0, status["last_error"]
        lines = _lost_lines(caplog, "retention_late_start")
        assert sorted(lines) == lost  # one line per run of lost batches, with its reason
        assert all("minBatchesToRetain" in reason for reason in lines.values())
        assert watch.registry.get_sample_value(
            "wmwatch_audit_batches_lost_total", {"query": "retention_late_start"}
        ) == len(lost)
        # caught up and idle: the next batch to audit has the whole retention ahead of it
        _eventually(
            lambda: (
                watch.registry.get_sample_value(
                    "wmwatch_audit_retention_batches_remaining", {"query": "retention_late_start"}
                )
                == RETAIN
            ),
            "the retention gauge to show the full retention",
        )
        audit.stop()
        committed_now = reader.committed_batches()
    finally:
        query.stop()
        watch.close()
    marks = _audited_batches(stream_dir / "h.duckdb")
    # every batch after the lost ones, up to the last commit, was audited exactly once
    assert sorted(marks) == list(range(max(lost) + 1, max(committed_now) + 1))
    assert set(still_held) <= set(marks)
    assert sum(marks.values()) == 2 == status["late_rows"]


@pytest.mark.spark
def test_paused_audit_resumes_after_the_purge_without_counting_twice(
    spark: Any, stream_dir: Path, retain_three: None, caplog: pytest.LogCaptureFixture
) -> None:
    query, events = _start(spark, stream_dir, "retention_paused")
    watch = wmwatch.attach(
        spark, db=str(stream_dir / "h.duckdb"), metrics_port=None, registry=CollectorRegistry()
    )
    registry = watch.registry
    try:
        first = watch.audit(query, events, poll_interval_seconds=0.2)
        _feed(query, stream_dir, 0, 2)
        assert first.sync(90)
        assert first.status()["batches_lost"] == 0
        before_pause = first.status()["last_audited_batch"]
        _eventually(
            lambda: (
                registry.get_sample_value(
                    "wmwatch_audit_retention_batches_remaining", {"query": "retention_paused"}
                )
                == RETAIN
            ),
            "the retention gauge while the audit keeps up",
        )
        first.stop()
        # paused while the query runs on: more batches than the checkpoint keeps
        _feed(query, stream_dir, 20, 4)
        reader = CheckpointReader(str(stream_dir / "checkpoint"))
        lost = _unauditable(reader, before_pause)
        assert lost
        with caplog.at_level(logging.WARNING, logger="wmwatch.audit"):
            second = watch.audit(query, events, poll_interval_seconds=0.2)
            assert second.sync(90)
            # stopping and resuming again finds nothing new to lose
            second.stop()
            third = watch.audit(query, events, poll_interval_seconds=0.2)
            assert third.sync(90)
        assert second.status()["batches_lost"] == len(lost)
        assert third.status()["batches_lost"] == 0
        assert sorted(_lost_lines(caplog, "retention_paused")) == lost
        assert registry.get_sample_value(
            "wmwatch_audit_batches_lost_total", {"query": "retention_paused"}
        ) == len(lost)
        expected = [b for b in range(0, max(reader.committed_batches()) + 1) if b not in lost]
        third.stop()
    finally:
        query.stop()
        watch.close()
    assert sorted(_audited_batches(stream_dir / "h.duckdb")) == expected
