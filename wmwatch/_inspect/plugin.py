"""Plan inspection: what the executed plan says about joins and watermarks, and the plugin using it.

Classic PySpark: through py4j on the query's ``StreamExecution`` — the executed plan's
``StreamingSymmetricHashJoinExec`` (``stateWatermarkPredicates``), the stateful operators'
per-operator watermarks (from the ``watermarkPropagator`` of the last ``IncrementalExecution``),
each ``EventTimeWatermarkExec`` (node id, column, delay) and the query's ``WatermarkTracker``
(each watermark node's own value and the multiple-watermark policy). Spark Connect: the same
facts parsed from ``explain(True)`` text, the only thing the client gets. All of this is
internal Spark API, so every read is guarded and a failure only costs the feature, never the
watch.

Cost: the structural inspection (a walk of the plan tree, one py4j call per node and a few per
join) runs once per query run, and again only when a cheap periodic check finds the plan's shape
changed. Each batch gets a light read (the tracker's map and two watermarks per stateful
operator, about ten py4j calls). Both run on this plugin's own inspector thread, never on the
watch's worker thread; their cost is kept in :attr:`PlanPlugin.costs`.

:class:`PlanPlugin` puts it together with the pure logic in ``_joins``, ``_watermarks`` and
``_findings``: join findings, watermark findings, history rows and metrics.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric

from wmwatch._core.plugins import WatchPlugin
from wmwatch._core.spark_jobs import bounded_job
from wmwatch._events import QueryIdle, QueryStarted, QueryTerminated
from wmwatch._inspect.findings import (
    JOIN_STATE_UNBOUNDED,
    WATERMARK_JUMP,
    FindingsBook,
    finding_id,
)
from wmwatch._inspect.joins import (
    NONE,
    SIDES,
    Growth,
    JoinCheck,
    JoinPlan,
    StateSample,
    analyze_growth,
    classify_join,
    cleanup_kind,
    parse_join_lines,
    parse_plan_tree,
    physical_plan_section,
)
from wmwatch._inspect.watermarks import (
    OperatorWatermark,
    SourceWatermark,
    WatermarkMonitor,
    holding_back,
    policy_from_conf,
)
from wmwatch._progress import ProgressSnapshot
from wmwatch._text import redact

log = logging.getLogger("wmwatch.plan")

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
}
_UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
_TRACKER_ENTRY = re.compile(rf"({_UUID}) -> (?:Some\((-?\d+)\)|(None)|(-?\d+))")
_WATERMARK_LINE = re.compile(rf"EventTimeWatermark ({_UUID}), (?P<col>[^#,]+)#\d+: \w+, (?P<delay>[^,\]]+)")
_OP_WATERMARKS = re.compile(
    r"opId = (?P<op>\d+).*?stateStoreCkptIds = \S+?, (?:[A-Za-z]+, )?(?P<late>-?\d+|None), (?P<evict>-?\d+|None)"
)
_INTERVAL_UNITS = {
    "microsecond": 1e-6, "millisecond": 1e-3, "second": 1.0, "minute": 60.0, "hour": 3600.0,
    "day": 86400.0, "week": 604800.0,
}  # fmt: skip
_MAX_TEXT_CHARS = 20_000


@dataclass(frozen=True, slots=True)
class WatermarkNode:
    """One ``withWatermark`` in the plan; ``text`` is its logical subtree (to find its sources)."""

    node_id: str
    event_time_column: str | None
    delay_seconds: float | None
    text: str


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
            tuple((j.operator_id, j.join_type, j.left_cleanup, j.right_cleanup) for j in self.joins),
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


# -- pure text parsing (Spark Connect, and a cross-check for classic) ----------------------------


def interval_seconds(text: str | None) -> float | None:
    """``10 seconds`` / ``1 minutes 30 seconds`` / ``interval 2 hours`` -> seconds."""
    if not text:
        return None
    total, found = 0.0, False
    for amount, unit in re.findall(r"(-?\d+(?:\.\d+)?)\s*([a-z]+)", text.lower()):
        unit = unit.rstrip("s")
        if unit in _INTERVAL_UNITS:
            total += float(amount) * _INTERVAL_UNITS[unit]
            found = True
    return total if found else None


def facts_from_text(
    physical_text: str, logical_text: str | None = None, *, run_id: str | None = None
) -> PlanFacts:
    """Plan facts from plan text (``explain(True)`` output or the plans' ``toString``)."""
    started = time.perf_counter()
    physical = physical_plan_section(physical_text)
    operators: list[tuple[int, str]] = []
    for root in parse_plan_tree(physical):
        for node in root.walk():
            op = re.search(r"opId = (\d+)", node.line)
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


def operator_watermarks_from_text(physical_text: str) -> list[tuple[int, datetime | None, datetime | None]]:
    """(operator id, late-row watermark, eviction watermark) of each stateful operator line."""
    found = []
    for root in parse_plan_tree(physical_plan_section(physical_text)):
        for node in root.walk():
            match = _OP_WATERMARKS.search(node.line)
            if match:
                found.append((int(match.group("op")), _ms(match.group("late")), _ms(match.group("evict"))))
    return sorted(found, key=lambda item: item[0])


def _logical_section(text: str) -> str | None:
    for marker in ("== Analyzed Logical Plan ==", "== Parsed Logical Plan =="):
        if marker in text:
            return text.split(marker, 1)[1].split("==", 1)[0]
    return None


def _watermark_nodes_from_text(text: str) -> tuple[WatermarkNode, ...]:
    nodes: dict[str, WatermarkNode] = {}
    for root in parse_plan_tree(text):
        for node in root.walk():
            match = _WATERMARK_LINE.search(node.line)
            if not match or match.group(1) in nodes:
                continue
            subtree = "\n".join(n.line for n in node.walk())[:_MAX_TEXT_CHARS]
            nodes[match.group(1)] = WatermarkNode(
                match.group(1), match.group("col").strip(), interval_seconds(match.group("delay")), subtree
            )
    return tuple(nodes.values())


def _progress_name(exec_name: str) -> str:
    name = exec_name if exec_name.endswith("Exec") else exec_name + "Exec"
    return _STATEFUL_EXECS.get(name, exec_name)


def _ms(value: Any) -> datetime | None:
    if value is None or value == "None":
        return None
    try:
        ms = int(value)
    except (TypeError, ValueError):
        return None
    if ms <= 0:
        return None
    return datetime.fromtimestamp(ms / 1000.0, tz=UTC)


# -- classic: py4j ---------------------------------------------------------------------------


def _option(value: Any) -> Any:
    return value.get() if value is not None and value.isDefined() else None


def _children(node: Any) -> Iterator[Any]:
    iterator = node.children().iterator()
    while iterator.hasNext():
        yield iterator.next()


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
            sides[side] = (cleanup_kind(str(predicate.getClass().getSimpleName())), str(predicate.toString()))
    # attributes carrying a watermark print as ``ts#12-T10000ms``
    left_output = str(node.left().output().toString())
    right_output = str(node.right().output().toString())
    return JoinPlan(
        operator_id=op_id,
        join_type=str(node.joinType().toString()),
        left_cleanup=sides["left"][0],
        right_cleanup=sides["right"][0],
        left_has_watermark=re.search(r"-T\d+ms", left_output) is not None,
        right_has_watermark=re.search(r"-T\d+ms", right_output) is not None,
        left_predicate=sides["left"][1],
        right_predicate=sides["right"][1],
        condition=redact(str(node.condition().toString()))[:2000],
        state_location=_state_location(node),
    )


def _state_location(node: Any) -> str | None:
    try:
        info = _option(node.stateInfo())
        return str(info.checkpointLocation()) if info is not None else None
    except Exception:
        return None


def count_join_side_rows(
    spark: Any, state_location: str, operator_id: int, *, timeout_seconds: float = 120.0
) -> dict[str, int]:
    """Rows each side of a join keeps, from the last committed state (one small Spark job per side).

    Progress only reports a join operator's total; the ``statestore`` reader splits it by side.
    A count is an aggregate (bounded memory whatever the state's size); a huge state store
    could still take long, so the jobs are cancelled after ``timeout_seconds``.
    """
    root = state_location[: -len("/state")] if state_location.endswith("/state") else state_location
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


def _policy_from_jvm(stream_execution: Any, execution: Any) -> str:
    try:
        conf = execution.offsetSeqMetadata().conf()
        value = _option(conf.get("spark.sql.streaming.multipleWatermarkPolicy"))
        if value is not None:
            return policy_from_conf({"spark.sql.streaming.multipleWatermarkPolicy": str(value)})
    except Exception:
        pass
    try:
        text = str(_field(stream_execution.watermarkTracker(), "policy").toString())
        return "max" if "Max" in text else "min"
    except Exception:
        return "min"


def _field(obj: Any, name: str) -> Any:
    declared = obj.getClass().getDeclaredField(name)
    declared.setAccessible(True)
    return declared.get(obj)


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
                late = _ms(propagator.getInputWatermarkForLateEvents(batch_id, op_id))
                eviction = _ms(propagator.getInputWatermarkForEviction(batch_id, op_id))
            except Exception:
                late = eviction = None
            operators.append(OperatorWatermark(op_id, op_name, late, eviction))
    nodes: dict[str, datetime | None] = {}
    global_at = None
    if facts.watermark_nodes:
        tracker = stream_execution.watermarkTracker()
        text = str(_field(tracker, "operatorToWatermarkMap").toString())
        for node_id, some, _none, plain in _TRACKER_ENTRY.findall(text):
            nodes[node_id] = _ms(some or plain or None) if (some or plain) else None
        global_at = _ms(_field(tracker, "globalWatermarkMs"))
    return WatermarkReading(batch_id, tuple(operators), nodes, global_at, time.perf_counter() - started)


# -- Spark Connect ---------------------------------------------------------------------------


def explain_text(query: Any) -> str | None:
    """``explain(True)`` text of a Spark Connect query without printing it."""
    try:
        import pyspark.sql.connect.proto as pb2

        cmd = pb2.StreamingQueryCommand()
        cmd.explain.extended = True
        return str(query._execute_streaming_query_cmd(cmd).explain.result)
    except Exception:
        return None


# -- the plugin ------------------------------------------------------------------------------


@dataclass
class _Query:
    query_id: str
    name: str | None
    run_id: str | None = None
    facts: PlanFacts | None = None
    checks: dict[int, JoinCheck] = field(default_factory=dict)
    samples: dict[int, deque[StateSample]] = field(default_factory=dict)
    growth: dict[int, Growth] = field(default_factory=dict)
    monitor: WatermarkMonitor = field(default_factory=WatermarkMonitor)
    reading: WatermarkReading | None = None
    sources: list[SourceWatermark] = field(default_factory=list)
    idle: dict[int, int] = field(default_factory=dict)  # progress source index -> idle batches
    descriptions: dict[int, str] = field(default_factory=dict)
    last: ProgressSnapshot | None = None
    batches_since_inspection: int = 0
    inspect_failures: int = 0
    side_rows: dict[int, deque[tuple[datetime, dict[str, int]]]] = field(default_factory=dict)
    side_counted_batch: dict[int, int] = field(default_factory=dict)
    side_count_failed: bool = False

    def side_rate(self, op_id: int, side: str) -> float | None:
        """Rows per second one side gained between the first and last per-side counts."""
        counts = self.side_rows.get(op_id)
        if not counts or len(counts) < 2:
            return None
        (t0, first), (t1, last) = counts[0], counts[-1]
        seconds = (t1 - t0).total_seconds()
        return (last[side] - first[side]) / seconds if seconds > 0 else None

    @property
    def label(self) -> str:
        from wmwatch._progress import query_label

        return query_label(self.name, self.query_id)


class PlanPlugin(WatchPlugin):
    """Join-state and watermark checks for every watched query.

    ``PlanPlugin(watch, state_budget_bytes=None)``: ``watch`` gives ``get_query``, ``store``
    (optional) and is otherwise not touched. ``state_budget_bytes``: the state size a join may
    reach (memory or disk) for ``wmwatch_state_budget_seconds_remaining``.
    ``reinspect_every_batches``: how often the light read also re-checks the plan's shape.
    """

    name = "plan"

    def __init__(
        self,
        watch: Any,
        *,
        state_budget_bytes: int | None = None,
        growth_window_batches: int = 20,
        min_growth_batches: int = 3,
        behaviour_batches: int = 5,
        reinspect_every_batches: int = 50,
        stall_batches: int = 5,
        jump_min_seconds: float = 3600.0,
        findings_update_interval_seconds: float = 30.0,
        side_count_every_batches: int | None = 20,
        min_read_interval_seconds: float = 1.0,
    ) -> None:
        self._watch = watch
        # py4j reads compete with the watched query for the driver: at most one per query per
        # interval (the newest progress wins), however many batches a second it runs
        self.min_read_interval_seconds = min_read_interval_seconds
        self._last_read: dict[str, float] = {}
        self.state_budget_bytes = state_budget_bytes
        self.growth_window_batches = growth_window_batches
        self.min_growth_batches = min_growth_batches
        self.behaviour_batches = behaviour_batches
        self.side_count_every_batches = side_count_every_batches
        self.reinspect_every_batches = reinspect_every_batches
        self.stall_batches = stall_batches
        self.jump_min_seconds = jump_min_seconds
        store = getattr(watch, "store", None)
        self._store = store
        self.findings = FindingsBook(
            writer=(lambda fn, description: store.submit(fn, description=description))
            if store is not None
            else None,
            update_interval_seconds=findings_update_interval_seconds,
        )
        self.costs: dict[str, deque[float]] = {
            "inspect_seconds": deque(maxlen=200),
            "read_seconds": deque(maxlen=200),
            "side_count_seconds": deque(maxlen=200),
        }
        self._lock = threading.RLock()
        self._queries: dict[str, _Query] = {}
        self._requests: dict[str, ProgressSnapshot] = {}
        self._connect_facts: dict[str, PlanFacts] = {}
        self._previous_watermark: dict[str, datetime | None] = {}
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._inspect_loop, name="wmwatch-plan", daemon=True)
        self._thread.start()

    # -- hooks (worker thread: pure Python, no py4j) ---------------------------------------

    def on_query_started(self, event: QueryStarted) -> None:
        with self._lock:
            q = self._queries.setdefault(event.query_id, _Query(event.query_id, event.name))
            q.name = event.name or q.name
            if q.run_id != event.run_id:
                self._new_run(q, event.run_id)

    def on_progress(self, snapshot: ProgressSnapshot) -> None:
        with self._lock:
            q = self._queries.setdefault(snapshot.query_id, _Query(snapshot.query_id, snapshot.name))
            q.name = snapshot.name or q.name
            if q.run_id != snapshot.run_id:
                self._new_run(q, snapshot.run_id)
            q.last = snapshot
            for source in snapshot.sources:
                q.descriptions[source.index] = source.description
                q.idle[source.index] = 0 if source.input_rows else q.idle.get(source.index, 0) + 1
            at = snapshot.timestamp_at or datetime.now(UTC)
            for op in snapshot.operators:
                if op.name != "symmetricHashJoin":
                    continue
                window = q.samples.setdefault(op.operator_id, deque(maxlen=self.growth_window_batches))
                window.append(
                    StateSample(
                        snapshot.batch_id, at, snapshot.watermark_at, op.rows_total or 0,
                        op.rows_removed or 0, op.memory_used_bytes or 0, snapshot.input_rows or 0,
                    )
                )  # fmt: skip
                q.growth[op.operator_id] = analyze_growth(window, min_batches=self.min_growth_batches)
            self._refresh_sources(q)
            self._evaluate_joins(q, snapshot.batch_id, at)
            for verdict in q.monitor.observe(snapshot, holding=q.sources):
                self._apply_verdict(q, verdict, snapshot.batch_id, at)
        with self._cond:
            self._requests[snapshot.query_id] = snapshot
            self._cond.notify_all()

    def on_query_idle(self, event: QueryIdle) -> None:
        return None

    def on_query_terminated(self, event: QueryTerminated) -> None:
        with self._cond:
            self._requests.pop(event.query_id, None)

    def _new_run(self, q: _Query, run_id: str) -> None:
        q.run_id = run_id
        q.facts = None
        q.checks = {}
        q.reading = None
        q.samples.clear()
        q.growth.clear()
        q.monitor = WatermarkMonitor(stall_batches=self.stall_batches, jump_min_seconds=self.jump_min_seconds)
        q.idle.clear()
        q.batches_since_inspection = 0
        q.inspect_failures = 0
        q.side_rows.clear()
        q.side_counted_batch.clear()
        q.side_count_failed = False

    # -- inspector thread (py4j) -----------------------------------------------------------

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until every queued inspection is done (tests and ``flush``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._requests or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.05))
        return True

    def _inspect_loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    waits = {
                        qid: self._last_read.get(qid, -math.inf) + self.min_read_interval_seconds - now
                        for qid in self._requests
                    }
                    ready = [qid for qid, wait in waits.items() if wait <= 0]
                    if ready:
                        break
                    # nothing queued: sleep until a progress (or close) notifies, no polling
                    self._cond.wait(min(waits.values(), default=None))
                query_id = ready[0]
                snapshot = self._requests.pop(query_id)
                self._last_read[query_id] = now
                self._busy = True
            try:
                self._inspect(snapshot)
            except Exception:
                log.debug("wmwatch: plan inspection failed for %s", query_id, exc_info=True)
                with self._lock:
                    q = self._queries.get(query_id)
                    if q is not None:
                        q.inspect_failures += 1
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _inspect(self, snapshot: ProgressSnapshot) -> None:
        with self._lock:
            q = self._queries.get(snapshot.query_id)
            if q is None or q.run_id != snapshot.run_id or q.inspect_failures >= 5:
                return
            facts = q.facts
            due = facts is None or q.batches_since_inspection >= self.reinspect_every_batches
            q.batches_since_inspection += 1
        query = self._watch.get_query(snapshot.query_id)
        if query is None:
            return
        jsq = getattr(query, "_jsq", None)
        reading: WatermarkReading | None
        if jsq is not None:
            execution = jsq.streamingQuery()
            if due:
                fresh = facts_from_jvm(execution, run_id=snapshot.run_id)
                if fresh is not None:
                    self.costs["inspect_seconds"].append(fresh.inspected_seconds)
                    facts = fresh
            if facts is None:
                return
            reading = read_watermarks_jvm(execution, facts)
        else:
            reading = self._read_connect(query, snapshot, due, facts)
            if reading is None:
                return
            facts = self._connect_facts.get(snapshot.query_id, facts)
            if facts is None:
                return
        if reading is not None:
            self.costs["read_seconds"].append(reading.read_seconds)
        at = snapshot.timestamp_at or datetime.now(UTC)
        with self._lock:
            if q.run_id != snapshot.run_id:
                return
            changed = q.facts is None or q.facts.signature != facts.signature
            if changed:
                q.facts = facts
                q.checks = {j.operator_id: classify_join(j) for j in facts.joins}
            if changed or due:
                q.batches_since_inspection = 0
            q.reading = reading or q.reading
            self._refresh_sources(q)
            if changed:
                self._evaluate_joins(q, snapshot.batch_id, at)
            sources = list(q.sources)
            label = q.label
        if reading is not None and self._store is not None:
            self._record(snapshot.query_id, label, reading, sources, facts.policy)
        self._count_sides(q, snapshot, at)

    def _count_sides(self, q: _Query, snapshot: ProgressSnapshot, at: datetime) -> None:
        """Per-side state rows of joins that keep state forever, every few batches."""
        every = self.side_count_every_batches
        spark = getattr(self._watch, "spark", None)
        if every is None or spark is None or q.side_count_failed:
            return
        with self._lock:
            due = [
                (op_id, check.plan.state_location)
                for op_id, check in q.checks.items()
                if not check.bounded
                and check.plan.state_location
                and snapshot.batch_id - q.side_counted_batch.get(op_id, -every) >= every
            ]
        for op_id, location in due:
            started = time.perf_counter()
            try:
                counts = count_join_side_rows(spark, str(location), op_id)
            except Exception:
                log.debug("wmwatch: per-side join state count failed", exc_info=True)
                with self._lock:
                    q.side_count_failed = True
                return
            self.costs["side_count_seconds"].append(time.perf_counter() - started)
            with self._lock:
                q.side_rows.setdefault(op_id, deque(maxlen=50)).append((at, counts))
                q.side_counted_batch[op_id] = snapshot.batch_id

    def _read_connect(
        self, query: Any, snapshot: ProgressSnapshot, due: bool, facts: PlanFacts | None
    ) -> WatermarkReading | None:
        """Spark Connect: explain text once per run (and every few batches); in between, the
        operators' watermarks follow from progress (late rows: the previous batch's watermark,
        eviction: this batch's), which is what the explain text shows on Spark 4.3."""
        previous = self._previous_watermark.get(snapshot.query_id)
        self._previous_watermark[snapshot.query_id] = snapshot.watermark_at
        if due or facts is None:
            started = time.perf_counter()
            text = explain_text(query)
            if text is None:
                return None
            fresh = facts_from_text(text, run_id=snapshot.run_id)
            self.costs["inspect_seconds"].append(time.perf_counter() - started)
            self._connect_facts[snapshot.query_id] = fresh
            operators = tuple(
                OperatorWatermark(op, dict(fresh.operators).get(op, "unknown"), late, evict)
                for op, late, evict in operator_watermarks_from_text(text)
            )
            return WatermarkReading(snapshot.batch_id, operators, {}, snapshot.watermark_at, 0.0)
        wm = snapshot.watermark_at if snapshot.has_watermark else None
        late = previous if previous is not None and previous.timestamp() > 0 else None
        operators = tuple(OperatorWatermark(op, name, late, wm) for op, name in facts.operators)
        return WatermarkReading(snapshot.batch_id, operators, {}, snapshot.watermark_at, 0.0)

    # -- evaluation (under the lock) -------------------------------------------------------

    def _refresh_sources(self, q: _Query) -> None:
        facts, reading = q.facts, q.reading
        if facts is None or not facts.watermark_nodes:
            q.sources = []
            return
        sources = []
        for node in facts.watermark_nodes:
            indexes = tuple(
                i for i, description in sorted(q.descriptions.items()) if description and description in node.text
            )
            label = ",".join(q.descriptions[i] for i in indexes) if indexes else (
                f"{node.event_time_column or 'watermark'}@{node.node_id[:8]}"
            )
            idle = min((q.idle.get(i, 0) for i in indexes), default=0)
            sources.append(
                SourceWatermark(
                    node_id=node.node_id,
                    source=redact(label)[:300],
                    source_indexes=indexes,
                    event_time_column=node.event_time_column,
                    delay_seconds=node.delay_seconds,
                    watermark_at=reading.nodes.get(node.node_id) if reading is not None else None,
                    idle_batches=idle,
                )
            )
        q.sources = holding_back(sources, facts.policy)

    def _evaluate_joins(self, q: _Query, batch_id: int, at: datetime) -> None:
        self._evaluate_behaviour(q, batch_id, at)
        for op_id, check in q.checks.items():
            growth = q.growth.get(op_id)
            for side in SIDES:
                fid = finding_id(q.query_id, JOIN_STATE_UNBOUNDED, op_id, side)
                if side not in check.unbounded_sides:
                    self.findings.resolve(fid, at=at, batch_id=batch_id, reason="the plan now cleans this side")
                    continue
                evidence: dict[str, Any] = {
                    "case": check.case,
                    "join_type": check.plan.join_type,
                    "state_cleanup": {s: check.plan.cleanup(s) for s in SIDES},
                    "predicates": {"left": check.plan.left_predicate, "right": check.plan.right_predicate},
                    "watermark": {s: check.plan.has_watermark(s) for s in SIDES},
                    "condition": check.plan.condition,
                    "via": q.facts.via if q.facts else None,
                }
                if growth is not None:
                    evidence["growth"] = growth.evidence()
                    evidence["side_rows_per_second"] = growth.rows_per_second / len(check.unbounded_sides)
                    evidence["side_rate_source"] = "operator total split over uncleaned sides"
                    remaining = growth.seconds_to_budget(self.state_budget_bytes)
                    if remaining is not None:
                        evidence["state_budget_bytes"] = self.state_budget_bytes
                        evidence["seconds_to_budget"] = round(remaining, 1)
                counted = q.side_rows.get(op_id)
                if counted:
                    evidence["side_state_rows"] = counted[-1][1][side]
                    measured = q.side_rate(op_id, side)
                    if measured is not None:
                        evidence["side_rows_per_second"] = measured
                        evidence["side_rate_source"] = "statestore reader, per side"
                severity = "warning"
                if growth is not None and growth.growing:
                    remaining = growth.seconds_to_budget(self.state_budget_bytes)
                    if remaining is not None and remaining < 86400:
                        severity = "critical"
                self.findings.observe(
                    query_id=q.query_id,
                    query_name=q.name,
                    kind=JOIN_STATE_UNBOUNDED,
                    operator_id=op_id,
                    side=side,
                    severity=severity,
                    message=check.message,
                    evidence=evidence,
                    fix=check.fixes.get(side),
                    at=at,
                    batch_id=batch_id,
                )

    def _evaluate_behaviour(self, q: _Query, batch_id: int, at: datetime) -> None:
        """Joins the plan has not judged (no plan access): judge them by their numbers alone.

        Stricter than with a plan, since a bounded join also grows until its first eviction:
        ``behaviour_batches`` data batches in which state never shrank, the watermark moved (or
        there is none) and not one row was removed.
        """
        for op_id, growth in q.growth.items():
            fid = finding_id(q.query_id, JOIN_STATE_UNBOUNDED, op_id, None)
            if op_id in q.checks:
                self.findings.resolve(fid, at=at, batch_id=batch_id, reason="the plan now judges this join")
                continue
            if not (growth.growing and growth.rows_removed == 0 and growth.batches >= self.behaviour_batches):
                continue
            evidence: dict[str, Any] = {"case": "unknown_plan", "via": "progress", "growth": growth.evidence()}
            remaining = growth.seconds_to_budget(self.state_budget_bytes)
            if remaining is not None:
                evidence["state_budget_bytes"] = self.state_budget_bytes
                evidence["seconds_to_budget"] = round(remaining, 1)
            self.findings.observe(
                query_id=q.query_id,
                query_name=q.name,
                kind=JOIN_STATE_UNBOUNDED,
                operator_id=op_id,
                side=None,
                message=(
                    f"join operator {op_id}: state grew in each of the last {growth.batches} batches "
                    f"to {growth.rows_total} rows while the watermark advanced and nothing was removed"
                ),
                evidence=evidence,
                fix=(
                    "give both inputs withWatermark and the join a time-range condition such as "
                    "r.ts BETWEEN l.ts - INTERVAL 10 MINUTES AND l.ts + INTERVAL 10 MINUTES"
                ),
                at=at,
                batch_id=batch_id,
            )

    def _apply_verdict(self, q: _Query, verdict: Any, batch_id: int, at: datetime) -> None:
        if verdict.action == "resolve":
            fid = finding_id(q.query_id, verdict.kind, None, None)
            if verdict.kind == WATERMARK_JUMP:
                # keep the final attribution in the row before closing it
                self.findings.observe(
                    query_id=q.query_id, query_name=q.name, kind=verdict.kind, severity=verdict.severity,
                    message=verdict.message, evidence=verdict.evidence, fix=verdict.fix, at=at,
                    batch_id=batch_id,
                )  # fmt: skip
            self.findings.resolve(fid, at=at, batch_id=batch_id, reason=verdict.message)
            return
        evidence = dict(verdict.evidence)
        if verdict.kind == WATERMARK_JUMP:
            movers = _jumped_sources(q)
            if movers:
                evidence["moved_by_source"] = movers
        self.findings.observe(
            query_id=q.query_id,
            query_name=q.name,
            kind=verdict.kind,
            severity=verdict.severity,
            message=verdict.message,
            evidence=evidence,
            fix=verdict.fix,
            at=at,
            batch_id=batch_id,
        )

    # -- history ---------------------------------------------------------------------------

    def _record(
        self,
        query_id: str,
        label: str,
        reading: WatermarkReading,
        sources: list[SourceWatermark],
        policy: str,
    ) -> None:
        if reading.batch_id is None:
            return
        batch_id = reading.batch_id
        now = datetime.now(UTC)
        op_rows = [
            (query_id, batch_id, o.operator_id, o.operator_name, o.late_at, o.eviction_at, now)
            for o in reading.operators
        ]
        src_rows = [
            (
                query_id, batch_id, s.node_id, s.source, s.event_time_column, s.delay_seconds,
                s.watermark_at, s.event_time_max_at, s.idle_batches, s.holding_back, policy, now,
            )
            for s in sources
        ]

        def write(con: Any) -> None:
            if op_rows:
                con.executemany("INSERT OR REPLACE INTO operator_watermarks VALUES (?, ?, ?, ?, ?, ?, ?)", op_rows)
            if src_rows:
                con.executemany(
                    "INSERT OR REPLACE INTO source_watermarks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    src_rows,
                )

        store = self._store
        if store is not None:
            store.submit(write, description=f"watermarks {label} batch {batch_id}")

    # -- metrics ---------------------------------------------------------------------------

    def collect(self) -> Iterable[Metric]:
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
        with self._lock:
            queries = list(self._queries.values())
            for q in queries:
                label = q.label
                for op_id, check in q.checks.items():
                    growth = q.growth.get(op_id)
                    sides_growing = check.unbounded_sides or SIDES
                    for side in SIDES:
                        unbounded.add_metric([label, str(op_id), side], 1.0 if side in check.unbounded_sides else 0.0)
                        share = 1.0 / len(sides_growing) if side in sides_growing else 0.0
                        measured = q.side_rate(op_id, side)
                        rows_rate.add_metric(
                            [label, str(op_id), side],
                            measured if measured is not None else (growth.rows_per_second if growth else 0.0) * share,
                        )
                        bytes_rate.add_metric(
                            [label, str(op_id), side], (growth.bytes_per_second if growth else 0.0) * share
                        )
                    if growth is not None and growth.growing:
                        remaining = growth.seconds_to_budget(self.state_budget_bytes)
                        if remaining is not None:
                            budget.add_metric([label, str(op_id)], remaining)
                for op_id, growth in q.growth.items():
                    if op_id not in q.checks:  # no plan: the operator's total, side unknown
                        rows_rate.add_metric([label, str(op_id), "unknown"], growth.rows_per_second)
                        bytes_rate.add_metric([label, str(op_id), "unknown"], growth.bytes_per_second)
                if q.reading is not None:
                    for o in q.reading.operators:
                        if o.late_at is not None:
                            op_wm.add_metric([label, str(o.operator_id), "late"], o.late_at.timestamp())
                        if o.eviction_at is not None:
                            op_wm.add_metric([label, str(o.operator_id), "eviction"], o.eviction_at.timestamp())
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
        labels = {q.query_id: q.label for q in queries}
        for finding in self.findings.all():
            key = (labels.get(finding.query_id, finding.query_name or finding.query_id), finding.kind)
            counts[key] = counts.get(key, 0) + (1 if finding.active else 0)
        for (label, kind), count in sorted(counts.items()):
            active.add_metric([label, kind], float(count))
        for kind, values in self.costs.items():
            if values:
                cost.add_metric([kind.removesuffix("_seconds")], sum(values) / len(values))
        return [unbounded, rows_rate, bytes_rate, budget, op_wm, src_wm, src_max, holding, idle, policy, active, cost]

    # -- report helpers --------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """Rendering-ready state of every query: findings, per-operator and per-source watermarks."""
        out: dict[str, Any] = {}
        with self._lock:
            for q in self._queries.values():
                out[q.label] = {
                    "query_id": q.query_id,
                    "policy": q.facts.policy if q.facts else None,
                    "joins": [
                        {"operator_id": op, "case": c.case, "unbounded_sides": list(c.unbounded_sides)}
                        for op, c in sorted(q.checks.items())
                    ],
                    "operators": [
                        {
                            "operator_id": o.operator_id,
                            "operator_name": o.operator_name,
                            "late_watermark_at": o.late_at.isoformat() if o.late_at else None,
                            "eviction_watermark_at": o.eviction_at.isoformat() if o.eviction_at else None,
                        }
                        for o in (q.reading.operators if q.reading else ())
                    ],
                    "sources": [
                        {
                            "source": s.source,
                            "watermark_at": s.watermark_at.isoformat() if s.watermark_at else None,
                            "event_time_max_at": s.event_time_max_at.isoformat() if s.event_time_max_at else None,
                            "idle_batches": s.idle_batches,
                            "holding_back": s.holding_back,
                        }
                        for s in q.sources
                    ],
                    "findings": [f.as_row() for f in self.findings.all(query_id=q.query_id)],
                }
        return out

    def close(self) -> None:
        self.wait_idle(timeout=5.0)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=5.0)
        self.findings.flush()


def _jumped_sources(q: _Query) -> list[str]:
    """The input(s) whose own watermark is the highest: the ones a future-dated row moved."""
    known = [s for s in q.sources if s.watermark_at is not None]
    if not known:
        return []
    top = max(s.watermark_at for s in known if s.watermark_at is not None)
    return [s.source for s in known if s.watermark_at == top]

