"""The Kafka scenario: topics on the run's shared broker (``tests/kafka_broker.py``), records
produced in order, and ``events`` as a Kafka query writes it."""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tests.harness.audited import audited_run
from tests.harness.streams import ts

PARTITIONS = 3


def new_topic(bootstrap: str, partitions: int = PARTITIONS) -> str:
    """A fresh topic (a unique name per test: the broker is shared by the run)."""
    return new_topic_named(bootstrap, f"t_{uuid.uuid4().hex[:10]}", partitions)


def new_topic_named(bootstrap: str, name: str, partitions: int = PARTITIONS) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(30)
    return name


def produce(bootstrap: str, topic: str, records: Iterable[tuple[int, dict[str, Any]]]) -> None:
    """Write ``(partition, value)`` records in order, each value as JSON; wait for every ack."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "acks": "all"})
    for partition, value in records:
        producer.produce(topic, json.dumps(value).encode(), partition=partition)
    assert producer.flush(30) == 0


def event_stream(seed: int, count: int = 60) -> list[tuple[int, int, str]]:
    """``(partition, second, user)`` in production order: time moves forward about 2 s a record
    across the 3 partitions, every fifth record is 30-90 s behind (in turn in each partition),
    a few repeat an earlier (user, second); one last record moves the watermark past
    everything."""
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


def records(seed: int, count: int = 72) -> list[tuple[int, dict[str, Any]]]:
    """``(partition, row)`` of :func:`event_stream`, with ids in production order."""
    return [
        (p, {"id": i, "user": u, "ts": ts(s)})
        for i, (p, s, u) in enumerate(event_stream(seed=seed, count=count))
    ]


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


def parse(schema: str, *extra: str) -> Any:
    """A transformation of Kafka records (JSON values) by hand, for ``prepare=``."""
    from pyspark.sql import functions as F

    def prepare(raw: Any) -> Any:
        parsed = F.from_json(F.col("value").cast("string"), schema).alias("j")
        return raw.select(parsed, *extra).select("j.*", *extra)

    return prepare


def run_kafka(
    spark: Any,
    folder: Path,
    query_frame: Any,
    events: list[Any],
    prepares: list[Any] | None = None,
    *,
    name: str,
    before_audit: Any = None,
) -> dict[str, Any]:
    """Run ``query_frame`` until it has read every record, audit it, and collect what the
    checks need (:func:`tests.harness.audited.audited_run`). ``before_audit(query)`` runs
    between the query and the audit's start."""
    return audited_run(
        spark,
        folder,
        query_frame,
        events,
        name=name,
        feed=lambda query: query.processAllAvailable(),
        before_audit=before_audit,
        sync_seconds=180,
        prepare=prepares,
    )
