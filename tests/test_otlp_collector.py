"""OTLP export against a real OpenTelemetry Collector (``tests/otelcol_server.py``, built from the
Collector's Go modules by ``.ci/build_otelcol.sh``) and real streaming queries on the shared
SparkSession.

What arrives is read back from the Collector's file exporter and compared with what /metrics
served at the same moment and with the queries' own progress: every metric, its value, its
attributes, the resource and the batch spans. The Collector is then stopped, paused (a Collector
that accepts connections and never answers) and started again under a running query: batches keep
being recorded, the watch never waits, drops are counted, and exports resume. TLS with a client
certificate and a bearer token are checked over HTTP and gRPC, and a missing token is refused.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import wmwatch
from tests import otelcol_server as otelcol
from tests.harness.kafka import new_topic, produce
from tests.harness.net import free_port
from tests.harness.streams import epoch_seconds, write_events
from wmwatch._metrics.otlp.names import BY_PROMETHEUS, METRICS, Mapped

pytestmark = [pytest.mark.spark, pytest.mark.otel]

SCHEMA = "id int, user string, ts timestamp"


def ts(second: int) -> str:
    return f"2026-01-01T00:{second // 60:02d}:{second % 60:02d}Z"


# One file per batch (availableNow runs no batch without data in between). A batch judges late
# rows by the watermark of the batch before it: the first file sets 15 s, the second moves it to
# 30 s, so the third is judged by 15 s: its rows at 3 s and 5 s (window [0, 10) has closed) are
# dropped, the one at 10 s (window [10, 20) still open) is kept.
FILES = [
    [(1, "a", 1), (2, "b", 4), (3, "c", 12), (4, "a", 25)],
    [(5, "a", 40)],
    [(6, "late", 3), (7, "open", 10), (8, "late", 5), (9, "y", 52)],
]


@pytest.fixture(scope="module")
def collector(tmp_path_factory: pytest.TempPathFactory) -> Iterator[otelcol.Collector]:
    """The module's Collector (plain and secure receivers), started once."""
    try:
        otelcol.otelcol_binary()
    except otelcol.CollectorMissing as exc:
        pytest.fail(str(exc))
    work = tmp_path_factory.mktemp("otelcol")
    with otelcol.running(otelcol.configure(work, otelcol.make_tls(work / "tls"))) as running:
        yield running


def otlp_plugin(watch: Any) -> Any:
    (plugin,) = [p for p in watch.plugins() if p.name == "otlp"]
    return plugin


def wait_for(condition: Callable[[], Any], timeout: float = 60.0, what: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what or condition}")


def received(path: Path, service: str) -> list[otelcol.Point]:
    return [p for p in otelcol.points(path) if p.resource.get("service.name") == service]


def last_export(path: Path, service: str, since_ns: int) -> list[otelcol.Point]:
    """The points of the newest export stamped after ``since_ns`` (one export, one timestamp)."""
    newer = [p for p in received(path, service) if p.time_unix_nano > since_ns]
    if not newer:
        return []
    stamp = max(p.time_unix_nano for p in newer)
    return [p for p in newer if p.time_unix_nano == stamp]


def mapped_for(family: Any) -> Mapped:
    """The table's row of a family parsed from /metrics (info families parse as ``*_info``)."""
    exposed = {m.exposed: m for m in METRICS if m.kind == "info"}
    return BY_PROMETHEUS.get(family.name) or exposed[family.name]


def scrape_families(url: str) -> list[Any]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return list(text_string_to_metric_families(response.read().decode()))


def test_every_metric_arrives_with_the_values_metrics_serves(
    spark: Any, stream_dir: Path, collector: otelcol.Collector
) -> None:
    from pyspark.sql import functions as F

    service = f"wmwatch-test-{uuid.uuid4().hex[:8]}"
    for rows in FILES:
        write_events(stream_dir / "in", [{"id": i, "user": u, "ts": ts(s)} for i, u, s in rows])
    events = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(stream_dir / "in"))
        .withWatermark("ts", "10 seconds")
    )
    watch = wmwatch.attach(
        spark,
        db=str(stream_dir / "h.duckdb"),
        metrics_port=free_port(),
        otlp_endpoint=collector.endpoint("plain", "http"),
        # no export but the ones the test asks for: /metrics and the export see one moment
        otlp_interval_seconds=3600,
        otlp_service_name=service,
        otlp_resource_attributes={"deployment.environment.name": "test"},
        otlp_traces=True,
    )
    query = None
    try:
        query = (
            events.groupBy(F.window("ts", "10 seconds"))
            .count()
            .writeStream.format("memory")
            .queryName("otlp_windows")
            .outputMode("append")
            .trigger(availableNow=True)
            .option("checkpointLocation", str(stream_dir / "checkpoint"))
            .start()
        )
        audit = watch.audit(query, events)
        assert query.awaitTermination(120)
        assert audit.sync(120), audit.status()
        late_rows = audit.status()["late_rows"]
        assert watch.flush(30)
        progress = list(query.recentProgress)
        assert watch.metrics_url is not None
        families = scrape_families(watch.metrics_url)
        before_ns = time.time_ns()
        assert otlp_plugin(watch).export_now()
        points = wait_for(
            lambda: last_export(collector.output("plain"), service, before_ns),
            what="the export in the Collector's file",
        )
        spans = wait_for(
            lambda: [
                s
                for s in otelcol.spans(collector.output("plain"))
                if s.resource.get("service.name") == service
            ],
            what="the batch spans",
        )
    finally:
        if query is not None:
            query.stop()
        watch.close()

    # every sample /metrics served, under its OpenTelemetry name and attributes, same value
    by_key = {
        (p.name, tuple(sorted(p.attributes.items()))): p for p in points if p.kind != "histogram"
    }
    compared: set[str] = set()
    for family in families:
        mapped = mapped_for(family)
        for sample in family.samples:
            attributes = {mapped.attribute(k): v for k, v in sample.labels.items() if k != "le"}
            attributes.update(mapped.constant)
            if family.type == "histogram":
                (hist,) = [
                    p for p in points if p.name == mapped.name and p.attributes == attributes
                ]
                if sample.name.endswith("_count"):
                    assert int(hist.value["count"]) == sample.value
                elif sample.name.endswith("_sum"):
                    assert hist.value.get("sum", 0.0) == pytest.approx(sample.value)
                elif sample.labels["le"] == "+Inf":
                    assert sum(int(c) for c in hist.value["bucketCounts"]) == sample.value
                continue
            point = by_key.get((mapped.name, tuple(sorted(attributes.items()))))
            assert point is not None, f"{sample} did not arrive as {mapped.name} {attributes}"
            assert point.value == pytest.approx(sample.value, rel=1e-12, abs=0), sample
            assert point.unit == mapped.unit
            assert point.kind == ("sum" if family.type == "counter" else "gauge"), sample
            assert point.monotonic == (family.type == "counter")
            compared.add(mapped.name)
    # and nothing /metrics did not serve
    assert {p.name for p in points} == {mapped_for(f).name for f in families if f.samples}
    # the run had something in each part: the query, its operator, the audit, the plan, health
    for name in (
        "spark.streaming.watermark",
        "spark.streaming.watermark.lag",
        "spark.streaming.state.rows.dropped_by_watermark",
        "spark.streaming.audit.late_rows",
        "spark.streaming.operator.watermark",
        "wmwatch.listener.events.processed",
        "wmwatch.store.writes",
        "wmwatch.otlp.exports",
    ):
        assert name in compared, name
    assert len(compared) > 40

    # the values are the query's own
    def point(name: str, **attributes: str) -> float:
        want = {"spark.streaming.query.name": "otlp_windows", **attributes}
        (found,) = [p.value for p in points if p.name == name and p.attributes == want]
        return float(found)

    watermark = progress[-1]["eventTime"]["watermark"]
    assert point("spark.streaming.watermark") == epoch_seconds(watermark)
    assert point("spark.streaming.batches") == len(progress)
    assert point("spark.streaming.input.rows") == sum(len(f) for f in FILES)
    dropped = sum(op["numRowsDroppedByWatermark"] for p in progress for op in p["stateOperators"])
    assert dropped >= 1
    assert (
        point(
            "spark.streaming.state.rows.dropped_by_watermark",
            **{
                "spark.streaming.operator.index": "0",
                "spark.streaming.operator.name": "stateStoreSave",
            },
        )
        == dropped
    )
    assert point("spark.streaming.audit.late_rows") == late_rows == 2

    resource = points[0].resource
    assert resource["service.name"] == service
    assert resource["spark.app.id"] == spark.sparkContext.applicationId
    assert resource["spark.app.name"] == spark.sparkContext.appName
    assert resource["deployment.environment.name"] == "test"
    assert resource["telemetry.sdk.name"] == "opentelemetry"

    # one span per batch, from its trigger time for its triggerExecution, phases as children
    batches = {
        s.attributes["spark.streaming.batch.id"]: s
        for s in spans
        if s.name == "spark.streaming.batch"
    }
    assert sorted(batches) == [p["batchId"] for p in progress]
    for p in progress:
        span = batches[p["batchId"]]
        assert span.parent_span_id == ""
        assert span.start_unix_nano == round(epoch_seconds(p["timestamp"]) * 1000) * 1_000_000
        assert (
            span.end_unix_nano - span.start_unix_nano
            == p["durationMs"]["triggerExecution"] * 1_000_000
        )
        children = {
            s.name: s
            for s in spans
            if s.parent_span_id == span.span_id and s.trace_id == span.trace_id
        }
        phases = {k: v for k, v in p["durationMs"].items() if k != "triggerExecution"}
        assert set(children) == set(phases)
        for phase, ms in phases.items():
            child = children[phase]
            assert child.end_unix_nano - child.start_unix_nano == ms * 1_000_000
            assert child.attributes["spark.streaming.batch.phase"] == phase


@pytest.mark.kafka
def test_kafka_partitions_arrive_with_messaging_attributes(
    spark: Any, kafka: str, stream_dir: Path, collector: otelcol.Collector
) -> None:
    topic = new_topic(kafka, 2)
    produce(kafka, topic, [(0, {"n": i}) for i in range(5)] + [(1, {"n": 9})] * 3)
    service = f"kafka-{uuid.uuid4().hex[:8]}"
    watch = wmwatch.attach(
        spark,
        db=None,
        metrics_port=None,
        otlp_endpoint=collector.endpoint("plain", "grpc"),
        otlp_protocol="grpc",
        otlp_interval_seconds=3600,
        otlp_service_name=service,
    )
    try:
        query = (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", kafka)
            .option("subscribe", topic)
            .option("startingOffsets", "earliest")
            .load()
            .writeStream.format("noop")
            .queryName("otlp_kafka")
            .trigger(availableNow=True)
            .option("checkpointLocation", str(stream_dir / "checkpoint"))
            .start()
        )
        assert query.awaitTermination(120)
        assert watch.flush(30)
        (source,) = query.lastProgress["sources"]
        before_ns = time.time_ns()
        assert otlp_plugin(watch).export_now()
        points = wait_for(
            lambda: last_export(collector.output("plain"), service, before_ns), what="the export"
        )
    finally:
        watch.close()
    # PySpark hands the offsets over as JSON text
    assert json.loads(source["endOffset"]) == {topic: {"0": 5, "1": 3}}
    assert json.loads(source["latestOffset"]) == {topic: {"0": 5, "1": 3}}

    def by_partition(name: str) -> dict[str, float]:
        found = {}
        for p in points:
            if p.name == name:
                assert p.attributes["spark.streaming.query.name"] == "otlp_kafka"
                assert p.attributes["spark.streaming.source.index"] == "0"
                assert p.attributes["messaging.system"] == "kafka"
                assert p.attributes["messaging.destination.name"] == topic
                found[p.attributes["messaging.destination.partition.id"]] = p.value
        return found

    assert by_partition("spark.streaming.source.kafka.offset") == {"0": 5.0, "1": 3.0}
    assert by_partition("spark.streaming.source.kafka.lag") == {"0": 0.0, "1": 0.0}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_tls_with_a_client_certificate_and_a_token(
    spark: Any, collector: otelcol.Collector, protocol: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="wmwatch")
    caplog.set_level(logging.DEBUG, logger="opentelemetry")
    tls = collector.tls
    output = collector.output("secure")

    def export_once(service: str, **options: Any) -> tuple[bool, float | None]:
        registry = CollectorRegistry()
        watch = wmwatch.attach(
            spark,
            db=None,
            metrics_port=None,
            registry=registry,
            otlp_endpoint=collector.endpoint("secure", protocol),
            otlp_protocol=protocol,
            otlp_interval_seconds=3600,
            otlp_timeout_seconds=2,
            otlp_service_name=service,
            **{
                "otlp_cafile": str(tls.ca),
                "otlp_certfile": str(tls.client_cert),
                "otlp_keyfile": str(tls.client_key),
                **options,
            },
        )
        try:
            accepted = otlp_plugin(watch).export_now()
            dropped = registry.get_sample_value(
                "wmwatch_otlp_exports_dropped_total", {"signal": "metrics"}
            )
        finally:
            watch.close()
        return accepted, dropped

    token = {"authorization": f"Bearer {otelcol.TOKEN}"}
    good = f"tls-ok-{protocol}-{uuid.uuid4().hex[:6]}"
    assert export_once(good, otlp_headers=token) == (True, 0.0)
    points = wait_for(lambda: received(output, good), what="the accepted export")
    capacity = {p.value for p in points if p.name == "wmwatch.event_queue.capacity"}
    assert capacity == {10_000}

    refused = {
        "no token": {},
        "a wrong token": {"otlp_headers": {"authorization": "Bearer not-the-token"}},
        # the CA did not sign the Collector's certificate: wmwatch's side refuses the Collector
        "another CA": {"otlp_headers": token, "otlp_cafile": str(tls.client_cert)},
        "no client certificate": {
            "otlp_headers": token,
            "otlp_certfile": None,
            "otlp_keyfile": None,
        },
    }
    services = {}
    for why, options in refused.items():
        service = f"tls-refused-{uuid.uuid4().hex[:6]}"
        services[why] = service
        assert export_once(service, **options) == (False, 1.0), why
    # the accepted export was written; give the refused ones as long, then check none was
    wait_for(lambda: received(output, good), what="the file")
    time.sleep(0.5)
    for why, service in services.items():
        assert received(output, service) == [], why
    assert otelcol.TOKEN not in caplog.text
    assert "not-the-token" not in caplog.text


@pytest.mark.slow
def test_a_collector_gone_or_slow_costs_only_dropped_exports(
    spark: Any,
    stream_dir: Path,
    collector: otelcol.Collector,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from pyspark.sql import functions as F

    caplog.set_level(logging.DEBUG, logger="wmwatch")
    caplog.set_level(logging.DEBUG, logger="opentelemetry")
    t0 = time.monotonic()

    def lap(what: str) -> None:
        print(f"{time.monotonic() - t0:6.1f} s {what}")

    own = otelcol.configure(tmp_path / "otelcol", collector.tls)
    output = own.output("plain")
    service = f"restart-{uuid.uuid4().hex[:8]}"
    registry = CollectorRegistry()
    otelcol.start(own)
    watch = wmwatch.attach(
        spark,
        db=str(stream_dir / "h.duckdb"),
        metrics_port=None,
        registry=registry,
        otlp_endpoint=own.endpoint("plain", "grpc"),
        otlp_protocol="grpc",
        otlp_interval_seconds=0.5,
        otlp_timeout_seconds=1.0,
        otlp_service_name=service,
        otlp_traces=True,
    )
    name = "otlp_restart"
    labels = {"query": name}
    query = None
    second = iter(range(0, 10_000, 7))

    def feed() -> None:
        write_events(stream_dir / "in", [{"id": 1, "user": "u", "ts": ts(next(second))}])

    def batches() -> float:
        return registry.get_sample_value("wmwatch_batches_total", labels) or 0.0

    def dropped() -> float:
        return (
            registry.get_sample_value("wmwatch_otlp_exports_dropped_total", {"signal": "metrics"})
            or 0.0
        )

    def exported_batches() -> float:
        values = [p.value for p in received(output, service) if p.name == "spark.streaming.batches"]
        return max(values, default=0.0)

    def batches_advance(count: int, timeout: float = 60.0) -> None:
        start = batches()
        deadline = time.monotonic() + timeout
        while batches() < start + count:
            assert time.monotonic() < deadline, f"batches stopped at {batches()}"
            feed()
            time.sleep(0.6)

    def worker_keeps_up() -> None:
        started = time.monotonic()
        assert watch.flush(10)
        # the worker never waits on the exporter: what the listener received is handled at once
        assert time.monotonic() - started < 3.0
        received_events = registry.get_sample_value(
            "wmwatch_events_received_total", {"kind": "progress"}
        )
        processed = registry.get_sample_value(
            "wmwatch_events_processed_total", {"kind": "progress"}
        )
        assert received_events == processed
        assert registry.get_sample_value("wmwatch_events_dropped_total", {"kind": "progress"}) == 0

    try:
        query = (
            spark.readStream.schema(SCHEMA)
            .json(str(stream_dir / "in"))
            .withWatermark("ts", "10 seconds")
            .groupBy(F.window("ts", "10 seconds"))
            .count()
            .writeStream.format("noop")
            .queryName(name)
            .outputMode("append")
            .trigger(processingTime="300 milliseconds")
            .option("checkpointLocation", str(stream_dir / "checkpoint"))
            .start()
        )
        feed()
        wait_for(exported_batches, what="a first export")
        lap("first export")

        # gone: exports are dropped and counted, batches go on being recorded
        otelcol.stop(own)
        gone_at = dropped()
        batches_advance(3)
        wait_for(lambda: dropped() >= gone_at + 2, what="drops while the Collector is gone")
        worker_keeps_up()
        lap("gone")

        # back: exports resume with the current values
        otelcol.start(own)
        wait_for(lambda: exported_batches() >= batches(), what="exports after the restart")
        lap("back")

        # slow (paused: connections accepted, never answered): exports time out, nothing waits
        otelcol.pause(own, True)
        slow_at = dropped()
        batches_advance(3)
        wait_for(lambda: dropped() >= slow_at + 1, what="drops while the Collector is paused")
        worker_keeps_up()
        lap("slow")
        otelcol.pause(own, False)
        query.stop()
        assert watch.flush(30)
        final = batches()
        drops = dropped()
        wait_for(lambda: exported_batches() == final, what="the final values after the pause")
        # the drops themselves arrive over OTLP too
        wait_for(
            lambda: any(
                p.name == "wmwatch.otlp.exports.dropped" and p.value >= drops
                for p in received(output, service)
            ),
            what="the drop count over OTLP",
        )
    finally:
        if query is not None:
            query.stop()
        watch.close()
        otelcol.stop(own)
        lap("closed")
    assert final >= 7
    # every batch the query ran is in the history, outage or not
    with duckdb.connect(str(stream_dir / "h.duckdb"), read_only=True) as con:
        (stored,) = con.execute("SELECT count(*) FROM batches").fetchone() or (0,)
    assert stored == final
    # and a span for each (those of dropped exports are counted, not lost silently)
    sent = {
        s.attributes["spark.streaming.batch.id"]
        for s in otelcol.spans(output)
        if s.resource.get("service.name") == service and s.name == "spark.streaming.batch"
    }
    assert len(sent) + otlp_plugin(watch).spans_dropped_total >= final
    # the SDK's exporters said nothing of wmwatch's failed exports; wmwatch said it once an outage
    sdk = [r for r in caplog.records if r.name.startswith("opentelemetry") and r.levelno >= 30]
    assert sdk == [], sdk[:3]
    said = [r.getMessage() for r in caplog.records if r.name == "wmwatch" and r.levelno >= 30]
    assert 2 <= len(said) <= 4, said
    assert all("OTLP" in line and "dropped" in line for line in said), said
