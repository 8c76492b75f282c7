"""wmwatch's own health: is the monitor itself losing events, failing, or falling behind?"""

from __future__ import annotations

from grafana_foundation_sdk.models import dashboard as dashboard_models

from dashboards._panels import PanelBuilder, Target, assemble, stat_panel, timeseries_panel

UID = "wmwatch-health"

# A labelled counter has no series until its first increment; `or 0 * <always-present gauge>`
# shows a zero per wmwatch instance instead of "No data", which reads as broken.
_ZERO_PER_INSTANCE = "0 * wmwatch_event_queue_size"


def events_dropped_total() -> PanelBuilder:
    return stat_panel(
        "Events dropped",
        "short",
        Target("sum(increase(wmwatch_events_dropped_total[$__range]))"),
        description="Listener events dropped in the time range because the queue was full.",
        thresholds=((None, "green"), (1, "red")),
    )


def store_up() -> PanelBuilder:
    return stat_panel(
        "History store up",
        "short",
        Target("min(wmwatch_store_up)"),
        description="0 when the last write to the DuckDB history failed.",
        thresholds=((None, "red"), (1, "green")),
    )


def store_pending_now() -> PanelBuilder:
    return stat_panel(
        "Store writes pending",
        "short",
        Target("sum(wmwatch_store_pending_writes)"),
        description="Writes waiting for the DuckDB history.",
        thresholds=((None, "green"), (1000, "orange")),
    )


def queue_size_now() -> PanelBuilder:
    return stat_panel(
        "Event queue",
        "short",
        Target("sum(wmwatch_event_queue_size)"),
        description="Events waiting for the worker thread.",
    )


def events_received() -> PanelBuilder:
    return timeseries_panel(
        "Events received",
        "short",
        [
            Target(
                "sum by (kind) (rate(wmwatch_events_received_total[$__rate_interval]))",
                "{{kind}}/s",
            )
        ],
        description="Listener events per second, by kind.",
    )


def events_dropped() -> PanelBuilder:
    return timeseries_panel(
        "Events dropped",
        "short",
        [
            Target(
                "sum by (kind) (increase(wmwatch_events_dropped_total[$__rate_interval]))",
                "{{kind}}",
            )
        ],
        description="Any drop means missing history and late-row audit gaps.",
        bars=True,
    )


def listener_errors() -> PanelBuilder:
    return timeseries_panel(
        "Listener errors",
        "short",
        [
            Target(
                "sum by (stage) (increase(wmwatch_listener_errors_total[$__rate_interval])) "
                f"or on () sum({_ZERO_PER_INSTANCE})",
                "{{stage}}",
            )
        ],
        description="Errors while receiving or handling events, by stage (wmwatch logs each).",
        bars=True,
    )


def event_queue() -> PanelBuilder:
    return timeseries_panel(
        "Event queue size",
        "short",
        [Target("wmwatch_event_queue_size", "{{instance}}")],
        description="A queue that keeps growing means the worker cannot keep up.",
    )


def event_handling_time() -> PanelBuilder:
    return timeseries_panel(
        "Event handling time",
        "s",
        [
            Target(
                "histogram_quantile(0.5, sum by (le) (rate(wmwatch_event_handling_seconds_bucket"
                "[$__rate_interval])))",
                "p50",
            ),
            Target(
                "histogram_quantile(0.99, sum by (le) (rate(wmwatch_event_handling_seconds_bucket"
                "[$__rate_interval])))",
                "p99",
            ),
        ],
        description="Worker time per event; it should stay in the low milliseconds.",
    )


def store_writes() -> PanelBuilder:
    return timeseries_panel(
        "History store",
        "short",
        [
            Target("sum(wmwatch_store_pending_writes)", "pending writes"),
            Target("sum(increase(wmwatch_store_errors_total[$__rate_interval]))", "write errors"),
        ],
        description="Writes waiting for DuckDB, and failed write attempts (retried).",
    )


def audit_lag_batches() -> PanelBuilder:
    return timeseries_panel(
        "Audit lag (batches)",
        "short",
        [Target("wmwatch_audit_lag_batches", "{{query}}")],
        description="Batches each audited query's late-row audit still has to check.",
    )


def audit_lag_seconds() -> PanelBuilder:
    return timeseries_panel(
        "Audit lag (time)",
        "s",
        [Target("wmwatch_audit_lag_seconds", "{{query}}")],
        description="How far behind the newest batch the audit is.",
    )


def build() -> dashboard_models.Dashboard:
    return assemble(
        uid=UID,
        title="wmwatch / Monitor health",
        description="Whether wmwatch itself receives, handles and stores every event.",
        multi_query=None,
        rows=[
            ("Now", [events_dropped_total(), store_up(), store_pending_now(), queue_size_now()]),
            ("Events", [events_received(), events_dropped(), listener_errors(), event_queue()]),
            ("Worker and store", [event_handling_time(), store_writes()]),
            ("Audit", [audit_lag_batches(), audit_lag_seconds()]),
        ],
    )
