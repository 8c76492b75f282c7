"""Plan inspection's metric families: join state, per-operator and per-input watermarks,
active findings and the cost of the plan reads."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric

from wmwatch._inspect.findings import Finding
from wmwatch._inspect.joins import SIDES
from wmwatch._inspect.state import QueryState


def plan_metrics(
    queries: Sequence[QueryState],
    findings: Iterable[Finding],
    costs: Mapping[str, Sequence[float]],
    state_budget_bytes: int | None,
) -> list[Metric]:
    """Every family, built from the queries' state (read under the plugin's lock)."""
    unbounded = GaugeMetricFamily(
        "wmwatch_join_state_unbounded",
        "1 when the plan never cleans this side of a stream-stream join's state",
        labels=["query", "operator", "side"],
    )
    rows_rate = GaugeMetricFamily(
        "wmwatch_state_growth_rows_per_second",
        "Growth of a join side's state rows (operator total split over its uncleaned sides)",
        labels=["query", "operator", "side"],
    )
    bytes_rate = GaugeMetricFamily(
        "wmwatch_state_growth_bytes_per_second",
        "Growth of a join side's state memory (operator total split over its uncleaned sides)",
        labels=["query", "operator", "side"],
    )
    budget = GaugeMetricFamily(
        "wmwatch_state_budget_seconds_remaining",
        "Seconds until a growing join's state reaches the configured state budget",
        labels=["query", "operator"],
    )
    op_wm = GaugeMetricFamily(
        "wmwatch_operator_watermark_seconds",
        "A stateful operator's watermark for late rows (late) and for eviction/output (eviction)",
        labels=["query", "operator", "kind"],
    )
    src_wm = GaugeMetricFamily(
        "wmwatch_source_watermark_seconds",
        "A withWatermark input's own watermark (its max event time minus its delay)",
        labels=["query", "source"],
    )
    src_max = GaugeMetricFamily(
        "wmwatch_source_event_time_max_seconds",
        "The max event time a withWatermark input has seen in this run",
        labels=["query", "source"],
    )
    holding = GaugeMetricFamily(
        "wmwatch_watermark_holding_back",
        "1 for the input the global watermark is waiting for",
        labels=["query", "source"],
    )
    idle = GaugeMetricFamily(
        "wmwatch_source_idle_batches",
        "Consecutive batches in which an input read no rows",
        labels=["query", "source"],
    )
    policy = InfoMetricFamily(
        "wmwatch_multiple_watermark_policy",
        "The multiple-watermark policy in force for a query",
        labels=["query", "policy"],
    )
    active = GaugeMetricFamily(
        "wmwatch_findings_active", "Active findings by kind", labels=["query", "kind"]
    )
    cost = GaugeMetricFamily(
        "wmwatch_plan_inspection_seconds",
        "Mean cost of wmwatch's plan reads (structure once per run; light read per batch)",
        labels=["kind"],
    )
    for q in queries:
        label = q.label
        for op_id, check in q.checks.items():
            growth = q.growth.get(op_id)
            sides_growing = check.unbounded_sides or SIDES
            rows_per_second = growth.rows_per_second if growth else 0.0
            bytes_per_second = growth.bytes_per_second if growth else 0.0
            for side in SIDES:
                labels = [label, str(op_id), side]
                unbounded.add_metric(labels, 1.0 if side in check.unbounded_sides else 0.0)
                share = 1.0 / len(sides_growing) if side in sides_growing else 0.0
                measured = q.side_rate(op_id, side)
                rows_rate.add_metric(
                    labels, measured if measured is not None else rows_per_second * share
                )
                bytes_rate.add_metric(labels, bytes_per_second * share)
            if growth is not None and growth.growing:
                remaining = growth.seconds_to_budget(state_budget_bytes)
                if remaining is not None:
                    budget.add_metric([label, str(op_id)], remaining)
        for op_id, growth in q.growth.items():
            if op_id not in q.checks:  # no plan: the operator's total, side unknown
                rows_rate.add_metric([label, str(op_id), "unknown"], growth.rows_per_second)
                bytes_rate.add_metric([label, str(op_id), "unknown"], growth.bytes_per_second)
        if q.reading is not None:
            for o in q.reading.operators:
                operator = str(o.operator_id)
                if o.late_at is not None:
                    op_wm.add_metric([label, operator, "late"], o.late_at.timestamp())
                if o.eviction_at is not None:
                    op_wm.add_metric([label, operator, "eviction"], o.eviction_at.timestamp())
        for s in q.sources:
            if s.watermark_at is not None:
                src_wm.add_metric([label, s.source], s.watermark_at.timestamp())
            if s.event_time_max_at is not None:
                src_max.add_metric([label, s.source], s.event_time_max_at.timestamp())
            holding.add_metric([label, s.source], 1.0 if s.holding_back else 0.0)
            idle.add_metric([label, s.source], float(s.idle_batches))
        if q.facts is not None and q.facts.watermark_nodes:
            policy.add_metric([label, q.facts.policy], {})
    counts: dict[tuple[str, str], int] = {}
    query_labels = {q.query_id: q.label for q in queries}
    for finding in findings:
        query = query_labels.get(finding.query_id, finding.query_name or finding.query_id)
        key = (query, finding.kind)
        counts[key] = counts.get(key, 0) + (1 if finding.active else 0)
    for (query, kind), count in sorted(counts.items()):
        active.add_metric([query, kind], float(count))
    for kind, values in costs.items():
        if values:
            cost.add_metric([kind.removesuffix("_seconds")], sum(values) / len(values))
    return [
        unbounded, rows_rate, bytes_rate, budget, op_wm, src_wm, src_max, holding, idle, policy,
        active, cost,
    ]  # fmt: skip
