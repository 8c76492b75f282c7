"""The late-row audit of queries that read Kafka, against a real broker (``tests/kafka_broker.py``)
and Spark's own Kafka connector.

Each scenario produces out-of-order JSON events into topics of 3 partitions (late rows in several
partitions), runs the production query twice with different batching (``maxOffsetsPerTrigger``),
and checks what the audit recorded against what Spark dropped and emitted.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from typing import Any

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.kafka]

PARTITIONS = 3


def new_topic(bootstrap: str, partitions: int = PARTITIONS) -> str:
    """A fresh topic (a unique name per test: the broker is shared by the run)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"t_{uuid.uuid4().hex[:10]}"
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
