"""The OpenTelemetry side without a Collector or a JVM: the one name table is complete and is what
docs/metrics.md shows, collected values convert to OTLP data point for point, the OTLP options
refuse mistakes in one line, and a watch without OTLP imports nothing of OpenTelemetry."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from wmwatch._core.health import Health
from wmwatch._core.state import QueryBook
from wmwatch._errors import ConfigError
from wmwatch._metrics.collector import WatchCollector
from wmwatch._metrics.otlp.names import (
    ATTRIBUTES,
    BY_PROMETHEUS,
    METRICS,
    attributes_table,
    metrics_table,
)
from wmwatch._progress import parse_progress

ROOT = Path(__file__).parent.parent
FIXTURE = Path(__file__).parent / "fixtures" / "progress_window.json"
# A family is made in one of these ways in the package: a prometheus-client family class, or the
# collector's _gauge/_counter helpers, with the name as the first argument.
_FAMILY = re.compile(r"(?:MetricFamily|_gauge|_counter)\(\s*\"(wmwatch_[a-z0-9_]+)\"", re.MULTILINE)


def _families_in_source() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "wmwatch").rglob("*.py"):
        names.update(_FAMILY.findall(path.read_text()))
    return names


def test_every_metric_family_in_the_package_has_one_row_both_ways() -> None:
    made = _families_in_source()
    assert len(made) > 60, made  # the scan finds the families (a broken pattern finds none)
    mapped = {m.prometheus for m in METRICS}
    assert made - mapped == set(), "families with no OpenTelemetry name in names.METRICS"
    assert mapped - made == set(), "rows in names.METRICS for families nothing makes"
    otel = [m.name for m in METRICS]
    assert len(otel) == len(set(otel)), "two Prometheus families under one OpenTelemetry name"


def test_names_follow_opentelemetry_style() -> None:
    for m in METRICS:
        # the API's instrument name syntax; units in the unit field, no Prometheus suffixes
        assert re.fullmatch(r"[a-z][a-z0-9_.]{0,254}", m.name), m.name
        assert m.name.split(".")[0] in ("spark", "wmwatch"), m.name
        assert not re.search(r"(_total|_seconds|_bytes|_info)$", m.name), m.name
        assert m.unit and " " not in m.unit, m
        if m.prometheus.endswith("_seconds") and "timestamp" not in m.prometheus:
            assert m.unit == "s", m
        if m.prometheus.endswith("_bytes"):
            assert m.unit == "By", m
    for attribute in ATTRIBUTES.values():
        assert re.fullmatch(r"[a-z][a-z0-9_.]*", attribute), attribute
    kafka = BY_PROMETHEUS["wmwatch_kafka_partition_offsets_behind_latest"]
    assert kafka.attribute("topic") == "messaging.destination.name"
    assert kafka.attribute("partition") == "messaging.destination.partition.id"
    assert BY_PROMETHEUS["wmwatch_watermark_lag_seconds"].name == "spark.streaming.watermark.lag"


def test_docs_list_every_metric_under_both_names() -> None:
    docs = (ROOT / "docs" / "metrics.md").read_text()
    for table in (attributes_table(), metrics_table()):
        assert table in docs, (
            "docs/metrics.md is not the name table in code: replace its OpenTelemetry tables "
            "with the output of `python -m wmwatch._metrics.otlp.names`"
        )


def _registry_with_a_batch() -> CollectorRegistry:
    book = QueryBook(forget_after_seconds=60)
    doc = json.loads(FIXTURE.read_text())
    doc["sources"].append(
        {
            "description": "KafkaV2[Subscribe[orders]]",
            "startOffset": {"orders": {"0": 10, "1": 4}},
            "endOffset": {"orders": {"0": 17, "1": 9}},
            "latestOffset": {"orders": {"0": 20, "1": 9}},
            "numInputRows": 12,
        }
    )
    book.on_progress(parse_progress(doc))
    health = Health()
    health.observe_handling(0.003)
    registry = CollectorRegistry()
    registry.register(WatchCollector(book, health, queue_size=lambda: 0, queue_capacity=10))
    return registry


def test_kafka_partitions_are_series_with_topic_and_partition() -> None:
    registry = _registry_with_a_batch()
    labels = {"query": "orders_per_minute", "source": "1", "topic": "orders"}
    read = "wmwatch_kafka_partition_end_offset"
    behind = "wmwatch_kafka_partition_offsets_behind_latest"
    assert registry.get_sample_value(read, {**labels, "partition": "0"}) == 17
    assert registry.get_sample_value(read, {**labels, "partition": "1"}) == 9
    assert registry.get_sample_value(behind, {**labels, "partition": "0"}) == 3
    assert registry.get_sample_value(behind, {**labels, "partition": "1"}) == 0
    # a file source has no partitions
    assert registry.get_sample_value(read, {**labels, "source": "0", "partition": "0"}) is None


def test_collected_values_become_otlp_points_one_for_one() -> None:
    from opentelemetry.sdk.metrics.export import Gauge, Histogram, Sum
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from wmwatch._metrics.otlp.convert import to_metrics_data

    registry = _registry_with_a_batch()
    families = list(registry.collect())
    data = to_metrics_data(
        families,
        resource=Resource.create({"service.name": "t"}),
        scope=InstrumentationScope("wmwatch"),
        start_ns=1,
        now_ns=2,
    )
    metrics = {m.name: m for m in data.resource_metrics[0].scope_metrics[0].metrics}
    compared = 0
    for family in families:
        mapped = BY_PROMETHEUS[family.name]
        metric = metrics[mapped.name]
        assert metric.unit == mapped.unit
        if family.type == "histogram":
            assert isinstance(metric.data, Histogram)
            (point,) = metric.data.data_points
            buckets = {
                s.labels["le"]: s.value for s in family.samples if s.name.endswith("_bucket")
            }
            assert point.count == buckets["+Inf"] == 1
            assert sum(point.bucket_counts) == 1
            assert len(point.bucket_counts) == len(point.explicit_bounds) + 1
            compared += 1
            continue
        expected_type = Sum if family.type == "counter" else Gauge
        assert isinstance(metric.data, expected_type), family.name
        values = {tuple(sorted(p.attributes.items())): p.value for p in metric.data.data_points}
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            attributes = {mapped.attribute(k): v for k, v in sample.labels.items()}
            attributes.update(mapped.constant)
            assert values[tuple(sorted(attributes.items()))] == sample.value, sample
            compared += 1
    assert compared > 40
    lag = metrics["spark.streaming.watermark.lag"].data.data_points[0]
    assert lag.attributes == {"spark.streaming.query.name": "orders_per_minute"}
    assert lag.value == 20.0  # 00:02:00 batch time minus the 00:01:40 watermark
    lag_points = metrics["spark.streaming.source.kafka.lag"].data.data_points
    assert {(p.attributes["messaging.destination.partition.id"], p.value) for p in lag_points} == {
        ("0", 3.0),
        ("1", 0.0),
    }
    assert all(p.attributes["messaging.system"] == "kafka" for p in lag_points)
    assert all(p.attributes["messaging.destination.name"] == "orders" for p in lag_points)


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"endpoint": "collector:4318"}, "needs a scheme and a host"),
        ({"endpoint": "http://collector:4318", "protocol": "thrift"}, "otlp_protocol"),
        ({"endpoint": "https://u:s3cr3tpw@collector:4318"}, "not in otlp_endpoint"),
        ({"endpoint": "http://collector:4318", "cafile": "ca.pem"}, "need an https://"),
        ({"endpoint": "https://collector:4318", "certfile": "c.pem"}, "both otlp_certfile"),
        ({"endpoint": "https://collector:4318", "cafile": "/nonexistent/ca.pem"}, "cannot read"),
        ({"endpoint": "http://collector:4317/v1", "protocol": "grpc"}, "no path"),
        ({"endpoint": "http://c:4318", "interval_seconds": 0}, "above 0"),
        (
            {"endpoint": "http://c:4318", "headers": {"authorization": "Bearer t0k\nv4lue"}},
            "line break",
        ),
    ],
)
def test_otlp_options_refuse_mistakes_in_one_line(options: dict[str, object], says: str) -> None:
    from wmwatch._metrics.otlp.exporter import otlp_settings

    endpoint = str(options.pop("endpoint"))
    with pytest.raises(ConfigError) as caught:
        otlp_settings(endpoint, **options)  # type: ignore[arg-type]
    message = str(caught.value)
    assert says in message and "\n" not in message
    assert "s3cr3tpw" not in message and "t0k" not in message


def test_http_urls_follow_the_endpoint_path() -> None:
    from wmwatch._metrics.otlp.exporter import otlp_settings

    settings = otlp_settings("https://gateway.example/otlp/", headers={"X-Token": "t"})
    assert settings.signal_url("metrics") == "https://gateway.example/otlp/v1/metrics"
    assert settings.headers == {"x-token": "t"}
    assert otlp_settings("http://c:4317", protocol="grpc").grpc_target == "c:4317"


def test_a_watch_without_otlp_imports_nothing_of_opentelemetry() -> None:
    code = (
        "import sys, wmwatch, wmwatch._attach, wmwatch._metrics.collector, wmwatch.cli;"
        "from wmwatch._metrics.otlp import names;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('opentelemetry', 'grpc')))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    assert out.strip() == "[]"


def test_the_resource_names_the_application_not_a_later_builder_call() -> None:
    """A ``builder.appName(...)`` in the same driver (the sidecar CLI run in-process does one)
    changes the session's ``spark.app.name`` conf, never the application's own name."""
    from types import SimpleNamespace

    from wmwatch._metrics.otlp.exporter import spark_resource

    conf = {"spark.app.id": "local-1", "spark.app.name": "wmwatch-sidecar"}
    classic = SimpleNamespace(
        _jsparkSession=object(),  # what makes a session classic (py4j)
        conf=SimpleNamespace(get=lambda key, default=None: conf.get(key, default)),
        sparkContext=SimpleNamespace(applicationId="local-1", appName="orders-job"),
    )
    resource = spark_resource(classic, None, None)
    assert resource["spark.app.name"] == "orders-job"
    assert resource["service.name"] == "orders-job"

    # Spark Connect: no SparkContext, so the session's conf is what there is
    connect = SimpleNamespace(conf=classic.conf)
    assert spark_resource(connect, None, None)["spark.app.name"] == "wmwatch-sidecar"
