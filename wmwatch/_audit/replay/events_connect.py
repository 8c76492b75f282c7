"""Replaying ``events`` as the user wrote it on Spark Connect: the client's own plan rewritten
over each batch's read, and what cannot be replayed, read off the server's analysed plan text.
How, and what it cannot see: docs/audit-sources.md (``events`` as written).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.replay.refusals import (
    batch_time_reason,
    nondeterministic_reason,
    refused,
    stateful_reason,
)
from wmwatch._errors import AuditError
from wmwatch._plantext import parse_plan_tree

_ANALYZED = "== Analyzed Logical Plan =="
# Spark's non-deterministic functions, as its plan text prints them
_NONDETERMINISTIC = re.compile(
    r"\b(rand|randn|random|randstr|uniform|uuid|shuffle|monotonically_increasing_id|"
    r"spark_partition_id|input_file_name|input_file_block_start|input_file_block_length)\([^)]*\)"
)
# functions whose value is the time a batch ran
_BATCH_TIME = re.compile(r"\b(current_timestamp|now|current_date|current_time|localtimestamp)\(\)")
# steps that keep their input's columns or list the ones they output, so an attached column
# can be carried through them
_CARRYING = (
    "Project",
    "Filter",
    "WithColumns",
    "WithColumnsRenamed",
    "WithWatermark",
    "SubqueryAlias",
    "Hint",
    "Repartition",
    "RepartitionByExpression",
    "Sort",
    "Drop",
)


def _children(node: Any) -> list[tuple[tuple[str, ...], Any]]:
    """A node's children, each once, with every attribute that holds it (a join keeps its left
    side as ``_child`` and as ``left``)."""
    from pyspark.sql.connect.plan import LogicalPlan

    held: dict[int, tuple[tuple[str, ...], Any]] = {}
    for name, value in vars(node).items():
        if isinstance(value, LogicalPlan):
            names, _ = held.get(id(value), ((), value))
            held[id(value)] = ((*names, name), value)
    return list(held.values())


def _leaf_paths(root: Any) -> list[list[tuple[Any, tuple[str, ...]]]]:
    """For every streaming read: the read first (no attribute), then its ancestors, nearest
    first, each with the attributes that hold the child the path goes through."""
    from pyspark.sql.connect.plan import DataSource

    found: list[list[tuple[Any, tuple[str, ...]]]] = []

    def walk(node: Any, ancestors: list[tuple[Any, tuple[str, ...]]]) -> None:
        if isinstance(node, DataSource) and node._is_streaming:
            found.append([(node, ()), *reversed(ancestors)])
            return
        for attributes, child in _children(node):
            walk(child, [*ancestors, (node, attributes)])

    walk(root, [])
    return found


def refusal(analysed_plan_text: str) -> str | None:
    """Why the analysed plan of ``events`` (text) cannot be replayed over a batch, or None."""
    for root in parse_plan_tree(analysed_plan_text):
        for node in root.walk():
            if not node.children:
                continue  # the streaming read itself
            reason = stateful_reason(node.name)
            if reason is not None:
                return reason
            match = _BATCH_TIME.search(node.line)
            if match:
                return batch_time_reason(match.group(0))
            match = _NONDETERMINISTIC.search(node.line)
            if match:
                return nondeterministic_reason(match.group(0))
    return None


@dataclass(frozen=True)
class ConnectEventsAsWritten:
    """``events``' plan over its streaming read, ready to be hung over a batch's read."""

    read: Any = field(compare=False)
    # the read's ancestors, nearest first, each with the attributes holding the path's child
    ancestors: tuple[tuple[Any, tuple[str, ...]], ...] = field(compare=False)
    columns: tuple[str, ...]

    def __call__(self, batch: Any) -> Any:
        return self.replay(batch)

    @property
    def carries(self) -> bool:
        return all(type(node).__name__ in _CARRYING for node, _ in self.ancestors)

    def replay(self, batch: Any) -> Any:
        """``batch`` (a batch DataFrame of the source's raw rows) as ``events`` produces it."""
        from pyspark.sql import functions as F
        from pyspark.sql.connect.dataframe import DataFrame
        from pyspark.sql.connect.plan import Project, WithWatermark

        have = batch.columns
        missing = [c for c in self.columns if c not in have]
        if missing:
            raise AuditError(
                f"the replayed rows have no column {missing[0]!r}, which events reads from its "
                "source; pass prepare= to build events from them."
            )
        carried = [c for c in have if c not in self.columns] if self.carries else []
        selected = batch.select(*self.columns, *carried)
        node = copy.copy(selected._plan)
        # references tied to the streaming read (raw["value"]) resolve against this node
        node._root_plan_id = self.read._root_plan_id
        for parent, attributes in self.ancestors:
            if isinstance(parent, WithWatermark):
                continue
            rebuilt = copy.copy(parent)
            for attribute in attributes:
                setattr(rebuilt, attribute, node)
            if carried and isinstance(rebuilt, Project):
                rebuilt._columns = [*rebuilt._columns, *(F.col(c) for c in carried)]
            node = rebuilt
        return DataFrame(node, batch.sparkSession)


def connect_as_written(events: Any) -> ConnectEventsAsWritten:
    """How to replay a batch of a Connect ``events``' source as ``events`` transforms it;
    raises :class:`AuditError` with the reason when that cannot be done."""
    from pyspark.sql.connect.dataframe import DataFrame

    paths = _leaf_paths(events._plan)
    if len(paths) != 1:
        raise AuditError(
            f"events reads {len(paths)} streaming sources, so its batches cannot be replayed "
            "as written; pass one streaming DataFrame per source (events=[...]), each reading "
            "exactly one."
        )
    path = paths[0]
    for node, _ in path[1:]:
        if len(_children(node)) > 1:
            raise refused(
                f"it combines its stream with another DataFrame ({type(node).__name__}); "
                "pass prepare=, a function that turns the raw source rows into events"
            )
    text = str(events._explain_string(extended=True))
    analysed = text.split(_ANALYZED, 1)[-1].split("\n==", 1)[0]
    reason = refusal(analysed)
    if reason is not None:
        raise refused(reason)
    read = path[0][0]
    columns = tuple(DataFrame(read, events.sparkSession).columns)
    return ConnectEventsAsWritten(read=read, ancestors=tuple(path[1:]), columns=columns)
