"""The per-query drill-down: why one query's watermark, lateness or state looks the way it does."""

from __future__ import annotations

from grafana_foundation_sdk.models import dashboard as dashboard_models

from dashboards._panels import QUERY, PanelBuilder, Target, assemble, timeseries_panel

UID = "wmwatch-query"


def watermark_vs_event_time() -> PanelBuilder:
    # Grafana's date units want milliseconds.
    return timeseries_panel(
        "Watermark vs event time",
        "dateTimeAsIso",
        [
            Target(f"wmwatch_watermark_seconds{{{QUERY}}} * 1000", "watermark"),
            Target(f"wmwatch_event_time_max_seconds{{{QUERY}}} * 1000", "event time max"),
            Target(f"wmwatch_event_time_min_seconds{{{QUERY}}} * 1000", "event time min"),
        ],
        description="Event-time range of each batch's input against the watermark; input below "
        "the watermark line is late.",
        width=24,
    )


def watermark_lag() -> PanelBuilder:
    return timeseries_panel(
        "Watermark lag",
        "s",
        [Target(f"wmwatch_watermark_lag_seconds{{{QUERY}}}", "lag")],
        description="Batch time minus watermark.",
    )


def lateness() -> PanelBuilder:
    return timeseries_panel(
        "Lateness",
        "s",
        [
            Target(
                f"wmwatch_event_time_delay_seconds{{{QUERY}}}", "allowed delay (max - watermark)"
            ),
            Target(f"wmwatch_event_time_spread_seconds{{{QUERY}}}", "spread in batch (max - min)"),
            Target(
                f"wmwatch_event_time_ahead_seconds{{{QUERY}}}",
                "ahead of the clock (largest seen - batch time)",
            ),
        ],
        description="A batch spread wider than the allowed delay means rows arrive later than "
        "the watermark waits for. Above 0, 'ahead of the clock' means the watermark stands on "
        "rows dated in the future (see WmwatchEventTimeAhead).",
    )


def rows_dropped_per_operator() -> PanelBuilder:
    return timeseries_panel(
        "Rows dropped as late, per operator",
        "short",
        [
            Target(
                "sum by (operator, operator_name) (increase("
                f"wmwatch_rows_dropped_by_watermark_total{{{QUERY}}}[$__rate_interval]))",
                "op {{operator}} {{operator_name}}",
            )
        ],
        description="Spark's count: input rows for dedupe, late groups for aggregations.",
        bars=True,
    )


def audited_late_rows() -> PanelBuilder:
    return timeseries_panel(
        "Audited late rows",
        "short",
        [
            Target(
                "sum by (query) "
                f"(increase(wmwatch_late_rows_audited_total{{{QUERY}}}[$__rate_interval]))",
                "late rows found by audit",
            )
        ],
        description="Input rows the audit rebuilt as dropped, batch by batch (needs watch.audit).",
        bars=True,
    )


def operator_watermarks() -> PanelBuilder:
    return timeseries_panel(
        "Per-operator watermarks",
        "dateTimeAsIso",
        [
            Target(
                f"wmwatch_operator_watermark_seconds{{{QUERY}}} * 1000",
                "op {{operator}} {{kind}}",
            )
        ],
        description="Late-row and eviction watermarks of each stateful operator, from the plan.",
    )


def source_watermarks() -> PanelBuilder:
    return timeseries_panel(
        "Per-source watermarks",
        "dateTimeAsIso",
        [
            Target(
                f"wmwatch_source_watermark_seconds{{{QUERY}}} * 1000", "source {{source}} watermark"
            ),
            Target(
                f"wmwatch_source_event_time_max_seconds{{{QUERY}}} * 1000",
                "source {{source}} event time max",
            ),
        ],
        description="With several inputs the slowest source sets the watermark (min policy).",
    )


def watermark_holding_back() -> PanelBuilder:
    return timeseries_panel(
        "Source holding back the watermark",
        "short",
        [Target(f"wmwatch_watermark_holding_back{{{QUERY}}}", "source {{source}}")],
        description="1 for the source whose watermark the query's watermark follows.",
    )


def state_rows_per_operator() -> PanelBuilder:
    return timeseries_panel(
        "State rows per operator",
        "short",
        [Target(f"wmwatch_state_rows{{{QUERY}}}", "op {{operator}} {{operator_name}}")],
        description="Rows in each operator's state store.",
    )


def state_memory_per_operator() -> PanelBuilder:
    return timeseries_panel(
        "State memory per operator",
        "bytes",
        [Target(f"wmwatch_state_memory_bytes{{{QUERY}}}", "op {{operator}} {{operator_name}}")],
        description="Memory used by each operator's state store.",
    )


def state_rows_removed() -> PanelBuilder:
    return timeseries_panel(
        "State rows evicted",
        "short",
        [
            Target(
                "sum by (operator, operator_name) (increase("
                f"wmwatch_state_rows_removed_total{{{QUERY}}}[$__rate_interval]))",
                "op {{operator}} {{operator_name}}",
            )
        ],
        description="Rows the watermark evicted from state; zero forever with growing state is "
        "the unbounded-state pattern.",
        bars=True,
    )


def join_state() -> PanelBuilder:
    return timeseries_panel(
        "Join state growth",
        "short",
        [
            Target(
                f"wmwatch_state_growth_rows_per_second{{{QUERY}}}",
                "op {{operator}} {{side}} rows/s",
            ),
            Target(
                f"wmwatch_join_state_unbounded{{{QUERY}}}", "op {{operator}} {{side}} unbounded"
            ),
        ],
        description="Growth of each join side's state; 'unbounded' is 1 when the plan never "
        "cleans that side.",
    )


def batch_phases() -> PanelBuilder:
    return timeseries_panel(
        "Batch phases",
        "s",
        [Target(f"wmwatch_batch_phase_duration_seconds{{{QUERY}}}", "{{phase}}")],
        description=(
            "Where each batch's time went (addBatch, getBatch, queryPlanning, walCommit, ...)."
        ),
        stacked=True,
        bars=True,
    )


def batch_input() -> PanelBuilder:
    return timeseries_panel(
        "Batch input and count",
        "short",
        [
            Target(f"wmwatch_batch_input_rows{{{QUERY}}}", "input rows of last batch"),
            Target(
                f"sum by (query) (increase(wmwatch_batches_total{{{QUERY}}}[$__rate_interval]))",
                "batches",
            ),
        ],
        description="Rows of the last batch, and batches run per interval.",
    )


def findings() -> PanelBuilder:
    return timeseries_panel(
        "Active findings",
        "short",
        [Target(f"wmwatch_findings_active{{{QUERY}}}", "{{kind}}")],
        description="Problems wmwatch diagnosed for this query; `wmwatch report` explains each.",
    )


def audit_lag() -> PanelBuilder:
    return timeseries_panel(
        "Audit lag",
        "short",
        [Target(f"wmwatch_audit_lag_batches{{{QUERY}}}", "batches behind")],
        description="Batches the late-row audit still has to check.",
    )


def build() -> dashboard_models.Dashboard:
    return assemble(
        uid=UID,
        title="wmwatch / Query drill-down",
        description=(
            "One query's watermark, lateness, operators, sources, state, batches and audit."
        ),
        multi_query=False,
        rows=[
            ("Watermark and lateness", [watermark_vs_event_time(), watermark_lag(), lateness()]),
            (
                "Late rows",
                [rows_dropped_per_operator(), audited_late_rows(), findings(), audit_lag()],
            ),
            (
                "Operators and sources",
                [operator_watermarks(), source_watermarks(), watermark_holding_back()],
            ),
            (
                "State",
                [
                    state_rows_per_operator(),
                    state_memory_per_operator(),
                    state_rows_removed(),
                    join_state(),
                ],
            ),
            ("Batches", [batch_phases(), batch_input()]),
        ],
    )
