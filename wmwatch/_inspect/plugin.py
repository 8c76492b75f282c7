"""The plan plugin: join-state and watermark checks for every watched query. Its worker-thread
hooks stay pure Python; everything that reads Spark runs on the inspector's own thread
(:mod:`wmwatch._inspect.reads`). How the parts fit: docs/architecture.md (Plan inspection).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from prometheus_client.core import Metric

from wmwatch._core.plugins import HistoryAccess, WatchContext, WatchPlugin
from wmwatch._core.sessions import is_connect
from wmwatch._events import QueryStarted, QueryTerminated
from wmwatch._inspect.evaluate import apply_verdict, judge_joins
from wmwatch._inspect.findings import Finding, FindingsBook
from wmwatch._inspect.joins import StateSample, analyze_growth, classify_join
from wmwatch._inspect.metrics import plan_metrics
from wmwatch._inspect.plan import (
    PlanFacts,
    WatermarkReading,
    count_join_side_rows,
    facts_from_jvm,
    facts_from_text,
    operator_watermarks_from_text,
    read_watermarks_jvm,
)
from wmwatch._inspect.reads import LatestReads
from wmwatch._inspect.state import QueryState
from wmwatch._inspect.tables import write_finding, write_watermarks
from wmwatch._inspect.watermarks import (
    OperatorWatermark,
    SourceWatermark,
    WatermarkMonitor,
)
from wmwatch._plantext import explain_text
from wmwatch._progress import ProgressSnapshot
from wmwatch._text import get_logger

log = get_logger("wmwatch.plan")


class PlanPlugin(WatchPlugin):
    """Join-state and watermark checks for every watched query.

    ``context`` hands out the running queries, the session (for per-side join state counts) and
    the history (optional). ``state_budget_bytes``: the state size a join may reach (memory or
    disk) for ``wmwatch_state_budget_seconds_remaining``. ``reinspect_every_batches``: how often
    the light read also re-checks the plan's shape. ``min_read_interval_seconds``: the least time
    between two plan reads of one query. ``forget_after_seconds``: how long a stopped query's
    state and series stay (``attach`` passes its own); ``monotonic``: the clock that measures it.
    """

    name = "plan"

    def __init__(
        self,
        context: WatchContext,
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
        min_read_interval_seconds: float = 2.0,
        forget_after_seconds: float = 600.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._context = context
        # a Spark Connect client reads no watermark tracker: it follows each node from progress
        self._connect = is_connect(context.spark)
        self.state_budget_bytes = state_budget_bytes
        self.growth_window_batches = growth_window_batches
        self.min_growth_batches = min_growth_batches
        self.behaviour_batches = behaviour_batches
        self.side_count_every_batches = side_count_every_batches
        self.reinspect_every_batches = reinspect_every_batches
        self.stall_batches = stall_batches
        self.jump_min_seconds = jump_min_seconds
        self.forget_after_seconds = forget_after_seconds
        self._monotonic = monotonic
        store = context.store
        self._store = store
        self.findings = FindingsBook(
            writer=_finding_writer(store) if store is not None else None,
            update_interval_seconds=findings_update_interval_seconds,
        )
        self.costs: dict[str, deque[float]] = {
            "inspect_seconds": deque(maxlen=200),
            "read_seconds": deque(maxlen=200),
            "side_count_seconds": deque(maxlen=200),
        }
        self._lock = threading.RLock()
        self._queries: dict[str, QueryState] = {}
        self._connect_facts: dict[str, PlanFacts] = {}
        self._previous_watermark: dict[str, datetime | None] = {}
        # query id -> (the run that stopped, when, on ``monotonic``)
        self._stopped: dict[str, tuple[str, float]] = {}
        # query id -> (run id, its StreamingQuery): Spark lists a run no more once it stops,
        # and its last progress is still read
        self._handles: dict[str, tuple[str, Any]] = {}
        self._reads = LatestReads(
            self._read, min_interval_seconds=min_read_interval_seconds, name="wmwatch-plan"
        )

    # -- hooks (worker thread: pure Python, no py4j) ---------------------------------------

    def on_query_started(self, event: QueryStarted) -> None:
        self._forget_stopped()
        with self._lock:
            self._stopped.pop(event.query_id, None)
            q = self._queries.setdefault(event.query_id, QueryState(event.query_id, event.name))
            q.name = event.name or q.name
            if q.run_id != event.run_id:
                self._new_run(q, event.run_id)

    def on_progress(self, snapshot: ProgressSnapshot) -> None:
        with self._lock:
            q = self._queries.setdefault(
                snapshot.query_id, QueryState(snapshot.query_id, snapshot.name)
            )
            q.name = snapshot.name or q.name
            if q.run_id != snapshot.run_id:
                self._new_run(q, snapshot.run_id)
            stopped = self._stopped.get(snapshot.query_id)
            if stopped is not None and stopped[0] != snapshot.run_id:
                del self._stopped[snapshot.query_id]  # a new run whose start we did not hear
            for source in snapshot.sources:
                q.descriptions[source.index] = source.description
                q.idle[source.index] = 0 if source.input_rows else q.idle.get(source.index, 0) + 1
            at = snapshot.timestamp_at or datetime.now(UTC)
            for op in snapshot.operators:
                if op.name != "symmetricHashJoin":
                    continue
                window = q.samples.setdefault(
                    op.operator_id, deque(maxlen=self.growth_window_batches)
                )
                window.append(
                    StateSample(
                        snapshot.batch_id, at, snapshot.watermark_at, op.rows_total or 0,
                        op.rows_removed or 0, op.memory_used_bytes or 0, snapshot.input_rows or 0,
                    )
                )  # fmt: skip
                q.growth[op.operator_id] = analyze_growth(
                    window, min_batches=self.min_growth_batches
                )
            if self._connect:
                q.follow_watermarks(snapshot)
            q.refresh_sources()
            self._judge_joins(q, snapshot.batch_id, at)
            for verdict in q.monitor.observe(snapshot, holding=q.sources):
                apply_verdict(q, self.findings, verdict, batch_id=snapshot.batch_id, at=at)
        self._reads.submit(snapshot.query_id, snapshot)

    def on_query_terminated(self, event: QueryTerminated) -> None:
        with self._lock:
            if event.query_id in self._queries:
                self._stopped[event.query_id] = (event.run_id, self._monotonic())
        # the run's last progress waiting for a read is read now (its final watermarks), not
        # dropped; the run's handle goes after that read
        if not self._reads.finish(event.query_id):
            self._drop_stopped_handle(event.query_id)
        self._forget_stopped()

    def _drop_stopped_handle(self, query_id: str) -> None:
        with self._lock:
            if query_id in self._stopped:
                self._handles.pop(query_id, None)

    def _forget_stopped(self) -> None:
        """Forget the queries stopped more than ``forget_after_seconds`` ago: their state,
        pending reads, findings (written to the history first) and so their series."""
        now = self._monotonic()
        with self._lock:
            due = [
                query_id
                for query_id, (_, stopped_at) in self._stopped.items()
                if now - stopped_at > self.forget_after_seconds
            ]
            for query_id in due:
                del self._stopped[query_id]
                self._queries.pop(query_id, None)
                self._connect_facts.pop(query_id, None)
                self._previous_watermark.pop(query_id, None)
                self._handles.pop(query_id, None)
        for query_id in due:
            self._reads.discard(query_id)
            self.findings.forget(query_id)

    def remembered(self) -> dict[str, int]:
        """How many entries each of the per-query structures holds (tests: nothing leaks)."""
        with self._lock:
            return {
                "queries": len(self._queries),
                "stopped": len(self._stopped),
                "connect_facts": len(self._connect_facts),
                "previous_watermark": len(self._previous_watermark),
                "handles": len(self._handles),
                "reads": len(self._reads.keys()),
                "findings": len(self.findings.all()),
            }

    def _new_run(self, q: QueryState, run_id: str) -> None:
        monitor = WatermarkMonitor(
            stall_batches=self.stall_batches, jump_min_seconds=self.jump_min_seconds
        )
        q.new_run(run_id, monitor)

    def _judge_joins(self, q: QueryState, batch_id: int, at: datetime) -> None:
        judge_joins(
            q,
            self.findings,
            state_budget_bytes=self.state_budget_bytes,
            behaviour_batches=self.behaviour_batches,
            batch_id=batch_id,
            at=at,
        )

    # -- inspector thread (py4j) -----------------------------------------------------------

    @property
    def min_read_interval_seconds(self) -> float:
        return self._reads.min_interval_seconds

    @min_read_interval_seconds.setter
    def min_read_interval_seconds(self, seconds: float) -> None:
        self._reads.min_interval_seconds = seconds

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until every queued inspection is done (tests and ``flush``)."""
        return self._reads.wait_idle(timeout)

    def _read(self, query_id: str, snapshot: ProgressSnapshot) -> None:
        try:
            self._inspect(snapshot)
        except Exception:
            log.debug("wmwatch: plan inspection failed for %s", query_id, exc_info=True)
            with self._lock:
                q = self._queries.get(query_id)
                if q is not None:
                    q.inspect_failures += 1
        finally:
            # a stopped run's last read is done: its handle is not needed any more
            self._drop_stopped_handle(query_id)

    def _inspect(self, snapshot: ProgressSnapshot) -> None:
        with self._lock:
            q = self._queries.get(snapshot.query_id)
            if q is None or q.run_id != snapshot.run_id or q.inspect_failures >= 5:
                return
            facts = q.facts
            due = facts is None or q.batches_since_inspection >= self.reinspect_every_batches
            q.batches_since_inspection += 1
        query = self._running_or_stopped(snapshot)
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
            # a run that ended, or a query forgotten while its plan was read, is not written to
            if q.run_id != snapshot.run_id or self._queries.get(snapshot.query_id) is not q:
                return
            changed = q.facts is None or q.facts.signature != facts.signature
            if changed:
                q.facts = facts
                q.checks = {j.operator_id: classify_join(j) for j in facts.joins}
            if changed or due:
                q.batches_since_inspection = 0
            q.reading = reading or q.reading
            q.refresh_sources()
            if changed:
                self._judge_joins(q, snapshot.batch_id, at)
            sources = list(q.sources)
            label = q.label
        if reading is not None and self._store is not None:
            self._record(snapshot.query_id, label, reading, sources, facts.policy)
        self._count_sides(q, snapshot, at)

    def _running_or_stopped(self, snapshot: ProgressSnapshot) -> Any:
        """The query of ``snapshot``'s run: running, or stopped since (its last read)."""
        query = self._context.get_query(snapshot.query_id)
        with self._lock:
            if query is not None:
                if snapshot.query_id not in self._stopped:
                    self._handles[snapshot.query_id] = (snapshot.run_id, query)
                return query
            run_id, handle = self._handles.get(snapshot.query_id, (None, None))
        return handle if run_id == snapshot.run_id else None

    def _count_sides(self, q: QueryState, snapshot: ProgressSnapshot, at: datetime) -> None:
        """Per-side state rows of joins that keep state forever, every few batches."""
        every = self.side_count_every_batches
        spark = self._context.spark
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
        with self._lock:
            if snapshot.query_id not in self._queries:
                return None  # forgotten meanwhile
            previous = self._previous_watermark.get(snapshot.query_id)
            self._previous_watermark[snapshot.query_id] = snapshot.watermark_at
        reading = self._read_connect_operators(query, snapshot, due, facts, previous)
        facts = self._connect_facts.get(snapshot.query_id, facts)
        if reading is None or facts is None:
            return reading
        with self._lock:
            q = self._queries.get(snapshot.query_id)
            if q is None or q.run_id != snapshot.run_id:
                return reading
            q.start_following(facts)
            assert q.node_watermarks is not None
            return replace(reading, nodes=q.node_watermarks.watermarks())

    def _read_connect_operators(
        self,
        query: Any,
        snapshot: ProgressSnapshot,
        due: bool,
        facts: PlanFacts | None,
        previous: datetime | None,
    ) -> WatermarkReading | None:
        if due or facts is None:
            started = time.perf_counter()
            text = explain_text(query)
            if text is None:
                return None
            fresh = facts_from_text(text, run_id=snapshot.run_id)
            self.costs["inspect_seconds"].append(time.perf_counter() - started)
            with self._lock:
                if snapshot.query_id not in self._queries:
                    return None  # forgotten meanwhile
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

    # -- history ---------------------------------------------------------------------------

    def _record(
        self,
        query_id: str,
        label: str,
        reading: WatermarkReading,
        sources: list[SourceWatermark],
        policy: str,
    ) -> None:
        store = self._store
        batch_id = reading.batch_id
        if store is None or batch_id is None:
            return
        recorded_at = datetime.now(UTC)
        store.submit(
            lambda con: write_watermarks(
                con,
                query_id=query_id,
                batch_id=batch_id,
                operators=reading.operators,
                sources=sources,
                policy=policy,
                recorded_at=recorded_at,
            ),
            description=f"watermarks {label} batch {batch_id}",
        )

    # -- metrics and report ----------------------------------------------------------------

    def collect(self) -> Iterable[Metric]:
        self._forget_stopped()
        with self._lock:
            return plan_metrics(
                list(self._queries.values()),
                self.findings.all(),
                self.costs,
                self.state_budget_bytes,
            )

    def summary(self) -> dict[str, Any]:
        """Rendering-ready state of every query: findings, operator and input watermarks."""
        out: dict[str, Any] = {}
        self._forget_stopped()
        with self._lock:
            for q in self._queries.values():
                out[q.label] = {
                    "query_id": q.query_id,
                    "policy": q.facts.policy if q.facts else None,
                    "joins": [
                        {
                            "operator_id": op,
                            "case": c.case,
                            "unbounded_sides": list(c.unbounded_sides),
                        }
                        for op, c in sorted(q.checks.items())
                    ],
                    "operators": [
                        {
                            "operator_id": o.operator_id,
                            "operator_name": o.operator_name,
                            "late_watermark_at": o.late_at and o.late_at.isoformat(),
                            "eviction_watermark_at": o.eviction_at and o.eviction_at.isoformat(),
                        }
                        for o in (q.reading.operators if q.reading else ())
                    ],
                    "sources": [
                        {
                            "source": s.source,
                            "watermark_at": s.watermark_at and s.watermark_at.isoformat(),
                            "event_time_max_at": s.event_time_max_at
                            and s.event_time_max_at.isoformat(),
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
        self._reads.close(timeout=5.0)
        self.findings.flush()


def _finding_writer(store: HistoryAccess) -> Callable[[Finding], None]:
    def write(finding: Finding) -> None:
        store.submit(lambda con: write_finding(con, finding), description=f"finding {finding.kind}")

    return write
