"""Batches the audit can no longer read: how close Spark's purge of the checkpoint is to the
oldest batch the audit still needs, which batches it purged before the audit reached them, and
the bounded log lines of lost batches.

Spark keeps ``spark.sql.streaming.minBatchesToRetain`` batches of offsets; the audit exports how
many batches remain before the oldest one it still needs is purged, and a batch whose entries
are gone is logged with the reason, counted as lost and passed over, so the batches after it
are still audited.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from wmwatch._checkpoint.reader import (
    MIN_BATCHES_TO_RETAIN_KEY,
    CheckpointReader,
    batches_until_purge,
    min_batches_to_retain,
)
from wmwatch._text import get_logger

log = get_logger("wmwatch.audit")

# Lost batches logged one line each per pass; the rest of a larger gap gets one summary line.
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

    def purged_gap(self, committed: list[int], floor: int, done: Collection[int]) -> list[int]:
        """Batches below the oldest commit the checkpoint still holds, never audited (each
        returned once)."""
        if not committed:
            return []
        start = max(floor, self._gap_checked_below)
        gone = [b for b in range(start, committed[0]) if b not in done]
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


def log_lost(label: str, batch_ids: list[int], reason: str) -> None:
    """One log line per lost batch, at most :data:`_LOST_LINES_PER_PASS`, then one for the
    rest."""
    for batch_id in batch_ids[:_LOST_LINES_PER_PASS]:
        log.warning("wmwatch: audit of %s lost batch %d, not audited: %s", label, batch_id, reason)
    if len(batch_ids) > _LOST_LINES_PER_PASS:
        log.warning(
            "wmwatch: audit of %s lost %d more batches (%d to %d), not audited: %s",
            label,
            len(batch_ids) - _LOST_LINES_PER_PASS,
            batch_ids[_LOST_LINES_PER_PASS],
            batch_ids[-1],
            reason,
        )
