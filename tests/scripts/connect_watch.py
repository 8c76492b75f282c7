"""Run a watched windowed query on a local Spark Connect server; print what wmwatch saw as JSON.

Spark Connect starts its own server JVM, so this runs in a subprocess of the test.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from connect_session import local_connect_session  # noqa: E402 - beside this script


def main(work: Path) -> None:
    from pyspark.sql import functions as F

    import wmwatch

    spark = local_connect_session()
    incoming = work / "in"
    incoming.mkdir()
    (incoming / "a.json").write_text(json.dumps({"ts": "2026-01-01T00:00:05Z"}) + "\n")
    events = (
        spark.readStream.schema("ts timestamp")
        .json(str(incoming))
        .withWatermark("ts", "10 seconds")
    )
    query = (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.outputMode("append")
        .format("memory")
        .queryName("connect_counts")
        .option("checkpointLocation", str(work / "ck"))
        .start()
    )
    query.processAllAvailable()
    (incoming / "a2.json").write_text(json.dumps({"ts": "2026-01-01T00:00:35Z"}) + "\n")
    query.processAllAvailable()
    # attached to a running query: its earlier batches come from Spark's recent progress
    watch = wmwatch.attach(spark, db=str(work / "h.duckdb"), metrics_port=None)
    (incoming / "b.json").write_text(json.dumps({"ts": "2026-01-01T00:01:05Z"}) + "\n")
    query.processAllAvailable()
    query.stop()
    last = query.lastProgress
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and watch.queries()[0].status == "active":
        time.sleep(0.1)
    watch.flush(timeout=20)
    snap = watch.latest("connect_counts")
    recorded = watch.store.read(
        lambda con: [
            r[0] for r in con.execute("SELECT batch_id FROM batches ORDER BY 1").fetchall()
        ]
    )
    result = {
        "mode": watch.health.listener_mode,
        "batch_id": snap.batch_id if snap else None,
        "expected_batch_id": last["batchId"],
        "watermark": snap.watermark_at.isoformat() if snap and snap.watermark_at else None,
        "expected_watermark": last["eventTime"]["watermark"],
        "recorded_batches": recorded,
        "expected_batches": [p["batchId"] for p in query.recentProgress],
        "batches_total": watch.queries()[0].batches_total,
    }
    watch.close()
    spark.stop()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
