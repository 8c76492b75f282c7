"""Collected Prometheus families into OpenTelemetry metric data, through the one name table.

The values are the ones /metrics would serve at that moment: the same collector yields them.
Gauges (and info families) become gauges, counters cumulative monotonic sums, the histogram a
cumulative histogram with the same bounds. Families the table does not name (a caller's own
metrics in a shared registry) are not exported.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client.core import Metric as Family

from wmwatch._metrics.otlp.names import BY_PROMETHEUS, Mapped

Labels = dict[str, str]


def to_metrics_data(
    families: Iterable[Family],
    *,
    resource: Resource,
    scope: InstrumentationScope,
    start_ns: int,
    now_ns: int,
) -> MetricsData:
    """One export's worth of data: every mapped family, stamped ``now_ns``; sums and the
    histogram count from ``start_ns`` (when the watch started)."""
    metrics = []
    for family in families:
        mapped = BY_PROMETHEUS.get(family.name)
        if mapped is None:
            continue
        data: Any
        if family.type == "counter":
            data = Sum(
                data_points=_numbers(family, mapped, "_total", start_ns, now_ns),
                aggregation_temporality=AggregationTemporality.CUMULATIVE,
                is_monotonic=True,
            )
        elif family.type == "histogram":
            data = Histogram(
                data_points=_histograms(family, mapped, start_ns, now_ns),
                aggregation_temporality=AggregationTemporality.CUMULATIVE,
            )
        else:
            suffix = "_info" if family.type == "info" else ""
            data = Gauge(data_points=_numbers(family, mapped, suffix, start_ns, now_ns))
        if data.data_points:
            metrics.append(
                Metric(
                    name=mapped.name,
                    description=family.documentation,
                    unit=mapped.unit,
                    data=data,
                )
            )
    scoped = ScopeMetrics(scope=scope, metrics=metrics, schema_url="")
    return MetricsData(
        resource_metrics=[ResourceMetrics(resource=resource, scope_metrics=[scoped], schema_url="")]
    )


def _attributes(mapped: Mapped, labels: Labels) -> dict[str, str]:
    attributes = {mapped.attribute(label): value for label, value in labels.items()}
    attributes.update(mapped.constant)
    return attributes


def _numbers(
    family: Family, mapped: Mapped, suffix: str, start_ns: int, now_ns: int
) -> list[NumberDataPoint]:
    name = family.name + suffix
    return [
        NumberDataPoint(
            attributes=_attributes(mapped, sample.labels),
            start_time_unix_nano=start_ns,
            time_unix_nano=now_ns,
            value=float(sample.value),
        )
        for sample in family.samples
        if sample.name == name and not math.isnan(sample.value)
    ]


def _histograms(
    family: Family, mapped: Mapped, start_ns: int, now_ns: int
) -> list[HistogramDataPoint]:
    # Prometheus buckets are cumulative and keyed by "le"; OTLP's count each bucket alone
    series: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for sample in family.samples:
        labels = {k: v for k, v in sample.labels.items() if k != "le"}
        entry = series.setdefault(tuple(sorted(labels.items())), {"buckets": {}})
        if sample.name.endswith("_bucket"):
            entry["buckets"][float(sample.labels["le"])] = sample.value
        elif sample.name.endswith("_count"):
            entry["count"] = sample.value
        elif sample.name.endswith("_sum"):
            entry["sum"] = sample.value
    points = []
    for key, entry in series.items():
        bounds = sorted(entry["buckets"])
        cumulative = [entry["buckets"][b] for b in bounds]
        counts = [int(c - p) for c, p in zip(cumulative, [0.0, *cumulative[:-1]], strict=True)]
        finite = [b for b in bounds if not math.isinf(b)]
        points.append(
            HistogramDataPoint(
                attributes=_attributes(mapped, dict(key)),
                start_time_unix_nano=start_ns,
                time_unix_nano=now_ns,
                count=int(entry.get("count", cumulative[-1] if cumulative else 0)),
                sum=float(entry.get("sum", 0.0)),
                bucket_counts=counts,
                explicit_bounds=finite,
                # Prometheus keeps neither: OTLP leaves them unset
                min=None,  # type: ignore[arg-type]  # optional in OTLP, typed float in the SDK
                max=None,  # type: ignore[arg-type]  # optional in OTLP, typed float in the SDK
            )
        )
    return points
