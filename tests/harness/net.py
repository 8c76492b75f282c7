"""Free loopback ports, scraping a /metrics endpoint, and certificates for TLS tests."""

from __future__ import annotations

import socket
import subprocess
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    """A port nothing listens on now (the caller binds it soon after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def listening(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def scrape(url: str, timeout: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Fetch /metrics and return {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A certificate and key for 127.0.0.1 in ``folder``, made by openssl (one day valid)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
