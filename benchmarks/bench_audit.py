"""What the late-row audit costs the production query, and how fast it writes late rows.

    python benchmarks/bench_audit.py [--files 24] [--rows 20000]

1. Throughput of a windowed count (10 s windows, 30 s delay, append mode, JSON files, one file
   per batch through availableNow + maxFilesPerTrigger=1) with the audit off and on, on the
   same input, for 0% late rows and for 1% late rows. Runs alternate off/on so background
   load hits both alike. "Caught up" is how long after the query finished the audit had
   audited every committed batch.
   ``--only join`` measures the same for a stream-stream join: two inputs (the same ids, times
   within the 10 s of their file), joined on the id and a 10 s time range, inner, each side
   with the same late fraction; the audit replays both sides.
2. Audit write rate: one batch whose rows are all late, audited after the fact, into DuckDB and
   into Parquet (rows per second, replay included).
3. A late-row storm (``--storm-rows``, 5 million by default): that many rows, all behind the
   watermark, in one batch of a query on Spark's default driver memory, in a driver process of
   its own (``tests/scripts/late_storm.py``, the scenario of ``tests/test_audit_storm.py``):
   rows per second audited and the driver's peak Python RSS.

Prints one line per figure; takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _machine import print_machine

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

DELAY = "30 seconds"
SCHEMA = "id long, user string, ts timestamp, payload string"


def _iso(second: float) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(1_767_225_600 + second))
        + f".{int(second * 1000) % 1000:03d}Z"
    )


def write_input(folder: Path, files: int, rows: int, late_fraction: float, seed: int = 1) -> int:
    """``files`` JSON files; file i holds times in [10 i, 10 i + 10) s, shuffled (within the
    delay, so never late), except ``late_fraction`` of rows placed 120 s behind (always late)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    late = 0
    next_id = 0
    for i in range(files):
        lines = []
        for _ in range(rows):
            second = 10 * i + rng.random() * 10
            if i >= 4 and rng.random() < late_fraction:
                second -= 120
                late += 1
            lines.append(
                json.dumps(
                    {
                        "id": next_id,
                        "user": f"u{rng.randrange(50)}",
                        "ts": _iso(second),
                        "payload": "x" * 40,
                    }
                )
            )
            next_id += 1
        tmp = folder.parent / f".f{i}.tmp"
        tmp.write_text("\n".join(lines) + "\n")
        final = folder / f"f{i:05d}.json"
        os.replace(tmp, final)
        stamp = 1_700_000_000 + i
        os.utime(final, (stamp, stamp))
    return late


def run_query(
    spark: Any,
    folder: Path,
    tag: str,
    *,
    audit: bool,
    sink: str = "duckdb",
    shape: str = "window",
) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry
    from pyspark.sql import functions as F

    import wmwatch

    work = folder / tag
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    events = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(folder / "in"))
        .withWatermark("ts", DELAY)
    )
    if shape == "join":
        other = (
            spark.readStream.schema(SCHEMA)
            .option("maxFilesPerTrigger", 1)
            .json(str(folder / "right"))
            .select(
                F.col("id").alias("rid"),
                F.col("ts").alias("rts"),
                F.col("payload").alias("rpayload"),
            )
            .withWatermark("rts", DELAY)
        )
        renamed = {"id": "rid", "ts": "rts", "payload": "rpayload"}

        def prepare_right(frame: Any) -> Any:
            return frame.select(*[F.col(k).alias(v) for k, v in renamed.items()])

        condition = "id = rid AND ts BETWEEN rts - INTERVAL 10 SECONDS AND rts + INTERVAL 10 SECOND"
        counts = events.join(other, F.expr(condition))
        inputs: Any = [events, other]
        prepare: Any = [None, prepare_right]
    else:
        counts = events.groupBy(F.window("ts", "10 seconds"), "user").count()
        inputs, prepare = events, None
    watch = wmwatch.attach(
        spark, db=str(work / "h.duckdb"), metrics_port=None, registry=CollectorRegistry()
    )
    try:
        started = time.perf_counter()
        query = (
            counts.writeStream.format("noop")
            .outputMode("append")
            .option("checkpointLocation", str(work / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        handle = (
            watch.audit(query, inputs, prepare=prepare, sink=sink, parquet_path=str(work / "late"))
            if audit
            else None
        )
        query.awaitTermination()
        query_seconds = time.perf_counter() - started
        rows = sum(p["numInputRows"] for p in query.recentProgress)
        result: dict[str, Any] = {"rows": rows, "query_seconds": query_seconds}
        if handle is not None:
            assert handle.sync(600), handle.status()
            result["caught_up_seconds"] = time.perf_counter() - started - query_seconds
            result["status"] = handle.status()
            handle.stop()
        return result
    finally:
        watch.close()


def audit_rate(spark: Any, folder: Path, rows: int, sink: str) -> tuple[int, float]:
    """Rows per second for one batch whose rows are all late, audited after the query ran."""
    from prometheus_client import CollectorRegistry
    from pyspark.sql import functions as F

    import wmwatch

    work = folder / f"rate_{sink}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "in").mkdir(parents=True)
    # a moves the watermark far ahead, b (one row, not late) gives the batch that carries it,
    # c holds the late rows
    for name, second, stamp in (("a", 100_000, 0), ("b", 100_000, 1)):
        path = work / "in" / f"{name}.json"
        path.write_text(
            json.dumps({"id": 0, "user": "u", "ts": _iso(second), "payload": ""}) + "\n"
        )
        os.utime(path, (1_700_000_000 + stamp, 1_700_000_000 + stamp))
    rng = random.Random(2)
    lines = [
        json.dumps(
            {
                "id": i,
                "user": f"u{rng.randrange(50)}",
                "ts": _iso(rng.random() * 50_000),
                "payload": "x" * 40,
            }
        )
        for i in range(1, rows + 1)
    ]
    (work / "in" / "c.json").write_text("\n".join(lines) + "\n")
    os.utime(work / "in" / "c.json", (1_700_000_100, 1_700_000_100))
    events = (
        spark.readStream.schema(SCHEMA)
        .option("maxFilesPerTrigger", 1)
        .json(str(work / "in"))
        .withWatermark("ts", DELAY)
    )
    query = (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.format("noop")
        .outputMode("append")
        .option("checkpointLocation", str(work / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    watch = wmwatch.attach(
        spark, db=str(work / "h.duckdb"), metrics_port=None, registry=CollectorRegistry()
    )
    try:
        started = time.perf_counter()
        handle = watch.audit(query, events, sink=sink, parquet_path=str(work / "late"))
        assert handle.sync(600), handle.status()
        seconds = time.perf_counter() - started
        late = int(handle.status()["late_rows"])
        handle.stop()
    finally:
        watch.close()
    return late, seconds


def storm(rows: int) -> None:
    """The late-row storm scenario in a driver of its own, with a Parquet overflow folder."""
    script = Path(__file__).resolve().parents[1] / "tests" / "scripts" / "late_storm.py"
    work = Path(tempfile.mkdtemp(prefix="wmwatch-bench-storm-"))
    timeout = 1800  # 5,000,000 rows take about two minutes on 2 cores
    try:
        run = subprocess.run(
            [sys.executable, str(script), str(work), str(rows), "--parquet"],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "PYTHONPATH": str(script.parents[2])},
            timeout=timeout,
        )
        # a failed part fails the benchmark (its --tiny run is a test)
        if run.returncode != 0:
            sys.exit(f"storm: the driver failed:\n{run.stderr[-3000:]}")
        result = json.loads(run.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        sys.exit(f"storm: the driver ran past {timeout} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    status = result["status"]
    mib = 1024 * 1024
    print(
        f"storm: {rows:,} late rows in one batch; query alive {result['query_alive']}, "
        f"{len(result['batches_after_storm'])} batches after it; audited {status['late_rows']:,} "
        f"({status['late_rows'] - status['late_rows_over_cap']:,} kept in DuckDB, all in Parquet) "
        f"in {result['audit_after_commit_seconds']:.1f} s after the batch committed = "
        f"{result['audit_rows_per_second']:,} rows/s; the query's own batch took "
        f"{result['query_seconds']:.1f} s; driver Python RSS "
        f"{result['rss_baseline_bytes'] / mib:.0f} MiB before, "
        f"peak {result['rss_peak_bytes'] / mib:.0f} MiB "
        f"(+{(result['rss_peak_bytes'] - result['rss_baseline_bytes']) / mib:.0f} MiB)"
    )


def main() -> None:
    print_machine()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--rate-rows", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--storm-rows", type=int, default=5_000_000)
    parser.add_argument(
        "--only",
        choices=("throughput", "join", "rate", "storm"),
        default=None,
        help="run one part",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="tiny sizes, one repeat, no warm-up (CI)"
    )
    args = parser.parse_args()
    if args.tiny:
        args.files, args.rows, args.repeats = 2, 400, 1
        args.rate_rows, args.storm_rows = 1_000, 2_000
    if args.only == "storm":
        storm(args.storm_rows)
        return

    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("wmwatch-bench-audit")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.scheduler.mode", "FAIR")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.adaptive.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    base = Path(tempfile.mkdtemp(prefix="wmwatch-bench-audit-"))
    try:
        print(
            f"input: {args.files} JSON files x {args.rows} rows, one file per batch; "
            f"load avg {os.getloadavg()[0]:.1f}"
        )
        shapes = {None: ("window", "join"), "throughput": ("window",), "join": ("join",)}
        runs = [
            (shape, late_fraction)
            for shape in shapes.get(args.only, ())
            # a tiny run shows each shape still runs; one fraction is enough for that
            for late_fraction in ((0.01,) if args.tiny else (0.0, 0.01))
        ]
        for shape, late_fraction in runs:
            folder = base / f"{shape}-late{late_fraction}"
            late_rows = write_input(folder / "in", args.files, args.rows, late_fraction)
            if shape == "join":
                late_rows += write_input(
                    folder / "right", args.files, args.rows, late_fraction, seed=2
                )
            if not args.tiny:
                # warm both code paths (JIT, caches) before anything is timed
                run_query(spark, folder, "warmup_off", audit=False, shape=shape)
                run_query(spark, folder, "warmup_on", audit=True, shape=shape)
            off_rates, on_rates = [], []
            last: dict[str, Any] = {}
            for r in range(args.repeats):
                off = run_query(spark, folder, f"off{r}", audit=False, shape=shape)
                on = run_query(spark, folder, f"on{r}", audit=True, shape=shape)
                off_rates.append(off["rows"] / off["query_seconds"])
                on_rates.append(on["rows"] / on["query_seconds"])
                last = on
            off_rate = sum(off_rates) / len(off_rates)
            on_rate = sum(on_rates) / len(on_rates)
            status = last["status"]
            print(
                f"{shape} late {late_fraction:.0%}: audit off {off_rate:,.0f} rows/s, "
                f"on {on_rate:,.0f} rows/s, "
                f"ratio {on_rate / off_rate:.2f}; late rows in input {late_rows}, audited "
                f"{status['late_rows']}; batches replayed {status['batches_replayed']}, skipped "
                f"{status['batches_skipped']}; replay time {status['replay_seconds']:.1f} s; "
                f"audit caught up {last['caught_up_seconds']:.1f} s after the query finished"
            )
        for sink in ("duckdb", "parquet") if args.only in (None, "rate") else ():
            if not args.tiny:
                audit_rate(spark, base, args.rate_rows // 10, sink)  # warm-up
            late, seconds = audit_rate(spark, base, args.rate_rows, sink)
            print(
                f"audit write rate into {sink}: {late:,} late rows in {seconds:.1f} s = "
                f"{late / seconds:,.0f} rows/s"
            )
    finally:
        spark.stop()
        shutil.rmtree(base, ignore_errors=True)
    if args.only is None:
        storm(args.storm_rows)


if __name__ == "__main__":
    main()
