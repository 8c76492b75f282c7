"""The /metrics endpoint over real loopback sockets: address, TLS, basic auth, busy port."""

from __future__ import annotations

import base64
import socket
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Gauge

from tests.harness.net import self_signed_cert
from wmwatch import ConfigError, MetricsServerError
from wmwatch._metrics.exporter import serve_metrics


@pytest.fixture
def registry() -> CollectorRegistry:
    reg = CollectorRegistry()
    Gauge("wmwatch_test_value", "A value.", registry=reg).set(42)
    return reg


def test_serves_on_loopback_by_default_with_a_free_port(registry: CollectorRegistry) -> None:
    server = serve_metrics(registry, port=0)
    try:
        assert server.url.startswith("http://127.0.0.1:")
        body = urllib.request.urlopen(server.url, timeout=5).read().decode()
        assert "wmwatch_test_value 42.0" in body
    finally:
        server.close()


def test_busy_port_gives_one_clear_sentence(registry: CollectorRegistry) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsServerError) as info:
            serve_metrics(registry, port=port)
    message = str(info.value)
    assert f"port {port}" in message and "metrics_port=0" in message and "\n" not in message


def test_bad_port_and_half_tls_config_are_refused(registry: CollectorRegistry) -> None:
    with pytest.raises(ConfigError, match="not a TCP port"):
        serve_metrics(registry, port=70000)
    with pytest.raises(ConfigError, match="both"):
        serve_metrics(registry, port=0, certfile="cert.pem")


def test_basic_auth_rejects_missing_and_wrong_credentials(registry: CollectorRegistry) -> None:
    server = serve_metrics(registry, port=0, basic_auth=("prom", "s3cret"))
    try:
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.url, timeout=5)
        assert info.value.code == 401
        for user, password, ok in (("prom", "wrong", False), ("prom", "s3cret", True)):
            request = urllib.request.Request(server.url)
            token = base64.b64encode(f"{user}:{password}".encode()).decode()
            request.add_header("Authorization", f"Basic {token}")
            if ok:
                assert b"wmwatch_test_value" in urllib.request.urlopen(request, timeout=5).read()
            else:
                with pytest.raises(urllib.error.HTTPError):
                    urllib.request.urlopen(request, timeout=5)
    finally:
        server.close()


def test_tls_endpoint_serves_https(registry: CollectorRegistry, tmp_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    server = serve_metrics(registry, port=0, certfile=str(cert), keyfile=str(key))
    try:
        assert server.url.startswith("https://")
        context = ssl.create_default_context(cafile=str(cert))
        body = urllib.request.urlopen(server.url, timeout=5, context=context).read()
        assert b"wmwatch_test_value 42.0" in body
        with pytest.raises(OSError):  # a plain-HTTP client gets no metrics
            urllib.request.urlopen(server.url.replace("https", "http"), timeout=5)
    finally:
        server.close()


def test_unreadable_tls_files_are_a_clear_error(
    registry: CollectorRegistry, tmp_path: Path
) -> None:
    with pytest.raises(MetricsServerError, match="TLS certificate"):
        serve_metrics(
            registry, port=0, certfile=str(tmp_path / "none.pem"), keyfile=str(tmp_path / "k")
        )
