"""In-memory state of every watched query: the latest snapshot, lifecycle and running totals.

The worker thread is the only writer; the metrics collector reads copies under the lock at
scrape time. Counters (input rows, rows dropped, ...) are kept per query id across runs so a
restarted query continues its counters instead of resetting them. Queries that stopped are kept
for ``forget_after_seconds`` (so the final state and a failure are scraped and can alert), then
forgotten, so stopped queries do not leave stale series forever.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime

from wmwatch._events import QueryIdle, QueryStarted, QueryTerminated
from wmwatch._progress import ProgressSnapshot, query_label
from wmwatch._trigger import Trigger


@dataclass(slots=True)
class QueryState:
    query_id: str
    run_id: str
    name: str | None
    status: str = "active"  # active | terminated | failed
    latest: ProgressSnapshot | None = None
    # the last batch that carried event-time stats (no-data batches only carry the watermark)
    latest_with_data: ProgressSnapshot | None = None
    # the largest event time any batch reported: what Spark builds the watermark on (it keeps
    # it across restarts in the checkpoint, so this is kept across runs too)
    event_time_max_seen_at: datetime | None = None
    started_at: datetime | None = None
    exception: str | None = None
    error_class: str | None = None
    stopped_monotonic: float | None = None
    last_progress_wall_seconds: float | None = None
    last_idle_wall_seconds: float | None = None
    batches_total: int = 0
    input_rows_total: int = 0
    dropped_total: dict[tuple[int, str], int] = field(default_factory=dict)
    removed_total: dict[tuple[int, str], int] = field(default_factory=dict)
    source_rows_total: dict[int, int] = field(default_factory=dict)
    # batches whose progress never arrived (Spark's listener bus drops events under pressure)
    missed_batches_total: int = 0
    # watermark per batch id, to find the late-row watermark of the next batch
    watermark_by_batch: dict[int, datetime | None] = field(default_factory=dict)
    # the run's trigger, read once per run (trigger_run_id: the run it was read for)
    trigger: Trigger = field(default_factory=Trigger)
    trigger_run_id: str | None = None

    @property
    def label(self) -> str:
        return query_label(self.name, self.query_id)

    @property
    def event_time_ahead_seconds(self) -> float | None:
        """The largest event time seen minus the latest batch's time: above zero, the watermark
        stands on rows dated in the future (a producer's clock, a unit mistake)."""
        latest = self.latest
        if self.event_time_max_seen_at is None or latest is None or latest.timestamp_at is None:
            return None
        return (self.event_time_max_seen_at - latest.timestamp_at).total_seconds()

    def copy(self) -> QueryState:
        return replace(
            self,
            dropped_total=dict(self.dropped_total),
            removed_total=dict(self.removed_total),
            source_rows_total=dict(self.source_rows_total),
            watermark_by_batch={},
        )


class QueryBook:
    """The states of all watched queries, keyed by query id."""

    def __init__(
        self,
        *,
        forget_after_seconds: float = 600.0,
        monotonic: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._lock = threading.Lock()
        self._queries: dict[str, QueryState] = {}
        self._forget_after_seconds = forget_after_seconds
        self._monotonic = monotonic
        self._wall = wall

    def on_started(self, event: QueryStarted) -> None:
        with self._lock:
            state = self._queries.get(event.query_id)
            if state is None:
                state = QueryState(query_id=event.query_id, run_id=event.run_id, name=event.name)
                self._queries[event.query_id] = state
            elif state.run_id != event.run_id:
                state.watermark_by_batch.clear()
            state.run_id = event.run_id
            state.name = event.name
            state.status = "active"
            state.started_at = event.started_at
            state.exception = state.error_class = None
            state.stopped_monotonic = None

    def on_progress(self, snapshot: ProgressSnapshot) -> datetime | None:
        """Record a snapshot; return the late-row watermark in force for its batch, if known."""
        with self._lock:
            state = self._queries.get(snapshot.query_id)
            if state is None:
                state = QueryState(
                    query_id=snapshot.query_id, run_id=snapshot.run_id, name=snapshot.name
                )
                self._queries[snapshot.query_id] = state
            if state.status != "active" and state.run_id == snapshot.run_id:
                # a progress event queued behind the termination: keep it as history only
                pass
            else:
                state.status = "active"
                state.stopped_monotonic = None
            state.run_id = snapshot.run_id
            state.name = snapshot.name
            previous = state.latest
            is_retry = previous is not None and snapshot.batch_id <= previous.batch_id
            if previous is not None and previous.run_id == snapshot.run_id and not is_retry:
                state.missed_batches_total += max(0, snapshot.batch_id - previous.batch_id - 1)
            if previous is None or snapshot.batch_id >= previous.batch_id:
                state.latest = snapshot
                if snapshot.event_time_max_at is not None:
                    state.latest_with_data = snapshot
            if snapshot.event_time_max_at is not None and (
                state.event_time_max_seen_at is None
                or snapshot.event_time_max_at > state.event_time_max_seen_at
            ):
                state.event_time_max_seen_at = snapshot.event_time_max_at
            state.last_progress_wall_seconds = self._wall()
            if not is_retry:
                state.batches_total += 1
                state.input_rows_total += snapshot.input_rows or 0
                for op in snapshot.operators:
                    key = (op.operator_id, op.name)
                    state.dropped_total[key] = state.dropped_total.get(key, 0) + (
                        op.rows_dropped_by_watermark or 0
                    )
                    state.removed_total[key] = state.removed_total.get(key, 0) + (
                        op.rows_removed or 0
                    )
                for source in snapshot.sources:
                    state.source_rows_total[source.index] = state.source_rows_total.get(
                        source.index, 0
                    ) + (source.input_rows or 0)
            state.watermark_by_batch[snapshot.batch_id] = snapshot.watermark_at
            if len(state.watermark_by_batch) > 64:
                for old in sorted(state.watermark_by_batch)[:-32]:
                    del state.watermark_by_batch[old]
            if snapshot.batch_id == 0:
                return None
            return state.watermark_by_batch.get(snapshot.batch_id - 1)

    def on_idle(self, event: QueryIdle) -> None:
        with self._lock:
            state = self._queries.get(event.query_id)
            if state is not None:
                state.last_idle_wall_seconds = self._wall()

    def on_terminated(self, event: QueryTerminated) -> None:
        with self._lock:
            state = self._queries.get(event.query_id)
            if state is None:
                state = QueryState(query_id=event.query_id, run_id=event.run_id, name=None)
                self._queries[event.query_id] = state
            state.status = "failed" if event.failed else "terminated"
            state.exception = event.exception
            state.error_class = event.error_class
            state.stopped_monotonic = self._monotonic()

    def needs_trigger(self, query_id: str, run_id: str) -> bool:
        """Whether this run's trigger is still to be read."""
        with self._lock:
            state = self._queries.get(query_id)
            return state is not None and state.trigger_run_id != run_id

    def set_trigger(self, query_id: str, run_id: str, trigger: Trigger) -> None:
        with self._lock:
            state = self._queries.get(query_id)
            if state is not None and state.run_id == run_id:
                state.trigger, state.trigger_run_id = trigger, run_id

    def snapshot(self) -> list[QueryState]:
        """Copies of the states to export, after forgetting queries stopped long enough ago."""
        now = self._monotonic()
        with self._lock:
            for query_id in [
                qid
                for qid, state in self._queries.items()
                if state.stopped_monotonic is not None
                and now - state.stopped_monotonic > self._forget_after_seconds
            ]:
                del self._queries[query_id]
            return [state.copy() for state in self._queries.values()]

    def get(self, key: str) -> QueryState | None:
        """Find a query by id or by label."""
        with self._lock:
            state = self._queries.get(key)
            if state is None:
                state = next((s for s in self._queries.values() if s.label == key), None)
            return state.copy() if state is not None else None
