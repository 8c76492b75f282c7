"""The plan plugin's hooks without a plan: behaviour-only join check, cost of a hook, metrics."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import CollectorRegistry

from wmwatch._inspect.plugin import PlanPlugin
from wmwatch._progress import ProgressSnapshot, parse_progress

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class NoQueries:
    """A watch that cannot hand out the query (as when plan access is unavailable)."""

    store = None

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


def test_progress_hook_is_cheap() -> None:
    plugin = PlanPlugin(NoQueries())
    try:
        snapshots = [join_progress(batch, total=6 * (batch + 1), removed=0) for batch in range(200)]
        started = time.perf_counter()
        for snap in snapshots:
            plugin.on_progress(snap)
        per_call_seconds = (time.perf_counter() - started) / len(snapshots)
        # the worker thread's budget is a few milliseconds per event for everything
        assert per_call_seconds < 0.002, per_call_seconds
    finally:
        plugin.close()
