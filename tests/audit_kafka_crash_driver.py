"""A Spark driver for the Kafka crash test: an audited query over a Kafka topic, status printed.

    python -m tests.audit_kafka_crash_driver <folder> run <bootstrap> <topic> [shape]
    python -m tests.audit_kafka_crash_driver <folder> finish <bootstrap> <topic> [shape]

``run`` loops until killed; ``finish`` processes what the topic holds, syncs the audit and exits.
Shapes: ``dedupe`` (the default; ``dropDuplicates`` on user and event time) and ``window`` (a
count per 10 s window). The query reads JSON records with ``maxOffsetsPerTrigger`` (several
batches per run), writes Parquet to <folder>/out, checkpoints to <folder>/checkpoint and is
audited into <folder>/history.duckdb, with the same parsing passed as ``prepare=``. It runs in
a process of its own (the test kills it), with Spark's Kafka connector from the jar cache.
Status lines are JSON on stdout, one per loop. Every progress event is appended to
<folder>/progress.jsonl as it comes (Spark's own counts, in both runs, for the test to compare).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

PER_TRIGGER = 6


def main(folder: str, mode: str, bootstrap: str, topic: str, shape: str = "dedupe") -> int:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import wmwatch
    from tests.kafka_broker import connector_jars
    from tests.test_audit_kafka_spark import SCHEMA, kafka_stream, parse

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("wmwatch-kafka-crash-driver")
        .config("spark.jars", ",".join(connector_jars()))
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.default.parallelism", "1")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.scheduler.mode", "FAIR")
        .config("spark.driver.memory", "512m")
        .config("spark.sql.adaptive.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    events = parse(SCHEMA)(kafka_stream(spark, bootstrap, topic, PER_TRIGGER)).withWatermark(
        "ts", "10 seconds"
    )
    if shape == "window":
        result = events.groupBy(F.window("ts", "10 seconds")).count()
    else:
        result = events.dropDuplicates(["user", "ts"])
    spark.streams.addListener(_progress_recorder(f"{folder}/progress.jsonl"))
    watch = wmwatch.attach(spark, db=f"{folder}/history.duckdb", metrics_port=None)
    query = (
        result.writeStream.format("parquet")
        .queryName(f"kafka_{shape}")
        .outputMode("append")
        .option("path", f"{folder}/out")
        .option("checkpointLocation", f"{folder}/checkpoint")
        .start()
    )
    handle = watch.audit(query, events, prepare=parse(SCHEMA), poll_interval_seconds=0.2)
    if mode == "finish":
        query.processAllAvailable()
        ok = handle.sync(120) and watch.flush(30)
        print(json.dumps({"done": ok, **handle.status()}), flush=True)
        handle.stop()
        query.stop()
        watch.close()
        spark.stop()
        return 0 if ok else 1
    while True:
        query.processAllAvailable()
        watch.flush(10)  # progress on disk before a kill, so the test can compare counts
        print(json.dumps(handle.status()), flush=True)
        time.sleep(0.2)


def _progress_recorder(path: str) -> Any:
    """A listener that appends each progress event to ``path`` and flushes it at once."""
    from pyspark.sql.streaming import StreamingQueryListener

    class Recorder(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:  # noqa: N802
            pass

        def onQueryProgress(self, event: Any) -> None:  # noqa: N802
            with open(path, "a") as handle:
                handle.write(event.progress.json.replace("\n", " ") + "\n")

        def onQueryIdle(self, event: Any) -> None:  # noqa: N802
            pass

        def onQueryTerminated(self, event: Any) -> None:  # noqa: N802
            pass

    return Recorder()


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:6]))
