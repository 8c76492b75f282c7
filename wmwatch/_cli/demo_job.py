"""``wmwatch demo``: a real local streaming query over an out-of-order event stream, watched.

A generator thread lands JSON files in ``<workdir>/in`` every half second. Event times trail
the clock by a little jitter, and a share of rows arrive 15-90 s late, so the 10-second
watermark drops some of them. A windowed count runs on a local SparkSession with wmwatch
attached (metrics on HTTP, history in DuckDB, late rows audited when the audit is available),
and the report is printed at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from wmwatch._errors import ConfigError
from wmwatch._text import get_logger

log = get_logger("wmwatch")


MARKER = ".wmwatch-demo"
"""The file that says a folder is the demo's: only such a folder is ever cleared."""

# What a run leaves in its folder; clearing removes these names and nothing else.
_DEMO_ENTRIES = (
    "in",
    "checkpoint",
    "wmwatch.duckdb",
    "wmwatch.duckdb.wal",
    "wmwatch.duckdb.lock",
    "log4j2.properties",
    "spark.log",
    "bronze",
    "bronze-checkpoint",
    "report.html",
)


def claim_workdir(workdir: Path) -> Path:
    """The demo's folder, made or cleared of an earlier run; ConfigError for someone else's.

    A folder is the demo's when it holds the marker the demo writes, or is new or empty: a
    folder with anything else in it (``--workdir .`` or ``~``) is refused, never emptied.
    """
    folder = workdir.expanduser().absolute()
    marker = folder / MARKER
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise ConfigError(
            f"--workdir {folder} is not a folder: pass a new folder for the demo "
            "(e.g. --workdir wmwatch-demo)"
        )
    if folder.is_dir() and not marker.is_file() and any(folder.iterdir()):
        raise ConfigError(
            f"--workdir {folder} already holds files the demo did not make (no {MARKER} "
            "marker), and the demo clears its folder: pass a new or empty folder"
        )
    if marker.is_symlink():
        raise ConfigError(f"{marker} is a symbolic link: remove it or pass a new folder")
    folder.mkdir(parents=True, exist_ok=True)
    if not marker.exists():
        marker.write_text(
            "This folder belongs to `wmwatch demo`, which clears what it made here on each run.\n"
        )
    _clear_earlier_run(folder)
    return folder


def _clear_earlier_run(folder: Path) -> None:
    leftovers = [folder / name for name in _DEMO_ENTRIES] + list(folder.glob(".part-*.tmp"))
    for entry in leftovers:
        # a link is removed, never followed into
        if entry.is_symlink() or entry.is_file():
            entry.unlink()
        elif entry.is_dir():
            shutil.rmtree(entry)


@dataclass
class DemoResult:
    db: Path
    batches: int
    input_rows: int
    rows_dropped: int
    late_rows_audited: int | None
    metrics_url: str | None


class EventGenerator(threading.Thread):
    """Writes one file of events every ``interval_seconds``; a share of them late."""

    def __init__(
        self,
        folder: Path,
        *,
        interval_seconds: float = 0.5,
        rows_per_file: int = 40,
        late_share: float = 0.05,
        seed: int = 7,
    ) -> None:
        super().__init__(name="wmwatch-demo-generator", daemon=True)
        self.folder = folder
        self.interval_seconds = interval_seconds
        self.rows_per_file = rows_per_file
        self.late_share = late_share
        self.random = random.Random(seed)
        self.stop_event = threading.Event()
        self.files = 0
        self.rows = 0

    def run(self) -> None:
        users = [f"user-{i}" for i in range(20)]
        while not self.stop_event.is_set():
            now = datetime.now(UTC)
            lines = []
            for _ in range(self.rows_per_file):
                if self.random.random() < self.late_share:
                    event_time = now - timedelta(seconds=self.random.uniform(15, 90))
                else:
                    event_time = now - timedelta(seconds=self.random.uniform(0, 4))
                lines.append(
                    json.dumps(
                        {
                            "event_time": event_time.isoformat(timespec="milliseconds").replace(
                                "+00:00", "Z"
                            ),
                            "user": self.random.choice(users),
                            "amount": round(self.random.uniform(1, 200), 2),
                        }
                    )
                )
            tmp = self.folder.parent / f".part-{self.files:06d}.tmp"
            tmp.write_text("\n".join(lines) + "\n")
            os.replace(tmp, self.folder / f"part-{self.files:06d}.json")
            self.files += 1
            self.rows += len(lines)
            self.stop_event.wait(self.interval_seconds)


_QUIET_LOG4J = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.abort.name = org.apache.spark.sql.execution.datasources.v2
logger.abort.level = fatal
"""


def build_session(
    workdir: Path, app_name: str = "wmwatch-demo", master: str = "local[2]", delta: bool = False
) -> Any:
    """A session that keeps the terminal for the demo (errors only, no stage bars).

    ``master`` is ``local[2]`` by default; a cluster's URL (``spark://host:7077``) runs the
    executors in their own JVMs, which read the demo's input and checkpoint from ``workdir``:
    it must be a folder they see at the same path (one machine, or a shared mount). Spark's own
    output goes to ``<workdir>/spark.log``; a start that fails raises SparkStartError (one line).
    """
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module="pyspark")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from wmwatch._cli.spark_start import delta_jars, start_session

    log4j = workdir / "log4j2.properties"
    log4j.write_text(_QUIET_LOG4J)
    settings = {
        "spark.master": master,
        "spark.app.name": app_name,
        "spark.driver.extraJavaOptions": f"-Dlog4j2.configurationFile=file:{log4j}",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.ui.enabled": "false",
        "spark.sql.session.timeZone": "UTC",
        "spark.scheduler.mode": "FAIR",
        "spark.sql.adaptive.enabled": "false",
    }
    if delta:
        settings |= {
            "spark.jars": ",".join(str(jar) for jar in delta_jars()),
            "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
            "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
            "spark.databricks.delta.snapshotPartitions": "2",
        }
    spark = start_session(settings, log=workdir / "spark.log")
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def run_demo(
    *,
    duration_seconds: float,
    metrics_port: int,
    workdir: Path,
    console: Any,
    audit: bool = True,
    master: str = "local[2]",
    source_format: str = "json",
) -> DemoResult:
    """Run the demo query for ``duration_seconds`` and return what it recorded."""
    from rich.markup import escape
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    import wmwatch

    # executors outside this process read the input and checkpoint by path
    workdir = claim_workdir(workdir)
    incoming = workdir / "in"
    incoming.mkdir(parents=True)
    db = workdir / "wmwatch.duckdb"

    where = "a local SparkSession" if master.startswith("local") else f"a SparkSession on {master}"
    console.print(f"[bold]wmwatch demo[/]: starting {escape(where)} (takes ~10 s) ...")
    spark = build_session(workdir, master=master, delta=source_format == "delta")
    from pyspark.sql import functions as F

    generator = EventGenerator(incoming)
    generator.start()
    watch = wmwatch.attach(spark, db=str(db), metrics_port=metrics_port)
    if watch.metrics_url:
        console.print(f"Prometheus metrics: [cyan]{watch.metrics_url}[/]")
    for problem in watch.problems:
        console.print(f"[yellow]note:[/] {escape(str(problem))}")
    schema = "event_time timestamp, user string, amount double"
    landed = spark.readStream.schema(schema).option("maxFilesPerTrigger", 20).json(str(incoming))
    bronze_query = None
    if source_format == "delta":
        # bronze: the landing files copied into a Delta table, which the query reads as a stream
        bronze = str(workdir / "bronze")
        spark.createDataFrame([], schema).write.format("delta").save(bronze)
        bronze_query = (
            landed.writeStream.format("delta")
            .option("checkpointLocation", str(workdir / "bronze-checkpoint"))
            .trigger(processingTime="1 second")
            .start(bronze)
        )
        landed = spark.readStream.format("delta").option("maxFilesPerTrigger", 20).load(bronze)
    events = landed.withWatermark("event_time", "10 seconds")
    totals = events.groupBy(F.window("event_time", "10 seconds"), "user").agg(
        F.count("*").alias("orders"), F.sum("amount").alias("revenue")
    )
    query = (
        totals.writeStream.outputMode("append")
        .format("memory")
        .queryName("demo_revenue_per_user")
        .option("checkpointLocation", str(workdir / "checkpoint"))
        .trigger(processingTime="1 second")
        .start()
    )
    audit_handle = None
    if audit:
        try:
            audit_handle = watch.audit(query, events)
        except Exception as exc:  # noqa: BLE001 - the demo goes on without the audit
            console.print(f"[yellow]late-row audit not started:[/] {escape(str(exc))}")
    try:
        with Progress(
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        ) as progress:
            task = progress.add_task("streaming", total=duration_seconds, stats="")
            started = time.monotonic()
            while (elapsed := time.monotonic() - started) < duration_seconds:
                if not query.isActive:
                    break
                snap = watch.latest("demo_revenue_per_user")
                state = next(
                    (s for s in watch.queries() if s.label == "demo_revenue_per_user"), None
                )
                stats = ""
                if snap is not None and state is not None:
                    dropped = sum(state.dropped_total.values())
                    lag = snap.watermark_lag_seconds
                    stats = (
                        f"batch {snap.batch_id}  rows {state.input_rows_total}  "
                        f"dropped {dropped}  lag {lag:.1f}s"
                        if lag is not None
                        else f"batch {snap.batch_id}  rows {state.input_rows_total}"
                    )
                progress.update(task, completed=elapsed, stats=stats)
                time.sleep(0.5)
            progress.update(task, completed=duration_seconds)
    finally:
        generator.stop_event.set()
        generator.join(timeout=5)
        # let the last files finish instead of aborting a batch; a failed query still reports
        if bronze_query is not None:
            with contextlib.suppress(Exception):
                bronze_query.processAllAvailable()
            bronze_query.stop()
        with contextlib.suppress(Exception):
            query.processAllAvailable()
        query.stop()
        late_rows: int | None = None
        if audit_handle is not None:
            try:
                audit_handle.sync(timeout=60)  # audit every batch the query committed
                audit_handle.stop()
                late_rows = int(audit_handle.status().get("late_rows", 0))
            except Exception as exc:  # noqa: BLE001
                console.print(f"[yellow]audit stop failed:[/] {escape(str(exc))}")
        state = next((s for s in watch.queries() if s.label == "demo_revenue_per_user"), None)
        watch.close()
        spark.stop()
    return DemoResult(
        db=db,
        batches=state.batches_total if state else 0,
        input_rows=state.input_rows_total if state else 0,
        rows_dropped=sum(state.dropped_total.values()) if state else 0,
        late_rows_audited=late_rows,
        metrics_url=watch.metrics_url,
    )
