"""Real Prometheus-side servers for tests: the Debian prometheus and pushgateway binaries on
loopback, and a tiny WSGI receiver that records what is pushed to it."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from tests.harness.net import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
PUSHGATEWAY = shutil.which("prometheus-pushgateway") or "/usr/bin/prometheus-pushgateway"
APT_HINT = "install it with: apt-get install -y prometheus prometheus-pushgateway"


def require(binary: str) -> str:
    if not Path(binary).exists():
        raise AssertionError(f"{binary} is missing; {APT_HINT}")
    return binary


def _wait_ready(
    url: str,
    process: subprocess.Popen[bytes],
    log: Path,
    timeout: float = 30.0,
    probe: Probe | None = None,
) -> None:
    deadline = time.monotonic() + timeout
    probe = probe or Probe()
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"{url} exited early:\n{log.read_text()[-3000:]}")
        try:
            request = urllib.request.Request(url, headers=probe.headers)
            with urllib.request.urlopen(request, timeout=1, context=probe.context) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"{url} not ready after {timeout}s:\n{log.read_text()[-3000:]}")


@dataclass
class Probe:
    """How to reach a server that asks for credentials: its CA, an Authorization header."""

    context: ssl.SSLContext | None = None
    headers: dict[str, str] = field(default_factory=dict)


@contextmanager
def _process(
    args: list[str], ready_url: str, log: Path, probe: Probe | None = None
) -> Iterator[None]:
    with log.open("wb") as out:
        process = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_ready(ready_url, process, log, probe=probe)
        yield
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


@contextmanager
def pushgateway(
    workdir: Path, web_config: dict[str, Any] | None = None, probe: Probe | None = None
) -> Iterator[str]:
    """A real Pushgateway on a free loopback port, in memory only; yields its base URL.

    ``web_config``: its ``--web.config.file`` (TLS, basic auth), with ``probe`` to reach it;
    the URL is https:// when it has ``tls_server_config``."""
    port = free_port()
    scheme = "https" if web_config and "tls_server_config" in web_config else "http"
    url = f"{scheme}://127.0.0.1:{port}"
    args = [
        require(PUSHGATEWAY),
        f"--web.listen-address=127.0.0.1:{port}",
        "--persistence.file=",  # never the system's /var/lib file, shared by every run
    ]
    if web_config is not None:
        config = workdir / "pushgateway-web.yml"
        config.write_text(json.dumps(web_config))  # JSON is YAML
        args.append(f"--web.config.file={config}")
    with _process(args, f"{url}/-/ready", workdir / "pushgateway.log", probe):
        yield url


@dataclass
class Prometheus:
    url: str

    def api(self, path: str, **params: Any) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return list(data["result"])

    def query_range(
        self, expr: str, start: float, end: float, step: float = 1.0
    ) -> list[dict[str, Any]]:
        return list(self.api("query_range", query=expr, start=start, end=end, step=step)["result"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(self.api("alerts")["alerts"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets")["activeTargets"])


@contextmanager
def prometheus(
    workdir: Path, targets: Iterable[str], rule_files: Iterable[Path] = (), job: str = "wmwatch"
) -> Iterator[Prometheus]:
    """A real Prometheus scraping ``targets`` every second and evaluating rules every second."""
    port = free_port()
    config = workdir / "prometheus.yml"
    config.write_text(
        json.dumps(
            {
                "global": {
                    "scrape_interval": "1s",
                    "evaluation_interval": "1s",
                    "scrape_timeout": "1s",
                },
                "rule_files": [str(path) for path in rule_files],
                "scrape_configs": [
                    {"job_name": job, "static_configs": [{"targets": list(targets)}]}
                ],
            }
        )
    )
    data = workdir / "prometheus-data"
    data.mkdir(exist_ok=True)
    args = [
        require(PROMETHEUS),
        f"--config.file={config}",
        f"--storage.tsdb.path={data}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--web.enable-lifecycle",
    ]
    url = f"http://127.0.0.1:{port}"
    with _process(args, f"{url}/-/ready", workdir / "prometheus.log"):
        yield Prometheus(url)


@dataclass
class Received:
    method: str
    path: str
    body: str


@dataclass
class Recorder:
    """Records every request and answers 200; after ``hold()`` it answers nothing until
    ``release()``, like a gateway that hangs (requests that arrive are still listed in
    ``arrived``)."""

    url: str
    requests: list[Received] = field(default_factory=list)
    arrivals: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    gate: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.gate.set()

    def hold(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def arrived(self) -> list[Received]:
        with self.lock:
            return [r for r in self.arrivals if r.method in ("PUT", "POST")]

    def pushes(self) -> list[Received]:
        """Requests that were answered."""
        with self.lock:
            return [r for r in self.requests if r.method in ("PUT", "POST")]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


@contextmanager
def recorder() -> Iterator[Recorder]:
    """A loopback HTTP server that stores each request, standing in for a Pushgateway."""
    box: list[Recorder] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length).decode() if length else ""
        rec = box[0]
        received = Received(environ["REQUEST_METHOD"], environ["PATH_INFO"], body)
        with rec.lock:
            rec.arrivals.append(received)
        rec.gate.wait()
        with rec.lock:
            rec.requests.append(received)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b""]

    server: WSGIServer = make_server("127.0.0.1", 0, app, handler_class=_QuietHandler)
    box.append(Recorder(url=f"http://127.0.0.1:{server.server_port}"))
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
    )
    thread.start()
    try:
        yield box[0]
    finally:
        box[0].release()  # a held request would keep the server from shutting down
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
