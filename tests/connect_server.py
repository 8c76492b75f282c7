"""A real Spark Connect server, started as its own process from the pyspark package.

``sbin/start-connect-server.sh`` runs the server JVM as a daemon; the tests talk to it over
loopback gRPC only, on a free port, and stop it with ``sbin/stop-connect-server.sh``. Its logs
and pid file live in a folder of the caller's, so a failed start can say why.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from tests import jvm_archive
from tests.harness.net import free_port, listening

START_TIMEOUT_SECONDS = 120.0

# the settings of the tests' local session, for the server's own
SERVER_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.ui.enabled": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.scheduler.mode": "FAIR",
    "spark.sql.streaming.noDataProgressEventInterval": "1000",
    "spark.sql.adaptive.enabled": "false",
}


def _spark_home() -> str:
    import pyspark

    return os.path.dirname(pyspark.__file__)


def _kafka_connector_jars() -> list[str]:
    """Spark's Kafka connector when fetched (as the classic session gets it; the `kafka`
    fixture fails loudly without it), so Kafka queries run on the server too."""
    from tests.kafka_broker import JarsMissing, connector_jars

    try:
        return connector_jars()
    except JarsMissing:
        return []


@contextlib.contextmanager
def connect_server(work: Path, *, master: str = "local[2]") -> Iterator[str]:
    """Start a Spark Connect server process; yield its ``sc://`` URL; stop it afterwards."""
    work.mkdir(parents=True, exist_ok=True)
    home = _spark_home()
    port = free_port()
    env = {
        **os.environ,
        "SPARK_HOME": home,
        "SPARK_LOG_DIR": str(work / "logs"),
        "SPARK_PID_DIR": str(work / "pid"),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_DRIVER_MEMORY": "2g",
        # the server's Python workers unpickle what the tests define (data sources, functions)
        "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")) if p
        ),
    }
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    args = ["bash", f"{home}/sbin/start-connect-server.sh", "--master", master]
    conf = {
        **SERVER_CONF,
        **jvm_archive.long_lived_conf(),
        "spark.connect.grpc.binding.port": str(port),
    }
    jars = _kafka_connector_jars()
    if jars:
        conf["spark.jars"] = ",".join(jars)
    for key, value in conf.items():
        args += ["--conf", f"{key}={value}"]
    subprocess.run(args, env=env, check=True, capture_output=True, timeout=60)
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not listening(port):
            if time.monotonic() > deadline:
                logs = sorted((work / "logs").glob("*.out"))
                tail = logs[-1].read_text()[-2000:] if logs else "no log"
                raise RuntimeError(f"the Spark Connect server did not listen on {port}: {tail}")
            time.sleep(0.5)
        yield f"sc://127.0.0.1:{port}"
    finally:
        subprocess.run(
            ["bash", f"{home}/sbin/stop-connect-server.sh"],
            env=env,
            capture_output=True,
            timeout=60,
            check=False,
        )
