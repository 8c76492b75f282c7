"""Late rows in real-time mode (``trigger(realTime=...)``), pinned against real runs.

A real-time batch reads its source for the whole interval, but its watermarks are fixed when it
starts: late rows are judged against the watermark of the batch before, which is a whole interval
old. Rows go in through ``LowLatencyMemoryStream``, Spark's in-memory real-time source.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

BASE = datetime(2026, 1, 1, tzinfo=UTC)


class RealTimeRun:
    """A real-time query over a LowLatencyMemoryStream of ``key,seconds`` strings."""

    def __init__(self, spark: Any, tmp: Any) -> None:
        from pyspark.sql import DataFrame

        jvm = spark._jvm
        self.jvm = jvm
        self.spark = spark
        self.tmp = tmp
        self.stream = (
            jvm.org.apache.spark.sql.execution.streaming.sources.LowLatencyMemoryStream.apply(
                spark._jsparkSession, 1, jvm.org.apache.spark.sql.Encoders.STRING()
            )
        )
        self.frame = DataFrame(self.stream.toDF(), spark)
        self.name = f"rt_{uuid.uuid4().hex[:12]}"
        self.query: Any = None

    def events(self) -> Any:
        from pyspark.sql import functions as F

        parts = F.split("value", ",")
        seconds = parts.getItem(1).cast("double") + BASE.timestamp()
        return self.frame.select(
            parts.getItem(0).alias("k"), F.timestamp_seconds(seconds).alias("ts")
        ).withWatermark("ts", "10 seconds")

    def start(self, frame: Any) -> None:
        sink = str(self.tmp / "out.jsonl")

        def append(record: Any) -> None:  # runs on an executor: one JSON line per output row
            with open(sink, "a") as handle:
                handle.write(json.dumps(record.asDict(recursive=True), default=str) + "\n")

        self.sink = self.tmp / "out.jsonl"
        # every stage of a real-time batch runs at once: one source partition and one shuffle
        # partition fit the two local task slots
        saved = self.spark.conf.get("spark.sql.shuffle.partitions")
        self.spark.conf.set("spark.sql.shuffle.partitions", "1")
        try:
            self._start(frame, append)
        finally:
            self.spark.conf.set("spark.sql.shuffle.partitions", saved)

    def _start(self, frame: Any, append: Any) -> None:
        self.query = (
            frame.writeStream.foreach(append)
            .queryName(self.name)
            .outputMode("update")
            .trigger(realTime="5 seconds")
            .option("checkpointLocation", str(self.tmp / "checkpoint"))
            .start()
        )

    def add(self, *values: str) -> None:
        java_list = self.jvm.java.util.ArrayList()
        for value in values:
            java_list.add(value)
        self.stream.addData(self.jvm.scala.jdk.javaapi.CollectionConverters.asScala(java_list))

    def progress(self) -> list[dict[str, Any]]:
        return [json.loads(p.json()) for p in self.query._jsq.recentProgress()]

    def wait_for(self, done: Any, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.progress():
                if done(p):
                    return p
            if self.query.exception() is not None:
                raise AssertionError(str(self.query.exception()))
            time.sleep(0.1)
        raise AssertionError(f"no such progress within {timeout} s: {self.progress()}")

    def output(self) -> list[dict[str, Any]]:
        if not self.sink.exists():
            return []
        return [json.loads(line) for line in self.sink.read_text().splitlines()]

    def stop(self) -> None:
        if self.query is not None:
            self.query.stop()


@pytest.fixture
def rt(spark: Any, tmp_path: Any) -> Iterator[RealTimeRun]:
    handle = RealTimeRun(spark, tmp_path)
    yield handle
    handle.stop()


def test_real_time_late_rows_use_the_previous_batch_watermark(rt: RealTimeRun) -> None:
    from pyspark.sql import functions as F

    counts = (
        rt.events().groupBy(F.window("ts", "10 seconds").alias("w")).agg(F.count("*").alias("n"))
    )
    rt.start(counts)
    rt.add("w,100")
    first = rt.wait_for(lambda p: p["numInputRows"] > 0)
    b = first["batchId"]
    # batch b+1 has already started: its watermark is 90 s, but it judges late rows with batch
    # b's (0), so a row 40 s behind the watermark it reports is still aggregated
    rt.add("a,50")
    kept = rt.wait_for(lambda p: p["batchId"] == b + 1)
    # batch b+2 judges with batch b+1's watermark, 90 s: the same row is now dropped
    rt.add("b,50")
    dropped = rt.wait_for(lambda p: p["batchId"] == b + 2)
    assert kept["eventTime"]["watermark"] == "2026-01-01T00:01:30.000Z"
    assert kept["numInputRows"] == 1
    assert kept["stateOperators"][0]["numRowsDroppedByWatermark"] == 0
    assert dropped["numInputRows"] == 1
    assert dropped["stateOperators"][0]["numRowsDroppedByWatermark"] == 1
    # the kept row was aggregated into window [50, 60), which ended 30 s before the watermark
    # of its batch, and emitted; the dropped one never reached the aggregation
    late_windows = [
        (r["w"]["start"], r["n"]) for r in rt.output() if r["w"]["start"] < "2026-01-01 00:01:00"
    ]
    assert late_windows == [("2026-01-01 00:00:50", 1)]
    assert kept["stateOperators"][0]["operatorName"] == "StatefulStreamlineAggregate"
    # eviction in that same batch used its own watermark, 90 s: the window was added and removed
    assert kept["stateOperators"][0]["numRowsRemoved"] == 1
    assert kept["stateOperators"][0]["numRowsTotal"] == 1


def test_real_time_deduplication_uses_the_previous_batch_watermark(rt: RealTimeRun) -> None:
    rt.start(rt.events().dropDuplicates(["k", "ts"]))
    rt.add("w,100")
    first = rt.wait_for(lambda p: p["numInputRows"] > 0)
    b = first["batchId"]
    rt.add("a,50")
    kept = rt.wait_for(lambda p: p["batchId"] == b + 1)
    rt.add("b,50")
    dropped = rt.wait_for(lambda p: p["batchId"] == b + 2)
    # batch b+1 judged with 0 and kept the row (emitted), then evicted it with 90 at its end
    assert kept["eventTime"]["watermark"] == "2026-01-01T00:01:30.000Z"
    assert kept["stateOperators"][0]["numRowsDroppedByWatermark"] == 0
    assert kept["stateOperators"][0]["numRowsRemoved"] == 1
    assert kept["stateOperators"][0]["numRowsTotal"] == 1
    # batch b+2 judged with 90 and dropped the same row as late
    assert dropped["stateOperators"][0]["numRowsDroppedByWatermark"] == 1
    assert sorted(r["k"] for r in rt.output()) == ["a", "w"]
