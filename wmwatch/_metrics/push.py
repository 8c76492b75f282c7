"""Pushgateway mode: pushes the watch's metrics for jobs that may end before Prometheus scrapes.

A ``Trigger.AvailableNow`` backfill can start, run its batches and stop between two scrapes;
its watermark and late-row counts would never reach Prometheus. :class:`PushPlugin` pushes the
whole registry (PUT, so the group always holds one consistent snapshot) after batches, at most
once per ``min_interval_seconds``, right away when a query terminates, and a last time on
``close``. Pushing runs on a thread of its own: the worker thread only flags that there is
something new, so a slow or unreachable gateway never delays event handling.

A gateway behind basic auth or TLS (a private CA, a client certificate) gets a handler from
:func:`gateway_handler`; the gateway's address is redacted wherever it is logged.
"""

from __future__ import annotations

import base64
import functools
import logging
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import basic_auth_handler, default_handler, push_to_gateway

from wmwatch._core.plugins import WatchPlugin
from wmwatch._errors import ConfigError
from wmwatch._events import QueryStarted, QueryTerminated
from wmwatch._progress import ProgressSnapshot
from wmwatch._text import error_line, redact

log = logging.getLogger("wmwatch")

# What push_to_gateway calls: (url, method, timeout, headers, data) -> a function that sends.
Handler = Callable[..., Callable[[], None]]


def gateway_handler(
    *,
    basic_auth: tuple[str, str] | None = None,
    cafile: str | None = None,
    certfile: str | None = None,
    keyfile: str | None = None,
) -> Handler:
    """The handler ``push_to_gateway`` sends with: basic auth and/or TLS, as for the endpoint.

    ``cafile`` verifies the gateway's certificate (default: the system's CAs); ``certfile`` and
    ``keyfile`` are a client certificate. The files are read now, so a wrong path is a
    :class:`ConfigError` at attach rather than a failed push later.
    """
    if basic_auth is not None and (len(basic_auth) != 2 or not all(basic_auth)):
        raise ConfigError("push_basic_auth needs a non-empty (user, password)")
    if bool(certfile) != bool(keyfile):
        raise ConfigError("TLS client auth needs both push_certfile and push_keyfile")
    if not cafile and not certfile:
        if basic_auth is None:
            return default_handler
        user, password = basic_auth
        return functools.partial(basic_auth_handler, username=user, password=password)
    context = _client_context(cafile, certfile, keyfile)
    # prometheus-client's tls_auth_handler needs a client certificate and cannot add basic
    # auth: this sends as it does, through urllib, with the context made above.
    auth = [] if basic_auth is None else [("Authorization", _basic_credentials(*basic_auth))]

    def tls_handler(
        url: str, method: str, timeout: float | None, headers: list[tuple[str, str]], data: bytes
    ) -> Callable[[], None]:
        def send() -> None:
            request = urllib.request.Request(
                url, data=data, method=method, headers=dict([*headers, *auth])
            )
            opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=context))
            # an answer of 400 or more raises HTTPError, which the push counts as failed
            with opener.open(request, timeout=timeout):
                pass

        return send

    return tls_handler


def _client_context(
    cafile: str | None, certfile: str | None, keyfile: str | None
) -> ssl.SSLContext:
    try:
        # verifies the certificate chain and the host name, as Prometheus itself would
        context = ssl.create_default_context(cafile=cafile or None)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if certfile and keyfile:
            context.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as exc:
        files = ", ".join(str(f) for f in (cafile, certfile, keyfile) if f)
        raise ConfigError(
            f"cannot load the Pushgateway TLS files ({files}): {error_line(exc)}; "
            "check push_cafile, push_certfile and push_keyfile"
        ) from None
    return context


def _basic_credentials(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _gateway_url(gateway: str, tls: bool) -> str:
    """``gateway`` as a URL; https:// when TLS options were given and no scheme was."""
    gateway = gateway.strip()
    scheme = urllib.parse.urlsplit(gateway).scheme.lower()
    has_scheme = scheme in ("http", "https")
    # urllib would take "user:password@host" for a host and a port, and put the password in
    # its error message
    if urllib.parse.urlsplit(gateway if has_scheme else f"//{gateway}").username is not None:
        raise ConfigError(
            "put the Pushgateway's credentials in push_basic_auth=(user, password), not in its URL"
        )
    if tls and scheme == "http":
        raise ConfigError(
            "push_cafile, push_certfile and push_keyfile need an https:// Pushgateway address"
        )
    if tls and not has_scheme:
        return f"https://{gateway}"
    return gateway


class _HasRegistry(Protocol):
    registry: CollectorRegistry


class PushPlugin(WatchPlugin):
    """Pushes ``registry`` (or ``watch.registry``) to the Pushgateway at ``gateway``.

    ``gateway``: ``host:port`` or a URL. ``job``: the Pushgateway job; with ``grouping_key``
    it names the group that each push replaces, so concurrent jobs need distinct keys.
    ``basic_auth``, ``cafile``, ``certfile``, ``keyfile``: see :func:`gateway_handler` (or
    pass your own ``handler``).
    Metrics ``wmwatch_pushes_total``, ``wmwatch_push_errors_total`` and
    ``wmwatch_last_push_timestamp_seconds`` say whether pushing works.
    """

    name = "pushgateway"

    def __init__(
        self,
        watch: _HasRegistry | CollectorRegistry,
        gateway: str,
        *,
        job: str = "wmwatch",
        grouping_key: Mapping[str, str] | None = None,
        min_interval_seconds: float = 10.0,
        timeout_seconds: float = 5.0,
        basic_auth: tuple[str, str] | None = None,
        cafile: str | None = None,
        certfile: str | None = None,
        keyfile: str | None = None,
        handler: Handler | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not gateway or not gateway.strip():
            raise ConfigError("pushgateway needs an address: pass pushgateway='host:port'.")
        secured = basic_auth is not None or bool(cafile or certfile or keyfile)
        if handler is not None and secured:
            raise ConfigError("pass either a push handler or basic auth/TLS options, not both")
        if not job or "/" in job:
            raise ConfigError(
                "push_job must be a non-empty name without '/', e.g. 'nightly-backfill'."
            )
        if min_interval_seconds < 0 or timeout_seconds <= 0:
            raise ConfigError(
                "min_interval_seconds must be >= 0 and timeout_seconds > 0 for the Pushgateway."
            )
        self._registry = watch if isinstance(watch, CollectorRegistry) else watch.registry
        self.gateway = _gateway_url(gateway, tls=bool(cafile or certfile or keyfile))
        self.job = job
        self.grouping_key = dict(grouping_key or {})
        self.min_interval_seconds = min_interval_seconds
        self.timeout_seconds = timeout_seconds
        self._handler = handler or gateway_handler(
            basic_auth=basic_auth, cafile=cafile, certfile=certfile, keyfile=keyfile
        )
        self._clock = clock

        self._lock = threading.Condition()
        self._dirty = False
        self._urgent = False
        self._closing = False
        self._last_push_monotonic: float | None = None
        self.pushes_total = 0
        self.push_errors_total = 0
        self.last_push_wall_seconds: float | None = None
        self.last_error: str | None = None
        self._thread = threading.Thread(target=self._run, name="wmwatch-push", daemon=True)
        self._thread.start()

    # -- hooks (worker thread): only flag, never push here -----------------------------------

    def on_query_started(self, event: QueryStarted) -> None:
        self._request(urgent=False)

    def on_progress(self, snapshot: ProgressSnapshot) -> None:
        self._request(urgent=False)

    def on_query_terminated(self, event: QueryTerminated) -> None:
        # The job may exit right after its query stops: this push may be the last one.
        self._request(urgent=True)

    def _request(self, *, urgent: bool) -> None:
        with self._lock:
            self._dirty = True
            self._urgent = self._urgent or urgent
            self._lock.notify_all()

    # -- scrape (HTTP thread) ----------------------------------------------------------------

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            pushes, errors, last = (
                self.pushes_total,
                self.push_errors_total,
                self.last_push_wall_seconds,
            )
        pushed = CounterMetricFamily(
            "wmwatch_pushes", "Successful pushes to the Pushgateway.", labels=[]
        )
        pushed.add_metric([], pushes)
        failed = CounterMetricFamily(
            "wmwatch_push_errors",
            "Failed pushes to the Pushgateway (retried with the next one).",
            labels=[],
        )
        failed.add_metric([], errors)
        metrics: list[Metric] = [pushed, failed]
        if last is not None:
            when = GaugeMetricFamily(
                "wmwatch_last_push_timestamp_seconds",
                "When the last push succeeded (Unix seconds).",
                labels=[],
            )
            when.add_metric([], last)
            metrics.append(when)
        return metrics

    # -- the pushing thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._ready():
                    if self._closing:
                        return
                    self._lock.wait(timeout=self._wait_seconds())
                self._dirty = False
                self._urgent = False
            self._push()

    def _ready(self) -> bool:
        """Called with the lock held."""
        if not self._dirty:
            return False
        if self._urgent or self._last_push_monotonic is None:
            return True
        return self._clock() - self._last_push_monotonic >= self.min_interval_seconds

    def _wait_seconds(self) -> float | None:
        if not self._dirty or self._last_push_monotonic is None:
            return None if not self._closing else 0.05
        remaining = self.min_interval_seconds - (self._clock() - self._last_push_monotonic)
        return max(0.01, remaining)

    def _push(self) -> bool:
        started = self._clock()
        try:
            push_to_gateway(
                self.gateway,
                job=self.job,
                registry=self._registry,
                grouping_key=self.grouping_key or None,
                timeout=self.timeout_seconds,
                handler=self._handler,
            )
        except Exception as exc:  # noqa: BLE001 - an unreachable gateway must not stop the watch
            with self._lock:
                self.push_errors_total += 1
                first = self.push_errors_total == 1
                self.last_error = error_line(exc)
                self._last_push_monotonic = started
            # Log the first failure loudly, later ones quietly: a down gateway fails every push.
            (log.warning if first else log.debug)(
                "wmwatch: push to Pushgateway %s failed (%s); check the address, its credentials "
                "and that it runs",
                redact(self.gateway),
                error_line(exc),
            )
            return False
        with self._lock:
            self.pushes_total += 1
            self.last_push_wall_seconds = time.time()
            self._last_push_monotonic = started
        return True

    def push_now(self) -> bool:
        """Push synchronously from the calling thread; True when the gateway accepted it."""
        with self._lock:
            self._dirty = False
            self._urgent = False
        return self._push()

    def close(self) -> None:
        """Stop the thread, then push once more so the gateway keeps the final values."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._dirty = False
            self._lock.notify_all()
        self._thread.join(timeout=self.timeout_seconds + 1.0)
        self._push()
