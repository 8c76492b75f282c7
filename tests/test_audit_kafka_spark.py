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

from tests import kafka_broker
from tests.kafka_broker import produce

pytestmark = [pytest.mark.spark, pytest.mark.kafka]

PARTITIONS = 3


def new_topic(bootstrap: str, partitions: int = PARTITIONS) -> str:
    return kafka_broker.new_topic(bootstrap, partitions)


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


SCHEMA = "id int, user string, ts timestamp"
LEFT_SCHEMA = "lid int, lk string, lt timestamp"
RIGHT_SCHEMA = "rid int, rk string, rt timestamp"
# (name, records per trigger): small batches make other rows late than large ones. A batch's
# rows are judged by the watermark logged before it, which the batch before that set, so
# "large" still needs several batches to have late rows at all.
BATCHINGS = [("small", 9), ("large", 15)]


def ts(second: int) -> str:
    minute, sec = divmod(second, 60)
    hour, minute = divmod(minute, 60)
    return f"2026-01-01T{hour:02d}:{minute:02d}:{sec:02d}Z"


def event_stream(seed: int, count: int = 60) -> list[tuple[int, int, str]]:
    """``(partition, second, user)`` in production order: time moves forward about 2 s a record
    across the 3 partitions, every fifth record is 30-90 s behind (in turn in each partition),
    a few repeat an earlier (user, second); one last record moves the watermark past
    everything."""
    import random

    rng = random.Random(seed)
    out: list[tuple[int, int, str]] = []
    for i in range(count):
        partition = i % PARTITIONS
        if out and rng.random() < 0.1:
            _, second, user = rng.choice(out)
        elif i % 5 == 4:  # every partition gets its share of late records
            second, user = max(0, 2 * i - rng.randint(30, 90)), rng.choice("abcd")
        else:
            second, user = 2 * i, rng.choice("abcd")
        out.append((partition, second, user))
    out.append((0, 10_000, "flush"))
    return out


def written(raw: Any, schema: str, *extra: str) -> Any:
    """``events`` as a Kafka query writes it: the value as text, parsed, the fields selected,
    records that are not events (no id) filtered out and a column added; the caller adds
    ``withWatermark``."""
    from pyspark.sql import functions as F

    key = schema.split()[0]  # id, lid or rid
    return (
        raw.selectExpr("CAST(value AS STRING) AS json", *extra)
        .select(F.from_json("json", schema).alias("j"), *extra)
        .select("j.*", *extra)
        .where(F.col(key).isNotNull())
        .withColumn(f"{key}_twice", F.col(key) * 2)
    )


def assert_replayed_as_written(late: list[Any], key: str = "id") -> None:
    """The late rows went through ``events``' own ``withColumn``."""
    rows = [json.loads(r[8]) for r in late]
    assert rows and all(r[f"{key}_twice"] == 2 * r[key] for r in rows), rows[:3]


def parse(schema: str, *extra: str) -> Any:
    """A transformation of Kafka records (JSON values) by hand, for ``prepare=``."""
    from pyspark.sql import functions as F

    def prepare(raw: Any) -> Any:
        parsed = F.from_json(F.col("value").cast("string"), schema).alias("j")
        return raw.select(parsed, *extra).select("j.*", *extra)

    return prepare


def kafka_stream(
    spark: Any, bootstrap: str, topic: str, per_trigger: int | None, **options: str
) -> Any:
    reader = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("subscribe", topic)
        .option("startingOffsets", "earliest")
        .options(**options)
    )
    if per_trigger is not None:
        reader = reader.option("maxOffsetsPerTrigger", per_trigger)
    return reader.load()


def run_kafka(
    spark: Any,
    folder: Any,
    query_frame: Any,
    events: list[Any],
    prepares: list[Any] | None = None,
    *,
    name: str,
    before_audit: Any = None,
) -> dict[str, Any]:
    """Run ``query_frame`` until it has read every record, audit it, and collect what the
    checks need. ``before_audit(query)`` runs between the query and the audit's start."""
    import duckdb
    from prometheus_client import CollectorRegistry

    import wmwatch
    from tests.test_audit_join_spark import late_rows_of
    from wmwatch._checkpoint.reader import CheckpointReader

    db = folder / "history.duckdb"
    registry = CollectorRegistry()
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=registry)
    query = (
        query_frame.writeStream.format("memory")
        .queryName(name)
        .outputMode("append")
        .option("checkpointLocation", str(folder / "checkpoint"))
        .start()
    )
    try:
        if before_audit is None:
            # from the start, as in production: progress lets it skip batches with no late row
            handle = watch.audit(query, events, prepare=prepares)
            query.processAllAvailable()
        else:
            query.processAllAvailable()
            before_audit(query)
            handle = watch.audit(query, events, prepare=prepares)
        assert handle.sync(180), handle.status()
        status = handle.status()
        progress = list(query.recentProgress)
        output = [r.asDict(recursive=True) for r in spark.table(name).collect()]
        metrics = {
            side: registry.get_sample_value(
                "wmwatch_late_rows_audited_by_operator_total",
                {"query": name, "operator": "0", "kind": "join", "side": side},
            )
            for side in ("left", "right")
        }
        handle.stop()
    finally:
        query.stop()
        watch.close()
    with duckdb.connect(str(db), read_only=True) as con:
        late = con.execute(
            "SELECT batch_id, epoch_ms(event_time_at), epoch_ms(watermark_at), lateness_seconds, "
            "epoch_ms(window_start_at), epoch_ms(window_end_at), operator_kind, source_file, "
            "row_data::VARCHAR FROM late_rows"
        ).fetchall()
        marks = con.execute(
            "SELECT batch_id, late_rows, sink, location FROM audit_batches"
        ).fetchall()
        by_input = con.execute(
            "SELECT late_rows_by_input::VARCHAR FROM audit_batches "
            "WHERE late_rows_by_input IS NOT NULL"
        ).fetchall()
    return {
        "status": status,
        "progress": progress,
        "output": output,
        "late": late,
        "late_join": late_rows_of(db),
        "marks": marks,
        "by_input": [json.loads(r[0]) for r in by_input],
        "metrics": metrics,
        "checkpoint": CheckpointReader(str(folder / "checkpoint")),
    }


def produce_events(bootstrap: str, topic: str, stream: list[tuple[int, int, str]]) -> list[Any]:
    """The stream's events, after a record per partition that is not JSON (which ``events``
    filters out); returns the events."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "acks": "all"})
    for partition in range(PARTITIONS):
        producer.produce(topic, b"not json", partition=partition)
    assert producer.flush(30) == 0
    rows = [{"id": i, "user": u, "ts": ts(s)} for i, (_, s, u) in enumerate(stream)]
    produce(bootstrap, topic, [(p, row) for (p, _, _), row in zip(stream, rows, strict=True)])
    return rows


@pytest.mark.parametrize(("batching", "per_trigger"), BATCHINGS)
def test_kafka_windowed_count_is_exact(
    spark: Any, kafka: str, tmp_path: Any, batching: str, per_trigger: int
) -> None:
    from collections import Counter

    from pyspark.sql import functions as F

    from tests.test_audit_spark import assert_windows_balance, final_watermark_ms

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
    expected = Counter(
        (s // 10 * 10_000, s // 10 * 10_000 + 10_000) for s in (int(sec_of(r["ts"])) for r in rows)
    )
    wm_ms = final_watermark_ms(result["progress"])
    assert_windows_balance(dict(expected), result["output"], result["late"], wm_ms)
    # Spark counts late groups per batch (after merging partial aggregates), not rows
    assert len({(r[0], r[4]) for r in result["late"]}) == dropped_by_watermark(result["progress"])
    assert result["status"]["late_rows"] == len(result["late"])
    assert result["status"]["errors"] == 0 and result["status"]["batches_lost"] == 0
    late_partitions = {json.loads(r[8])["id"] % PARTITIONS for r in result["late"]}
    assert len(late_partitions) >= 2, "late rows in several partitions"
    assert_replayed_as_written(result["late"])


def sec_of(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def dropped_by_watermark(progress: list[dict[str, Any]]) -> int:
    return sum(
        op.get("numRowsDroppedByWatermark", 0) for p in progress for op in p["stateOperators"]
    )


@pytest.mark.parametrize(("batching", "per_trigger"), BATCHINGS)
def test_kafka_drop_duplicates_is_exact(
    spark: Any, kafka: str, tmp_path: Any, batching: str, per_trigger: int
) -> None:
    from tests.test_audit_spark import check_dedupe

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

    from tests.test_audit_join_spark import check_join

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


def per_batch_dropped(progress: list[dict[str, Any]]) -> dict[int, int]:
    return {
        p["batchId"]: sum(op.get("numRowsDroppedByWatermark", 0) for op in p["stateOperators"])
        for p in progress
    }


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


def new_topic_named(bootstrap: str, name: str) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, PARTITIONS, 1)])[name].result(30)
    return name
