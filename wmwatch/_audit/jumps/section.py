"""The report section "who moved the watermark": each batch that moved a query's watermark
(from ``watermark_jumps`` and ``watermark_jump_rows``, see :mod:`wmwatch._audit.jumps.table`),
the rows that did it, and the rows the jump dropped since.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wmwatch._section import Scope, Section, as_float, as_int, named_rows
from wmwatch._text import first_line
from wmwatch._time import format_at, format_duration

if TYPE_CHECKING:
    import duckdb
    from rich.table import Table

# incidents shown per query (the latest), rows per incident are bounded when recorded
MAX_INCIDENTS = 20
# characters of a row's data in the one-line sentence
_ROW_CHARS = 160

_INCIDENTS_SQL = """
    SELECT query_id, batch_id, run_id, batch_at, event_time_max_at, ahead_seconds,
           watermark_before_at, watermark_after_at, jump_seconds, jump_batch_id, reasons,
           source_index, source_description, rows_error, rows_dropped_since,
           counted_through_batch
    FROM watermark_jumps
    WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
      AND ($2::DOUBLE IS NULL OR coalesce(batch_at, recorded_at) >= to_timestamp($2::DOUBLE))
    QUALIFY row_number() OVER (PARTITION BY query_id ORDER BY batch_id DESC) <= $3
    ORDER BY query_id, batch_id
"""

_ROWS_SQL = """
    SELECT query_id, batch_id, row_rank, event_time_at, source_index, source_file, kafka_topic,
           kafka_partition, kafka_offset, row_data::VARCHAR AS row_data
    FROM watermark_jump_rows
    WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
    ORDER BY query_id, batch_id, row_rank
"""


def load_watermark_jumps(con: duckdb.DuckDBPyConnection, scope: Scope) -> dict[str, Any]:
    """``{query_id: {"incidents": [...]}}`` for the queries with an incident in scope."""
    since = scope.since_at.timestamp() if scope.since_at else None
    ids = list(scope.query_ids)
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in named_rows(con, _ROWS_SQL, (ids,)):
        rows.setdefault((row["query_id"], int(row["batch_id"])), []).append(
            {
                "rank": int(row["row_rank"]),
                "event_time_at": row["event_time_at"],
                "source_index": as_int(row["source_index"]),
                "source_file": row["source_file"],
                "kafka_topic": row["kafka_topic"],
                "kafka_partition": as_int(row["kafka_partition"]),
                "kafka_offset": as_int(row["kafka_offset"]),
                "row_data": row["row_data"],
            }
        )
    out: dict[str, Any] = {}
    for row in named_rows(con, _INCIDENTS_SQL, (ids, since, MAX_INCIDENTS)):
        batch_id = int(row["batch_id"])
        incident = {
            "batch_id": batch_id,
            "run_id": row["run_id"],
            "batch_at": row["batch_at"],
            "event_time_max_at": row["event_time_max_at"],
            "ahead_seconds": as_float(row["ahead_seconds"]),
            "watermark_before_at": row["watermark_before_at"],
            "watermark_after_at": row["watermark_after_at"],
            "jump_seconds": as_float(row["jump_seconds"]),
            "jump_batch_id": as_int(row["jump_batch_id"]),
            "reasons": row["reasons"],
            "source_index": as_int(row["source_index"]),
            "source_description": row["source_description"],
            "rows_error": row["rows_error"],
            "rows_dropped_since": as_int(row["rows_dropped_since"]),
            "counted_through_batch": as_int(row["counted_through_batch"]),
            "rows": rows.get((row["query_id"], batch_id), []),
        }
        incident["summary"] = sentence(incident)
        out.setdefault(row["query_id"], {"incidents": []})["incidents"].append(incident)
    return out


def row_text(row: Mapping[str, Any] | None) -> str:
    """A recorded row for people: its data and where it came from."""
    if row is None:
        return "rows not recorded"
    where = []
    if row.get("source_index") is not None:
        where.append(f"input {row['source_index']}")
    if row.get("kafka_partition") is not None:
        topic = f"{row['kafka_topic']} " if row.get("kafka_topic") else ""
        where.append(f"{topic}partition {row['kafka_partition']} offset {row['kafka_offset']}")
    if row.get("source_file"):
        where.append(str(row["source_file"]))
    data = first_line(str(row.get("row_data") or ""), _ROW_CHARS) or "-"
    return f"{data} (event time {format_at(row.get('event_time_at'))}; {', '.join(where)})"


def sentence(incident: Mapping[str, Any]) -> str:
    """ "the watermark was moved by <row> at <time>; it dropped N rows since"."""
    rows = incident.get("rows") or []
    culprit = row_text(rows[0] if rows else None)
    if not rows and incident.get("rows_error"):
        culprit = f"rows not read again ({incident['rows_error']})"
    dropped = incident.get("rows_dropped_since")
    cost = (
        f"it dropped {dropped:,} rows since"
        if dropped is not None
        else "the rows it dropped since are not counted yet"
    )
    return (
        f"the watermark was moved by {culprit} in batch {incident['batch_id']} at "
        f"{format_at(incident.get('batch_at'))}; {cost}"
    )


def render_watermark_jumps(data: Mapping[str, Any]) -> Table:
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title="who moved the watermark", title_justify="left", show_header=False, box=None
    )
    table.add_column(style="bold")
    table.add_column()
    for incident in data.get("incidents") or []:
        table.add_row(f"batch {incident['batch_id']}", f"[red]{escape(incident['summary'])}[/]")
        detail = []
        if incident.get("ahead_seconds") is not None:
            detail.append(
                f"event time {format_duration(incident['ahead_seconds'])} ahead of the batch"
            )
        if incident.get("watermark_before_at") is not None:
            detail.append(
                f"watermark {format_at(incident['watermark_before_at'])} → "
                f"{format_at(incident.get('watermark_after_at'))}"
            )
        if incident.get("source_description"):
            detail.append(f"input {incident['source_index']}: {incident['source_description']}")
        if detail:
            table.add_row("", escape("; ".join(detail)))
        for row in (incident.get("rows") or [])[1:]:
            table.add_row("", escape(f"#{row['rank']}: {row_text(row)}"))
    return table


def watermark_jumps_csv(data: Mapping[str, Any] | None) -> Mapping[str, Any]:
    incidents = (data or {}).get("incidents") or []
    last = incidents[-1] if incidents else None
    return {
        "watermark_jumps": len(incidents),
        "watermark_jump_rows_dropped": sum(i["rows_dropped_since"] or 0 for i in incidents),
        "watermark_jump_last": last["summary"] if last else None,
    }


WATERMARK_JUMPS_SECTION = Section(
    key="watermark_jumps",
    title="who moved the watermark",
    load=load_watermark_jumps,
    render=render_watermark_jumps,
    csv_columns=("watermark_jumps", "watermark_jump_rows_dropped", "watermark_jump_last"),
    csv_values=watermark_jumps_csv,
)
