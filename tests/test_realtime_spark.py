"""wmwatch on real-time queries (``trigger(realTime="5 seconds")``), against real Spark.

One real-time query per operator Real-time Mode runs statefully (a windowed aggregation, a
``dropDuplicates`` with the event time), each with a late row in the first batch after the
watermark moved (kept: that batch judges with the watermark of the batch before) and the same
kind of row in the next batch (dropped). The audit replays each batch from the offsets the
checkpoint logged, through the memory stream's own reader, and must agree with Spark batch by
batch; the watch must name the real-time operator and the trigger. On ``local[2]`` the query's
batches hold every task slot, so the audit must not start a replay while the query runs (Spark
would fail the query): it replays once the run stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

import wmwatch
from tests.realtime import BASE, KafkaRealTimeRun, RealTimeRun
from wmwatch._audit.report.section import LATE_ROWS_SECTION
from wmwatch._inspect.plugin import PlanPlugin
from wmwatch.cli import app

pytestmark = [pytest.mark.spark, pytest.mark.slow]

LATE_ROWS = LATE_ROWS_SECTION.key


@pytest.fixture
def rt(spark: Any, tmp_path: Path) -> Iterator[RealTimeRun]:
    handle = RealTimeRun(spark, tmp_path)
    yield handle
    handle.stop()


@pytest.fixture
def kafka_rt(spark: Any, kafka: str, tmp_path: Path) -> Iterator[RealTimeRun]:
    handle = KafkaRealTimeRun(spark, tmp_path, kafka)
    yield handle
    handle.stop()


def _late_watermark_read(plugin: PlanPlugin, name: str) -> bool:
    operators = plugin.summary().get(name, {}).get("operators") or []
    return any(op["late_watermark_at"] is not None for op in operators)


def run_audited(rt: RealTimeRun, build: Any, tmp_path: Path) -> dict[str, Any]:
    """Start ``build(events)`` in real-time mode with the watch and the audit; feed it a row,
    then a late row in the first batch after the watermark moved, then one in the next."""
    registry = CollectorRegistry()
    db = tmp_path / "h.duckdb"
    watch = wmwatch.attach(rt.spark, db=str(db), metrics_port=None, registry=registry)
    plugin = next(p for p in watch.plugins() if isinstance(p, PlanPlugin))
    try:
        events = rt.events()
        rt.start(build(events))
        prepare = None if rt.as_written else rt.parse
        audit = watch.audit(rt.query, events, prepare=prepare, poll_interval_seconds=0.2)
        rt.add("w,100")
        b = rt.wait_for(lambda p: p["numInputRows"] > 0)["batchId"]
        rt.add("a,50")  # batch b+1: its watermark is 90 s, it judges with b's (0): kept
        rt.wait_for(lambda p: p["batchId"] == b + 1)
        rt.add("b,50")  # batch b+2 judges with 90 s: dropped
        rt.wait_for(lambda p: p["batchId"] == b + 2)
        # one more batch, so that the plan's watermarks are read while the query runs
        rt.wait_for(lambda p: p["batchId"] == b + 3)
        # the audit reaches batch b+1 (it may hold rows kept behind the watermark) and waits,
        # and the plan's late-row watermark (90 s from batch b+2 on) has been read
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (
            audit.status()["waiting_for_task_slot"] and _late_watermark_read(plugin, rt.name)
        ):
            time.sleep(0.2)
        during = audit.status()
        assert rt.query.isActive and rt.query.exception() is None
        rt.stop()
        assert audit.sync(60), audit.status()
        watch.flush(20)
        plugin.wait_idle(20)
        result = {
            "b": b,
            "during": during,
            "status": audit.status(),
            "progress": rt.progress(),
            "operators": plugin.summary()[rt.name]["operators"],
            "kept_metric": registry.get_sample_value(
                "wmwatch_rows_kept_behind_watermark_total", {"query": rt.name}
            ),
            "info": [
                s.labels
                for m in registry.collect()
                if m.name == "wmwatch_query_info"
                for s in m.samples
            ],
        }
    finally:
        watch.close()
    with duckdb.connect(str(db), read_only=True) as con:
        result["late"] = con.execute(
            "SELECT batch_id, operator_kind, row_data::VARCHAR, source_file FROM late_rows"
        ).fetchall()
        result["marks"] = dict(
            con.execute("SELECT batch_id, rows_kept_behind_watermark FROM audit_batches").fetchall()
        )
        result["operator_watermarks"] = con.execute(
            "SELECT operator_name, max(late_watermark_at), max(eviction_watermark_at) "
            "FROM operator_watermarks GROUP BY operator_name"
        ).fetchall()
        result["trigger"] = con.execute(
            "SELECT DISTINCT trigger, trigger_interval_ms FROM queries"
        ).fetchall()
    result["report"] = CliRunner().invoke(app, ["report", "--db", str(db), "--format", "json"])
    result["html"] = CliRunner().invoke(
        app, ["report", "--db", str(db), "--format", "html", "--output", "-"]
    )
    return result


def check(result: dict[str, Any], kind: str, operator: str) -> None:
    b = result["b"]
    by_batch = {p["batchId"]: p for p in result["progress"]}
    dropped = {
        batch: sum(op["numRowsDroppedByWatermark"] for op in p["stateOperators"])
        for batch, p in by_batch.items()
    }
    late_by_batch: dict[int, int] = {}
    for batch, *_ in result["late"]:
        late_by_batch[batch] = late_by_batch.get(batch, 0) + 1
    # the audit agrees with Spark batch by batch: only b+2 dropped a row
    assert {k: v for k, v in dropped.items() if v} == {b + 2: 1}
    assert late_by_batch == {b + 2: 1}
    ((_, late_kind, row, source),) = result["late"]
    assert late_kind == kind and json.loads(row)["k"] == "b" and source is None
    # b+1 kept the row at 50 s although it reported a watermark of 90 s
    assert result["marks"][b + 1] == 1
    assert result["marks"][b + 2] == 0  # judged with 90 s: nothing kept behind it
    assert result["status"]["rows_kept_behind_watermark"] == 1
    assert result["kept_metric"] == 1.0
    assert result["status"]["errors"] == 0
    # the query's batches held both task slots of local[2]: while it ran, no replay started
    # beside it (that would have failed the query), and the audit said it was waiting
    assert result["during"]["waiting_for_task_slot"] is True
    assert result["during"]["batches_replayed"] == 0
    assert result["status"]["waiting_for_task_slot"] is False
    # the watch names the real-time operator, with its watermarks, and the trigger
    (op,) = result["operators"]
    assert op["operator_name"] == operator
    ((name, late_at, eviction_at),) = result["operator_watermarks"]
    assert name == operator
    # read from the plan: the late-row watermark trails the eviction one by a batch
    assert eviction_at is not None and eviction_at.timestamp() == BASE.timestamp() + 90
    assert late_at is not None and late_at <= eviction_at
    assert result["trigger"] == [("real_time", 5000)]
    assert [labels["trigger"] for labels in result["info"]] == ["real_time"]
    assert result["report"].exit_code == 0, result["report"].output
    (query,) = json.loads(result["report"].stdout)["queries"]
    assert query["trigger"] == "real_time" and query["trigger_interval_seconds"] == 5.0
    # the report explains the interval with the query's own figures
    costs = query["watermarks"]["real_time"]
    assert costs["interval_seconds"] == 5.0 and costs["delay_seconds"] == 10.0
    assert costs["watermark_age_max_seconds"] == 10.0
    assert costs["lateness_kept_max_seconds"] == 20.0
    assert costs["state_held_max_seconds"] == 15.0
    assert costs["state_interval_share"] == pytest.approx(1 / 3)
    assert "checkpoint interval 5.0s" in costs["text"]
    assert query[LATE_ROWS]["rows_kept_behind_watermark"] == 1
    assert result["html"].exit_code == 0, result["html"].output
    assert "real time, batches of 5.0s" in result["html"].stdout
    assert "Real-time mode, checkpoint interval 5.0s" in result["html"].stdout


def test_real_time_aggregation_is_audited_batch_by_batch(rt: RealTimeRun, tmp_path: Path) -> None:
    from pyspark.sql import functions as F

    def counts(events: Any) -> Any:
        return events.groupBy(F.window("ts", "10 seconds").alias("w")).agg(F.count("*"))

    check(run_audited(rt, counts, tmp_path), "window", "StatefulStreamlineAggregate")


def test_real_time_deduplication_is_audited_batch_by_batch(rt: RealTimeRun, tmp_path: Path) -> None:
    result = run_audited(rt, lambda events: events.dropDuplicates(["k", "ts"]), tmp_path)
    check(result, "dedupe", "dedupe")


@pytest.mark.kafka
def test_real_time_aggregation_over_kafka_is_audited_batch_by_batch(
    kafka_rt: RealTimeRun, tmp_path: Path
) -> None:
    """The same over Kafka: the real-time Kafka source logs each batch's offsets as a
    micro-batch does, and the audit replays them with Spark's Kafka batch reader."""
    from pyspark.sql import functions as F

    def counts(events: Any) -> Any:
        return events.groupBy(F.window("ts", "10 seconds").alias("w")).agg(F.count("*"))

    check(run_audited(kafka_rt, counts, tmp_path), "window", "StatefulStreamlineAggregate")
