"""The sidecar's batch history: each batch it audits, read from the checkpoint as ``wmwatch
checkpoint-history`` reads it and written to the tables the listener fills, just before the
batch's audit marker, so that ``wmwatch report`` shows the audited query's batches and
watermarks as for an in-job audit. What it writes and leaves out: docs/sidecar-audit.md.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING

from wmwatch._audit.sinks import AuditHistory, BatchLateRows
from wmwatch._checkpoint.history import (
    CheckpointHistory,
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

    def audited_batches(self) -> list[int]:
        """The marked batches (where the audit resumes), after writing the history of those
        that have none while the checkpoint still holds them."""
        audited = super().audited_batches()
        query_id = self.query_id

        def missing(con: duckdb.DuckDBPyConnection) -> set[int]:
            rows = con.execute(
                "SELECT a.batch_id FROM audit_batches a ANTI JOIN batches b "
                "USING (query_id, batch_id) WHERE a.query_id = ?",
                [query_id],
            ).fetchall()
            return {int(batch_id) for (batch_id,) in rows}

        try:
            retained = set(self._reader.offset_batches())
            gaps = sorted(set(self._store.read(missing, timeout=30)) & retained)
        except Exception as exc:  # noqa: BLE001 - the history is extra; the audit must go on
            _log.warning(
                "wmwatch: audit %s: no batch history caught up: %s", self.label, error_line(exc)
            )
            return audited
        for start in range(0, len(gaps), _CATCH_UP_CHUNK):
            self._write_batches(gaps[start : start + _CATCH_UP_CHUNK])
        return audited

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
            history = read_batches(
                self._reader,
                self.query_id,
                batch_ids,
                operators=self._operators,
                has_watermark=self._has_watermark,
                previous=previous if previous and previous.batch_id == batch_ids[0] - 1 else None,
            )
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
            _history_writer(history, self._query_name),
            description=(
                f"audit {self.label}: history of batches {batch_ids[0]}-{batch_ids[-1]} "
                f"(run {CHECKPOINT_RUN_ID})"
            ),
        )


def _history_writer(history: CheckpointHistory, name: str | None) -> Write:
    read_at = datetime.now(UTC)

    def write(con: duckdb.DuckDBPyConnection) -> None:
        write_history(con, history, name, read_at, state_batches_counted=0)
        # the sidecar's read goes on batch by batch: its row counts every batch written so far
        con.execute(
            """
            UPDATE checkpoint_reads SET batches_written = (
                SELECT count(*) FROM batches WHERE query_id = $1 AND run_id = $2)
            WHERE query_id = $1 AND checkpoint = $3
            """,
            [history.query_id, CHECKPOINT_RUN_ID, clean(history.checkpoint)],
        )

    return write
