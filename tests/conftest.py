"""Shared fixtures: one local SparkSession per test run, temporary folders for streams."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from tests import jvm_archive
from tests.kafka_broker import JarsMissing, connector_jars

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

# CI replays the same generated examples on every run (a failure there reproduces exactly);
# elsewhere each run explores new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")
# Python workers run the interpreter of the tests, so functions they unpickle (state functions,
# data sources) find the same packages
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
# every Spark JVM of the run (this process's, the drivers it starts, the Connect server) starts
# from the class-data archive noxfile.py builds; the short-lived ones with the client compiler
# only, the session below, the Connect server and the storm's driver with both
# (tests/jvm_archive.py)
jvm_archive.apply(os.environ)
# A query with nothing new to read polls its sources every spark.sql.streaming.pollingDelay
# (Spark's default 10 ms): an idle file-source query then keeps a quarter of a core busy, and
# the tests' queries are often idle (a driver between files, a query waiting for its audit).
# Every Spark JVM of the run (a system property in SPARK_SUBMIT_OPTS reaches each SparkConf)
# polls every 100 ms instead: 0.28 -> 0.07 of a core for an idle query, measured here; a new
# file is read at most 0.1 s later.
IDLE_POLL_OPTION = "-Dspark.sql.streaming.pollingDelay=100ms"
_jvm_options = os.environ.get(jvm_archive.VARIABLE, "").split()
# and Spark's expressions outside whole-stage code interpreted (jvm_archive.INTERPRETED_OPTION)
_missing = [o for o in (IDLE_POLL_OPTION, jvm_archive.INTERPRETED_OPTION) if o not in _jvm_options]
if _missing:
    os.environ[jvm_archive.VARIABLE] = " ".join([*_jvm_options, *_missing])


def _java_available() -> bool:
    try:
        return subprocess.run(["java", "-version"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


# ``WMWATCH_TEST_SPARK=connect`` runs the Spark tests it selects on a Spark Connect session to a
# real server process instead (a process is either a Connect client or classic PySpark, never
# both: pyspark's functions follow the mode of the process)
CONNECT = os.environ.get("WMWATCH_TEST_SPARK") == "connect"
# A run that starts another pytest (tests/test_connect_suite.py) hands it its own Spark Connect
# server and Kafka broker through these, so neither is started twice
CONNECT_URL_VARIABLE = "WMWATCH_TEST_CONNECT_URL"
KAFKA_VARIABLE = "WMWATCH_TEST_KAFKA"


# Delta Lake runs on pyspark 4.2 (no Delta release supports 4.3): the Delta tests run in the
# pyspark 4.2 environment of noxfile.py, whose session loads Delta's jars (.ci/fetch_jars.sh)
DELTA = importlib.metadata.version("pyspark").startswith("4.2.")


def jar_set(name: str) -> list[str]:
    """The jars of one set fetched by .ci/fetch_jars.sh (tests/jars/<name>/pom.xml)."""
    cache = Path(os.environ.get("WMWATCH_JAR_CACHE", Path.home() / ".cache/wmwatch/jars"))
    jars = sorted(str(p) for p in (cache / name).glob("*.jar"))
    if not jars:
        pytest.fail(f"no jars in {cache / name}: run bash .ci/fetch_jars.sh first")
    return jars


# ``WMWATCH_TEST_SHARED_SERVERS=1`` (noxfile.py sets it) on a run spread over processes
# (``pytest -n 2``): the run's controller starts the one Kafka broker and the one Spark Connect
# server before its workers start and hands both to them through the variables above, so the
# workers share one server of each kind; both are stopped, by pid, when the run ends.
SHARED_SERVERS_VARIABLE = "WMWATCH_TEST_SHARED_SERVERS"
_shared_servers = contextlib.ExitStack()


def _is_xdist_controller(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get(SHARED_SERVERS_VARIABLE) != "1" or not _is_xdist_controller(config):
        return
    import tempfile

    from tests.connect_server import connect_server
    from tests.kafka_broker import kafka_broker

    work = Path(
        _shared_servers.enter_context(
            tempfile.TemporaryDirectory(prefix="wmwatch-test-servers-", ignore_cleanup_errors=True)
        )
    )
    try:
        if KAFKA_VARIABLE not in os.environ:
            connector_jars()  # the connector's jars, or the error that says to fetch them
            os.environ[KAFKA_VARIABLE] = _shared_servers.enter_context(kafka_broker(work / "kafka"))
        if CONNECT_URL_VARIABLE not in os.environ and _java_available():
            os.environ[CONNECT_URL_VARIABLE] = _shared_servers.enter_context(
                connect_server(work / "connect")
            )
    except BaseException:
        _shared_servers.close()
        raise


def pytest_unconfigure(config: pytest.Config) -> None:
    _shared_servers.close()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A classic run leaves out the tests only a Spark Connect session can run (deselected, not
    skipped: ``tests/test_connect_suite.py`` runs them on its server).

    A run spread over processes (``--dist loadgroup --no-loadscope-reorder``, noxfile.py) hands
    tests out one by one in this order: the longest first, so that the two processes end
    together (a long test handed out last keeps one process busy after the other finished).
    Tests go out one by one, so a module-scoped fixture starts once in each process that runs
    one of its tests (pytest-xdist's ``xdist_group`` would keep a module together, but under
    pytest 9 it does not take effect: xdist 3.8 renames a test through an attribute pytest no
    longer reads)."""
    if not CONNECT:
        kept = [item for item in items if item.get_closest_marker("connect") is None]
        if len(kept) != len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in kept])
            items[:] = kept
    if _spread(config):
        items.sort(key=_expected_minutes, reverse=True)  # stable: the rest keep their order


def _spread(config: pytest.Config) -> bool:
    # collection happens in xdist's workers only, which see ``dist`` as "no" and ``loadgroup`` set
    return bool(getattr(config.option, "loadgroup", False))


def _expected_minutes(item: pytest.Item) -> float:
    """What a test takes in a two-process run, from its ``slow`` mark (``minutes=``, 1 if not
    given); 0 without the mark."""
    mark = item.get_closest_marker("slow")
    return 0.0 if mark is None else float(mark.kwargs.get("minutes", 1.0))


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """The run's one local SparkSession (FAIR scheduler so audit pools can yield)."""
    if not _java_available():
        pytest.fail("Java 17 is required for the Spark tests: install openjdk-17-jre-headless")
    from pyspark.sql import SparkSession

    if CONNECT:
        from tests.connect_server import connect_server

        given = os.environ.get(CONNECT_URL_VARIABLE)
        with (
            contextlib.nullcontext(given)
            if given
            else connect_server(tmp_path_factory.mktemp("connect-server"))
        ) as url:
            remote = SparkSession.builder.remote(url).getOrCreate()
            yield remote
            for query in remote.streams.active:
                with contextlib.suppress(Exception):  # best effort at teardown
                    query.stop()
            remote.stop()
        return

    builder = SparkSession.builder
    # Spark's Kafka connector, when fetched (CI always fetches it; the `kafka` fixture fails
    # loudly without it)
    with contextlib.suppress(JarsMissing):
        builder = builder.config("spark.jars", ",".join(connector_jars()))
    if DELTA:
        builder = (
            builder.config("spark.jars", ",".join(jar_set("delta")))
            .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
            .config(
                "spark.sql.catalog.spark_catalog",
                "org.apache.spark.sql.delta.catalog.DeltaCatalog",
            )
            # Delta rebuilds a snapshot in 50 tasks by default: far too many for 2 cores
            .config("spark.databricks.delta.snapshotPartitions", "2")
        )
    for key, value in jvm_archive.long_lived_conf().items():
        builder = builder.config(key, value)
    session = (
        builder.master("local[2]")
        .appName("wmwatch-tests")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.scheduler.mode", "FAIR")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.streaming.noDataProgressEventInterval", "1000")
        .config("spark.sql.adaptive.enabled", "false")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    for query in session.streams.active:
        with contextlib.suppress(Exception):  # best effort at teardown
            query.stop()
    session.stop()


@pytest.fixture(autouse=True)
def _no_query_outlives_its_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """A streaming query a test leaves running in its process's shared session keeps polling
    its source for the rest of the run, taking CPU from every later test: it is stopped when
    the test ends (after the test's own fixtures), and the test fails, naming it."""
    yield
    if "spark" not in request.fixturenames:
        return
    session = request.getfixturevalue("spark")
    left = list(session.streams.active)
    for query in left:
        with contextlib.suppress(Exception):  # best effort: the test's outcome stands
            query.stop()
    if left:
        names = ", ".join(sorted(str(q.name or q.id) for q in left))
        pytest.fail(f"the test left queries running in the shared session: {names}")


@pytest.fixture
def delta_spark(spark: Any) -> Any:
    """The run's session, which must be the pyspark 4.2 one with Delta's jars."""
    if not DELTA:
        pytest.fail("the Delta tests run on pyspark 4.2 with Delta's jars: run `nox -s delta`")
    return spark


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The run's one Kafka broker (KRaft, 127.0.0.1), started the first time a test needs it
    (or the one the run that started this pytest hands over); yields its bootstrap address."""
    from tests.kafka_broker import kafka_broker

    try:
        connector_jars()
    except JarsMissing as exc:
        pytest.fail(str(exc))
    given = os.environ.get(KAFKA_VARIABLE)
    if given:
        yield given
        return
    with kafka_broker(tmp_path_factory.mktemp("kafka")) as bootstrap:
        yield bootstrap


@pytest.fixture(scope="session")
def connect_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The run's one Spark Connect server process, started the first time a test needs it (or
    the one the run's controller started for its workers); yields its ``sc://`` URL."""
    given = os.environ.get(CONNECT_URL_VARIABLE)
    if given:
        yield given
        return
    if not _java_available():
        pytest.fail("Java 17 is required for the Spark tests: install openjdk-17-jre-headless")
    from tests.connect_server import connect_server

    with connect_server(tmp_path_factory.mktemp("connect-server")) as url:
        yield url


@pytest.fixture
def stream_dir(tmp_path: Path) -> Path:
    """A folder for a test's input files, checkpoints and database."""
    for sub in ("in", "checkpoint", "out"):
        (tmp_path / sub).mkdir()
    return tmp_path
