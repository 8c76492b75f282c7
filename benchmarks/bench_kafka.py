"""What the late-row audit costs a query that reads Kafka.

    python benchmarks/bench_kafka.py [--batches 16] [--rows 20000] [--repeats 2]

Starts a Kafka broker of its own (KRaft, 127.0.0.1, ``tests/kafka_broker.py``) from the jars
``.ci/fetch_jars.sh`` keeps in the jar cache, and reads it with Spark's Kafka connector from the
same cache. Per late fraction (0% and 1%) one topic of 3 partitions holds ``--batches`` x
``--rows`` JSON records; chunk i holds times in [10 i, 10 i + 10) s, shuffled (within the 30 s
delay, so never late), except that fraction of rows placed 120 s behind (always late). The query
parses the values (``from_json``), counts per 10 s window and user (append mode, noop sink) and
reads ``--rows`` records a batch (``maxOffsetsPerTrigger``, ``availableNow``). Runs alternate
audit off / audit on over the same topic (each from the earliest offset, its own checkpoint),
so background load hits both alike; the figure is the throughput ratio on / off. "Caught up" is
how long after the query finished the audit had audited every committed batch.

Prints the machine and the load average first, then one line per late fraction.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from _machine import print_machine

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

DELAY = "30 seconds"
SCHEMA = "id long, user string, ts timestamp, payload string"
PARTITIONS = 3
# the broker helper lives with the tests; CI runs benchmarks with the repo root on PYTHONPATH
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _iso(second: float) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(1_767_225_600 + second))
        + f".{int(second * 1000) % 1000:03d}Z"
    )


def produce_input(
    bootstrap: str, batches: int, rows: int, late_fraction: float, seed: int = 1
) -> tuple[str, int]:
    """A new topic holding the input (round robin over its partitions); its name and how many
    records are late."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"bench_{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "acks": "all"})
    rng = random.Random(seed)
    late = 0
    next_id = 0
    for i in range(batches):
        for _ in range(rows):
            second = 10 * i + rng.random() * 10
            if i >= 4 and rng.random() < late_fraction:
                second -= 120
                late += 1
            value = {
                "id": next_id,
                "user": f"u{rng.randrange(50)}",
                "ts": _iso(second),
                "payload": "x" * 40,
            }
            while True:
                try:
                    producer.produce(topic, json.dumps(value).encode(), partition=next_id % 3)
                    break
                except BufferError:  # the local queue is full: let it drain
                    producer.poll(0.1)
            next_id += 1
        producer.poll(0)
    if producer.flush(120) != 0:
        raise RuntimeError("the broker did not take every benchmark record within 120 s")
    return topic, late


def parse(raw: Any) -> Any:
    """The query's transformation of the Kafka records, also the audit's ``prepare=``."""
    from pyspark.sql import functions as F

    return raw.select(F.from_json(F.col("value").cast("string"), SCHEMA).alias("j")).select("j.*")


def run_query(
    spark: Any, bootstrap: str, topic: str, rows: int, work: Path, *, audit: bool
) -> dict[str, Any]:
    from prometheus_client import CollectorRegistry
    from pyspark.sql import functions as F

    import wmwatch

    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    raw = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", rows)
        .load()
    )
    events = parse(raw).withWatermark("ts", DELAY)
    counts = events.groupBy(F.window("ts", "10 seconds"), "user").count()
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
        handle = watch.audit(query, events, prepare=parse) if audit else None
        query.awaitTermination()
        query_seconds = time.perf_counter() - started
        total = sum(p["numInputRows"] for p in query.recentProgress)
        result: dict[str, Any] = {"rows": total, "query_seconds": query_seconds}
        if handle is not None:
            if not handle.sync(600):
                raise RuntimeError(f"the audit did not catch up in 600 s: {handle.status()}")
            result["caught_up_seconds"] = time.perf_counter() - started - query_seconds
            result["status"] = handle.status()
            handle.stop()
        return result
    finally:
        watch.close()


def measure(
    spark: Any, bootstrap: str, base: Path, args: argparse.Namespace, late_fraction: float
) -> None:
    topic, late_rows = produce_input(bootstrap, args.batches, args.rows, late_fraction)
    folder = base / f"late{late_fraction}"
    if not args.tiny:
        # warm both code paths (JIT, caches, the connector's consumers) before anything is timed
        run_query(spark, bootstrap, topic, args.rows, folder / "warmup_off", audit=False)
        run_query(spark, bootstrap, topic, args.rows, folder / "warmup_on", audit=True)
    off_rates, on_rates = [], []
    last: dict[str, Any] = {}
    for r in range(args.repeats):
        off = run_query(spark, bootstrap, topic, args.rows, folder / f"off{r}", audit=False)
        on = run_query(spark, bootstrap, topic, args.rows, folder / f"on{r}", audit=True)
        off_rates.append(off["rows"] / off["query_seconds"])
        on_rates.append(on["rows"] / on["query_seconds"])
        last = on
    off_rate = sum(off_rates) / len(off_rates)
    on_rate = sum(on_rates) / len(on_rates)
    status = last["status"]
    print(
        f"kafka windowed count, late {late_fraction:.0%}: audit off {off_rate:,.0f} rows/s, "
        f"on {on_rate:,.0f} rows/s, ratio {on_rate / off_rate:.2f} ({args.repeats} runs each, "
        f"alternated); late rows in input {late_rows}, audited {status['late_rows']}; batches "
        f"replayed {status['batches_replayed']}, skipped {status['batches_skipped']}, lost "
        f"{status['batches_lost']}; replay time {status['replay_seconds']:.1f} s; audit caught "
        f"up {last['caught_up_seconds']:.1f} s after the query finished; "
        f"load avg {os.getloadavg()[0]:.1f}",
        flush=True,
    )


def main() -> None:
    print_machine()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--rows", type=int, default=20_000, help="records per batch")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--tiny", action="store_true", help="tiny sizes, one repeat, no warm-up (CI)"
    )
    args = parser.parse_args()
    if args.tiny:
        args.batches, args.rows, args.repeats = 6, 300, 1  # a few late rows at 1%

    from tests.kafka_broker import JarsMissing, connector_jars, kafka_broker

    try:
        jars = connector_jars()
    except JarsMissing as exc:
        sys.exit(f"bench_kafka: {exc}")
    from pyspark.sql import SparkSession

    base = Path(tempfile.mkdtemp(prefix="wmwatch-bench-kafka-"))
    try:
        with kafka_broker(base / "broker") as bootstrap:
            spark = (
                SparkSession.builder.master("local[2]")
                .appName("wmwatch-bench-kafka")
                .config("spark.jars", ",".join(jars))
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
            try:
                print(
                    f"input: {args.batches} batches x {args.rows} JSON records over "
                    f"{PARTITIONS} partitions; load avg {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
                for late_fraction in (0.0, 0.01):
                    measure(spark, bootstrap, base, args, late_fraction)
            finally:
                spark.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
