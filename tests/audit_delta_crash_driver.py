"""A Spark driver for the Delta crash test: an audited query over a Delta table, status printed.

    python -m tests.audit_delta_crash_driver <folder> run <table>
    python -m tests.audit_delta_crash_driver <folder> finish <table>

``run`` loops until killed; ``finish`` processes what the table holds, syncs the audit and exits.
The query deduplicates on user and event time over ``spark.readStream.format("delta")`` of
<table> (``events`` as written: a derived column before the watermark, no ``prepare=``), writes
Parquet to <folder>/out, checkpoints to <folder>/checkpoint and is audited into
<folder>/history.duckdb. It runs in a process of its own (the test kills it), with Delta's jars
from the jar cache and the Delta session settings of ``tests/conftest.py``. Status lines are
JSON on stdout, one per loop; every progress event is appended to <folder>/progress.jsonl.
"""

from __future__ import annotations

import json
import os
import sys
import time

from tests.audit_kafka_crash_driver import _progress_recorder


def main(folder: str, mode: str, table: str) -> int:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import wmwatch
    from tests.conftest import jar_set
    from tests.test_audit_spark import DELAY

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("wmwatch-delta-crash-driver")
        .config("spark.jars", ",".join(jar_set("delta")))
        .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        .config(
            "spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog"
        )
        .config("spark.databricks.delta.snapshotPartitions", "1")
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
    events = (
        spark.readStream.format("delta")
        .option("maxFilesPerTrigger", 1)  # several batches per run
        .load(table)
        .withColumn("user", F.upper("user"))
        .withWatermark("ts", DELAY)
    )
    spark.streams.addListener(_progress_recorder(f"{folder}/progress.jsonl"))
    watch = wmwatch.attach(spark, db=f"{folder}/history.duckdb", metrics_port=None)
    query = (
        events.dropDuplicates(["user", "ts"])
        .writeStream.format("parquet")
        .queryName("delta_dedupe")
        .option("path", f"{folder}/out")
        .option("checkpointLocation", f"{folder}/checkpoint")
        .start()
    )
    handle = watch.audit(query, events, poll_interval_seconds=0.2)
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


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
