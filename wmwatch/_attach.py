"""``attach`` and the ``Watch`` handle: the public surface, and the wiring of a watch's parts.

A watch is a listener feeding a bounded queue, the worker thread that handles each event
(:mod:`wmwatch._core.worker`), the query book, the history store, the metrics collector and
endpoint, and the plugins. Nothing here ever raises into Spark; setup problems (port in use,
unusable db) either raise (``strict=True``) or are logged once at ERROR and leave wmwatch running
degraded, so a monitoring mistake never takes the watched job down. Over 500 lines because the
public surface (``attach``, ``Watch.audit``, ``Watch.audit_checkpoint``) is typed and documented
option by option here, where users and their editors read it.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry

from wmwatch._audit.handle import AuditHandle, SidecarHandle
from wmwatch._audit.jumps.rules import DEFAULT_AHEAD_SECONDS, DEFAULT_JUMP_SECONDS
from wmwatch._audit.options import (
    DEFAULT_JOB_TIMEOUT_SECONDS,
    DEFAULT_MAX_ROW_BYTES,
    DEFAULT_MAX_ROWS_PER_BATCH,
    DEFAULT_POOL,
    AuditOptions,
    Prepare,
)
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
# the same cores, and a flush's fixed cost (20-40 ms of DuckDB's CPU for one batch or fifty)
# grows with a slower machine. Reads, ``flush`` and a backlog are never held back by it.
HISTORY_WRITER_CPU_SHARE = 0.002


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

    def audit(
        self,
        query: Any,
        events: Any,
        *,
        prepare: Prepare | Sequence[Prepare | None] | None = None,
        sink: str = "duckdb",
        parquet_path: str | os.PathLike[str] | None = None,
        columns: Sequence[str] | None = None,
        hash_columns: Sequence[str] = (),
        hash_key: bytes | str | None = None,
        event_time: str | None = None,
        delay: str | float | None = None,
        window: str | float | None = None,
        slide: str | float | None = None,
        kind: str | None = None,
        checkpoint: str | os.PathLike[str] | None = None,
        pool: str = DEFAULT_POOL,
        poll_interval_seconds: float = 1.0,
        max_rows_per_batch: int = DEFAULT_MAX_ROWS_PER_BATCH,
        max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
        job_timeout_seconds: float = DEFAULT_JOB_TIMEOUT_SECONDS,
        watermark_ahead_seconds: float = DEFAULT_AHEAD_SECONDS,
        watermark_jump_seconds: float = DEFAULT_JUMP_SECONDS,
    ) -> AuditHandle:
        """Divert the rows ``query`` drops behind its watermark into the history
        (``late_rows``), batch by batch, each late row once (docs/audit.md).

        Each input's operator, join side, event-time column, delay and window come from the
        query's plan; each batch is replayed through ``events`` as written (its parsing, filters
        and new columns run over the batch's raw rows, on classic PySpark and Spark Connect).
        What cannot be replayed (a non-deterministic expression, a stateful step inside
        ``events``) is refused here with the reason. On Spark Connect a query that has not
        planned a batch yet is read once it has (``status()["plan_known"]``); a plan that
        cannot be audited then ends the audit with the reason in ``status()["last_error"]``.

        :param query: the running ``StreamingQuery`` (what ``writeStream...start()`` returned).
        :param events: the streaming DataFrame the query reads before its stateful operator,
            as written; for a query with several inputs (a join, a union), a list of them, one
            per source, in any order.
        :param prepare: instead of ``events`` as written, the function that turns the raw
            source DataFrame (read as a batch) into the same rows; a list of them (None where
            not needed) for several inputs.
        :param sink: ``"duckdb"`` (the late rows into the history) or ``"parquet"`` (written by
            Spark under ``parquet_path``, the markers still in the history).
        :param parquet_path: the folder for ``sink="parquet"``; with the DuckDB sink, where the
            rows of a batch over ``max_rows_per_batch`` go.
        :param columns: the columns kept in ``row_data`` and a join's ``join_key`` (an
            allow-list; default all).
        :param hash_columns: columns stored as SHA-256 of their value (HMAC-SHA256 with
            ``hash_key``); each must be in ``columns`` when that is given.
        :param hash_key: the HMAC key for ``hash_columns`` (bytes, or a str taken as UTF-8;
            default ``$WMWATCH_HASH_KEY``), so that a dictionary of likely values cannot
            reverse a hash without the key.
        :param event_time: the event-time column, for a query with one audited input (default:
            from the plan).
        :param delay: the watermark delay (``"10 minutes"`` or seconds), for a query with one
            audited input (default: from the plan).
        :param window: the window length (``"5 minutes"`` or seconds), for a query with one
            audited input (default: from the plan).
        :param slide: the window slide (default: from the plan, or ``window``).
        :param kind: the operator's late-row rule (``window``, ``dedupe``, ...) for a query with
            one audited input (default: from the plan).
        :param checkpoint: the query's checkpoint root (default: the one the query runs with).
        :param pool: the FAIR scheduler pool the audit's Spark jobs run in.
        :param poll_interval_seconds: how often the audit looks for new commits.
        :param max_rows_per_batch: late rows of one batch kept in DuckDB at most (the rest are
            counted, and written to ``parquet_path`` when given); 0 counts only.
        :param max_row_bytes: ``row_data`` longer than this is kept as its size and SHA-256
            (at least 64).
        :param job_timeout_seconds: every Spark job of the audit is cancelled after this (and
            retried later).
        :param watermark_ahead_seconds: a batch whose largest event time is this far after the
            batch's own time is recorded in ``watermark_jumps`` with the rows that moved the
            watermark (docs/forensics-watermark.md).
        :param watermark_jump_seconds: a batch whose watermark is this far above the batch
            before's is recorded in ``watermark_jumps`` likewise.
        :returns: the running audit.
        :raises ConfigError: an option is wrong (the message says which and what to do).
        :raises AuditError: the query cannot be audited (the message says why).
        """
        from wmwatch._audit.start import start_audit

        options = AuditOptions(
            prepare=prepare,
            sink=sink,
            parquet_path=parquet_path,
            columns=columns,
            hash_columns=hash_columns,
            hash_key=hash_key,
            event_time=event_time,
            delay=delay,
            window=window,
            slide=slide,
            kind=kind,
            pool=pool,
            poll_interval_seconds=poll_interval_seconds,
            max_rows_per_batch=max_rows_per_batch,
            max_row_bytes=max_row_bytes,
            job_timeout_seconds=job_timeout_seconds,
            watermark_ahead_seconds=watermark_ahead_seconds,
            watermark_jump_seconds=watermark_jump_seconds,
        )
        return start_audit(self, query, events, options, checkpoint)

    def audit_checkpoint(
        self,
        checkpoint: str | os.PathLike[str],
        events: Any,
        query: Any = None,
        *,
        name: str | None = None,
        output_mode: str = "append",
        prepare: Prepare | Sequence[Prepare | None] | None = None,
        sink: str = "duckdb",
        parquet_path: str | os.PathLike[str] | None = None,
        columns: Sequence[str] | None = None,
        hash_columns: Sequence[str] = (),
        hash_key: bytes | str | None = None,
        event_time: str | None = None,
        delay: str | float | None = None,
        window: str | float | None = None,
        slide: str | float | None = None,
        kind: str | None = None,
        pool: str = DEFAULT_POOL,
        poll_interval_seconds: float = 1.0,
        max_rows_per_batch: int = DEFAULT_MAX_ROWS_PER_BATCH,
        max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
        job_timeout_seconds: float = DEFAULT_JOB_TIMEOUT_SECONDS,
    ) -> SidecarHandle:
        """Audit another application's query from its checkpoint (running or stopped): the
        same late rows, markers and metrics as :meth:`audit`, with nothing run in its driver
        (docs/sidecar-audit.md). The checkpoint is only read.

        :param checkpoint: the ``checkpointLocation`` the production query runs with.
        :param events: the streaming DataFrame (a list for several inputs) the production query
            reads, built the same way in this session.
        :param query: the query's DataFrame built on ``events`` (what the production code calls
            ``writeStream`` on, unstarted): its operators set the late-row rules; without it,
            one input's rule comes from ``kind=`` and the other overrides.
        :param name: the query's name for the history and metrics.
        :param output_mode: the production query's output mode (complete mode drops nothing).
        :param prepare: as for :meth:`audit`; so are ``sink``, ``parquet_path``, ``columns``,
            ``hash_columns``, ``hash_key``, ``event_time``, ``delay``, ``window``, ``slide``,
            ``kind``, ``pool``, ``poll_interval_seconds``, ``max_rows_per_batch``,
            ``max_row_bytes`` and ``job_timeout_seconds``.
        :returns: the running audit; ``finish()`` ends it once what is committed is audited.
        :raises ConfigError: an option or the definition is wrong (the message says which).
        :raises AuditError: the checkpoint's query cannot be audited with this definition.
        """
        from wmwatch._audit.sidecar.run import start_sidecar

        options = AuditOptions(
            prepare=prepare,
            sink=sink,
            parquet_path=parquet_path,
            columns=columns,
            hash_columns=hash_columns,
            hash_key=hash_key,
            event_time=event_time,
            delay=delay,
            window=window,
            slide=slide,
            kind=kind,
            pool=pool,
            poll_interval_seconds=poll_interval_seconds,
            max_rows_per_batch=max_rows_per_batch,
            max_row_bytes=max_row_bytes,
            job_timeout_seconds=job_timeout_seconds,
        )
        return start_sidecar(
            self, checkpoint, events, query, options, name=name, output_mode=output_mode
        )

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
    ``wmwatch report`` can read it in between); where a flush costs more than 0.2% of one core
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
