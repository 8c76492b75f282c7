"""Per-source holding-back and the stalled / jump monitor: pure logic over parsed progress."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from wmwatch._inspect.watermarks import (
    NodeWatermarks,
    SourceWatermark,
    WatermarkMonitor,
    holding_back,
    policy_from_conf,
)
from wmwatch._progress import ProgressSnapshot, parse_progress

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def iso(value: datetime) -> str:
    return value.strftime("%Y-%m-%dT%H:%M:%S.000Z")


def progress(
    batch: int,
    watermark: datetime | None,
    *,
    rows: int = 3,
    max_at: datetime | None = None,
    dropped: int = 0,
) -> ProgressSnapshot:
    doc: dict[str, Any] = {
        "id": "q1",
        "runId": "r1",
        "name": "events",
        "batchId": batch,
        "timestamp": iso(datetime(2026, 11, 1, tzinfo=UTC) + timedelta(seconds=batch)),
        "numInputRows": rows,
        "eventTime": {},
        "stateOperators": [{"operatorName": "dedupe", "numRowsDroppedByWatermark": dropped}],
    }
    if watermark is not None:
        doc["eventTime"]["watermark"] = iso(watermark)
    if rows and max_at is not None:
        doc["eventTime"]["max"] = iso(max_at)
    return parse_progress(doc)


def source(name: str, minute: int | None, idle: int = 0) -> SourceWatermark:
    at = T0 + timedelta(minutes=minute) if minute is not None else None
    return SourceWatermark(name, name, (0,), "ts", 10.0, at, idle_batches=idle)


def test_holding_back_under_min_and_max() -> None:
    marked = holding_back([source("a", 5), source("b", 1, idle=7), source("c", None)], "min")
    assert [s.holding_back for s in marked] == [False, True, False]
    assert marked[1].event_time_max_at == T0 + timedelta(minutes=1, seconds=10)
    assert not any(s.holding_back for s in holding_back([source("a", 5), source("b", 1)], "max"))
    assert not any(s.holding_back for s in holding_back([source("a", 5), source("b", 5)], "min"))
    assert not any(s.holding_back for s in holding_back([source("a", 5)], "min"))


def test_policy_from_conf() -> None:
    assert policy_from_conf(None) == "min"
    assert policy_from_conf({"spark.sql.streaming.multipleWatermarkPolicy": "MAX"}) == "max"


def test_stalled_after_n_batches_with_input_then_resolved() -> None:
    monitor = WatermarkMonitor(stall_batches=3)
    held = holding_back([source("left", 9), source("right", 1, idle=4)], "min")
    wm = T0 + timedelta(minutes=1)
    verdicts = []
    for batch in range(4):
        verdicts += monitor.observe(
            progress(batch, wm, max_at=T0 + timedelta(minutes=batch + 5)), holding=held
        )
    (stalled,) = verdicts
    assert stalled.kind == "watermark_stalled" and stalled.action == "open"
    assert stalled.evidence["holding_back"] == ["right"]
    assert stalled.evidence["batches"] == 3 and stalled.evidence["input_rows"] == 9
    assert "idle for 4 batches" in stalled.message
    # no-data batches neither count nor break the stall
    assert monitor.observe(progress(4, wm, rows=0)) == []
    (resolved,) = monitor.observe(progress(5, wm + timedelta(minutes=1)))
    assert resolved.action == "resolve"


def test_steady_advance_is_no_jump_and_the_first_watermark_is_no_jump() -> None:
    monitor = WatermarkMonitor()
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    verdicts = monitor.observe(progress(0, epoch))
    for batch in range(1, 6):
        verdicts += monitor.observe(progress(batch, T0 + timedelta(minutes=batch)))
    assert verdicts == []


def test_jump_flagged_and_later_drops_attributed_until_event_times_catch_up() -> None:
    monitor = WatermarkMonitor(jump_min_seconds=3600)
    for batch in range(4):
        monitor.observe(
            progress(batch, T0 + timedelta(minutes=batch), max_at=T0 + timedelta(minutes=batch))
        )
    future = T0 + timedelta(days=2)
    assert monitor.observe(progress(4, T0 + timedelta(minutes=4), max_at=future)) == []
    (jump,) = monitor.observe(progress(5, future - timedelta(seconds=10), rows=0))
    assert jump.kind == "watermark_jump" and jump.action == "open" and jump.severity == "critical"
    assert jump.evidence["caused_by_event_time_max_at"] == future.isoformat()
    assert jump.evidence["caused_by_batch_id"] == 4
    (update,) = monitor.observe(
        progress(6, future - timedelta(seconds=10), max_at=T0 + timedelta(minutes=5), dropped=3)
    )
    assert update.evidence["dropped_after_jump"] == 3
    (update,) = monitor.observe(
        progress(7, future - timedelta(seconds=10), max_at=T0 + timedelta(minutes=6), dropped=2)
    )
    assert update.evidence["dropped_after_jump"] == 5
    assert update.evidence["batches_with_drops"] == [6, 7]
    (done,) = monitor.observe(progress(8, future, max_at=future + timedelta(seconds=5)))
    assert done.action == "resolve" and done.evidence["dropped_after_jump"] == 5


def _two_nodes(policy: str = "min") -> NodeWatermarks:
    # node "a" reads source 0 and comes first in the plan; node "b" reads source 1
    return NodeWatermarks(
        order=("a", "b"),
        delays_ms={"a": 10_000, "b": 10_000},
        sources={"a": (0,), "b": (1,)},
        policy=policy,
    )


def test_node_watermarks_follow_the_node_progress_describes() -> None:
    nodes = _two_nodes()
    nodes.observe(0, 60_000, {0: 0, 1: 3})  # only b read rows: eventTime is b's
    assert nodes.watermarks() == {"a": None, "b": datetime.fromtimestamp(50, UTC)}
    nodes.observe(0, 100_000, {0: 2, 1: 0})
    assert nodes.watermarks()["a"] == datetime.fromtimestamp(90, UTC)
    # a lower max never lowers a node's watermark
    nodes.observe(50_000, 70_000, {0: 1, 1: 0})
    assert nodes.watermarks()["a"] == datetime.fromtimestamp(90, UTC)


def test_node_watermarks_of_an_unreported_node_come_from_the_global_one() -> None:
    nodes = _two_nodes()
    nodes.observe(0, 60_000, {0: 2, 1: 2})  # both read rows: only a's max is reported
    assert nodes.watermarks() == {"a": datetime.fromtimestamp(50, UTC), "b": None}
    # the global watermark moved to 40 s, below a's 50 s: under min it is b's own
    nodes.observe(40_000, 120_000, {0: 1, 1: 0})
    assert nodes.watermarks() == {
        "a": datetime.fromtimestamp(110, UTC),
        "b": datetime.fromtimestamp(40, UTC),
    }


def test_node_watermarks_stay_unknown_when_the_global_one_does_not_pin_them() -> None:
    nodes = _two_nodes()
    nodes.observe(0, 60_000, {0: 2, 1: 2})
    # the global watermark equals a's: b is at least that, not known
    nodes.observe(50_000, 60_000, {0: 0, 1: 0})
    assert nodes.watermarks()["b"] is None
    # max policy: a global watermark above every known node is the unknown node's
    high = _two_nodes("max")
    high.observe(0, 60_000, {0: 2, 1: 2})
    high.observe(80_000, None, {})
    assert high.watermarks()["b"] == datetime.fromtimestamp(80, UTC)


def test_node_watermarks_ignore_a_global_value_that_never_moved_in_the_run() -> None:
    # after a restart the global watermark comes back from the checkpoint, above the nodes'
    nodes = _two_nodes()
    nodes.observe(500_000, 60_000, {0: 2, 1: 2})
    nodes.observe(500_000, None, {})
    assert nodes.watermarks()["b"] is None
