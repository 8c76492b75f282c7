"""Small helpers shared by the Spark tests: writing input files, free ports, scraping."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

_counter = iter(range(10**9))


def write_events(
    folder: Path, rows: Iterable[Mapping[str, Any]], *, name: str | None = None
) -> Path:
    """Write one JSON-lines file atomically (write, then rename): no stream sees half a file."""
    index = next(_counter)
    final = folder / (name or f"part-{index:05d}.json")
    tmp = folder.parent / f".{final.name}.tmp"
    with tmp.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    os.replace(tmp, final)
    # file sources take files in modification-time order: keep successive files strictly ordered
    stamp = time.time() + index * 0.001
    os.utime(final, (stamp, stamp))
    return final


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(url: str, timeout: float = 5.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Fetch /metrics and return {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def iso(ts: str) -> float:
    """Spark's ISO UTC string to Unix seconds."""
    from datetime import datetime

    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


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


def offsets_moved(reader: Any, batch_id: int) -> bool:
    """Whether batch ``batch_id`` read anything: its offsets differ from the batch before's
    (``reader`` a :class:`~wmwatch._checkpoint.reader.CheckpointReader`)."""
    entry, before = reader.offsets(batch_id), reader.offsets(batch_id - 1)
    assert entry is not None and before is not None
    return bool(entry.source_offsets != before.source_offsets)


@contextlib.contextmanager
def py4j_calls(spark: Any) -> Iterator[list[int]]:
    """Count the py4j commands this thread sends to the driver's JVM while the block runs (each
    a round trip: the driver's cost per JVM object touched); the commands still go through."""
    client = spark.sparkContext._gateway._gateway_client
    send = client.send_command
    me = threading.get_ident()
    count = [0]

    def counting(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == me:
            count[0] += 1
        return send(*args, **kwargs)

    client.send_command = counting
    try:
        yield count
    finally:
        del client.send_command


def sidecar_args(checkpoint: str | os.PathLike[str], db: Path, *more: str) -> list[str]:
    """``wmwatch sidecar`` over the definitions of :mod:`tests.sidecar_defs` (``dropDuplicates``
    of ``$WMWATCH_SIDECAR_TEST_IN``), as its command line."""
    return [
        "sidecar",
        "--checkpoint",
        os.fspath(checkpoint),
        "--events",
        "tests.sidecar_defs:events",
        "--query",
        "tests.sidecar_defs:dedupe",
        "--db",
        str(db),
        *more,
    ]
