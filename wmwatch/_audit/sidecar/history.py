"""The sidecar's batch history: each batch it audits, read from the checkpoint as ``wmwatch
checkpoint-history`` reads it and written to the tables the listener fills, just before the
batch's audit marker, so that ``wmwatch report`` shows the audited query's batches and
watermarks as for an in-job audit. What it writes and leaves out: docs/sidecar-audit.md.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from wmwatch._audit.sinks import AuditHistory, BatchLateRows
from wmwatch._checkpoint.history import (
    CheckpointHistory,
    Retention,
    StateOperator,
    read_batches,
    read_operators,
)
from wmwatch._checkpoint.reader import CheckpointReader, OffsetsEntry
from wmwatch._checkpoint.tables import CHECKPOINT_RUN_ID, write_history
from wmwatch._core.plugins import HistoryAccess, Write
from wmwatch._text import clean, error_line, get_logger

if TYPE_CHECKING:
    import duckdb

_log = get_logger("wmwatch.audit")

# Batches written per transaction when catching up at start.
_CATCH_UP_CHUNK = 200
# How often the checkpoint's reach (offsets, commits, state folders) is listed again for the
# history's checkpoint_reads row: a listing per audited batch would cost more than the batch.
_LIST_EVERY_SECONDS = 10.0


class SidecarHistory(AuditHistory):
    """The audit's tables, plus each audited batch's history from the checkpoint."""

    def __init__(
        self,
        store: HistoryAccess,
        *,
        query_id: str,
        label: str,
        reader: CheckpointReader,
        query_name: str | None,
        has_watermark: bool,
    ) -> None:
        super().__init__(store, query_id=query_id, label=label)
        self._reader = reader
        self._query_name = query_name
        self._has_watermark = has_watermark
        self._operators: tuple[StateOperator, ...] = ()
        # the offsets of the batch last written, which the next batch starts from
        self._previous: OffsetsEntry | None = None
        # the checkpoint's reach, listed at most every _LIST_EVERY_SECONDS (not per batch)
        self._retention: Retention | None = None
        self._listed_at = 0.0
        # this sidecar's row in checkpoint_reads counts on from what it wrote since
        self._started_at = datetime.now(UTC)

    def last_audited_batch(self) -> int | None:
        """The newest marked batch (where the audit resumes), after writing the history of
        marked batches that have none while the checkpoint still holds them (only those are
        looked up: a long history is never read whole)."""
        last = super().last_audited_batch()
        query_id = self.query_id

        def missing(con: duckdb.DuckDBPyConnection, first: int, latest: int) -> list[int]:
            rows = con.execute(
                "SELECT a.batch_id FROM audit_batches a ANTI JOIN batches b "
                "USING (query_id, batch_id) WHERE a.query_id = ? "
                "AND a.batch_id BETWEEN ? AND ? ORDER BY a.batch_id",
                [query_id, first, latest],
            ).fetchall()
            return [int(batch_id) for (batch_id,) in rows]

        try:
            retained = self._reader.offset_batches()
            if not retained:
                return last
            held = set(retained)
            found = self._store.read(
                lambda con: missing(con, retained[0], retained[-1]), timeout=30
            )
            gaps = [b for b in found if b in held]
        except Exception as exc:  # noqa: BLE001 - the history is extra; the audit must go on
            _log.warning(
                "wmwatch: audit %s: no batch history caught up: %s", self.label, error_line(exc)
            )
            return last
        for start in range(0, len(gaps), _CATCH_UP_CHUNK):
            self._write_batches(gaps[start : start + _CATCH_UP_CHUNK])
        return last

    def commit(
        self,
        *,
        query_name: str | None,
        run_id: str | None,
        batch_id: int,
        late_wm_ms: int | None,
        found: BatchLateRows,
        sink: str,
    ) -> None:
        """Queue the batch's history, then its late rows and marker (in that order, so a batch
        marked audited has its history unless that write failed; a restart repairs that)."""
        self._write_batches([batch_id])
        super().commit(
            query_name=query_name,
            run_id=run_id,
            batch_id=batch_id,
            late_wm_ms=late_wm_ms,
            found=found,
            sink=sink,
        )

    def _write_batches(self, batch_ids: list[int]) -> None:
        """Read ``batch_ids`` from the checkpoint and queue their write; a failure to read is
        logged and leaves them without history (the audit itself goes on)."""
        try:
            if not self._operators:  # a query's operators are in its checkpoint once it ran
                self._operators = read_operators(self._reader)[0]
            previous = self._previous
            fresh = time.monotonic() - self._listed_at < _LIST_EVERY_SECONDS
            history = read_batches(
                self._reader,
                self.query_id,
                batch_ids,
                operators=self._operators,
                has_watermark=self._has_watermark,
                previous=previous if previous and previous.batch_id == batch_ids[0] - 1 else None,
                retention=self._retention if fresh else None,
            )
            if not fresh:
                self._retention, self._listed_at = history.retention, time.monotonic()
        except Exception as exc:  # noqa: BLE001 - the history is extra; the audit must go on
            _log.warning(
                "wmwatch: audit %s: no batch history for batches %s-%s: %s",
                self.label,
                batch_ids[0],
                batch_ids[-1],
                error_line(exc),
            )
            return
        if not history.batches:
            return  # purged since: nothing left to read
        self._previous = history.batches[-1].offsets
        self._store.submit(
            _history_writer(history, self._query_name, self._started_at),
            description=(
                f"audit {self.label}: history of batches {batch_ids[0]}-{batch_ids[-1]} "
                f"(run {CHECKPOINT_RUN_ID})"
            ),
        )


def _history_writer(history: CheckpointHistory, name: str | None, started_at: datetime) -> Write:
    read_at = datetime.now(UTC)
    query_id, checkpoint = history.query_id, clean(history.checkpoint)
    batch_ids = [b.batch_id for b in history.batches]

    def write(con: duckdb.DuckDBPyConnection) -> None:
        before = con.execute(
            "SELECT batches_written, read_at FROM checkpoint_reads "
            "WHERE query_id = ? AND checkpoint = ?",
            [query_id, checkpoint],
        ).fetchone()
        (present,) = con.execute(
            "SELECT count(*) FROM batches WHERE query_id = ? AND batch_id = ANY(?::BIGINT[])",
            [query_id, batch_ids],
        ).fetchone() or (0,)
        write_history(con, history, name, read_at, state_batches_counted=0)
        # the sidecar's read goes on batch by batch: its row counts every batch written so far,
        # counted once when this sidecar first writes and then added to (never a count of the
        # whole history per batch)
        if before is not None and before[0] is not None and before[1] >= started_at:
            total = int(before[0]) + len(batch_ids) - int(present)
            con.execute(
                "UPDATE checkpoint_reads SET batches_written = ? "
                "WHERE query_id = ? AND checkpoint = ?",
                [total, query_id, checkpoint],
            )
        else:
            con.execute(
                """
                UPDATE checkpoint_reads SET batches_written = (
                    SELECT count(*) FROM batches WHERE query_id = $1 AND run_id = $2)
                WHERE query_id = $1 AND checkpoint = $3
                """,
                [query_id, CHECKPOINT_RUN_ID, checkpoint],
            )

    return write
