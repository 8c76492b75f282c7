"""The worker thread: the one place a watch's state changes.

It takes raw events off the bounded queue, parses them once, updates the query book (what
/metrics shows), hands history to the store's writer thread and tells the plugins, one event at a
time. Every few seconds it also reads how many events Spark's listener bus dropped; once it has
dropped any, a query Spark no longer runs is marked stopped here, since its termination event
may be the one that was lost. Nothing it does may end the thread: a failure is counted and logged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from wmwatch._core.health import Health
from wmwatch._core.listener import EventQueue, RawEvent, spark_streams_events_dropped
from wmwatch._core.plugins import WatchPlugin
from wmwatch._core.state import QueryBook, QueryState
from wmwatch._errors import ProgressParseError
from wmwatch._events import QueryTerminated, parse_idle, parse_started, parse_terminated
from wmwatch._progress import parse_progress_event
from wmwatch._text import first_line, get_logger
from wmwatch._trigger import Trigger, read_trigger

if TYPE_CHECKING:  # duckdb loads only with a history store
    from wmwatch._store.writer import HistoryStore

log = get_logger("wmwatch")

SPARK_BUS_POLL_SECONDS = 5.0
# While Spark's bus keeps dropping events, warn once and then at most this often.
BUS_DROP_LOG_INTERVAL_SECONDS = 600.0


class Worker:
    """Handles every event of one watch on a thread of its own; see the module docstring."""

    def __init__(
        self,
        spark: Any,
        events: EventQueue,
        book: QueryBook,
        health: Health,
        store: HistoryStore | None,
        plugins: Callable[[], list[WatchPlugin]],
    ) -> None:
        self._spark = spark
        self._events = events
        self._book = book
        self._health = health
        self._store = store
        self._plugins = plugins
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._bus_drop_log_after = 0.0
        self._thread = threading.Thread(target=self._run, name="wmwatch-worker", daemon=True)

    # -- control (caller's thread) -----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every event queued so far is handled; True if it was within ``timeout``."""
        deadline = time.monotonic() + timeout
        with self._idle:
            # taken but not yet handled counts too (a size and an in-flight count read apart
            # would miss an event between the queue's get and the count)
            while self._events.unfinished():
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._idle.wait(min(remaining, 0.05))
        return True

    def stop(self) -> None:
        """Let the thread end once the queue is empty."""
        self._stop.set()
        self._events.wake()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout=timeout)

    def await_terminations(self, timeout: float) -> None:
        """Let the termination of queries that just stopped reach the history before closing.

        Spark posts a termination to its listener bus after ``stop()`` or ``awaitTermination()``
        return, so a job that closes right after its last query (a backfill) could otherwise
        record that query as still running. Waits at most ``timeout``; a termination that has
        not arrived by then is recorded as lost (without its exception) on the worker thread.
        """
        try:
            active = {str(query.id) for query in self._spark.streams.active}
        except Exception:  # noqa: BLE001 - the session may already be stopped
            return
        deadline = time.monotonic() + timeout
        while (
            self._stopped_unheard(active)
            and time.monotonic() < deadline
            and self._thread.is_alive()
        ):
            time.sleep(0.02)
        for state in self._stopped_unheard(active):
            log.warning(
                "wmwatch: query %s stopped but its termination event did not arrive before "
                "close(); recording it as stopped",
                state.label,
            )
            self._events.offer(
                "terminated", {"id": state.query_id, "runId": state.run_id, "exception": None}
            )

    # -- the thread --------------------------------------------------------------------------

    def _run(self) -> None:
        next_bus_poll = 0.0
        while True:
            if time.monotonic() >= next_bus_poll:
                # a few py4j calls: cheap, but not per event
                next_bus_poll = time.monotonic() + SPARK_BUS_POLL_SECONDS
                try:
                    self._poll_spark_bus()
                except Exception:  # noqa: BLE001 - the worker must survive anything
                    self._health.error("spark_bus")
            # sleeps until an event comes in or the bus is due (no polling while idle: waking
            # ten times a second cost more CPU than the events); stop() wakes it
            stopping = self._stop.is_set()
            wait = 0.0 if stopping else max(0.0, next_bus_poll - time.monotonic())
            event = self._events.get(timeout=wait)
            if event is None:
                if stopping and not self._events.size():
                    return  # nothing left to handle
                continue
            started = time.perf_counter()
            try:
                self._handle(event)
                self._health.count(self._health.processed, event.kind)
            except ProgressParseError as exc:
                self._health.error(f"parse:{event.kind}")
                log.warning("wmwatch: ignoring a malformed %s event: %s", event.kind, exc)
            except Exception:
                self._health.error(f"handle:{event.kind}")
                log.exception("wmwatch: failed to handle a %s event", event.kind)
            finally:
                self._health.observe_handling(time.perf_counter() - started)
                self._events.task_done()
                with self._idle:
                    self._idle.notify_all()

    def _handle(self, event: RawEvent) -> None:
        if event.kind == "progress":
            snapshot = parse_progress_event(event.payload)
            late_watermark = self._book.on_progress(snapshot)
            if self._store is not None:
                self._store.record_progress(snapshot, late_watermark)
            if self._book.needs_trigger(snapshot.query_id, snapshot.run_id):
                self._read_trigger(snapshot.query_id, snapshot.run_id)
            self._tell("on_progress", snapshot)
        elif event.kind == "started":
            started = parse_started(event.payload)
            self._book.on_started(started)
            if self._store is not None:
                self._store.record_query_started(started)
            self._tell("on_query_started", started)
        elif event.kind == "idle":
            idle = parse_idle(event.payload)
            self._book.on_idle(idle)
            self._tell("on_query_idle", idle)
        elif event.kind == "terminated":
            self._terminated(parse_terminated(event.payload))

    def _read_trigger(self, query_id: str, run_id: str) -> None:
        """Once per run: how the query triggers batches (a few py4j calls; Connect: unknown)."""
        try:
            query = self._spark.streams.get(query_id)
        except Exception:  # noqa: BLE001 - no such query any more: its trigger stays unknown
            query = None
        trigger = read_trigger(query) if query is not None else Trigger()
        self._book.set_trigger(query_id, run_id, trigger)
        if self._store is not None:
            self._store.record_query_trigger(query_id, run_id, trigger)

    def _terminated(self, terminated: QueryTerminated) -> None:
        self._book.on_terminated(terminated)
        if self._store is not None:
            self._store.record_query_terminated(terminated)
        if terminated.failed:
            log.error(
                "wmwatch: query %s failed: %s",
                terminated.query_id,
                first_line(terminated.exception) or "",
            )
        self._tell("on_query_terminated", terminated)

    def _tell(self, hook: str, event: object) -> None:
        for plugin in self._plugins():
            try:
                getattr(plugin, hook)(event)
            except Exception:
                self._health.error(f"plugin:{plugin.name}")
                log.exception("wmwatch: plugin %s failed in %s", plugin.name, hook)

    # -- terminations Spark's bus lost -------------------------------------------------------

    def _poll_spark_bus(self) -> None:
        dropped = spark_streams_events_dropped(self._spark)
        if dropped is None:
            return
        now = time.monotonic()
        if dropped > self._health.spark_listener_bus_dropped and now >= self._bus_drop_log_after:
            # never fill the driver log
            self._bus_drop_log_after = now + BUS_DROP_LOG_INTERVAL_SECONDS
            log.warning(
                "wmwatch: Spark's listener bus dropped %d streaming event(s) so far (its 'streams' "
                "queue was full): raise spark.scheduler.listenerbus.eventqueue.streams.capacity "
                "or remove slow listeners",
                dropped,
            )
        self._health.spark_listener_bus_dropped = dropped
        self._health.spark_listener_bus_readable = True
        if dropped > 0:
            self._reconcile_with_active_queries()

    def _reconcile_with_active_queries(self) -> None:
        """Once Spark has dropped events, a lost termination would leave a query "up" forever:
        mark queries that Spark no longer runs as terminated (the exception, if any, is lost)."""
        active = {str(query.id) for query in self._spark.streams.active}
        for state in self._stopped_unheard(active):
            lost = QueryTerminated(state.query_id, state.run_id, None, None, None)
            log.warning(
                "wmwatch: query %s stopped but its termination event was lost; marking it stopped",
                state.label,
            )
            self._book.on_terminated(lost)
            if self._store is not None:
                self._store.record_query_terminated(lost)
            self._tell("on_query_terminated", lost)

    def _stopped_unheard(self, active: set[str]) -> list[QueryState]:
        """Queries the book has as running that Spark (``active`` ids) no longer runs."""
        return [
            state
            for state in self._book.snapshot()
            if state.status == "active" and state.query_id not in active
        ]
