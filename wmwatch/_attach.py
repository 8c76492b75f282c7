"""``attach`` and the ``Watch`` handle: wiring listener, worker, state, store, metrics and plugins.

One worker thread owns every update: it takes raw events off the bounded queue, parses them once,
updates the query book (what /metrics shows), hands history to the store's writer thread and
tells the plugins. Nothing here ever raises into Spark; setup problems (port in use, unusable db)
either raise (``strict=True``) or are logged once at ERROR and leave wmwatch running degraded, so
a monitoring mistake never takes the watched job down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import Any

from prometheus_client import CollectorRegistry

from wmwatch._core.health import Health
from wmwatch._core.listener import (
    EventQueue,
    ListenerRegistration,
    RawEvent,
    seed_active_queries,
    spark_streams_events_dropped,
)
from wmwatch._core.plugins import WatchPlugin
from wmwatch._core.sessions import SessionRegistry, differing_options
from wmwatch._core.state import QueryBook, QueryState
from wmwatch._errors import ConfigError, ProgressParseError, WmwatchError
from wmwatch._events import QueryTerminated, parse_idle, parse_started, parse_terminated
from wmwatch._metrics.collector import WatchCollector
from wmwatch._metrics.exporter import MetricsServer, serve_metrics
from wmwatch._progress import ProgressSnapshot, parse_progress_event

log = logging.getLogger("wmwatch")

DEFAULT_METRICS_ADDR = "127.0.0.1"
SPARK_BUS_POLL_SECONDS = 5.0
# The history writer's timed flushes may use this share of one core: the watched job runs on
# the same cores, and a flush's fixed cost grows with a slower machine.
HISTORY_WRITER_CPU_SHARE = 0.005


class Watch:
    """A running wmwatch attached to one SparkSession. Use as a context manager or call ``close``."""

    def __init__(
        self,
        spark: Any,
        *,
        db: str | os.PathLike[str] | None,
        metrics_port: int | None,
        metrics_addr: str | None,
        registry: CollectorRegistry | None,
        metrics_certfile: str | None,
        metrics_keyfile: str | None,
        metrics_basic_auth: tuple[str, str] | None,
        strict: bool,
        queue_capacity: int,
        forget_after_seconds: float,
        retention_days: float | None,
        db_flush_seconds: float,
        listener: str,
        plugins: Iterable[WatchPlugin],
        inspect_plans: bool,
        state_budget_bytes: int | None,
        pushgateway: str | None,
        push_job: str,
    ) -> None:
        if queue_capacity < 1:
            raise ConfigError("queue_capacity must be at least 1")
        self.spark = spark
        self.health = Health()
        self.book = QueryBook(forget_after_seconds=forget_after_seconds)
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.problems: list[str] = []
        self._strict = strict
        self._plugins: list[WatchPlugin] = []
        self._plugins_lock = threading.Lock()
        self._events = EventQueue(queue_capacity, self.health)
        self._closed = False
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._in_flight = 0
        self._bus_drop_log_after = 0.0

        self.store: Any = None
        if db is not None:
            self.store = self._open_store(db, retention_days, db_flush_seconds)

        self._collector = WatchCollector(
            self.book,
            self.health,
            queue_size=self._events.size,
            queue_capacity=queue_capacity,
            store_health=(lambda: self.store.health) if self.store is not None else None,
            plugins=self.plugins,
        )
        self.registry.register(self._collector)

        self.metrics_server: MetricsServer | None = None
        if metrics_port:
            addr = metrics_addr or os.environ.get("WMWATCH_METRICS_ADDR") or DEFAULT_METRICS_ADDR
            try:
                self.metrics_server = serve_metrics(
                    self.registry,
                    port=metrics_port,
                    addr=addr,
                    certfile=metrics_certfile,
                    keyfile=metrics_keyfile,
                    basic_auth=metrics_basic_auth,
                )
                self.health.metrics_server_up = True
            except WmwatchError as exc:
                self._problem(exc)

        for plugin in self._default_plugins(inspect_plans, state_budget_bytes, pushgateway, push_job):
            self.add_plugin(plugin)
        for plugin in plugins:
            self.add_plugin(plugin)

        self._worker = threading.Thread(target=self._run, name="wmwatch-worker", daemon=True)
        self._worker.start()
        try:
            # Live events wait until the batches Spark still holds for running queries are
            # queued: history goes in batch order, and a batch seen twice counts once.
            with self._events.live_events_held() as offer_first:
                self._registration = ListenerRegistration(spark, self._events, self.health, mode=listener)
                seed_active_queries(spark, offer_first, self.health, room=queue_capacity // 2)
        except BaseException:
            # nothing half-made may keep the port or the history file from the next attach
            self._stop.set()
            for plugin in self.plugins():
                with contextlib.suppress(Exception):
                    plugin.close()
            self._teardown_partial()
            raise

    # -- setup -------------------------------------------------------------------------------

    def _problem(self, error: WmwatchError) -> None:
        if self._strict:
            self._teardown_partial()
            raise error
        self.problems.append(str(error))
        log.error("wmwatch: %s (continuing without it; pass strict=True to fail instead)", error)

    def _teardown_partial(self) -> None:
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()
        server: MetricsServer | None = getattr(self, "metrics_server", None)
        if server is not None:
            with contextlib.suppress(Exception):
                server.close()
        collector = getattr(self, "_collector", None)
        if collector is not None:
            # a caller's registry must take this watch's successor without a duplicate error
            with contextlib.suppress(KeyError):
                self.registry.unregister(collector)

    def _open_store(
        self, db: str | os.PathLike[str], retention_days: float | None, db_flush_seconds: float
    ) -> Any:
        from wmwatch._store.writer import HistoryStore

        try:
            store = HistoryStore(
                Path(db),
                retention_days=retention_days,
                flush_interval_seconds=db_flush_seconds,
                max_cpu_share=HISTORY_WRITER_CPU_SHARE,
            )
        except WmwatchError as exc:
            if self._strict:
                raise
            self._problem(exc)
            return None
        history = getattr(store, "history_at_open", ())
        if history:
            summary = ", ".join(
                f"{h.query_name or h.query_id}: {h.batches} batches (last #{h.last_batch_id})"
                for h in history[:5]
            )
            how = "recovered after an unclean stop" if getattr(store, "recovered_after_crash", False) else "opened"
            log.info("wmwatch: history %s %s with %s", db, how, summary)
        store.start()
        return store

    def _default_plugins(
        self,
        inspect_plans: bool,
        state_budget_bytes: int | None,
        pushgateway: str | None,
        push_job: str,
    ) -> list[WatchPlugin]:
        plugins: list[WatchPlugin] = []
        if inspect_plans:
            from wmwatch._inspect.plugin import PlanPlugin

            plugins.append(PlanPlugin(self, state_budget_bytes=state_budget_bytes))
        if pushgateway:
            from wmwatch._metrics.push import PushPlugin

            plugins.append(PushPlugin(self, pushgateway, job=push_job))
        return plugins

    # -- public surface ----------------------------------------------------------------------

    @property
    def metrics_url(self) -> str | None:
        """Where /metrics is served, or None when there is no endpoint."""
        return self.metrics_server.url if self.metrics_server is not None else None

    def plugins(self) -> list[WatchPlugin]:
        with self._plugins_lock:
            return list(self._plugins)

    def add_plugin(self, plugin: WatchPlugin) -> None:
        """Register a plugin: it is told about every later event and scraped with the rest."""
        with self._plugins_lock:
            self._plugins.append(plugin)

    def remove_plugin(self, plugin: WatchPlugin) -> None:
        with self._plugins_lock:
            if plugin in self._plugins:
                self._plugins.remove(plugin)

    def get_query(self, query_id: str) -> Any:
        """The running ``StreamingQuery`` with this id, or None."""
        try:
            return self.spark.streams.get(query_id)
        except Exception:  # noqa: BLE001
            return None

    def latest(self, query: str) -> ProgressSnapshot | None:
        """The last progress seen for a query (by name or id)."""
        state = self.book.get(query)
        return state.latest if state is not None else None

    def queries(self) -> list[QueryState]:
        """Copies of the state of every query being watched."""
        return self.book.snapshot()

    def audit(self, query: Any, events: Any, **options: Any) -> Any:
        """Divert the rows ``query`` drops behind its watermark into the audit table.

        See :func:`wmwatch._audit.auditor.start_audit` for the options.
        """
        from wmwatch._audit.auditor import start_audit

        return start_audit(self, query, events, **options)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every event received so far is handled and written; True if it was."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._events.size() or self._in_flight:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._worker.is_alive():
                    return False
                self._idle.wait(min(remaining, 0.05))
        if self.store is not None:
            return bool(self.store.flush(timeout=max(0.1, deadline - time.monotonic())))
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Stop listening, handle what is queued, flush the history and stop the endpoint."""
        if self._closed:
            return
        self._closed = True
        try:
            self._await_terminations(min(timeout, 5.0))
            self._registration.remove()
            self.flush(timeout=timeout)
            self._stop.set()
            self._worker.join(timeout=timeout)
            for plugin in self.plugins():
                try:
                    plugin.close()
                except Exception:  # noqa: BLE001
                    log.exception("wmwatch: plugin %s failed to close", plugin.name)
            if self.store is not None:
                self.store.close()
            if self.metrics_server is not None:
                self.metrics_server.close()
                self.health.metrics_server_up = False
            with contextlib.suppress(KeyError):
                self.registry.unregister(self._collector)
        finally:
            # only now, with the port and the history file free, may the session get a new watch
            _LIVE_WATCHES.discard(self)

    def __enter__(self) -> Watch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- the worker --------------------------------------------------------------------------

    def _poll_spark_bus(self) -> None:
        dropped = spark_streams_events_dropped(self.spark)
        if dropped is None:
            return
        now = time.monotonic()
        if dropped > self.health.spark_listener_bus_dropped and now >= self._bus_drop_log_after:
            # once, then at most every 10 minutes while it keeps dropping: never fill the driver log
            self._bus_drop_log_after = now + 600.0
            log.warning(
                "wmwatch: Spark's listener bus dropped %d streaming event(s) so far (its 'streams' "
                "queue was full): raise spark.scheduler.listenerbus.eventqueue.streams.capacity "
                "or remove slow listeners",
                dropped,
            )
        self.health.spark_listener_bus_dropped = dropped
        self.health.spark_listener_bus_readable = True
        if dropped > 0:
            self._reconcile_with_active_queries()

    def _await_terminations(self, timeout: float) -> None:
        """Let the termination of queries that just stopped reach the history before closing.

        Spark posts a termination to its listener bus after ``stop()`` or ``awaitTermination()``
        return, so a job that closes right after its last query (a backfill) could otherwise
        record that query as still running. Waits at most ``timeout``; a termination that has
        not arrived by then is recorded as lost (without its exception) on the worker thread.
        """
        try:
            active = {str(query.id) for query in self.spark.streams.active}
        except Exception:  # noqa: BLE001 - the session may already be stopped
            return
        deadline = time.monotonic() + timeout
        while (
            self._stopped_unheard(active)
            and time.monotonic() < deadline
            and self._worker.is_alive()
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

    def _reconcile_with_active_queries(self) -> None:
        """Once Spark has dropped events, a lost termination would leave a query "up" forever:
        mark queries that Spark no longer runs as terminated (the exception, if any, is lost)."""
        active = {str(query.id) for query in self.spark.streams.active}
        for state in self._stopped_unheard(active):
            lost = QueryTerminated(state.query_id, state.run_id, None, None, None)
            log.warning(
                "wmwatch: query %s stopped but its termination event was lost; marking it stopped",
                state.label,
            )
            self.book.on_terminated(lost)
            if self.store is not None:
                self.store.record_query_terminated(lost)
            self._tell("on_query_terminated", lost)

    def _stopped_unheard(self, active: set[str]) -> list[QueryState]:
        """Queries the book has as running that Spark (``active`` ids) no longer runs."""
        return [
            state
            for state in self.book.snapshot()
            if state.status == "active" and state.query_id not in active
        ]

    def _run(self) -> None:
        next_bus_poll = 0.0
        while True:
            if time.monotonic() >= next_bus_poll:
                # a few py4j calls: cheap, but not per event
                next_bus_poll = time.monotonic() + SPARK_BUS_POLL_SECONDS
                try:
                    self._poll_spark_bus()
                except Exception:  # noqa: BLE001 - the worker must survive anything
                    self.health.error("spark_bus")
            event = self._events.get(timeout=0.1)
            if event is None:
                if self._stop.is_set():
                    return
                continue
            with self._idle:
                self._in_flight += 1
            started = time.perf_counter()
            try:
                self._handle(event)
                self.health.count(self.health.processed, event.kind)
            except ProgressParseError as exc:
                self.health.error(f"parse:{event.kind}")
                log.warning("wmwatch: ignoring a malformed %s event: %s", event.kind, exc)
            except Exception:  # noqa: BLE001 - the worker must survive anything
                self.health.error(f"handle:{event.kind}")
                log.exception("wmwatch: failed to handle a %s event", event.kind)
            finally:
                self.health.observe_handling(time.perf_counter() - started)
                with self._idle:
                    self._in_flight -= 1
                    self._idle.notify_all()

    def _handle(self, event: RawEvent) -> None:
        if event.kind == "progress":
            snapshot = parse_progress_event(event.payload)
            late_watermark = self.book.on_progress(snapshot)
            if self.store is not None:
                self.store.record_progress(snapshot, late_watermark)
            self._tell("on_progress", snapshot)
        elif event.kind == "started":
            started = parse_started(event.payload)
            self.book.on_started(started)
            if self.store is not None:
                self.store.record_query_started(started)
            self._tell("on_query_started", started)
        elif event.kind == "idle":
            idle = parse_idle(event.payload)
            self.book.on_idle(idle)
            self._tell("on_query_idle", idle)
        elif event.kind == "terminated":
            terminated = parse_terminated(event.payload)
            self.book.on_terminated(terminated)
            if self.store is not None:
                self.store.record_query_terminated(terminated)
            if terminated.failed:
                log.error(
                    "wmwatch: query %s failed: %s",
                    terminated.query_id,
                    (terminated.exception or "").splitlines()[0][:300],
                )
            self._tell("on_query_terminated", terminated)

    def _tell(self, hook: str, event: Any) -> None:
        for plugin in self.plugins():
            try:
                getattr(plugin, hook)(event)
            except Exception:  # noqa: BLE001
                self.health.error(f"plugin:{plugin.name}")
                log.exception("wmwatch: plugin %s failed in %s", plugin.name, hook)


def attach(
    spark: Any,
    db: str | os.PathLike[str] | None = "wmwatch.duckdb",
    metrics_port: int | None = 9108,
    *,
    metrics_addr: str | None = None,
    registry: CollectorRegistry | None = None,
    metrics_certfile: str | None = None,
    metrics_keyfile: str | None = None,
    metrics_basic_auth: tuple[str, str] | None = None,
    strict: bool = False,
    queue_capacity: int = 10_000,
    forget_after_seconds: float = 600.0,
    retention_days: float | None = None,
    db_flush_seconds: float = 2.0,
    listener: str = "auto",
    plugins: Iterable[WatchPlugin] = (),
    inspect_plans: bool = True,
    state_budget_bytes: int | None = None,
    pushgateway: str | None = None,
    push_job: str = "wmwatch",
) -> Watch:
    """Watch every streaming query of ``spark``, including ones already running.

    ``db``: DuckDB history file (None: no history). ``metrics_port``: /metrics port (0 or None:
    no endpoint; read the ``registry`` instead). ``metrics_addr``: bind address, default
    127.0.0.1 or ``$WMWATCH_METRICS_ADDR``; use ``"0.0.0.0"`` for a remote Prometheus.
    ``strict``: raise on setup problems (port in use, unusable db) instead of logging them and
    running without that part. ``forget_after_seconds``: how long a stopped query's series stay.
    ``db_flush_seconds``: how often history is written (the file is opened only then, so
    ``wmwatch report`` can read it in between); where a flush costs more than 0.5% of one core
    over that interval (a slow or busy machine), flushes are spaced out to keep to that share.
    ``retention_days``: delete older history.
    ``pushgateway``: ``host:port`` to push to, for jobs that end before a scrape.

    One watch per session: on a session that already has a live watch, ``attach`` returns it
    (and warns about options that differ from its own); ``close()`` it first to attach anew.
    """
    plugins = tuple(plugins)
    requested: dict[str, Any] = {
        # as the watch resolves them, so "h.duckdb" and "./h.duckdb" are the same option
        "db": str(Path(db).expanduser().absolute()) if db is not None else None,
        "metrics_port": metrics_port or None,
        "metrics_addr": metrics_addr or os.environ.get("WMWATCH_METRICS_ADDR") or DEFAULT_METRICS_ADDR,
        "registry": registry,
        "metrics_certfile": metrics_certfile,
        "metrics_keyfile": metrics_keyfile,
        "metrics_basic_auth": metrics_basic_auth,
        "strict": strict,
        "queue_capacity": queue_capacity,
        "forget_after_seconds": forget_after_seconds,
        "retention_days": retention_days,
        "db_flush_seconds": db_flush_seconds,
        "listener": listener,
        "plugins": plugins,
        "inspect_plans": inspect_plans,
        "state_budget_bytes": state_budget_bytes,
        "pushgateway": pushgateway,
        "push_job": push_job,
    }

    def create() -> Watch:
        return Watch(
            spark,
            db=db,
            metrics_port=metrics_port,
            metrics_addr=metrics_addr,
            registry=registry,
            metrics_certfile=metrics_certfile,
            metrics_keyfile=metrics_keyfile,
            metrics_basic_auth=metrics_basic_auth,
            strict=strict,
            queue_capacity=queue_capacity,
            forget_after_seconds=forget_after_seconds,
            retention_days=retention_days,
            db_flush_seconds=db_flush_seconds,
            listener=listener,
            plugins=plugins,
            inspect_plans=inspect_plans,
            state_budget_bytes=state_budget_bytes,
            pushgateway=pushgateway,
            push_job=push_job,
        )

    # A second watch would add a second listener (every event twice) and fight the first for
    # its port and history file; returning the live one keeps its counters and audits going.
    watch, live_options = _LIVE_WATCHES.get_or_create(spark, requested, create)
    if live_options is not None:
        log.info(
            "wmwatch: this SparkSession already has a live watch (history: %s, metrics: %s); "
            "returning it",
            watch.store.path if watch.store is not None else "none",
            watch.metrics_url or "none",
        )
        ignored = differing_options(live_options, requested)
        if ignored:
            log.warning(
                "wmwatch: attach ignored %s (different from the live watch's): call watch.close() "
                "first to attach with new options",
                ", ".join(ignored),
            )
    return watch


_LIVE_WATCHES: SessionRegistry[Watch] = SessionRegistry()
