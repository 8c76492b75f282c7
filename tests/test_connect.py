"""Spark Connect only: the watch follows queries through the stock listener in the client, and the
join check and operator watermarks come from the explain text (a client has no plan objects).

Marked ``connect``: a classic run leaves these out, and ``tests/test_connect_suite.py`` runs
them on its Spark Connect server.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

import wmwatch
from tests.harness.streams import epoch_seconds
from wmwatch._inspect.plugin import PlanPlugin

pytestmark = [pytest.mark.spark, pytest.mark.connect]


def test_spark_connect_queries_are_watched_with_the_stock_listener(
    spark: Any, stream_dir: Path
) -> None:
    from pyspark.sql import functions as F

    incoming = stream_dir / "in"
    (incoming / "a.json").write_text(json.dumps({"ts": "2026-01-01T00:00:05Z"}) + "\n")
    events = spark.readStream.schema("ts timestamp").json(str(incoming))
    query = (
        events.withWatermark("ts", "10 seconds")
        .groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.outputMode("append")
        .format("memory")
        .queryName("connect_counts")
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    watch = None
    try:
        query.processAllAvailable()
        (incoming / "a2.json").write_text(json.dumps({"ts": "2026-01-01T00:00:35Z"}) + "\n")
        query.processAllAvailable()
        # attached to a running query: its earlier batches come from Spark's recent progress
        watch = wmwatch.attach(spark, db=str(stream_dir / "h.duckdb"), metrics_port=None)
        (incoming / "b.json").write_text(json.dumps({"ts": "2026-01-01T00:01:05Z"}) + "\n")
        query.processAllAvailable()
    finally:
        query.stop()
    assert watch is not None
    try:
        last = query.lastProgress
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and watch.queries()[0].status == "active":
            time.sleep(0.1)
        watch.flush(timeout=20)
        snap = watch.latest("connect_counts")
        assert watch.store is not None
        recorded = watch.store.read(
            lambda con: [
                r[0] for r in con.execute("SELECT batch_id FROM batches ORDER BY 1").fetchall()
            ]
        )
        expected = [p["batchId"] for p in query.recentProgress]
        assert watch.health.listener_mode == "stock"
        assert snap is not None and snap.batch_id == last["batchId"]
        assert snap.watermark_at is not None
        assert snap.watermark_at.timestamp() == epoch_seconds(last["eventTime"]["watermark"])
        # started before attach: the history starts at the query's first batch, each batch once
        assert recorded == expected == list(range(len(expected)))
        assert watch.queries()[0].batches_total == len(expected)
    finally:
        watch.close()


def test_connect_join_classified_from_plan_text(spark: Any, stream_dir: Path) -> None:
    from pyspark.sql import functions as F

    for name in ("l", "r"):
        (stream_dir / name).mkdir()
    watch = wmwatch.attach(spark, db=str(stream_dir / "h.duckdb"), metrics_port=None)
    plugin = next(p for p in watch.plugins() if isinstance(p, PlanPlugin))

    def side(name: str, prefix: str) -> Any:
        frame = spark.readStream.schema("k INT, ts TIMESTAMP").json(str(stream_dir / name))
        frame = frame.withWatermark("ts", "10 seconds")
        return frame.select(F.col("k").alias(f"{prefix}k"), F.col("ts").alias(f"{prefix}ts"))

    one_sided = side("l", "l").join(side("r", "r"), F.expr("lk = rk AND rts >= lts"), "inner")
    query = (
        one_sided.writeStream.format("noop")
        .queryName("connect_join")
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        for batch in range(3):
            for name in ("l", "r"):
                rows = [
                    {"k": batch * 10 + j, "ts": f"2026-01-01T00:{batch:02d}:{j * 5:02d}Z"}
                    for j in range(3)
                ]
                text = "".join(json.dumps(r) + "\n" for r in rows)
                (stream_dir / name / f"{batch}.json").write_text(text)
            query.processAllAvailable()
        last = query.lastProgress
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            snap = watch.latest("connect_join")
            if snap is not None and snap.batch_id >= last["batchId"]:
                break
            time.sleep(0.1)
        watch.flush(timeout=20)
        plugin.wait_idle(timeout=20)
        summary = plugin.summary()["connect_join"]
    finally:
        query.stop()
        watch.close()
    assert summary["joins"] == [
        {"operator_id": 0, "case": "one_sided_range", "unbounded_sides": ["left"]}
    ]
    findings = summary["findings"]
    assert sorted((f["kind"], f["side"]) for f in findings) == [("join_state_unbounded", "left")]
    assert [f["evidence"].get("via") for f in findings] == ["text"]
    (operator,) = summary["operators"]
    assert operator["operator_name"] == "symmetricHashJoin"
    assert operator["eviction_watermark_at"] == "2026-01-01T00:02:00+00:00"
