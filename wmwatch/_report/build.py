"""What ``wmwatch report`` says: queries over the history file, and their rendering.

Building (:func:`build_report`) and rendering (:func:`render_table`, :func:`render_json`,
:func:`render_csv`) are separate pure steps over an open DuckDB connection, so the CLI, tests and
benchmarks share them. The core summary comes from ``batches``/``operators``/``queries``; every
other part of a query's report is a :class:`Section` in :data:`SECTIONS`, loaded from its own
tables and shown only for queries with rows there. To add one (the audit and joins features do),
write a loader, a renderer and its CSV columns, and call :func:`register_section`.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wmwatch._audit.report import parquet_late_column, state_advice_from_quantile, window_grid
from wmwatch._errors import UnknownQueryError

if TYPE_CHECKING:
    import duckdb
    from rich.console import Console, RenderableType

__all__ = [
    "SECTIONS",
    "QueryRef",
    "QuerySummary",
    "Report",
    "Scope",
    "Section",
    "UnknownQueryError",
    "build_report",
    "format_duration",
    "known_queries",
    "parse_since",
    "register_section",
    "render_csv",
    "render_json",
    "render_table",
    "watermark_delay_advice",
]


@dataclass(frozen=True, slots=True)
class QueryRef:
    query_id: str
    name: str | None

    @property
    def label(self) -> str:
        return self.name or self.query_id


@dataclass(frozen=True, slots=True)
class Scope:
    """Which history a report covers: these queries, batches at or after ``since_at``.

    ``first_batch_ids`` holds each query's first batch id in scope, for tables keyed by batch
    that have no batch time of their own (late rows, audit batches).
    """

    query_ids: tuple[str, ...]
    since_at: datetime | None
    first_batch_ids: Mapping[str, int]

    def first_batch_id(self, query_id: str) -> int:
        return self.first_batch_ids.get(query_id, 0)


@dataclass(slots=True)
class QuerySummary:
    query_id: str
    query: str
    status: str
    error_class: str | None
    exception: str | None
    runs: int
    batches: int
    first_batch_id: int | None
    last_batch_id: int | None
    first_batch_at: datetime | None
    last_batch_at: datetime | None
    watermark_at: datetime | None
    watermark_lag_p50_seconds: float | None
    watermark_lag_p95_seconds: float | None
    watermark_lag_max_seconds: float | None
    event_time_delay_p50_seconds: float | None
    input_rows: int
    rows_dropped_by_watermark: int | None
    drops_count_groups: bool
    state_rows_first: int | None
    state_rows_last: int | None
    state_rows_growth: int | None
    state_rows_growth_per_hour: float | None
    state_memory_bytes_last: int | None
    state_memory_bytes_max: int | None
    operators: list[dict[str, Any]] = field(default_factory=list)
    sections: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Report:
    db: str
    generated_at: datetime
    since_at: datetime | None
    queries: list[QuerySummary]


@dataclass(frozen=True, slots=True)
class Section:
    """One optional part of each query's report, driven by its own table(s).

    ``load`` returns ``{query_id: data}`` only for queries with rows; ``data`` must be plain
    JSON-able values (datetimes allowed). ``render`` turns one query's data into a rich
    renderable; ``csv_values`` maps data (or None) to ``csv_columns``.
    """

    key: str
    title: str
    load: Callable[[duckdb.DuckDBPyConnection, Scope], Mapping[str, Any]]
    render: Callable[[Any], RenderableType]
    csv_columns: tuple[str, ...]
    csv_values: Callable[[Any], Mapping[str, Any]]


SECTIONS: list[Section] = []


def register_section(section: Section) -> None:
    """Add (or replace, by key) a report section."""
    for index, existing in enumerate(SECTIONS):
        if existing.key == section.key:
            SECTIONS[index] = section
            return
    SECTIONS.append(section)


# ---------------------------------------------------------------------------- inputs

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)\s*(w|d|h|m|min|s|sec)", re.IGNORECASE)
_DURATION = re.compile(r"^\s*(?:\d+(?:\.\d+)?\s*(?:w|d|h|m|min|s|sec)\s*)+$", re.IGNORECASE)
_UNIT_SECONDS = {"w": 604_800, "d": 86_400, "h": 3_600, "m": 60, "min": 60, "s": 1, "sec": 1}


def parse_since(text: str, *, now: datetime | None = None) -> datetime:
    """``15m``, ``2h``, ``7d``, ``1h30m`` (ago) or an ISO date/timestamp (UTC if no offset)."""
    now = now or datetime.now(UTC)
    if _DURATION.match(text):
        seconds = sum(
            float(amount) * _UNIT_SECONDS[unit.lower()]
            for amount, unit in _DURATION_PART.findall(text)
        )
        return now - timedelta(seconds=seconds)
    candidate = text.strip()
    if candidate.endswith(("Z", "z")):
        candidate = candidate[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(candidate)
    except ValueError:
        try:
            parsed_date = date.fromisoformat(candidate)
        except ValueError:
            raise ValueError(
                f"--since {text!r} is neither a duration (15m, 2h, 7d) nor an ISO timestamp "
                "(2026-01-31 or 2026-01-31T08:00:00Z)"
            ) from None
        parsed = datetime(parsed_date.year, parsed_date.month, parsed_date.day)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC)


def known_queries(con: duckdb.DuckDBPyConnection) -> list[QueryRef]:
    """Every query in the history, with its most recent name."""
    rows = con.execute(
        """
        SELECT query_id, arg_max(query_name, seen_at) FILTER (WHERE query_name IS NOT NULL)
        FROM (
            SELECT query_id, query_name, coalesce(last_progress_at, started_at) AS seen_at FROM queries
            UNION ALL
            SELECT query_id, query_name, batch_at FROM (
                SELECT query_id, arg_max(query_name, batch_id) AS query_name, max(batch_at) AS batch_at
                FROM batches GROUP BY query_id)
        )
        GROUP BY query_id
        ORDER BY 2 NULLS LAST, 1
        """
    ).fetchall()
    return [QueryRef(row[0], row[1]) for row in rows]


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


# ---------------------------------------------------------------------------- building


def build_report(
    con: duckdb.DuckDBPyConnection,
    *,
    db: str,
    query: str | None = None,
    since_at: datetime | None = None,
    now: datetime | None = None,
) -> Report:
    """Summarise the history behind ``con`` (raises UnknownQueryError for a bad ``query``)."""
    refs = select_queries(known_queries(con), query)
    names = {ref.query_id: ref.label for ref in refs}
    query_ids = tuple(names)
    summaries = _load_core(con, query_ids, since_at, names)
    scope = Scope(
        query_ids=query_ids,
        since_at=since_at,
        first_batch_ids={
            s.query_id: s.first_batch_id for s in summaries if s.first_batch_id is not None
        },
    )
    if query_ids:
        for section in SECTIONS:
            data = section.load(con, scope)
            for summary in summaries:
                summary.sections[section.key] = data.get(summary.query_id)
    return Report(
        db=db, generated_at=now or datetime.now(UTC), since_at=since_at, queries=summaries
    )


def _load_core(
    con: duckdb.DuckDBPyConnection,
    query_ids: tuple[str, ...],
    since_at: datetime | None,
    names: Mapping[str, str],
) -> list[QuerySummary]:
    if not query_ids:
        return []
    since_epoch = since_at.timestamp() if since_at else None
    batch_rows = con.execute(
        """
        SELECT query_id,
               count(*), min(batch_id), max(batch_id),
               epoch(min(batch_at)), epoch(max(batch_at)),
               epoch(arg_max(watermark_at, batch_id)),
               quantile_cont(watermark_lag_seconds, 0.5),
               quantile_cont(watermark_lag_seconds, 0.95),
               max(watermark_lag_seconds),
               quantile_cont(event_time_delay_seconds, 0.5),
               coalesce(sum(input_rows), 0),
               sum(rows_dropped_by_watermark),
               arg_min(state_rows_total, batch_id) FILTER (WHERE state_rows_total IS NOT NULL),
               arg_max(state_rows_total, batch_id) FILTER (WHERE state_rows_total IS NOT NULL),
               epoch(arg_min(batch_at, batch_id) FILTER (WHERE state_rows_total IS NOT NULL)),
               epoch(arg_max(batch_at, batch_id) FILTER (WHERE state_rows_total IS NOT NULL)),
               arg_max(state_memory_bytes, batch_id) FILTER (WHERE state_memory_bytes IS NOT NULL),
               max(state_memory_bytes),
               count(DISTINCT run_id)
        FROM batches
        WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
          AND ($2::DOUBLE IS NULL OR batch_at >= to_timestamp($2::DOUBLE))
        GROUP BY query_id
        """,
        (list(query_ids), since_epoch),
    ).fetchall()
    by_id = {row[0]: row for row in batch_rows}

    status_rows = con.execute(
        """
        SELECT query_id,
               arg_max(status, coalesce(terminated_at, last_progress_at, started_at)),
               arg_max(error_class, coalesce(terminated_at, last_progress_at, started_at)),
               arg_max(exception, coalesce(terminated_at, last_progress_at, started_at))
        FROM queries WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
        GROUP BY query_id
        """,
        (list(query_ids),),
    ).fetchall()
    statuses = {row[0]: row[1:] for row in status_rows}

    operator_rows = con.execute(
        """
        SELECT o.query_id, o.operator_id, arg_max(o.operator_name, o.batch_id),
               sum(o.rows_dropped_by_watermark),
               arg_max(o.rows_total, o.batch_id), arg_max(o.memory_used_bytes, o.batch_id)
        FROM operators o
        JOIN (SELECT query_id, min(batch_id) AS first_id FROM batches
              WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
                AND ($2::DOUBLE IS NULL OR batch_at >= to_timestamp($2::DOUBLE))
              GROUP BY query_id) f
          ON o.query_id = f.query_id AND o.batch_id >= f.first_id
        GROUP BY o.query_id, o.operator_id
        ORDER BY o.query_id, o.operator_id
        """,
        (list(query_ids), since_epoch),
    ).fetchall()
    operators: dict[str, list[dict[str, Any]]] = {}
    for qid, operator_id, name, dropped, rows_total, memory in operator_rows:
        operators.setdefault(qid, []).append(
            {
                "operator_id": operator_id,
                "operator_name": name,
                "rows_dropped_by_watermark": _int(dropped),
                "state_rows_last": _int(rows_total),
                "state_memory_bytes_last": _int(memory),
            }
        )

    summaries = []
    for qid in query_ids:
        row = by_id.get(qid)
        status, error_class, exception = statuses.get(qid, ("active", None, None))
        ops = operators.get(qid, [])
        if row is None:
            summaries.append(_empty_summary(qid, names[qid], status, error_class, exception))
            continue
        first_state, last_state = _int(row[13]), _int(row[14])
        growth = (
            last_state - first_state if first_state is not None and last_state is not None else None
        )
        span_hours = (
            (row[16] - row[15]) / 3600.0 if row[15] is not None and row[16] is not None else None
        )
        summaries.append(
            QuerySummary(
                query_id=qid,
                query=names[qid],
                status=status or "active",
                error_class=error_class,
                exception=_first_line(exception),
                runs=int(row[19]),
                batches=int(row[1]),
                first_batch_id=_int(row[2]),
                last_batch_id=_int(row[3]),
                first_batch_at=_at(row[4]),
                last_batch_at=_at(row[5]),
                watermark_at=_at(row[6]),
                watermark_lag_p50_seconds=_float(row[7]),
                watermark_lag_p95_seconds=_float(row[8]),
                watermark_lag_max_seconds=_float(row[9]),
                event_time_delay_p50_seconds=_float(row[10]),
                input_rows=int(row[11]),
                rows_dropped_by_watermark=_int(row[12]),
                drops_count_groups=any(op["operator_name"] == "stateStoreSave" for op in ops),
                state_rows_first=first_state,
                state_rows_last=last_state,
                state_rows_growth=growth,
                state_rows_growth_per_hour=(
                    growth / span_hours if growth is not None and span_hours else None
                ),
                state_memory_bytes_last=_int(row[17]),
                state_memory_bytes_max=_int(row[18]),
                operators=ops,
            )
        )
    return summaries


def _empty_summary(
    qid: str, label: str, status: str | None, error_class: str | None, exception: str | None
) -> QuerySummary:
    return QuerySummary(
        query_id=qid,
        query=label,
        status=status or "active",
        error_class=error_class,
        exception=_first_line(exception),
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


# ---------------------------------------------------------------------------- late rows section

_LATE_COLUMNS = (
    "query_id",
    "batch_id",
    "event_time_at",
    "watermark_at",
    "lateness_seconds",
    "window_start_at",
    "window_end_at",
    "source_file",
)
_LATENESS_BUCKETS: tuple[tuple[str, float], ...] = (
    ("< 1s", 1.0),
    ("1-10s", 10.0),
    ("10s-1m", 60.0),
    ("1-10m", 600.0),
    ("10m-1h", 3_600.0),
    (">= 1h", math.inf),
)


def _late_rows_source(con: duckdb.DuckDBPyConnection, scope: Scope) -> tuple[str, list[Any], int]:
    """SQL (and parameters) for every audited late row in scope, DuckDB and Parquet alike.

    Returns (sql, params, parquet directories listed but missing).
    """
    columns = ", ".join(_LATE_COLUMNS)
    # A batch over max_rows_per_batch with a Parquet overflow folder has every one of its rows
    # there and only some in late_rows: read it from Parquet alone.
    parts = [
        f"""SELECT {columns} FROM late_rows l
            WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
              AND NOT EXISTS (SELECT 1 FROM audit_batches a
                              WHERE a.query_id = l.query_id AND a.batch_id = l.batch_id
                                AND a.overflow_location IS NOT NULL)"""
    ]
    locations = con.execute(
        """
        SELECT DISTINCT coalesce(overflow_location, location) FROM audit_batches
        WHERE (sink = 'parquet' AND location IS NOT NULL OR overflow_location IS NOT NULL)
          AND query_id IN (SELECT unnest($1::VARCHAR[]))
        """,
        (list(scope.query_ids),),
    ).fetchall()
    patterns: list[str] = []
    missing = 0
    for (location,) in locations:
        local = re.sub(r"^file:(//)?", "", str(location))
        path = Path(local)
        if path.is_file():
            patterns.append(str(path))
        elif path.is_dir():
            if any(path.rglob("*.parquet")):
                patterns.append(str(path / "**" / "*.parquet"))
        else:
            missing += 1
    if patterns:
        present = {
            row[0]
            for row in con.execute(
                "DESCRIBE SELECT * FROM read_parquet($1::VARCHAR[], union_by_name = true)",
                (patterns,),
            ).fetchall()
        }
        select = ", ".join(parquet_late_column(col, present) for col in _LATE_COLUMNS)
        parts.append(
            f"""SELECT {select} FROM read_parquet($2::VARCHAR[], union_by_name = true)
                WHERE query_id IN (SELECT unnest($1::VARCHAR[]))"""
        )
    sql = " UNION ALL BY NAME ".join(f"({part})" for part in parts)
    params: list[Any] = [list(scope.query_ids)]
    if patterns:
        params.append(patterns)
    return sql, params, missing


def load_late_rows(con: duckdb.DuckDBPyConnection, scope: Scope) -> dict[str, Any]:
    """Late rows audited per query: count, per batch and window, lateness, sources, advice."""
    source_sql, params, missing = _late_rows_source(con, scope)
    first_ids = [[qid, str(scope.first_batch_id(qid))] for qid in scope.query_ids]
    scoped = f"""
        WITH first_ids AS (SELECT f[1] AS query_id, f[2]::BIGINT AS first_id
                           FROM (SELECT unnest(${len(params) + 1}::VARCHAR[][]) AS f)),
        late AS (SELECT l.*,
                   greatest(0, coalesce(epoch(l.watermark_at) - epoch(l.window_end_at),
                                        l.lateness_seconds)) AS needed_seconds
                 FROM ({source_sql}) l JOIN first_ids USING (query_id)
                 WHERE l.batch_id >= first_ids.first_id)
    """
    params = [*params, first_ids]
    # what the markers say: every late row found, and those over the cap that no table keeps
    counted = {
        row[0]: row[1:]
        for row in con.execute(
            """
            WITH first_ids AS (SELECT f[1] AS query_id, f[2]::BIGINT AS first_id
                               FROM (SELECT unnest($1::VARCHAR[][]) AS f))
            SELECT a.query_id, count(*), coalesce(sum(a.late_rows), 0),
                   coalesce(sum(a.rows_over_cap) FILTER (WHERE a.overflow_location IS NULL), 0),
                   count(*) FILTER (WHERE a.rows_over_cap > 0)
            FROM audit_batches a JOIN first_ids USING (query_id)
            WHERE a.batch_id >= first_ids.first_id
            GROUP BY a.query_id
            """,
            (first_ids,),
        ).fetchall()
    }
    totals = con.execute(
        scoped
        + """
        SELECT query_id, count(*), count(DISTINCT batch_id),
               quantile_cont(lateness_seconds, 0.5), quantile_cont(lateness_seconds, 0.95),
               max(lateness_seconds),
               quantile_cont(needed_seconds, 0.95), quantile_cont(needed_seconds, 0.99),
               max(needed_seconds)
        FROM late GROUP BY query_id
        """,
        params,
    ).fetchall()
    for qid, (_, found, _not_kept, _) in counted.items():
        if found and not any(row[0] == qid for row in totals):
            # every late row of the query was over the cap and counted only
            totals.append((qid, 0, 0, None, None, None, None, None, None))
    if not totals:
        return {}
    per_batch = _grouped(
        con.execute(
            scoped
            + """
            SELECT query_id, batch_id, count(*) AS n FROM late GROUP BY query_id, batch_id
            QUALIFY row_number() OVER (PARTITION BY query_id ORDER BY n DESC, batch_id) <= 5
            ORDER BY query_id, n DESC
            """,
            params,
        ).fetchall(),
        lambda r: {"batch_id": r[1], "late_rows": r[2]},
    )
    per_window = _grouped(
        con.execute(
            scoped
            + """
            SELECT query_id, window_start_at, window_end_at, count(*) AS n FROM late
            WHERE window_end_at IS NOT NULL GROUP BY query_id, window_start_at, window_end_at
            QUALIFY row_number() OVER (PARTITION BY query_id ORDER BY n DESC, window_start_at) <= 5
            ORDER BY query_id, n DESC
            """,
            params,
        ).fetchall(),
        lambda r: {
            "window_start_at": _aware(r[1]),
            "window_end_at": _aware(r[2]),
            "late_rows": r[3],
        },
    )
    bucket_cases = " ".join(
        f"WHEN lateness_seconds < {limit} THEN {index}"
        for index, (_, limit) in enumerate(_LATENESS_BUCKETS)
        if not math.isinf(limit)
    )
    histogram_rows = con.execute(
        scoped
        + f"""
        SELECT query_id, CASE {bucket_cases} ELSE {len(_LATENESS_BUCKETS) - 1} END AS bucket,
               count(*)
        FROM late WHERE lateness_seconds IS NOT NULL GROUP BY ALL ORDER BY ALL
        """,
        params,
    ).fetchall()
    histograms: dict[str, dict[str, int]] = {}
    for qid, bucket, count in histogram_rows:
        histogram = histograms.setdefault(qid, {label: 0 for label, _ in _LATENESS_BUCKETS})
        histogram[_LATENESS_BUCKETS[bucket][0]] = int(count)
    sources = _grouped(
        con.execute(
            scoped
            + """
            SELECT query_id, source_file, count(*) AS n FROM late
            WHERE source_file IS NOT NULL GROUP BY query_id, source_file
            QUALIFY row_number() OVER (PARTITION BY query_id ORDER BY n DESC, source_file) <= 5
            ORDER BY query_id, n DESC
            """,
            params,
        ).fetchall(),
        lambda r: {"source_file": r[1], "late_rows": r[2]},
    )
    result: dict[str, Any] = {}
    for qid, count, batches, p50, p95, max_lateness, need95, need99, need_max in totals:
        audited, _found, not_kept, over_cap_batches = counted.get(qid, (0, 0, 0, 0))
        result[qid] = {
            # the rows that can be read plus those only counted over the cap; the figures
            # below describe the rows that were kept
            "late_rows": int(count) + int(not_kept),
            "late_rows_kept": int(count),
            "late_rows_not_kept": int(not_kept),
            "batches_over_cap": int(over_cap_batches),
            "batches_with_late_rows": int(batches),
            "audited_batches": int(audited),
            "lateness_p50_seconds": _float(p50),
            "lateness_p95_seconds": _float(p95),
            "lateness_max_seconds": _float(max_lateness),
            "extra_delay_p95_seconds": _float(need95),
            "extra_delay_p99_seconds": _float(need99),
            "extra_delay_max_seconds": _float(need_max),
            "lateness_histogram": histograms.get(qid, {}),
            "top_batches": per_batch.get(qid, []),
            "top_windows": per_window.get(qid, []),
            "top_sources": sources.get(qid, []),
            "missing_parquet_locations": missing,
        }
    # what the advised extra delay costs: windows per key held open that much longer
    for qid, entry in result.items():
        windows = con.execute(
            scoped
            + f"""
            SELECT DISTINCT epoch(window_start_at), epoch(window_end_at) FROM late
            WHERE query_id = ${len(params) + 1} AND window_end_at IS NOT NULL LIMIT 5000
            """,
            [*params, qid],
        ).fetchall()
        entry["state_advice"] = state_advice_from_quantile(
            entry["extra_delay_p99_seconds"], window_grid((float(a), float(b)) for a, b in windows)
        )
    return result


def watermark_delay_advice(
    current_delay_seconds: float | None,
    extra_p95_seconds: float | None,
    extra_p99_seconds: float | None,
) -> str | None:
    """One sentence on how much more watermark delay would have kept most late rows."""
    if extra_p95_seconds is None:
        return None
    extra95 = max(extra_p95_seconds, 0.0)
    extra99 = max(extra_p99_seconds or extra95, extra95)
    if current_delay_seconds is not None and current_delay_seconds > 0:
        return (
            f"a watermark delay of about {format_duration(current_delay_seconds + extra95)} "
            f"(now ~{format_duration(current_delay_seconds)}) would have kept 95% of these rows, "
            f"{format_duration(current_delay_seconds + extra99)} 99%; each second of delay adds "
            "output latency and state"
        )
    return (
        f"about {format_duration(extra95)} more watermark delay would have kept 95% of these rows "
        f"({format_duration(extra99)} for 99%); each second of delay adds output latency and state"
    )


def _render_late_rows(data: Mapping[str, Any]) -> RenderableType:
    from rich.table import Table

    table = Table(title="late rows audited", title_justify="left", show_header=False, box=None)
    table.add_column(style="bold")
    table.add_column()
    table.add_row(
        "late rows",
        f"[yellow]{data['late_rows']:,}[/] in {data['batches_with_late_rows']:,} batches "
        f"({data['audited_batches']:,} batches audited)",
    )
    if data.get("batches_over_cap"):
        not_kept = data.get("late_rows_not_kept") or 0
        table.add_row(
            "late-row storm",
            f"[red]{data['batches_over_cap']:,} batch(es) over max_rows_per_batch[/]: "
            + (
                f"{not_kept:,} rows counted, not kept (pass parquet_path= to keep every row); "
                if not_kept
                else "every row kept in Parquet; "
            )
            + "the figures below describe the kept rows",
        )
    table.add_row(
        "lateness",
        f"p50 {format_duration(data['lateness_p50_seconds'])} · "
        f"p95 {format_duration(data['lateness_p95_seconds'])} · "
        f"max {format_duration(data['lateness_max_seconds'])}",
    )
    histogram = data.get("lateness_histogram") or {}
    if histogram:
        peak = max(histogram.values()) or 1
        table.add_row(
            "histogram",
            "\n".join(
                f"{label:>7} {'█' * max(1 if n else 0, round(20 * n / peak)):<20} {n:,}"
                for label, n in histogram.items()
            ),
        )
    if data.get("top_batches"):
        table.add_row(
            "top batches",
            ", ".join(f"#{b['batch_id']}: {b['late_rows']:,}" for b in data["top_batches"]),
        )
    if data.get("top_windows"):
        table.add_row(
            "top windows",
            "\n".join(
                f"{_fmt_at(w['window_start_at'])} - {_fmt_at(w['window_end_at'])}: {w['late_rows']:,}"
                for w in data["top_windows"]
            ),
        )
    if data.get("top_sources"):
        table.add_row(
            "top sources",
            "\n".join(f"{s['source_file']}: {s['late_rows']:,}" for s in data["top_sources"]),
        )
    if data.get("advice"):
        table.add_row("advice", f"[cyan]{data['advice']}[/]")
    if data.get("state_advice"):
        table.add_row("delay cost", f"[cyan]{data['state_advice']}[/]")
    if data.get("missing_parquet_locations"):
        table.add_row(
            "note",
            f"[red]{data['missing_parquet_locations']} Parquet audit folders listed in "
            "audit_batches are gone[/]",
        )
    return table


def _late_rows_csv(data: Mapping[str, Any] | None) -> Mapping[str, Any]:
    if not data:
        return {
            "late_rows": 0,
            "late_rows_not_kept": 0,
            "batches_with_late_rows": 0,
            "lateness_p95_seconds": None,
        }
    return {
        "late_rows": data["late_rows"],
        "late_rows_not_kept": data["late_rows_not_kept"],
        "batches_with_late_rows": data["batches_with_late_rows"],
        "lateness_p95_seconds": data["lateness_p95_seconds"],
    }


# ---------------------------------------------------------------------------- findings section


def load_findings(con: duckdb.DuckDBPyConnection, scope: Scope) -> dict[str, Any]:
    """Active findings per query, critical first, most recent first."""
    rows = con.execute(
        """
        SELECT query_id, kind, severity, operator_id, side, message, fix, occurrences,
               epoch(first_seen_at), epoch(last_seen_at), first_batch_id, last_batch_id
        FROM findings
        WHERE status = 'active' AND query_id IN (SELECT unnest($1::VARCHAR[]))
        ORDER BY query_id, severity = 'critical' DESC, last_seen_at DESC
        """,
        (list(scope.query_ids),),
    ).fetchall()
    return _grouped(
        rows,
        lambda r: {
            "kind": r[1],
            "severity": r[2],
            "operator_id": r[3],
            "side": r[4],
            "message": r[5],
            "fix": r[6],
            "occurrences": r[7],
            "first_seen_at": _at(r[8]),
            "last_seen_at": _at(r[9]),
            "first_batch_id": r[10],
            "last_batch_id": r[11],
        },
    )


def _render_findings(findings: Sequence[Mapping[str, Any]]) -> RenderableType:
    from rich.table import Table

    table = Table(title="active findings", title_justify="left", expand=False)
    table.add_column("severity")
    table.add_column("finding")
    table.add_column("fix")
    for finding in findings:
        colour = "red" if finding["severity"] == "critical" else "yellow"
        where = ""
        if finding.get("operator_id") is not None:
            where = f" (operator {finding['operator_id']}"
            where += f", {finding['side']} side)" if finding.get("side") else ")"
        table.add_row(
            f"[{colour}]{finding['severity']}[/]",
            f"[bold]{_escape(str(finding['kind']))}[/]{where}: {_escape(str(finding['message']))}\n"
            f"[dim]{finding['occurrences']}x, last seen batch {finding['last_batch_id']}[/]",
            _escape(str(finding.get("fix") or "")),
        )
    return table


def _findings_csv(findings: Sequence[Mapping[str, Any]] | None) -> Mapping[str, Any]:
    findings = findings or []
    return {
        "findings_active": len(findings),
        "findings_critical": sum(1 for f in findings if f["severity"] == "critical"),
        "findings_kinds": ";".join(sorted({f["kind"] for f in findings})),
    }


register_section(
    Section(
        key="late_rows",
        title="late rows audited",
        load=load_late_rows,
        render=_render_late_rows,
        csv_columns=(
            "late_rows",
            "late_rows_not_kept",
            "batches_with_late_rows",
            "lateness_p95_seconds",
        ),
        csv_values=_late_rows_csv,
    )
)
register_section(
    Section(
        key="findings",
        title="active findings",
        load=load_findings,
        render=_render_findings,
        csv_columns=("findings_active", "findings_critical", "findings_kinds"),
        csv_values=_findings_csv,
    )
)


# ---------------------------------------------------------------------------- watermarks section
# (owned by the joins/watermarks feature: logic in wmwatch/_inspect/watermarks.py)


def _load_watermarks(con: duckdb.DuckDBPyConnection, scope: Scope) -> Mapping[str, Any]:
    from wmwatch._inspect.watermarks import load_watermarks

    return load_watermarks(con, scope.query_ids)


def _render_watermarks(data: Mapping[str, Any]) -> RenderableType:
    from wmwatch._inspect.watermarks import render_watermarks

    return render_watermarks(data)  # type: ignore[no-any-return]


def _watermarks_csv(data: Mapping[str, Any] | None) -> Mapping[str, Any]:
    from wmwatch._inspect.watermarks import watermarks_csv

    return watermarks_csv(data)


register_section(
    Section(
        key="watermarks",
        title="watermarks per operator and input",
        load=_load_watermarks,
        render=_render_watermarks,
        csv_columns=("watermark_policy", "watermark_holding_back", "stateful_operators"),
        csv_values=_watermarks_csv,
    )
)


# ---------------------------------------------------------------------------- rendering

_CORE_CSV_COLUMNS = (
    "query",
    "query_id",
    "status",
    "error_class",
    "runs",
    "batches",
    "first_batch_id",
    "last_batch_id",
    "first_batch_at",
    "last_batch_at",
    "watermark_at",
    "watermark_lag_p50_seconds",
    "watermark_lag_p95_seconds",
    "watermark_lag_max_seconds",
    "input_rows",
    "rows_dropped_by_watermark",
    "state_rows_first",
    "state_rows_last",
    "state_rows_growth",
    "state_rows_growth_per_hour",
    "state_memory_bytes_last",
    "state_memory_bytes_max",
)


def _with_advice(summary: QuerySummary) -> None:
    late = summary.sections.get("late_rows")
    if late and "advice" not in late:
        late["advice"] = watermark_delay_advice(
            summary.event_time_delay_p50_seconds,
            late.get("extra_delay_p95_seconds"),
            late.get("extra_delay_p99_seconds"),
        )


def report_dict(report: Report) -> dict[str, Any]:
    """The report as plain JSON-able values (timestamps as ISO-8601 UTC strings)."""
    queries = []
    for summary in report.queries:
        _with_advice(summary)
        item = {
            name: getattr(summary, name) for name in QuerySummary.__slots__ if name != "sections"
        }
        item["rows_dropped_note"] = (
            "Spark counts late groups, not input rows, for aggregations"
            if summary.drops_count_groups
            else None
        )
        for section in SECTIONS:
            item[section.key] = summary.sections.get(section.key)
        queries.append(item)
    doc: dict[str, Any] = _jsonable(
        {
            "db": report.db,
            "generated_at": report.generated_at,
            "since": report.since_at,
            "queries": queries,
        }
    )
    return doc


def render_json(report: Report) -> str:
    return json.dumps(report_dict(report), indent=2, sort_keys=False, allow_nan=False) + "\n"


def render_csv(report: Report) -> str:
    """One row per query: the core summary plus each section's columns."""
    columns = list(_CORE_CSV_COLUMNS)
    for section in SECTIONS:
        columns.extend(section.csv_columns)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for summary in report.queries:
        row: dict[str, Any] = {
            name: getattr(summary, name) for name in _CORE_CSV_COLUMNS if name != "query"
        }
        row["query"] = summary.query
        for section in SECTIONS:
            row.update(section.csv_values(summary.sections.get(section.key)))
        writer.writerow({key: _csv_value(value) for key, value in row.items()})
    return out.getvalue()


def render_table(report: Report, console: Console) -> None:
    """A readable summary per query for a terminal (colour only when it is one)."""
    from rich.panel import Panel
    from rich.table import Table

    if not report.queries:
        console.print(f"no queries recorded yet in {report.db}")
        return
    scope = f" since {_fmt_at(report.since_at)}" if report.since_at else ""
    console.print(f"[bold]wmwatch report[/] for {report.db}{scope}")
    for summary in report.queries:
        _with_advice(summary)
        colour = {"failed": "red", "terminated": "dim", "active": "green"}.get(
            summary.status, "white"
        )
        status = f"[{colour}]{summary.status}[/]"
        if summary.error_class:
            status += f" ({summary.error_class})"
        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        table.add_row("status", status)
        if summary.exception:
            table.add_row("exception", f"[red]{summary.exception}[/]")
        if summary.batches == 0:
            table.add_row("batches", "none in this period")
        else:
            table.add_row(
                "batches",
                f"{summary.batches:,} (#{summary.first_batch_id}-#{summary.last_batch_id}, "
                f"{summary.runs} run{'s' if summary.runs != 1 else ''})",
            )
            table.add_row(
                "batch time",
                f"{_fmt_at(summary.first_batch_at)} → {_fmt_at(summary.last_batch_at)}",
            )
            table.add_row("watermark", _fmt_at(summary.watermark_at))
            table.add_row(
                "watermark lag",
                f"p50 {format_duration(summary.watermark_lag_p50_seconds)} · "
                f"p95 {format_duration(summary.watermark_lag_p95_seconds)} · "
                f"max {format_duration(summary.watermark_lag_max_seconds)}",
            )
            table.add_row("input rows", f"{summary.input_rows:,}")
            if summary.rows_dropped_by_watermark is not None:
                dropped = summary.rows_dropped_by_watermark
                text = f"[yellow]{dropped:,}[/]" if dropped else "0"
                if summary.drops_count_groups:
                    text += " [dim](aggregations: Spark counts late groups, not rows)[/]"
                table.add_row("dropped by watermark", text)
            if summary.state_rows_last is not None:
                growth = summary.state_rows_growth or 0
                rate = summary.state_rows_growth_per_hour
                growth_text = f"{growth:+,}" + (f", {rate:+,.0f}/h" if rate is not None else "")
                table.add_row(
                    "state rows",
                    f"{summary.state_rows_first:,} → {summary.state_rows_last:,} ({growth_text})",
                )
            if summary.state_memory_bytes_last is not None:
                table.add_row(
                    "state memory",
                    f"{format_bytes(summary.state_memory_bytes_last)} "
                    f"(max {format_bytes(summary.state_memory_bytes_max)})",
                )
        parts: list[Any] = [table]
        for section in SECTIONS:
            data = summary.sections.get(section.key)
            if data:
                parts.append(section.render(data))
        from rich.console import Group

        console.print(
            Panel(
                Group(*parts),
                title=f"[bold]{_escape(summary.query)}[/]",
                subtitle=summary.query_id if summary.query != summary.query_id else None,
                title_align="left",
                expand=False,
            )
        )


# ---------------------------------------------------------------------------- formatting helpers


def format_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    sign = "-" if seconds < 0 else ""
    value = abs(seconds)
    if value < 1:
        return f"{sign}{value * 1000:.0f}ms"
    if value < 60:
        return f"{sign}{value:.1f}s"
    if value < 3600:
        return f"{sign}{int(value // 60)}m {int(value % 60)}s"
    if value < 86_400:
        return f"{sign}{int(value // 3600)}h {int(value % 3600 // 60)}m"
    return f"{sign}{int(value // 86_400)}d {int(value % 86_400 // 3600)}h"


def format_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _fmt_at(value: datetime | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def _grouped(rows: Sequence[Sequence[Any]], make: Callable[[Sequence[Any]], Any]) -> dict[str, Any]:
    grouped: dict[str, list[Any]] = {}
    for row in rows:
        grouped.setdefault(row[0], []).append(make(row))
    return grouped


def _at(epoch_seconds: float | None) -> datetime | None:
    if epoch_seconds is None:
        return None
    return datetime.fromtimestamp(epoch_seconds, UTC)


def _aware(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


def _int(value: Any) -> int | None:
    return None if value is None else int(value)


def _float(value: Any) -> float | None:
    if value is None:
        return None
    number = float(value)
    return None if math.isnan(number) or math.isinf(number) else number


def _first_line(text: str | None) -> str | None:
    if not text:
        return None
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line[:300] or None


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        return _aware(value).isoformat().replace("+00:00", "Z")  # type: ignore[union-attr]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    return value


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, datetime):
        return _jsonable(value)
    if isinstance(value, bool):
        return str(value).lower()
    return value
