"""The report's late-rows section: what the audit found, rendered as a table for people and
as CSV rows, and the :class:`~wmwatch._section.Section` that ties it to its loader
(:mod:`wmwatch._audit.report.loading`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from wmwatch._audit.report.loading import load_late_rows
from wmwatch._section import Section
from wmwatch._time import format_at, format_duration

if TYPE_CHECKING:
    from rich.table import Table


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
