"""The late-row audit of the other operators that drop late input, against real Spark: session
windows, aggregations keyed by the raw event-time column, ``applyInPandasWithState`` with an
event-time timeout and ``transformWithStateInPandas`` in event-time mode.

The stream is the one of tests/test_audit_spark.py (rows exactly on the watermark, a no-data
batch that moves the watermark, duplicates), run with one file per batch and with availableNow.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry

import wmwatch
from tests.audit_crash_driver import seen_processor, seen_rows
from tests.harness.audited import run_audited
from tests.harness.checks import dropped_by_watermark
from tests.harness.streams import DELAY, SCHEMA, all_rows, stream_files, write_events

pytestmark = pytest.mark.spark


def late_ids(result: dict[str, Any]) -> list[int]:
    return [json.loads(r[8])["id"] for r in result["late"]]


@pytest.mark.parametrize("batching", ["each", "bulk"])
def test_session_window_conservation(spark: Any, stream_dir: Path, batching: str) -> None:
    from pyspark.sql import functions as F

    result = run_audited(
        spark,
        stream_dir,
        lambda e: e.groupBy("user", F.session_window("ts", "5 seconds")).count(),
        batching=batching,
        name=f"session_{batching}",
    )
    rows = all_rows(result["files"])
    ids = late_ids(result)
    assert ids and len(ids) == len(set(ids))
    for _batch, event_ms, wm_ms, _lateness, start_ms, end_ms, kind, _src, _data in result["late"]:
        # the row's own session [ts, ts + gap) ended by the watermark
        assert kind == "session" and start_ms == event_ms and end_ms == event_ms + 5000
        assert end_ms <= wm_ms
    # every input row is in an emitted session or audited, except the flush row's open session
    emitted = sum(r["count"] for r in result["output"])
    assert emitted + len(ids) == len(rows) - 1
    # Spark counts the (user, session) groups of each input partition (a file here) that were
    # late, after partial aggregation: rows of one user at one time in one file are one group
    by_id = {r["id"]: r for r in rows}
    groups = {
        (r[0], r[7], by_id[i]["user"], by_id[i]["ts"])
        for r, i in zip(result["late"], ids, strict=True)
    }
    assert len(groups) == dropped_by_watermark(result["progress"])


@pytest.mark.parametrize("batching", ["each", "bulk"])
def test_raw_event_time_aggregation_conservation(
    spark: Any, stream_dir: Path, batching: str
) -> None:
    """``groupBy("user", "ts")`` in update mode: last count + audited rows = all input."""
    updates: list[tuple[int, str, str, int]] = []

    def sink(frame: Any, batch_id: int) -> None:
        updates.extend(
            (batch_id, r["user"], r["ts"].isoformat(), r["count"]) for r in frame.collect()
        )

    files = stream_files()
    reader = spark.readStream.schema(SCHEMA)
    if batching == "bulk":
        for f in files:
            write_events(stream_dir / "in", f)
        reader = reader.option("maxFilesPerTrigger", 2)
    events = reader.json(str(stream_dir / "in")).withWatermark("ts", DELAY)
    db = stream_dir / "h.duckdb"
    writer = (
        events.groupBy("user", "ts")
        .count()
        .writeStream.outputMode("update")
        .foreachBatch(sink)
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
    )
    if batching == "bulk":
        writer = writer.trigger(availableNow=True)
    query = writer.start()
    try:
        with wmwatch.attach(
            spark, db=str(db), metrics_port=None, registry=CollectorRegistry()
        ) as watch:
            handle = watch.audit(query, events)
            assert handle.spec.kind == "aggregate" and handle.spec.event_time_column == "ts"
            if batching == "bulk":
                query.awaitTermination(120)
            for f in files if batching == "each" else ():
                write_events(stream_dir / "in", f)
                query.processAllAvailable()
            assert handle.sync(60)
            handle.stop()
            progress = list(query.recentProgress)
    finally:
        query.stop()
    last = {(user, at): count for _, user, at, count in sorted(updates)}
    with duckdb.connect(str(db), read_only=True) as con:
        late = con.execute(
            "SELECT batch_id, row_data::VARCHAR, operator_kind FROM late_rows"
        ).fetchall()
    assert late and {k for _, _, k in late} == {"aggregate"}
    rows = all_rows(files)
    by_id = {r["id"]: r for r in rows}
    audited = Counter()
    for _, data, _ in late:
        row = by_id[json.loads(data)["id"]]
        audited[(row["user"], row["ts"])] += 1
    expected = Counter((r["user"], r["ts"]) for r in rows)
    from datetime import datetime

    def key(at: str) -> str:
        return datetime.fromisoformat(at.replace("Z", "+00:00")).replace(tzinfo=None).isoformat()

    for (user, at), total in expected.items():
        assert last.get((user, key(at)), 0) + audited.get((user, at), 0) == total, (user, at)
    # one late group per (batch, user, ts): Spark's count, after partial aggregation
    groups = {
        (b, by_id[json.loads(d)["id"]]["user"], by_id[json.loads(d)["id"]]["ts"])
        for b, d, _ in late
    }
    assert len(groups) == dropped_by_watermark(progress)


@pytest.mark.parametrize("batching", ["each", "bulk"])
def test_apply_in_pandas_with_state_event_time_timeout(
    spark: Any, stream_dir: Path, batching: str
) -> None:
    result = run_audited(
        spark,
        stream_dir,
        lambda e: e.groupBy("user").applyInPandasWithState(
            seen_rows, "id int", "n int", "append", "EventTimeTimeout"
        ),
        batching=batching,
        name=f"state_{batching}",
    )
    ids = late_ids(result)
    seen = [r["id"] for r in result["output"]]
    assert ids and len(ids) == len(set(ids))
    assert not set(ids) & set(seen)  # a dropped row never reached the function
    assert sorted(ids + seen) == sorted(r["id"] for r in all_rows(result["files"]))
    assert len(ids) == dropped_by_watermark(result["progress"])  # raw rows, exactly
    assert {r[6] for r in result["late"]} == {"state"}


@pytest.mark.parametrize("batching", ["each", "bulk"])
def test_transform_with_state_in_event_time_mode(
    spark: Any, stream_dir: Path, batching: str
) -> None:
    from pyspark.sql.types import IntegerType, StructField, StructType

    provider = "spark.sql.streaming.stateStore.providerClass"
    before = spark.conf.get(provider, None)
    spark.conf.set(
        provider, "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
    )
    try:
        result = run_audited(
            spark,
            stream_dir,
            lambda e: e.groupBy("user").transformWithStateInPandas(
                statefulProcessor=seen_processor(),
                outputStructType=StructType([StructField("id", IntegerType())]),
                outputMode="Append",
                timeMode="EventTime",
            ),
            batching=batching,
            name=f"tws_{batching}",
        )
    finally:
        # unset rather than set to the default: real-time mode refuses an explicit default
        if before is None:
            spark.conf.unset(provider)
        else:
            spark.conf.set(provider, before)
    ids = late_ids(result)
    seen = [r["id"] for r in result["output"]]
    assert ids and not set(ids) & set(seen)
    assert sorted(ids + seen) == sorted(r["id"] for r in all_rows(result["files"]))
    assert len(ids) == dropped_by_watermark(result["progress"])
