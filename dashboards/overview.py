"""The overview dashboard: every watched query on one page, for the on-call glance."""

from __future__ import annotations

from grafana_foundation_sdk.models import dashboard as dashboard_models

from dashboards._panels import QUERY, PanelBuilder, Target, assemble, stat_panel, timeseries_panel

UID = "wmwatch-overview"


def queries_running() -> PanelBuilder:
    return stat_panel(
        "Queries running",
        "short",
        Target(f"sum(wmwatch_query_up{{{QUERY}}})"),
        description="Watched queries that are active now.",
    )


def queries_failed() -> PanelBuilder:
    return stat_panel(
        "Queries failed",
        "short",
        Target(f"sum(wmwatch_query_failed{{{QUERY}}})"),
        description="Queries whose last run ended with an exception (see the drill-down).",
        thresholds=((None, "green"), (1, "red")),
    )


def worst_watermark_lag() -> PanelBuilder:
    return stat_panel(
        "Worst watermark lag",
        "s",
        Target(f"max(wmwatch_watermark_lag_seconds{{{QUERY}}})"),
        description="Largest batch-time-minus-watermark over the selected queries.",
        thresholds=((None, "green"), (900, "orange"), (3600, "red")),
    )


def stalest_progress() -> PanelBuilder:
    return stat_panel(
        "Oldest last progress",
        "s",
        Target(f"max(time() - wmwatch_last_progress_timestamp_seconds{{{QUERY}}})"),
        description="Seconds since the least recent progress event; idle queries also age here.",
        thresholds=((None, "green"), (600, "orange"), (3600, "red")),
    )


def watermark_lag() -> PanelBuilder:
    return timeseries_panel(
        "Watermark lag",
        "s",
        [Target(f"wmwatch_watermark_lag_seconds{{{QUERY}}}", "{{query}}")],
        description="Batch time minus watermark: how far each query's watermark trails the clock.",
    )


def input_vs_processing_rate() -> PanelBuilder:
    return timeseries_panel(
        "Input vs processing rate",
        "short",
        [
            Target(
                f"sum by (query) (wmwatch_input_rows_per_second{{{QUERY}}})", "{{query}} input/s"
            ),
            Target(
                f"sum by (query) (wmwatch_processed_rows_per_second{{{QUERY}}})",
                "{{query}} processed/s",
            ),
        ],
        description="Rows per second arriving vs processed in the last batch; processing below "
        "input for long means the query falls behind.",
    )


def rows_dropped_as_late() -> PanelBuilder:
    return timeseries_panel(
        "Rows dropped as late",
        "short",
        [
            Target(
                "sum by (query) (increase(wmwatch_rows_dropped_by_watermark_total"
                f"{{{QUERY}}}[$__rate_interval]))",
                "{{query}}",
            )
        ],
        description="Rows (late groups, for aggregations) that stateful operators dropped behind "
        "the watermark.",
        bars=True,
    )


def state_rows() -> PanelBuilder:
    return timeseries_panel(
        "State rows",
        "short",
        [Target(f"sum by (query) (wmwatch_state_rows{{{QUERY}}})", "{{query}}")],
        description="Rows held in state over all stateful operators of each query.",
    )


def state_memory() -> PanelBuilder:
    return timeseries_panel(
        "State memory",
        "bytes",
        [Target(f"sum by (query) (wmwatch_state_memory_bytes{{{QUERY}}})", "{{query}}")],
        description="Memory used by state stores, summed over operators.",
    )


def batch_duration() -> PanelBuilder:
    return timeseries_panel(
        "Batch duration",
        "s",
        [Target(f"wmwatch_batch_duration_seconds{{{QUERY}}}", "{{query}}")],
        description="Wall time of each query's last batch.",
    )


def build() -> dashboard_models.Dashboard:
    return assemble(
        uid=UID,
        title="wmwatch / Streaming queries overview",
        description=(
            "Watermark lag, throughput, late rows, state and health of every watched query."
        ),
        multi_query=True,
        rows=[
            (
                "Health",
                [queries_running(), queries_failed(), worst_watermark_lag(), stalest_progress()],
            ),
            ("Watermarks and throughput", [watermark_lag(), input_vs_processing_rate()]),
            (
                "Late rows and state",
                [rows_dropped_as_late(), batch_duration(), state_rows(), state_memory()],
            ),
        ],
    )
