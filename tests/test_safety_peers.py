"""The /metrics endpoint against peers that misbehave, over real loopback sockets and real TLS
clients: silent TLS peers, half-sent requests, a flood of connections, a stuck answer. A scrape
must still answer, threads stay bounded, and close() returns in bounded time."""

from __future__ import annotations

import socket
import ssl
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric

from tests.harness.net import scrape, self_signed_cert
from wmwatch._core.health import Health
from wmwatch._core.state import QueryBook
from wmwatch._metrics.collector import WatchCollector
from wmwatch._metrics.connections import MAX_CONNECTIONS
from wmwatch._metrics.exporter import CLOSE_TIMEOUT_SECONDS, MetricsServer, serve_metrics

HALF_A_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow"


@pytest.fixture
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Gauge("wmwatch_test_value", "A value.", registry=reg).set(42)
    return reg


def connect(server: MetricsServer) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    return sock


def closed_by_server(sock: socket.socket, timeout_seconds: float = 5.0) -> bool:
    """True when the server closes ``sock`` within ``timeout_seconds`` (EOF or reset)."""
    sock.settimeout(timeout_seconds)
    try:
        return sock.recv(1024) == b""
    except (ConnectionResetError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def close_within(server: MetricsServer, bound_seconds: float) -> float:
    """Close ``server`` on another thread; the test fails (instead of hanging) past the bound."""
    started = time.monotonic()
    closer = threading.Thread(target=server.close, daemon=True)
    closer.start()
    closer.join(timeout=bound_seconds)
    assert not closer.is_alive(), f"close() still running after {bound_seconds}s"
    return time.monotonic() - started


def connection_threads() -> int:
    return sum(1 for t in threading.enumerate() if t.name == "wmwatch-metrics-connection")


def test_silent_tls_peers_neither_stop_scrapes_nor_hang_close(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    cert, key = self_signed_cert(tmp_path)
    server = serve_metrics(registry, port=0, certfile=str(cert), keyfile=str(key))
    client_context = ssl.create_default_context(cafile=str(cert))
    with ExitStack() as peers:
        # a TLS client that connects and never starts its handshake
        silent = peers.enter_context(
            client_context.wrap_socket(
                socket.create_connection(("127.0.0.1", server.port), timeout=5),
                server_hostname="127.0.0.1",
                do_handshake_on_connect=False,
            )
        )
        # a TLS client that completes its handshake and never sends a request
        idle = peers.enter_context(
            client_context.wrap_socket(
                socket.create_connection(("127.0.0.1", server.port), timeout=5),
                server_hostname="127.0.0.1",
            )
        )
        for _ in range(3):
            body = urllib.request.urlopen(server.url, timeout=5, context=client_context).read()
            assert b"wmwatch_test_value 42.0" in body
        took_seconds = close_within(server, CLOSE_TIMEOUT_SECONDS + 5)
        assert took_seconds < CLOSE_TIMEOUT_SECONDS
        # both peers are still connected on their side: the endpoint closed them
        assert closed_by_server(silent) and closed_by_server(idle)
    assert server.connections.count() == 0


def test_half_sent_requests_hold_bounded_threads_while_a_scrape_answers(
    registry: CollectorRegistry,
) -> None:
    server = serve_metrics(registry, port=0)
    before = threading.active_count()
    most_threads = before
    with ExitStack() as peers:
        for _ in range(250):
            peer = peers.enter_context(connect(server))
            peer.sendall(HALF_A_REQUEST)
            most_threads = max(most_threads, threading.active_count())
        for _ in range(3):  # while all 250 are still connected
            body = urllib.request.urlopen(server.url, timeout=5).read()
            assert b"wmwatch_test_value 42.0" in body
            most_threads = max(most_threads, threading.active_count())
        # at most 2 * MAX_CONNECTIONS connections (see wmwatch._metrics.connections), plus a
        # few threads that let go of theirs and are ending; before the cap it was one per peer
        assert most_threads - before <= 2 * MAX_CONNECTIONS + 8
        assert server.connections.count() <= 2 * MAX_CONNECTIONS
        assert server.connections.evicted_total >= 250 - MAX_CONNECTIONS
        # closing with the peers still connected
        assert close_within(server, CLOSE_TIMEOUT_SECONDS + 5) < CLOSE_TIMEOUT_SECONDS
    assert server.connections.count() == 0
    deadline = time.monotonic() + 5
    while connection_threads() and time.monotonic() < deadline:
        time.sleep(0.05)  # evicted threads end moments after they let go of their connection
    assert connection_threads() == 0


def test_a_peer_that_stalls_its_request_is_closed_after_the_request_timeout(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    server = serve_metrics(registry, port=0, request_timeout_seconds=0.5)
    try:
        with connect(server) as half, connect(server) as dribbling, connect(server) as silent:
            half.sendall(HALF_A_REQUEST)
            # one byte every 0.1 s: each read is quick, the request never ends
            closed_at: float | None = None
            started = time.monotonic()
            for byte in HALF_A_REQUEST[:50]:
                try:
                    dribbling.sendall(bytes([byte]))
                except OSError:
                    closed_at = time.monotonic()
                    break
                time.sleep(0.1)
            assert closed_by_server(dribbling)
            assert closed_at is None or closed_at - started < 4.0
            assert closed_by_server(half) and closed_by_server(silent)
        # and scrapes are answered as before, counting what was closed
        registry.register(
            WatchCollector(
                QueryBook(),
                Health(),
                queue_size=lambda: 0,
                queue_capacity=1,
                endpoint_connections=lambda: server.connections,
            )
        )
        closed = {
            dict(labels)["reason"]: value
            for (name, labels), value in scrape(server.url).items()
            if name == "wmwatch_metrics_connections_closed_total"
        }
        assert closed == {"timed_out": 3, "evicted": 0, "refused": 0}
    finally:
        server.close()


class _HeldCollector:
    """A collector whose scrape waits until the test lets it go: answers in progress."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def collect(self) -> Iterator[Metric]:
        self.entered.release()
        self.release.wait(timeout=30)
        gauge = GaugeMetricFamily("wmwatch_held", "A value served late.")
        gauge.add_metric([], 1)
        yield gauge


def test_a_connection_past_the_cap_is_closed_at_once_never_queued() -> None:
    held = _HeldCollector()
    registry = CollectorRegistry()
    registry.register(held)
    server = serve_metrics(registry, port=0, max_connections=2)
    answers: list[bytes] = []

    def scrape() -> None:
        answers.append(urllib.request.urlopen(server.url, timeout=30).read())

    scrapers = [threading.Thread(target=scrape, daemon=True) for _ in range(2)]
    try:
        for scraper in scrapers:
            scraper.start()
        for _ in scrapers:  # both places are answering a request
            assert held.entered.acquire(timeout=10)
        with connect(server) as extra:
            extra.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            started = time.monotonic()
            assert closed_by_server(extra)
            assert time.monotonic() - started < 2.0
        assert server.connections.refused_total == 1
        held.release.set()
        for scraper in scrapers:
            scraper.join(timeout=10)
        assert len(answers) == 2 and all(b"wmwatch_held 1.0" in a for a in answers)
    finally:
        held.release.set()
        server.close()


def test_close_is_bounded_while_an_answer_is_stuck() -> None:
    held = _HeldCollector()
    registry = CollectorRegistry()
    registry.register(held)
    server = serve_metrics(registry, port=0)
    outcome: list[str] = []

    def scrape() -> None:
        try:
            urllib.request.urlopen(server.url, timeout=30).read()
            outcome.append("answered")
        except OSError:
            outcome.append("closed")

    scraper = threading.Thread(target=scrape, daemon=True)
    try:
        scraper.start()
        assert held.entered.acquire(timeout=10)
        started = time.monotonic()
        closer = threading.Thread(target=lambda: server.close(timeout_seconds=1.0), daemon=True)
        closer.start()
        closer.join(timeout=10)
        assert not closer.is_alive()
        assert time.monotonic() - started < 3.0
    finally:
        held.release.set()
        scraper.join(timeout=10)
    # the held answer could not be sent on the connection close() shut down
    assert outcome == ["closed"]
