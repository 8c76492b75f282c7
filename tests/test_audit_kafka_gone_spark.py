"""Kafka records that are not there as a batch read them: a topic deleted and created again under
the same name, records deleted while the audit read them, a compacted topic. Against the real
broker and Spark's own connector, the audit counts each such batch lost with the reason and
stores no row of other records; the batches it can read are audited exactly.

An audit "lagging behind" is made with a ``prepare=`` that holds the audit's second replay (after
Spark's reader was planned over the batch, before its job runs) until the test has changed the
topic: the window in which a real audit that falls behind meets the change.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import duckdb
import pytest

import wmwatch
from tests.harness.audited import sidecar_status
from tests.harness.checks import offsets_moved, per_batch_dropped
from tests.harness.kafka import PARTITIONS, event_stream, kafka_stream, new_topic, parse, produce
from tests.harness.streams import SCHEMA, epoch_seconds, ts
from wmwatch._checkpoint.reader import CheckpointReader

pytestmark = [pytest.mark.spark, pytest.mark.kafka]

PER_TRIGGER = 9


class HeldReplay:
    """A ``prepare=`` that parses records as ``parse(SCHEMA)`` does, lets the audit's first
    replay through and holds the second until :meth:`release`: the audit lags behind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls = 0
        self.entered = threading.Event()
        self._released = threading.Event()

    def __call__(self, raw: Any) -> Any:
        with self._lock:
            self._calls += 1
            hold = self._calls == 2
        if hold:
            self.entered.set()
            assert self._released.wait(180), "the test never released the audit"
        return parse(SCHEMA)(raw)

    def release(self) -> None:
        self._released.set()


def _records(seed: int) -> list[tuple[int, dict[str, Any]]]:
    return [
        (p, {"id": i, "user": u, "ts": ts(s)})
        for i, (p, s, u) in enumerate(event_stream(seed=seed, count=60))
    ]


def _ghosts(per_partition: int) -> list[tuple[int, dict[str, Any]]]:
    """Other rows, dated at the very start: any batch that replayed them would call them late."""
    return [
        (p, {"id": 9000 + p * per_partition + i, "user": "ghost", "ts": ts(i % 3)})
        for p in range(PARTITIONS)
        for i in range(per_partition)
    ]


def _recreate(bootstrap: str, topic: str) -> None:
    """Delete ``topic`` and create it again under the same name (a new topic id)."""
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([topic])[topic].result(30)
    deadline = time.monotonic() + 60
    while True:
        try:
            admin.create_topics([NewTopic(topic, PARTITIONS, 1)])[topic].result(30)
            return
        except Exception:  # noqa: BLE001 - the deletion is still under way: try again
            assert time.monotonic() < deadline, f"{topic} could not be created again"
            time.sleep(0.5)


def _delete_below(bootstrap: str, topic: str, offsets: dict[int, int]) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    wanted = [TopicPartition(topic, p, o) for p, o in offsets.items() if o > 0]
    for future in admin.delete_records(wanted).values():
        future.result(30)


def _history(db: Path) -> tuple[list[tuple[int, dict[str, Any]]], dict[int, int]]:
    with duckdb.connect(str(db), read_only=True) as con:
        late = [
            (int(b), json.loads(r))
            for b, r in con.execute("SELECT batch_id, row_data::VARCHAR FROM late_rows").fetchall()
        ]
        marked = dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())
    return late, marked


def _audit_held(
    spark: Any,
    bootstrap: str,
    folder: Path,
    change: Any,
    *,
    name: str,
    fail_on_data_loss: str,
) -> dict[str, Any]:
    """A dropDuplicates over a fresh topic, audited from the start with its second replay held;
    the query runs to the end and stops, ``change(topic, held_batch)`` changes the topic, then
    the audit goes on. What the checks need, returned."""
    topic = new_topic(bootstrap)
    produce(bootstrap, topic, _records(seed=91))
    raw = kafka_stream(spark, bootstrap, topic, PER_TRIGGER, failOnDataLoss=fail_on_data_loss)
    events = parse(SCHEMA)(raw).withWatermark("ts", "10 seconds")
    db = folder / "history.duckdb"
    held = HeldReplay()
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None)
    query = (
        events.dropDuplicates(["user", "ts"])
        .writeStream.format("noop")
        .queryName(name)
        .option("checkpointLocation", str(folder / "checkpoint"))
        .start()
    )
    try:
        handle = watch.audit(query, events, prepare=held)
        query.processAllAvailable()
        assert held.entered.wait(120), handle.status()
        progress = list(query.recentProgress)
        query.stop()  # every committed batch read the topic as it was
        held_batch = int(handle.status()["last_audited_batch"]) + 1
        change(topic, held_batch)
        held.release()
        assert handle.sync(180), handle.status()
        status = handle.status()
        handle.stop()
    finally:
        held.release()
        query.stop()
        watch.close()
    late, marked = _history(db)
    reader = CheckpointReader(str(folder / "checkpoint"))
    committed = reader.committed_batches()
    return {
        "topic": topic,
        "held": held_batch,
        "status": status,
        "late": late,
        "marked": marked,
        "lost": set(committed) - set(marked),
        "committed": committed,
        "dropped": per_batch_dropped(progress),
        "reader": reader,
    }


def _audited_exactly(result: dict[str, Any], batches: set[int]) -> None:
    """Each of ``batches`` is marked with as many late rows as Spark dropped, all stored."""
    per_batch = {b: 0 for b in batches}
    for batch_id, _ in result["late"]:
        if batch_id in per_batch:
            per_batch[batch_id] += 1
    for b in batches:
        assert per_batch[b] == result["marked"][b] == result["dropped"].get(b, 0), b


def test_in_job_audit_behind_a_topic_deleted_and_created_again_counts_its_batches_lost(
    spark: Any, kafka: str, tmp_path: Path
) -> None:
    """The topic is deleted and created again, with other rows at the same offsets, while the
    audit is behind: the batch it was reading and every later one are lost with the reason (the
    topic's id is not the one the audit saw), and no row of the new topic is stored."""

    def recreate(topic: str, held: int) -> None:
        _recreate(kafka, topic)
        produce(kafka, topic, _ghosts(per_partition=40))  # past every old batch's end

    result = _audit_held(
        spark, kafka, tmp_path, recreate, name="kafka_recreated", fail_on_data_loss="false"
    )
    held, status = result["held"], result["status"]
    after = {b for b in result["committed"] if b >= held and offsets_moved(result["reader"], b)}
    assert after, "no batch read data after the held one"
    assert result["lost"] == after
    assert status["batches_lost"] == len(after) and status["errors"] == 0, status
    reason = status["last_lost_reason"]
    assert result["topic"] in reason and "deleted and created again" in reason, reason
    assert not any(row["user"] == "ghost" for _, row in result["late"])
    before = {b for b in result["marked"] if b < held}
    _audited_exactly(result, before)
    assert any(result["marked"][b] for b in before), "no audited batch had late rows"


@pytest.mark.parametrize("fail_on_data_loss", ["true", "false"])
def test_records_deleted_while_the_audit_reads_them_lose_that_batch_only(
    spark: Any, kafka: str, tmp_path: Path, fail_on_data_loss: str
) -> None:
    """The records of the batch the audit is about to read are deleted (``deleteRecords`` up to
    its end): with ``failOnDataLoss=true`` Spark's reader fails with ``KAFKA_DATA_LOSS``, which
    counts the batch lost at once (never retried); with ``false`` it reads nothing, and the
    broker asked after the read shows the records gone. Either way that batch is lost with the
    reason and the later ones are audited exactly."""
    ends: dict[int, int] = {}

    def truncate(topic: str, held: int) -> None:
        reader = CheckpointReader(str(tmp_path / "checkpoint"))
        entry = reader.offsets(held)
        assert entry is not None and entry.source_offsets[0] is not None
        ends.update({int(p): o for p, o in json.loads(entry.source_offsets[0])[topic].items()})
        _delete_below(kafka, topic, ends)

    result = _audit_held(
        spark,
        kafka,
        tmp_path,
        truncate,
        name=f"kafka_truncated_{fail_on_data_loss}",
        fail_on_data_loss=fail_on_data_loss,
    )
    held, status = result["held"], result["status"]
    assert result["lost"] == {held}, (held, sorted(result["lost"]))
    assert status["errors"] == 0, status
    reason = status["last_lost_reason"]
    if fail_on_data_loss == "true":
        assert "KAFKA_DATA_LOSS" in reason, reason
    else:
        assert "earliest now" in reason and result["topic"] in reason, reason
    later = {b for b in result["marked"] if b > held}
    _audited_exactly(result, later)
    assert any(result["marked"][b] for b in later), "no batch after the deleted one dropped rows"


def test_sidecar_of_a_topic_deleted_and_created_again_counts_what_it_had_not_audited_lost(
    spark: Any, kafka: str, tmp_path: Path
) -> None:
    """A stopped query's checkpoint audited by the sidecar, then the query run on, stopped, and
    its topic deleted and created again with other rows: the sidecar run again remembers the
    topic's id from its history, so the batches it had not audited are lost with the reason,
    and no row of the new topic is stored as theirs."""
    topic = new_topic(kafka)
    records = _records(seed=93)
    checkpoint = tmp_path / "checkpoint"
    db = tmp_path / "side.duckdb"

    def events() -> Any:
        return parse(SCHEMA)(kafka_stream(spark, kafka, topic, PER_TRIGGER)).withWatermark(
            "ts", "10 seconds"
        )

    def run_query() -> None:
        query = (
            events()
            .dropDuplicates(["user", "ts"])
            .writeStream.format("noop")
            .option("checkpointLocation", str(checkpoint))
            .start()
        )
        try:
            query.processAllAvailable()
        finally:
            query.stop()

    def sidecar() -> dict[str, Any]:
        frame = events()
        query = frame.dropDuplicates(["user", "ts"])
        return sidecar_status(spark, db, checkpoint, frame, query, name="kafka_side")

    produce(kafka, topic, records[:30])
    run_query()
    first = sidecar()
    audited_first = CheckpointReader(str(checkpoint)).committed_batches()
    assert first["batches_lost"] == 0 and first["errors"] == 0, first
    produce(kafka, topic, records[30:])
    run_query()
    _recreate(kafka, topic)
    produce(kafka, topic, _ghosts(per_partition=40))
    second = sidecar()

    reader = CheckpointReader(str(checkpoint))
    later = {b for b in reader.committed_batches() if b > audited_first[-1]}
    expected = {b for b in later if offsets_moved(reader, b)}
    assert expected, "the second run read nothing"
    late, marked = _history(db)
    assert set(reader.committed_batches()) - set(marked) == expected
    assert second["batches_lost"] == len(expected) and second["errors"] == 0, second
    reason = second["last_lost_reason"]
    assert topic in reason and "deleted and created again" in reason, reason
    assert not any(row["user"] == "ghost" for _, row in late)
    assert any(b <= audited_first[-1] for b, _ in late), "the first run audited no late row"


def _produce_keyed(bootstrap: str, topic: str, rows: list[tuple[str, dict[str, Any]]]) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0, "acks": "all"})
    for key, value in rows:
        producer.produce(topic, json.dumps(value).encode(), key=key.encode(), partition=0)
    assert producer.flush(30) == 0


def _offsets_present(spark: Any, bootstrap: str, topic: str, until: int) -> set[int]:
    rows = (
        spark.read.format("kafka")
        .option("kafka.bootstrap.servers", bootstrap)
        .option("assign", json.dumps({topic: [0]}))
        .option("startingOffsets", json.dumps({topic: {"0": 0}}))
        .option("endingOffsets", json.dumps({topic: {"0": until}}))
        .option("failOnDataLoss", "false")
        .load()
        .select("offset")
        .collect()
    )
    return {int(r["offset"]) for r in rows}


def test_compacted_topic_batches_are_audited_whole_or_lost_where_compaction_reached_them(
    spark: Any, kafka: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A compacted topic: records of its first batches are replaced by newer ones with the same
    keys and compaction removes them (Spark's reader skips the gaps, even with
    ``failOnDataLoss``). The audit names the topic compacted, counts every batch whose range
    lost a record lost with the reason, and audits the whole ones exactly."""
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"c_{uuid.uuid4().hex[:10]}"
    compact = {
        "cleanup.policy": "compact",
        "segment.ms": "100",
        "min.cleanable.dirty.ratio": "0.01",
        "min.compaction.lag.ms": "0",
        "delete.retention.ms": "100",
    }
    admin = AdminClient({"bootstrap.servers": kafka})
    admin.create_topics([NewTopic(topic, 1, 1, config=compact)])[topic].result(30)
    # 18 records of three keys (the last of each key survives compaction), then a segment later
    # 42 records of keys of their own, late ones among them, and the flush
    first = [(f"k{i % 3}", {"id": i, "user": "a", "ts": ts(2 * i)}) for i in range(18)]
    rest = [
        (f"r{i}", {"id": 100 + i, "user": u, "ts": ts(36 + s)})
        for i, (_, s, u) in enumerate(event_stream(seed=95, count=41))
    ]
    _produce_keyed(kafka, topic, first)
    time.sleep(0.5)  # the next record rolls the segment that holds the first ones
    _produce_keyed(kafka, topic, rest)
    total = len(first) + len(rest)
    deadline = time.monotonic() + 90
    rolls = 0
    while len(present := _offsets_present(spark, kafka, topic, total)) == total:
        assert time.monotonic() < deadline, "the broker never compacted the topic"
        rolls += 1  # a record of a key of its own rolls the active segment
        _produce_keyed(kafka, topic, [(f"roll{rolls}", {"id": -rolls})])
        time.sleep(1.0)
    missing = set(range(total)) - present

    raw = kafka_stream(spark, kafka, topic, 6)
    events = parse(SCHEMA)(raw).where("id >= 0").withWatermark("ts", "10 seconds")
    db = tmp_path / "history.duckdb"
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None)
    query = (
        events.dropDuplicates(["user", "ts"])
        .writeStream.format("noop")
        .queryName("kafka_compacted")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        with caplog.at_level(logging.WARNING, logger="wmwatch.audit"):
            handle = watch.audit(query, events)
            query.processAllAvailable()
            # before idle progress events push the batches' own out of recentProgress
            progress = list(query.recentProgress)
            query.stop()
            assert handle.sync(180), handle.status()
        status = handle.status()
        handle.stop()
    finally:
        query.stop()
        watch.close()
    late, marked = _history(db)
    reader = CheckpointReader(str(tmp_path / "checkpoint"))

    def offset_after(batch_id: int) -> int:
        entry = reader.offsets(batch_id)
        assert entry is not None and entry.source_offsets[0] is not None
        return int(json.loads(entry.source_offsets[0])[topic]["0"])

    def reads_missing(batch_id: int) -> bool:
        begin = offset_after(batch_id - 1) if batch_id > 0 else 0
        return any(begin <= o < offset_after(batch_id) for o in missing)

    by_batch = {p["batchId"]: p for p in progress if p["numInputRows"]}

    def replayed(batch_id: int) -> bool:
        """Whether the audit had to read the batch: progress does not show every row ahead of
        the watermark it was judged by (a row is late at or behind it)."""
        late_ms, event = reader.late_watermark_ms(batch_id), by_batch.get(batch_id)
        if late_ms is None:
            return False
        low = (event or {}).get("eventTime", {}).get("min")
        return not (event and event["numInputRows"] and low and epoch_seconds(low) * 1000 > late_ms)

    expected = {b for b in reader.committed_batches() if reads_missing(b) and replayed(b)}
    assert expected, "compaction reached no batch the audit replays"
    assert set(reader.committed_batches()) - set(marked) == expected
    assert status["batches_lost"] == len(expected) and status["errors"] == 0, status
    assert "compaction" in status["last_lost_reason"], status["last_lost_reason"]
    assert any(f"topic {topic} is compacted" in r.getMessage() for r in caplog.records)
    dropped = per_batch_dropped(progress)
    per_batch = {b: 0 for b in marked}
    for batch_id, _ in late:
        per_batch[batch_id] += 1
    for b in marked:
        assert per_batch[b] == marked[b] == dropped.get(b, 0), b
    assert any(marked.values()), "no whole batch had late rows"
