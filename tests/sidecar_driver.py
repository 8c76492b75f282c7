"""The production application of the sidecar tests: a query over a file stream, in a process of
its own (a different Spark application from the sidecar's).

    python -m tests.sidecar_driver <folder> <shape> files <count> [audit]  # write, run, stop
    python -m tests.sidecar_driver <folder> <shape> run                    # follow until killed

``files`` writes ``count`` small files to <folder>/in one at a time, processing each (about one
data batch per file, plus the no-data batches Spark runs), then stops; with ``audit`` the
in-job audit writes to <folder>/injob.duckdb. ``run`` processes what arrives until killed.
Shapes are the functions of :mod:`tests.sidecar_defs`. The query writes Parquet to
<folder>/out and checkpoints to <folder>/checkpoint; every progress event is appended to
<folder>/progress.jsonl as it comes (Spark's own counts, for the test to compare). Status lines
are JSON on stdout.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any


def many_files(count: int, seed: int = 11, start: int = 0) -> list[list[dict[str, Any]]]:
    """``count`` small files of an out-of-order stream (files ``start`` to ``start+count-1`` of
    one endless sequence): event time moves about 4 s a file; some rows come 15-45 s late
    (behind the 10 s watermark), some repeat an earlier user and time (duplicates)."""
    from tests.test_audit_spark import ts

    rng = random.Random(seed)
    files, seen = [], [("a", 0)]
    for index in range(start + count):
        base = 20 + 4 * index
        rows = []
        for k in range(4):
            roll = rng.random()
            if roll < 0.2:
                user, second = rng.choice(seen)  # a duplicate of an earlier row
            elif roll < 0.45:
                user, second = rng.choice("abc"), max(0, base - rng.randint(15, 45))
            else:
                user, second = rng.choice("abcd"), base + rng.randint(-3, 3)
            seen.append((user, second))
            rows.append({"id": index * 10 + k, "user": user, "ts": ts(second)})
        files.append(rows)
    return files[start:]


def main(folder: str, shape: str, mode: str, count: str = "0", audit: str = "") -> int:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["WMWATCH_SIDECAR_TEST_IN"] = f"{folder}/in"
    from pyspark.sql import SparkSession

    import wmwatch
    from tests import sidecar_defs
    from tests.audit_kafka_crash_driver import _progress_recorder

    spark = (
        SparkSession.builder.master("local[1]")
        .appName("wmwatch-sidecar-production")
        .config("spark.sql.shuffle.partitions", "1")
        .config("spark.default.parallelism", "1")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "512m")
        .config("spark.sql.adaptive.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    events = sidecar_defs.events(spark)
    result = getattr(sidecar_defs, shape)(events)
    spark.streams.addListener(_progress_recorder(f"{folder}/progress.jsonl"))
    watch = wmwatch.attach(spark, db=f"{folder}/injob.duckdb" if audit else None, metrics_port=None)
    query = (
        result.writeStream.format("parquet")
        .queryName(f"sidecar_{shape}")
        .outputMode("append")
        .option("path", f"{folder}/out")
        .option("checkpointLocation", f"{folder}/checkpoint")
        .start()
    )
    handle = watch.audit(query, events, poll_interval_seconds=0.2) if audit else None
    if mode == "files":
        from tests.helpers import write_events

        for rows in many_files(int(count)):
            write_events(Path(folder) / "in", rows)
            query.processAllAvailable()
        ok = handle.sync(300) if handle is not None else True
        ok = watch.flush(30) and ok
        print(json.dumps({"done": ok, "batches": query.lastProgress["batchId"]}), flush=True)
        if handle is not None:
            handle.stop()
        query.stop()
        watch.close()
        spark.stop()
        return 0 if ok else 1
    while True:
        query.processAllAvailable()
        print(json.dumps({"batch": (query.lastProgress or {}).get("batchId")}), flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:6]))
