"""The /metrics HTTP endpoint: bind address, TLS and basic auth around prometheus-client's WSGI app.

The default address is 127.0.0.1: the endpoint then answers only on the driver host until the
operator opens it deliberately (``metrics_addr="0.0.0.0"`` or ``WMWATCH_METRICS_ADDR``), which is
what a Kubernetes or remote Prometheus scrape needs. How many connections are served at once,
and for how long, is bounded in :mod:`wmwatch._metrics.connections`.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import hmac
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from wmwatch._errors import ConfigError, MetricsServerError
from wmwatch._metrics.connections import (
    MAX_CONNECTIONS,
    POLL_SECONDS,
    REQUEST_TIMEOUT_SECONDS,
    BoundedServer,
    Connections,
    QuietHandler,
)

# close() returns within this, whatever the peers do: the serve loop stops within one poll,
# and every connection's thread is woken by its socket's shutdown.
CLOSE_TIMEOUT_SECONDS = 5.0


def _basic_auth(app: Callable[..., Any], user: str, password: str) -> Callable[..., Any]:
    expected = hashlib.sha256(b"Basic " + base64.b64encode(f"{user}:{password}".encode())).digest()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        given = environ.get("HTTP_AUTHORIZATION", "").encode()
        if not hmac.compare_digest(hashlib.sha256(given).digest(), expected):
            start_response(
                "401 Unauthorized",
                [("WWW-Authenticate", 'Basic realm="wmwatch"'), ("Content-Type", "text/plain")],
            )
            return [b"authentication required\n"]
        result: Iterable[bytes] = app(environ, start_response)
        return result

    return guarded


@dataclass
class MetricsServer:
    """A running endpoint; ``url`` is what Prometheus should scrape."""

    httpd: BoundedServer
    thread: threading.Thread
    url: str

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def connections(self) -> Connections:
        return self.httpd.connections

    def close(self, timeout_seconds: float = CLOSE_TIMEOUT_SECONDS) -> None:
        """Stop serving and close every connection, in at most about ``timeout_seconds``."""
        deadline = time.monotonic() + timeout_seconds
        self.httpd.shutdown()  # the serve loop never waits for a peer: back within one poll
        self.httpd.server_close()
        for thread in [self.thread, *self.httpd.connections.close_all()]:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))


def serve_metrics(
    registry: CollectorRegistry,
    *,
    port: int,
    addr: str = "127.0.0.1",
    certfile: str | None = None,
    keyfile: str | None = None,
    basic_auth: tuple[str, str] | None = None,
    max_connections: int = MAX_CONNECTIONS,
    request_timeout_seconds: float = REQUEST_TIMEOUT_SECONDS,
) -> MetricsServer:
    """Serve ``registry`` on ``addr:port`` in a daemon thread (``port=0`` picks a free port).

    At most ``max_connections`` are served at once; a connection has ``request_timeout_seconds``
    to complete its TLS handshake and send its request (see :mod:`wmwatch._metrics.connections`).
    """
    if not 0 <= port <= 65535:
        raise ConfigError(
            f"metrics_port {port} is not a TCP port: use 1-65535, or 0/None for no endpoint"
        )
    if bool(certfile) != bool(keyfile):
        raise ConfigError("TLS needs both metrics_certfile and metrics_keyfile")
    app: Callable[..., Any] = make_wsgi_app(registry)
    if basic_auth is not None:
        user, password = basic_auth
        if not user or not password:
            raise ConfigError("metrics_basic_auth needs a non-empty (user, password)")
        app = _basic_auth(app, user, password)

    if max_connections < 1 or request_timeout_seconds <= 0:
        raise ConfigError("the endpoint needs max_connections >= 1 and request_timeout_seconds > 0")

    class _Server(BoundedServer):
        address_family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        # A closed endpoint's port stays in TIME_WAIT for a minute after a scrape: without
        # SO_REUSEADDR, close() then attach() on the same port would fail. On POSIX the flag never
        # lets a second server listen on a port in use, so that is still refused.
        allow_reuse_address = os.name == "posix"

    try:
        httpd = make_server(addr, port, app, _Server, handler_class=QuietHandler)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise MetricsServerError(
                f"port {port} on {addr} is already in use: pick another metrics_port, "
                "or pass metrics_port=0 to run without an HTTP endpoint"
            ) from None
        raise MetricsServerError(
            f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}"
        ) from None
    httpd.connections = Connections(max_connections, request_timeout_seconds)
    scheme = "http"
    if certfile and keyfile:
        try:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(certfile, keyfile)
        except (OSError, ssl.SSLError) as exc:
            httpd.server_close()
            raise MetricsServerError(
                f"cannot load TLS certificate {certfile} / key {keyfile}: {exc}"
            ) from None
        # Each connection's thread does its own handshake (BoundedServer): a handshake in
        # accept() would let one silent peer stop every scrape.
        httpd.tls = context
        scheme = "https"
    thread = threading.Thread(
        target=httpd.serve_forever,
        kwargs={"poll_interval": POLL_SECONDS},
        name="wmwatch-metrics",
        daemon=True,
    )
    thread.start()
    host = addr if ":" not in addr else f"[{addr}]"
    bound_port = int(httpd.server_address[1])
    return MetricsServer(httpd, thread, f"{scheme}://{host}:{bound_port}/metrics")
