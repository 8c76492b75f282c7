"""Who moved the watermark, against real Spark: a file stream and a Kafka stream (a real broker)
where one row dated 6 hours ahead arrives mid-stream, and ordinary rows after it are dropped.

The query deduplicates on ``(user, ts)`` (event time in the keys), so Spark's
``numRowsDroppedByWatermark`` counts input rows: the rows the report says the jump dropped must
be exactly Spark's drops in the batches after the one that read the row. Event times are near
the clock (a few minutes ago), as in a live stream; only the poisoned row is ahead of it.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

import wmwatch
from tests.harness.net import free_port
from tests.harness.streams import write_events
from wmwatch.cli import app

pytestmark = pytest.mark.spark

SCHEMA = "id int, user string, ts timestamp"
DELAY = "10 seconds"
POISON_ID = 99
runner = CliRunner()


def iso(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.000Z")


def steps(now: datetime) -> list[list[dict[str, Any]]]:
    """Four deliveries: ordinary rows a few minutes behind the clock, the second one carrying a
    row dated 6 hours ahead (id 99); every (user, ts) once."""
    base = now.replace(microsecond=0) - timedelta(minutes=5)

    def row(i: int, second: int) -> dict[str, Any]:
        return {"id": i, "user": f"u{i}", "ts": iso(base + timedelta(seconds=second))}

    poison = {"id": POISON_ID, "user": "clock", "ts": iso(now + timedelta(hours=6))}
    return [
        [row(1, 0), row(2, 5), row(3, 10), row(4, 20)],
        [row(5, 25), poison, row(6, 30)],
        [row(7, 35), row(8, 40), row(9, 45), row(10, 50)],
        [row(11, 55), row(12, 60)],
    ]


def spark_drops_after(progress: list[dict[str, Any]], batch_id: int) -> int:
    return sum(
        op.get("numRowsDroppedByWatermark", 0)
        for p in progress
        if p["batchId"] > batch_id
        for op in p["stateOperators"]
    )


def poison_batch(progress: list[dict[str, Any]], poison_iso: str) -> int:
    (batch,) = [p["batchId"] for p in progress if p["eventTime"].get("max") == poison_iso]
    return int(batch)


def report(db: Path, *args: str) -> str:
    # wide enough that the terminal table keeps each sentence on one line
    result = runner.invoke(app, ["report", "--db", str(db), *args], env={"COLUMNS": "500"})
    assert result.exit_code == 0, result.output
    return str(result.output)


def check_report(db: Path, name: str, batch_id: int, dropped: int, tmp: Path) -> dict[str, Any]:
    """The report in every format names the row, the batch and the cost; returns the JSON
    incident."""
    doc = json.loads(report(db, "--query", name, "--format", "json"))
    (incident,) = doc["queries"][0]["watermark_jumps"]["incidents"]
    assert incident["batch_id"] == batch_id
    assert incident["rows_dropped_since"] == dropped
    top = incident["rows"][0]
    assert json.loads(top["row_data"])["id"] == POISON_ID
    assert incident["summary"].startswith('the watermark was moved by {"id":99,')
    assert incident["summary"].endswith(f"it dropped {dropped:,} rows since")
    table = report(db, "--query", name)
    assert "who moved the watermark" in table and f"it dropped {dropped:,} rows since" in table
    assert f"batch {batch_id}" in table
    csv_text = report(db, "--query", name, "--format", "csv")
    assert f"it dropped {dropped:,} rows since" in csv_text
    html_path = tmp / "report.html"
    report(db, "--query", name, "--format", "html", "--output", str(html_path))
    page = html_path.read_text()
    assert 'data-table="watermark-jumps"' in page and f"it dropped {dropped:,} rows since" in page
    return dict(incident)


def test_file_stream_names_the_row_that_moved_the_watermark(spark: Any, stream_dir: Path) -> None:
    name = "jump_files"
    delivered = steps(datetime.now(UTC))
    events = spark.readStream.schema(SCHEMA).json(str(stream_dir / "in")).withWatermark("ts", DELAY)
    db = stream_dir / "history.duckdb"
    registry = CollectorRegistry()
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=registry)
    query = (
        events.dropDuplicates(["user", "ts"])
        .writeStream.format("memory")
        .queryName(name)
        .outputMode("append")
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        # user and id are hashed and kept out, as with late rows: the report shows the rest
        handle = watch.audit(query, events, columns=["id", "ts", "user"], hash_columns=["user"])
        for rows in delivered:
            write_events(stream_dir / "in", rows)
            query.processAllAvailable()
        assert handle.sync(120), handle.status()
        status = handle.status()
        ahead = registry.get_sample_value("wmwatch_event_time_ahead_seconds", {"query": name})
        progress = list(query.recentProgress)
        handle.stop()
    finally:
        query.stop()
        watch.close()
    batch_id = poison_batch(progress, delivered[1][1]["ts"])
    dropped = spark_drops_after(progress, batch_id)
    assert dropped >= 2, progress  # the jump made ordinary rows late
    assert status["watermark_incidents"] == 1 and status["errors"] == 0, status
    assert ahead is not None and 5.9 * 3600 < ahead < 6.1 * 3600
    incident = check_report(db, name, batch_id, dropped, stream_dir)
    assert incident["reasons"] == "ahead,jump"
    assert 5.9 * 3600 < incident["ahead_seconds"] < 6.1 * 3600
    assert incident["source_index"] == 0
    assert incident["source_description"].startswith("FileStreamSource[")
    top = incident["rows"][0]
    assert top["source_file"].endswith(".json") and top["kafka_partition"] is None
    # hash_columns applies as it does to late rows
    data = json.loads(top["row_data"])
    assert data["user"] != "clock" and len(data["user"]) == 64
    # every audited row that the jump made late is in the history, and only those
    with duckdb.connect(str(db), read_only=True) as con:
        late = con.execute(
            "SELECT count(*) FROM late_rows WHERE batch_id > ?", [batch_id]
        ).fetchone()
    assert late == (dropped,)


@pytest.mark.kafka
def test_kafka_stream_names_partition_and_offset(spark: Any, kafka: str, tmp_path: Path) -> None:
    from confluent_kafka import Producer

    from tests.harness.kafka import kafka_stream, new_topic, written

    name = "jump_kafka"
    topic = new_topic(kafka)
    delivered = steps(datetime.now(UTC))
    raw = kafka_stream(spark, kafka, topic, None)
    events = written(raw, SCHEMA).withWatermark("ts", DELAY)
    db = tmp_path / "history.duckdb"
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=CollectorRegistry())
    query = (
        events.dropDuplicates(["user", "ts"])
        .writeStream.format("memory")
        .queryName(name)
        .outputMode("append")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    placed: dict[int, tuple[int, int]] = {}

    def delivered_to(err: Any, msg: Any) -> None:
        assert err is None, err
        placed[json.loads(msg.value())["id"]] = (msg.partition(), msg.offset())

    producer = Producer({"bootstrap.servers": kafka, "linger.ms": 0, "acks": "all"})
    try:
        handle = watch.audit(query, events)
        for step, rows in enumerate(delivered):
            for i, row in enumerate(rows):
                partition = 1 if row["id"] == POISON_ID else (step + i) % 3
                producer.produce(
                    topic, json.dumps(row).encode(), partition=partition, callback=delivered_to
                )
            assert producer.flush(30) == 0
            query.processAllAvailable()
        assert handle.sync(180), handle.status()
        status = handle.status()
        progress = list(query.recentProgress)
        handle.stop()
    finally:
        query.stop()
        watch.close()
    batch_id = poison_batch(progress, delivered[1][1]["ts"])
    dropped = spark_drops_after(progress, batch_id)
    assert dropped >= 2, progress
    assert status["watermark_incidents"] == 1 and status["errors"] == 0, status
    incident = check_report(db, name, batch_id, dropped, tmp_path)
    top = incident["rows"][0]
    assert (top["kafka_topic"], top["kafka_partition"], top["kafka_offset"]) == (
        topic,
        *placed[POISON_ID],
    )
    assert incident["source_index"] == 0
    assert incident["source_description"].startswith("KafkaV2[Subscribe[")
    assert f"partition 1 offset {placed[POISON_ID][1]}" in incident["summary"]
    # the row went through events as written (its withColumn), as late rows do
    assert json.loads(top["row_data"])["id_twice"] == 2 * POISON_ID


@pytest.mark.prometheus
def test_the_alert_fires_in_a_real_prometheus(spark: Any, stream_dir: Path, tmp_path: Path) -> None:
    from dashboards import alerts, generate
    from tests.prom_servers import prometheus

    name = "jump_alert"
    rules_path = tmp_path / "wmwatch.test.rules.yml"
    rules_path.write_text(generate.rules_yaml(alerts.TEST))
    delivered = steps(datetime.now(UTC))
    port = free_port()
    watch = wmwatch.attach(
        spark, db=str(stream_dir / "history.duckdb"), metrics_port=port,
        registry=CollectorRegistry(),
    )  # fmt: skip
    events = spark.readStream.schema(SCHEMA).json(str(stream_dir / "in")).withWatermark("ts", DELAY)
    query = (
        events.dropDuplicates(["user", "ts"])
        .writeStream.format("memory")
        .queryName(name)
        .outputMode("append")
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        with prometheus(tmp_path, [f"127.0.0.1:{port}"], [rules_path]) as prom:
            write_events(stream_dir / "in", delivered[0])
            query.processAllAvailable()
            # ordinary rows only: scraped, and quiet
            deadline = time.monotonic() + 30
            while not prom.query(f'wmwatch_event_time_ahead_seconds{{query="{name}"}}'):
                assert time.monotonic() < deadline, "never scraped"
                time.sleep(0.5)
            assert not firing(prom, name)
            for rows in delivered[1:]:
                write_events(stream_dir / "in", rows)
                query.processAllAvailable()
            deadline = time.monotonic() + 60
            while not firing(prom, name):
                assert time.monotonic() < deadline, prom.alerts()
                time.sleep(0.5)
            (alert,) = firing(prom, name)
            assert alert["labels"]["severity"] == "critical"
            assert "ahead of the clock" in alert["annotations"]["summary"]
            assert "wmwatch report" in alert["annotations"]["runbook"]
    finally:
        query.stop()
        watch.close()


def firing(prom: Any, name: str) -> list[dict[str, Any]]:
    return [
        a
        for a in prom.alerts()
        if a["state"] == "firing"
        and a["labels"].get("alertname") == "WmwatchEventTimeAhead"
        and a["labels"].get("query") == name
    ]
