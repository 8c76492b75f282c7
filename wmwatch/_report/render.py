"""Rendering a built report: a table for people, JSON and CSV for scripts.

Rendering only reads the :class:`~wmwatch._report.model.Report`; each section renders its own
part through its :class:`~wmwatch._report.model.Section`.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from wmwatch._report.model import Report
from wmwatch._section import QuerySummary
from wmwatch._time import as_utc, format_at, format_duration

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = ["render_csv", "render_json", "render_table", "report_dict"]

_CORE_CSV_COLUMNS = (
    "query",
    "query_id",
    "status",
    "error_class",
    "trigger",
    "trigger_interval_seconds",
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


def report_dict(report: Report) -> dict[str, Any]:
    """The report as plain JSON-able values (timestamps as ISO-8601 UTC strings)."""
    queries = []
    for summary in report.queries:
        item = {
            name: getattr(summary, name) for name in QuerySummary.__slots__ if name != "sections"
        }
        item["rows_dropped_note"] = (
            "Spark counts late groups, not input rows, for aggregations"
            if summary.drops_count_groups
            else None
        )
        for section in report.sections:
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
    for section in report.sections:
        columns.extend(section.csv_columns)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for summary in report.queries:
        row: dict[str, Any] = {
            name: getattr(summary, name) for name in _CORE_CSV_COLUMNS if name != "query"
        }
        row["query"] = summary.query
        for section in report.sections:
            row.update(section.csv_values(summary.sections.get(section.key)))
        writer.writerow({key: _csv_value(value) for key, value in row.items()})
    return out.getvalue()


def render_table(report: Report, console: Console) -> None:
    """A readable summary per query for a terminal (colour only when it is one)."""
    from rich.console import Group
    from rich.markup import escape
    from rich.panel import Panel

    if not report.queries:
        console.print(f"no queries recorded yet in {escape(report.db)}")
        return
    scope = f" since {format_at(report.since_at)}" if report.since_at else ""
    console.print(f"[bold]wmwatch report[/] for {escape(report.db)}{scope}")
    for summary in report.queries:
        parts: list[Any] = [_core_table(summary)]
        for section in report.sections:
            data = summary.sections.get(section.key)
            if data:
                parts.append(section.render(data))
        console.print(
            Panel(
                Group(*parts),
                title=f"[bold]{escape(summary.query)}[/]",
                subtitle=escape(summary.query_id) if summary.query != summary.query_id else None,
                title_align="left",
                expand=False,
            )
        )


def trigger_text(summary: QuerySummary) -> str:
    """How the query triggers batches, for people: "real time, batches of 5.0s"."""
    text = summary.trigger.replace("_", " ")
    if summary.trigger_interval_seconds is not None:
        every = format_duration(summary.trigger_interval_seconds)
        text += f", batches of {every}" if summary.trigger == "real_time" else f", every {every}"
    return text


def _core_table(summary: QuerySummary) -> Table:
    from rich.markup import escape
    from rich.table import Table

    # every value read from the history is escaped: a name or message holding "[/x]" is text
    colour = {"failed": "red", "terminated": "dim", "active": "green"}.get(summary.status, "white")
    status = f"[{colour}]{escape(summary.status)}[/]"
    if summary.error_class:
        status += f" ({escape(summary.error_class)})"
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column()
    table.add_row("status", status)
    table.add_row("trigger", escape(trigger_text(summary)))
    if summary.exception:
        table.add_row("exception", f"[red]{escape(summary.exception)}[/]")
    if summary.batches == 0:
        table.add_row("batches", "none in this period")
        return table
    table.add_row(
        "batches",
        f"{summary.batches:,} (#{summary.first_batch_id}-#{summary.last_batch_id}, "
        f"{summary.runs} run{'s' if summary.runs != 1 else ''})",
    )
    table.add_row(
        "batch time",
        f"{format_at(summary.first_batch_at)} → {format_at(summary.last_batch_at)}",
    )
    table.add_row("watermark", format_at(summary.watermark_at))
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
    return table


def _jsonable(value: Any) -> Any:
    if isinstance(value, datetime):
        utc = as_utc(value)
        return utc.isoformat().replace("+00:00", "Z") if utc is not None else None
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


def format_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
