"""The endpoint's connections, bounded: how many are served at once, and for how long each, so
that no peer holds a thread of the watched job's driver for long or makes the serve loop wait.
The rules: docs/architecture.md (The metrics endpoint).
"""

from __future__ import annotations

import contextlib
import io
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler

from prometheus_client.exposition import ThreadingWSGIServer

log = logging.getLogger("wmwatch")

MAX_CONNECTIONS = 32
# Prometheus sends its whole request at once and reads the answer as it comes; a peer that
# needs longer for either is not a scraper worth a thread.
REQUEST_TIMEOUT_SECONDS = 10.0
CONNECTION_DEADLINE_SECONDS = 60.0
# How often the serve loop looks for connections past their deadline, and so the longest
# ``shutdown()`` waits for the loop.
POLL_SECONDS = 0.25


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    opened_at_monotonic: float
    thread: threading.Thread | None = None
    sending_request: bool = True  # until its headers are read, the connection may be closed
    open: bool = True  # False once the endpoint has shut it down


class Connections:
    """The open connections, in the order they came; every method is safe from any thread.

    ``refused_total``, ``evicted_total`` and ``timed_out_total`` count the connections the
    endpoint closed: no place free, made room for a newer one, past a deadline.
    """

    def __init__(
        self,
        limit: int,
        request_timeout_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limit = limit
        self.request_timeout_seconds = request_timeout_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._connections: list[_Connection] = []
        self.refused_total = 0
        self.evicted_total = 0
        self.timed_out_total = 0

    def admit(self, sock: socket.socket) -> _Connection | None:
        """A place for ``sock``, or None when every place is answering a request."""
        with self._lock:
            served = [c for c in self._connections if c.open]
            if len(served) >= self.limit:
                waiting = next((c for c in served if c.sending_request), None)
                if waiting is None or len(self._connections) >= 2 * self.limit:
                    self.refused_total += 1
                    return None
                _shut(waiting)
                self.evicted_total += 1
            connection = _Connection(sock, self._clock())
            self._connections.append(connection)
            return connection

    def wrap(self, connection: _Connection, context: ssl.SSLContext) -> ssl.SSLSocket:
        """Wrap the connection's socket in TLS; under the lock, since wrapping takes the file
        descriptor from the plain socket, which a concurrent shutdown would then miss."""
        with self._lock:
            if not connection.open:
                raise ConnectionAbortedError("closed by the endpoint")
            wrapped = context.wrap_socket(
                connection.sock, server_side=True, do_handshake_on_connect=False
            )
            connection.sock = wrapped
            return wrapped

    def request_read(self, sock: socket.socket) -> None:
        """The request on ``sock`` is in: from now on it is being answered, and keeps its place."""
        with self._lock:
            for connection in self._connections:
                if connection.sock is sock:
                    connection.sending_request = False

    def close_overdue(self) -> None:
        now = self._clock()
        with self._lock:
            for connection in self._connections:
                age_seconds = now - connection.opened_at_monotonic
                if connection.open and (
                    (connection.sending_request and age_seconds > self.request_timeout_seconds)
                    or age_seconds > CONNECTION_DEADLINE_SECONDS
                ):
                    _shut(connection)
                    self.timed_out_total += 1

    def timed_out(self, connection: _Connection) -> None:
        """A read or write took longer than ``request_timeout_seconds``: counted once, even
        when :meth:`close_overdue` finds the connection at the same moment."""
        with self._lock:
            if connection.open:
                connection.open = False
                self.timed_out_total += 1

    def release(self, connection: _Connection) -> None:
        """Forget a connection whose thread is done with it, and close its socket."""
        with self._lock:
            self._connections.remove(connection)
            connection.open = False
            connection.sock.close()

    def close_all(self) -> list[threading.Thread]:
        """Shut every connection down; returns their threads, to be joined."""
        with self._lock:
            for connection in self._connections:
                if connection.open:
                    _shut(connection)
            return [c.thread for c in self._connections if c.thread is not None]

    def closed_totals(self) -> dict[str, int]:
        """Connections the endpoint closed, by reason (the ``reason`` label of its metric)."""
        with self._lock:
            return {
                "refused": self.refused_total,
                "evicted": self.evicted_total,
                "timed_out": self.timed_out_total,
            }

    def count(self) -> int:
        """Connections whose thread has not ended yet."""
        with self._lock:
            return len(self._connections)


def _shut(connection: _Connection) -> None:
    """Called with the lock held. ``shutdown`` wakes the connection's thread from a blocked
    read or write at once; its thread then closes the socket. The plain socket's method, since
    ``SSLSocket.shutdown`` also drops the TLS state the thread may be using."""
    connection.open = False
    with contextlib.suppress(OSError):  # already closed by the peer
        socket.socket.shutdown(connection.sock, socket.SHUT_RDWR)


class _DebugLog(io.TextIOBase):
    """Where wsgiref writes a failed answer's traceback (a peer that stopped reading): the
    driver's log at DEBUG, not its stderr."""

    def write(self, text: str) -> int:
        if text.strip():
            log.debug("wmwatch: metrics endpoint: %s", text.rstrip())
        return len(text)


class QuietHandler(WSGIRequestHandler):
    server: BoundedServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        """Scrapes every few seconds must not fill the driver log."""

    def get_stderr(self) -> Any:
        return _DebugLog()

    def parse_request(self) -> bool:
        parsed = super().parse_request()
        if parsed:
            self.server.connections.request_read(self.request)
        return parsed


class BoundedServer(ThreadingWSGIServer):
    """prometheus-client's threading WSGI server, with :class:`Connections` bounding its
    connections and the TLS handshake on each connection's thread (``tls``)."""

    connections: Connections
    tls: ssl.SSLContext | None = None
    # socketserver's 5 would let a burst of connects fill the kernel's queue, and a scrape
    # behind it would wait for SYN retries (a second or more); the queue costs no thread.
    request_queue_size = 128

    def server_activate(self) -> None:
        super().server_activate()
        # Accept only when a peer is waiting, and never wait in accept(): a peer that resets
        # between the poll and the accept must not hold the serve loop.
        self.socket.setblocking(False)

    def process_request(self, request: Any, client_address: Any) -> None:
        connection = self.connections.admit(request)
        if connection is None:
            self.shutdown_request(request)
            return
        thread = threading.Thread(
            target=self._serve_connection,
            args=(connection, client_address),
            name="wmwatch-metrics-connection",
            daemon=True,
        )
        connection.thread = thread
        try:
            thread.start()
        except RuntimeError:  # no thread to be had: the peer goes without an answer
            self.connections.release(connection)

    def _serve_connection(self, connection: _Connection, client_address: Any) -> None:
        try:
            connection.sock.settimeout(self.connections.request_timeout_seconds)
            if self.tls is not None:
                self.connections.wrap(connection, self.tls).do_handshake()
            self.finish_request(connection.sock, client_address)
        except TimeoutError:
            self.connections.timed_out(connection)
        except Exception as exc:  # noqa: BLE001 - a peer's failure ends its connection only
            log.debug("wmwatch: metrics connection from %s ended: %r", client_address, exc)
        finally:
            self.connections.release(connection)

    def service_actions(self) -> None:
        self.connections.close_overdue()
