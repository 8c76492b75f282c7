"""Pushgateway mode against real HTTP receivers on loopback: a recording WSGI server (to count
pushes, and to hang like a stuck gateway) and the Debian Pushgateway (to prove it accepts and keeps
what wmwatch pushes). The rate limit runs on a clock the test moves, so no test depends on speed."""

from __future__ import annotations

import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from tests.harness.metrics import progress, samples, watched_registry
from tests.harness.net import free_port
from tests.harness.streams import write_events
from tests.prom_servers import pushgateway, recorder
from wmwatch._errors import ConfigError
from wmwatch._events import parse_started, parse_terminated
from wmwatch._metrics.push import PushPlugin


def wait_for(condition: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


class ManualClock:
    """The plugin's monotonic clock, moved only by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_pushes_are_rate_limited_then_immediate_at_termination_and_close() -> None:
    book, registry = watched_registry()
    clock = ManualClock()
    with recorder() as gateway:
        plugin = PushPlugin(
            registry, gateway.url, job="backfill", min_interval_seconds=0.5, clock=clock
        )
        # registered like the watch does, so each push carries the push counters too
        registry.register(_PluginCollector(plugin))
        started = parse_started({"id": "q1", "runId": "r1", "name": "orders"})
        book.on_started(started)
        plugin.on_query_started(started)
        wait_for(lambda: len(gateway.pushes()) == 1)  # the first event is pushed at once

        # ten batches while the clock stands still: no push until the interval has passed,
        # then one push that carries all ten (spaced out, so that without the limit most
        # batches would be pushed on their own)
        for batch in range(10):
            snapshot = progress(batch)
            book.on_progress(snapshot)
            plugin.on_progress(snapshot)
            time.sleep(0.05)
        clock.now += 0.5
        wait_for(lambda: len(gateway.pushes()) == 2)
        assert (
            samples(gateway.pushes()[1].body)[("wmwatch_batches_total", (("query", "orders"),))]
            == 10
        )

        # more batches, the clock still: a termination is pushed anyway, with everything before it
        for batch in range(10, 20):
            snapshot = progress(batch)
            book.on_progress(snapshot)
            plugin.on_progress(snapshot)
        ended = parse_terminated({"id": "q1", "runId": "r1"})
        book.on_terminated(ended)
        plugin.on_query_terminated(ended)
        wait_for(lambda: len(gateway.pushes()) == 3)
        at_termination = samples(gateway.pushes()[2].body)
        assert at_termination[("wmwatch_batches_total", (("query", "orders"),))] == 20
        assert at_termination[("wmwatch_query_up", (("query", "orders"),))] == 0
        plugin.close()
        pushes = gateway.pushes()

    # started, one per interval, termination, close: never one per batch
    assert len(pushes) == 4
    assert {p.method for p in pushes} == {"PUT"}
    assert {p.path for p in pushes} == {"/metrics/job/backfill"}
    final = samples(pushes[-1].body)
    assert final[("wmwatch_query_up", (("query", "orders"),))] == 0
    assert final[("wmwatch_batches_total", (("query", "orders"),))] == 20
    assert final[("wmwatch_watermark_seconds", (("query", "orders"),))] == pytest.approx(
        1767225619.0
    )
    assert final[("wmwatch_pushes_total", ())] == 3


class _PluginCollector:
    """The watch scrapes plugins through its collector; this does the same for one plugin."""

    def __init__(self, plugin: PushPlugin) -> None:
        self._plugin = plugin

    def collect(self) -> Any:
        return self._plugin.collect()


def test_real_pushgateway_keeps_the_final_values(tmp_path: Path) -> None:
    book, registry = watched_registry()
    with pushgateway(tmp_path) as url:
        plugin = PushPlugin(
            registry,
            url.removeprefix("http://"),
            job="nightly",
            grouping_key={"instance": "driver-1"},
        )
        snapshot = progress(7)
        book.on_progress(snapshot)
        plugin.on_progress(snapshot)
        plugin.close()
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            kept = samples(response.read().decode())
    group = (("instance", "driver-1"), ("job", "nightly"))
    assert kept[("wmwatch_watermark_seconds", (*group, ("query", "orders")))] == (
        pytest.approx(1767225607.0)
    )
    assert kept[("wmwatch_rows_dropped_by_watermark_total", (
        ("instance", "driver-1"), ("job", "nightly"), ("operator", "0"),
        ("operator_name", "stateStoreSave"), ("query", "orders"),
    ))] == 1  # fmt: skip
    assert kept[("push_failure_time_seconds", group)] == 0
    assert kept[("push_time_seconds", group)] > 0
    assert plugin.pushes_total >= 1 and plugin.push_errors_total == 0


def test_an_unreachable_gateway_is_counted() -> None:
    _, registry = watched_registry()
    plugin = PushPlugin(registry, f"127.0.0.1:{free_port()}", job="j", min_interval_seconds=0.1)
    for batch in range(5):
        plugin.on_progress(progress(batch))  # never raises, whatever the gateway does
    wait_for(lambda: plugin.push_errors_total >= 1, timeout=60)
    plugin.close()
    errors = {m.name: m.samples[0].value for m in plugin.collect()}
    assert errors["wmwatch_push_errors"] >= 2  # the batches' and the final push
    assert errors["wmwatch_pushes"] == 0
    assert plugin.last_error is not None


def test_a_hanging_gateway_never_blocks_the_hooks() -> None:
    _, registry = watched_registry()
    with recorder() as gateway:
        gateway.hold()
        plugin = PushPlugin(
            registry, gateway.url, job="j", min_interval_seconds=0.0, timeout_seconds=120
        )
        plugin.on_progress(progress(0))
        wait_for(lambda: len(gateway.arrived()) == 1, timeout=60)  # the push thread is now stuck

        def worker_hooks() -> None:
            for batch in range(1, 10):
                plugin.on_progress(progress(batch))
                plugin.on_query_terminated(parse_terminated({"id": "q1", "runId": "r1"}))

        hooks = threading.Thread(target=worker_hooks)
        hooks.start()
        hooks.join(timeout=60)
        # every hook returned while the gateway still held the first push
        assert not hooks.is_alive()
        assert len(gateway.arrived()) == 1 and gateway.pushes() == []
        gateway.release()
        plugin.close()
        pushes = gateway.pushes()
    # what queued up behind the stuck push is covered by at most one push, then the final one
    assert 2 <= len(pushes) <= 3
    assert plugin.pushes_total == len(pushes)


def test_close_returns_while_the_gateway_still_hangs() -> None:
    _, registry = watched_registry()
    with recorder() as gateway:
        gateway.hold()
        plugin = PushPlugin(
            registry, gateway.url, job="j", min_interval_seconds=0.0, timeout_seconds=0.5
        )
        plugin.on_progress(progress(0))
        wait_for(lambda: len(gateway.arrived()) == 1, timeout=60)
        closer = threading.Thread(target=plugin.close)
        closer.start()
        closer.join(timeout=60)
        # close gave up on the gateway after its own timeout: the gateway never answered
        assert not closer.is_alive()
        assert gateway.pushes() == []
    assert plugin.pushes_total == 0
    assert plugin.push_errors_total == 2  # the stuck push and the final one, both timed out


@pytest.mark.parametrize(
    ("gateway", "job", "message"),
    [("", "j", "needs an address"), ("h:1", "", "non-empty"), ("h:1", "a/b", "without '/'")],
)
def test_misuse_is_a_config_error(gateway: str, job: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PushPlugin(CollectorRegistry(), gateway, job=job)


@pytest.mark.spark
@pytest.mark.prometheus
def test_attach_pushes_an_available_now_backfill(spark: Any, stream_dir: Path) -> None:
    from pyspark.sql.functions import window

    import wmwatch

    write_events(stream_dir / "in", [{"ts": "2026-01-01T00:00:05Z", "k": "a"}])
    write_events(stream_dir / "in", [{"ts": "2026-01-01T00:01:05Z", "k": "b"}])
    with pushgateway(stream_dir) as url:
        watch = wmwatch.attach(
            spark, db=None, metrics_port=None, pushgateway=url, push_job="backfill",
            inspect_plans=False,
        )  # fmt: skip
        query = None
        try:
            events = (
                spark.readStream.schema("ts TIMESTAMP, k STRING")
                .option("maxFilesPerTrigger", 1)
                .json(str(stream_dir / "in"))
            )
            query = (
                events.withWatermark("ts", "10 seconds")
                .groupBy(window("ts", "1 minute"))
                .count()
                .writeStream.format("noop")
                .queryName("backfill_q")
                .option("checkpointLocation", str(stream_dir / "checkpoint"))
                .trigger(availableNow=True)
                .start()
            )
            query.awaitTermination(120)
        finally:
            if query is not None:
                query.stop()
            watch.close()
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            kept = samples(response.read().decode())
    group = (("instance", ""), ("job", "backfill"))
    assert kept[("wmwatch_batches_total", (*group, ("query", "backfill_q")))] >= 2
    assert kept[("wmwatch_input_rows_total", (*group, ("query", "backfill_q")))] == 2
    assert kept[("wmwatch_query_up", (*group, ("query", "backfill_q")))] == 0
