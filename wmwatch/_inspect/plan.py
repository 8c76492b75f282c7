"""Reading a running query's plan: its joins, stateful operators and watermarks, through py4j on
classic PySpark and from ``explain(True)`` text on Spark Connect. All of it is internal Spark
API: callers guard every read, so a failure only costs the feature, never the watch. What is
read, and what each read costs: docs/findings.md (How the plan is read).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from wmwatch._core.spark_jobs import bounded_job
from wmwatch._inspect.joins import (
    NONE,
    SIDES,
    JoinPlan,
    cleanup_kind,
    parse_join_lines,
)
from wmwatch._inspect.watermarks import OperatorWatermark, policy_from_conf
from wmwatch._plantext import parse_plan_tree, physical_plan_section, streaming_relations
from wmwatch._text import clean
from wmwatch._time import from_epoch_ms, interval_seconds

# the physical operators that keep state, and the name progress gives each
_STATEFUL_EXECS = {
    "StateStoreSaveExec": "stateStoreSave",
    "SessionWindowStateStoreSaveExec": "sessionWindowStateStoreSaveExec",
    "StreamingDeduplicateExec": "dedupe",
    "StreamingDeduplicateWithinWatermarkExec": "dedupeWithinWatermark",
    "StreamingSymmetricHashJoinExec": "symmetricHashJoin",
    "FlatMapGroupsWithStateExec": "flatMapGroupsWithState",
    "FlatMapGroupsInPandasWithStateExec": "applyInPandasWithState",
    "TransformWithStateExec": "transformWithStateExec",
    "TransformWithStateInPySparkExec": "transformWithStateInPySparkExec",
    "StreamingGlobalLimitExec": "globalLimit",
    # real-time mode's aggregation (Spark's RealTimeModeAllowlist also lets StateStoreSaveExec,
    # StreamingDeduplicateExec and TransformWithStateExec run there, mapped above)
    "StatefulStreamlineAggregateExec": "StatefulStreamlineAggregate",
}
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_TRACKER_ENTRY = re.compile(rf"({_UUID}) -> (?:Some\((-?\d+)\)|(None)|(-?\d+))")
_WATERMARK_LINE = re.compile(
    rf"EventTimeWatermark ({_UUID}), (?P<col>[^#,]+)#\d+: \w+, (?P<delay>[^,\]]+)"
)
_OP_ID = re.compile(r"opId = (\d+)")
_OP_WATERMARKS = re.compile(
    r"opId = (?P<op>\d+).*?stateStoreCkptIds = \S+?, (?:[A-Za-z]+, )?"
    r"(?P<late>-?\d+|None), (?P<evict>-?\d+|None)"
)
# attributes carrying a watermark print as ``ts#12-T10000ms``
_WATERMARKED_ATTRIBUTE = re.compile(r"-T\d+ms")
_MAX_TEXT_CHARS = 20_000


@dataclass(frozen=True, slots=True)
class WatermarkNode:
    """One ``withWatermark`` in the plan; ``text`` is its logical subtree (to find its sources)."""

    node_id: str
    event_time_column: str | None
    delay_seconds: float | None
    text: str
    # the positions of the sources under it (from plan text, where no description names them)
    source_positions: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PlanFacts:
    """The shape of a query's plan: read once per run (and again when the shape changes)."""

    run_id: str | None
    via: str  # py4j | text
    joins: tuple[JoinPlan, ...]
    operators: tuple[tuple[int, str], ...]  # (operator id, progress operator name)
    watermark_nodes: tuple[WatermarkNode, ...]
    policy: str
    inspected_seconds: float

    @property
    def signature(self) -> tuple[object, ...]:
        return (
            self.operators,
            tuple(
                (j.operator_id, j.join_type, j.left_cleanup, j.right_cleanup) for j in self.joins
            ),
            tuple(n.node_id for n in self.watermark_nodes),
        )


@dataclass(frozen=True, slots=True)
class WatermarkReading:
    """One batch's per-operator and per-node watermarks."""

    batch_id: int | None
    operators: tuple[OperatorWatermark, ...]
    nodes: dict[str, datetime | None]
    global_watermark_at: datetime | None
    read_seconds: float


# -- plan text (Spark Connect, and a cross-check for classic) ------------------------------------


def facts_from_text(
    physical_text: str, logical_text: str | None = None, *, run_id: str | None = None
) -> PlanFacts:
    """Plan facts from plan text (``explain(True)`` output or the plans' ``toString``)."""
    started = time.perf_counter()
    physical = physical_plan_section(physical_text)
    operators: list[tuple[int, str]] = []
    for root in parse_plan_tree(physical):
        for node in root.walk():
            op = _OP_ID.search(node.line)
            # StateStoreRestore shares its operator id with StateStoreSave: one progress entry
            if op and node.name + "Exec" in _STATEFUL_EXECS:
                operators.append((int(op.group(1)), _progress_name(node.name)))
    logical = logical_text if logical_text is not None else _logical_section(physical_text)
    nodes = _watermark_nodes_from_text(logical or physical)
    policy = "min"
    match = re.search(r"multipleWatermarkPolicy -> (\w+)", physical_text)
    if match:
        policy = match.group(1).lower()
    return PlanFacts(
        run_id=run_id,
        via="text",
        joins=tuple(parse_join_lines(physical)),
        operators=tuple(sorted(set(operators))),
        watermark_nodes=nodes,
        policy=policy,
        inspected_seconds=time.perf_counter() - started,
    )


def operator_watermarks_from_text(
    physical_text: str,
) -> list[tuple[int, datetime | None, datetime | None]]:
    """(operator id, late-row watermark, eviction watermark) of each stateful operator line."""
    found = []
    for root in parse_plan_tree(physical_plan_section(physical_text)):
        for node in root.walk():
            match = _OP_WATERMARKS.search(node.line)
            if match:
                late_at = from_epoch_ms(match.group("late"))
                eviction_at = from_epoch_ms(match.group("evict"))
                found.append((int(match.group("op")), late_at, eviction_at))
    return sorted(found, key=lambda item: item[0])


def _logical_section(text: str) -> str | None:
    for marker in ("== Analyzed Logical Plan ==", "== Parsed Logical Plan =="):
        if marker in text:
            return text.split(marker, 1)[1].split("==", 1)[0]
    return None


def _watermark_nodes_from_text(text: str) -> tuple[WatermarkNode, ...]:
    nodes: dict[str, WatermarkNode] = {}
    roots = parse_plan_tree(text)
    relations = streaming_relations(roots)
    for root in roots:
        for node in root.walk():
            match = _WATERMARK_LINE.search(node.line)
            if not match or match.group(1) in nodes:
                continue
            below = node.walk()
            subtree = "\n".join(n.line for n in below)[:_MAX_TEXT_CHARS]
            nodes[match.group(1)] = WatermarkNode(
                match.group(1),
                match.group("col").strip(),
                interval_seconds(match.group("delay")),
                subtree,
                tuple(i for i, r in enumerate(relations) if any(r is n for n in below)),
            )
    return tuple(nodes.values())


def _progress_name(exec_name: str) -> str:
    name = exec_name if exec_name.endswith("Exec") else exec_name + "Exec"
    return _STATEFUL_EXECS.get(name, exec_name)


# -- classic: py4j -------------------------------------------------------------------------------


def _option(value: Any) -> Any:
    return value.get() if value is not None and value.isDefined() else None


def _children(node: Any) -> Iterator[Any]:
    iterator = node.children().iterator()
    while iterator.hasNext():
        yield iterator.next()


def _field(obj: Any, name: str) -> Any:
    declared = obj.getClass().getDeclaredField(name)
    declared.setAccessible(True)
    return declared.get(obj)


def facts_from_jvm(stream_execution: Any, *, run_id: str | None = None) -> PlanFacts | None:
    """Plan facts from the running query's last ``IncrementalExecution``; None before it exists."""
    started = time.perf_counter()
    execution = stream_execution.lastExecution()
    if execution is None:
        return None
    plan = execution.executedPlan()
    joins: list[JoinPlan] = []
    operators: list[tuple[int, str]] = []
    ids: list[str] = []
    stack = [plan]
    while stack:
        node = stack.pop()
        name = node.getClass().getSimpleName()
        if name in _STATEFUL_EXECS:
            info = _option(node.stateInfo())
            op_id = int(info.operatorId()) if info is not None else len(operators)
            operators.append((op_id, _STATEFUL_EXECS[name]))
            if name == "StreamingSymmetricHashJoinExec":
                joins.append(_join_from_jvm(node, op_id))
        elif name == "EventTimeWatermarkExec":
            ids.append(str(node.nodeId().toString()))
        # depth-first, left before right, as Spark's own collect() visits the tree
        stack.extend(reversed(list(_children(node))))
    logical_text = str(stream_execution.logicalPlan().toString())
    by_text = {n.node_id: n for n in _watermark_nodes_from_text(logical_text)}
    nodes = tuple(by_text.get(i) or WatermarkNode(i, None, None, "") for i in ids)
    return PlanFacts(
        run_id=run_id,
        via="py4j",
        joins=tuple(sorted(joins, key=lambda j: j.operator_id)),
        operators=tuple(sorted(set(operators))),
        watermark_nodes=nodes,
        policy=_policy_from_jvm(stream_execution, execution),
        inspected_seconds=time.perf_counter() - started,
    )


def _join_from_jvm(node: Any, op_id: int) -> JoinPlan:
    predicates = node.stateWatermarkPredicates()
    sides: dict[str, tuple[str, str | None]] = {}
    for side in SIDES:
        predicate = _option(getattr(predicates, side)())
        if predicate is None:
            sides[side] = (NONE, None)
        else:
            kind = cleanup_kind(str(predicate.getClass().getSimpleName()))
            sides[side] = (kind, str(predicate.toString()))
    left_output = str(node.left().output().toString())
    right_output = str(node.right().output().toString())
    return JoinPlan(
        operator_id=op_id,
        join_type=str(node.joinType().toString()),
        left_cleanup=sides["left"][0],
        right_cleanup=sides["right"][0],
        left_has_watermark=_WATERMARKED_ATTRIBUTE.search(left_output) is not None,
        right_has_watermark=_WATERMARKED_ATTRIBUTE.search(right_output) is not None,
        left_predicate=sides["left"][1],
        right_predicate=sides["right"][1],
        condition=clean(str(node.condition().toString()), 2000),
        state_location=_state_location(node),
    )


def _state_location(node: Any) -> str | None:
    try:
        info = _option(node.stateInfo())
        return str(info.checkpointLocation()) if info is not None else None
    except Exception:  # noqa: BLE001 - internal API: no location is a fact, not an error
        return None


def _policy_from_jvm(stream_execution: Any, execution: Any) -> str:
    try:
        conf = execution.offsetSeqMetadata().conf()
        value = _option(conf.get("spark.sql.streaming.multipleWatermarkPolicy"))
        if value is not None:
            return policy_from_conf({"spark.sql.streaming.multipleWatermarkPolicy": str(value)})
    except Exception:  # noqa: BLE001 - internal API: fall back to the tracker below
        pass
    try:
        text = str(_field(stream_execution.watermarkTracker(), "policy").toString())
        return "max" if "Max" in text else "min"
    except Exception:  # noqa: BLE001 - internal API: Spark's default policy
        return "min"


def read_watermarks_jvm(stream_execution: Any, facts: PlanFacts) -> WatermarkReading | None:
    """This batch's per-operator and per-node watermarks: about ten py4j calls."""
    started = time.perf_counter()
    execution = stream_execution.lastExecution()
    if execution is None:
        return None
    batch_id = int(execution.currentBatchId())
    operators = []
    if facts.operators:
        propagator = execution.watermarkPropagator()
        for op_id, op_name in facts.operators:
            try:
                late_ms = propagator.getInputWatermarkForLateEvents(batch_id, op_id)
                eviction_ms = propagator.getInputWatermarkForEviction(batch_id, op_id)
                late_at, eviction_at = from_epoch_ms(late_ms), from_epoch_ms(eviction_ms)
            except Exception:  # noqa: BLE001 - internal API: watermarks unknown for this batch
                late_at = eviction_at = None
            operators.append(OperatorWatermark(op_id, op_name, late_at, eviction_at))
    nodes: dict[str, datetime | None] = {}
    global_at = None
    if facts.watermark_nodes:
        tracker = stream_execution.watermarkTracker()
        text = str(_field(tracker, "operatorToWatermarkMap").toString())
        for node_id, some, _none, plain in _TRACKER_ENTRY.findall(text):
            nodes[node_id] = from_epoch_ms(some or plain or None)
        global_at = from_epoch_ms(_field(tracker, "globalWatermarkMs"))
    elapsed = time.perf_counter() - started
    return WatermarkReading(batch_id, tuple(operators), nodes, global_at, elapsed)


def count_join_side_rows(
    spark: Any, state_location: str, operator_id: int, *, timeout_seconds: float = 120.0
) -> dict[str, int]:
    """Rows each side of a join keeps, from the last committed state (one small Spark job per side).

    Progress only reports a join operator's total; the ``statestore`` reader splits it by side.
    A count is an aggregate (bounded memory whatever the state's size); a huge state store
    could still take long, so the jobs are cancelled after ``timeout_seconds``.
    """
    root = state_location.removesuffix("/state")
    counts = {}
    with bounded_job(
        spark,
        description=f"wmwatch join state count, operator {operator_id}",
        timeout_seconds=timeout_seconds,
        pool="wmwatch_audit",
    ):
        for side in SIDES:
            frame = (
                spark.read.format("statestore")
                .option("path", root)
                .option("operatorId", operator_id)
                .option("joinSide", side)
                .load()
            )
            counts[side] = int(frame.count())
    return counts
