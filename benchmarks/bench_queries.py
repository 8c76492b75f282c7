"""Does the audit of one query slow down the other queries of the same application?

    python benchmarks/bench_queries.py [--files 12] [--rows 20000] [--repeats 2]

Three production queries run at once in one SparkSession (``local[2]``): windowed counts over
JSON files, one file per batch (availableNow + maxFilesPerTrigger=1). The first, ``audited``,
has 1% late rows and is audited into DuckDB in the "on" runs; the two others, ``other_1`` and
``other_2``, have none and are never audited. The figure is the throughput of the two others
(rows per second from start to their end) with the audit on over the same without it, runs
alternated off/on. It is measured under both ``spark.scheduler.mode`` values, FIFO (Spark's
default) and FAIR, each in a driver process of its own (the mode is fixed when the
SparkContext starts); both are run by one invocation, one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import print_machine
from bench_audit import DELAY, SCHEMA, write_input

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

QUERIES = ("audited", "other_1", "other_2")


def run_round(spark: Any, base: Path, tag: str, *, audit: bool) -> dict[str, Any]:
    """Start the three queries together; the others' rows per second and the audit's status."""
    from prometheus_client import CollectorRegistry
    from pyspark.sql import functions as F

    import wmwatch

    work = base / tag
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    watch = wmwatch.attach(
        spark, db=str(work / "h.duckdb"), metrics_port=None, registry=CollectorRegistry()
    )
    try:
        started = time.perf_counter()
        queries: dict[str, Any] = {}
        frames: dict[str, Any] = {}
        for name in QUERIES:
            events = (
                spark.readStream.schema(SCHEMA)
                .option("maxFilesPerTrigger", 1)
                .json(str(base / name / "in"))
                .withWatermark("ts", DELAY)
            )
            frames[name] = events
            queries[name] = (
                events.groupBy(F.window("ts", "10 seconds"), "user")
                .count()
                .writeStream.format("noop")
                .outputMode("append")
                .queryName(f"{name}_{tag}")
                .option("checkpointLocation", str(work / name))
                .trigger(availableNow=True)
                .start()
            )
        handle = watch.audit(queries["audited"], frames["audited"]) if audit else None
        ended: dict[str, float] = {}
        while len(ended) < len(queries):
            for name, query in queries.items():
                if name not in ended and not query.isActive:
                    ended[name] = time.perf_counter() - started
            time.sleep(0.05)
        result: dict[str, Any] = {"seconds": ended}
        result["rows"] = {
            name: sum(p["numInputRows"] for p in q.recentProgress) for name, q in queries.items()
        }
        if handle is not None:
            assert handle.sync(600), handle.status()
            result["caught_up_seconds"] = time.perf_counter() - started - ended["audited"]
            result["status"] = handle.status()
            handle.stop()
        return result
    finally:
        watch.close()


def child(mode: str, base: Path, repeats: int, warm_up: bool) -> None:
    """One scheduler mode in this process; prints one JSON line with every round."""
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName(f"wmwatch-bench-queries-{mode}")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.scheduler.mode", mode)
        .config("spark.driver.memory", "2g")
        .config("spark.sql.adaptive.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    rounds: list[dict[str, Any]] = []
    try:
        if warm_up:
            run_round(spark, base, "warmup_off", audit=False)
            run_round(spark, base, "warmup_on", audit=True)
        for r in range(repeats):
            for audit in (False, True):
                tag = f"{'on' if audit else 'off'}{r}"
                rounds.append({"audit": audit, **run_round(spark, base, tag, audit=audit)})
    finally:
        spark.stop()
    print(json.dumps({"mode": mode, "rounds": rounds}), flush=True)


def summarise(mode: str, rounds: list[dict[str, Any]], late_rows: int) -> None:
    def rate(audit: bool, name: str) -> float:
        picked = [r for r in rounds if r["audit"] is audit]
        return sum(r["rows"][name] / r["seconds"][name] for r in picked) / len(picked)

    ratios = []
    parts = []
    for name in QUERIES[1:]:
        off, on = rate(False, name), rate(True, name)
        ratios.append(on / off)
        parts.append(f"{name} {on:,.0f} / {off:,.0f} rows/s = {on / off:.2f}")
    audited_off, audited_on = rate(False, "audited"), rate(True, "audited")
    last = [r for r in rounds if r["audit"]][-1]
    status = last["status"]
    print(
        f"{mode}: others with audit / without: {'; '.join(parts)} (worst {min(ratios):.2f}); "
        f"the audited query itself {audited_on / audited_off:.2f}; late rows in its input "
        f"{late_rows}, audited {status['late_rows']}, batches replayed "
        f"{status['batches_replayed']}, replay {status['replay_seconds']:.1f} s, caught up "
        f"{last['caught_up_seconds']:.1f} s after the query ended",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--files", type=int, default=12)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--modes", default="FIFO,FAIR")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--base", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--tiny", action="store_true", help="tiny sizes, FIFO only, no warm-up (CI)"
    )
    args = parser.parse_args()
    if args.tiny:
        args.files, args.rows, args.repeats, args.modes = 2, 400, 1, "FIFO"
    if args.child:
        child(args.child, Path(args.base), args.repeats, warm_up=not args.tiny)
        return
    print_machine()
    base = Path(tempfile.mkdtemp(prefix="wmwatch-bench-queries-"))
    try:
        late_rows = 0
        for name in QUERIES:
            fraction = 0.01 if name == "audited" else 0.0
            late = write_input(base / name / "in", args.files, args.rows, fraction, seed=len(name))
            late_rows += late if name == "audited" else 0
        print(
            f"input: 3 queries x {args.files} JSON files x {args.rows} rows, one file per batch, "
            f"1% late rows in the audited one; load avg {os.getloadavg()[0]:.1f}",
            flush=True,
        )
        for mode in args.modes.split(","):
            run = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    mode,
                    "--base",
                    str(base),
                    "--repeats",
                    str(args.repeats),
                    *(["--tiny"] if args.tiny else []),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if run.returncode != 0:
                print(f"{mode}: the driver failed:\n{run.stderr[-3000:]}")
                continue
            result = json.loads(run.stdout.strip().splitlines()[-1])
            summarise(mode, result["rounds"], late_rows)
        print(f"load avg at the end {os.getloadavg()[0]:.1f}")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
