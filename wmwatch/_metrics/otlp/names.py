"""The one mapping between wmwatch's Prometheus names and its OpenTelemetry names.

Every metric family the collector and the plugins yield has one row in :data:`METRICS`: its
Prometheus family name (as collected: a counter without ``_total``), its OpenTelemetry name and
UCUM unit, and its kind. Labels become attributes through :data:`ATTRIBUTES`, or through a row's
own ``attributes`` where one label name means something else in that family (``kind``,
``source``). OpenTelemetry names put the unit in the unit field, never in the name, and have no
``_total``: ``wmwatch_watermark_lag_seconds`` is ``spark.streaming.watermark.lag`` in ``s``.
What the watched query does is under ``spark.streaming.``; wmwatch's own health under
``wmwatch.``. Timestamps are Unix seconds in both.

``python -m wmwatch._metrics.otlp.names`` prints the tables that docs/metrics.md carries (a test
keeps them equal). Nothing of OpenTelemetry is imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

# Prometheus label -> OpenTelemetry attribute, wherever a row does not say otherwise.
ATTRIBUTES: Mapping[str, str] = MappingProxyType(
    {
        "query": "spark.streaming.query.name",
        "query_id": "spark.streaming.query.id",
        "trigger": "spark.streaming.trigger",
        "phase": "spark.streaming.batch.phase",
        "operator": "spark.streaming.operator.index",
        "operator_name": "spark.streaming.operator.name",
        "source": "spark.streaming.source.index",
        "description": "spark.streaming.source.description",
        "side": "spark.streaming.join.side",
        "policy": "spark.streaming.watermark.policy",
        "topic": "messaging.destination.name",
        "partition": "messaging.destination.partition.id",
        "kind": "wmwatch.event.kind",
        "stage": "wmwatch.listener.stage",
        "mode": "wmwatch.listener.mode",
        "reason": "wmwatch.connection.close_reason",
        "signal": "wmwatch.otlp.signal",
    }
)

KAFKA: Mapping[str, str] = MappingProxyType({"messaging.system": "kafka"})


@dataclass(frozen=True)
class Mapped:
    """One metric under both names."""

    prometheus: str  # the family name as collected (counters without ``_total``)
    name: str
    unit: str
    kind: str  # gauge, counter, histogram or info (a gauge of 1 on both sides)
    attributes: Mapping[str, str] = field(default_factory=dict)  # this family's own renames
    constant: Mapping[str, str] = field(default_factory=dict)  # attributes every point carries

    def attribute(self, label: str) -> str:
        """The attribute a label of this family becomes."""
        return self.attributes.get(label) or ATTRIBUTES.get(label) or label

    @property
    def exposed(self) -> str:
        """The name of the family on /metrics."""
        suffix = {"counter": "_total", "info": "_info"}.get(self.kind, "")
        return self.prometheus + suffix


def _m(
    prometheus: str,
    name: str,
    unit: str,
    kind: str = "gauge",
    *,
    attributes: Mapping[str, str] | None = None,
    constant: Mapping[str, str] | None = None,
) -> Mapped:
    return Mapped(prometheus, name, unit, kind, dict(attributes or {}), dict(constant or {}))


_SOURCE_NAME = {"source": "spark.streaming.source.name"}

METRICS: tuple[Mapped, ...] = (
    # the watched queries (_metrics/collector.py)
    _m("wmwatch_query_info", "spark.streaming.query.info", "1"),
    _m("wmwatch_query_up", "spark.streaming.query.up", "1"),
    _m("wmwatch_query_failed", "spark.streaming.query.failed", "1"),
    _m("wmwatch_watermark_seconds", "spark.streaming.watermark", "s"),
    _m("wmwatch_event_time_max_seconds", "spark.streaming.event_time.max", "s"),
    _m("wmwatch_event_time_min_seconds", "spark.streaming.event_time.min", "s"),
    _m("wmwatch_event_time_avg_seconds", "spark.streaming.event_time.avg", "s"),
    _m("wmwatch_watermark_lag_seconds", "spark.streaming.watermark.lag", "s"),
    _m("wmwatch_event_time_delay_seconds", "spark.streaming.event_time.delay", "s"),
    _m("wmwatch_event_time_ahead_seconds", "spark.streaming.event_time.ahead", "s"),
    _m("wmwatch_event_time_spread_seconds", "spark.streaming.event_time.spread", "s"),
    _m("wmwatch_input_rows", "spark.streaming.input.rows", "{row}", "counter"),
    _m("wmwatch_batch_input_rows", "spark.streaming.batch.input.rows", "{row}"),
    _m("wmwatch_input_rows_per_second", "spark.streaming.input.rate", "{row}/s"),
    _m("wmwatch_processed_rows_per_second", "spark.streaming.processing.rate", "{row}/s"),
    _m("wmwatch_batch_duration_seconds", "spark.streaming.batch.duration", "s"),
    _m("wmwatch_batch_phase_duration_seconds", "spark.streaming.batch.phase.duration", "s"),
    _m("wmwatch_batches", "spark.streaming.batches", "{batch}", "counter"),
    _m(
        "wmwatch_progress_events_missed",
        "spark.streaming.progress_events.missed",
        "{batch}",
        "counter",
    ),
    _m("wmwatch_last_batch_id", "spark.streaming.batch.last_id", "1"),
    _m("wmwatch_last_progress_timestamp_seconds", "spark.streaming.progress.last_time", "s"),
    _m("wmwatch_last_event_timestamp_seconds", "spark.streaming.query.last_event_time", "s"),
    _m(
        "wmwatch_rows_dropped_by_watermark",
        "spark.streaming.state.rows.dropped_by_watermark",
        "{row}",
        "counter",
    ),
    _m("wmwatch_state_rows", "spark.streaming.state.rows", "{row}"),
    _m("wmwatch_state_rows_updated", "spark.streaming.state.rows.updated", "{row}"),
    _m("wmwatch_state_rows_removed", "spark.streaming.state.rows.removed", "{row}", "counter"),
    _m("wmwatch_state_memory_bytes", "spark.streaming.state.memory.usage", "By"),
    _m("wmwatch_source_input_rows", "spark.streaming.source.input.rows", "{row}", "counter"),
    _m(
        "wmwatch_kafka_partition_end_offset",
        "spark.streaming.source.kafka.offset",
        "{offset}",
        constant=KAFKA,
    ),
    _m(
        "wmwatch_kafka_partition_offsets_behind_latest",
        "spark.streaming.source.kafka.lag",
        "{message}",
        constant=KAFKA,
    ),
    # the audit (_audit/plugin.py)
    _m("wmwatch_late_rows_audited", "spark.streaming.audit.late_rows", "{row}", "counter"),
    _m(
        "wmwatch_late_rows_audited_by_operator",
        "spark.streaming.audit.operator.late_rows",
        "{row}",
        "counter",
        attributes={"kind": "spark.streaming.operator.kind"},
    ),
    _m(
        "wmwatch_late_rows_over_cap",
        "spark.streaming.audit.late_rows.over_cap",
        "{row}",
        "counter",
    ),
    _m(
        "wmwatch_audit_batches_over_cap",
        "spark.streaming.audit.batches.over_cap",
        "{batch}",
        "counter",
    ),
    _m("wmwatch_audit_lag_batches", "spark.streaming.audit.lag.batches", "{batch}"),
    _m("wmwatch_audit_lag_seconds", "spark.streaming.audit.lag", "s"),
    _m("wmwatch_audit_errors", "spark.streaming.audit.errors", "{error}", "counter"),
    _m(
        "wmwatch_audit_retention_batches_remaining",
        "spark.streaming.audit.retention.remaining",
        "{batch}",
    ),
    _m("wmwatch_audit_batches_lost", "spark.streaming.audit.batches.lost", "{batch}", "counter"),
    _m(
        "wmwatch_rows_kept_behind_watermark",
        "spark.streaming.audit.rows.kept_behind_watermark",
        "{row}",
        "counter",
    ),
    # plan inspection (_inspect/metrics.py)
    _m("wmwatch_join_state_unbounded", "spark.streaming.join.state.unbounded", "1"),
    _m(
        "wmwatch_state_growth_rows_per_second",
        "spark.streaming.join.state.rows.growth_rate",
        "{row}/s",
    ),
    _m(
        "wmwatch_state_growth_bytes_per_second",
        "spark.streaming.join.state.memory.growth_rate",
        "By/s",
    ),
    _m(
        "wmwatch_state_budget_seconds_remaining",
        "spark.streaming.join.state.budget.remaining_time",
        "s",
    ),
    _m(
        "wmwatch_operator_watermark_seconds",
        "spark.streaming.operator.watermark",
        "s",
        attributes={"kind": "spark.streaming.watermark.kind"},
    ),
    _m(
        "wmwatch_source_watermark_seconds",
        "spark.streaming.source.watermark",
        "s",
        attributes=_SOURCE_NAME,
    ),
    _m(
        "wmwatch_source_event_time_max_seconds",
        "spark.streaming.source.event_time.max",
        "s",
        attributes=_SOURCE_NAME,
    ),
    _m(
        "wmwatch_watermark_holding_back",
        "spark.streaming.source.watermark.holding_back",
        "1",
        attributes=_SOURCE_NAME,
    ),
    _m(
        "wmwatch_source_idle_batches",
        "spark.streaming.source.idle_batches",
        "{batch}",
        attributes=_SOURCE_NAME,
    ),
    _m("wmwatch_multiple_watermark_policy", "spark.streaming.query.watermark_policy", "1", "info"),
    _m(
        "wmwatch_findings_active",
        "spark.streaming.findings.active",
        "{finding}",
        attributes={"kind": "wmwatch.finding.kind"},
    ),
    _m(
        "wmwatch_plan_inspection_seconds",
        "wmwatch.plan_inspection.duration",
        "s",
        attributes={"kind": "wmwatch.plan_inspection.kind"},
    ),
    # wmwatch's own health (_metrics/collector.py)
    _m("wmwatch_events_received", "wmwatch.listener.events.received", "{event}", "counter"),
    _m("wmwatch_events_dropped", "wmwatch.listener.events.dropped", "{event}", "counter"),
    _m("wmwatch_events_processed", "wmwatch.listener.events.processed", "{event}", "counter"),
    _m("wmwatch_listener_errors", "wmwatch.listener.errors", "{error}", "counter"),
    _m("wmwatch_event_queue_size", "wmwatch.event_queue.size", "{event}"),
    _m("wmwatch_event_queue_capacity", "wmwatch.event_queue.capacity", "{event}"),
    _m("wmwatch_event_handling_seconds", "wmwatch.event.handling.duration", "s", "histogram"),
    _m("wmwatch_listener_mode", "wmwatch.listener.mode", "1"),
    _m("wmwatch_metrics_server_up", "wmwatch.metrics_server.up", "1"),
    _m(
        "wmwatch_metrics_connections_closed",
        "wmwatch.metrics_server.connections.closed",
        "{connection}",
        "counter",
    ),
    _m(
        "wmwatch_spark_listener_events_dropped",
        "spark.listener_bus.streams.events.dropped",
        "{event}",
        "counter",
    ),
    _m("wmwatch_store_up", "wmwatch.store.up", "1"),
    _m("wmwatch_store_pending_writes", "wmwatch.store.pending_writes", "{write}"),
    _m("wmwatch_store_pending_bytes", "wmwatch.store.pending.size", "By"),
    _m("wmwatch_store_writes", "wmwatch.store.writes", "{write}", "counter"),
    _m("wmwatch_store_errors", "wmwatch.store.errors", "{error}", "counter"),
    _m("wmwatch_store_dropped_writes", "wmwatch.store.dropped_writes", "{write}", "counter"),
    _m(
        "wmwatch_store_progress_json_missing",
        "wmwatch.store.progress_json.missing",
        "{batch}",
        "counter",
    ),
    # the Pushgateway (_metrics/push.py) and OTLP (_metrics/otlp/exporter.py)
    _m("wmwatch_pushes", "wmwatch.pushgateway.pushes", "{push}", "counter"),
    _m("wmwatch_push_errors", "wmwatch.pushgateway.errors", "{push}", "counter"),
    _m("wmwatch_last_push_timestamp_seconds", "wmwatch.pushgateway.last_push_time", "s"),
    _m("wmwatch_otlp_exports", "wmwatch.otlp.exports", "{export}", "counter"),
    _m("wmwatch_otlp_exports_dropped", "wmwatch.otlp.exports.dropped", "{export}", "counter"),
    _m("wmwatch_otlp_spans_dropped", "wmwatch.otlp.spans.dropped", "{span}", "counter"),
    _m("wmwatch_otlp_last_export_timestamp_seconds", "wmwatch.otlp.last_export_time", "s"),
)

BY_PROMETHEUS: Mapping[str, Mapped] = MappingProxyType({m.prometheus: m for m in METRICS})
BY_NAME: Mapping[str, Mapped] = MappingProxyType({m.name: m for m in METRICS})


def metrics_table() -> str:
    """Every metric under both names, as the Markdown table in docs/metrics.md."""
    lines = [
        "| Prometheus | OpenTelemetry | unit | type | attributes |",
        "| --- | --- | --- | --- | --- |",
    ]
    for m in sorted(METRICS, key=lambda m: m.exposed):
        own = [f"`{label}`: `{attr}`" for label, attr in sorted(m.attributes.items())]
        own += [f"`{attr}`=`{value}`" for attr, value in sorted(m.constant.items())]
        otel_kind = {"counter": "sum", "info": "gauge"}.get(m.kind, m.kind)
        lines.append(
            f"| `{m.exposed}` | `{m.name}` | `{m.unit}` | {m.kind} / {otel_kind} | "
            f"{', '.join(own)} |"
        )
    return "\n".join(lines)


def attributes_table() -> str:
    """Labels and the attributes they become, as the Markdown table in docs/metrics.md."""
    lines = ["| Prometheus label | OpenTelemetry attribute |", "| --- | --- |"]
    lines += [f"| `{label}` | `{attr}` |" for label, attr in ATTRIBUTES.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    print(attributes_table(), metrics_table(), sep="\n\n")
