"""Late rows in real-time mode (``trigger(realTime=...)``), pinned against real runs.

A real-time batch reads its source for the whole interval, but its watermarks are fixed when it
starts: late rows are judged against the watermark of the batch before, which is a whole interval
old. Rows go in through ``LowLatencyMemoryStream``, Spark's in-memory real-time source.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.realtime import RealTimeRun

pytestmark = [pytest.mark.spark, pytest.mark.slow]


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
