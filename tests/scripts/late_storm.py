"""A late-row storm against a real query with the audit attached, in a driver of its own.

    python tests/scripts/late_storm.py FOLDER ROWS [--parquet] [--cap N]

A windowed count (watermark 1 minute, 5-minute windows, append mode, noop sink) on ``local[2]``
with Spark's default memory reads one JSON file per batch: a few ordinary rows; one row three
days ahead, which moves the watermark; then ROWS old rows (id, timestamp, a 60-character string)
in one file, every one of them behind the watermark; then two more ordinary files. wmwatch is
attached with the audit (DuckDB sink, optionally with a Parquet overflow folder).

Prints one JSON line: whether the query survived and went on, Spark's and the audit's counts,
the driver's Python RSS (baseline and peak, sampled every 20 ms), and the audit's time for the
storm batch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """Samples this process's resident set size on a thread of its own."""

    def __init__(self, interval: float = 0.02) -> None:
        self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)
        self._thread.start()

    def _run(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.peak = max(self.peak, rss_bytes())

    def reset(self) -> int:
        self.peak = rss_bytes()
        return self.peak

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def iso(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def write_file(
    folder: Path, name: str, lines: list[str] | None = None, *, old_rows: int = 0
) -> None:
    """Write a JSON-lines file atomically; ``old_rows`` rows spread over T0's first hour."""
    tmp = folder.parent / f".{name}.tmp"
    with tmp.open("w", encoding="utf-8") as handle:
        if lines:
            handle.write("\n".join(lines) + "\n")
        pad = "x" * 60
        block: list[str] = []
        for i in range(old_rows):
            at = T0 + timedelta(milliseconds=(i * 1_799) % 3_600_000)
            block.append(f'{{"id":{i},"t":"{iso(at)}","s":"{pad}"}}\n')
            if len(block) == 50_000:
                handle.write("".join(block))
                block.clear()
        handle.write("".join(block))
    os.replace(tmp, folder / name)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder", type=Path)
    parser.add_argument("rows", type=int)
    parser.add_argument("--parquet", action="store_true", help="keep every row in Parquet too")
    parser.add_argument("--cap", type=int, default=None, help="max_rows_per_batch")
    parser.add_argument("--remote", default=None, help="a Spark Connect server's sc:// URL")
    args = parser.parse_args()
    folder: Path = args.folder
    incoming = folder / "in"
    incoming.mkdir(parents=True, exist_ok=True)
    rss = PeakRss()

    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import wmwatch

    if args.remote:
        # a Spark Connect client: the query runs in the server; this process holds the audit
        spark = SparkSession.builder.remote(args.remote).getOrCreate()
    else:
        # Spark's defaults (driver memory included) but for a small number of shuffle partitions
        spark = (
            SparkSession.builder.master("local[2]")
            .appName("wmwatch-late-storm")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.session.timeZone", "UTC")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
    ahead = T0 + timedelta(days=3)
    write_file(incoming, "f0.json", [json.dumps({"id": -1, "t": iso(T0), "s": "first"})])
    write_file(incoming, "f1.json", [json.dumps({"id": -2, "t": iso(ahead), "s": "ahead"})])
    events = (
        spark.readStream.schema("id long, t timestamp, s string")
        .option("maxFilesPerTrigger", 1)
        .json(str(incoming))
        .withWatermark("t", "1 minute")
    )
    query = (
        events.groupBy(F.window("t", "5 minutes"))
        .count()
        .writeStream.format("noop")
        .outputMode("append")
        .queryName("storm")
        .option("checkpointLocation", str(folder / "checkpoint"))
        .start()
    )
    watch = wmwatch.attach(spark, db=str(folder / "history.duckdb"), metrics_port=None)
    options: dict[str, object] = {"poll_interval_seconds": 0.2}
    if args.parquet:
        options["parquet_path"] = str(folder / "late-parquet")
    if args.cap is not None:
        options["max_rows_per_batch"] = args.cap
    audit = watch.audit(query, events, **options)
    query.processAllAvailable()
    assert audit.sync(120), audit.status()

    baseline = rss.reset()
    write_file(incoming, "f2.json", old_rows=args.rows)
    started = time.monotonic()
    query.processAllAvailable()
    storm_batch = query.lastProgress["batchId"]
    query_seconds = time.monotonic() - started
    synced = audit.sync(1800)
    audit_seconds = time.monotonic() - started
    peak = rss.peak
    for name, at in (
        ("f3.json", ahead + timedelta(minutes=10)),
        ("f4.json", ahead + timedelta(minutes=20)),
    ):
        write_file(incoming, name, [json.dumps({"id": -3, "t": iso(at), "s": "after"})])
        query.processAllAvailable()
    after = [
        p["batchId"]
        for p in query.recentProgress
        # the attribute: a Spark Connect client's progress has no numInputRows key
        if p["batchId"] > storm_batch and p.numInputRows
    ]
    dropped = sum(
        op.get("numRowsDroppedByWatermark", 0)
        for p in query.recentProgress
        for op in p.get("stateOperators", [])
    )
    audit.sync(120)
    status = audit.status()
    alive = query.isActive and query.exception() is None
    if args.remote:
        context_alive = spark.range(3).count() == 3
    else:
        context_alive = not spark.sparkContext._jsc.sc().isStopped()
    watch.flush(60)
    query.stop()
    watch.close()
    spark.stop()
    peak = max(peak, rss.stop())
    print(
        json.dumps(
            {
                "rows": args.rows,
                "storm_batch": storm_batch,
                "synced": synced,
                "query_alive": alive,
                "context_alive": context_alive,
                "batches_after_storm": after,
                "spark_groups_dropped": dropped,
                "status": status,
                "rss_baseline_bytes": baseline,
                "rss_peak_bytes": peak,
                "query_seconds": round(query_seconds, 2),
                "audit_seconds": round(audit_seconds, 2),
                "audit_after_commit_seconds": round(audit_seconds - query_seconds, 2),
                "audit_rows_per_second": round(
                    args.rows / max(audit_seconds - query_seconds, 1e-3)
                ),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
