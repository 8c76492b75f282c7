"""A real Apache Kafka broker (KRaft: one process is controller and broker), started from the
jars ``.ci/fetch_jars.sh`` keeps in the machine's jar cache.

The storage is formatted with ``kafka.tools.StorageTool`` under a random cluster id, then
``kafka.Kafka`` runs with both listeners on free 127.0.0.1 ports and a small heap. The tests talk
to it over loopback only and stop it by its pid (terminate, then kill after a bound), whatever
happens. Its log and data live in a folder of the caller's, so a failed start can say why.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from tests.harness.net import free_port, listening

START_TIMEOUT_SECONDS = 60.0
STOP_TIMEOUT_SECONDS = 15.0
BROKER_SET = "kafka-broker"
CONNECTOR_SET = "spark-kafka"
_POMS = Path(__file__).parent / "jars"
# Small heap and quick start: the tests send a few thousand records.
_JVM_OPTS = ("-Xms64m", "-Xmx512m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")


class JarsMissing(RuntimeError):
    """A jar set is not in the cache (or is from another version of its pom)."""


def jar_cache() -> Path:
    """Where ``.ci/fetch_jars.sh`` puts the jar sets (the same default)."""
    default = Path.home() / ".cache" / "wmwatch" / "jars"
    return Path(os.environ.get("WMWATCH_JAR_CACHE", str(default)))


def jar_set(name: str) -> Path:
    """The cached folder of one jar set, checked against its pom's hash."""
    folder = jar_cache() / name
    pom = _POMS / name / "pom.xml"
    wanted = hashlib.sha256(pom.read_bytes()).hexdigest()
    stamp = folder / ".pom-sha256"
    if not stamp.is_file() or stamp.read_text().strip() != wanted:
        raise JarsMissing(
            f"the {name} jars are not in {folder} (or are from another version of "
            f"tests/jars/{name}/pom.xml); run `bash .ci/fetch_jars.sh` first"
        )
    return folder


def connector_jars() -> list[str]:
    """Spark's Kafka connector and its dependencies, for ``spark.jars``."""
    return sorted(str(p) for p in jar_set(CONNECTOR_SET).glob("*.jar"))


def _cluster_id() -> str:
    """A random KRaft cluster id (a UUID in URL-safe base64, as ``kafka-storage random-uuid``).

    Like Kafka's own ``Uuid.randomUuid``, never one starting with "-" (1 in 64 would): the
    storage tool's command line would read it as an option and refuse to format.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _properties(work: Path, broker_port: int, controller_port: int) -> str:
    settings = {
        "process.roles": "broker,controller",
        "node.id": "1",
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{broker_port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{broker_port}",
        "controller.listener.names": "CONTROLLER",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "inter.broker.listener.name": "PLAINTEXT",
        "log.dirs": str(work / "data"),
        "num.partitions": "1",
        "offsets.topic.replication.factor": "1",
        "offsets.topic.num.partitions": "1",
        "transaction.state.log.replication.factor": "1",
        "transaction.state.log.min.isr": "1",
        "share.coordinator.state.topic.replication.factor": "1",
        "share.coordinator.state.topic.min.isr": "1",
        "group.initial.rebalance.delay.ms": "0",
        "auto.create.topics.enable": "false",
    }
    return "".join(f"{k}={v}\n" for k, v in settings.items())


def _answers(bootstrap: str, port: int) -> bool:
    """Whether the broker serves metadata (a socket first: the client logs refused connects)."""
    from confluent_kafka.admin import AdminClient

    if not listening(port):
        return False
    admin = AdminClient({"bootstrap.servers": bootstrap, "socket.timeout.ms": 2000, "log_level": 0})
    try:
        admin.list_topics(timeout=2).brokers  # noqa: B018 - a metadata round trip
        return True
    except Exception:  # noqa: BLE001 - not up yet
        return False


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Terminate by pid, kill if it has not ended within the bound."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(STOP_TIMEOUT_SECONDS)


@dataclasses.dataclass(frozen=True)
class Broker:
    """A formatted broker: its folder and ports (it can be started, stopped and started again)."""

    work: Path
    broker_port: int
    controller_port: int

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.broker_port}"


def format_broker(work: Path) -> Broker:
    """Write the config (free loopback ports) and format the storage under a random cluster id."""
    jars = jar_set(BROKER_SET)
    work.mkdir(parents=True, exist_ok=True)
    broker_port, controller_port = free_port(), free_port()
    while controller_port == broker_port:
        controller_port = free_port()
    config = work / "server.properties"
    config.write_text(_properties(work, broker_port, controller_port))
    subprocess.run(
        [*_java(jars), "kafka.tools.StorageTool", "format", "-t", _cluster_id(), "-c", str(config)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return Broker(work, broker_port, controller_port)


def _java(jars: Path) -> list[str]:
    return ["java", *_JVM_OPTS, "-cp", f"{jars}/*"]


@contextlib.contextmanager
def running(broker: Broker) -> Iterator[str]:
    """Run a formatted broker until the block ends; yield its bootstrap address."""
    jars = jar_set(BROKER_SET)
    log_path = broker.work / "broker.log"
    with log_path.open("ab") as log:
        process = subprocess.Popen(
            [*_java(jars), "kafka.Kafka", str(broker.work / "server.properties")],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + START_TIMEOUT_SECONDS
            while not _answers(broker.bootstrap, broker.broker_port):
                if process.poll() is not None or time.monotonic() > deadline:
                    tail = log_path.read_text(errors="replace")[-2000:]
                    raise RuntimeError(
                        f"the Kafka broker did not answer on {broker.bootstrap}: {tail}"
                    )
                time.sleep(0.3)
            yield broker.bootstrap
        finally:
            _stop(process)


@contextlib.contextmanager
def kafka_broker(work: Path) -> Iterator[str]:
    """Format the storage, start a KRaft broker, yield its bootstrap address; stop it afterwards."""
    with running(format_broker(work)) as bootstrap:
        yield bootstrap
