"""What an audit remembers stays bounded however long it runs and wherever its batch ids start:
handled batches are ranges, never one id each; a purged gap of millions of batches is one range
(one log line, the count right); progress of handled batches is dropped.

No JVM: the real auditor, retention, status and jump watch over a checkpoint of a query that
commits one batch a second (:mod:`tests.synthetic_checkpoint`), memory traced with tracemalloc.
The same started late on real Spark, with batch ids above 5,000,000, is in
``tests/test_audit_started_late_spark.py``; the figures in ``benchmarks/bench_long_run.py``.
"""

from __future__ import annotations

import itertools
import logging
import tracemalloc

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.long_run import run, synthetic_auditor
from tests.synthetic_checkpoint import RollingCheckpoint
from wmwatch._audit.handled import HandledBatches, range_count
from wmwatch._audit.retention import Retention

MiB = 1024 * 1024


@given(
    floor=st.integers(0, 50),
    adds=st.lists(st.tuples(st.integers(0, 120), st.integers(0, 12)), max_size=40),
    probe=st.tuples(st.integers(0, 130), st.integers(0, 130)),
)
def test_handled_batches_hold_what_was_added_as_a_few_ranges(
    floor: int, adds: list[tuple[int, int]], probe: tuple[int, int]
) -> None:
    """Against a plain set of ids: the same membership and the same gaps."""
    handled = HandledBatches(floor)
    model = set(range(floor))
    for first, length in adds:
        handled.add(first, first + length)
        model |= set(range(first, first + length + 1))
    for batch_id in range(0, 140):
        assert (batch_id in handled) == (batch_id in model)
    first, last = min(probe), max(probe)
    gaps = handled.missing(first, last)
    assert [b for a, z in gaps for b in range(a, z + 1)] == [
        b for b in range(first, last + 1) if b not in model
    ]
    ranges = list(handled.ranges())
    # disjoint, apart from each other and from the floor
    assert all(a <= z for a, z in ranges)
    assert all(z + 1 < a for (_, z), (a, _) in itertools.pairwise(ranges))
    assert all(a > handled.floor for a, _ in ranges)


def test_batches_handled_in_order_are_one_floor_and_no_ranges() -> None:
    handled = HandledBatches(5_000_000)
    for batch_id in range(5_000_000, 5_010_000):
        handled.add(batch_id)
    assert handled.floor == 5_010_000 and list(handled.ranges()) == []
    handled.add(5_010_002)  # one batch still waiting below it
    assert list(handled.ranges()) == [(5_010_002, 5_010_002)]
    handled.add(5_010_000, 5_010_001)
    assert handled.floor == 5_010_003 and list(handled.ranges()) == []


def test_a_purged_gap_of_five_million_batches_is_one_range() -> None:
    """A checkpoint whose first commit is batch 5,000,000: the gap below it is one range,
    found without a list of five million ids."""
    checkpoint = RollingCheckpoint(first_batch=5_000_000)
    checkpoint.commit(3)
    retention = Retention(None, "q")
    tracemalloc.start()
    try:
        gone = retention.purged_gap(checkpoint.committed_batches(), HandledBatches(0))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert gone == [(0, 4_999_999)]
    assert range_count(gone) == 5_000_000
    assert peak < MiB
    # found once: the next pass finds nothing new
    assert retention.purged_gap(checkpoint.committed_batches(), HandledBatches(0)) == []


def test_an_audit_started_at_batch_five_million_counts_the_gap_in_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The whole auditor, started on a query whose batches begin at 5,000,000: five million
    batches counted lost in one log line with the first and last id, the batches the checkpoint
    holds audited, and the memory this took a few hundred kB, not hundreds of MB."""
    checkpoint = RollingCheckpoint(first_batch=5_000_000)
    auditor = synthetic_auditor(checkpoint)
    for batch_id in range(5_000_000, 5_000_020):
        auditor.note_progress(
            batch_id, checkpoint.min_event_time_ms(batch_id), "run-1", has_rows=True
        )
    checkpoint.commit(20)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="wmwatch.audit"):
            auditor.start()
            assert auditor.sync(60)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        auditor.stop(30)
        tracemalloc.stop()
    status = auditor.status()
    # batch 5,000,000 is lost too: the watermark it judged with was in offsets/4,999,999
    assert status["batches_lost"] == 5_000_001
    assert status["batches_audited"] == 19
    assert status["last_audited_batch"] == 5_000_019
    assert status["errors"] == 0, status["last_error"]
    lost = [r.getMessage() for r in caplog.records if " lost " in r.getMessage()]
    assert len(lost) == 2, lost
    assert "lost batches 0 to 4999999 (5000000 batches), not audited" in lost[0]
    assert "lost batch 5000000, not audited" in lost[1]
    assert peak < 4 * MiB, f"{peak / MiB:.1f} MiB traced"


def test_a_million_batches_leave_the_audit_holding_what_it_held_after_the_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A query commits a million batches, ten thousand between two passes of its audit, and
    its checkpoint keeps the newest 100: every pass audits what is held and counts the rest
    lost. What the audit holds after a million batches is what it held after 100,000 (within
    a generous 1 MiB; one int per batch would be tens of MiB)."""
    with caplog.at_level(logging.ERROR, logger="wmwatch.audit"):  # 100 lost lines per pass
        result = run(1_000_000, per_pass=10_000, progress_for_purged=False)
    status = result.status
    assert status["batches_audited"] + status["batches_lost"] == 1_000_000
    assert status["batches_audited"] == 100 * 99  # each pass: the held batches but the first
    assert status["errors"] == 0, status["last_error"]
    assert status["last_audited_batch"] == 999_999
    first, last = result.traced_bytes[0], result.traced_bytes[-1]
    assert result.batches[0] == 100_000 and result.batches[-1] == 1_000_000
    assert last - first < MiB, [
        f"{b:,}: {t / MiB:.2f} MiB"
        for b, t in zip(result.batches, result.traced_bytes, strict=True)
    ]
