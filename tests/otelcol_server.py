"""A real OpenTelemetry Collector for the OTLP tests, built from the Collector's Go modules.

``.ci/build_otelcol.sh`` builds ``tests/otelcol`` (an OTLP receiver, the bearer-token auth
extension and the file exporter) into the machine cache under a name that holds the hash of its
go.mod, go.sum and main.go; :func:`otelcol_binary` finds it at the same place. The Collector runs
two OTLP receivers on free 127.0.0.1 ports, each with HTTP and gRPC: ``plain`` (no TLS, no auth)
and ``secure`` (TLS with a test CA, a client certificate required, and a bearer token). Each
writes what it receives, one OTLP/JSON request a line, to a file of its own. It is stopped by
its pid (terminate, then kill after a bound), and can be started again on the same ports.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.harness.net import free_port as _free_port
from tests.harness.net import listening as _listening
from tests.kafka_broker import _stop as stop_process

SOURCE = Path(__file__).parent / "otelcol"
START_TIMEOUT_SECONDS = 30.0
TOKEN = "wmwatch-test-token-5f2c9"


class CollectorMissing(RuntimeError):
    """The Collector is not built (or was built from other sources)."""


def otelcol_binary() -> Path:
    """The cached Collector built from tests/otelcol as it is now."""
    cache = Path(
        os.environ.get("WMWATCH_BIN_CACHE", str(Path.home() / ".cache" / "wmwatch" / "bin"))
    )
    go_mod = (SOURCE / "go.mod").read_text()
    version = next(
        line.split()[1]
        for line in go_mod.splitlines()
        if line.split()[:1] == ["go.opentelemetry.io/collector/otelcol"]
    )
    digest = hashlib.sha256(
        b"".join((SOURCE / name).read_bytes() for name in ("go.mod", "go.sum", "main.go"))
    ).hexdigest()[:12]
    binary = cache / f"wmwatch-otelcol-{version}-{digest}"
    if not os.access(binary, os.X_OK):
        raise CollectorMissing(
            f"the OpenTelemetry Collector is not built at {binary}: run `bash .ci/build_otelcol.sh`"
        )
    return binary


@dataclass(frozen=True)
class Tls:
    """A test CA, the Collector's certificate for 127.0.0.1, and a client certificate."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls(folder: Path) -> Tls:
    """A CA and two certificates it signs, made by openssl (one day valid)."""
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    ca, ca_key = folder / "ca.pem", folder / "ca-key.pem"
    run(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
        "-subj", "/CN=wmwatch test CA", "-keyout", str(ca_key), "-out", str(ca),
    )  # fmt: skip
    made = {}
    for who, extension in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        key, csr, cert = folder / f"{who}-key.pem", folder / f"{who}.csr", folder / f"{who}.pem"
        ext = folder / f"{who}.ext"
        ext.write_text(extension + "\n")
        run(
            "req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=wmwatch test {who}",
            "-keyout", str(key), "-out", str(csr),
        )  # fmt: skip
        run(
            "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "1", "-extfile", str(ext), "-out", str(cert),
        )  # fmt: skip
        made[who] = (cert, key)
    return Tls(ca, *made["server"], *made["client"])


@dataclass
class Collector:
    """A configured Collector: its folder, ports and output files; start it with :func:`running`."""

    work: Path
    tls: Tls
    ports: dict[str, int] = field(default_factory=dict)
    process: subprocess.Popen[bytes] | None = None

    def endpoint(self, receiver: str, protocol: str) -> str:
        """The URL of a receiver (plain, secure) for a protocol (http, grpc)."""
        scheme = "https" if receiver == "secure" else "http"
        return f"{scheme}://127.0.0.1:{self.ports[f'{receiver}_{protocol}']}"

    def output(self, receiver: str) -> Path:
        return self.work / f"{receiver}.jsonl"

    @property
    def config(self) -> Path:
        return self.work / "config.yaml"

    @property
    def log(self) -> Path:
        return self.work / "otelcol.log"


def configure(work: Path, tls: Tls) -> Collector:
    """Write the Collector's config on free loopback ports."""
    work.mkdir(parents=True, exist_ok=True)
    collector = Collector(work, tls)
    taken: set[int] = set()
    for name in ("plain_http", "plain_grpc", "secure_http", "secure_grpc"):
        port = _free_port()
        while port in taken:
            port = _free_port()
        taken.add(port)
        collector.ports[name] = port
    secure_tls = {
        "cert_file": str(tls.server_cert),
        "key_file": str(tls.server_key),
        "client_ca_file": str(tls.ca),
    }
    receivers: dict[str, Any] = {
        "otlp/plain": {
            "protocols": {
                "http": {"endpoint": f"127.0.0.1:{collector.ports['plain_http']}"},
                "grpc": {"endpoint": f"127.0.0.1:{collector.ports['plain_grpc']}"},
            }
        },
        "otlp/secure": {
            "protocols": {
                protocol: {
                    "endpoint": f"127.0.0.1:{collector.ports[f'secure_{protocol}']}",
                    "tls": secure_tls,
                    "auth": {"authenticator": "bearertokenauth"},
                }
                for protocol in ("http", "grpc")
            }
        },
    }
    exporters = {
        # append: a restarted Collector keeps what it wrote before
        f"file/{name}": {
            "path": str(collector.output(name)),
            "append": True,
            "flush_interval": "100ms",
        }
        for name in ("plain", "secure")
    }
    pipelines = {
        f"{signal}/{name}": {"receivers": [f"otlp/{name}"], "exporters": [f"file/{name}"]}
        for signal in ("metrics", "traces")
        for name in ("plain", "secure")
    }
    config = {
        "extensions": {"bearertokenauth": {"token": TOKEN}},
        "receivers": receivers,
        "exporters": exporters,
        "service": {
            "extensions": ["bearertokenauth"],
            # no telemetry server of its own: it would take port 8888
            "telemetry": {"metrics": {"level": "none"}, "logs": {"level": "info"}},
            "pipelines": pipelines,
        },
    }
    # JSON is YAML: no YAML writer needed
    collector.config.write_text(json.dumps(config, indent=2))
    return collector


def start(collector: Collector) -> None:
    """Start the Collector and wait until every receiver listens."""
    binary = otelcol_binary()
    with collector.log.open("ab") as log:
        collector.process = subprocess.Popen(
            [str(binary), "--config", f"file:{collector.config}"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while not all(_listening(port) for port in collector.ports.values()):
        if collector.process.poll() is not None or time.monotonic() > deadline:
            stop(collector)
            tail = collector.log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the OpenTelemetry Collector did not start: {tail}")
        time.sleep(0.1)


def stop(collector: Collector) -> None:
    """Terminate by pid (the file exporter flushes), kill if it has not ended within the bound."""
    process = collector.process
    if process is None or process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGCONT)  # a paused Collector cannot end
    stop_process(process)


def pause(collector: Collector, paused: bool) -> None:
    """SIGSTOP / SIGCONT: a Collector that accepts connections and never answers (a slow one)."""
    assert collector.process is not None
    collector.process.send_signal(signal.SIGSTOP if paused else signal.SIGCONT)


@contextlib.contextmanager
def running(collector: Collector) -> Iterator[Collector]:
    start(collector)
    try:
        yield collector
    finally:
        stop(collector)


# -- what the Collector wrote ---------------------------------------------------------------


@dataclass(frozen=True)
class Point:
    """One data point as the Collector received it."""

    resource: dict[str, Any]
    name: str
    unit: str
    kind: str  # gauge, sum, histogram
    attributes: dict[str, Any]
    value: Any  # a number; for a histogram, the data point dict
    time_unix_nano: int
    monotonic: bool = False


@dataclass(frozen=True)
class SpanRecord:
    resource: dict[str, Any]
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_unix_nano: int
    end_unix_nano: int
    attributes: dict[str, Any]


def _value(value: dict[str, Any]) -> Any:
    for key in ("stringValue", "boolValue", "doubleValue"):
        if key in value:
            return value[key]
    if "intValue" in value:
        return int(value["intValue"])
    return value


def _attributes(items: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {item["key"]: _value(item.get("value", {})) for item in items or []}


def _lines(path: Path) -> Iterator[dict[str, Any]]:
    if not path.exists():
        return
    # the last piece is what the Collector is still writing (or "" after a complete line)
    for line in path.read_text().split("\n")[:-1]:
        if line.strip():
            yield json.loads(line)


def points(path: Path) -> list[Point]:
    """Every metric data point in a file exporter's output, in the order received."""
    found = []
    for request in _lines(path):
        for rm in request.get("resourceMetrics", []):
            resource = _attributes(rm.get("resource", {}).get("attributes"))
            for sm in rm.get("scopeMetrics", []):
                for metric in sm.get("metrics", []):
                    for kind in ("gauge", "sum", "histogram"):
                        if kind not in metric:
                            continue
                        body = metric[kind]
                        for dp in body.get("dataPoints", []):
                            if kind == "histogram":
                                value: Any = dp
                            elif "asDouble" in dp:
                                value = float(dp["asDouble"])
                            else:
                                value = int(dp.get("asInt", 0))
                            found.append(
                                Point(
                                    resource=resource,
                                    name=metric["name"],
                                    unit=metric.get("unit", ""),
                                    kind=kind,
                                    attributes=_attributes(dp.get("attributes")),
                                    value=value,
                                    time_unix_nano=int(dp.get("timeUnixNano", 0)),
                                    monotonic=bool(body.get("isMonotonic", False)),
                                )
                            )
    return found


def spans(path: Path) -> list[SpanRecord]:
    found = []
    for request in _lines(path):
        for rs in request.get("resourceSpans", []):
            resource = _attributes(rs.get("resource", {}).get("attributes"))
            for ss in rs.get("scopeSpans", []):
                for span in ss.get("spans", []):
                    found.append(
                        SpanRecord(
                            resource=resource,
                            name=span["name"],
                            trace_id=span.get("traceId", ""),
                            span_id=span.get("spanId", ""),
                            parent_span_id=span.get("parentSpanId", ""),
                            start_unix_nano=int(span.get("startTimeUnixNano", 0)),
                            end_unix_nano=int(span.get("endTimeUnixNano", 0)),
                            attributes=_attributes(span.get("attributes")),
                        )
                    )
    return found
