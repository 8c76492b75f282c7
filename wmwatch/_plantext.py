"""Spark's plan tree text (``+-``/``:-`` prefixes, three characters a level) parsed into nodes.

Both the plan reader and the audit read plans printed by Spark; this is the one parser.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


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
