"""Spark's plan tree text (``+-``/``:-`` prefixes, three characters a level) parsed into nodes.

Both the plan reader and the audit read plans printed by Spark; this is the one parser, and
:func:`explain_text` the one way a Spark Connect client gets a query's plans.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class PlanNode:
    """One node of a plan tree parsed from text: its line and children."""

    line: str
    children: list[PlanNode] = field(default_factory=list)

    @property
    def name(self) -> str:
        stripped = self.line.lstrip("~*() 0123456789")
        return stripped.split(" ", 1)[0].split("[", 1)[0]

    def walk(self) -> list[PlanNode]:
        nodes = [self]
        for child in self.children:
            nodes.extend(child.walk())
        return nodes


def streaming_relations(roots: list[PlanNode]) -> list[PlanNode]:
    """The nodes that stand for the query's sources, in source order (the checkpoint's
    ``sources/<i>``): its streaming relations; in the explain text of its last batch (all Spark
    Connect shows), which has none, each batch's data for a source instead: the lowest nodes
    Spark marks as streaming ("~"), above the batch relation that holds the data."""
    nodes = [n for root in roots for n in root.walk()]
    relations = [n for n in nodes if not n.children and n.name.startswith("Streaming")]
    if relations:
        return relations
    return [
        n
        for n in nodes
        if n.line.startswith("~") and not any(c.line.startswith("~") for c in n.children)
    ]


_TREE_PREFIX = re.compile(r"^(?P<pipes>[ :]*)[+:]- ")


def parse_plan_tree(text: str) -> list[PlanNode]:
    """Parse Spark's tree text (``+-``/``:-`` prefixes, 3 characters a level) into its roots."""
    roots: list[PlanNode] = []
    stack: list[tuple[int, PlanNode]] = []
    for raw in text.splitlines():
        if not raw.strip():
            continue
        if raw.startswith("=="):
            stack = []
            continue
        match = _TREE_PREFIX.match(raw)
        if match:
            depth = len(match.group("pipes")) // 3 + 1
            body = raw[match.end() :]
        elif raw[0] in " :":
            continue  # the continuation of a node printed over several lines
        else:
            depth, body = 0, raw
        node = PlanNode(body)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            stack[-1][1].children.append(node)
        elif depth == 0:
            roots.append(node)
        else:
            continue
        stack.append((depth, node))
    return roots


def physical_plan_section(text: str) -> str:
    """The ``== Physical Plan ==`` part of ``explain(True)`` output (or all of it if absent)."""
    marker = "== Physical Plan =="
    if marker not in text:
        return text
    return text.split(marker, 1)[1]


def explain_text(query: Any) -> str | None:
    """``explain(True)`` text of a Spark Connect query without printing it."""
    try:
        import pyspark.sql.connect.proto as pb2

        cmd = pb2.StreamingQueryCommand()
        cmd.explain.extended = True
        return str(query._execute_streaming_query_cmd(cmd).explain.result)
    except Exception:  # noqa: BLE001 - Connect internals: no plan text is a fact, not an error
        return None
