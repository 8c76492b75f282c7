"""Starting Spark for wmwatch's commands: Delta's jars fetched by wmwatch, and a start that fails
in one line with what to do (``wmwatch/_cli/spark_start.py``).

The fetch is tested against a real HTTP server on loopback; the failures against the real CLI
and, for an address Spark cannot bind, a real JVM."""

from __future__ import annotations

import http.server
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from wmwatch._cli.spark_start import DELTA_JARS, DELTA_VERSION, delta_jars, explain_start_failure
from wmwatch._errors import SparkStartError

REPO = Path(__file__).parent.parent


class _Served(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def bogus_repository() -> Iterator[str]:
    """A Maven repository on loopback that serves bytes which are not Delta's jars."""
    handler = type("Bogus", (_Served,), {"body": b"PK\x03\x04 not a delta jar"})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/maven2"
    finally:
        server.shutdown()
        server.server_close()


def test_a_jar_that_is_not_the_published_one_is_refused_and_nothing_is_left(
    tmp_path: Path, bogus_repository: str
) -> None:
    with pytest.raises(SparkStartError) as caught:
        delta_jars(cache=tmp_path, repository=bogus_repository)
    message = str(caught.value)
    assert "SHA-256 differs" in message and "WMWATCH_MAVEN_REPO" in message
    assert "\n" not in message
    # no jar and no partial download stays behind to be mistaken for a fetched one
    assert [p.name for p in (tmp_path / f"delta-{DELTA_VERSION}").iterdir()] == []


def test_an_unreachable_repository_is_one_line_with_what_to_do(tmp_path: Path) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(SparkStartError) as caught:
        delta_jars(cache=tmp_path, repository=f"http://127.0.0.1:{port}")
    message = str(caught.value)
    assert message.startswith("could not fetch Delta Lake's jar")
    assert "refused" in message and "WMWATCH_MAVEN_REPO" in message
    assert "\n" not in message


def test_the_test_jar_set_pins_the_same_delta_release() -> None:
    """``tests/jars/delta/pom.xml`` (the tests' jars) and the demo's pinned jars are one release."""
    pom = (REPO / "tests/jars/delta/pom.xml").read_text()
    assert set(re.findall(r"<version>([^<]+)</version>", pom)) - {"1"} == {DELTA_VERSION}
    assert all(DELTA_VERSION in name for name in DELTA_JARS)


@pytest.mark.parametrize(
    ("output", "expected"),
    [
        (
            "\t\t[NOT FOUND  ] org.slf4j#slf4j-api;2.0.13!slf4j-api.jar (0ms)\n"
            "Exception in thread main java.lang.RuntimeException: [unresolved dependency]",
            "could not resolve the package org.slf4j#slf4j-api;2.0.13!slf4j-api.jar",
        ),
        (
            "java.net.BindException: bind(..) failed with error(-99): Cannot assign requested "
            "address: Service 'sparkDriver' failed after 16 retries",
            "could not bind its driver (Cannot assign requested address): set SPARK_LOCAL_IP",
        ),
        (
            "Error: A JNI error has occurred\njava.lang.UnsupportedClassVersionError: "
            "org/apache/spark/launcher/Main has been compiled by a more recent version",
            "the java on PATH is too old for Spark",
        ),
        (
            "20:05:50 ERROR SparkContext: Error initializing SparkContext.\n"
            "java.lang.IllegalArgumentException: spark.executor.memory must be positive\n"
            "\tat org.apache.spark.SparkConf.validateSettings(SparkConf.scala:600)",
            "Spark did not start: java.lang.IllegalArgumentException: spark.executor.memory "
            "must be positive",
        ),
    ],
)
def test_spark_output_becomes_one_line_with_what_to_do(output: str, expected: str) -> None:
    line = explain_start_failure(output, RuntimeError("JAVA_GATEWAY_EXITED"), Path("/w/spark.log"))
    assert expected in line
    assert line.endswith("(Spark's output: /w/spark.log)")
    assert "\n" not in line and "\tat " not in line


def test_an_error_that_cannot_describe_itself_is_still_one_line() -> None:
    class GatewayGone(Exception):
        def __str__(self) -> str:  # a Py4JJavaError asks the JVM, which may be gone
            raise ConnectionRefusedError(111, "Connection refused")

    line = explain_start_failure("", GatewayGone(), None)
    assert line == "Spark did not start: GatewayGone"


def _demo(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "wmwatch.cli", "demo", "--duration", "5", "--port", "0",
         "--workdir", str(tmp_path / "demo")],
        capture_output=True, text=True, timeout=180, check=False, cwd=REPO,
        env={**os.environ, **env},
    )  # fmt: skip


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def test_demo_with_a_java_home_without_java_says_so_in_one_line(tmp_path: Path) -> None:
    run = _demo(tmp_path, JAVA_HOME=str(tmp_path / "no-jdk"))
    assert run.returncode == 1
    assert _error_lines(run.stderr) == [
        f"wmwatch demo: JAVA_HOME is {tmp_path / 'no-jdk'}, which has no bin/java: point "
        "JAVA_HOME at a JDK 17 or unset it"
    ]


@pytest.mark.spark
def test_demo_whose_driver_cannot_bind_says_so_in_one_line(tmp_path: Path) -> None:
    """A real JVM asked to bind the driver to an address this machine does not have (TEST-NET-3):
    Spark fails inside the JVM; the demo prints one line and keeps Spark's stack in its log."""
    run = _demo(tmp_path, SPARK_LOCAL_IP="203.0.113.9")
    assert run.returncode == 1
    lines = _error_lines(run.stderr)
    assert len(lines) == 1, run.stderr[-3000:]
    assert lines[0].startswith("wmwatch demo: Spark could not bind its driver")
    assert "SPARK_LOCAL_IP" in lines[0]
    log = tmp_path / "demo" / "spark.log"
    assert str(log) in lines[0]
    assert "BindException" in log.read_text()
