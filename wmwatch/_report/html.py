"""``wmwatch report --format html``: one self-contained page, charts as inline SVG.

The page reads the same :class:`~wmwatch._report.model.Report` as the other formats (summary,
findings, late-row tables) plus the series of :mod:`wmwatch._report.history` for its charts
(:mod:`wmwatch._report.html_charts`). It loads nothing: no script, no font, no stylesheet from
elsewhere; its Content-Security-Policy forbids any request, so it opens the same from a ticket,
a chat or a laptop on a plane.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from wmwatch._report.model import Report
from wmwatch._report.render import format_bytes, trigger_text
from wmwatch._section import QuerySummary
from wmwatch._time import format_at, format_duration

if TYPE_CHECKING:
    from wmwatch._report.history import QueryHistory

__all__ = ["MISSING_EXTRA", "html_available", "render_html"]

MISSING_EXTRA = "the HTML report needs matplotlib: pip install 'wmwatch[html]'"

_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#111;
 margin:0 auto;max-width:1000px;padding:16px 20px 48px}
h1{font-size:24px;margin:0 0 4px}h2{font-size:20px;margin:32px 0 8px;
 border-bottom:2px solid #111;padding-bottom:4px}h3{font-size:15px;margin:0}
.meta,.note{color:#444}.empty{padding:24px;border:1px dashed #999;margin:24px 0}
dl.summary{display:grid;grid-template-columns:max-content 1fr;gap:2px 16px;margin:8px 0}
dl.summary dt{font-weight:600}dl.summary dd{margin:0}
figure.chart{margin:18px 0;page-break-inside:avoid;break-inside:avoid}
figure.chart figcaption p{margin:2px 0 4px;color:#333}
figure.chart svg{width:100%;height:auto;display:block}
table{border-collapse:collapse;margin:8px 0 16px;width:100%}
th,td{border:1px solid #bbb;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f0f0f0}td.num{text-align:right;font-variant-numeric:tabular-nums}
.critical{font-weight:700;color:#a33c00}.warning{font-weight:700;color:#7a5a00}
code{font-size:13px}nav ul{margin:4px 0;padding-left:20px}
@media print{body{max-width:none}h2{page-break-before:always}}
"""


def html_available() -> bool:
    """Whether the ``html`` extra (matplotlib) is installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def render_html(report: Report, histories: Mapping[str, QueryHistory]) -> str:
    """The whole page for ``report``; ``histories`` holds the series of queries with batches."""
    from wmwatch._report.html_charts import chart_set

    scope = f" since {format_at(report.since_at)}" if report.since_at else ""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>wmwatch report: {_e(report.db)}</title>",
        f"<style>{_CSS}</style></head><body>",
        "<header><h1>wmwatch report</h1>",
        f'<p class="meta">History <code>{_e(report.db)}</code>{_e(scope)}; generated '
        f"{_e(format_at(report.generated_at))}. All times are UTC.</p></header>",
    ]
    with_batches = [s for s in report.queries if s.query_id in histories]
    if not with_batches:
        what = "no queries" if not report.queries else "no batches"
        parts.append(
            f'<section class="empty" id="nothing-yet"><h2>Nothing recorded yet</h2>'
            f"<p>The history has {what}{_e(scope)} to draw. Attach wmwatch to a running query "
            "(<code>wmwatch.attach(spark, db=...)</code>) and run this report again once it has "
            "run a few batches.</p></section>"
        )
    if len(report.queries) > 1:
        parts.append("<nav><h3>Queries</h3><ul>")
        for index, summary in enumerate(report.queries):
            parts.append(f'<li><a href="#q{index}">{_e(summary.query)}</a></li>')
        parts.append("</ul></nav>")
    for index, summary in enumerate(report.queries):
        parts.append(f'<section class="query" id="q{index}">')
        parts.append(f"<h2>{_e(summary.query)}</h2>")
        if summary.query != summary.query_id:
            parts.append(f'<p class="meta">query id <code>{_e(summary.query_id)}</code></p>')
        parts.append(_summary(summary))
        findings = summary.sections.get("findings") or []
        parts.append(_findings(findings))
        history = histories.get(summary.query_id)
        if history is not None:
            late = summary.sections.get("late_rows")
            for chart in chart_set(history, salt=f"q{index}", late_rows=late, findings=findings):
                parts.append(
                    f'<figure class="chart" data-chart="{chart.key}" '
                    f'data-series="{chart.series}"><figcaption><h3>{_e(chart.title)}</h3>'
                    f"<p>{_e(chart.explanation)}</p></figcaption>{chart.svg}</figure>"
                )
            if not late:
                parts.append(
                    '<p class="note">No late-row audit recorded for this query: '
                    "<code>watch.audit(query, events)</code> records which rows were dropped.</p>"
                )
        parts.append(_watermark_jumps(summary.sections.get("watermark_jumps")))
        parts.append(_late_tables(summary.sections.get("late_rows")))
        parts.append(_holding_back(summary.sections.get("watermarks")))
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(part for part in parts if part) + "\n"


def _summary(s: QuerySummary) -> str:
    rows: list[tuple[str, str]] = [
        ("status", s.status + (f" ({s.error_class})" if s.error_class else "")),
        ("trigger", trigger_text(s)),
    ]
    real_time = (s.sections.get("watermarks") or {}).get("real_time")
    if real_time:
        rows.append(("real-time mode", real_time["text"]))
    if s.exception:
        rows.append(("exception", s.exception))
    if not s.batches:
        rows.append(("batches", "none in this period"))
        return _dl(rows)
    rows += [
        (
            "batches",
            f"{s.batches:,} (#{s.first_batch_id} to #{s.last_batch_id}, "
            f"{s.runs} run{'s' if s.runs != 1 else ''})",
        ),
        ("batch time", f"{format_at(s.first_batch_at)} to {format_at(s.last_batch_at)}"),
        ("watermark", format_at(s.watermark_at)),
        (
            "watermark lag",
            f"p50 {format_duration(s.watermark_lag_p50_seconds)}, "
            f"p95 {format_duration(s.watermark_lag_p95_seconds)}, "
            f"max {format_duration(s.watermark_lag_max_seconds)}",
        ),
        ("input rows", f"{s.input_rows:,}"),
    ]
    if s.rows_dropped_by_watermark is not None:
        note = " (aggregations: Spark counts late groups, not rows)" if s.drops_count_groups else ""
        rows.append(("dropped by watermark", f"{s.rows_dropped_by_watermark:,}{note}"))
    if s.state_rows_last is not None:
        rows.append(("state rows", f"{s.state_rows_first or 0:,} to {s.state_rows_last:,}"))
    if s.state_memory_bytes_last is not None:
        rows.append(
            (
                "state memory",
                f"{format_bytes(s.state_memory_bytes_last)} "
                f"(max {format_bytes(s.state_memory_bytes_max)})",
            )
        )
    return _dl(rows)


def _findings(findings: Sequence[Mapping[str, Any]]) -> str:
    if not findings:
        return '<p class="note">No active findings.</p>'
    rows = []
    for f in findings:
        where = ""
        if f.get("operator_id") is not None:
            side = f", {f['side']} side" if f.get("side") else ""
            where = f"operator {f['operator_id']}{side}"
        severity = str(f.get("severity") or "")
        rows.append(
            [
                f'<span class="{_e(severity)}">{_e(severity)}</span>',
                f"<strong>{_e(f.get('kind'))}</strong>" + (f"<br>{_e(where)}" if where else ""),
                _e(f.get("message")),
                _e(f.get("fix") or ""),
                _e(
                    f"{f.get('occurrences') or 0}x, batches {f.get('first_batch_id')} to "
                    f"{f.get('last_batch_id')}"
                ),
            ]
        )
    return _table(
        "Active findings",
        ("severity", "finding", "what wmwatch saw", "fix", "seen"),
        rows,
        table_id="findings",
    )


def _watermark_jumps(jumps: Mapping[str, Any] | None) -> str:
    """Who moved the watermark: one sentence per incident, then the rows that did it."""
    incidents = (jumps or {}).get("incidents") or []
    if not incidents:
        return ""
    parts = [f'<p class="critical">{_e(i["summary"])}.</p>' for i in incidents]
    rows = [
        [
            _num(i["batch_id"]),
            _num(r["rank"]),
            _e(format_at(r.get("event_time_at"))),
            _e(r.get("source_index")),
            _e(r.get("kafka_partition")),
            _e(r.get("kafka_offset")),
            f"<code>{_e(r.get('row_data'))}</code>",
        ]
        for i in incidents
        for r in i.get("rows") or []
    ]
    if rows:
        parts.append(
            _table(
                "Who moved the watermark",
                ("batch", "rank", "event time (UTC)", "input", "partition", "offset", "row"),
                rows,
                table_id="watermark-jumps",
            )
        )
    return "\n".join(parts)


def _late_tables(late: Mapping[str, Any] | None) -> str:
    if not late:
        return ""
    parts = [
        f"<p><strong>{late['late_rows']:,}</strong> late rows audited in "
        f"{late['batches_with_late_rows']:,} batches ({late['audited_batches']:,} audited); "
        f"lateness p50 {format_duration(late.get('lateness_p50_seconds'))}, "
        f"p95 {format_duration(late.get('lateness_p95_seconds'))}, "
        f"max {format_duration(late.get('lateness_max_seconds'))}.</p>"
    ]
    for key in ("advice", "state_advice"):
        if late.get(key):
            parts.append(f'<p class="note">{_e(str(late[key]).capitalize())}.</p>')
    if late.get("late_rows_not_kept"):
        parts.append(
            f'<p class="note">{late["late_rows_not_kept"]:,} late rows were over '
            "max_rows_per_batch and only counted: the tables describe the kept rows.</p>"
        )
    windows = late.get("top_windows") or []
    if windows:
        parts.append(
            _table(
                "Top late windows",
                ("window start (UTC)", "window end (UTC)", "late rows"),
                [
                    [
                        _e(format_at(w["window_start_at"])),
                        _e(format_at(w["window_end_at"])),
                        _num(w["late_rows"]),
                    ]
                    for w in windows
                ],
                table_id="top-windows",
            )
        )
    sources = late.get("top_sources") or []
    if sources:
        parts.append(
            _table(
                "Top source files",
                ("source file", "late rows"),
                [[f"<code>{_e(s['source_file'])}</code>", _num(s["late_rows"])] for s in sources],
                table_id="top-sources",
            )
        )
    batches = late.get("top_batches") or []
    if batches:
        parts.append(
            _table(
                "Top batches",
                ("batch id", "late rows"),
                [[_num(b["batch_id"]), _num(b["late_rows"])] for b in batches],
                table_id="top-batches",
            )
        )
    return "\n".join(parts)


def _holding_back(marks: Mapping[str, Any] | None) -> str:
    if not marks or not marks.get("sources"):
        return ""
    rows = []
    for src in marks["sources"]:
        rows.append(
            [
                f"<code>{_e(src['source'])}</code>",
                _e(f"{src.get('event_time_column')}, delay {src.get('delay_seconds') or 0:g} s"),
                _e(format_at(src.get("watermark_at"))),
                _e(format_at(src.get("event_time_max_at"))),
                "holding the global watermark back" if src.get("holding_back") else "",
            ]
        )
    policy = marks.get("policy")
    title = f"Inputs at batch {marks.get('sources_batch_id')}" + (
        f" (multipleWatermarkPolicy = {policy})" if policy else ""
    )
    return _table(
        title,
        ("input", "event time column", "watermark (UTC)", "max event time (UTC)", "note"),
        rows,
        table_id="inputs",
    )


def _dl(rows: Iterable[tuple[str, str]]) -> str:
    items = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in rows)
    return f'<dl class="summary">{items}</dl>'


def _table(
    caption: str, headers: Sequence[str], rows: Sequence[Sequence[str]], *, table_id: str
) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return (
        f'<table data-table="{table_id}"><caption><h3>{_e(caption)}</h3></caption>'
        f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
    )


def _num(value: Any) -> str:
    return f'<span class="num">{int(value):,}</span>'


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))
