"""The late-row audit of queries that read Kafka, against a real broker (``tests/kafka_broker.py``)
and Spark's own Kafka connector.

Each scenario produces out-of-order JSON events into topics of 3 partitions (late rows in several
partitions, and a record per partition that is not JSON), runs the production query twice with
different batching (``maxOffsetsPerTrigger``), and checks what the audit recorded against what
Spark dropped and emitted. ``events`` is written as a Kafka query writes it (``CAST(value AS
STRING)``, ``from_json``, ``select("j.*")``, a filter, ``withColumn``, ``withWatermark``) and
audited as written, without ``prepare=``; one test shows that ``prepare=`` still overrides it.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import pytest

from tests.harness.checks import (
    assert_windows_balance,
    check_dedupe,
    check_join,
    dropped_by_watermark,
    final_watermark_ms,
    per_batch_dropped,
    tumbling_counts,
)
from tests.harness.joins import LEFT_SCHEMA, RIGHT_SCHEMA
from tests.harness.kafka import (
    PARTITIONS,
    event_stream,
    kafka_stream,
    new_topic,
    new_topic_named,
    parse,
    produce,
    produce_events,
    run_kafka,
    written,
)
from tests.harness.streams import SCHEMA, ts

pytestmark = [pytest.mark.spark, pytest.mark.kafka]


def test_spark_reads_the_broker(spark: Any, kafka: str) -> None:
    topic = new_topic(kafka)
    produce(kafka, topic, [(p, {"id": p}) for p in range(PARTITIONS) for _ in range(2)])
    rows = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", kafka)
        .option("subscribe", topic)
        .load()
        .groupBy("partition")
        .count()
        .collect()
    )
    assert {r["partition"]: r["count"] for r in rows} == {0: 2, 1: 2, 2: 2}


# (name, records per trigger): small batches make other rows late than large ones. A batch's
# rows are judged by the watermark logged before it, which the batch before that set, so
# "large" still needs several batches to have late rows at all.
BATCHINGS = [("small", 9), ("large", 15)]


def assert_replayed_as_written(late: list[Any], key: str = "id") -> None:
    """The late rows went through ``events``' own ``withColumn``."""
    rows = [json.loads(r[8]) for r in late]
    assert rows and all(r[f"{key}_twice"] == 2 * r[key] for r in rows), rows[:3]


@pytest.mark.parametrize(("batching", "per_trigger"), BATCHINGS)
def test_kafka_windowed_count_is_exact(
    spark: Any, kafka: str, tmp_path: Any, batching: str, per_trigger: int
) -> None:
    from pyspark.sql import functions as F

    topic = new_topic(kafka)
    rows = produce_events(kafka, topic, event_stream(seed=3))
    events = written(kafka_stream(spark, kafka, topic, per_trigger), SCHEMA).withWatermark(
        "ts", "10 seconds"
    )
    result = run_kafka(
        spark,
        tmp_path,
        events.groupBy(F.window("ts", "10 seconds")).count(),
        [events],
        name=f"kafka_window_{batching}",
    )
    expected = tumbling_counts([r["ts"] for r in rows])
    wm_ms = final_watermark_ms(result["progress"])
    assert_windows_balance(expected, result["output"], result["late"], wm_ms)
    # Spark counts late groups per batch (after merging partial aggregates), not rows
    assert len({(r[0], r[4]) for r in result["late"]}) == dropped_by_watermark(result["progress"])
    assert result["status"]["late_rows"] == len(result["late"])
    assert result["status"]["errors"] == 0 and result["status"]["batches_lost"] == 0
    late_partitions = {json.loads(r[8])["id"] % PARTITIONS for r in result["late"]}
    assert len(late_partitions) >= 2, "late rows in several partitions"
    assert_replayed_as_written(result["late"])


@pytest.mark.parametrize(("batching", "per_trigger"), BATCHINGS)
def test_kafka_drop_duplicates_is_exact(
    spark: Any, kafka: str, tmp_path: Any, batching: str, per_trigger: int
) -> None:

    topic = new_topic(kafka)
    rows = produce_events(kafka, topic, event_stream(seed=5))
    events = written(kafka_stream(spark, kafka, topic, per_trigger), SCHEMA).withWatermark(
        "ts", "10 seconds"
    )
    result = run_kafka(
        spark,
        tmp_path,
        events.dropDuplicates(["user", "ts"]),
        [events],
        name=f"kafka_dedupe_{batching}",
    )
    # row ts values are datetimes in the output, ISO text in the input: compare as text
    for row in result["output"]:
        row["ts"] = row["ts"].strftime("%Y-%m-%dT%H:%M:%SZ")
    result["files"] = [rows]
    check_dedupe(result, lambda r: (r["user"], r["ts"]), "dedupe")
    assert result["status"]["batches_lost"] == 0
    assert_replayed_as_written(result["late"])


@pytest.mark.parametrize(("batching", "per_trigger"), BATCHINGS)
def test_kafka_stream_stream_join_is_exact(
    spark: Any, kafka: str, tmp_path: Any, batching: str, per_trigger: int
) -> None:
    from pyspark.sql import functions as F

    left_topic, right_topic = new_topic(kafka), new_topic(kafka)
    left_stream, right_stream = event_stream(seed=11), event_stream(seed=12)
    produce(
        kafka,
        left_topic,
        [(p, {"lid": i, "lk": u, "lt": ts(s)}) for i, (p, s, u) in enumerate(left_stream)],
    )
    produce(
        kafka,
        right_topic,
        [
            (p, {"rid": 1000 + i, "rk": u, "rt": ts(s + 1)})
            for i, (p, s, u) in enumerate(right_stream)
        ],
    )
    left = written(kafka_stream(spark, kafka, left_topic, per_trigger), LEFT_SCHEMA)
    left = left.withWatermark("lt", "10 seconds")
    right = written(kafka_stream(spark, kafka, right_topic, per_trigger), RIGHT_SCHEMA)
    right = right.withWatermark("rt", "10 seconds")
    condition = F.expr("lk = rk AND lt BETWEEN rt - INTERVAL 5 SECONDS AND rt + INTERVAL 5 SECONDS")
    result = run_kafka(
        spark,
        tmp_path,
        left.join(right, condition, "inner"),
        [right, left],  # any order
        name=f"kafka_join_{batching}",
    )
    result["late"] = result["late_join"]
    check_join(result, sides=("left", "right"))
    assert result["status"]["batches_lost"] == 0
    for row in (json.loads(r[8]) for r in result["late"]):
        key = "lid" if "lid" in row else "rid"
        assert row[f"{key}_twice"] == 2 * row[key], row


def test_kafka_partition_added_mid_stream(spark: Any, kafka: str, tmp_path: Any) -> None:
    """Rows of a partition added while the query runs are read from its start, late ones
    audited like the others. ``prepare=`` given here overrides events as written: the late rows
    are the ones it builds (without the column ``events`` adds)."""
    from confluent_kafka.admin import AdminClient, NewPartitions

    topic = new_topic(kafka)
    first = event_stream(seed=21, count=30)[:-1]  # no flush yet
    rows = produce_events(kafka, topic, first)
    events = written(kafka_stream(spark, kafka, topic, None), SCHEMA, "partition")
    events = events.withWatermark("ts", "10 seconds")
    added: list[dict[str, Any]] = []

    def add_partition(query: Any) -> None:
        admin = AdminClient({"bootstrap.servers": kafka})
        admin.create_partitions([NewPartitions(topic, PARTITIONS + 1)])[topic].result(30)
        # late rows in the new partition and an old one, then the flush
        later = [
            (3, {"id": 500, "user": "n", "ts": ts(5)}),
            (3, {"id": 501, "user": "n", "ts": ts(80)}),
            (1, {"id": 502, "user": "o", "ts": ts(6)}),
            (3, {"id": 503, "user": "m", "ts": ts(7)}),
        ]
        produce(kafka, topic, later)
        query.processAllAvailable()
        produce(kafka, topic, [(0, {"id": 504, "user": "flush", "ts": ts(10_000)})])
        query.processAllAvailable()
        added.extend(r for _, r in later)

    result = run_kafka(
        spark,
        tmp_path,
        events.dropDuplicates(["id", "ts"]),
        [events],
        [parse(SCHEMA, "partition")],
        name="kafka_new_partition",
        before_audit=add_partition,
    )
    assert rows and added
    late = [json.loads(r[8]) for r in result["late"]]
    assert len(late) == dropped_by_watermark(result["progress"])
    assert {r["id"] for r in late} >= {500, 502, 503}
    assert {r["partition"] for r in late} >= {1, 3}
    assert result["status"]["batches_lost"] == 0 and result["status"]["errors"] == 0
    assert "id_twice" in events.columns and not any("id_twice" in r for r in late)


def test_kafka_records_deleted_before_the_audit_are_counted_lost(
    spark: Any, kafka: str, tmp_path: Any
) -> None:
    """Batches whose records were deleted before the audit read them are counted lost with the
    reason; every other batch is audited exactly, and no row is made up."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    topic = new_topic(kafka)
    produce_events(kafka, topic, event_stream(seed=31))
    events = written(kafka_stream(spark, kafka, topic, 12), SCHEMA).withWatermark(
        "ts", "10 seconds"
    )
    deleted_below = 12  # on partitions 0 and 1: the first batches' records

    def delete(query: Any) -> None:
        admin = AdminClient({"bootstrap.servers": kafka})
        wanted = [TopicPartition(topic, p, deleted_below) for p in (0, 1)]
        for future in admin.delete_records(wanted).values():
            future.result(30)

    result = run_kafka(
        spark,
        tmp_path,
        events.dropDuplicates(["user", "ts"]),
        [events],
        name="kafka_deleted",
        before_audit=delete,
    )
    reader = result["checkpoint"]
    committed = reader.committed_batches()
    marked = {b: n for b, n, _, _ in result["marks"]}
    lost = set(committed) - set(marked)
    # the batches that read a deleted record, and had a watermark to judge by
    expected_lost = set()
    for b in committed:
        before = json.loads(reader.offsets(b - 1).source_offsets[0]) if b > 0 else None
        end = json.loads(reader.offsets(b).source_offsets[0])[topic]
        start = before[topic] if before else {str(p): 0 for p in range(PARTITIONS)}
        reads_deleted = any(
            start.get(str(p), 0) < deleted_below and end[str(p)] > start.get(str(p), 0)
            for p in (0, 1)
        )
        if reads_deleted and reader.late_watermark_ms(b) is not None:
            expected_lost.add(b)
    assert expected_lost, "the scenario deleted no record a batch read"
    assert lost == expected_lost
    status = result["status"]
    assert status["batches_lost"] == len(expected_lost)
    assert "deleted" in status["last_lost_reason"] and topic in status["last_lost_reason"]
    dropped = per_batch_dropped(result["progress"])
    per_batch = {b: 0 for b in marked}
    for r in result["late"]:
        per_batch[r[0]] += 1
    for b in marked:
        assert per_batch[b] == marked[b] == dropped.get(b, 0), b
    assert any(marked.values()), "no batch after the deleted ones had late rows"


def test_kafka_broker_down_the_audit_retries_then_audits_exactly(spark: Any, tmp_path: Any) -> None:
    """With the broker down the audit fails, says why and retries, the query keeps running;
    once the broker is back every batch is audited exactly."""
    import duckdb
    from prometheus_client import CollectorRegistry

    import wmwatch
    from tests.kafka_broker import format_broker, running

    broker = format_broker(tmp_path / "own-broker")  # this test stops it: not the shared one
    db = tmp_path / "history.duckdb"
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=CollectorRegistry())
    query = None
    try:
        with running(broker) as bootstrap:
            topic = new_topic(bootstrap)
            produce_events(bootstrap, topic, event_stream(seed=41))
            # the query's own client gives up on the broker sooner than its 60 s default, so
            # that stopping it while it waits for the broker does not wait that long
            timeouts = {"kafka.default.api.timeout.ms": "10000", "kafka.request.timeout.ms": "5000"}
            stream = kafka_stream(spark, bootstrap, topic, 9, **timeouts)
            events = written(stream, SCHEMA).withWatermark("ts", "10 seconds")
            query = (
                events.dropDuplicates(["user", "ts"])
                .writeStream.format("memory")
                .queryName("kafka_broker_down")
                .option("checkpointLocation", str(tmp_path / "checkpoint"))
                .start()
            )
            query.processAllAvailable()
        # the broker is down
        handle = watch.audit(query, events)
        deadline = time.monotonic() + 90
        while handle.status()["errors"] == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        status = handle.status()
        assert status["errors"] >= 1 and "Kafka broker" in status["last_error"], status
        assert status["batches_lost"] == 0 and status["late_rows"] == 0
        assert query.isActive and query.exception() is None
        with running(broker):
            assert handle.sync(180), handle.status()
            status = handle.status()
            progress = list(query.recentProgress)
        handle.stop()
    finally:
        if query is not None:
            query.stop()
        watch.close()
    with duckdb.connect(str(db), read_only=True) as con:
        late = con.execute("SELECT count(*) FROM late_rows").fetchone()
    assert late is not None and late[0] == dropped_by_watermark(progress) > 0
    assert status["batches_lost"] == 0


def test_kafka_topic_matched_by_pattern_mid_stream(spark: Any, kafka: str, tmp_path: Any) -> None:
    """A topic created while the query runs and matched by its ``subscribePattern`` is read from
    its start; its late rows are audited like the others (with ``includeHeaders`` on)."""
    prefix = f"p_{uuid.uuid4().hex[:8]}"
    first = new_topic_named(kafka, f"{prefix}_a")
    produce_events(kafka, first, event_stream(seed=51, count=30)[:-1])
    stream = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", kafka)
        .option("subscribePattern", f"{prefix}_.*")
        .option("startingOffsets", "earliest")
        .option("includeHeaders", "true")
        .load()
    )
    events = written(stream, SCHEMA, "topic").withWatermark("ts", "10 seconds")

    def add_topic(query: Any) -> None:
        second = new_topic_named(kafka, f"{prefix}_b")
        later = [
            (0, {"id": 600, "user": "n", "ts": ts(4)}),
            (2, {"id": 601, "user": "n", "ts": ts(90)}),
            (1, {"id": 602, "user": "m", "ts": ts(8)}),
        ]
        produce(kafka, second, later)
        # the source looks for new topics when it plans a batch; wait until it has read them
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            query.processAllAvailable()
            ends = [s.get("endOffset") or "" for p in query.recentProgress for s in p["sources"]]
            if any(second in end for end in ends):
                break
            time.sleep(0.5)
        produce(kafka, first, [(0, {"id": 603, "user": "flush", "ts": ts(10_000)})])
        query.processAllAvailable()

    result = run_kafka(
        spark,
        tmp_path,
        events.dropDuplicates(["id", "ts"]),
        [events],
        name="kafka_pattern",
        before_audit=add_topic,
    )
    late = [json.loads(r[8]) for r in result["late"]]
    assert len(late) == dropped_by_watermark(result["progress"])
    assert {r["id"] for r in late} >= {600, 602}
    assert {r["topic"] for r in late} >= {f"{prefix}_b"}
    assert result["status"]["batches_lost"] == 0 and result["status"]["errors"] == 0
