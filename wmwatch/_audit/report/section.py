"""The report's late-rows section: what the audit found, read from ``late_rows``, the Parquet
folders ``audit_batches`` lists, and ``audit_batches`` itself.

Besides the SQL, this holds the audit-specific rules: how the Parquet sink's columns map onto the
``late_rows`` table, how much more watermark delay would have kept the rows, and what that extra
delay costs in state.
"""

from __future__ import annotations

import itertools
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from math import gcd
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wmwatch._audit.sinks import local_path
from wmwatch._errors import StoreError
from wmwatch._section import Row, Scope, Section, as_float, as_int, grouped, named_rows
from wmwatch._time import as_utc, format_at, format_duration

if TYPE_CHECKING:
    import duckdb
    from rich.table import Table

# The Parquet sink stores instants as integer microseconds (time-zone free); the table has
# TIMESTAMPTZ columns of the same names with ``_at``.
PARQUET_MICROS_COLUMNS = {
    "event_time_at": "event_time_us",
    "watermark_at": "watermark_us",
    "window_start_at": "window_start_us",
    "window_end_at": "window_end_us",
    "audited_at": "audited_at_us",
}


def parquet_late_column(column: str, present: Iterable[str]) -> str:
    """SQL that yields ``late_rows.column`` from an audit Parquet file with columns ``present``."""
    have = set(present)
    if column in have:
        return column
    micros = PARQUET_MICROS_COLUMNS.get(column)
    if micros is not None and micros in have:
        return f"(TIMESTAMPTZ '1970-01-01 00:00:00+00' + to_microseconds({micros})) AS {column}"
    return f"NULL AS {column}"


# -- advice ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WindowGrid:
    window_seconds: float
    slide_seconds: float


def window_grid(windows: Iterable[tuple[float, float]]) -> WindowGrid | None:
    """Window length and slide seen in audited rows (start, end in seconds); None if no windows.

    The slide is the greatest common step between window starts, capped at the length: exact
    once rows from two neighbouring windows were audited, an upper bound before that.
    """
    pairs = [(round(s * 1000), round(e * 1000)) for s, e in windows]
    if not pairs:
        return None
    length = Counter(e - s for s, e in pairs).most_common(1)[0][0]
    starts = sorted({s for s, _ in pairs})
    step = 0
    for a, b in itertools.pairwise(starts):
        step = gcd(step, b - a)
    slide = min(step, length) if step else length
    return WindowGrid(length / 1000, slide / 1000)


def extra_windows_in_state(extra_delay_seconds: float, slide_seconds: float) -> int:
    """Windows per key that stay open longer: each slide of extra delay keeps one more window."""
    if slide_seconds <= 0:
        return 0
    return math.ceil(extra_delay_seconds / slide_seconds)


def state_advice_from_quantile(
    needed_p99_seconds: float | None, grid: WindowGrid | None
) -> str | None:
    """``a watermark delay of X more would have kept about 99% of these rows; state would hold
    about Y more windows per key`` (or, without windows, keep each key X longer).

    ``needed_p99_seconds`` is the 99th percentile of the extra delay each row needed (watermark
    minus window end, or its lateness without a window). A row needing N seconds is kept only by
    a delay strictly larger than N (Spark drops at equality), hence the +1 on whole seconds.
    """
    if needed_p99_seconds is None:
        return None
    extra = float(math.floor(max(needed_p99_seconds, 0.0)) + 1)
    head = f"a watermark delay of {_seconds(extra)} more would have kept about 99% of these rows"
    if grid is None:
        return f"{head}; state would keep each key about {_seconds(extra)} longer"
    windows = extra_windows_in_state(extra, grid.slide_seconds)
    return (
        f"{head}; state would hold about {windows} more window{'s' if windows != 1 else ''} per key"
    )


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


def _seconds(value: float) -> str:
    if value >= 3600 and value % 3600 == 0:
        return f"{value / 3600:g}h"
    if value >= 60 and value % 60 == 0:
        return f"{value / 60:g}m"
    return f"{value:g}s"


# -- loading --------------------------------------------------------------------------------------

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


# The folder the audit writes one batch's Parquet rows to: <parquet_path>/<query id>/batch-<n>
# (see Replayer.parquet_dir, which names them)
_BATCH_FOLDER = re.compile(r"batch-\d{12}")


def audit_folder(location: str, query_id: str) -> Path | None:
    """The local folder the audit wrote for one batch of ``query_id`` (None: another file system).

    A history file may come from someone else: a location not shaped like the audit's own
    folders (``/``, a home folder) is refused with :class:`StoreError` rather than read.
    """
    local = local_path(location)
    if local is None:
        return None
    path = Path(local)
    if (
        not _BATCH_FOLDER.fullmatch(path.name)
        or query_id in ("", ".", "..")
        or path.parent.name != query_id
        # Spark makes both folders: a link there points somewhere the audit never wrote
        or path.is_symlink()
        or path.parent.is_symlink()
    ):
        shown = repr(location[:120])
        raise StoreError(
            f"the history lists {shown} as the Parquet folder of a batch of {query_id[:60]!r}, "
            "but the audit writes only <parquet_path>/<query id>/batch-<n>: the file was "
            "altered, so it is not read; pass a history file written by wmwatch"
        )
    return path


def parquet_files(folder: Path) -> list[str]:
    """The Parquet files Spark wrote in one batch folder: regular files only, no links, no
    subfolders, so nothing outside the folder is read."""
    try:
        with os.scandir(folder) as entries:
            return sorted(
                entry.path
                for entry in entries
                if entry.name.endswith(".parquet") and entry.is_file(follow_symlinks=False)
            )
    except (FileNotFoundError, NotADirectoryError):
        return []


def _parquet_locations(
    con: duckdb.DuckDBPyConnection, query_ids: Iterable[str] | None
) -> list[tuple[str, str]]:
    rows = con.execute(
        """
        SELECT DISTINCT query_id, coalesce(overflow_location, location) FROM audit_batches
        WHERE (sink = 'parquet' AND location IS NOT NULL OR overflow_location IS NOT NULL)
          AND ($1::VARCHAR[] IS NULL OR query_id IN (SELECT unnest($1::VARCHAR[])))
        ORDER BY ALL
        """,
        (None if query_ids is None else list(query_ids),),
    ).fetchall()
    return [(str(qid), str(location)) for qid, location in rows]


def audit_parquet_files(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Every Parquet file of the audit's batch folders that the history lists (for
    :func:`wmwatch._store.files.open_readonly`'s ``readable_files``)."""
    files: list[str] = []
    for query_id, location in _parquet_locations(con, None):
        folder = audit_folder(location, query_id)
        if folder is not None:
            files.extend(parquet_files(folder))
    return files


def _readable_files(con: duckdb.DuckDBPyConnection) -> set[str] | None:
    """The outside files a sealed connection may read (None: it may read any)."""
    row = con.execute(
        "SELECT current_setting('enable_external_access'), current_setting('allowed_paths')"
    ).fetchone()
    if row is None or row[0]:
        return None
    return {str(path) for path in row[1] or ()}


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
    # exact file names, never a glob: the reader's connection may open these files only
    readable = _readable_files(con)
    files: list[str] = []
    missing = 0
    for query_id, location in _parquet_locations(con, scope.query_ids):
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
    source_sql, params, missing = _late_rows_source(con, scope)
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


# -- rendering ------------------------------------------------------------------------------------


def render_late_rows(data: Mapping[str, Any]) -> Table:
    from rich.markup import escape
    from rich.table import Table

    # every text read from the history (reasons, kinds, join keys, file names) is escaped

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
    if data.get("rows_kept_behind_watermark") is not None:
        table.add_row(
            "kept behind watermark",
            f"{data['rows_kept_behind_watermark']:,} rows kept although the watermark their "
            "batch reported had passed them (judged against the batch before's); a shorter "
            "checkpoint interval would have dropped them",
        )
    for missing in data.get("without_payload") or []:
        counted = missing["rows_dropped"]
        table.add_row(
            "without payload",
            f"source {missing['source_index']}: "
            + (f"{counted:,} dropped (Spark's count) " if counted is not None else "")
            + f"[yellow]not read again[/]: {escape(str(missing['reason']))}"
            + (
                f" ({missing['batches_uncounted']:,} batches uncounted: Spark counts its "
                "operator's inputs together, or the batch's progress was not seen)"
                if missing["batches_uncounted"]
                else ""
            ),
        )
    operators = data.get("by_operator") or []
    if len(operators) > 1 or any(o["side"] for o in operators):
        table.add_row(
            "by operator",
            "\n".join(
                escape(f"operator {o['operator_index']} {o['kind']}")
                + escape(f" {o['side']} side" if o["side"] else "")
                + f": {o['late_rows']:,}"
                for o in operators
            ),
        )
    if data.get("lost_matches"):
        table.add_row(
            "lost matches",
            "\n".join(
                escape(f"operator {m['operator_index']} {m['side']} side, key {m['join_key']}")
                + f": {m['late_rows']:,} late rows"
                for m in data["lost_matches"]
            ),
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
                f"{format_at(w['window_start_at'])} - {format_at(w['window_end_at'])}: "
                f"{w['late_rows']:,}"
                for w in data["top_windows"]
            ),
        )
    if data.get("top_sources"):
        table.add_row(
            "top sources",
            "\n".join(
                f"{escape(str(s['source_file']))}: {s['late_rows']:,}" for s in data["top_sources"]
            ),
        )
    if data.get("advice"):
        table.add_row("advice", f"[cyan]{escape(data['advice'])}[/]")
    if data.get("state_advice"):
        table.add_row("delay cost", f"[cyan]{escape(data['state_advice'])}[/]")
    if data.get("missing_parquet_locations"):
        table.add_row(
            "note",
            f"[red]{data['missing_parquet_locations']} Parquet audit folders listed in "
            "audit_batches are gone[/]",
        )
    return table


def late_rows_csv(data: Mapping[str, Any] | None) -> Mapping[str, Any]:
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


LATE_ROWS_SECTION = Section(
    key="late_rows",
    title="late rows audited",
    load=load_late_rows,
    render=render_late_rows,
    csv_columns=(
        "late_rows",
        "late_rows_not_kept",
        "batches_with_late_rows",
        "lateness_p95_seconds",
    ),
    csv_values=late_rows_csv,
)
