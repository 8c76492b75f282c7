"""Loading the late-rows section from the history: the audited late rows in scope, DuckDB and
Parquet alike (:mod:`wmwatch._audit.report.folders`), per query, batch, window, input and
lateness, with the advice (:mod:`wmwatch._audit.report.advice`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from wmwatch._audit.report.advice import (
    state_advice_from_quantile,
    watermark_delay_advice,
    window_grid,
)
from wmwatch._audit.report.folders import (
    audit_folder,
    parquet_files,
    parquet_late_column,
    parquet_locations,
    readable_files,
)
from wmwatch._section import Row, Scope, as_float, as_int, grouped, named_rows
from wmwatch._time import as_utc

if TYPE_CHECKING:
    import duckdb


# one entry of audit_batches.late_rows_by_input
_INPUT_JSON = (
    '[{"operator_index": "INTEGER", "kind": "VARCHAR", "side": "VARCHAR", '
    '"source_index": "INTEGER", "rows": "BIGINT", "payload_missing": "VARCHAR"}]'
)


# every input entry of the markers in scope ($1: [query id, first batch id] pairs)
_INPUTS = f"""WITH first_ids AS (SELECT f[1] AS query_id, f[2]::BIGINT AS first_id
                               FROM (SELECT unnest($1::VARCHAR[][]) AS f)),
            inputs AS (
                SELECT a.query_id, unnest(from_json(a.late_rows_by_input, '{_INPUT_JSON}')) AS i
                FROM audit_batches a JOIN first_ids USING (query_id)
                WHERE a.batch_id >= first_ids.first_id AND a.late_rows_by_input IS NOT NULL)"""


_LATE_COLUMNS = (
    "query_id",
    "batch_id",
    "event_time_at",
    "watermark_at",
    "lateness_seconds",
    "window_start_at",
    "window_end_at",
    "source_file",
    "operator_kind",
    "operator_index",
    "join_side",
    "join_key",
)


_LATENESS_BUCKETS: tuple[tuple[str, float], ...] = (
    ("< 1s", 1.0),
    ("1-10s", 10.0),
    ("10s-1m", 60.0),
    ("1-10m", 600.0),
    ("10m-1h", 3_600.0),
    (">= 1h", math.inf),
)


def late_rows_source(con: duckdb.DuckDBPyConnection, scope: Scope) -> tuple[str, list[Any], int]:
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
    # exact file names, never a glob: the reader's connection may open these files only
    readable = readable_files(con)
    files: list[str] = []
    missing = 0
    for query_id, location in parquet_locations(con, scope.query_ids):
        folder = audit_folder(location, query_id)
        if folder is None or not folder.is_dir():
            missing += 1
            continue
        # a batch the running audit wrote after the connection was opened is left for the next
        # report (its files were not made readable)
        files.extend(f for f in parquet_files(folder) if readable is None or f in readable)
    if files:
        present = {
            row["column_name"]
            for row in named_rows(
                con,
                "DESCRIBE SELECT * FROM read_parquet($1::VARCHAR[], union_by_name = true)",
                (files,),
            )
        }
        select = ", ".join(parquet_late_column(col, present) for col in _LATE_COLUMNS)
        parts.append(
            f"""SELECT {select} FROM read_parquet($2::VARCHAR[], union_by_name = true)
                WHERE query_id IN (SELECT unnest($1::VARCHAR[]))"""
        )
    sql = " UNION ALL BY NAME ".join(f"({part})" for part in parts)
    params: list[Any] = [list(scope.query_ids)]
    if files:
        params.append(files)
    return sql, params, missing


def load_late_rows(con: duckdb.DuckDBPyConnection, scope: Scope) -> dict[str, Any]:
    """Late rows audited per query: count, per batch and window, lateness, sources, advice."""
    source_sql, params, missing = late_rows_source(con, scope)
    first_ids = [[qid, str(scope.first_batch_id(qid))] for qid in scope.query_ids]
    # needed_seconds: how much more delay would have kept the row; the watermark had to stay
    # below the window's end (aggregations) or below the event time (deduplication)
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
        row["query_id"]: row
        for row in named_rows(
            con,
            """
            WITH first_ids AS (SELECT f[1] AS query_id, f[2]::BIGINT AS first_id
                               FROM (SELECT unnest($1::VARCHAR[][]) AS f))
            SELECT a.query_id,
                   count(*) AS audited_batches,
                   coalesce(sum(a.late_rows), 0) AS late_rows_found,
                   coalesce(sum(a.rows_over_cap) FILTER (WHERE a.overflow_location IS NULL), 0)
                       AS late_rows_not_kept,
                   count(*) FILTER (WHERE a.rows_over_cap > 0) AS batches_over_cap,
                   sum(a.rows_kept_behind_watermark) AS rows_kept_behind_watermark,
                   count(*) FILTER (WHERE a.late_rows_by_input LIKE '%payload_missing%')
                       AS batches_without_payload
            FROM audit_batches a JOIN first_ids USING (query_id)
            WHERE a.batch_id >= first_ids.first_id
            GROUP BY a.query_id
            """,
            (first_ids,),
        )
    }
    totals = named_rows(
        con,
        scoped
        + """
        SELECT query_id,
               count(*) AS late_rows_kept,
               count(DISTINCT batch_id) AS batches_with_late_rows,
               quantile_cont(lateness_seconds, 0.5) AS lateness_p50_seconds,
               quantile_cont(lateness_seconds, 0.95) AS lateness_p95_seconds,
               max(lateness_seconds) AS lateness_max_seconds,
               quantile_cont(needed_seconds, 0.95) AS extra_delay_p95_seconds,
               quantile_cont(needed_seconds, 0.99) AS extra_delay_p99_seconds,
               max(needed_seconds) AS extra_delay_max_seconds
        FROM late GROUP BY query_id
        """,
        params,
    )
    for qid, marks in counted.items():
        found = marks["late_rows_found"] or marks["batches_without_payload"]
        if found and not any(row["query_id"] == qid for row in totals):
            # every late row of the query was over the cap and counted only
            totals.append(_no_rows_kept(qid))
    if not totals:
        return {}
    per_batch = grouped(
        named_rows(
            con,
            scoped
            + """
            SELECT query_id, batch_id, count(*) AS late_rows FROM late GROUP BY query_id, batch_id
            QUALIFY row_number() OVER (PARTITION BY query_id ORDER BY late_rows DESC, batch_id) <= 5
            ORDER BY query_id, late_rows DESC
            """,
            params,
        ),
        lambda r: {"batch_id": r["batch_id"], "late_rows": r["late_rows"]},
    )
    per_window = grouped(
        named_rows(
            con,
            scoped
            + """
            SELECT query_id, window_start_at, window_end_at, count(*) AS late_rows FROM late
            WHERE window_end_at IS NOT NULL GROUP BY query_id, window_start_at, window_end_at
            QUALIFY row_number() OVER (PARTITION BY query_id
                                       ORDER BY late_rows DESC, window_start_at) <= 5
            ORDER BY query_id, late_rows DESC
            """,
            params,
        ),
        lambda r: {
            "window_start_at": as_utc(r["window_start_at"]),
            "window_end_at": as_utc(r["window_end_at"]),
            "late_rows": r["late_rows"],
        },
    )
    bucket_cases = " ".join(
        f"WHEN lateness_seconds < {limit} THEN {index}"
        for index, (_, limit) in enumerate(_LATENESS_BUCKETS)
        if not math.isinf(limit)
    )
    histograms: dict[str, dict[str, int]] = {}
    for row in named_rows(
        con,
        scoped
        + f"""
        SELECT query_id,
               CASE {bucket_cases} ELSE {len(_LATENESS_BUCKETS) - 1} END AS bucket,
               count(*) AS late_rows
        FROM late WHERE lateness_seconds IS NOT NULL GROUP BY ALL ORDER BY ALL
        """,
        params,
    ):
        histogram = histograms.setdefault(
            row["query_id"], {label: 0 for label, _ in _LATENESS_BUCKETS}
        )
        histogram[_LATENESS_BUCKETS[row["bucket"]][0]] = int(row["late_rows"])
    sources = grouped(
        named_rows(
            con,
            scoped
            + """
            SELECT query_id, source_file, count(*) AS late_rows FROM late
            WHERE source_file IS NOT NULL GROUP BY query_id, source_file
            QUALIFY row_number() OVER (PARTITION BY query_id
                                       ORDER BY late_rows DESC, source_file) <= 5
            ORDER BY query_id, late_rows DESC
            """,
            params,
        ),
        lambda r: {"source_file": r["source_file"], "late_rows": r["late_rows"]},
    )
    # every late row found per operator and join side, from the markers (rows over the cap too)
    by_operator = grouped(
        named_rows(
            con,
            """
            {_INPUTS}
            SELECT query_id, i.operator_index AS operator_index, i.kind AS kind, i.side AS side,
                   sum(i.rows) AS late_rows
            FROM inputs WHERE i.payload_missing IS NULL
            GROUP BY ALL ORDER BY query_id, operator_index, side NULLS FIRST
            """.replace("{_INPUTS}", _INPUTS),
            (first_ids,),
        ),
        lambda r: {
            "operator_index": r["operator_index"],
            "kind": r["kind"],
            "side": r["side"],
            "late_rows": int(r["late_rows"]),
        },
    )
    # inputs the audit could not read again: Spark's count of what their operator dropped
    without_payload = grouped(
        named_rows(
            con,
            """
            {_INPUTS}
            SELECT query_id, i.source_index AS source_index, i.operator_index AS operator_index,
                   any_value(i.payload_missing) AS reason, sum(i.rows) AS rows,
                   count(*) FILTER (WHERE i.rows IS NULL) AS batches_uncounted
            FROM inputs WHERE i.payload_missing IS NOT NULL
            GROUP BY ALL ORDER BY query_id, source_index
            """.replace("{_INPUTS}", _INPUTS),
            (first_ids,),
        ),
        lambda r: {
            "source_index": r["source_index"],
            "operator_index": r["operator_index"],
            "reason": r["reason"],
            "rows_dropped": as_int(r["rows"]),
            "batches_uncounted": int(r["batches_uncounted"]),
        },
    )
    # the join keys whose matches the late rows lost, per side (rows that were kept)
    lost_matches = grouped(
        named_rows(
            con,
            scoped
            + """
            SELECT query_id, operator_index, join_side, join_key, count(*) AS late_rows
            FROM late WHERE join_key IS NOT NULL
            GROUP BY query_id, operator_index, join_side, join_key
            QUALIFY row_number() OVER (PARTITION BY query_id, operator_index, join_side
                                       ORDER BY late_rows DESC, join_key) <= 5
            ORDER BY query_id, operator_index, join_side, late_rows DESC
            """,
            params,
        ),
        lambda r: {
            "operator_index": r["operator_index"],
            "side": r["join_side"],
            "join_key": r["join_key"],
            "late_rows": r["late_rows"],
        },
    )
    result: dict[str, Any] = {}
    for row in totals:
        qid = row["query_id"]
        marks = counted.get(qid, {})
        kept, not_kept = int(row["late_rows_kept"]), int(marks.get("late_rows_not_kept", 0))
        result[qid] = {
            # the rows that can be read plus those only counted over the cap; the figures
            # below describe the rows that were kept
            "late_rows": kept + not_kept,
            "late_rows_kept": kept,
            "late_rows_not_kept": not_kept,
            "batches_over_cap": int(marks.get("batches_over_cap", 0)),
            "batches_with_late_rows": int(row["batches_with_late_rows"]),
            "audited_batches": int(marks.get("audited_batches", 0)),
            # rows kept although the watermark their batch reported had passed them (counted
            # for real-time queries; None where not counted)
            "rows_kept_behind_watermark": as_int(marks.get("rows_kept_behind_watermark")),
            "lateness_p50_seconds": as_float(row["lateness_p50_seconds"]),
            "lateness_p95_seconds": as_float(row["lateness_p95_seconds"]),
            "lateness_max_seconds": as_float(row["lateness_max_seconds"]),
            "extra_delay_p95_seconds": as_float(row["extra_delay_p95_seconds"]),
            "extra_delay_p99_seconds": as_float(row["extra_delay_p99_seconds"]),
            "extra_delay_max_seconds": as_float(row["extra_delay_max_seconds"]),
            "lateness_histogram": histograms.get(qid, {}),
            "top_batches": per_batch.get(qid, []),
            "top_windows": per_window.get(qid, []),
            "top_sources": sources.get(qid, []),
            "by_operator": by_operator.get(qid, []),
            "lost_matches": lost_matches.get(qid, []),
            "without_payload": without_payload.get(qid, []),
            "missing_parquet_locations": missing,
        }
    for qid, entry in result.items():
        # what the advised extra delay costs: windows per key held open that much longer
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
        summary = scope.summaries.get(qid)
        entry["advice"] = watermark_delay_advice(
            summary.event_time_delay_p50_seconds if summary is not None else None,
            entry["extra_delay_p95_seconds"],
            entry["extra_delay_p99_seconds"],
        )
    return result


def _no_rows_kept(query_id: str) -> Row:
    return {
        "query_id": query_id,
        "late_rows_kept": 0,
        "batches_with_late_rows": 0,
        "lateness_p50_seconds": None,
        "lateness_p95_seconds": None,
        "lateness_max_seconds": None,
        "extra_delay_p95_seconds": None,
        "extra_delay_p99_seconds": None,
        "extra_delay_max_seconds": None,
    }
