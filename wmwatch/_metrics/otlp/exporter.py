"""The OTLP exporter: a thread of its own that sends every wmwatch metric (and, if asked, one
span per batch) to an OpenTelemetry Collector with the official SDK's OTLP exporters.

Every ``interval_seconds`` it reads the same collector /metrics serves, converts the families
through the one name table and exports them. An export that fails or takes longer than
``timeout_seconds`` (a Collector down, slow, refusing the token) is dropped and counted in
``wmwatch_otlp_exports_dropped_total``, never retried later: the next export carries the
current values anyway (sums are cumulative). Spans wait in a bounded buffer; what does not fit,
or was in a dropped export, is counted in ``wmwatch_otlp_spans_dropped_total``. The worker
thread only hands a batch's spans to that buffer, so a slow Collector never delays the watch.

Header values (tokens) are never logged; the endpoint is redacted wherever it is.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.core import Metric as Family

from wmwatch._core.listener import is_classic
from wmwatch._core.plugins import WatchPlugin
from wmwatch._errors import ConfigError
from wmwatch._metrics.otlp.convert import to_metrics_data
from wmwatch._metrics.otlp.spans import BatchSpans
from wmwatch._progress import ProgressSnapshot
from wmwatch._text import clean, error_line, first_line, get_logger, redact

log = get_logger("wmwatch")

PROTOCOLS = ("http/protobuf", "grpc")
SIGNALS = ("metrics", "traces")
# Spans waiting for the next export: about 1 KB each, so the buffer stays under a few MB.
MAX_PENDING_SPANS = 2048
SPANS_PER_EXPORT = 512
# The loggers of the SDK's OTLP exporters. While wmwatch exports, what they log (an ERROR and
# retry WARNINGs per failed export: every interval while a Collector is down) is held back and
# said once per outage in wmwatch's own line; the same exporters used by the application log as
# they always do. wmwatch's redaction goes on them as well.
_SDK_LOGGERS = (
    "opentelemetry.exporter.otlp.common.http",
    "opentelemetry.exporter.otlp.common._aggregation",
    "opentelemetry.exporter.otlp.proto.common._internal",
    "opentelemetry.exporter.otlp.proto.common._internal.metrics_encoder",
    "opentelemetry.exporter.otlp.proto.common._internal.trace_encoder",
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.grpc.metric_exporter",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)


class _OwnExports(logging.Filter):
    """Holds back what the SDK logs on a thread while it runs one of wmwatch's exports, keeping
    the last message (redacted, one line) as the reason of a failure."""

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    @contextlib.contextmanager
    def exporting(self) -> Iterator[list[str]]:
        said: list[str] = []
        self._local.said = said
        try:
            yield said
        finally:
            self._local.said = None

    def filter(self, record: logging.LogRecord) -> bool:
        said = getattr(self._local, "said", None)
        if said is None:
            return True
        said.append(first_line(redact(record.getMessage())) or record.levelname)
        return False


_OWN_EXPORTS = _OwnExports()


def _watch_sdk_loggers() -> None:
    for name in _SDK_LOGGERS:
        logger = get_logger(name)
        if _OWN_EXPORTS not in logger.filters:
            logger.addFilter(_OWN_EXPORTS)


@dataclass(frozen=True)
class OtlpSettings:
    """Where and how to export; :func:`otlp_settings` checks and builds one."""

    endpoint: str
    protocol: str
    headers: Mapping[str, str] = field(default_factory=dict)
    cafile: str | None = None
    certfile: str | None = None
    keyfile: str | None = None
    interval_seconds: float = 10.0
    timeout_seconds: float = 5.0
    traces: bool = False

    @property
    def secure(self) -> bool:
        return urllib.parse.urlsplit(self.endpoint).scheme == "https"

    def signal_url(self, signal: str) -> str:
        """The OTLP/HTTP URL of a signal: the endpoint's path, then ``v1/<signal>``."""
        parts = urllib.parse.urlsplit(self.endpoint)
        path = parts.path.rstrip("/") + f"/v1/{signal}"
        return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))

    @property
    def grpc_target(self) -> str:
        return urllib.parse.urlsplit(self.endpoint).netloc


def otlp_settings(
    endpoint: str,
    *,
    protocol: str = "http/protobuf",
    headers: Mapping[str, str] | None = None,
    cafile: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
    interval_seconds: float = 10.0,
    timeout_seconds: float = 5.0,
    traces: bool = False,
) -> OtlpSettings:
    """Check the OTLP options of ``attach``; a mistake is a :class:`ConfigError` saying which."""
    protocol = {"http": "http/protobuf"}.get(protocol, protocol)
    if protocol not in PROTOCOLS:
        raise ConfigError(
            f"otlp_protocol must be 'http/protobuf' (or 'http') or 'grpc', not {protocol!r}"
        )
    endpoint = (endpoint or "").strip()
    parts = urllib.parse.urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"otlp_endpoint {redact(endpoint)!r} needs a scheme and a host: "
            "'http://collector:4318' (HTTP) or 'http://collector:4317' (gRPC); https:// for TLS"
        )
    if parts.username is not None or parts.password is not None:
        raise ConfigError(
            "put the Collector's credentials in otlp_headers (e.g. {'authorization': "
            "'Bearer ...'}), not in otlp_endpoint"
        )
    if protocol == "grpc" and parts.path.strip("/"):
        raise ConfigError("a gRPC otlp_endpoint has no path: 'https://collector:4317'")
    if (cafile or certfile or keyfile) and parts.scheme != "https":
        raise ConfigError("otlp_cafile, otlp_certfile and otlp_keyfile need an https:// endpoint")
    if bool(certfile) != bool(keyfile):
        raise ConfigError("a TLS client certificate needs both otlp_certfile and otlp_keyfile")
    for option, path in (
        ("otlp_cafile", cafile),
        ("otlp_certfile", certfile),
        ("otlp_keyfile", keyfile),
    ):
        if path:
            _read(option, path)
    if not interval_seconds > 0 or not timeout_seconds > 0:
        raise ConfigError("otlp_interval_seconds and otlp_timeout_seconds must be above 0")
    clean_headers: dict[str, str] = {}
    for name, value in (headers or {}).items():
        if not isinstance(name, str) or not isinstance(value, str) or not name.strip():
            raise ConfigError("otlp_headers must map header names to text values")
        if any(c in name + value for c in "\r\n\0"):
            # never echoed: the value is usually a credential
            raise ConfigError(f"otlp_headers: the value of {name.strip()!r} holds a line break")
        # gRPC metadata keys are lower case; HTTP header names ignore case
        clean_headers[name.strip().lower()] = value
    return OtlpSettings(
        endpoint=endpoint.rstrip("/") if protocol == "grpc" else endpoint,
        protocol=protocol,
        headers=clean_headers,
        cafile=cafile,
        certfile=certfile,
        keyfile=keyfile,
        interval_seconds=float(interval_seconds),
        timeout_seconds=float(timeout_seconds),
        traces=traces,
    )


def spark_resource(
    spark: Any, service_name: str | None, extra: Mapping[str, str] | None
) -> dict[str, str]:
    """The resource attributes: the caller's, then ``spark.app.id`` and ``spark.app.name`` of
    the application (classic: its SparkContext's, which a later ``builder.appName(...)`` in the
    same driver does not change; Spark Connect: the session's), and ``service.name`` (the
    option, else the application's name)."""
    resource = {str(k): str(v) for k, v in (extra or {}).items()}
    application: dict[str, str] = {}
    if is_classic(spark):
        try:
            context = spark.sparkContext
            application = {"spark.app.id": context.applicationId, "spark.app.name": context.appName}
        except Exception:  # noqa: BLE001 - a stopped context: the session's conf, as on Connect
            application = {}
    for key in ("spark.app.id", "spark.app.name"):
        try:
            value = application.get(key) or spark.conf.get(key, None)
        except Exception:  # noqa: BLE001 - a resource attribute less, never a failed attach
            value = None
        if value:
            resource.setdefault(key, clean(str(value), 200))
    name = service_name or resource.get("service.name") or resource.get("spark.app.name")
    resource["service.name"] = name or "wmwatch"
    return resource


def _read(option: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"cannot read {option} {path}: {exc.strerror or error_line(exc)}; check the path"
        ) from None


def _exporters(settings: OtlpSettings) -> tuple[MetricExporter, SpanExporter | None]:
    """The SDK's OTLP exporters for the settings' protocol (imported only now)."""
    timeout = settings.timeout_seconds
    headers = dict(settings.headers)
    if settings.protocol == "grpc":
        import grpc
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcMetricExporter,
        )
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcSpanExporter,
        )

        credentials = None
        if settings.secure:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read("otlp_cafile", settings.cafile)
                if settings.cafile
                else None,
                private_key=_read("otlp_keyfile", settings.keyfile) if settings.keyfile else None,
                certificate_chain=(
                    _read("otlp_certfile", settings.certfile) if settings.certfile else None
                ),
            )
        grpc_args: dict[str, Any] = {
            "endpoint": settings.grpc_target,
            "insecure": not settings.secure,
            "credentials": credentials,
            "headers": headers,
            "timeout": timeout,
        }
        metrics: MetricExporter = GrpcMetricExporter(**grpc_args)
        spans: SpanExporter | None = GrpcSpanExporter(**grpc_args) if settings.traces else None
        return metrics, spans

    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpMetricExporter,
    )
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpSpanExporter,
    )

    http_args: dict[str, Any] = {
        "session": _ca_file_session() if settings.cafile else None,
        "certificate_file": settings.cafile,
        "client_certificate_file": settings.certfile,
        "client_key_file": settings.keyfile,
        "headers": headers,
        "timeout": timeout,
    }
    metrics = HttpMetricExporter(endpoint=settings.signal_url("metrics"), **http_args)
    spans = (
        HttpSpanExporter(endpoint=settings.signal_url("traces"), **http_args)
        if settings.traces
        else None
    )
    return metrics, spans


def _ca_file_session() -> Any:
    """A requests session that keeps the CA file it is given.

    requests lets ``REQUESTS_CA_BUNDLE`` / ``CURL_CA_BUNDLE`` replace a session's ``verify``
    whenever a request sets none (the SDK's exporter sets it on the session only), so on a
    machine that exports either variable ``otlp_cafile`` would silently not be used and the
    Collector's certificate would fail verification.
    """
    import requests

    class CaFileSession(requests.Session):
        def merge_environment_settings(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
            settings: dict[str, Any] = super().merge_environment_settings(*args, **kwargs)
            if isinstance(self.verify, str):
                settings["verify"] = self.verify
            return settings

    return CaFileSession()


def _reason(said: list[str]) -> str:
    """Why an export failed, from what the SDK said during it (its last error line)."""
    return said[-1][:300] if said else "the Collector refused the export or did not answer"


class OtlpPlugin(WatchPlugin):
    """Exports ``collect()`` (the watch's registry) over OTLP every ``interval_seconds``.

    ``resource``: the resource attributes (``service.name``, ``spark.app.id``, ...).
    Metrics ``wmwatch_otlp_exports_total``, ``wmwatch_otlp_exports_dropped_total``,
    ``wmwatch_otlp_spans_dropped_total`` and ``wmwatch_otlp_last_export_timestamp_seconds`` say
    whether exporting works, on /metrics and over OTLP alike.
    """

    name = "otlp"

    def __init__(
        self,
        collect: Callable[[], Iterable[Family]],
        settings: OtlpSettings,
        resource: Mapping[str, str],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        _watch_sdk_loggers()
        self.settings = settings
        self._collect = collect
        self._clock = clock
        self._resource = Resource.create(dict(resource))
        self._scope = InstrumentationScope("wmwatch")
        self._start_ns = int(clock() * 1e9)
        self._metric_exporter, self._span_exporter = _exporters(settings)

        self._lock = threading.Lock()  # the counters and the span buffer
        self._export_lock = threading.Lock()  # one export at a time, whichever thread asks
        self.exports_total = dict.fromkeys(SIGNALS, 0)
        self.dropped_total = dict.fromkeys(SIGNALS, 0)
        self.spans_dropped_total = 0
        self.last_export_wall_seconds: dict[str, float] = {}
        self.last_error: str | None = None
        self._pending: collections.deque[ReadableSpan] = collections.deque()
        self._spans = BatchSpans(self._resource, self._take_span) if settings.traces else None

        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wmwatch-otlp", daemon=True)
        self._thread.start()

    # -- the worker thread: hand spans over, nothing more -----------------------------------

    def on_progress(self, snapshot: ProgressSnapshot) -> None:
        if self._spans is not None:
            self._spans.record(snapshot)

    def _take_span(self, span: ReadableSpan) -> None:
        with self._lock:
            if len(self._pending) >= MAX_PENDING_SPANS:
                self.spans_dropped_total += 1
                return
            self._pending.append(span)

    # -- scrape and export (HTTP thread, exporter thread) -----------------------------------

    def collect(self) -> Iterable[Family]:
        with self._lock:
            exports = dict(self.exports_total)
            dropped = dict(self.dropped_total)
            spans_dropped = self.spans_dropped_total
            last = dict(self.last_export_wall_seconds)
        signals = SIGNALS if self._span_exporter is not None else ("metrics",)
        done = CounterMetricFamily(
            "wmwatch_otlp_exports", "OTLP exports the Collector accepted.", labels=["signal"]
        )
        failed = CounterMetricFamily(
            "wmwatch_otlp_exports_dropped",
            "OTLP exports dropped: the Collector refused them, failed or did not answer in time "
            "(not retried; the next export carries the current values).",
            labels=["signal"],
        )
        when = GaugeMetricFamily(
            "wmwatch_otlp_last_export_timestamp_seconds",
            "When the Collector last accepted an export (Unix seconds).",
            labels=["signal"],
        )
        for signal in signals:
            done.add_metric([signal], exports[signal])
            failed.add_metric([signal], dropped[signal])
            if signal in last:
                when.add_metric([signal], last[signal])
        families: list[Family] = [done, failed, when]
        if self._span_exporter is not None:
            lost = CounterMetricFamily(
                "wmwatch_otlp_spans_dropped",
                "Batch spans never delivered: the buffer was full, or their export was dropped.",
                labels=[],
            )
            lost.add_metric([], spans_dropped)
            families.append(lost)
        return families

    def _run(self) -> None:
        while not self._stop.wait(self.settings.interval_seconds):
            self.export_now()

    def export_now(self) -> bool:
        """Export the current values (and waiting spans) now; True when all were accepted."""
        with self._export_lock:
            ok = self._export_metrics()
            if self._span_exporter is not None:
                ok = self._export_spans() and ok
            return ok

    def _export_metrics(self) -> bool:
        with _OWN_EXPORTS.exporting() as said:
            try:
                data = to_metrics_data(
                    self._collect(),
                    resource=self._resource,
                    scope=self._scope,
                    start_ns=self._start_ns,
                    now_ns=int(self._clock() * 1e9),
                )
                result = self._metric_exporter.export(
                    data, timeout_millis=self.settings.timeout_seconds * 1000
                )
                ok, problem = result is MetricExportResult.SUCCESS, None
            except Exception as exc:  # noqa: BLE001 - a failed export is counted, never raised
                ok, problem = False, error_line(exc)
        self._count("metrics", ok, problem or _reason(said))
        return ok

    def _export_spans(self) -> bool:
        assert self._span_exporter is not None
        while True:
            with self._lock:
                batch = [
                    self._pending.popleft()
                    for _ in range(min(SPANS_PER_EXPORT, len(self._pending)))
                ]
            if not batch:
                return True
            with _OWN_EXPORTS.exporting() as said:
                try:
                    sent, problem = (
                        self._span_exporter.export(batch) is SpanExportResult.SUCCESS,
                        None,
                    )
                except Exception as exc:  # noqa: BLE001 - a failed export is counted, never raised
                    sent, problem = False, error_line(exc)
            self._count("traces", sent, problem or _reason(said))
            if not sent:
                with self._lock:
                    self.spans_dropped_total += len(batch)
                # the rest waits for the next export: one timeout per export, not one per chunk
                return False

    def _count(self, signal: str, ok: bool, problem: str) -> None:
        with self._lock:
            # the first failure after a success (or at start) opens an outage, logged once
            first = self.last_error is None
            if ok:
                self.exports_total[signal] += 1
                self.last_export_wall_seconds[signal] = time.time()
                self.last_error = None
            else:
                self.dropped_total[signal] += 1
                self.last_error = problem
        if ok:
            if not first:
                log.info("wmwatch: OTLP export to %s works again", redact(self.settings.endpoint))
            return
        # Loud once per outage, quiet while it lasts: a Collector that is down fails every export.
        (log.warning if first else log.debug)(
            "wmwatch: OTLP %s export to %s dropped (%s); check that the Collector runs, its "
            "address, TLS files and headers (counted in wmwatch_otlp_exports_dropped_total)",
            signal,
            redact(self.settings.endpoint),
            problem,
        )

    def close(self) -> None:
        """Stop the thread, export once more so the Collector gets the final values, shut down.

        Bounded: an export under way ends within its timeouts (metrics, then one span chunk);
        the last export is skipped when the one before failed, so closing never waits twice on a
        Collector that is down or silent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=self.settings.timeout_seconds * 2 + 1.0)
        with self._lock:
            failing = self.last_error is not None
        if not self._thread.is_alive() and not failing:
            self.export_now()
        for exporter in (self._metric_exporter, self._span_exporter):
            if exporter is not None:
                try:
                    exporter.shutdown()
                except Exception:  # noqa: BLE001 - closing must finish whatever the SDK does
                    log.debug("wmwatch: the OTLP exporter did not shut down cleanly")
        if self._spans is not None:
            self._spans.close()
