"""A watched session whose listener bus drops streaming events; prints what wmwatch saw as JSON.

Spark gives its "streams" listener queue a tiny capacity here, and a stock PySpark listener
(which converts every event field by field over py4j, 100+ ms each) sits on the same queue, as a
slow listener of another team would. The queue overflows, Spark drops events before any listener
sees them, and wmwatch must notice: the gaps in batch ids, and Spark's own drop counter.
Runs in a subprocess because the capacity must be set before the SparkContext starts.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def main(work: Path, seconds: float) -> None:
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families
    from pyspark.sql import SparkSession
    from pyspark.sql.streaming import StreamingQueryListener  # type: ignore[attr-defined]  # exported untyped

    import wmwatch

    spark = (
        SparkSession.builder.master("local[2]")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.scheduler.listenerbus.eventqueue.streams.capacity", "4")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("OFF")

    class SlowStockListener(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:  # noqa: N802
            pass

        def onQueryProgress(self, event: Any) -> None:  # noqa: N802
            time.sleep(1.0)

        def onQueryIdle(self, event: Any) -> None:  # noqa: N802
            pass

        def onQueryTerminated(self, event: Any) -> None:  # noqa: N802
            pass

    watch = wmwatch.attach(spark, db=str(work / "h.duckdb"), metrics_port=None)
    spark.streams.addListener(SlowStockListener())
    query = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 50)
        .load()
        .writeStream.format("noop")
        .queryName("bus_pressure")
        .trigger(processingTime="50 milliseconds")
        .option("checkpointLocation", str(work / "cp"))
        .start()
    )
    time.sleep(seconds)
    query.stop()
    last_batch = query.lastProgress["batchId"] if query.lastProgress else -1
    time.sleep(6)  # one more poll of Spark's counter by the worker
    watch.flush(timeout=30)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(watch.registry).decode())
        for s in family.samples
    }
    received = watch.health.copy().received
    watch.close()
    import duckdb

    with duckdb.connect(str(work / "h.duckdb"), read_only=True) as con:
        recorded = [
            r[0]
            for r in con.execute(
                "SELECT batch_id FROM batches WHERE query_id = ? ORDER BY batch_id", [str(query.id)]
            ).fetchall()
        ]
    print(
        json.dumps(
            {
                "last_batch_id": last_batch,
                "recorded_batch_ids": recorded,
                "received": received,
                "missed_total": samples.get(
                    ("wmwatch_progress_events_missed_total", (("query", "bus_pressure"),))
                ),
                "spark_dropped_total": samples.get(
                    ("wmwatch_spark_listener_events_dropped_total", ())
                ),
                "query_up_after_stop": samples.get(
                    ("wmwatch_query_up", (("query", "bus_pressure"),))
                ),
            }
        )
    )
    spark.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
