"""Building a report: which queries and batches it covers, their core summary, their sections.

The core summary comes from the ``queries``, ``batches`` and ``operators`` tables; every other
part of a query's report is a :class:`~wmwatch._report.model.Section` loaded by the feature that
owns its tables (see :mod:`wmwatch._report.sections`). Building is a pure step over an open
DuckDB connection, so the CLI, tests and benchmarks share it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from wmwatch._errors import UnknownQueryError
from wmwatch._report.model import QueryRef, Report
from wmwatch._report.sections import SECTIONS
from wmwatch._section import QuerySummary, Row, Scope, Section, as_float, as_int, named_rows
from wmwatch._text import first_line
from wmwatch._time import from_epoch_seconds, parse_duration_us, parse_timestamp

if TYPE_CHECKING:
    import duckdb

__all__ = ["build_report", "known_queries", "parse_since", "select_queries"]


def parse_since(text: str, *, now: datetime | None = None) -> datetime:
    """``15m``, ``2h``, ``7d``, ``1h30m`` (ago) or an ISO date/timestamp (UTC if no offset)."""
    # a minus sign makes it an ISO date or a negative duration: never a time ago
    if "-" not in text:
        try:
            ago_us = parse_duration_us(text)
        except ValueError:
            pass
        else:
            return (now or datetime.now(UTC)) - timedelta(microseconds=ago_us)
    parsed = parse_timestamp(text)
    if parsed is None:
        raise ValueError(
            f"--since {text!r} is neither a duration (15m, 2h, 7d) nor an ISO timestamp "
            "(2026-01-31 or 2026-01-31T08:00:00Z)"
        )
    return parsed


def known_queries(con: duckdb.DuckDBPyConnection) -> list[QueryRef]:
    """Every query in the history, with its most recent name."""
    rows = con.execute(
        """
        SELECT query_id, arg_max(query_name, seen_at) FILTER (WHERE query_name IS NOT NULL)
        FROM (
            SELECT query_id, query_name, coalesce(last_progress_at, started_at) AS seen_at
            FROM queries
            UNION ALL
            SELECT query_id, query_name, batch_at FROM (
                SELECT query_id, arg_max(query_name, batch_id) AS query_name,
                       max(batch_at) AS batch_at
                FROM batches GROUP BY query_id)
        )
        GROUP BY query_id
        ORDER BY 2 NULLS LAST, 1
        """
    ).fetchall()
    return [QueryRef(query_id, name) for query_id, name in rows]


def select_queries(known: Sequence[QueryRef], wanted: str | None) -> list[QueryRef]:
    """``wanted`` as a name or an id (all queries if None); UnknownQueryError otherwise."""
    if wanted is None:
        return list(known)
    chosen = [ref for ref in known if wanted in (ref.query_id, ref.name)]
    if chosen:
        return chosen
    listing = ", ".join(ref.label for ref in known[:20]) or "none recorded yet"
    if len(known) > 20:
        listing += f", ... ({len(known)} in all)"
    raise UnknownQueryError(
        f"no query named or with id {wanted!r} in the history; known: {listing}"
    )


def build_report(
    con: duckdb.DuckDBPyConnection,
    *,
    db: str,
    query: str | None = None,
    since_at: datetime | None = None,
    now: datetime | None = None,
    sections: tuple[Section, ...] = SECTIONS,
) -> Report:
    """Summarise the history behind ``con`` (raises UnknownQueryError for a bad ``query``)."""
    refs = select_queries(known_queries(con), query)
    names = {ref.query_id: ref.label for ref in refs}
    query_ids = tuple(names)
    summaries = _load_core(con, query_ids, since_at, names)
    scope = Scope(
        query_ids=query_ids,
        since_at=since_at,
        summaries={summary.query_id: summary for summary in summaries},
    )
    if query_ids:
        for section in sections:
            data = section.load(con, scope)
            for summary in summaries:
                summary.sections[section.key] = data.get(summary.query_id)
    return Report(
        db=db,
        generated_at=now or datetime.now(UTC),
        since_at=since_at,
        queries=summaries,
        sections=sections,
    )


# -- core summary ---------------------------------------------------------------------------------

_BATCH_STATS_SQL = """
    SELECT query_id,
           count(*) AS batches,
           count(DISTINCT run_id) AS runs,
           min(batch_id) AS first_batch_id,
           max(batch_id) AS last_batch_id,
           epoch(min(batch_at)) AS first_batch_epoch_seconds,
           epoch(max(batch_at)) AS last_batch_epoch_seconds,
           epoch(arg_max(watermark_at, batch_id)) AS watermark_epoch_seconds,
           quantile_cont(watermark_lag_seconds, 0.5) AS watermark_lag_p50_seconds,
           quantile_cont(watermark_lag_seconds, 0.95) AS watermark_lag_p95_seconds,
           max(watermark_lag_seconds) AS watermark_lag_max_seconds,
           quantile_cont(event_time_delay_seconds, 0.5) AS event_time_delay_p50_seconds,
           coalesce(sum(input_rows), 0) AS input_rows_total,
           sum(rows_dropped_by_watermark) AS rows_dropped_total,
           arg_min(state_rows_total, batch_id) FILTER (WHERE state_rows_total IS NOT NULL)
               AS state_rows_first,
           arg_max(state_rows_total, batch_id) FILTER (WHERE state_rows_total IS NOT NULL)
               AS state_rows_last,
           epoch(arg_min(batch_at, batch_id) FILTER (WHERE state_rows_total IS NOT NULL))
               AS state_rows_first_epoch_seconds,
           epoch(arg_max(batch_at, batch_id) FILTER (WHERE state_rows_total IS NOT NULL))
               AS state_rows_last_epoch_seconds,
           arg_max(state_memory_bytes, batch_id) FILTER (WHERE state_memory_bytes IS NOT NULL)
               AS state_memory_bytes_last,
           max(state_memory_bytes) AS state_memory_bytes_max
    FROM batches
    WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
      AND ($2::DOUBLE IS NULL OR batch_at >= to_timestamp($2::DOUBLE))
    GROUP BY query_id
"""

_STATUS_SQL = """
    SELECT query_id,
           arg_max(status, coalesce(terminated_at, last_progress_at, started_at)) AS status,
           arg_max(error_class, coalesce(terminated_at, last_progress_at, started_at))
               AS error_class,
           arg_max(exception, coalesce(terminated_at, last_progress_at, started_at))
               AS exception,
           arg_max(trigger, coalesce(last_progress_at, started_at, terminated_at))
               FILTER (WHERE trigger IS NOT NULL) AS trigger,
           arg_max(trigger_interval_ms, coalesce(last_progress_at, started_at, terminated_at))
               FILTER (WHERE trigger IS NOT NULL) AS trigger_interval_ms
    FROM queries WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
    GROUP BY query_id
"""

_OPERATORS_SQL = """
    SELECT o.query_id, o.operator_id,
           arg_max(o.operator_name, o.batch_id) AS operator_name,
           sum(o.rows_dropped_by_watermark) AS rows_dropped_total,
           arg_max(o.rows_total, o.batch_id) AS rows_total_last,
           arg_max(o.memory_used_bytes, o.batch_id) AS memory_used_bytes_last
    FROM operators o
    JOIN (SELECT query_id, min(batch_id) AS first_id FROM batches
          WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
            AND ($2::DOUBLE IS NULL OR batch_at >= to_timestamp($2::DOUBLE))
          GROUP BY query_id) f
      ON o.query_id = f.query_id AND o.batch_id >= f.first_id
    GROUP BY o.query_id, o.operator_id
    ORDER BY o.query_id, o.operator_id
"""


def _load_core(
    con: duckdb.DuckDBPyConnection,
    query_ids: tuple[str, ...],
    since_at: datetime | None,
    names: Mapping[str, str],
) -> list[QuerySummary]:
    if not query_ids:
        return []
    since_epoch_seconds = since_at.timestamp() if since_at else None
    stats = {
        row["query_id"]: row
        for row in named_rows(con, _BATCH_STATS_SQL, (list(query_ids), since_epoch_seconds))
    }
    statuses = {row["query_id"]: row for row in named_rows(con, _STATUS_SQL, (list(query_ids),))}
    operators: dict[str, list[dict[str, Any]]] = {}
    for row in named_rows(con, _OPERATORS_SQL, (list(query_ids), since_epoch_seconds)):
        operators.setdefault(row["query_id"], []).append(
            {
                "operator_id": row["operator_id"],
                "operator_name": row["operator_name"],
                "rows_dropped_by_watermark": as_int(row["rows_dropped_total"]),
                "state_rows_last": as_int(row["rows_total_last"]),
                "state_memory_bytes_last": as_int(row["memory_used_bytes_last"]),
            }
        )
    return [
        _summary(
            query_id,
            names[query_id],
            statuses.get(query_id, {}),
            stats.get(query_id),
            operators.get(query_id, []),
        )
        for query_id in query_ids
    ]


def _summary(
    query_id: str,
    label: str,
    status: Row,
    stats: Row | None,
    operators: list[dict[str, Any]],
) -> QuerySummary:
    summary = QuerySummary(
        query_id=query_id,
        query=label,
        status=status.get("status") or "active",
        error_class=status.get("error_class"),
        exception=first_line(status.get("exception")),
        trigger=status.get("trigger") or "unknown",
        trigger_interval_seconds=(
            status["trigger_interval_ms"] / 1000.0
            if status.get("trigger_interval_ms") is not None
            else None
        ),
        runs=0,
        batches=0,
        first_batch_id=None,
        last_batch_id=None,
        first_batch_at=None,
        last_batch_at=None,
        watermark_at=None,
        watermark_lag_p50_seconds=None,
        watermark_lag_p95_seconds=None,
        watermark_lag_max_seconds=None,
        event_time_delay_p50_seconds=None,
        input_rows=0,
        rows_dropped_by_watermark=None,
        drops_count_groups=False,
        state_rows_first=None,
        state_rows_last=None,
        state_rows_growth=None,
        state_rows_growth_per_hour=None,
        state_memory_bytes_last=None,
        state_memory_bytes_max=None,
    )
    if stats is None:
        return summary
    first_state, last_state = as_int(stats["state_rows_first"]), as_int(stats["state_rows_last"])
    growth = (
        last_state - first_state if first_state is not None and last_state is not None else None
    )
    state_first_at = stats["state_rows_first_epoch_seconds"]
    state_last_at = stats["state_rows_last_epoch_seconds"]
    span_hours = (
        (state_last_at - state_first_at) / 3600.0
        if state_first_at is not None and state_last_at is not None
        else None
    )
    summary.runs = int(stats["runs"])
    summary.batches = int(stats["batches"])
    summary.first_batch_id = as_int(stats["first_batch_id"])
    summary.last_batch_id = as_int(stats["last_batch_id"])
    summary.first_batch_at = from_epoch_seconds(stats["first_batch_epoch_seconds"])
    summary.last_batch_at = from_epoch_seconds(stats["last_batch_epoch_seconds"])
    summary.watermark_at = from_epoch_seconds(stats["watermark_epoch_seconds"])
    summary.watermark_lag_p50_seconds = as_float(stats["watermark_lag_p50_seconds"])
    summary.watermark_lag_p95_seconds = as_float(stats["watermark_lag_p95_seconds"])
    summary.watermark_lag_max_seconds = as_float(stats["watermark_lag_max_seconds"])
    summary.event_time_delay_p50_seconds = as_float(stats["event_time_delay_p50_seconds"])
    summary.input_rows = int(stats["input_rows_total"])
    summary.rows_dropped_by_watermark = as_int(stats["rows_dropped_total"])
    summary.drops_count_groups = any(op["operator_name"] == "stateStoreSave" for op in operators)
    summary.state_rows_first = first_state
    summary.state_rows_last = last_state
    summary.state_rows_growth = growth
    summary.state_rows_growth_per_hour = (
        growth / span_hours if growth is not None and span_hours else None
    )
    summary.state_memory_bytes_last = as_int(stats["state_memory_bytes_last"])
    summary.state_memory_bytes_max = as_int(stats["state_memory_bytes_max"])
    summary.operators = operators
    return summary
