"""A Spark driver for the audit crash test: run a windowed query with the audit, print status.

    python -m tests.audit_crash_driver <folder> run [join]     # loop until killed
    python -m tests.audit_crash_driver <folder> finish [join]  # process what is there, sync, exit 0

The window query reads <folder>/in; the join query (``join``) joins <folder>/l with <folder>/r
on a key and a time range. Both write Parquet to <folder>/out (exactly once through the file
sink's log), checkpoint to <folder>/checkpoint and audit into <folder>/history.duckdb.
Status lines are JSON on stdout, one per loop.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(folder: str, mode: str, shape: str = "window") -> int:
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
    if shape == "join":
        left = (
            spark.readStream.schema("lid int, lk string, lt timestamp")
            .json(f"{folder}/l")
            .withWatermark("lt", "10 seconds")
        )
        right = (
            spark.readStream.schema("rid int, rk string, rt timestamp")
            .json(f"{folder}/r")
            .withWatermark("rt", "10 seconds")
        )
        condition = "lk = rk AND lt BETWEEN rt - INTERVAL 5 SECONDS AND rt + INTERVAL 5 SECONDS"
        result = left.join(right, F.expr(condition))
        events: object = [left, right]
    else:
        source = (
            spark.readStream.schema("id int, user string, ts timestamp")
            .json(f"{folder}/in")
            .withWatermark("ts", "10 seconds")
        )
        result = source.groupBy(F.window("ts", "10 seconds")).count()
        events = source
    query = (
        result.writeStream.format("parquet")
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
    sys.exit(main(*sys.argv[1:4]))
