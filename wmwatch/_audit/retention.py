"""Batches the audit can no longer read: how close Spark's purge of the checkpoint is to the
oldest batch the audit still needs, which batches it purged before the audit reached them, and
the bounded log lines of lost batches.

Spark keeps ``spark.sql.streaming.minBatchesToRetain`` batches of offsets; the audit exports how
many batches remain before the oldest one it still needs is purged, and a batch whose entries
are gone is logged with the reason, counted as lost and passed over, so the batches after it
are still audited.
"""

from __future__ import annotations

from typing import Any

from wmwatch._audit.handled import BatchRange, HandledBatches, range_count
from wmwatch._checkpoint.reader import (
    MIN_BATCHES_TO_RETAIN_KEY,
    CheckpointReader,
    batches_until_purge,
    min_batches_to_retain,
)
from wmwatch._text import get_logger

log = get_logger("wmwatch.audit")

# Runs of lost batches logged one line each per pass; the rest get one summary line.
_LOST_LINES_PER_PASS = 20


class Retention:
    """One audit's view of its checkpoint's purge: the query's ``minBatchesToRetain`` (read
    once) and how far back purged batches were already looked for."""

    def __init__(self, spark: Any, query_id: str) -> None:
        self._spark = spark
        self._query_id = query_id
        self._retain: int | None = None
        # batches below this were checked for purged entries already
        self._gap_checked_below = 0

    def retain_batches(self, checkpoint: CheckpointReader) -> int:
        """``minBatchesToRetain`` of the query: its offset log's conf, else its session's."""
        if self._retain is None:
            latest = checkpoint.latest_offsets()
            self._retain = min_batches_to_retain(
                latest.conf if latest is not None else {},
                session_retain_value(self._spark, self._query_id),
            )
        return self._retain

    def batches_remaining(
        self, checkpoint: CheckpointReader, oldest_pending: int | None, committed: list[int]
    ) -> int:
        """How many batches the query can commit before Spark purges the oldest one the audit
        still needs."""
        retain = self.retain_batches(checkpoint)
        offsets = checkpoint.offset_batches()
        if oldest_pending is None:
            # caught up: the next batch to audit is the one after the last commit
            oldest_pending = committed[-1] + 1 if committed else 0
        remaining = (
            retain if not offsets else batches_until_purge(oldest_pending, offsets[-1], retain)
        )
        return max(0, remaining)

    def purged_gap(self, committed: list[int], handled: HandledBatches) -> list[BatchRange]:
        """Runs of batches below the oldest commit the checkpoint still holds, never handled
        (each returned once): ranges, so a gap of millions of batches costs one pair."""
        if not committed:
            return []
        start = max(handled.floor, self._gap_checked_below)
        gone = handled.missing(start, committed[0] - 1) if start < committed[0] else []
        self._gap_checked_below = max(self._gap_checked_below, committed[0])
        return gone

    def purged_reason(self, checkpoint: CheckpointReader) -> str:
        return (
            "its offsets and commit were purged from the checkpoint before the audit reached "
            "it (Spark keeps spark.sql.streaming.minBatchesToRetain="
            f"{self.retain_batches(checkpoint)} batches); raise that setting or keep the audit "
            "closer to the query."
        )


def session_retain_value(spark: Any, query_id: str) -> str | None:
    """The value in the session the query runs with (classic PySpark), else the caller's."""
    try:
        query = spark.streams.get(query_id)
        jsq = getattr(query, "_jsq", None) if query is not None else None
        if jsq is not None:
            value = jsq.streamingQuery().sparkSession().conf().get(MIN_BATCHES_TO_RETAIN_KEY, None)
            if value is not None:
                return str(value)
    except Exception:  # noqa: BLE001 - the session's own conf is the next best answer
        pass
    try:
        value = spark.conf.get(MIN_BATCHES_TO_RETAIN_KEY, None)
    except Exception:  # noqa: BLE001 - Spark's default then
        return None
    return None if value is None else str(value)


def log_lost(label: str, ranges: list[BatchRange], reason: str) -> None:
    """One log line per run of lost batches (its first and last id and how many), at most
    :data:`_LOST_LINES_PER_PASS`, then one for the rest."""
    for first, last in ranges[:_LOST_LINES_PER_PASS]:
        if first == last:
            log.warning("wmwatch: audit of %s lost batch %d, not audited: %s", label, first, reason)
        else:
            log.warning(
                "wmwatch: audit of %s lost batches %d to %d (%d batches), not audited: %s",
                label,
                first,
                last,
                last - first + 1,
                reason,
            )
    rest = ranges[_LOST_LINES_PER_PASS:]
    if rest:
        log.warning(
            "wmwatch: audit of %s lost %d more batches (%d to %d), not audited: %s",
            label,
            range_count(rest),
            rest[0][0],
            rest[-1][1],
            reason,
        )
