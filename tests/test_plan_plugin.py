"""The plan plugin's hooks without a plan: behaviour-only join check, hooks that never wait,
metrics."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry

from wmwatch._core.plugins import WatchPlugin
from wmwatch._events import QueryTerminated
from wmwatch._inspect.plugin import PlanPlugin
from wmwatch._progress import ProgressSnapshot, parse_progress

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class NoSession:
    """A watch context without a session or a history."""

    spark = None
    store = None

    def plugins(self) -> list[WatchPlugin]:
        return []

    def add_plugin(self, plugin: WatchPlugin) -> None:
        pass


class NoQueries(NoSession):
    """A watch that cannot hand out the query (as when plan access is unavailable)."""

    def get_query(self, query_id: str) -> Any:
        return None


def iso(value: datetime) -> str:
    return value.strftime("%Y-%m-%dT%H:%M:%S.000Z")


def join_progress(batch: int, *, total: int, removed: int, rows: int = 6) -> ProgressSnapshot:
    return parse_progress(
        {
            "id": "q1",
            "runId": "r1",
            "name": "orders_payments",
            "batchId": batch,
            "timestamp": iso(T0 + timedelta(seconds=batch)),
            "numInputRows": rows,
            "eventTime": {"watermark": iso(T0 + timedelta(minutes=batch))},
            "stateOperators": [
                {
                    "operatorName": "symmetricHashJoin",
                    "numRowsTotal": total,
                    "numRowsRemoved": removed,
                    "memoryUsedBytes": total * 200,
                }
            ],
        }
    )


def test_growth_without_a_plan_is_flagged_after_enough_batches() -> None:
    plugin = PlanPlugin(NoQueries(), state_budget_bytes=1_000_000)
    registry = CollectorRegistry()
    registry.register(plugin)
    try:
        for batch in range(4):
            plugin.on_progress(join_progress(batch, total=6 * (batch + 1), removed=0))
        assert plugin.findings.all() == []  # four batches: not yet, a bounded join grows at first
        plugin.on_progress(join_progress(4, total=30, removed=0))
        (finding,) = plugin.findings.all()
        assert finding.kind == "join_state_unbounded" and finding.side is None
        assert finding.evidence["via"] == "progress"
        assert finding.evidence["seconds_to_budget"] > 0
        value = registry.get_sample_value(
            "wmwatch_findings_active", {"query": "orders_payments", "kind": "join_state_unbounded"}
        )
        assert value == 1.0
        rate = registry.get_sample_value(
            "wmwatch_state_growth_rows_per_second",
            {"query": "orders_payments", "operator": "0", "side": "unknown"},
        )
        assert rate == 6.0  # six rows a batch, a batch a second
    finally:
        plugin.close()


def test_bounded_numbers_without_a_plan_are_not_flagged() -> None:
    plugin = PlanPlugin(NoQueries())
    try:
        for batch in range(30):
            plugin.on_progress(join_progress(batch, total=12, removed=6))
        assert plugin.findings.all() == []
    finally:
        plugin.close()


class StuckQueries(NoSession):
    """A watch whose ``get_query`` (the first step of every plan read) hangs until released."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.callers: list[str] = []

    def get_query(self, query_id: str) -> Any:
        self.callers.append(threading.current_thread().name)
        self.entered.set()
        self.release.wait(timeout=120)
        return None


def test_progress_hook_never_waits_for_a_plan_read() -> None:
    """Plan reads go through py4j and can stall: the worker's hook must return regardless, and
    the reads for a busy query coalesce (the newest progress wins) instead of queuing up."""
    watch = StuckQueries()
    plugin = PlanPlugin(watch, min_read_interval_seconds=0.0)
    try:
        plugin.on_progress(join_progress(0, total=6, removed=0))
        assert watch.entered.wait(timeout=60)  # the inspector thread is now stuck in a read

        def worker_hooks() -> None:
            for batch in range(1, 200):
                plugin.on_progress(join_progress(batch, total=6 * (batch + 1), removed=0))

        hooks = threading.Thread(target=worker_hooks)
        hooks.start()
        hooks.join(timeout=60)
        assert not hooks.is_alive()  # 199 hooks returned while the read was still stuck
        assert watch.callers == ["wmwatch-plan"]
        # the hooks kept judging from progress alone meanwhile
        assert [f.kind for f in plugin.findings.all()] == ["join_state_unbounded"]
        watch.release.set()
        assert plugin.wait_idle(timeout=60)
        # one read for the stuck request, one for the newest of the 199 behind it
        assert watch.callers == ["wmwatch-plan", "wmwatch-plan"]
    finally:
        watch.release.set()
        plugin.close()


class StopsLater(NoSession):
    """A watch whose one query runs until ``running`` is cleared (Spark then lists it no more);
    each plan read of its handle is counted (and fails: there is no JVM behind it)."""

    def __init__(self) -> None:
        self.running = True
        self.reads = 0

    def get_query(self, query_id: str) -> Any:
        return _CountedQuery(self) if self.running else None


class _CountedQuery:
    def __init__(self, watch: StopsLater) -> None:
        self._watch = watch

    @property
    def _jsq(self) -> Any:
        self._watch.reads += 1
        raise RuntimeError("no JVM behind this query")


def test_a_stopped_runs_last_progress_is_read_at_once() -> None:
    """Reads are spaced out per query, but a run that stops has its waiting progress read at
    once (its final watermarks), through the run's own handle since Spark lists it no more;
    then nothing of it is kept for reads."""
    watch = StopsLater()
    plugin = PlanPlugin(watch, min_read_interval_seconds=3600.0)
    try:
        plugin.on_progress(join_progress(0, total=6, removed=0))
        deadline = time.monotonic() + 60
        while watch.reads < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert watch.reads == 1  # the first progress is read at once
        plugin.on_progress(join_progress(1, total=12, removed=0))
        time.sleep(0.3)
        assert watch.reads == 1  # the next waits for the interval
        assert plugin.remembered()["handles"] == 1
        watch.running = False
        plugin.on_query_terminated(QueryTerminated("q1", "r1", None, None, None))
        assert plugin.wait_idle(timeout=60)
        assert watch.reads == 2  # read at once, with the stopped run's handle
        assert plugin.remembered()["reads"] == 0
        assert plugin.remembered()["handles"] == 0
    finally:
        plugin.close()
