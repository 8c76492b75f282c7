"""Core benchmarks, side by side in one run (the machine is shared and noisy: read the ratios).

1. Per-event cost: wmwatch's py4j listener (callback + worker) vs the stock PySpark
   StreamingQueryListener doing nothing, both fed the same real JVM progress events.
2. Throughput: a busy file-stream aggregation with wmwatch attached vs without, runs alternated.
3. Freshness: from a batch's end (progress timestamp + batchDuration) to its batch id on /metrics,
   while the query runs several batches per second.

Where the time went: during the throughput runs every thread's CPU seconds are read from /proc,
this process's (wmwatch's worker, history writer, plan plugin, metrics server, py4j callbacks)
and the driver JVM's (the listener bus queue wmwatch's callback runs on, py4j gateway threads,
the query's own threads), and printed per run with and without wmwatch. On a shared machine
these move far less than wall-clock time; a regression shows up as a thread that grew.

Run: python benchmarks/bench_core.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _cpu import CpuSnapshot, CpuUse, jvm_thread_names, mean_use
from _machine import print_machine

import wmwatch
from wmwatch._core.health import Health
from wmwatch._core.listener import EventQueue, Py4jListener


def session() -> Any:
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.adaptive.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def write_files(folder: Path, files: int, rows: int, start_second: int = 0) -> None:
    for f in range(files):
        lines = []
        for r in range(rows):
            second = start_second + f * 2 + (r % 3)
            lines.append(
                json.dumps(
                    {
                        "ts": (
                            f"2026-01-01T{second // 3600:02d}:{second // 60 % 60:02d}:"
                            f"{second % 60:02d}Z"
                        ),
                        "user": f"u{r % 50}",
                        "amount": r,
                    }
                )
            )
        tmp = folder.parent / f".tmp-{f}"
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, folder / f"part-{start_second}-{f:05d}.json")


def windowed(
    spark: Any, folder: Path, checkpoint: Path, *, max_files: int, trigger: dict[str, Any]
) -> Any:
    from pyspark.sql import functions as F

    events = (
        spark.readStream.schema("ts timestamp, user string, amount long")
        .option("maxFilesPerTrigger", max_files)
        .json(str(folder))
        .withWatermark("ts", "30 seconds")
    )
    agg = events.groupBy(F.window("ts", "10 seconds"), "user").agg(F.sum("amount"))
    return (
        agg.writeStream.outputMode("append")
        .format("noop")
        .option("checkpointLocation", str(checkpoint))
        .trigger(**trigger)
        .start()
    )


def bench_event_cost(spark: Any, work: Path, events: int) -> dict[str, float]:
    from pyspark.sql.streaming.listener import JStreamingQueryListener, StreamingQueryListener

    folder = work / "cost-in"
    folder.mkdir()
    write_files(folder, 4, 20)
    query = windowed(spark, folder, work / "cost-ck", max_files=1, trigger={"availableNow": True})
    query.awaitTermination()
    jprogress = query._jsq.lastProgress()
    jvm = spark.sparkContext._jvm
    event_class = getattr(
        jvm.org.apache.spark.sql.streaming, "StreamingQueryListener$QueryProgressEvent"
    )
    jevent = event_class(jprogress)

    class Noop(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None: ...  # noqa: N802 - Spark's name
        def onQueryProgress(self, event: Any) -> None: ...  # noqa: N802 - Spark's name
        def onQueryIdle(self, event: Any) -> None: ...  # noqa: N802 - Spark's name
        def onQueryTerminated(self, event: Any) -> None: ...  # noqa: N802 - Spark's name

    stock = JStreamingQueryListener(Noop())
    health = Health()
    queue = EventQueue(events + 10, health)
    ours = Py4jListener(queue, health)
    watch = wmwatch.attach(spark, db=str(work / "cost.duckdb"), metrics_port=None)

    def timed(fn: Any) -> list[float]:
        samples = []
        for _ in range(events):
            t0 = time.perf_counter()
            fn(jevent)
            samples.append(time.perf_counter() - t0)
        return samples

    # alternate in rounds so drift on the machine hits both sides alike
    stock_s: list[float] = []
    ours_s: list[float] = []
    worker_s: list[float] = []
    for _ in range(4):
        stock_s += timed(stock.onQueryProgress)
        ours_s += timed(ours.onQueryProgress)
        # the worker's share: parse + state + history write, timed on the real worker
        before = watch.health.copy()
        t0 = time.perf_counter()
        while (raw := queue.get(timeout=0.01)) is not None:
            watch._events.offer("progress", raw.payload)
        watch.flush(timeout=60)
        after = watch.health.copy()
        handled = after.handling_count - before.handling_count
        if handled:
            worker_s.append((after.handling_sum_seconds - before.handling_sum_seconds) / handled)
        del t0
    watch.close()
    stock_ms = statistics.median(stock_s) * 1000
    ours_ms = statistics.median(ours_s) * 1000
    worker_ms = statistics.median(worker_s) * 1000 if worker_s else 0.0
    return {
        "stock_ms": stock_ms,
        "wmwatch_callback_ms": ours_ms,
        "wmwatch_worker_ms": worker_ms,
        "ratio": stock_ms / (ours_ms + worker_ms),
    }


def jvm_pid(spark: Any) -> int | None:
    try:
        return int(spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid())
    except Exception:  # noqa: BLE001 - only the CPU breakdown needs it
        return None


def bench_throughput(
    spark: Any, work: Path, files: int, rounds: int, warm_up: bool = True
) -> dict[str, Any]:
    """Same input, same query, alternated with/without wmwatch (ABBA) after a warm-up pair
    (left out with ``warm_up=False``: a run that only shows the benchmark works)."""
    folder = work / "tp-in"
    folder.mkdir()
    rows_per_file = 400
    write_files(folder, files, rows_per_file)
    timings: dict[str, list[float]] = {"without": [], "with": []}
    plan_costs: dict[str, list[float]] = {}
    cpu: dict[str, list[CpuUse]] = {"without": [], "with": []}
    pid = jvm_pid(spark)
    names = jvm_thread_names(pid) if pid is not None else {}
    order = [
        m
        for r in range(rounds)
        for m in (("without", "with") if r % 2 == 0 else ("with", "without"))
    ]
    warm = ["without", "with"] if warm_up else []
    for index, mode in enumerate([*warm, *order]):
        watch = None
        if mode == "with":
            watch = wmwatch.attach(spark, db=str(work / f"tp-{index}.duckdb"), metrics_port=None)
        before = CpuSnapshot.take(pid)
        t0 = time.perf_counter()
        query = windowed(
            spark, folder, work / f"tp-ck-{index}", max_files=2, trigger={"availableNow": True}
        )
        query.awaitTermination()
        elapsed = time.perf_counter() - t0
        after = CpuSnapshot.take(pid)  # before close: wmwatch's threads are still alive
        if pid is not None:
            # full JVM thread names (outside the timed run: a thread dump stops the JVM briefly)
            names.update(jvm_thread_names(pid))
        if watch is not None:
            for plugin in watch.plugins():
                for kind, samples in getattr(plugin, "costs", {}).items():
                    plan_costs.setdefault(kind, []).extend(samples)
            watch.close()
        if index >= len(warm):  # the first pair warms the JVM, codegen and the file listing
            timings[mode].append(elapsed)
            cpu[mode].append(CpuUse.between(before, after, names))
    without = statistics.median(timings["without"])
    with_ = statistics.median(timings["with"])
    rows = files * rows_per_file
    return {
        "rows_per_s_without": rows / without,
        "rows_per_s_with": rows / with_,
        "ratio": without / with_,
        "runs": len(order),
        "plan_inspect_ms": statistics.median(plan_costs.get("inspect_seconds") or [0.0]) * 1000,
        "plan_inspections": len(plan_costs.get("inspect_seconds", [])),
        "plan_read_ms": statistics.median(plan_costs.get("read_seconds") or [0.0]) * 1000,
        "plan_reads": len(plan_costs.get("read_seconds", [])),
        "seconds_with": with_,
        "cpu_with": mean_use(cpu["with"]),
        "cpu_without": mean_use(cpu["without"]),
    }


def print_cpu(tp: dict[str, Any]) -> None:
    """Where the CPU went in a run, with wmwatch and without (means over the alternated runs)."""
    with_: CpuUse = tp["cpu_with"]
    without: CpuUse = tp["cpu_without"]
    if not with_.python:
        print("   CPU per thread: unavailable (no /proc)")
        return
    extra = with_.python_total - without.python_total
    print(
        f"   CPU seconds per run, with wmwatch (without): python process {with_.python_total:.3f} "
        f"({without.python_total:.3f}), driver JVM {with_.jvm_total:.2f} ({without.jvm_total:.2f})"
    )
    print(
        f"   wmwatch in python: {extra:.3f} CPU s per run = "
        f"{extra / tp['seconds_with']:.2%} of one core "
        f"over the run's {tp['seconds_with']:.1f} s"
    )

    def rows(side: str, a: dict[str, float], b: dict[str, float], pick: Any) -> None:
        for group in sorted(set(a) | set(b), key=lambda g: -a.get(g, 0.0)):
            if pick(group) and max(a.get(group, 0.0), b.get(group, 0.0)) >= 0.001:
                print(
                    f"     {side:<6} {group:<40} {a.get(group, 0.0):7.3f} ({b.get(group, 0.0):.3f})"
                )

    rows("python", with_.python, without.python, lambda g: True)
    # the JVM threads wmwatch drives; the rest (tasks, JIT, GC) is the query's and in the totals
    rows("jvm", with_.jvm, without.jvm, lambda g: g.startswith(("listener bus", "py4j", "query:")))


def bench_freshness(spark: Any, work: Path, seconds: float) -> dict[str, float]:
    folder = work / "fresh-in"
    folder.mkdir()
    stop = threading.Event()

    def feed() -> None:
        n = 0
        while not stop.is_set():
            write_files(folder, 1, 20, start_second=n * 2)
            n += 1
            time.sleep(0.1)

    feeder = threading.Thread(target=feed, daemon=True)
    feeder.start()
    port_sock = __import__("socket").socket()
    port_sock.bind(("127.0.0.1", 0))
    port = port_sock.getsockname()[1]
    port_sock.close()
    watch = wmwatch.attach(spark, db=str(work / "fresh.duckdb"), metrics_port=port)
    query = windowed(
        spark,
        folder,
        work / "fresh-ck",
        max_files=1,
        trigger={"processingTime": "100 milliseconds"},
    )
    seen_at: dict[int, float] = {}
    deadline = time.time() + seconds
    url = watch.metrics_url
    assert url is not None
    while time.time() < deadline:
        body = urllib.request.urlopen(url, timeout=5).read().decode()
        now = time.time()
        for line in body.splitlines():
            if line.startswith("wmwatch_last_batch_id{"):
                batch = int(float(line.rsplit(" ", 1)[1]))
                for b in range(max(seen_at, default=-1) + 1, batch + 1):
                    seen_at.setdefault(b, now)
        time.sleep(0.01)
    stop.set()
    progress = {p["batchId"]: p for p in query.recentProgress}
    query.stop()
    watch.close()
    from wmwatch._time import parse_timestamp

    delays = []
    for batch, at in seen_at.items():
        p = progress.get(batch)
        if p is None:
            continue
        start = parse_timestamp(p["timestamp"])
        assert start is not None
        end = start.timestamp() + p["batchDuration"] / 1000
        delays.append(at - end)
    delays.sort()
    batches_per_s = len(progress) / seconds
    if not delays:
        # a machine so loaded that no batch reached /metrics in the window: say so, no figure
        nan = float("nan")
        return {
            "batches": 0,
            "batches_per_second": batches_per_s,
            "p50_s": nan,
            "p99_s": nan,
            "max_s": nan,
        }
    return {
        "batches": len(delays),
        "batches_per_second": batches_per_s,
        "p50_s": delays[len(delays) // 2],
        "p99_s": delays[min(len(delays) - 1, int(len(delays) * 0.99))],
        "max_s": delays[-1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument(
        "--tiny", action="store_true", help="tiny sizes, one round, no warm-up (CI)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="throughput rounds, two runs each (default 8; 2 with --quick)",
    )
    args = parser.parse_args()
    print_machine()
    work = Path(tempfile.mkdtemp(prefix="wmwatch-bench-"))
    spark = session()
    try:
        cost = bench_event_cost(spark, work, events=5 if args.tiny else 20 if args.quick else 60)
        print(
            f"1. per progress event: stock listener (no-op) {cost['stock_ms']:.2f} ms, "
            f"wmwatch callback {cost['wmwatch_callback_ms']:.2f} ms "
            f"+ worker {cost['wmwatch_worker_ms']:.2f} ms "
            f"-> wmwatch {cost['ratio']:.1f}x cheaper"
        )
        tp = bench_throughput(
            spark,
            work,
            files=6 if args.tiny else 40 if args.quick else 80,
            rounds=args.rounds or (1 if args.tiny else 2 if args.quick else 8),
            warm_up=not args.tiny,
        )
        print(
            f"2. throughput ({tp['runs']} runs alternated): "
            f"without {tp['rows_per_s_without']:.0f} rows/s, "
            f"with wmwatch {tp['rows_per_s_with']:.0f} rows/s -> ratio {tp['ratio']:.3f}"
        )
        print(
            f"   plan checks during those runs: {tp['plan_inspections']:.0f} plan walks, median "
            f"{tp['plan_inspect_ms']:.1f} ms; {tp['plan_reads']:.0f} watermark reads, "
            f"median {tp['plan_read_ms']:.1f} ms"
        )
        print_cpu(tp)
        fr = bench_freshness(spark, work, seconds=4 if args.tiny else 10 if args.quick else 30)
        print(
            f"3. freshness over {fr['batches']} batches "
            f"({fr['batches_per_second']:.1f} batches/s): "
            f"p50 {fr['p50_s'] * 1000:.0f} ms, p99 {fr['p99_s'] * 1000:.0f} ms, "
            f"max {fr['max_s'] * 1000:.0f} ms"
        )
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
