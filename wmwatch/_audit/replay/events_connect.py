"""Replaying ``events`` as the user wrote it on Spark Connect: the client's own plan rewritten
over each batch's read, and what cannot be replayed, read off the server's analysed plan text.
How, and what it cannot see: docs/audit-sources.md (``events`` as written).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.replay.refusals import (
    BATCH_TIME_CALL,
    NONDETERMINISTIC_CALL,
    batch_time_reason,
    nondeterministic_reason,
    refused,
    stateful_reason,
    too_large_reason,
)
from wmwatch._errors import AuditError
from wmwatch._plantext import parse_plan_tree

_ANALYZED = "== Analyzed Logical Plan =="
# a Python UDF's call in plan text ends in its result id: name(arguments)#12
_UDF_RESULT = re.compile(r"\)#\d")
_UDF_NAME = re.compile(r"([^\s(),\[\]]+)\($")
# objects of the client's plan walked for inline UDFs, at most
MAX_OBJECTS = 100_000
# the client's own plan and expression objects (a UDF's function is not walked)
_CONNECT_MODULES = ("pyspark.sql.connect.column", "pyspark.sql.connect.expressions")
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


def python_udf_calls(line: str) -> list[str]:
    """The names of the Python UDFs a line of plan text calls: Spark prints one as
    ``name(arguments)#resultId``, the only call followed by ``#``."""
    names = []
    for match in _UDF_RESULT.finditer(line):
        depth, at = 0, match.start()
        while at >= 0:
            depth += {")": 1, "(": -1}.get(line[at], 0)
            if depth == 0:
                break
            at -= 1
        name = _UDF_NAME.search(line, 0, at + 1) if at > 0 else None
        if name is not None:
            names.append(name.group(1))
    return names


def client_udfs(nodes: Iterable[Any]) -> dict[str, bool]:
    """The Python UDFs the client's plan nodes hold inline, by name: whether each is marked
    deterministic (False when any of that name is not). The walk over the nodes' expressions is
    bounded; past the bound :func:`refused` (an unread UDF is never taken as deterministic)."""
    from pyspark.sql.connect.expressions import CommonInlineUserDefinedFunction
    from pyspark.sql.connect.plan import LogicalPlan

    found: dict[str, bool] = {}
    seen: set[int] = set()
    pending: list[Any] = [value for node in nodes for value in vars(node).values()]
    while pending:
        value = pending.pop()
        if id(value) in seen or isinstance(value, (str, bytes, int, float, bool, LogicalPlan)):
            continue
        seen.add(id(value))
        if len(seen) > MAX_OBJECTS:
            raise refused(too_large_reason(MAX_OBJECTS, "the client's plan"))
        if isinstance(value, CommonInlineUserDefinedFunction):
            name = str(value._function_name)
            found[name] = found.get(name, True) and bool(value._deterministic)
        if isinstance(value, dict):
            pending.extend(value.values())
        elif isinstance(value, (list, tuple, set)):
            pending.extend(value)
        elif hasattr(value, "__dict__") and type(value).__module__.startswith(_CONNECT_MODULES):
            pending.extend(vars(value).values())
    return found


def refusal(analysed_plan_text: str, udfs: Mapping[str, bool] | None = None) -> str | None:
    """Why the analysed plan of ``events`` (text) cannot be replayed over a batch, or None;
    ``udfs``: the Python UDFs of the client's plan and whether each is deterministic."""
    udfs = udfs or {}
    for name, deterministic in udfs.items():
        if not deterministic:
            return nondeterministic_reason(f"{name}(), a Python UDF marked non-deterministic")
    for root in parse_plan_tree(analysed_plan_text):
        for node in root.walk():
            if not node.children:
                continue  # the streaming read itself
            reason = stateful_reason(node.name)
            if reason is not None:
                return reason
            match = BATCH_TIME_CALL.search(node.line)
            if match:
                return batch_time_reason(match.group(0))
            match = NONDETERMINISTIC_CALL.search(node.line)
            if match:
                return nondeterministic_reason(match.group(0))
            unread = [n for n in python_udf_calls(node.line) if n not in udfs]
            if unread:
                return (
                    f"it calls the Python UDF {unread[0]} by a registered name, whose "
                    "determinism a Spark Connect client cannot read; call the UDF object "
                    "itself in events, or pass prepare=, a function that turns the raw source "
                    "rows into events"
                )
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
    reason = refusal(analysed, client_udfs(node for node, _ in path[1:]))
    if reason is not None:
        raise refused(reason)
    read = path[0][0]
    columns = tuple(DataFrame(read, events.sparkSession).columns)
    return ConnectEventsAsWritten(read=read, ancestors=tuple(path[1:]), columns=columns)
