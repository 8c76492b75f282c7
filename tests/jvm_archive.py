"""A class-data archive of Spark's JVM, so that each Spark JVM the tests start starts cheaply.

The suite starts dozens of short-lived Spark JVMs (drivers killed and restarted, sidecars, the
benchmarks at ``--tiny``, the Connect server), and on a 2-core machine their start is a large
part of CI's time: loading and verifying Spark's classes from its jars and compiling the start's
code with both JIT compilers cost 17 CPU seconds for a session and one small job. Mapping the
classes from an archive (Java's AppCDS, ``-XX:SharedArchiveFile``) and compiling with the client
compiler only (``-XX:TieredStopAtLevel=1``) brings that to about 5 (docs/development.md).

- ``python -m tests.jvm_archive`` builds the archive once per pyspark and Java into
  ``~/.cache/wmwatch/cds/`` (noxfile.py runs it before each test session): a short workload of
  the kinds of queries the tests run, in a JVM that writes the classes it loaded at its exit.
- ``tests/conftest.py`` puts the options in ``SPARK_SUBMIT_OPTS``, which every JVM that
  ``spark-submit`` launches reads (pyspark's own, the drivers the tests start as processes, the
  Connect server); the variable passes to the tests' processes with the environment. The JVMs
  that live the whole run (each test process's session, the Connect server) keep both
  compilers (``long_lived_conf``): measured over the suite, their tests ran 5-30% slower with
  the client compiler alone; so does a short-lived one that moves a lot of data
  (``both_compilers``: the two-million-row storm).
- ``python -m tests.jvm_archive --measure`` starts Spark with and without it in alternation and
  prints the CPU and wall seconds of each start, with the machine.

Test speed only: wmwatch sets no JVM option, and a JVM whose class path is not the archive's
(extra jars on it) ignores the archive and starts the usual way.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

VARIABLE = "SPARK_SUBMIT_OPTS"
# the client compiler only: a short-lived JVM spends less on compiling than it gains from C2
COMPILER_OPTION = "-XX:TieredStopAtLevel=1"
# ... and both compilers for a JVM that lives the whole run: its hot code runs long enough for C2
LONG_LIVED_OPTION = "-XX:TieredStopAtLevel=4"
# Expressions evaluated outside whole-stage code (a state store's keys, a join's sides, the
# projections around a batch) interpreted instead of compiled to a class each: the tests'
# queries are many and small, and compiling took more time than running them (the exactness
# modules 240 -> 176 s, the sidecar of a stopped query 104 -> 67 s, measured here). Whole-stage
# code generation stays on, so the plans wmwatch reads are the ones production runs. A Spark
# SQL setting, as a system property in VARIABLE so that it reaches every Spark JVM of the run.
INTERPRETED_OPTION = "-Dspark.sql.codegen.factoryMode=NO_CODEGEN"
# an archive that does not fit the JVM is ignored; its warning would go to the driver's stdout
QUIET_OPTION = "-Xlog:cds*=off"
BUILD_TIMEOUT_SECONDS = 600


def _cache() -> Path:
    return Path(os.environ.get("WMWATCH_CDS_CACHE", Path.home() / ".cache/wmwatch/cds"))


def _java_identity() -> str:
    java = shutil.which("java")
    if java is None:
        return "no-java"
    home = Path(os.path.realpath(java)).parents[1]
    release = home / "release"
    return f"{home}\n{release.read_text() if release.is_file() else ''}"


def archive_path() -> Path:
    """Where the archive of this pyspark and this Java is (whether or not it exists)."""
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    listing = sorted(f"{p.name}:{p.stat().st_size}" for p in jars.glob("*.jar"))
    key = hashlib.sha256(
        "\n".join([importlib.metadata.version("pyspark"), _java_identity(), *listing]).encode()
    ).hexdigest()[:16]
    return _cache() / f"spark-{importlib.metadata.version('pyspark')}-{key}.jsa"


def java_options() -> list[str]:
    """The options the tests' Spark JVMs start with: the archive's when it is built."""
    archive = archive_path()
    if archive.is_file():
        return [f"-XX:SharedArchiveFile={archive}", QUIET_OPTION, COMPILER_OPTION]
    return [COMPILER_OPTION]


def long_lived_conf() -> dict[str, str]:
    """Spark settings for a JVM that runs the whole test run (a process's shared session, the
    Connect server): both JIT compilers again, as its hot code runs for many minutes
    (``spark.driver.extraJavaOptions`` follows ``SPARK_SUBMIT_OPTS`` on the command line)."""
    return {"spark.driver.extraJavaOptions": LONG_LIVED_OPTION}


def both_compilers(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` for a short-lived JVM that moves a lot of data (the two-million-row storm):
    both compilers, as its hot loops run long enough for C2 (its audit took 2.3x as long with
    the client compiler alone), and Spark's expressions compiled rather than interpreted (the
    storm took 65 s interpreted against 50 s compiled)."""
    options = environ.get(VARIABLE, "").split()
    kept = [option for option in options if option not in (COMPILER_OPTION, INTERPRETED_OPTION)]
    return {**environ, VARIABLE: " ".join([*kept, LONG_LIVED_OPTION])}


def apply(environ: os._Environ[str] | dict[str, str]) -> None:
    """Add the options to ``SPARK_SUBMIT_OPTS`` in ``environ``, once."""
    current = environ.get(VARIABLE, "")
    if COMPILER_OPTION in current.split():
        return
    environ[VARIABLE] = " ".join([current, *java_options()]).strip()


def _run_self(
    mode: str, env: dict[str, str], *, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """This module in a process of its own (``--workload``, ``--start-once``), bounded in time."""
    return subprocess.run(
        [sys.executable, "-m", "tests.jvm_archive", mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_SECONDS,
        check=check,
    )


def build() -> int:
    """Build the archive if this pyspark and Java have none; 0 when it is there after."""
    archive = archive_path()
    if archive.is_file():
        print(f"class-data archive for Spark's JVM: cached ({archive})")
        return 0
    archive.parent.mkdir(parents=True, exist_ok=True)
    partial = archive.with_name(f".{archive.name}.{os.getpid()}.partial")
    env = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        VARIABLE: f"-XX:ArchiveClassesAtExit={partial} {QUIET_OPTION} {COMPILER_OPTION}",
        "PYTHONPATH": str(Path(__file__).parents[1]),
    }
    started = time.monotonic()
    try:
        run = _run_self("--workload", env)
    except subprocess.TimeoutExpired:
        partial.unlink(missing_ok=True)
        print(
            f"class-data archive: the workload ran past {BUILD_TIMEOUT_SECONDS} s; "
            "the tests run without it (slower)"
        )
        return 1
    if run.returncode != 0 or not partial.is_file() or partial.stat().st_size < 1 << 20:
        partial.unlink(missing_ok=True)
        print(
            f"class-data archive: not built (exit {run.returncode}); the tests run without it "
            f"(slower):\n{run.stderr[-2000:]}"
        )
        return 1
    partial.replace(archive)
    print(
        f"class-data archive for Spark's JVM: built in {time.monotonic() - started:.0f} s "
        f"({archive}, {archive.stat().st_size >> 20} MiB)"
    )
    return 0


def _workload() -> None:
    """The kinds of work the tests give Spark: a batch job, windowed, deduplicating and joined
    streams over JSON files, a ``foreachBatch`` sink; then the JVM exits so it writes the
    archive."""
    import json
    import tempfile

    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    from tests.harness.crash import driver_session

    spark = driver_session("wmwatch-jvm-archive")  # as the drivers the tests start
    gateway = spark.sparkContext._gateway
    with tempfile.TemporaryDirectory(prefix="wmwatch-jvm-archive-") as tmp:
        work = Path(tmp)
        spark.range(1000).groupBy((F.col("id") % 7).alias("k")).count().collect()
        for side in ("left", "right"):
            (work / side).mkdir()
            rows = [{"k": i % 5, "ts": f"2026-01-01T00:00:{i % 60:02d}Z"} for i in range(50)]
            (work / side / "a.json").write_text("\n".join(json.dumps(r) for r in rows))

        def stream(side: str) -> DataFrame:
            return (
                spark.readStream.schema("k INT, ts TIMESTAMP")
                .json(str(work / side))
                .withWatermark("ts", "10 seconds")
            )

        left, right = stream("left"), stream("right").withColumnRenamed("k", "rk")
        queries = {
            "window": stream("left").groupBy(F.window("ts", "10 seconds")).count(),
            "dedupe": stream("left").dropDuplicatesWithinWatermark(["k"]),
            "join": left.join(
                right.withColumnRenamed("ts", "rts"),
                F.expr("k = rk AND rts BETWEEN ts - INTERVAL 5 SECONDS AND ts"),
            ),
        }
        for name, frame in queries.items():
            writer = frame.writeStream.option("checkpointLocation", str(work / f"cp-{name}"))
            if name == "window":
                writer = writer.foreachBatch(lambda batch, _id: batch.count())
            else:
                writer = writer.format("noop")
            writer.trigger(availableNow=True).start().awaitTermination(300)
    spark.stop()
    # the JVM exits when its standard input closes; the archive is written on the way out
    process = getattr(gateway, "proc", None)
    if process is not None:
        if process.stdin is not None:
            process.stdin.close()
        process.wait(timeout=300)


def _start_once() -> None:
    """Start Spark, run one small job, print the JVM's CPU seconds so far, stop."""
    from benchmarks._cpu import _process_seconds
    from tests.harness.crash import driver_session

    spark = driver_session("wmwatch-jvm-start")
    spark.range(1000).selectExpr("id % 7 AS k").groupBy("k").count().collect()
    print(_process_seconds(spark.sparkContext._gateway.proc.pid))
    spark.stop()


def measure(rounds: int = 3) -> None:
    """A Spark JVM's start (a session and one small job) with the archive and without, in
    alternation on this machine: CPU seconds of the JVM and wall seconds, the median of each."""
    sys.path.insert(0, str(Path(__file__).parents[1]))
    from benchmarks._machine import print_machine

    print_machine()
    if build() != 0:
        return
    base = {
        **os.environ,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "PYTHONPATH": str(Path(__file__).parents[1]),
    }
    base.pop(VARIABLE, None)
    ways = {"without": base, "with": {**base, VARIABLE: " ".join(java_options())}}
    figures: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, env in ways.items():
            started = time.monotonic()
            run = _run_self("--start-once", env, check=True)
            wall = time.monotonic() - started
            figures[name].append((float(run.stdout.strip().splitlines()[-1]), wall))
    for name, runs in figures.items():
        cpu = sorted(c for c, _ in runs)[len(runs) // 2]
        wall = sorted(w for _, w in runs)[len(runs) // 2]
        print(f"{name} the archive: JVM CPU {cpu:.1f} s, wall {wall:.1f} s (median of {rounds})")


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments == ["--workload"]:
        _workload()
    elif arguments == ["--start-once"]:
        _start_once()
    elif arguments == ["--measure"]:
        measure()
    else:
        sys.exit(build())
