"""History from a checkpoint, written: the batches, sources and operators rows a checkpoint
gives (as the listener's progress would), and the write that keeps every batch the listener
recorded as it is, with the ``checkpoint_reads`` row."""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import TYPE_CHECKING

from wmwatch._checkpoint.history import CheckpointBatch, CheckpointHistory
from wmwatch._store.rows import BatchRow, OperatorRow, ProgressRows, SourceRow, write_progress_rows
from wmwatch._text import clean
from wmwatch._time import EPOCH, from_epoch_ms

if TYPE_CHECKING:
    import duckdb


# The run id of every batch this feature writes: the checkpoint knows no runs, and the id tells
# its rows from the listener's (which it never replaces).
CHECKPOINT_RUN_ID = "checkpoint"


def history_rows(
    history: CheckpointHistory, name: str | None, recorded_at: datetime
) -> list[ProgressRows]:
    """The batches, operators and sources rows, as the listener's progress would give them."""
    has_watermark = (
        history.has_watermark
        if history.has_watermark is not None
        else any(b.offsets.watermark_ms > 0 for b in history.batches)
    )
    rows = []
    for seq, batch in enumerate(history.batches, start=1):
        rows.append(_batch_rows(history, batch, name, recorded_at, has_watermark, seq))
    return rows


def _batch_rows(
    history: CheckpointHistory,
    batch: CheckpointBatch,
    name: str | None,
    recorded_at: datetime,
    has_watermark: bool,
    seq: int,
) -> ProgressRows:
    entry = batch.offsets
    batch_at = from_epoch_ms(entry.timestamp_ms)
    # Spark reports the epoch as the watermark of a watermarked query until it has one, and no
    # watermark at all for a query without; the checkpoint writes 0 for both
    watermark_at = from_epoch_ms(entry.watermark_ms) or (EPOCH if has_watermark else None)
    real_watermark = watermark_at is not None and watermark_at != EPOCH
    operators = tuple(
        OperatorRow(
            query_id=history.query_id,
            batch_id=entry.batch_id,
            operator_id=op.operator_id,
            operator_name=op.name,
            rows_total=history.state_rows.get((entry.batch_id, op.operator_id)),
            rows_updated=None,
            rows_removed=None,
            rows_dropped_by_watermark=None,
            memory_used_bytes=None,
            shuffle_partitions=op.partitions,
            state_store_instances=None,
            custom_metrics="{}",
            seq=seq,
        )
        for op in history.operators
    )
    counts = [op.rows_total for op in operators]
    sources = tuple(
        SourceRow(
            query_id=history.query_id,
            batch_id=entry.batch_id,
            source_index=index,
            description=f"source {index} (from the checkpoint)",
            start_offset=_start_offset(batch, index),
            end_offset=None if end is None else clean(end),
            input_rows=None,
            input_rows_per_second=None,
            processed_rows_per_second=None,
            seq=seq,
        )
        for index, end in enumerate(entry.source_offsets)
    )
    row = BatchRow(
        query_id=history.query_id,
        batch_id=entry.batch_id,
        run_id=CHECKPOINT_RUN_ID,
        query_name=name,
        batch_at=batch_at,
        watermark_at=watermark_at,
        late_watermark_at=None,  # the writer takes the previous batch's watermark
        event_time_max_at=None,
        event_time_min_at=None,
        event_time_avg_at=None,
        watermark_lag_seconds=(
            (batch_at - watermark_at).total_seconds()
            if real_watermark and batch_at is not None and watermark_at is not None
            else None
        ),
        event_time_delay_seconds=None,
        input_rows=None,
        input_rows_per_second=None,
        processed_rows_per_second=None,
        batch_duration_seconds=None,
        durations_seconds="{}",
        rows_dropped_by_watermark=None,
        state_rows_total=(
            sum(c for c in counts if c is not None)
            if counts and all(c is not None for c in counts)
            else None
        ),
        state_memory_bytes=None,
        sink_output_rows=None,
        progress_json=None,
        recorded_at=recorded_at,
        operator_count=len(operators),
        source_count=len(sources),
        seq=seq,
    )
    return ProgressRows(row, operators, sources)


def _start_offset(batch: CheckpointBatch, index: int) -> str | None:
    if batch.previous_offsets is None or index >= len(batch.previous_offsets):
        return None
    start = batch.previous_offsets[index]
    return None if start is None else clean(start)


@dataclass(frozen=True, slots=True)
class Written:
    """What one write did."""

    batches_written: int
    batches_kept: int


def listener_batches(con: duckdb.DuckDBPyConnection, query_id: str) -> tuple[set[int], str | None]:
    """The batch ids the listener recorded for the query, and the name it last had."""
    rows = con.execute(
        "SELECT batch_id, query_name FROM batches WHERE query_id = ? AND run_id <> ? "
        "ORDER BY batch_id",
        (query_id, CHECKPOINT_RUN_ID),
    ).fetchall()
    names = [name for _, name in rows if name]
    return {int(batch_id) for batch_id, _ in rows}, (names[-1] if names else None)


def write_history(
    con: duckdb.DuckDBPyConnection,
    history: CheckpointHistory,
    name: str | None,
    read_at: datetime,
    state_batches_counted: int,
) -> Written:
    """Upsert the checkpoint's batches, leaving every batch the listener recorded as it is.

    Writing the same checkpoint again replaces its own rows (the keys are the query id and batch
    id), so nothing is duplicated; a state count an earlier read made and this one did not
    (``--no-state``, ``--state-batches``) is kept.
    """
    # only the batches this history holds are looked up (a sidecar writes one at a time)
    batch_ids = [b.batch_id for b in history.batches]
    kept = {
        int(batch_id)
        for (batch_id,) in con.execute(
            "SELECT batch_id FROM batches WHERE query_id = ? AND run_id <> ? "
            "AND batch_id = ANY(?::BIGINT[])",
            (history.query_id, CHECKPOINT_RUN_ID, batch_ids),
        ).fetchall()
    }
    earlier = {
        (int(batch_id), int(operator_id)): int(rows_total)
        for batch_id, operator_id, rows_total in con.execute(
            """
            SELECT o.batch_id, o.operator_id, o.rows_total FROM operators o
            JOIN batches b USING (query_id, batch_id)
            WHERE o.query_id = ? AND b.run_id = ? AND o.rows_total IS NOT NULL
              AND o.batch_id = ANY(?::BIGINT[])
            """,
            (history.query_id, CHECKPOINT_RUN_ID, batch_ids),
        ).fetchall()
    }
    merged = replace(history, state_rows={**earlier, **history.state_rows})
    rows = history_rows(merged, name, read_at)
    items = [item for item in rows if item.batch.batch_id not in kept]
    if items:
        write_progress_rows(con, items)
        committed = {b.batch_id: b.committed for b in history.batches}
        ids = [item.batch.batch_id for item in items]
        con.execute(
            """
            UPDATE batches SET committed = c.committed
            FROM (SELECT unnest($1::BIGINT[]) AS batch_id,
                         unnest($2::BOOLEAN[]) AS committed) c
            WHERE batches.query_id = $3 AND batches.batch_id = c.batch_id
              AND batches.run_id = $4
            """,
            (ids, [committed[i] for i in ids], history.query_id, CHECKPOINT_RUN_ID),
        )
        # The checkpoint cannot tell whether the query still runs; with a listener's runs
        # recorded, theirs say it (a run's status is read by its latest time).
        con.execute(
            """
            UPDATE queries SET status = 'unknown',
                last_progress_at = CASE WHEN $3 THEN NULL ELSE last_progress_at END
            WHERE query_id = $1 AND run_id = $2
            """,
            (history.query_id, CHECKPOINT_RUN_ID, bool(kept)),
        )
    retention = history.retention
    con.execute(
        """
        INSERT OR REPLACE INTO checkpoint_reads (query_id, checkpoint, read_at,
            oldest_offsets_batch, latest_offsets_batch, oldest_commit_batch, latest_commit_batch,
            oldest_state_batch, min_batches_to_retain, batches_written, batches_kept,
            state_batches_counted)
        VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
        """,
        (
            history.query_id,
            clean(history.checkpoint),  # a URI may carry credentials
            read_at,
            retention.oldest_offsets_batch,
            retention.latest_offsets_batch,
            retention.oldest_commit_batch,
            retention.latest_commit_batch,
            retention.oldest_state_batch,
            retention.min_batches_to_retain,
            len(items),
            len(rows) - len(items),
            state_batches_counted,
        ),
    )
    return Written(batches_written=len(items), batches_kept=len(rows) - len(items))
