"""``attach`` and the ``Watch`` handle: the public surface, and the wiring of a watch's parts.

A watch is a listener feeding a bounded queue, the worker thread that handles each event
(:mod:`wmwatch._core.worker`), the query book, the history store, the metrics collector and
endpoint, and the plugins. Nothing here ever raises into Spark; setup problems (port in use,
unusable db) either raise (``strict=True``) or are logged once at ERROR and leave wmwatch running
degraded, so a monitoring mistake never takes the watched job down.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from wmwatch._core.health import Health
from wmwatch._core.listener import EventQueue, ListenerRegistration, seed_active_queries
from wmwatch._core.options import DEFAULT_RETENTION_DAYS, WatchOptions
from wmwatch._core.plugins import WatchContext, WatchPlugin
from wmwatch._core.sessions import SessionRegistry, differing_options
from wmwatch._core.state import QueryBook, QueryState
from wmwatch._core.worker import Worker
from wmwatch._errors import ConfigError, WmwatchError
from wmwatch._metrics.collector import WatchCollector
from wmwatch._metrics.connections import Connections
from wmwatch._metrics.exporter import MetricsServer, serve_metrics
from wmwatch._progress import ProgressSnapshot
from wmwatch._text import get_logger

if TYPE_CHECKING:  # duckdb loads only with a history store
    from wmwatch._store.writer import HistoryStore

log = get_logger("wmwatch")

# The history writer's timed flushes may use this share of one core: the watched job runs on
# the same cores, and a flush's fixed cost grows with a slower machine.
HISTORY_WRITER_CPU_SHARE = 0.005


class Watch:
    """A running wmwatch on one SparkSession; use it as a context manager or call ``close``."""

    # -- setup -------------------------------------------------------------------------------

    def __init__(self, spark: Any, options: WatchOptions) -> None:
        """Start a watch on ``spark``; ``wmwatch.attach`` is the way in (one watch per session)."""
        if options.queue_capacity < 1:
            raise ConfigError("queue_capacity must be at least 1")
        if options.db is not None:
            from wmwatch._store.schema import days_to_keep

            days_to_keep(options.retention_days)  # a wrong value raises, strict or not
        self.spark = spark
        self.health = Health()
        self.book = QueryBook(forget_after_seconds=options.forget_after_seconds)
        registry = options.registry
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=False)
        self.problems: list[str] = []
        self._strict = options.strict
        self._plugins: list[WatchPlugin] = []
        self._plugins_lock = threading.Lock()
        self._events = EventQueue(options.queue_capacity, self.health)
        self._closed = False
        self.metrics_server: MetricsServer | None = None
        self._collector: WatchCollector | None = None

        self.store: HistoryStore | None = None
        if options.db is not None:
            self.store = self._open_store(
                options.db, options.retention_days, options.db_flush_seconds
            )
        store = self.store

        self._collector = WatchCollector(
            self.book,
            self.health,
            queue_size=self._events.size,
            queue_capacity=options.queue_capacity,
            store_health=(lambda: store.health) if store is not None else None,
            plugins=self.plugins,
            endpoint_connections=self._endpoint_connections,
        )
        self.registry.register(self._collector)

        if options.metrics_port:
            try:
                self.metrics_server = serve_metrics(
                    self.registry,
                    port=options.metrics_port,
                    addr=options.bind_addr,
                    certfile=options.metrics_certfile,
                    keyfile=options.metrics_keyfile,
                    basic_auth=options.metrics_basic_auth,
                )
                self.health.metrics_server_up = True
            except WmwatchError as exc:
                self._problem(exc)

        try:
            default_plugins = self._default_plugins(options)
        except BaseException:
            # a misconfigured plugin must not keep the port or the history file from a retry
            self._teardown_partial()
            raise
        for plugin in default_plugins:
            self.add_plugin(plugin)
        for plugin in options.plugins:
            self.add_plugin(plugin)

        self._worker = Worker(spark, self._events, self.book, self.health, store, self.plugins)
        self._worker.start()
        try:
            # Live events wait until the batches Spark still holds for running queries are
            # queued: history goes in batch order, and a batch seen twice counts once.
            with self._events.live_events_held() as offer_first:
                self._registration = ListenerRegistration(
                    spark, self._events, self.health, mode=options.listener
                )
                seed_active_queries(
                    spark, offer_first, self.health, room=options.queue_capacity // 2
                )
        except BaseException:
            # nothing half-made may keep the port or the history file from the next attach
            self._worker.stop()
            for plugin in self.plugins():
                with contextlib.suppress(Exception):
                    plugin.close()
            self._teardown_partial()
            raise

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
        if self.metrics_server is not None:
            with contextlib.suppress(Exception):
                self.metrics_server.close()
        if self._collector is not None:
            # a caller's registry must take this watch's successor without a duplicate error
            with contextlib.suppress(KeyError):
                self.registry.unregister(self._collector)

    def _open_store(
        self, db: str | os.PathLike[str], retention_days: float | None, db_flush_seconds: float
    ) -> HistoryStore | None:
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
        log.info("wmwatch: history in %s %s", store.path, _keeping(store.retention_days))
        history = store.history_at_open
        if history:
            summary = ", ".join(
                f"{h.query_name or h.query_id}: {h.batches} batches (last #{h.last_batch_id})"
                for h in history[:5]
            )
            how = "recovered after an unclean stop" if store.recovered_after_crash else "opened"
            log.info("wmwatch: history %s %s with %s", db, how, summary)
        store.start()
        return store

    def _default_plugins(self, options: WatchOptions) -> list[WatchPlugin]:
        context: WatchContext = self  # what the plugins may use of this watch
        plugins: list[WatchPlugin] = []
        if options.inspect_plans:
            from wmwatch._inspect.plugin import PlanPlugin

            plugins.append(
                PlanPlugin(
                    context,
                    state_budget_bytes=options.state_budget_bytes,
                    forget_after_seconds=options.forget_after_seconds,
                )
            )
        if options.pushgateway:
            from wmwatch._metrics.push import PushPlugin

            plugins.append(
                PushPlugin(
                    self,
                    options.pushgateway,
                    job=options.push_job,
                    basic_auth=options.push_basic_auth,
                    cafile=options.push_cafile,
                    certfile=options.push_certfile,
                    keyfile=options.push_keyfile,
                )
            )
        if options.otlp_endpoint:
            plugins.append(self._otlp_plugin(options))
        return plugins

    def _otlp_plugin(self, options: WatchOptions) -> WatchPlugin:
        try:
            from wmwatch._metrics.otlp.exporter import OtlpPlugin, otlp_settings, spark_resource
        except ImportError as exc:
            raise ConfigError(
                f"otlp_endpoint needs the OpenTelemetry SDK ({exc.name or exc} is missing): "
                "pip install 'wmwatch[otel]'"
            ) from None
        settings = otlp_settings(
            options.otlp_endpoint or "",
            protocol=options.otlp_protocol,
            headers=options.otlp_headers,
            cafile=options.otlp_cafile,
            certfile=options.otlp_certfile,
            keyfile=options.otlp_keyfile,
            interval_seconds=options.otlp_interval_seconds,
            timeout_seconds=options.otlp_timeout_seconds,
            traces=options.otlp_traces,
        )
        resource = spark_resource(
            self.spark, options.otlp_service_name, options.otlp_resource_attributes
        )
        return OtlpPlugin(self.registry.collect, settings, resource)

    def _endpoint_connections(self) -> Connections | None:
        server = self.metrics_server
        return server.connections if server is not None else None

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

        ``events``: the streaming DataFrame the query reads before its stateful operator, as
        written (a list of them for a query with several inputs). Returns an ``AuditHandle``.
        The options (``sink``, ``parquet_path``, ``columns``, ``hash_columns``, bounds, ...) are
        described in docs/audit.md and in ``wmwatch._audit.start_audit``.
        """
        from wmwatch._audit import start_audit

        return start_audit(self, query, events, **options)

    def audit_checkpoint(
        self, checkpoint: str | os.PathLike[str], events: Any, query: Any = None, **options: Any
    ) -> Any:
        """Audit another application's query from its checkpoint (running or stopped): the
        same late rows, markers and metrics as :meth:`audit`, with nothing run in its driver.

        See :func:`wmwatch._audit.sidecar.run.start_sidecar` for the options.
        """
        from wmwatch._audit.sidecar.run import start_sidecar

        return start_sidecar(self, checkpoint, events, query, **options)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every event received so far is handled and written; True if it was."""
        deadline = time.monotonic() + timeout
        if not self._worker.wait_idle(timeout):
            return False
        if self.store is not None:
            return self.store.flush(timeout=max(0.1, deadline - time.monotonic()))
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Stop listening, handle what is queued, flush the history and stop the endpoint."""
        if self._closed:
            return
        self._closed = True
        try:
            self._worker.await_terminations(min(timeout, 5.0))
            self._registration.remove()
            self.flush(timeout=timeout)
            self._worker.stop()
            self._worker.join(timeout=timeout)
            for plugin in self.plugins():
                try:
                    plugin.close()
                except Exception:
                    log.exception("wmwatch: plugin %s failed to close", plugin.name)
            if self.store is not None:
                self.store.close()
            if self.metrics_server is not None:
                self.metrics_server.close()
                self.health.metrics_server_up = False
            if self._collector is not None:
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


def _keeping(retention_days: float | None) -> str:
    """What the history keeps, for the attach log line."""
    if retention_days is None:
        return "keeps everything (retention_days=None)"
    return (
        f"keeps {retention_days:g} days (retention_days={retention_days:g}; None keeps everything)"
    )


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
    retention_days: float | None = DEFAULT_RETENTION_DAYS,
    db_flush_seconds: float = 2.0,
    listener: str = "auto",
    plugins: Iterable[WatchPlugin] = (),
    inspect_plans: bool = True,
    state_budget_bytes: int | None = None,
    pushgateway: str | None = None,
    push_job: str = "wmwatch",
    push_basic_auth: tuple[str, str] | None = None,
    push_cafile: str | None = None,
    push_certfile: str | None = None,
    push_keyfile: str | None = None,
    otlp_endpoint: str | None = None,
    otlp_protocol: str = "http/protobuf",
    otlp_headers: Mapping[str, str] | None = None,
    otlp_cafile: str | None = None,
    otlp_certfile: str | None = None,
    otlp_keyfile: str | None = None,
    otlp_interval_seconds: float = 10.0,
    otlp_timeout_seconds: float = 5.0,
    otlp_service_name: str | None = None,
    otlp_resource_attributes: Mapping[str, str] | None = None,
    otlp_traces: bool = False,
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
    ``retention_days``: days of history to keep (default 30; older rows are deleted every
    10 minutes); ``None`` keeps everything.
    ``pushgateway``: ``host:port`` to push to, for jobs that end before a scrape.
    ``push_basic_auth``: ``(user, password)`` for the Pushgateway; ``push_cafile``: the CA that
    signed its certificate (https; default the system's CAs); ``push_certfile`` and
    ``push_keyfile``: a client certificate.
    ``otlp_endpoint``: an OpenTelemetry Collector (``http://host:4318``, or ``https://`` for
    TLS) to push every metric to over OTLP, beside or instead of /metrics (``pip install
    'wmwatch[otel]'``). ``otlp_protocol``: ``"http/protobuf"`` (default) or ``"grpc"``
    (``host:4317``). ``otlp_headers``: sent with every export, e.g. ``{"authorization":
    "Bearer ..."}`` (never logged). ``otlp_cafile``, ``otlp_certfile``, ``otlp_keyfile``: the CA
    of the Collector's certificate, a client certificate. ``otlp_interval_seconds`` (10) and
    ``otlp_timeout_seconds`` (5): how often to export, how long one export may take before it
    is dropped and counted. ``otlp_service_name`` (default: the Spark application's name) and
    ``otlp_resource_attributes``: the resource; ``spark.app.id`` and ``spark.app.name`` are
    added. ``otlp_traces``: one span per micro-batch, its phases as child spans.

    One watch per session: on a session that already has a live watch, ``attach`` returns it
    (and warns about options that differ from its own); ``close()`` it first to attach anew.
    """
    options = WatchOptions(
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
        push_basic_auth=push_basic_auth,
        push_cafile=push_cafile,
        push_certfile=push_certfile,
        push_keyfile=push_keyfile,
        otlp_endpoint=otlp_endpoint,
        otlp_protocol=otlp_protocol,
        otlp_headers=otlp_headers,
        otlp_cafile=otlp_cafile,
        otlp_certfile=otlp_certfile,
        otlp_keyfile=otlp_keyfile,
        otlp_interval_seconds=otlp_interval_seconds,
        otlp_timeout_seconds=otlp_timeout_seconds,
        otlp_service_name=otlp_service_name,
        otlp_resource_attributes=otlp_resource_attributes,
        otlp_traces=otlp_traces,
    )
    requested = options.as_requested()

    def create() -> Watch:
        return Watch(spark, options)

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
