"""The report's plan-inspection sections: active findings (``findings``) and the latest
per-operator and per-input watermarks (``operator_watermarks``, ``source_watermarks``), with
what a real-time query's checkpoint interval costs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from wmwatch._inspect.watermarks import real_time_costs
from wmwatch._section import Row, Scope, Section, grouped, named_rows
from wmwatch._time import as_utc, format_at, from_epoch_seconds

if TYPE_CHECKING:
    import duckdb
    from rich.table import Table

# -- findings -------------------------------------------------------------------------------------


def load_findings(con: duckdb.DuckDBPyConnection, scope: Scope) -> dict[str, Any]:
    """Active findings per query, critical first, most recent first."""
    rows = named_rows(
        con,
        """
        SELECT query_id, kind, severity, operator_id, side, message, fix, occurrences,
               epoch(first_seen_at) AS first_seen_epoch_seconds,
               epoch(last_seen_at) AS last_seen_epoch_seconds,
               first_batch_id, last_batch_id
        FROM findings
        WHERE status = 'active' AND query_id IN (SELECT unnest($1::VARCHAR[]))
        ORDER BY query_id, severity = 'critical' DESC, last_seen_at DESC
        """,
        (list(scope.query_ids),),
    )
    return grouped(
        rows,
        lambda r: {
            "kind": r["kind"],
            "severity": r["severity"],
            "operator_id": r["operator_id"],
            "side": r["side"],
            "message": r["message"],
            "fix": r["fix"],
            "occurrences": r["occurrences"],
            "first_seen_at": from_epoch_seconds(r["first_seen_epoch_seconds"]),
            "last_seen_at": from_epoch_seconds(r["last_seen_epoch_seconds"]),
            "first_batch_id": r["first_batch_id"],
            "last_batch_id": r["last_batch_id"],
        },
    )


def render_findings(findings: Sequence[Mapping[str, Any]]) -> Table:
    from rich.markup import escape
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
            f"[{colour}]{escape(str(finding['severity']))}[/]",
            f"[bold]{escape(str(finding['kind']))}[/]{escape(where)}: "
            f"{escape(str(finding['message']))}\n"
            f"[dim]{finding['occurrences']}x, last seen batch {finding['last_batch_id']}[/]",
            escape(str(finding.get("fix") or "")),
        )
    return table


def findings_csv(findings: Sequence[Mapping[str, Any]] | None) -> Mapping[str, Any]:
    findings = findings or []
    return {
        "findings_active": len(findings),
        "findings_critical": sum(1 for f in findings if f["severity"] == "critical"),
        "findings_kinds": ";".join(sorted({f["kind"] for f in findings})),
    }


FINDINGS_SECTION = Section(
    key="findings",
    title="active findings",
    load=load_findings,
    render=render_findings,
    csv_columns=("findings_active", "findings_critical", "findings_kinds"),
    csv_values=findings_csv,
)


# -- watermarks -----------------------------------------------------------------------------------


def _latest_batch_rows(
    con: duckdb.DuckDBPyConnection, table: str, columns: str, order_by: str, ids: list[str]
) -> list[Row]:
    """The rows of each query's latest batch in ``table`` (query_id, batch_id, ``columns``)."""
    return named_rows(
        con,
        f"""
        SELECT query_id, batch_id, {columns}
        FROM {table} t
        WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
          AND batch_id = (SELECT max(batch_id) FROM {table} m WHERE m.query_id = t.query_id)
        ORDER BY query_id, {order_by}
        """,
        (ids,),
    )


def load_watermarks(con: duckdb.DuckDBPyConnection, scope: Scope) -> dict[str, dict[str, Any]]:
    """Per query: the latest recorded per-operator and per-source watermarks, and the policy.

    Returns ``{query_id: {"policy", "operators": [...], "sources": [...], "holding_back": [...],
    "operators_batch_id", "sources_batch_id"}}`` only for queries with rows; datetimes stay
    datetimes.
    """
    ids = list(scope.query_ids)
    if not ids:
        return {}
    out: dict[str, dict[str, Any]] = {}
    operators = _latest_batch_rows(
        con,
        "operator_watermarks",
        "operator_id, operator_name, late_watermark_at, eviction_watermark_at",
        "operator_id",
        ids,
    )
    for row in operators:
        entry = out.setdefault(row["query_id"], _empty_entry())
        entry["operators_batch_id"] = row["batch_id"]
        entry["operators"].append(
            {
                "operator_id": row["operator_id"],
                "operator_name": row["operator_name"],
                "late_watermark_at": as_utc(row["late_watermark_at"]),
                "eviction_watermark_at": as_utc(row["eviction_watermark_at"]),
            }
        )
    sources = _latest_batch_rows(
        con,
        "source_watermarks",
        "source, event_time_column, delay_seconds, watermark_at, event_time_max_at, "
        "idle_batches, holding_back, policy",
        "source",
        ids,
    )
    for row in sources:
        entry = out.setdefault(row["query_id"], _empty_entry())
        entry["sources_batch_id"] = row["batch_id"]
        entry["policy"] = row["policy"]
        entry["sources"].append(
            {
                "source": row["source"],
                "event_time_column": row["event_time_column"],
                "delay_seconds": row["delay_seconds"],
                "watermark_at": as_utc(row["watermark_at"]),
                "event_time_max_at": as_utc(row["event_time_max_at"]),
                "idle_batches": row["idle_batches"],
                "holding_back": bool(row["holding_back"]),
            }
        )
        if row["holding_back"]:
            entry["holding_back"].append(row["source"])
    for query_id in ids:
        summary = scope.summaries.get(query_id)
        if summary is None or summary.trigger != "real_time":
            continue
        if summary.trigger_interval_seconds is None:
            continue
        entry = out.setdefault(query_id, _empty_entry())
        delays = [s["delay_seconds"] for s in entry["sources"] if s["delay_seconds"] is not None]
        entry["real_time"] = real_time_costs(
            summary.trigger_interval_seconds,
            max(delays) if delays else None,
            summary.state_rows_last,
            summary.state_memory_bytes_last,
        )
    return out


def render_watermarks(data: Mapping[str, Any]) -> Table:
    """A rich table: each stateful operator's two watermarks, each input's own watermark."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="watermarks per operator and input", title_justify="left", expand=False)
    table.add_column("where")
    table.add_column("watermark (late rows / own)")
    table.add_column("eviction / max event time")
    table.add_column("note")
    for op in data.get("operators", []):
        table.add_row(
            escape(f"operator {op['operator_id']} {op['operator_name'] or ''}".strip()),
            format_at(op["late_watermark_at"], zone=False),
            format_at(op["eviction_watermark_at"], zone=False),
            "",
        )
    for src in data.get("sources", []):
        note = []
        if src["holding_back"]:
            note.append("[red]holding the watermark back[/]")
        if src["idle_batches"]:
            note.append(f"idle {src['idle_batches']} batches")
        where = (
            f"input {src['source']} ({src['event_time_column']}, delay {src['delay_seconds']:g} s)"
        )
        table.add_row(
            escape(where),
            format_at(src["watermark_at"], zone=False),
            format_at(src["event_time_max_at"], zone=False),
            ", ".join(note),
        )
    captions = []
    if data.get("policy"):
        captions.append(escape(f"multipleWatermarkPolicy = {data['policy']}"))
    if data.get("real_time"):
        captions.append(escape(data["real_time"]["text"]))
    if captions:
        table.caption = "\n".join(captions)
        table.caption_justify = "left"
    return table


def watermarks_csv(data: Mapping[str, Any] | None) -> dict[str, Any]:
    data = data or {}
    return {
        "watermark_policy": data.get("policy") or "",
        "watermark_holding_back": ";".join(data.get("holding_back", [])),
        "stateful_operators": len(data.get("operators", [])),
    }


def _empty_entry() -> dict[str, Any]:
    return {"policy": None, "operators": [], "sources": [], "holding_back": []}


WATERMARKS_SECTION = Section(
    key="watermarks",
    title="watermarks per operator and input",
    load=load_watermarks,
    render=render_watermarks,
    csv_columns=("watermark_policy", "watermark_holding_back", "stateful_operators"),
    csv_values=watermarks_csv,
)
