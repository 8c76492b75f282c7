"""Replaying ``events`` as the user wrote it (classic PySpark): a batch's raw source rows, put
through the transformation ``events``' own plan applies to its streaming source, for every kind
of source; and what cannot be replayed, refused at the start with the reason. How the plan is
rebuilt, and what is refused: docs/audit-sources.md (``events`` as written).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.replay.refusals import (
    batch_time_reason,
    nondeterministic_reason,
    refused,
    stateful_reason,
)
from wmwatch._core.sessions import is_connect
from wmwatch._errors import AuditError
from wmwatch._text import first_line, redact

_CATALYST = "org.apache.spark.sql.catalyst"
# nodes a batch replay leaves out: they only mark the event-time column for the stream
_WATERMARK_NODES = frozenset({"EventTimeWatermark", "UpdateEventTimeWatermarkColumn"})
# expressions whose value is the time a batch ran, which a later replay cannot know
_BATCH_TIME = frozenset(
    {
        "CurrentTimestamp",
        "Now",
        "CurrentDate",
        "CurrentTime",
        "LocalTimestamp",
        "CurrentBatchTimestamp",
    }
)
# expressions examined per plan at most, so that a huge generated plan cannot stall the start
_MAX_EXPRESSIONS = 20_000


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


def _expressions(spark: Any, node: Any) -> Iterator[Any]:
    """Every expression of one plan node, pre-order, bounded by :data:`_MAX_EXPRESSIONS`."""
    pending = list(reversed(_jvm_list(spark, node.expressions())))
    seen = 0
    while pending and seen < _MAX_EXPRESSIONS:
        expression = pending.pop()
        seen += 1
        yield expression
        pending.extend(reversed(_jvm_list(spark, expression.children())))


def _describe(expression: Any) -> str:
    try:
        return first_line(str(expression.sql()), 80) or str(expression.prettyName())
    except Exception:  # noqa: BLE001 - an expression without SQL text still has a name
        return str(expression.prettyName())


def unreplayable_reason(spark: Any, node: Any) -> str | None:
    """Why one node of ``events``' plan (JVM) cannot be replayed over a batch (and what to
    do), or None."""
    reason = stateful_reason(_name(node))
    if reason is not None:
        return reason
    for expression in _expressions(spark, node):
        if str(expression.getClass().getSimpleName()) in _BATCH_TIME:
            return batch_time_reason(_describe(expression))
        if not expression.deterministic() and all(
            child.deterministic() for child in _jvm_list(spark, expression.children())
        ):
            return nondeterministic_reason(_describe(expression))
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
        jvm = spark.sparkContext._jvm
        selected = self._leaf_columns(batch)
        batch_plan = selected._jdf.queryExecution().analyzed()
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
        logical = jvm.org.apache.spark.sql.catalyst.plans.logical
        node = logical.Project(_seq(jvm, [*aliases, *extra]), batch_plan)
        for parent, index in self.ancestors:
            if _name(parent) in _WATERMARK_NODES:
                continue  # the node above takes the replayed rows directly
            children = _children(spark, parent)
            children[index] = node
            node = parent.withNewChildren(_seq(jvm, children))
            if extra:
                node, extra = _carry(jvm, spark, node, extra)
        jdf = jvm.org.apache.spark.sql.classic.Dataset.ofRows(spark._jsparkSession, node)
        return DataFrame(jdf, spark)

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
    description = redact(first_line(str(leaf.toString()), 120) or "its source")
    for node, _ in paths[0][1:]:
        reason = unreplayable_reason(spark, node)
        if reason is not None:
            raise refused(reason)
    return EventsAsWritten(
        leaf_attributes=tuple(_jvm_list(spark, leaf.output())),
        ancestors=tuple(paths[0][1:]),
        description=description,
    )
