"""Replaying ``events`` as the user wrote it (classic PySpark): a batch's raw source rows, put
through the transformation ``events``' own plan applies to its streaming source, for every kind
of source; and what cannot be replayed, refused at the start with the reason. How the plan is
rebuilt, and what is refused: docs/audit-sources.md (``events`` as written).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.replay.refusals import (
    BATCH_TIME_CALL,
    NONDETERMINISTIC_CALL,
    batch_time_reason,
    nondeterministic_reason,
    refused,
    stateful_reason,
)
from wmwatch._core.sessions import is_connect
from wmwatch._errors import AuditError
from wmwatch._text import clean, first_line

_CATALYST = "org.apache.spark.sql.catalyst"
# nodes a batch replay leaves out: they only mark the event-time column for the stream
_WATERMARK_NODES = frozenset({"EventTimeWatermark", "UpdateEventTimeWatermarkColumn"})
# expressions walked one by one at most to name a non-deterministic one (each costs py4j round
# trips); whether there is one is asked of Catalyst for the whole tree, whatever its size
MAX_EXPRESSIONS = 20_000
_TREE_PATTERN = "org.apache.spark.sql.catalyst.trees.TreePattern"
# the metadata key on the event-time column that carries a watermark's delay
_DELAY_KEY = "spark.watermarkDelayMs"


def _jvm_list(spark: Any, seq: Any) -> list[Any]:
    return list(spark.sparkContext._jvm.scala.jdk.javaapi.CollectionConverters.asJava(seq))


def _children(spark: Any, node: Any) -> list[Any]:
    return _jvm_list(spark, node.children())


def _name(node: Any) -> str:
    return str(node.nodeName())


def _is_streaming_leaf(spark: Any, node: Any) -> bool:
    return _name(node).startswith("Streaming") and not _children(spark, node)


def _leaf_paths(spark: Any, root: Any) -> list[list[tuple[Any, int]]]:
    """For every streaming leaf: its ancestors, nearest first, each with the index of the child
    the path goes through; the leaf itself first, with index -1."""
    found: list[list[tuple[Any, int]]] = []

    def walk(node: Any, ancestors: list[tuple[Any, int]]) -> None:
        if _is_streaming_leaf(spark, node):
            found.append([(node, -1), *reversed(ancestors)])
            return
        for index, child in enumerate(_children(spark, node)):
            walk(child, [*ancestors, (node, index)])

    walk(root, [])
    return found


def _innermost_varying(spark: Any, expression: Any, budget: list[int]) -> Any:
    """The innermost non-deterministic expression under a non-deterministic ``expression``
    (itself when its children are deterministic), following the first such child down; where
    the walk runs past ``budget[0]`` children, the one reached so far."""
    current = expression
    while True:
        varying = None
        for child in _jvm_list(spark, current.children()):
            budget[0] -= 1
            if budget[0] < 0:
                return current
            if not child.deterministic():
                varying = child
                break
        if varying is None:
            return current
        current = varying


def _text(expression: Any) -> str:
    """An expression's SQL (never truncated, unlike its string); its string if it has none."""
    try:
        return str(expression.sql())
    except Exception:  # noqa: BLE001 - an expression without SQL text still prints
        return str(expression.toString())


def _describe(expression: Any) -> str:
    try:
        return first_line(str(expression.sql()), 80) or str(expression.prettyName())
    except Exception:  # noqa: BLE001 - an expression without SQL text still has a name
        return str(expression.prettyName())


def unreplayable_reason(spark: Any, node: Any, budget: list[int] | None = None) -> str | None:
    """Why one node of ``events``' plan (JVM) cannot be replayed over a batch (and what to
    do), or None.

    Each of the node's expressions is asked what Catalyst knows of its whole tree, whatever its
    size: whether it is deterministic, and whether any part of it is a ``CURRENT_LIKE`` (the
    batch's time among them, named by the tree's SQL). A plan is never accepted unchecked; the
    walk that names a non-deterministic expression stops after ``budget`` (a one-item list, shared
    by the plan's nodes; :data:`MAX_EXPRESSIONS`) and then names the outermost one."""
    name = _name(node)
    reason = stateful_reason(name)
    if reason is not None:
        return reason
    budget = budget if budget is not None else [MAX_EXPRESSIONS]
    current_like = getattr(spark.sparkContext._jvm, _TREE_PATTERN).CURRENT_LIKE()
    for top in _jvm_list(spark, node.expressions()):
        if top.containsPattern(current_like):
            # current_user() and the like are CURRENT_LIKE too, and the same in a replay
            match = BATCH_TIME_CALL.search(_text(top))
            if match:
                return batch_time_reason(match.group(0))
        if not top.deterministic():
            match = NONDETERMINISTIC_CALL.search(_text(top))
            varying = match.group(0) if match else _describe(_innermost_varying(spark, top, budget))
            return nondeterministic_reason(varying)
    return None


@dataclass(frozen=True)
class EventsAsWritten:
    """``events``' transformation of its source, ready to run over any batch of that source's
    raw rows: call it with the batch DataFrame (a ``prepare`` the audit derived itself)."""

    # the streaming leaf's attributes (JVM), in its output order
    leaf_attributes: tuple[Any, ...] = field(compare=False)
    # the leaf's ancestors, nearest first, each with the index of the child that leads to it
    ancestors: tuple[tuple[Any, int], ...] = field(compare=False)
    description: str = ""

    def __call__(self, batch: Any) -> Any:
        return self.replay(batch)

    def replay(self, batch: Any) -> Any:
        """``batch`` (a batch DataFrame of the source's raw rows) as ``events`` produces it,
        with the columns the audit attached to the raw rows kept after ``events``' own."""
        from pyspark.sql import DataFrame

        spark = batch.sparkSession
        node, _ = self._rebuilt(batch, carry=True)
        jdf = spark.sparkContext._jvm.org.apache.spark.sql.classic.Dataset.ofRows(
            spark._jsparkSession, node
        )
        return DataFrame(jdf, spark)

    def watermark_input(self, batch: Any) -> tuple[Any, str, int] | None:
        """What ``events``' watermark node reads in ``batch`` (the rows whose largest event time
        Spark turns into the watermark, before any step above the node), the node's event-time
        column and its delay in ms; None when ``events`` sets no watermark."""
        from pyspark.sql import DataFrame

        spark = batch.sparkSession
        node, mark = self._rebuilt(batch, stop_at="EventTimeWatermark")
        if mark is None:
            return None
        # the delay as Spark hands it to the watermark's operator: on the event-time column
        delay_ms = next(
            int(a.metadata().getLong(_DELAY_KEY))
            for a in _jvm_list(spark, mark.output())
            if a.metadata().contains(_DELAY_KEY)
        )
        jdf = spark.sparkContext._jvm.org.apache.spark.sql.classic.Dataset.ofRows(
            spark._jsparkSession, node
        )
        return DataFrame(jdf, spark), str(mark.eventTime().name()), delay_ms

    def _rebuilt(
        self, batch: Any, *, carry: bool = False, stop_at: str | None = None
    ) -> tuple[Any, Any | None]:
        """``events``' plan rebuilt over ``batch``: up to its top, or up to the first ancestor
        named ``stop_at`` (then returned beside the plan below it); ``carry`` keeps the columns
        the audit attached to the raw rows in every projection that can take them."""
        spark = batch.sparkSession
        jvm = spark.sparkContext._jvm
        node = self._leaf_plan(batch)
        extra = _jvm_list(spark, node.output())[len(self.leaf_attributes) :] if carry else []
        for parent, index in self.ancestors:
            if _name(parent) == stop_at:
                return node, parent
            if _name(parent) in _WATERMARK_NODES:
                continue  # the node above takes the replayed rows directly
            children = _children(spark, parent)
            children[index] = node
            node = parent.withNewChildren(_seq(jvm, children))
            if extra:
                node, extra = _carry(jvm, spark, node, extra)
        return node, None

    def _leaf_plan(self, batch: Any) -> Any:
        """The batch's plan standing in for the streaming leaf: its columns renamed to the
        leaf's attributes, the attached ones after them."""
        spark = batch.sparkSession
        jvm = spark.sparkContext._jvm
        batch_plan = self._leaf_columns(batch)._jdf.queryExecution().analyzed()
        batch_out = _jvm_list(spark, batch_plan.output())
        aliases = [
            jvm.org.apache.spark.sql.catalyst.expressions.Alias(
                batch_attr,
                str(stream_attr.name()),
                stream_attr.exprId(),
                stream_attr.qualifier(),
                jvm.scala.Option.empty(),
                _seq(jvm, []),
            )
            for batch_attr, stream_attr in zip(batch_out, self.leaf_attributes, strict=False)
        ]
        extra = batch_out[len(self.leaf_attributes) :]
        return jvm.org.apache.spark.sql.catalyst.plans.logical.Project(
            _seq(jvm, [*aliases, *extra]), batch_plan
        )

    def _leaf_columns(self, batch: Any) -> Any:
        """The batch with the leaf's columns first, in its order and types, then the columns
        the audit attached (carried through the replay)."""
        from pyspark.sql import functions as F

        have = set(batch.columns)
        schema = batch._jdf.schema()
        columns = []
        for attr in self.leaf_attributes:
            name = str(attr.name())
            if name not in have:
                raise AuditError(
                    f"the replayed rows of {self.description} have no column {name!r}, which "
                    "events reads from its source; pass prepare= to build events from them."
                )
            wanted = attr.dataType()
            # sameType ignores nullability, which a cast could not always change
            same = schema.apply(name).dataType().sameType(wanted)
            columns.append(F.col(name) if same else F.col(name).cast(str(wanted.catalogString())))
        leaf_names = {str(a.name()) for a in self.leaf_attributes}
        carried = [c for c in batch.columns if c not in leaf_names]
        return batch.select(*columns, *carried)


def _seq(jvm: Any, items: list[Any]) -> Any:
    java_list = jvm.java.util.ArrayList()
    for item in items:
        java_list.add(item)
    return jvm.org.apache.spark.api.python.PythonUtils.toSeq(java_list)


def _carry(jvm: Any, spark: Any, node: Any, extra: list[Any]) -> tuple[Any, list[Any]]:
    """``node`` with the attached columns in its output: a projection gets them appended; a node
    that passes its child's columns through keeps them; any other node ends the carrying (the
    replayed rows then go without them, e.g. without their source file)."""
    output = node.outputSet()
    missing = [a for a in extra if not output.contains(a)]
    if not missing:
        return node, extra
    if _name(node) == "Project":
        listed = _jvm_list(spark, node.projectList())
        project = jvm.org.apache.spark.sql.catalyst.plans.logical.Project
        return project(_seq(jvm, [*listed, *missing]), node.child()), extra
    return node, [a for a in extra if output.contains(a)]


def as_written(spark: Any, events: Any) -> Callable[[Any], Any]:
    """How to replay a batch of ``events``' source as ``events`` transforms it (a function of
    the batch DataFrame); raises :class:`AuditError` with the reason when that transformation
    cannot be replayed. On Spark Connect the client's own plan is rewritten instead
    (:mod:`wmwatch._audit.replay.events_connect`)."""
    if is_connect(events):
        from wmwatch._audit.replay.events_connect import connect_as_written

        return connect_as_written(events)
    root = events._jdf.queryExecution().analyzed()
    paths = _leaf_paths(spark, root)
    if len(paths) != 1:
        raise AuditError(
            f"events reads {len(paths)} streaming sources, so its batches cannot be replayed "
            "as written; pass one streaming DataFrame per source (events=[...]), each reading "
            "exactly one."
        )
    leaf = paths[0][0][0]
    description = clean(first_line(str(leaf.toString()), 120) or "its source")
    budget = [MAX_EXPRESSIONS]
    for node, _ in paths[0][1:]:
        reason = unreplayable_reason(spark, node, budget)
        if reason is not None:
            raise refused(reason)
    return EventsAsWritten(
        leaf_attributes=tuple(_jvm_list(spark, leaf.output())),
        ancestors=tuple(paths[0][1:]),
        description=description,
    )


def as_the_watermark_reads(spark: Any, query: Any) -> tuple[EventsAsWritten, Any] | None:
    """How the watermark node of ``query`` (a classic streaming DataFrame) reads a batch of its
    source: the query's optimized plan from the streaming leaf under the node up to the node,
    filters the optimizer moved below it included, as Spark runs it (``watermark_input`` of the
    result gives those rows), and that leaf (to place it among the query's sources); None unless
    the query has exactly one watermark node, over exactly one stream."""
    marks: list[Any] = []

    def walk(node: Any) -> None:
        if _name(node) == "EventTimeWatermark":
            marks.append(node)
        for child in _children(spark, node):
            walk(child)

    # the session's optimizer over the analysed plan, as a micro-batch runs it
    # (IncrementalExecution); a streaming Dataset's own optimizedPlan refuses to be planned
    analysed = query._jdf.queryExecution().analyzed()
    walk(query.sparkSession._jsparkSession.sessionState().optimizer().execute(analysed))
    paths = _leaf_paths(spark, marks[0]) if len(marks) == 1 else []
    if len(paths) != 1:
        return None
    leaf = paths[0][0][0]
    reads = EventsAsWritten(
        leaf_attributes=tuple(_jvm_list(spark, leaf.output())),
        ancestors=tuple(paths[0][1:]),
        description=clean(first_line(str(leaf.toString()), 120) or "its source"),
    )
    return reads, leaf
