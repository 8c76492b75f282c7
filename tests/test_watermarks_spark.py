"""Per-source and per-operator watermarks, and watermark findings, against real Spark."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

import wmwatch
from tests.harness.streams import write_events
from wmwatch._inspect.plugin import PlanPlugin
from wmwatch.cli import app

pytestmark = pytest.mark.spark


def ts(minute: int, second: int = 0) -> str:
    return f"2026-01-01T00:{minute:02d}:{second:02d}Z"


def attach(spark: Any, folder: Path, registry: CollectorRegistry) -> tuple[Any, PlanPlugin]:
    watch = wmwatch.attach(spark, db=str(folder / "h.duckdb"), metrics_port=None, registry=registry)
    plugin = next(p for p in watch.plugins() if isinstance(p, PlanPlugin))
    return watch, plugin


def settle(watch: Any, plugin: PlanPlugin) -> None:
    watch.flush()
    plugin.wait_idle()


def test_idle_input_named_as_holding_the_watermark_back(spark: Any, stream_dir: Path) -> None:
    left, right = stream_dir / "left", stream_dir / "right"
    left.mkdir()
    right.mkdir()
    schema = "k INT, ts TIMESTAMP"
    registry = CollectorRegistry()
    watch, plugin = attach(spark, stream_dir, registry)
    a = spark.readStream.schema(schema).json(str(left)).withWatermark("ts", "10 seconds")
    b = spark.readStream.schema(schema).json(str(right)).withWatermark("ts", "10 seconds")
    query = (
        a.unionByName(b)
        .dropDuplicates(["k", "ts"])
        .writeStream.format("noop")
        .queryName("two_inputs")
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        for minute in range(2):
            write_events(left, [{"k": minute, "ts": ts(minute)}])
            write_events(right, [{"k": 100 + minute, "ts": ts(minute)}])
            query.processAllAvailable()
        for minute in range(2, 9):  # the right input gets nothing more
            write_events(left, [{"k": minute, "ts": ts(minute)}])
            query.processAllAvailable()
        settle(watch, plugin)
        summary = plugin.summary()["two_inputs"]
        by_source = {
            Path(s["source"].split("file:")[1].rstrip("]")).name: s for s in summary["sources"]
        }
        assert summary["policy"] == "min"
        assert by_source["right"]["holding_back"] is True
        assert by_source["right"]["idle_batches"] >= 5
        assert by_source["left"]["holding_back"] is False
        assert by_source["right"]["watermark_at"] == "2026-01-01T00:00:50+00:00"
        assert by_source["left"]["watermark_at"] == "2026-01-01T00:07:50+00:00"
        assert by_source["left"]["event_time_max_at"] == "2026-01-01T00:08:00+00:00"

        right_label = next(s["source"] for s in summary["sources"] if s["holding_back"])
        left_label = next(s["source"] for s in summary["sources"] if not s["holding_back"])
        labels = {"query": "two_inputs", "source": right_label}
        assert registry.get_sample_value("wmwatch_watermark_holding_back", labels) == 1.0
        assert (
            registry.get_sample_value(
                "wmwatch_watermark_holding_back", {"query": "two_inputs", "source": left_label}
            )
            == 0.0
        )
        assert registry.get_sample_value(
            "wmwatch_source_watermark_seconds", labels
        ) == pytest.approx(1767225650.0)
        assert (
            registry.get_sample_value(
                "wmwatch_multiple_watermark_policy_info", {"query": "two_inputs", "policy": "min"}
            )
            == 1.0
        )

        stalled = [f for f in summary["findings"] if f["kind"] == "watermark_stalled"]
        assert len(stalled) == 1 and stalled[0]["status"] == "active"
        assert stalled[0]["evidence"]["holding_back"] == [right_label]
        assert "held back by" in stalled[0]["message"] and "idle for" in stalled[0]["message"]
        query_id = str(query.id)
    finally:
        query.stop()
        watch.close()
    con = duckdb.connect(str(stream_dir / "h.duckdb"), read_only=True)
    try:
        rows = con.execute(
            "SELECT source, holding_back, idle_batches FROM source_watermarks WHERE query_id = ? "
            "AND batch_id = (SELECT max(batch_id) FROM source_watermarks WHERE query_id = ?)",
            [query_id, query_id],
        ).fetchall()
        kinds = con.execute(
            "SELECT kind, status FROM findings WHERE query_id = ?", [query_id]
        ).fetchall()
    finally:
        con.close()
    assert sorted((r[0] == right_label, r[1]) for r in rows) == [(False, False), (True, True)]
    assert ("watermark_stalled", "active") in kinds

    result = CliRunner().invoke(
        app, ["report", "--db", str(stream_dir / "h.duckdb"), "--format", "json"]
    )
    assert result.exit_code == 0, result.output
    (reported,) = json.loads(result.stdout)["queries"]
    assert reported["watermarks"]["holding_back"] == [right_label]
    assert reported["watermarks"]["policy"] == "min"
    table = CliRunner().invoke(
        app, ["report", "--db", str(stream_dir / "h.duckdb")], terminal_width=250
    )
    assert table.exit_code == 0, table.output
    # the table wraps at 80 columns: the right input's row carries the note
    text = " ".join(table.stdout.split())
    assert "holding the" in text and "watermark back" in text


def test_chained_aggregations_show_both_operator_watermarks(spark: Any, stream_dir: Path) -> None:
    from pyspark.sql import functions as F

    registry = CollectorRegistry()
    watch, plugin = attach(spark, stream_dir, registry)
    events = spark.readStream.schema("k INT, ts TIMESTAMP").json(str(stream_dir / "in"))
    per_minute = (
        events.withWatermark("ts", "10 seconds").groupBy(F.window("ts", "1 minute")).count()
    )
    per_five = per_minute.groupBy(F.window(F.col("window"), "5 minutes")).agg(F.sum("count"))
    write_events(stream_dir / "in", [{"k": 0, "ts": ts(0, 30)}])
    query = (
        per_five.writeStream.format("noop")
        .outputMode("append")
        .queryName("chained")
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        query.processAllAvailable()
        for minute in range(1, 4):
            write_events(stream_dir / "in", [{"k": minute, "ts": ts(minute, 30)}])
            query.processAllAvailable()
        settle(watch, plugin)
        operators = plugin.summary()["chained"]["operators"]
        assert [o["operator_id"] for o in operators] == [0, 1]
        for op in ("0", "1"):
            for kind in ("late", "eviction"):
                value = registry.get_sample_value(
                    "wmwatch_operator_watermark_seconds",
                    {"query": "chained", "operator": op, "kind": kind},
                )
                assert value is not None and value > 0
        query_id = str(query.id)
    finally:
        query.stop()
        watch.close()
    con = duckdb.connect(str(stream_dir / "h.duckdb"), read_only=True)
    try:
        rows = con.execute(
            "SELECT o.batch_id, o.operator_id, o.eviction_watermark_at = b.watermark_at, "
            "o.late_watermark_at <= o.eviction_watermark_at "
            "FROM operator_watermarks o JOIN batches b USING (query_id, batch_id) "
            "WHERE o.query_id = ? ORDER BY o.batch_id DESC, o.operator_id LIMIT 2",
            [query_id],
        ).fetchall()
    finally:
        con.close()
    # both operators in the same batch; eviction uses the batch's watermark, late rows the
    # previous one
    assert [r[1] for r in rows] == [0, 1] and rows[0][0] == rows[1][0]
    assert all(r[2] and r[3] for r in rows)


def test_future_dated_row_flags_a_jump_and_the_drops_it_caused(
    spark: Any, stream_dir: Path
) -> None:
    registry = CollectorRegistry()
    watch, plugin = attach(spark, stream_dir, registry)
    events = spark.readStream.schema("k INT, ts TIMESTAMP").json(str(stream_dir / "in"))
    query = (
        events.withWatermark("ts", "10 seconds")
        .dropDuplicates(["k", "ts"])
        .writeStream.format("noop")
        .queryName("jumpy")
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        for minute in range(4):
            write_events(
                stream_dir / "in", [{"k": minute * 10 + j, "ts": ts(minute, j)} for j in range(2)]
            )
            query.processAllAvailable()
        write_events(
            stream_dir / "in", [{"k": 99, "ts": "2026-01-03T00:00:00Z"}, {"k": 98, "ts": ts(4)}]
        )
        query.processAllAvailable()
        for minute in (5, 6):  # on time by the clock of the source, but behind the jumped watermark
            write_events(
                stream_dir / "in", [{"k": minute * 10 + j, "ts": ts(minute, j)} for j in range(3)]
            )
            query.processAllAvailable()
        settle(watch, plugin)
        (jump,) = [
            f for f in plugin.summary()["jumpy"]["findings"] if f["kind"] == "watermark_jump"
        ]
        assert jump["status"] == "active" and jump["severity"] == "critical"
        evidence = jump["evidence"]
        assert evidence["watermark_after_at"] == "2026-01-02T23:59:50+00:00"
        assert evidence["caused_by_event_time_max_at"] == "2026-01-03T00:00:00+00:00"
        assert evidence["jump_seconds"] > 86000
        assert evidence["dropped_after_jump"] == 6
        assert (
            registry.get_sample_value(
                "wmwatch_findings_active", {"query": "jumpy", "kind": "watermark_jump"}
            )
            == 1.0
        )
        query_id = str(query.id)
    finally:
        query.stop()
        watch.close()
    con = duckdb.connect(str(stream_dir / "h.duckdb"), read_only=True)
    try:
        dropped_after = con.execute(
            "SELECT sum(rows_dropped_by_watermark) FROM batches"
            " WHERE query_id = ? AND batch_id > ?",
            [query_id, evidence["batch_id"]],
        ).fetchone()
    finally:
        con.close()
    # every row Spark dropped after the jump is attributed to it, and no others
    assert dropped_after is not None and dropped_after[0] == 6
    assert sorted(evidence["batches_with_drops"]) == evidence["batches_with_drops"]
