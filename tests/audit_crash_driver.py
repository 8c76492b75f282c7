"""A Spark driver for the audit crash test: run a windowed query with the audit, print status.

    python -m tests.audit_crash_driver <folder> run      # loop until killed
    python -m tests.audit_crash_driver <folder> finish   # process what is there, sync, exit 0

The query reads <folder>/in, writes Parquet to <folder>/out (exactly once through the file
sink's log), checkpoints to <folder>/checkpoint and audits into <folder>/history.duckdb.
Status lines are JSON on stdout, one per loop.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(folder: str, mode: str) -> int:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    import wmwatch

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("wmwatch-crash-driver")
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
        spark.readStream.schema("id int, user string, ts timestamp")
        .json(f"{folder}/in")
        .withWatermark("ts", "10 seconds")
    )
    query = (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.format("parquet")
        .outputMode("append")
        .option("path", f"{folder}/out")
        .option("checkpointLocation", f"{folder}/checkpoint")
        .start()
    )
    watch = wmwatch.attach(spark, db=f"{folder}/history.duckdb", metrics_port=None)
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
        print(json.dumps(handle.status()), flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
