"""What wmwatch costs a real-time query (``trigger(realTime="5 seconds")``).

    python benchmarks/bench_realtime.py [--seconds 25] [--rate 400] [--late 0.01] [--repeats 2]

One driver, ``local[3]``: the query (``dropDuplicates`` on key and event time, 10-second
watermark, one source partition and one shuffle partition) holds two task slots for every batch
and leaves the third to the audit. A feeder thread adds ``--rate`` rows a second to Spark's
``LowLatencyMemoryStream``, each row carrying the wall time it was added, a fraction ``--late``
of them a minute behind the others (late once the watermark has moved). The foreach sink
appends each row's arrival time; end-to-end latency is arrival minus addition. The same query
runs without wmwatch ("off") and with wmwatch attached and auditing into DuckDB ("on"), runs
alternated; printed: rows per second through the sink and latency p50/p95, on over off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _machine import print_machine

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

BASE_SECONDS = 1_767_225_600  # 2026-01-01T00:00:00Z


def feed(run: dict[str, Any], rate: float, late: float, stop: threading.Event) -> None:
    """Add rows at ``rate`` a second: ``key,event seconds,added at``; a ``late`` share old."""
    jvm, stream = run["jvm"], run["stream"]
    started = time.time()
    n = 0
    while not stop.is_set():
        due = int((time.time() - started) * rate) - n
        if due > 0:
            rows = jvm.java.util.ArrayList()
            now = time.time()
            event = now - started
            for i in range(due):
                k = n + i
                old = late > 0 and k % round(1 / late) == 0
                rows.add(f"{k},{event - 60 if old else event:.3f},{now:.6f}")
            stream.addData(jvm.scala.jdk.javaapi.CollectionConverters.asScala(rows))
            n += due
        stop.wait(0.05)
    run["added"] = n


def one_run(spark: Any, work: Path, tag: str, args: argparse.Namespace, *, on: bool) -> dict:
    from prometheus_client import CollectorRegistry
    from pyspark.sql import DataFrame
    from pyspark.sql import functions as F

    import wmwatch

    jvm = spark._jvm
    stream = jvm.org.apache.spark.sql.execution.streaming.sources.LowLatencyMemoryStream.apply(
        spark._jsparkSession, 1, jvm.org.apache.spark.sql.Encoders.STRING()
    )
    raw = DataFrame(stream.toDF(), spark)

    def parse(frame: Any) -> Any:
        parts = F.split("value", ",")
        return frame.select(
            parts.getItem(0).alias("k"),
            F.timestamp_seconds(parts.getItem(1).cast("double") + BASE_SECONDS).alias("ts"),
            parts.getItem(2).cast("double").alias("added"),
        )

    events = parse(raw).withWatermark("ts", "10 seconds")
    sink = work / f"{tag}.out"

    def arrive(row: Any) -> None:  # on an executor: one line per row that reached the sink
        with open(sink, "a", encoding="ascii") as handle:
            handle.write(f"{row['added']:.6f} {time.time():.6f}\n")

    watch = audit = None
    if on:
        watch = wmwatch.attach(
            spark, db=str(work / f"{tag}.duckdb"), metrics_port=None, registry=CollectorRegistry()
        )
    query = (
        events.dropDuplicates(["k", "ts"])
        .writeStream.foreach(arrive)
        .outputMode("update")
        .trigger(realTime="5 seconds")
        .option("checkpointLocation", str(work / f"{tag}.ck"))
        .start()
    )
    run: dict[str, Any] = {"jvm": jvm, "stream": stream}
    stop = threading.Event()
    feeder = threading.Thread(target=feed, args=(run, args.rate, args.late, stop), daemon=True)
    try:
        if watch is not None:
            audit = watch.audit(query, events, prepare=parse)
        feeder.start()
        time.sleep(args.seconds)
        stop.set()
        feeder.join()
        time.sleep(6)  # one more batch drains the rows added last
        failed = query.exception()
    finally:
        query.stop()
    status = audit.status() if audit is not None else None
    if audit is not None:
        audit.sync(120)
        status = audit.status()
    if watch is not None:
        watch.close()
    lines = sink.read_text().split() if sink.exists() else []
    pairs = list(zip(lines[::2], lines[1::2], strict=True))
    latencies = sorted(float(b) - float(a) for a, b in pairs)
    span = max(float(b) for _, b in pairs) - min(float(b) for _, b in pairs) if pairs else 0
    return {
        "failed": str(failed) if failed else None,
        "added": run.get("added", 0),
        "rows_out": len(pairs),
        "rows_per_second": len(pairs) / span if span else 0.0,
        "latency_p50_seconds": statistics.median(latencies) if latencies else None,
        "latency_p95_seconds": latencies[int(0.95 * (len(latencies) - 1))] if latencies else None,
        "audit": (
            {
                k: status[k]
                for k in (
                    "late_rows",
                    "rows_kept_behind_watermark",
                    "batches_replayed",
                    "batches_audited",
                    "errors",
                )
            }
            if status
            else None
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--rate", type=float, default=400.0)
    parser.add_argument("--late", type=float, default=0.01)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="one short run each way (CI)")
    args = parser.parse_args()
    if args.tiny:
        args.seconds, args.rate, args.repeats = 12.0, 50.0, 1
    print_machine()
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[3]")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    results: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="wmwatch-bench-rt-") as tmp:
        for repeat in range(args.repeats):
            for mode in ("off", "on"):
                result = one_run(spark, Path(tmp), f"{mode}{repeat}", args, on=mode == "on")
                results[mode].append(result)
                print(json.dumps({"mode": mode, "repeat": repeat, **result}), flush=True)
    spark.stop()

    def mean(mode: str, key: str) -> float:
        values = [r[key] for r in results[mode] if r[key] is not None]
        return statistics.mean(values) if values else float("nan")

    print(
        f"real-time dropDuplicates, {args.rate:g} rows/s offered, {args.late:.0%} late, "
        f"{args.seconds:g} s x {args.repeats} runs each, alternated"
    )
    for key, label in (
        ("rows_per_second", "rows/s through the sink"),
        ("latency_p50_seconds", "latency p50 (s)"),
        ("latency_p95_seconds", "latency p95 (s)"),
    ):
        off, on = mean("off", key), mean("on", key)
        ratio = on / off if off else float("nan")  # a run too short to emit has no ratio
        print(f"  {label:26s} off {off:10.3f}  on {on:10.3f}  on/off {ratio:5.2f}")
    failures = [r["failed"] for rs in results.values() for r in rs if r["failed"]]
    print(f"  query failures: {len(failures)}")


if __name__ == "__main__":
    main()
