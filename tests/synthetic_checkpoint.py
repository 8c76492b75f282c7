"""A streaming query's checkpoint that runs for months, without a JVM or a disk: what the audit
reads of a checkpoint (commits, offsets, the file source's files per batch) for the newest
``retain`` batches of a query that commits one batch a second, older ones purged as Spark
purges them.

It is a :class:`~wmwatch._checkpoint.reader.CheckpointReader` whose answers are made from the
batch id instead of read from files (the reader's parsing is proven against real checkpoints
elsewhere): everything above it (the auditor, its retention, the file source, the jump watch,
the status) runs unchanged, and a million batches cost no memory here.
"""

from __future__ import annotations

import threading

from wmwatch._checkpoint.reader import CheckpointReader, OffsetsEntry, SourceFile

T0_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
DELAY_MS = 10_000
ROOT = "/synthetic/checkpoint"
QUERY_ID = "00000000-0000-4000-8000-000000000001"


class RollingCheckpoint(CheckpointReader):
    """Batches ``first_batch`` to :attr:`latest` committed, the newest ``retain`` of them still
    in the checkpoint; batch N runs at ``T0_MS + N s`` and its watermark is ``DELAY_MS`` behind
    it. ``jump_every``: every so many batches, one batch reads a row dated an hour ahead, so
    the next batch's watermark jumps (and stays an hour ahead for that one batch); the batch
    judged by that watermark reads no new file (a no-data batch), so nothing needs replaying
    without a JVM."""

    def __init__(self, *, retain: int = 100, first_batch: int = 0, jump_every: int = 0) -> None:
        self.root = ROOT
        self.retain = retain
        self.first_batch = first_batch
        self.jump_every = jump_every
        self.latest = first_batch - 1
        self._lock = threading.Lock()
        self._conf = {"spark.sql.streaming.minBatchesToRetain": str(retain)}
        # the few entries the audit reads several times per batch (it reads N-1 and N)
        self._recent: dict[int, OffsetsEntry] = {}

    # -- the query ---------------------------------------------------------------------------

    def commit(self, batches: int = 1) -> None:
        """The query commits ``batches`` more batches (the oldest past ``retain`` are purged)."""
        with self._lock:
            self.latest += batches

    def batch_at_ms(self, batch_id: int) -> int:
        return T0_MS + batch_id * 1000

    def watermark_ms(self, batch_id: int) -> int:
        normal = self.batch_at_ms(batch_id) - DELAY_MS
        if self.jump_every and batch_id % self.jump_every == 1 and batch_id > 1:
            return normal + 3_600_000
        return normal

    def min_event_time_ms(self, batch_id: int) -> int:
        """The smallest event time batch ``batch_id`` read: a second behind its time, so never
        behind the watermark it is judged with (nothing to replay)."""
        return self.batch_at_ms(batch_id) - 1000

    def max_event_time_ms(self, batch_id: int) -> int:
        ahead = self.jump_every and batch_id % self.jump_every == 0 and batch_id > 0
        return self.batch_at_ms(batch_id) + (3_600_000 + DELAY_MS if ahead else 0)

    # -- what the checkpoint holds -----------------------------------------------------------

    def _retained(self) -> range:
        latest = self.latest  # one int, read whole
        return range(max(self.first_batch, latest - self.retain + 1), latest + 1)

    def committed_batches(self) -> list[int]:
        return list(self._retained())

    def offset_batches(self) -> list[int]:
        return list(self._retained())

    def is_committed(self, batch_id: int) -> bool:
        return batch_id in self._retained()

    def commit_mtime_seconds(self, batch_id: int) -> float | None:
        return self.batch_at_ms(batch_id) / 1000.0 if batch_id in self._retained() else None

    def offsets(self, batch_id: int) -> OffsetsEntry | None:
        if batch_id not in self._retained():
            return None
        entry = self._recent.get(batch_id)
        if entry is None:
            entry = OffsetsEntry(
                batch_id=batch_id,
                watermark_ms=self.watermark_ms(batch_id),
                timestamp_ms=self.batch_at_ms(batch_id),
                conf=self._conf,
                source_offsets=(f'{{"logOffset":{batch_id}}}',),
            )
            if len(self._recent) >= 8:
                self._recent.clear()
            self._recent[batch_id] = entry
        return entry

    def batch_files(self, batch_id: int, source_index: int = 0) -> list[SourceFile]:
        if batch_id not in self._retained():
            return super().batch_files(batch_id, source_index)  # raises: purged
        if self.jump_every and batch_id % self.jump_every == 2 and batch_id > 2:
            return []
        return [
            SourceFile(f"file:///in/part-{batch_id}.json", self.batch_at_ms(batch_id), batch_id)
        ]
