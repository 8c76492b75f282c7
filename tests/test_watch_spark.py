"""The core against real Spark: a windowed aggregation over a file stream, watched end to end."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import duckdb
import pytest

import wmwatch
from tests.harness.net import free_port, scrape
from tests.harness.streams import epoch_seconds, write_events

pytestmark = pytest.mark.spark

T0 = "2026-01-01T00:00:"


def ts(second: int) -> str:
    minute, sec = divmod(second, 60)
    return f"2026-01-01T00:{minute:02d}:{sec:02d}Z"


def start_windowed(spark: Any, folder: Path, name: str) -> Any:
    from pyspark.sql import functions as F

    events = (
        spark.readStream.schema("ts timestamp, user string")
        .json(str(folder / "in"))
        .withWatermark("ts", "10 seconds")
    )
    counts = events.groupBy(F.window("ts", "10 seconds")).count()
    return (
        counts.writeStream.outputMode("append")
        .format("memory")
        .queryName(name)
        .option("checkpointLocation", str(folder / "checkpoint"))
        .start()
    )


BATCHES = [
    [{"ts": ts(1), "user": "a"}, {"ts": ts(4), "user": "b"}],
    [{"ts": ts(25), "user": "a"}, {"ts": ts(12), "user": "c"}],
    [{"ts": ts(3), "user": "late"}, {"ts": ts(41), "user": "a"}],  # ts(3): its window ended
    [{"ts": ts(50), "user": "a"}],
]


def test_endpoint_and_history_match_every_progress_event(spark: Any, stream_dir: Path) -> None:
    write_events(stream_dir / "in", BATCHES[0])
    query = start_windowed(spark, stream_dir, "windowed_counts")
    try:
        query.processAllAvailable()  # started before attach: must still be watched
        port = free_port()
        db = stream_dir / "history.duckdb"
        with wmwatch.attach(spark, db=str(db), metrics_port=port) as watch:
            assert watch.metrics_url == f"http://127.0.0.1:{port}/metrics"
            for rows in BATCHES[1:]:
                write_events(stream_dir / "in", rows)
                query.processAllAvailable()
                assert watch.flush(timeout=20)
                last = query.lastProgress
                samples = scrape(watch.metrics_url)
                q = (("query", "windowed_counts"),)
                assert samples[("wmwatch_last_batch_id", q)] == last["batchId"]
                assert samples[("wmwatch_watermark_seconds", q)] == epoch_seconds(
                    last["eventTime"]["watermark"]
                )
                with_data = [p for p in query.recentProgress if "max" in p["eventTime"]][-1]
                assert samples[("wmwatch_event_time_max_seconds", q)] == epoch_seconds(
                    with_data["eventTime"]["max"]
                )
                assert samples[("wmwatch_event_time_min_seconds", q)] == epoch_seconds(
                    with_data["eventTime"]["min"]
                )
                assert samples[("wmwatch_batch_input_rows", q)] == last["numInputRows"]
                assert samples[("wmwatch_watermark_lag_seconds", q)] == pytest.approx(
                    epoch_seconds(last["timestamp"]) - epoch_seconds(last["eventTime"]["watermark"])
                )
                op = (
                    ("operator", "0"),
                    ("operator_name", "stateStoreSave"),
                    ("query", "windowed_counts"),
                )
                assert (
                    samples[("wmwatch_state_rows", op)] == last["stateOperators"][0]["numRowsTotal"]
                )
                assert samples[("wmwatch_query_up", q)] == 1
            recent = [p for p in query.recentProgress]
            dropped = sum(
                p["stateOperators"][0]["numRowsDroppedByWatermark"]
                for p in recent
                if p["batchId"] > recent[0]["batchId"] and p["stateOperators"]
            )
            assert dropped >= 1  # the late row in the third file
            assert watch.flush(timeout=20)
        with duckdb.connect(str(db), read_only=True) as con:
            rows = con.execute(
                "SELECT batch_id, run_id, epoch_ms(watermark_at), epoch_ms(late_watermark_at), "
                "epoch_ms(event_time_max_at), input_rows, rows_dropped_by_watermark "
                "FROM batches WHERE query_id = ? ORDER BY batch_id",
                [str(query.id)],
            ).fetchall()
        by_batch = {row[0]: row for row in rows}
        # every batch seen since attach is one row, values equal to Spark's. A slow machine can
        # make Spark report one batch id more than once (no-data reports before the batch that
        # read the file): the row holds the last report, as a batch seen again replaces its row.
        last_report = {p["batchId"]: p for p in query.recentProgress}
        watched = [p for batch_id, p in last_report.items() if batch_id in by_batch]
        assert len(watched) == len(rows) >= len(BATCHES)
        previous_watermark: dict[int, float] = {
            p["batchId"]: epoch_seconds(p["eventTime"]["watermark"]) * 1000
            for p in query.recentProgress
        }
        for progress in watched:
            row = by_batch[progress["batchId"]]
            assert row[1] == str(query.runId)
            assert row[2] == epoch_seconds(progress["eventTime"]["watermark"]) * 1000
            if (
                progress["batchId"] - 1 in previous_watermark
                and progress["batchId"] - 1 in by_batch
            ):
                assert row[3] == previous_watermark[progress["batchId"] - 1]
            if "max" in progress["eventTime"]:
                assert row[4] == epoch_seconds(progress["eventTime"]["max"]) * 1000
            assert row[5] == progress["numInputRows"]
            assert row[6] == sum(
                op["numRowsDroppedByWatermark"] for op in progress["stateOperators"]
            )
    finally:
        query.stop()


def test_failed_query_is_recorded_and_other_queries_keep_running(
    spark: Any, stream_dir: Path
) -> None:
    from pyspark.sql import functions as F

    def explode(batch: Any, batch_id: int) -> None:
        if batch_id >= 1:
            raise RuntimeError("boom in foreachBatch")

    write_events(stream_dir / "in", BATCHES[0])
    source = spark.readStream.schema("ts timestamp, user string").json(str(stream_dir / "in"))
    db = stream_dir / "h.duckdb"
    with wmwatch.attach(spark, db=str(db), metrics_port=None) as watch:
        failing = (
            source.writeStream.foreachBatch(explode)
            .queryName("fails_on_purpose")
            .option("checkpointLocation", str(stream_dir / "checkpoint" / "a"))
            .start()
        )
        healthy = (
            source.select(F.col("user"))
            .writeStream.format("memory")
            .queryName("keeps_running")
            .option("checkpointLocation", str(stream_dir / "checkpoint" / "b"))
            .start()
        )
        try:
            failing.processAllAvailable()
            write_events(stream_dir / "in", BATCHES[1])
            with pytest.raises(Exception, match="boom"):
                failing.processAllAvailable()
            healthy.processAllAvailable()
            assert healthy.isActive
            assert watch.flush(timeout=20)
            from prometheus_client import generate_latest

            text = generate_latest(watch.registry).decode()
            assert 'wmwatch_query_failed{query="fails_on_purpose"} 1.0' in text
            assert 'wmwatch_query_up{query="fails_on_purpose"} 0.0' in text
            assert 'wmwatch_query_up{query="keeps_running"} 1.0' in text
        finally:
            healthy.stop()
            failing.stop()
        assert watch.flush(timeout=20)
    with duckdb.connect(str(db), read_only=True) as con:
        status, exception = con.execute(
            "SELECT status, exception FROM queries WHERE query_name = 'fails_on_purpose'"
        ).fetchone()
        assert status == "failed" and "boom in foreachBatch" in exception
        assert con.execute(
            "SELECT status FROM queries WHERE query_name = 'keeps_running'"
        ).fetchone() == ("terminated",)


def test_malformed_events_are_counted_and_the_worker_goes_on(spark: Any) -> None:
    with wmwatch.attach(spark, db=None, metrics_port=None) as watch:
        for bad in ("{not json", '{"id": "x"}', json.dumps({"id": "q", "runId": "r"})[:-3], "[]"):
            watch._events.offer("progress", bad)
        watch._events.offer("terminated", "{}")
        good = {"id": "q-ok", "runId": "r", "batchId": 3, "eventTime": {}, "stateOperators": []}
        watch._events.offer("progress", json.dumps(good))
        assert watch.flush(timeout=10)
        health = watch.health.copy()
        assert health.errors == {"parse:progress": 4, "parse:terminated": 1}
        assert watch.latest("q-ok") is not None and watch.latest("q-ok").batch_id == 3


def test_port_in_use_is_reported_and_watching_continues(spark: Any) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with wmwatch.attach(spark, db=None, metrics_port=port) as watch:
            assert watch.metrics_url is None
            assert any("already in use" in p for p in watch.problems)
        with pytest.raises(wmwatch.MetricsServerError, match=f"port {port} .* already in use"):
            wmwatch.attach(spark, db=None, metrics_port=port, strict=True)


def test_unusable_db_path_is_reported_and_metrics_continue(spark: Any, tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "folder" / "h.duckdb"
    with wmwatch.attach(spark, db=str(missing), metrics_port=None) as watch:
        assert watch.store is None
        assert watch.problems and str(missing.parent) in watch.problems[0]
    with pytest.raises(wmwatch.StoreError):
        wmwatch.attach(spark, db=str(missing), metrics_port=None, strict=True)


def test_freshly_started_query_is_seen_through_the_py4j_listener(
    spark: Any, stream_dir: Path
) -> None:
    write_events(stream_dir / "in", BATCHES[0])
    with wmwatch.attach(spark, db=None, metrics_port=None) as watch:
        assert watch.health.listener_mode == "py4j"
        query = start_windowed(spark, stream_dir, "started_after_attach")
        try:
            query.processAllAvailable()
            last_batch = query.lastProgress["batchId"]

            def seen() -> int | None:
                latest = watch.latest("started_after_attach")
                return None if latest is None else latest.batch_id

            # the listener delivers the last progress a moment after processAllAvailable returns
            deadline = time.monotonic() + 10
            while seen() != last_batch and time.monotonic() < deadline:
                time.sleep(0.05)
            assert watch.flush(timeout=10)
            assert watch.health.copy().received["started"] >= 1
            assert seen() == last_batch
        finally:
            query.stop()
