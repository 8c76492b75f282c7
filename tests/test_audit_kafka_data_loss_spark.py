"""Records deleted from Kafka before the audit reached them, on a query that runs with
``failOnDataLoss=false``: the query goes on over the gap, the audit never makes up a row or a
count. Every batch that read a deleted range is counted lost with the reason (in the status and
in ``wmwatch_audit_batches_lost_total``, which ``WmwatchAuditBatchesLost`` alerts on), the others
are audited exactly. ``failOnDataLoss=true`` is covered in ``tests/test_audit_kafka_spark.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests.harness.checks import per_batch_dropped
from tests.harness.kafka import PARTITIONS, event_stream, kafka_stream, new_topic, parse, produce
from tests.harness.streams import SCHEMA, ts

pytestmark = [pytest.mark.spark, pytest.mark.kafka]

NAME = "kafka_loss_tolerated"
PER_TRIGGER = 9
DELETED_PARTITIONS = (0, 1)


def _start(spark: Any, bootstrap: str, topic: str, folder: Path) -> tuple[Any, Any]:
    stream = kafka_stream(spark, bootstrap, topic, PER_TRIGGER, failOnDataLoss="false")
    events = parse(SCHEMA)(stream).withWatermark("ts", "10 seconds")
    query = (
        events.dropDuplicates(["user", "ts"])
        .writeStream.format("parquet")
        .queryName(NAME)
        .option("path", str(folder / "out"))
        .option("checkpointLocation", str(folder / "checkpoint"))
        .start()
    )
    return query, events


def _delete_below(bootstrap: str, topic: str, offset: int) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    wanted = [TopicPartition(topic, p, offset) for p in DELETED_PARTITIONS]
    for future in admin.delete_records(wanted).values():
        future.result(30)


def _reads_below(reader: Any, batch_id: int, topic: str, offset: int) -> bool:
    """Whether the batch's logged range starts below ``offset`` on a partition records were
    deleted from (and reads something there)."""
    end = json.loads(reader.offsets(batch_id).source_offsets[0])[topic]
    if batch_id > 0:
        start = json.loads(reader.offsets(batch_id - 1).source_offsets[0])[topic]
    else:
        start = {str(p): 0 for p in range(PARTITIONS)}
    return any(
        start.get(str(p), 0) < offset and end[str(p)] > start.get(str(p), 0)
        for p in DELETED_PARTITIONS
    )


def test_kafka_records_deleted_with_fail_on_data_loss_false_are_counted_lost(
    spark: Any, kafka: str, tmp_path: Path
) -> None:
    from prometheus_client import CollectorRegistry

    import wmwatch
    from wmwatch._checkpoint.reader import CheckpointReader

    topic = new_topic(kafka)
    records = [
        (p, {"id": i, "user": u, "ts": ts(s)})
        for i, (p, s, u) in enumerate(event_stream(seed=81, count=90))
    ]
    # 12 records a partition read by a first run of the query; then 6 more a partition that
    # nobody reads before records are deleted below offset 15 on two partitions: some the query
    # read, some it will skip (failOnDataLoss=false); the rest and the flush after that
    first, unread, rest = records[:36], records[36:54], records[54:]
    deleted_below = 15
    produce(kafka, topic, first)
    query, _ = _start(spark, kafka, topic, tmp_path)
    try:
        query.processAllAvailable()
        progress = list(query.recentProgress)
        first_run_last = max(p["batchId"] for p in progress)
    finally:
        query.stop()
    produce(kafka, topic, unread)
    _delete_below(kafka, topic, deleted_below)
    produce(kafka, topic, rest)

    registry = CollectorRegistry()
    db = tmp_path / "history.duckdb"
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=registry)
    query, events = _start(spark, kafka, topic, tmp_path)  # the same checkpoint
    try:
        handle = watch.audit(query, events, prepare=parse(SCHEMA))
        query.processAllAvailable()
        assert query.exception() is None  # the query itself goes on over the gap
        assert handle.sync(180), handle.status()
        status = handle.status()
        progress += list(query.recentProgress)
        lost_metric = registry.get_sample_value("wmwatch_audit_batches_lost_total", {"query": NAME})
        handle.stop()
    finally:
        query.stop()
        watch.close()

    with duckdb.connect(str(db), read_only=True) as con:
        late = con.execute("SELECT batch_id, row_data::VARCHAR FROM late_rows").fetchall()
        marked = dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())
    reader = CheckpointReader(str(tmp_path / "checkpoint"))
    committed = reader.committed_batches()
    # the batches that read a deleted range and had a watermark to judge by
    touched = {
        b
        for b in committed
        if _reads_below(reader, b, topic, deleted_below) and reader.late_watermark_ms(b) is not None
    }
    lost = set(committed) - set(marked)
    dropped = per_batch_dropped(progress)
    assert lost <= touched, "a batch counted lost without a reason"
    # the first run's batches (read, then their records deleted) have no progress the audit saw:
    # lost; the second run's first batch skipped records deleted before it read them: lost too
    assert {b for b in touched if b <= first_run_last} <= lost
    assert any(b > first_run_last for b in lost), sorted(lost)
    # a touched batch is audited only when the query's own progress shows it could drop no row
    # (the rows it read were all ahead of the watermark): its zero is Spark's, not made up
    for b in touched - lost:
        assert marked[b] == 0 == dropped.get(b, -1), b
    assert status["batches_lost"] == len(lost) == lost_metric
    reason = status["last_lost_reason"]
    assert "deleted" in reason and topic in reason, reason
    assert status["errors"] == 0
    # no false row or count: every audited batch has as many late rows as Spark dropped
    per_batch = {b: 0 for b in marked}
    for batch_id, _ in late:
        per_batch[batch_id] += 1
    for b in marked:
        assert per_batch[b] == marked[b] == dropped.get(b, 0), b
    assert any(marked.values()), "no audited batch had late rows"
    assert not {b for b, _ in late} & lost
