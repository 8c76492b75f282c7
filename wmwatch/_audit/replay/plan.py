"""Reading the audit's facts off a streaming query's analysed logical plan: for each streaming
source, the stateful operator (and join side) its rows reach first, and that operator's late-row
rule (:class:`~wmwatch._audit.replay.predicates.OperatorSpec`).

Only the first stateful operator above a source sees its input rows; an operator further down a
chain judges another operator's output against a watermark that output is never behind (see
docs/spark-semantics.md, "Chains"), so the audit replays each source up to its first operator.

Pure logic: plan text in, values out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from wmwatch._audit.replay.predicates import (
    AGGREGATE,
    DEDUPE,
    DEDUPE_WITHIN_WATERMARK,
    JOIN,
    SESSION,
    STATE,
    WINDOW,
    OperatorSpec,
    override_spec,
)
from wmwatch._errors import AuditError
from wmwatch._plantext import PlanNode, parse_plan_tree, streaming_relations
from wmwatch._time import parse_duration_us

_WATERMARK_NODE = re.compile(
    r"EventTimeWatermark [0-9a-f-]+, ([^\n]+?)#\d+: [a-z_]+, ([^\n]+?)\s*$", re.M
)
_WATERMARKED_ATTR = re.compile(r"([^\s,\[\]()]+)#\d+-T\d+ms")
_STATEFUL = re.compile(
    r"^(Aggregate|Deduplicate|DeduplicateWithinWatermark|Join|FlatMapGroupsWithState|"
    r"TransformWithState\w*|FlatMapGroupsInPandasWithState|SessionWindow\w*)$"
)
_JOIN_TYPE = re.compile(r"^~?Join (\w+)")
_EQUALITY = re.compile(r"\(([^\s()#]+)#(\d+)(?:-T\d+ms)? = ([^\s()#]+)#(\d+)(?:-T\d+ms)?\)")
_SLIDE = re.compile(r"% (\d+)\)")
_OFFSET = re.compile(r"- (-?\d+)\) % \d+\)")
_WINDOW_LEN = re.compile(r"\+ (\d+)\), LongType, TimestampType\)")
_SESSION_GAP = re.compile(r"\+ cast\((.+?) as interval\)")


def parse_window_expression(plan_text: str) -> tuple[int, int, int]:
    """(window_us, slide_us, start_us) from the analysed ``window()`` arithmetic in a plan."""
    slides = {int(v) for v in _SLIDE.findall(plan_text)}
    lengths = {int(v) for v in _WINDOW_LEN.findall(plan_text)}
    offsets = {int(v) for v in _OFFSET.findall(plan_text)}
    if len(slides) != 1 or len(lengths) != 1 or len(offsets) > 1:
        raise AuditError(
            "cannot read the window length and slide from the query plan; pass window= and "
            "slide= (and kind='window') to audit()."
        )
    return lengths.pop(), slides.pop(), offsets.pop() if offsets else 0


@dataclass(frozen=True, slots=True)
class PlanInput:
    """One streaming source of a query and what its first stateful operator does to its rows.

    ``spec`` is None when the audit has nothing to replay for this source: ``drops`` False means
    Spark drops none of its rows (``reason`` says why), ``drops`` True that it may but the audit
    cannot tell which (``reason`` is the problem).
    """

    source_index: int
    relation: str
    spec: OperatorSpec | None
    operator: str | None
    drops: bool
    reason: str | None = None
    join_keys: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """What a query's plan says about replaying it, source by source."""

    inputs: tuple[PlanInput, ...]
    stateful_operators: tuple[str, ...]
    watermark_column: str | None
    delay_us: int | None
    problem: str | None = None
    # withWatermark nodes in the plan: with more than one, progress' eventTime describes one
    # of them only, so its minimum says nothing about the other inputs
    watermark_nodes: int = 0

    @property
    def audited(self) -> tuple[PlanInput, ...]:
        """The sources whose rows the audit replays."""
        return tuple(i for i in self.inputs if i.spec is not None)

    @property
    def spec(self) -> OperatorSpec | None:
        """The rule of the first audited source (the only one for a single-source query)."""
        audited = self.audited
        return audited[0].spec if audited else None


def _relation_path(root: PlanNode, relations: list[PlanNode]) -> list[list[tuple[PlanNode, int]]]:
    """For every streaming relation (pre-order): its ancestors, nearest first, each with the
    index of the child the path goes through."""
    paths: list[list[tuple[PlanNode, int]]] = []
    wanted = {id(r) for r in relations}

    def walk(node: PlanNode, ancestors: list[tuple[PlanNode, int]]) -> None:
        if id(node) in wanted:
            paths.append(list(reversed(ancestors)))
            return
        for index, child in enumerate(node.children):
            walk(child, [*ancestors, (node, index)])

    walk(root, [])
    return paths


def _watermark_on(
    path: list[tuple[PlanNode, int]], stop: PlanNode
) -> tuple[str, int | None] | None:
    """The event-time column (and delay) of the nearest watermark between a source and ``stop``."""
    for node, _ in path:
        if node is stop:
            return None
        if node.name == "EventTimeWatermark":
            m = _WATERMARK_NODE.search(node.line)
            if m:
                try:
                    delay: int | None = parse_duration_us(m.group(2))
                except ValueError:
                    delay = None
                return m.group(1), delay
    return None


def _subtree_text(node: PlanNode, limit: int | None = None) -> str:
    nodes = node.walk()
    return "\n".join(n.line for n in (nodes if limit is None else nodes[:limit]))


def _join_keys(line: str, side_text: str) -> tuple[str, ...]:
    """This side's equi-join key columns: the side of each ``a = b`` whose attribute it owns."""
    keys: list[str] = []
    for left, left_id, right, right_id in _EQUALITY.findall(line):
        for name, attr_id in ((left, left_id), (right, right_id)):
            if re.search(rf"\b{re.escape(name)}#{attr_id}\b", side_text) and name not in keys:
                keys.append(name)
                break
    return tuple(keys)


def _input_of(
    source_index: int,
    relation: PlanNode,
    path: list[tuple[PlanNode, int]],
    operators: list[PlanNode],
) -> PlanInput:
    first = next(((n, i) for n, i in path if _STATEFUL.match(n.name)), None)
    if first is None:
        return PlanInput(
            source_index,
            relation.line,
            None,
            None,
            drops=False,
            reason="its rows reach no stateful operator",
        )
    op, child_index = first
    op_index = next(i for i, n in enumerate(operators) if n is op)
    name = op.name
    wm = _watermark_on(path, op)
    below = op.children[child_index] if child_index < len(op.children) else op
    op_wm = _WATERMARKED_ATTR.findall(op.line)
    column, delay_us = wm if wm else (op_wm[0] if op_wm else None, None)

    def nothing(reason: str) -> PlanInput:
        return PlanInput(source_index, relation.line, None, name, drops=False, reason=reason)

    def problem(reason: str) -> PlanInput:
        return PlanInput(source_index, relation.line, None, name, drops=True, reason=reason)

    def spec(
        kind: str,
        col: str,
        *,
        side: str | None = None,
        join_keys: tuple[str, ...] = (),
        window_us: int | None = None,
        slide_us: int | None = None,
        start_us: int = 0,
        gap_us: int | None = None,
    ) -> PlanInput:
        made = OperatorSpec(
            kind,
            col,
            delay_us,
            window_us,
            slide_us,
            start_us,
            gap_us=gap_us,
            operator_index=op_index,
            side=side,
        )
        return PlanInput(source_index, relation.line, made, name, drops=True, join_keys=join_keys)

    if column is None:
        return nothing("no watermark reaches its first stateful operator")
    if name == "Join":
        side = "left" if child_index == 0 else "right"
        if wm is None:
            return nothing(f"the {side} side of the join has no watermark")
        kind = _JOIN_TYPE.match(op.line)
        join_type = kind.group(1) if kind else "Inner"
        if join_type == "LeftAnti":
            return problem("a stream-stream left anti join is not audited")
        return spec(JOIN, column, side=side, join_keys=_join_keys(op.line, _subtree_text(below)))
    if name == "DeduplicateWithinWatermark":
        return spec(DEDUPE_WITHIN_WATERMARK, column)
    if name == "Deduplicate":
        keys = _WATERMARKED_ATTR.findall(op.line)
        if not keys:
            return nothing("dropDuplicates without the event-time column in its keys")
        return spec(DEDUPE, keys[0])
    if name in ("FlatMapGroupsWithState", "FlatMapGroupsInPandasWithState"):
        if "EventTimeTimeout" not in op.line:
            return nothing("the state function has no event-time timeout, so it sees late rows")
        return spec(STATE, column)
    if name.startswith("TransformWithState"):
        if "EventTime" not in op.line:
            return nothing("transformWithState is not in event-time mode, so it sees late rows")
        return spec(STATE, column)
    if name == "Aggregate":
        grouping = op.line.split("], [", 1)[0]
        keys = _WATERMARKED_ATTR.findall(grouping)
        if not keys:
            return nothing("the aggregation does not group by event time")
        near = _subtree_text(below, 3)
        if keys[0].startswith("session_window"):
            gap = _SESSION_GAP.search(near)
            if gap is None:
                return problem("the session window's gap is not a fixed duration")
            try:
                gap_us = parse_duration_us(gap.group(1))
            except ValueError:
                return problem(f"the session window's gap {gap.group(1)!r} is not understood")
            return spec(SESSION, column, gap_us=gap_us)
        if keys[0] == column or "precisetimestampconversion" not in near:
            return spec(AGGREGATE, keys[0])
        try:
            window_us, slide_us, start_us = parse_window_expression(near)
        except AuditError as exc:
            return problem(str(exc))
        return spec(WINDOW, column, window_us=window_us, slide_us=slide_us, start_us=start_us)
    return problem(f"its first stateful operator is {name}, which the audit does not support")


def parse_plan(plan_text: str) -> ReplayPlan:
    """Read every source's first stateful operator and its rule from a streaming query's
    analysed logical plan text."""
    roots = parse_plan_tree(plan_text)
    operators = [n for root in roots for n in root.walk() if _STATEFUL.match(n.name)]
    names = tuple(n.name for n in operators)
    wm = _WATERMARK_NODE.search(plan_text)
    watermark_column = wm.group(1) if wm else None
    delay_us = None
    if wm:
        try:
            delay_us = parse_duration_us(wm.group(2))
        except ValueError:
            delay_us = None
    inputs: list[PlanInput] = []
    relations = streaming_relations(roots)
    for root in roots:
        for path in _relation_path(root, relations):
            relation = path[0][0].children[path[0][1]] if path else root
            inputs.append(_input_of(len(inputs), relation, path, operators))
    problem = None
    if not operators:
        problem = "the query has no stateful operator"
    elif watermark_column is None:
        problem = "the query has no watermark, so it drops no late rows"
    elif not any(i.spec for i in inputs):
        reasons = [i.reason for i in inputs if i.reason]
        problem = "; ".join(dict.fromkeys(reasons)) or "no source reaches a stateful operator"
    return ReplayPlan(
        tuple(inputs),
        names,
        watermark_column,
        delay_us,
        problem,
        watermark_nodes=len(_WATERMARK_NODE.findall(plan_text)),
    )


def apply_overrides(
    plan: ReplayPlan,
    *,
    kind: str | None,
    event_time: str | None,
    delay: str | float | None,
    window: str | float | None,
    slide: str | float | None,
) -> ReplayPlan:
    """The plan with explicit keyword overrides applied to its one audited source.

    Raises AuditError when nothing can be audited, or when overrides are given for a query with
    several audited sources (their rules come from the plan).
    """
    if plan.audited and all(v is None for v in (kind, event_time, delay, window, slide)):
        return plan
    if len(plan.audited) > 1:
        raise AuditError(
            "kind=, event_time=, delay=, window= and slide= apply to a query with one audited "
            "source; this query has several, whose rules come from its plan: drop them."
        )
    # raises the "cannot audit" error when neither the plan nor the overrides give a rule
    spec = override_spec(
        plan.spec,
        plan.watermark_column,
        plan.delay_us,
        kind=kind,
        event_time=event_time,
        delay=delay,
        window=window,
        slide=slide,
        problem=plan.problem,
    )
    target = plan.audited[0] if plan.audited else (plan.inputs[0] if plan.inputs else None)
    if target is None:
        return replace(plan, inputs=(PlanInput(0, "", spec, None, drops=True),))
    inputs = tuple(replace(i, spec=spec, drops=True) if i is target else i for i in plan.inputs)
    return replace(plan, inputs=inputs)
