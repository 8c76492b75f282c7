"""The core tables' rows: queries, batches, operators and sources.

A progress snapshot becomes one :class:`BatchRow` with its :class:`OperatorRow` and
:class:`SourceRow` rows, built on the caller's thread; the writer thread stages many of them at
once and upserts them in a few statements. Snapshots and events arrive clean (redacted, valid
UTF-8, bounded), so their text is written as it is.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, NamedTuple

from wmwatch._events import QueryStarted, QueryTerminated
from wmwatch._progress import ProgressSnapshot
from wmwatch._trigger import Trigger

if TYPE_CHECKING:
    import duckdb


@dataclass(frozen=True, slots=True)
class QueryHistory:
    """What the file held for one query when the store opened it."""

    query_id: str
    query_name: str | None
    batches: int
    last_batch_id: int | None


def read_history(con: duckdb.DuckDBPyConnection) -> tuple[QueryHistory, ...]:
    """Each query's batches in the file, by query id."""
    rows = con.execute(
        """
        SELECT query_id, arg_max(query_name, batch_id), count(*), max(batch_id)
        FROM batches GROUP BY query_id ORDER BY query_id
        """
    ).fetchall()
    return tuple(
        QueryHistory(query_id, query_name, int(batches), last_batch_id)
        for query_id, query_name, batches, last_batch_id in rows
    )


# -- query lifecycle --


def write_query_started(con: duckdb.DuckDBPyConnection, event: QueryStarted) -> None:
    con.execute(
        """
        INSERT INTO queries (query_id, run_id, query_name, status, started_at)
        VALUES (?, ?, ?, 'active', ?)
        ON CONFLICT (query_id, run_id) DO UPDATE SET
            query_name = coalesce(excluded.query_name, queries.query_name),
            started_at = coalesce(excluded.started_at, queries.started_at)
        """,
        (event.query_id, event.run_id, event.name, event.started_at),
    )


def write_query_trigger(
    con: duckdb.DuckDBPyConnection, query_id: str, run_id: str, trigger: Trigger
) -> None:
    con.execute(
        """
        INSERT INTO queries (query_id, run_id, status, trigger, trigger_interval_ms)
        VALUES (?, ?, 'active', ?, ?)
        ON CONFLICT (query_id, run_id) DO UPDATE SET
            trigger = excluded.trigger,
            trigger_interval_ms = excluded.trigger_interval_ms
        """,
        (query_id, run_id, trigger.mode, trigger.interval_ms),
    )


def write_query_terminated(
    con: duckdb.DuckDBPyConnection, event: QueryTerminated, terminated_at: datetime
) -> None:
    """Record how the run ended; ``terminated_at`` stands in when the event has no time."""
    con.execute(
        """
        INSERT INTO queries (query_id, run_id, status, terminated_at, exception, error_class)
        VALUES (?, ?, ?, ?, ?, ?)
        ON CONFLICT (query_id, run_id) DO UPDATE SET
            status = excluded.status,
            terminated_at = excluded.terminated_at,
            exception = excluded.exception,
            error_class = excluded.error_class
        """,
        (
            event.query_id,
            event.run_id,
            "failed" if event.failed else "terminated",
            event.terminated_at or terminated_at,
            event.exception,
            event.error_class,
        ),
    )


# -- progress --


class BatchRow(NamedTuple):
    query_id: str
    batch_id: int
    run_id: str
    query_name: str | None
    batch_at: datetime | None
    watermark_at: datetime | None
    late_watermark_at: datetime | None
    event_time_max_at: datetime | None
    event_time_min_at: datetime | None
    event_time_avg_at: datetime | None
    watermark_lag_seconds: float | None
    event_time_delay_seconds: float | None
    input_rows: int | None
    input_rows_per_second: float | None
    processed_rows_per_second: float | None
    batch_duration_seconds: float | None
    durations_seconds: str
    rows_dropped_by_watermark: int | None
    state_rows_total: int | None
    state_memory_bytes: int | None
    sink_output_rows: int | None
    progress_json: str | None
    recorded_at: datetime
    operator_count: int
    source_count: int
    seq: int


class OperatorRow(NamedTuple):
    query_id: str
    batch_id: int
    operator_id: int
    operator_name: str
    rows_total: int | None
    rows_updated: int | None
    rows_removed: int | None
    rows_dropped_by_watermark: int | None
    memory_used_bytes: int | None
    shuffle_partitions: int | None
    state_store_instances: int | None
    custom_metrics: str
    seq: int


class SourceRow(NamedTuple):
    query_id: str
    batch_id: int
    source_index: int
    description: str
    start_offset: str | None
    end_offset: str | None
    input_rows: int | None
    input_rows_per_second: float | None
    processed_rows_per_second: float | None
    seq: int


@dataclass(frozen=True, slots=True)
class ProgressRows:
    """One progress snapshot as rows, built on the caller's thread and written in bulk."""

    batch: BatchRow
    operators: tuple[OperatorRow, ...]
    sources: tuple[SourceRow, ...]


# Columns that exist only in the staged rows: how many operators and sources the batch
# reported (to delete those a retried batch no longer has), and the order of versions of one
# batch within a flush (the last recorded wins).
_STAGING_ONLY = frozenset({"operator_count", "source_count", "seq"})
_JSON_COLUMNS = frozenset({"durations_seconds", "progress_json", "custom_metrics"})
# The DuckDB type of each staged column (a name means the same in every table).
_COLUMN_TYPES = {
    "query_id": "VARCHAR",
    "batch_id": "BIGINT",
    "run_id": "VARCHAR",
    "query_name": "VARCHAR",
    "batch_at": "TIMESTAMPTZ",
    "watermark_at": "TIMESTAMPTZ",
    "late_watermark_at": "TIMESTAMPTZ",
    "event_time_max_at": "TIMESTAMPTZ",
    "event_time_min_at": "TIMESTAMPTZ",
    "event_time_avg_at": "TIMESTAMPTZ",
    "watermark_lag_seconds": "DOUBLE",
    "event_time_delay_seconds": "DOUBLE",
    "input_rows": "BIGINT",
    "input_rows_per_second": "DOUBLE",
    "processed_rows_per_second": "DOUBLE",
    "batch_duration_seconds": "DOUBLE",
    "durations_seconds": "VARCHAR",
    "rows_dropped_by_watermark": "BIGINT",
    "state_rows_total": "BIGINT",
    "state_memory_bytes": "BIGINT",
    "sink_output_rows": "BIGINT",
    "progress_json": "VARCHAR",
    "recorded_at": "TIMESTAMPTZ",
    "operator_count": "INTEGER",
    "source_count": "INTEGER",
    "seq": "BIGINT",
    "operator_id": "INTEGER",
    "operator_name": "VARCHAR",
    "rows_total": "BIGINT",
    "rows_updated": "BIGINT",
    "rows_removed": "BIGINT",
    "memory_used_bytes": "BIGINT",
    "shuffle_partitions": "INTEGER",
    "state_store_instances": "INTEGER",
    "custom_metrics": "VARCHAR",
    "source_index": "INTEGER",
    "description": "VARCHAR",
    "start_offset": "VARCHAR",
    "end_offset": "VARCHAR",
}

_seq_for_rows = itertools.count(1)


def progress_rows(
    snapshot: ProgressSnapshot, late_watermark_at: datetime | None, recorded_at: datetime
) -> ProgressRows:
    """The rows of one snapshot, built on the caller's thread (the writer only stages them)."""
    has_operators = bool(snapshot.operators)
    # None, not 0, when no operator counted (see OperatorProgress.rows_dropped_by_watermark)
    counted = any(op.rows_dropped_by_watermark is not None for op in snapshot.operators)
    seq = next(_seq_for_rows)
    batch = BatchRow(
        query_id=snapshot.query_id,
        batch_id=snapshot.batch_id,
        run_id=snapshot.run_id,
        query_name=snapshot.name,
        batch_at=snapshot.timestamp_at,
        watermark_at=snapshot.watermark_at,
        late_watermark_at=late_watermark_at,
        event_time_max_at=snapshot.event_time_max_at,
        event_time_min_at=snapshot.event_time_min_at,
        event_time_avg_at=snapshot.event_time_avg_at,
        watermark_lag_seconds=snapshot.watermark_lag_seconds,
        event_time_delay_seconds=snapshot.event_time_delay_seconds,
        input_rows=snapshot.input_rows,
        input_rows_per_second=snapshot.input_rows_per_second,
        processed_rows_per_second=snapshot.processed_rows_per_second,
        batch_duration_seconds=snapshot.batch_duration_seconds,
        durations_seconds=json.dumps(dict(snapshot.durations_seconds), sort_keys=True),
        rows_dropped_by_watermark=snapshot.rows_dropped_by_watermark if counted else None,
        state_rows_total=snapshot.state_rows_total if has_operators else None,
        state_memory_bytes=snapshot.state_memory_bytes if has_operators else None,
        sink_output_rows=snapshot.sink_output_rows,
        progress_json=snapshot.raw_json,
        recorded_at=recorded_at,
        operator_count=len(snapshot.operators),
        source_count=len(snapshot.sources),
        seq=seq,
    )
    operators = tuple(
        OperatorRow(
            query_id=snapshot.query_id,
            batch_id=snapshot.batch_id,
            operator_id=op.operator_id,
            operator_name=op.name,
            rows_total=op.rows_total,
            rows_updated=op.rows_updated,
            rows_removed=op.rows_removed,
            rows_dropped_by_watermark=op.rows_dropped_by_watermark,
            memory_used_bytes=op.memory_used_bytes,
            shuffle_partitions=op.shuffle_partitions,
            state_store_instances=op.state_store_instances,
            custom_metrics=json.dumps(dict(op.custom_metrics), sort_keys=True),
            seq=seq,
        )
        for op in snapshot.operators
    )
    sources = tuple(
        SourceRow(
            query_id=snapshot.query_id,
            batch_id=snapshot.batch_id,
            source_index=src.index,
            description=src.description,
            start_offset=src.start_offset,
            end_offset=src.end_offset,
            input_rows=src.input_rows,
            input_rows_per_second=src.input_rows_per_second,
            processed_rows_per_second=src.processed_rows_per_second,
            seq=seq,
        )
        for src in snapshot.sources
    )
    return ProgressRows(batch, operators, sources)


def _rows_select(columns: tuple[str, ...], first_param: int = 1) -> str:
    """SQL for rows passed as one list per column: one statement that unnests the lists (far
    faster than executemany), each column cast to its stored type."""
    return "SELECT " + ", ".join(
        f"unnest(${first_param + i}::{_COLUMN_TYPES[name]}[]) AS {name}"
        for i, name in enumerate(columns)
    )


def _column_lists(columns: tuple[str, ...], rows: list[Any]) -> list[list[Any]]:
    return [list(col) for col in zip(*rows, strict=True)] if rows else [[] for _ in columns]


def _stage(
    con: duckdb.DuckDBPyConnection,
    table: str,
    columns: tuple[str, ...],
    rows: list[Any],
) -> None:
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE {table} AS {_rows_select(columns)}",
        _column_lists(columns, rows),
    )


def _stored(columns: tuple[str, ...]) -> list[str]:
    return [name for name in columns if name not in _STAGING_ONLY]


def _selected(alias: str, name: str) -> str:
    return f"{alias}.{name}::JSON" if name in _JSON_COLUMNS else f"{alias}.{name}"


def _insert_rows(
    con: duckdb.DuckDBPyConnection,
    table: str,
    fields: tuple[str, ...],
    rows: list[Any],
    *,
    replace: bool,
) -> None:
    """Insert (``replace``: or replace) the rows of one table straight from column lists."""
    if not rows:
        return
    names = _stored(fields)
    verb = "INSERT OR REPLACE" if replace else "INSERT"
    con.execute(
        f"{verb} INTO {table} ({', '.join(names)}) "
        f"SELECT {', '.join(_selected('r', n) for n in names)} FROM ({_rows_select(fields)}) r",
        _column_lists(fields, rows),
    )


def _latest_versions(items: list[ProgressRows]) -> list[ProgressRows]:
    """One version of each batch (a batch retried within the flush keeps its last one)."""
    latest: dict[tuple[str, int], ProgressRows] = {}
    for item in items:
        key = (item.batch.query_id, item.batch.batch_id)
        known = latest.get(key)
        if known is None or item.batch.seq > known.batch.seq:
            latest[key] = item
    return list(latest.values())


def _any_recorded(con: duckdb.DuckDBPyConnection, batches: list[BatchRow]) -> bool:
    """Whether any of ``batches`` has rows in the file already (a retried batch, a rewrite;
    operators or sources of a batch whose own row was lost count too)."""
    keys = (
        "(SELECT unnest($1::VARCHAR[]) AS query_id, unnest($2::BIGINT[]) AS batch_id) s "
        "USING (query_id, batch_id)"
    )
    found = con.execute(
        f"SELECT 1 FROM (SELECT query_id, batch_id FROM batches JOIN {keys} "
        f"UNION ALL SELECT query_id, batch_id FROM operators JOIN {keys} "
        f"UNION ALL SELECT query_id, batch_id FROM sources JOIN {keys}) LIMIT 1",
        [[b.query_id for b in batches], [b.batch_id for b in batches]],
    ).fetchone()
    return found is not None


def write_progress_rows(con: duckdb.DuckDBPyConnection, items: list[ProgressRows]) -> None:
    """Upsert many snapshots at once; a batch retried within the flush keeps its last version.

    Batches are almost always new: then every row is a plain insert from column lists (a
    handful of statements per flush, whatever its size). A flush holding a batch already in
    the file replaces it, and its operators and sources, in full.
    """
    kept = _latest_versions(items)
    batches = [item.batch for item in kept]
    operators = [r for item in kept for r in item.operators]
    sources = [r for item in kept for r in item.sources]
    rewrite = _any_recorded(con, batches)
    if rewrite or any(b.late_watermark_at is None for b in batches):
        _write_batches_joined(con, batches, replace=rewrite)
    else:
        _insert_rows(con, "batches", BatchRow._fields, batches, replace=False)
    _insert_rows(con, "operators", OperatorRow._fields, operators, replace=rewrite)
    _insert_rows(con, "sources", SourceRow._fields, sources, replace=rewrite)
    if rewrite:
        _drop_rows_a_batch_no_longer_has(con, batches)
    _record_queries(con, batches)


def _write_batches_joined(
    con: duckdb.DuckDBPyConnection, batches: list[BatchRow], *, replace: bool
) -> None:
    """The batches, each without a late-row watermark taking the previous batch's."""
    _stage(con, "wmwatch_stage_batches", BatchRow._fields, batches)
    batch_columns = _stored(BatchRow._fields)
    select = ", ".join(
        "coalesce(s.late_watermark_at, ps.watermark_at, pb.watermark_at)"
        if name == "late_watermark_at"
        else _selected("s", name)
        for name in batch_columns
    )
    verb = "INSERT OR REPLACE" if replace else "INSERT"
    # The previous batch's watermark is the one Spark's late-row filter used for this batch;
    # it may be in this flush (ps) or already in the file (pb).
    con.execute(
        f"""
        {verb} INTO batches ({", ".join(batch_columns)})
        SELECT {select}
        FROM wmwatch_stage_batches s
        LEFT JOIN wmwatch_stage_batches ps
               ON ps.query_id = s.query_id AND ps.batch_id = s.batch_id - 1
        LEFT JOIN (SELECT query_id, batch_id, watermark_at FROM batches
                   WHERE batch_id >= (SELECT min(batch_id) - 1 FROM wmwatch_stage_batches)) pb
               ON pb.query_id = s.query_id AND pb.batch_id = s.batch_id - 1
        """
    )


def _drop_rows_a_batch_no_longer_has(
    con: duckdb.DuckDBPyConnection, batches: list[BatchRow]
) -> None:
    """A retried batch that reports fewer operators or sources than its first attempt."""
    counts = [
        [b.query_id for b in batches],
        [b.batch_id for b in batches],
        [b.operator_count for b in batches],
        [b.source_count for b in batches],
    ]
    rewritten = (
        "(SELECT unnest($1::VARCHAR[]) AS query_id, unnest($2::BIGINT[]) AS batch_id, "
        "unnest($3::INTEGER[]) AS operator_count, unnest($4::INTEGER[]) AS source_count)"
    )
    con.execute(
        f"""
        DELETE FROM operators o USING {rewritten} s
        WHERE o.query_id = s.query_id AND o.batch_id = s.batch_id
          AND o.operator_id >= s.operator_count
        """,
        counts,
    )
    con.execute(
        f"""
        DELETE FROM sources o USING {rewritten} s
        WHERE o.query_id = s.query_id AND o.batch_id = s.batch_id
          AND o.source_index >= s.source_count
        """,
        counts,
    )


def _record_queries(con: duckdb.DuckDBPyConnection, batches: list[BatchRow]) -> None:
    """Each run's row in ``queries``: its name, newest batch and last progress time."""
    runs: dict[tuple[str, str], tuple[int, str | None, int, datetime]] = {}
    for b in batches:
        at = b.batch_at or b.recorded_at
        key = (b.query_id, b.run_id)
        known = runs.get(key)
        if known is None:
            runs[key] = (b.seq, b.query_name, b.batch_id, at)
        else:
            seq, name, last, latest_at = known
            runs[key] = (
                max(seq, b.seq),
                b.query_name if b.seq > seq else name,
                max(last, b.batch_id),
                max(latest_at, at),
            )
    keys = list(runs)
    con.execute(
        """
        INSERT INTO queries (query_id, run_id, query_name, status, last_batch_id, last_progress_at)
        SELECT unnest($1::VARCHAR[]), unnest($2::VARCHAR[]), unnest($3::VARCHAR[]), 'active',
               unnest($4::BIGINT[]), unnest($5::TIMESTAMPTZ[])
        ON CONFLICT (query_id, run_id) DO UPDATE SET
            query_name = coalesce(excluded.query_name, queries.query_name),
            last_batch_id = greatest(coalesce(queries.last_batch_id, -1), excluded.last_batch_id),
            last_progress_at = greatest(queries.last_progress_at, excluded.last_progress_at)
        """,
        [
            [q for q, _ in keys],
            [r for _, r in keys],
            [runs[k][1] for k in keys],
            [runs[k][2] for k in keys],
            [runs[k][3] for k in keys],
        ],
    )
