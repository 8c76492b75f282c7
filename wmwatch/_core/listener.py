"""Receiving Spark's streaming events without slowing anything down: a py4j proxy of Spark's
``PythonStreamingQueryListener`` (classic PySpark; guarded, as the interface is internal) or the
stock listener (Spark Connect), whose callbacks put each event's text on a bounded queue and
never raise or block; and the seeding of queries already running at attach. Why:
docs/attach.md (How it stays out of the way).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from wmwatch._core.health import Health
from wmwatch._text import get_logger

log = get_logger("wmwatch")


@dataclass(frozen=True, slots=True)
class RawEvent:
    kind: str  # started | progress | idle | terminated
    payload: str | dict[str, Any]
    received_monotonic: float


Offer = Callable[[str, str | dict[str, Any]], bool]

# Put by :meth:`EventQueue.wake` to end a waiting ``get`` (never handed out as an event).
_WAKE = RawEvent("wake", {}, 0.0)


class EventQueue:
    """A bounded queue of raw events; ``offer`` never blocks."""

    def __init__(self, capacity: int, health: Health) -> None:
        self.capacity = capacity
        self._queue: queue.Queue[RawEvent] = queue.Queue(maxsize=capacity)
        self._health = health
        self._gate = threading.Lock()
        self._held: list[RawEvent] | None = None

    def offer(self, kind: str, payload: str | dict[str, Any]) -> bool:
        self._health.count(self._health.received, kind)
        event = RawEvent(kind, payload, time.monotonic())
        if self._held is None:  # the common case: no lock but the queue's own
            return self._put(event)
        with self._gate:
            if self._held is None:  # the hold ended meanwhile
                return self._put(event)
            if len(self._held) + self._queue.qsize() >= self.capacity:
                self._health.count(self._health.dropped, kind)
                return False
            self._held.append(event)
            return True

    @contextlib.contextmanager
    def live_events_held(self) -> Iterator[Offer]:
        """Queue what is offered through the yielded function first; events offered meanwhile
        through :meth:`offer` (the listener's) wait and follow, in their order, when the block ends.

        Seeding uses it: the listener is added before reading what Spark remembers (so no batch
        falls between the two), and a batch that finishes meanwhile must not overtake older ones.
        """
        with self._gate:
            self._held = []

        def offer_first(kind: str, payload: str | dict[str, Any]) -> bool:
            self._health.count(self._health.received, kind)
            return self._put(RawEvent(kind, payload, time.monotonic()))

        try:
            yield offer_first
        finally:
            with self._gate:
                # drained before it is unset: an offer that sees no hold must come after these
                for event in self._held or []:
                    self._put(event)
                self._held = None

    def _put(self, event: RawEvent) -> bool:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._health.count(self._health.dropped, event.kind)
            return False
        return True

    def get(self, timeout: float) -> RawEvent | None:
        """The next event, or None when ``timeout`` passed or :meth:`wake` was called."""
        try:
            event = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if event is _WAKE:
            self._queue.task_done()
            return None
        return event

    def wake(self) -> None:
        """Make a ``get`` that waits return None now (a full queue hands it an event anyway)."""
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait(_WAKE)

    def size(self) -> int:
        return self._queue.qsize()

    def task_done(self) -> None:
        """The event last taken with :meth:`get` is handled."""
        self._queue.task_done()

    def unfinished(self) -> int:
        """Events queued or taken and not yet handled."""
        with self._queue.mutex:
            return self._queue.unfinished_tasks


class Py4jListener:
    """The py4j proxy Spark calls for each event (classic PySpark)."""

    def __init__(self, events: EventQueue, health: Health) -> None:
        self._events = events
        self._health = health

    def _offer_json(self, kind: str, jevent: Any) -> None:
        try:
            # one JVM round trip per event; progress events arrive as {"progress": {...}}
            self._events.offer(kind, jevent.json())
        except BaseException:  # noqa: BLE001 - must never raise into Spark
            self._health.error(f"receive:{kind}")

    def onQueryStarted(self, jevent: Any) -> None:  # noqa: N802 - Java interface
        self._offer_json("started", jevent)

    def onQueryProgress(self, jevent: Any) -> None:  # noqa: N802
        self._offer_json("progress", jevent)

    def onQueryIdle(self, jevent: Any) -> None:  # noqa: N802
        self._offer_json("idle", jevent)

    def onQueryTerminated(self, jevent: Any) -> None:  # noqa: N802
        self._offer_json("terminated", jevent)

    class Java:
        implements = ["org.apache.spark.sql.streaming.PythonStreamingQueryListener"]  # noqa: RUF012


def make_stock_listener(events: EventQueue, health: Health) -> Any:
    """A stock ``StreamingQueryListener`` feeding the same queue (Spark Connect, or fallback)."""
    from pyspark.sql.streaming.listener import StreamingQueryListener

    class StockListener(StreamingQueryListener):
        def _safe(self, kind: str, build: Any) -> None:
            try:
                events.offer(kind, build())
            except BaseException:  # noqa: BLE001 - must never raise into Spark
                health.error(f"receive:{kind}")

        def onQueryStarted(self, event: Any) -> None:  # noqa: N802
            self._safe(
                "started",
                lambda: {
                    "id": str(event.id),
                    "runId": str(event.runId),
                    "name": event.name,
                    "timestamp": event.timestamp,
                },
            )

        def onQueryProgress(self, event: Any) -> None:  # noqa: N802
            self._safe("progress", lambda: event.progress.json)

        def onQueryIdle(self, event: Any) -> None:  # noqa: N802
            self._safe(
                "idle",
                lambda: {
                    "id": str(event.id),
                    "runId": str(event.runId),
                    "timestamp": event.timestamp,
                },
            )

        def onQueryTerminated(self, event: Any) -> None:  # noqa: N802
            self._safe(
                "terminated",
                lambda: {
                    "id": str(event.id),
                    "runId": str(event.runId),
                    "exception": event.exception,
                    "errorClassOnException": event.errorClassOnException,
                },
            )

    return StockListener()


def is_classic(spark: Any) -> bool:
    """True for a classic (py4j) SparkSession, False for Spark Connect."""
    return hasattr(spark, "_jsparkSession") and getattr(spark, "_jsparkSession", None) is not None


class ListenerRegistration:
    """Adds the cheapest listener the session supports and removes it again on ``remove``."""

    def __init__(
        self, spark: Any, events: EventQueue, health: Health, *, mode: str = "auto"
    ) -> None:
        self._spark = spark
        self._jwrapper: Any = None
        self._stock: Any = None
        if mode not in ("auto", "py4j", "stock"):
            from wmwatch._errors import ConfigError

            raise ConfigError(f"listener mode {mode!r} is not one of auto, py4j, stock")
        if mode in ("auto", "py4j") and is_classic(spark):
            try:
                from pyspark.java_gateway import ensure_callback_server_started

                context = spark.sparkContext
                ensure_callback_server_started(context._gateway)  # type: ignore[no-untyped-call]  # unannotated in pyspark
                streaming = context._jvm.org.apache.spark.sql.streaming
                self._jwrapper = streaming.PythonStreamingQueryListenerWrapper(
                    Py4jListener(events, health)
                )
                spark.streams._jsqm.addListener(self._jwrapper)
                health.listener_mode = "py4j"
                return
            except Exception as exc:
                self._jwrapper = None
                if mode == "py4j":
                    raise
                log.warning(
                    "wmwatch: py4j listener unavailable (%s); using the stock listener", exc
                )
        self._stock = make_stock_listener(events, health)
        spark.streams.addListener(self._stock)
        health.listener_mode = "stock"

    def remove(self) -> None:
        try:
            if self._jwrapper is not None:
                self._spark.streams._jsqm.removeListener(self._jwrapper)
            elif self._stock is not None:
                self._spark.streams.removeListener(self._stock)
        except Exception as exc:  # noqa: BLE001 - the session may already be stopped
            log.debug("wmwatch: removing the listener failed: %s", exc)


# Spark keeps 100 progress updates per query by default
# (spark.sql.streaming.numRecentProgressUpdates); a larger setting is honoured up to this many,
# so attach stays short (two py4j calls per batch).
SEED_MAX_BATCHES_PER_QUERY = 1_000


def seed_active_queries(spark: Any, offer: Offer, health: Health, *, room: int) -> int:
    """Queue a started event and the progress Spark still holds, oldest first, for every query
    running before attach; return how many queries there were.

    ``room``: at most this many progress events in all, so seeding never fills the queue that
    live events need. The worker handles them like live ones: a batch seen again later (live,
    or retried) replaces its history row and is not counted twice.
    """
    try:
        active = list(spark.streams.active)
    except Exception:  # noqa: BLE001
        health.error("seed")
        return 0
    per_query = max(1, min(SEED_MAX_BATCHES_PER_QUERY, room // max(1, len(active))))
    recovered: list[str] = []
    for query in active:
        try:
            query_id, name = str(query.id), query.name
            offer(
                "started",
                {"id": query_id, "runId": str(query.runId), "name": name, "timestamp": None},
            )
            batches = _remembered_progress(query, per_query, health)
            for progress in batches:
                offer("progress", progress)
            recovered.append(f"{name or query_id}: {len(batches)}")
        except Exception:  # noqa: BLE001
            health.error("seed")
    if recovered:
        more = len(recovered) - 10
        shown = ", ".join(recovered[:10]) + (f", and {more} more" if more > 0 else "")
        log.info(
            "wmwatch: watching %d query(ies) that were already running; batches recorded from "
            "Spark's recent progress: %s",
            len(recovered),
            shown,
        )
    return len(recovered)


def _remembered_progress(query: Any, limit: int, health: Health) -> list[str | dict[str, Any]]:
    """The last ``limit`` progress updates Spark holds for ``query``, oldest first."""
    jsq = getattr(query, "_jsq", None)
    if jsq is None:  # Spark Connect: one call for all of them
        recent = query.recentProgress or []
        # the document as Spark sent it (``.json``), as the stock listener records it
        return [_progress_document(p) for p in recent[-limit:]]
    try:
        # JVM objects: one .json() round trip each, instead of PySpark's field-by-field conversion
        jrecent = jsq.recentProgress()
        count = len(jrecent)
        return [str(jrecent[i].json()) for i in range(max(0, count - limit), count)]
    except Exception:  # noqa: BLE001 - internal API: fall back to the last progress
        health.error("seed")
        jlast = jsq.lastProgress()
        return [str(jlast.json())] if jlast is not None else []


def _progress_document(progress: Any) -> str | dict[str, Any]:
    text = getattr(progress, "json", None)
    if isinstance(text, str):
        return text
    return dict(progress)


# Spark's LiveListenerBus counts what each of its queues drops; streaming events go through
# its "streams" queue.
_STREAMS_DROPPED_COUNTER = "queue.streams.numDroppedEvents"


def spark_streams_events_dropped(spark: Any) -> int | None:
    """Events Spark's listener bus dropped from its ``streams`` queue, or None when unreadable.

    A full queue makes Spark drop events before any listener sees them (wmwatch then sees a gap
    in batch ids at best, nothing at all for a lost start or termination). Only classic PySpark
    exposes the bus (internal API, hence the broad guard); Spark Connect gives None.
    """
    if not is_classic(spark):
        return None
    try:
        registry = spark.sparkContext._jsc.sc().listenerBus().metrics().metricRegistry()
        counter = registry.getCounters().get(_STREAMS_DROPPED_COUNTER)
        return int(counter.getCount()) if counter is not None else 0
    except Exception:  # noqa: BLE001 - internal API, or the session is stopping
        return None
