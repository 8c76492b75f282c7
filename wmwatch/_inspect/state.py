"""What plan inspection knows about one watched query in its current run.

The plan's facts and join verdicts, the join state's growth, the latest watermark reading, each
input's own watermark and per-side join state counts. :class:`QueryState` is plain data guarded
by the plan plugin's lock; everything here is pure Python.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from datetime import datetime

from wmwatch._inspect.joins import Growth, JoinCheck, StateSample
from wmwatch._inspect.plan import PlanFacts, WatermarkReading
from wmwatch._inspect.watermarks import (
    NodeWatermarks,
    ProgressMark,
    SourceWatermark,
    WatermarkMonitor,
    holding_back,
)
from wmwatch._progress import ProgressSnapshot, query_label
from wmwatch._text import clean

# batches of progress kept while a Spark Connect query's plan is not read yet
_MAX_PENDING_MARKS = 10_000


@dataclass
class QueryState:
    """One query's inspection state; reset by :meth:`new_run` when a new run starts."""

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
    batches_since_inspection: int = 0
    inspect_failures: int = 0
    side_rows: dict[int, deque[tuple[datetime, dict[str, int]]]] = field(default_factory=dict)
    side_counted_batch: dict[int, int] = field(default_factory=dict)
    side_count_failed: bool = False
    # Spark Connect: each node's watermark followed from every batch's progress (None until the
    # plan's facts are known; the batches before that wait in progress_marks)
    node_watermarks: NodeWatermarks | None = None
    progress_marks: deque[ProgressMark] = field(
        default_factory=lambda: deque(maxlen=_MAX_PENDING_MARKS)
    )

    @property
    def label(self) -> str:
        return query_label(self.name, self.query_id)

    def new_run(self, run_id: str, monitor: WatermarkMonitor) -> None:
        """Forget what belonged to the previous run (its plan may differ)."""
        self.run_id = run_id
        self.facts = None
        self.checks = {}
        self.reading = None
        self.samples.clear()
        self.growth.clear()
        self.monitor = monitor
        self.idle.clear()
        self.batches_since_inspection = 0
        self.inspect_failures = 0
        self.side_rows.clear()
        self.side_counted_batch.clear()
        self.side_count_failed = False
        self.node_watermarks = None
        self.progress_marks.clear()

    def follow_watermarks(self, snapshot: ProgressSnapshot) -> None:
        """Spark Connect: feed one batch's progress to the per-node watermarks."""
        mark = ProgressMark.of(snapshot)
        if self.node_watermarks is None:
            self.progress_marks.append(mark)
        else:
            self.node_watermarks.observe(*mark)

    def start_following(self, facts: PlanFacts) -> None:
        """Spark Connect: the plan's facts are known: follow its nodes from the run's start."""
        order = tuple(n.node_id for n in facts.watermark_nodes)
        if self.node_watermarks is not None and self.node_watermarks.order == order:
            return
        nodes = facts.watermark_nodes
        self.node_watermarks = NodeWatermarks(
            order=order,
            delays_ms={n.node_id: int((n.delay_seconds or 0) * 1000) for n in nodes},
            sources={n.node_id: n.source_positions for n in nodes},
            policy=facts.policy,
        )
        for mark in self.progress_marks:
            self.node_watermarks.observe(*mark)
        self.progress_marks.clear()

    def side_rate(self, op_id: int, side: str) -> float | None:
        """Rows per second one side gained between the first and last per-side counts."""
        counts = self.side_rows.get(op_id)
        if not counts or len(counts) < 2:
            return None
        (t0, first), (t1, last) = counts[0], counts[-1]
        seconds = (t1 - t0).total_seconds()
        return (last[side] - first[side]) / seconds if seconds > 0 else None

    def refresh_sources(self) -> None:
        """Each ``withWatermark`` input's own watermark, named after the progress sources under
        it, and which of them holds the global watermark back."""
        facts, reading = self.facts, self.reading
        if facts is None or not facts.watermark_nodes:
            self.sources = []
            return
        sources = []
        if self.node_watermarks is not None:
            nodes = self.node_watermarks.watermarks()
        else:
            nodes = reading.nodes if reading is not None else {}
        for node in facts.watermark_nodes:
            indexes = tuple(
                i
                for i, description in sorted(self.descriptions.items())
                if description and description in node.text
            ) or tuple(i for i in node.source_positions if i in self.descriptions)
            if indexes:
                label = ",".join(self.descriptions[i] for i in indexes)
            else:
                label = f"{node.event_time_column or 'watermark'}@{node.node_id[:8]}"
            sources.append(
                SourceWatermark(
                    node_id=node.node_id,
                    source=clean(label, 300),
                    source_indexes=indexes,
                    event_time_column=node.event_time_column,
                    delay_seconds=node.delay_seconds,
                    watermark_at=nodes.get(node.node_id),
                    idle_batches=min((self.idle.get(i, 0) for i in indexes), default=0),
                )
            )
        self.sources = holding_back(sources, facts.policy)

    def jumped_sources(self) -> list[str]:
        """The input(s) whose own watermark is the highest: the ones a future-dated row moved."""
        known = [s.watermark_at for s in self.sources if s.watermark_at is not None]
        if not known:
            return []
        top = max(known)
        return [s.source for s in self.sources if s.watermark_at == top]
