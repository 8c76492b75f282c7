"""Reading a batch of a Kafka source again: each partition's ``[offsets/N-1, offsets/N)`` through
Spark's Kafka batch reader with the query's own options, after checking that the broker still
holds the range as the query read it (records deleted or compacted away, a topic deleted and
created again: the batch is lost, with the reason). The offsets, the first batch, Spark Connect
and secrets: docs/audit-sources.md (Kafka).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.identities import IdentityBook, MemoryIdentityBook
from wmwatch._audit.replay.connect import relation_schema_json
from wmwatch._audit.replay.sources._kafka_broker import (
    TopicState,
    broker_state,
    check_identity,
    records_gone,
)
from wmwatch._audit.replay.sources.base import (
    SOURCE_FILE_COL,
    SOURCE_POSITION_COL,
    ConnectFound,
    Found,
    SourceKind,
    SourceOptions,
)
from wmwatch._checkpoint.fs import CheckpointDamaged, CheckpointEntryGone
from wmwatch._checkpoint.reader import (
    CheckpointReader,
    checkpoint_long,
    logged_offsets,
    parse_offset_json,
)
from wmwatch._core.sessions import is_connect
from wmwatch._core.spark_jobs import bounded_job
from wmwatch._errors import AuditError
from wmwatch._text import get_logger

log = get_logger("wmwatch.audit")

# Options of the streaming reader that a batch read refuses or that mean nothing there.
_STREAM_ONLY = (
    "startingOffsets",
    "endingOffsets",
    "startingTimestamp",
    "endingTimestamp",
    "startingOffsetsByTimestamp",
    "endingOffsetsByTimestamp",
    "startingOffsetsByTimestampStrategy",
    "maxOffsetsPerTrigger",
    "minOffsetsPerTrigger",
    "maxTriggerDelay",
    "maxRecordsPerPartition",
    "subscribe",
    "subscribePattern",
    "assign",
    "failOnDataLoss",
    "path",
)
_SUBSCRIPTIONS = ("subscribe", "subscribePattern", "assign")
# How long Connect's probe of a partition's last record waits for it: a record that exists is
# fetched at once, one past the partition's end is waited for this long before Spark's reader
# calls it lost (the reader's default is spark.network.timeout, 120 s)
_PROBE_POLL_TIMEOUT_MS = "5000"
_KAFKA_TABLE = "KafkaSourceProvider$KafkaTable"
# Spark's error condition for records that are not in Kafka any more, and its message (a
# task's failure reaches a Connect client as a stage failure that quotes only the message)
_DATA_LOSS = "KAFKA_DATA_LOSS"
_DATA_LOSS_TEXT = "Some data may have been lost because they are not available in Kafka any more"
# a Kafka source's progress description: KafkaV2[Subscribe[a, b]], KafkaV2[SubscribePattern[p.*]]
_DESCRIPTION = re.compile(r"^KafkaV2\[(Subscribe|SubscribePattern|Assign)\[(.*)\]\]$")
_STRATEGIES = {"Subscribe": "subscribe", "SubscribePattern": "subscribepattern", "Assign": "assign"}

# {topic: {partition: offset}}
Offsets = dict[str, dict[int, int]]
# Kafka numbers partitions with a Java int
_MAX_PARTITION = 2**31 - 1


class RecordsGone(CheckpointEntryGone):
    """Records of a batch are not in Kafka as the batch read them (deleted, compacted, or their
    topic replaced): the batch is counted lost with the reason."""


def is_kafka_source(relation: Any) -> bool:
    """Whether a streaming relation of a logical plan reads Spark's Kafka source."""
    try:
        return bool(
            str(relation.nodeName()) == "StreamingRelationV2"
            and str(relation.table().getClass().getName()).endswith(_KAFKA_TABLE)
        )
    except Exception:  # noqa: BLE001 - any py4j failure: not this kind of relation
        return False


@dataclass(frozen=True, slots=True)
class KafkaSourceSpec:
    """The query's Kafka source: its options (never shown: they hold credentials) and schema."""

    options: SourceOptions = field(repr=False)
    schema_json: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", SourceOptions.of(self.options))

    @property
    def description(self) -> str:
        """The subscription, the one part of the options safe to show."""
        subscribed = [f"{k}={self.options[k]}" for k in _SUBSCRIPTIONS if k in self.options]
        return f"kafka {', '.join(subscribed) or '(no subscription)'}"


def kafka_source_of(relation: Any) -> KafkaSourceSpec:
    """The Kafka source ``relation`` reads, with the options the query gave it."""
    options = SourceOptions(dict(relation.extraOptions().asCaseSensitiveMap()))
    return KafkaSourceSpec(options=options, schema_json=str(relation.schema().json()))


def _at(kafka: KafkaSourceSpec, positions: list[int]) -> Found:
    return Found(positions, lambda index: KafkaBatchSource(kafka, index), kafka.description)


def _found(spark: Any, events: Any, relation: Any, positions: list[int], plan_text: str) -> Found:
    return _at(kafka_source_of(relation), positions)


# -- Spark Connect: the client's plan objects ---------------------------------------------------


def is_kafka_format(name: str | None) -> bool:
    """Whether a reader's format name (a Connect client's plan) is Spark's Kafka source."""
    return (name or "").lower() in ("kafka", "org.apache.spark.sql.kafka010.kafkasourceprovider")


def connect_kafka_source_of(events: Any, relation: Any) -> KafkaSourceSpec:
    """The Kafka source a Connect events DataFrame reads: the options the client gave it (they
    stay in memory: security settings among them) and its schema, from the server."""
    return KafkaSourceSpec(
        options=SourceOptions(relation._options),
        schema_json=relation_schema_json(events, relation),
    )


def _connect_found(events: Any, relation: Any) -> ConnectFound:
    kafka = connect_kafka_source_of(events, relation)

    def found(descriptions: Sequence[str]) -> Found:
        positions = kafka_positions(descriptions, kafka)
        if not positions and len(descriptions) <= 1:
            positions = [0]
        return _at(kafka, positions)

    return found


def kafka_positions(descriptions: Sequence[str], spec: KafkaSourceSpec) -> list[int]:
    """The positions of the sources whose progress description names ``spec``'s subscription
    (Spark Connect, where no plan object says which source is which)."""
    found = []
    for index, description in enumerate(descriptions):
        match = _DESCRIPTION.match(description)
        if match is None:
            continue
        strategy, value = _STRATEGIES[match.group(1)], match.group(2)
        wanted = spec.options.get(strategy)
        if wanted is None:
            continue
        if strategy == "subscribe":
            same = _topics(value, ",") == _topics(wanted, ",")
        elif strategy == "assign":
            same = {t.rsplit("-", 1)[0] for t in _topics(value, ",")} == set(json.loads(wanted))
        else:
            same = value == wanted
        if same:
            found.append(index)
    return found


def _topics(text: str, sep: str) -> set[str]:
    return {t.strip() for t in text.split(sep) if t.strip()}


def parse_kafka_offsets(text: str, what: str) -> Offsets:
    """A Kafka offset line as ``{topic: {partition: offset}}``; :class:`CheckpointDamaged` for
    a line of another shape or with numbers Kafka never gives (the batch cannot be read)."""
    parsed = parse_offset_json(text, what)
    shape = (
        f"the {what} offset line is not a Kafka offset line "
        '({"topic":{"0":123}}); the checkpoint is damaged or not this source\'s.'
    )
    if not isinstance(parsed, dict) or not all(isinstance(p, dict) for p in parsed.values()):
        raise CheckpointDamaged(shape)
    offsets: Offsets = {}
    for topic, parts in parsed.items():
        for partition, offset in parts.items():
            if not (partition.isascii() and partition.isdigit()) or int(partition) > _MAX_PARTITION:
                raise CheckpointDamaged(shape)
            offsets.setdefault(str(topic), {})[int(partition)] = checkpoint_long(
                offset, f"the {what} offset of {topic}-{partition}"
            )
    return offsets


def batch_ranges(start: Offsets, end: Offsets) -> dict[str, dict[int, tuple[int, int]]]:
    """Per topic partition, the ``[from, until)`` a batch read: from ``start``'s offset, or 0
    for a partition ``start`` does not name (added since: the source read it from its start);
    partitions that read nothing are left out."""
    ranges: dict[str, dict[int, tuple[int, int]]] = {}
    for topic, parts in end.items():
        for partition, until in parts.items():
            begin = start.get(topic, {}).get(partition, 0)
            if until > begin:
                ranges.setdefault(topic, {})[partition] = (begin, until)
    return ranges


def _initial_offsets(checkpoint: CheckpointReader, index: int) -> str:
    """Where the query started reading: the offsets the Kafka source wrote to its own log when
    it resolved ``startingOffsets`` (a zero byte, ``v1``, then the JSON)."""
    text = checkpoint.fs.read_text(checkpoint._join("sources", str(index), "0"))
    lines = [] if text is None else text.lstrip("\x00").splitlines()
    if len(lines) < 2 or not lines[0].startswith("v"):
        raise CheckpointEntryGone(
            f"sources/{index}/0, where the Kafka source logged the offsets it started from, is "
            "missing or damaged, so where the first batch started reading is unknown"
        )
    return lines[1]


@dataclass(frozen=True, slots=True)
class KafkaBatch:
    """What one batch read from a Kafka source: the logged offsets around it, and the
    checkpoint (to learn which batches it holds when an identity is first seen)."""

    batch_id: int
    start: str
    end: str
    checkpoint: CheckpointReader = field(compare=False, repr=False)

    @property
    def ranges(self) -> dict[str, dict[int, tuple[int, int]]]:
        return batch_ranges(
            parse_kafka_offsets(self.start, "start"), parse_kafka_offsets(self.end, "end")
        )

    def newest_batch(self) -> int:
        """The newest batch the checkpoint holds (planned, maybe not committed)."""
        planned = self.checkpoint.offset_batches()
        return max(planned[-1], self.batch_id) if planned else self.batch_id


@dataclass(frozen=True, slots=True)
class KafkaBatchSource:
    """A Kafka source: batch N read ``[offsets/N-1, offsets/N)`` of each topic partition."""

    spec: KafkaSourceSpec
    index: int
    # the broker is asked at most this long about the batch's topics (a broker that is down
    # makes the read fail; the audit retries later)
    broker_timeout_seconds: float = 30.0
    # what the audit saw of its topics' ids (the history's, handed over when the audit starts)
    _book: list[IdentityBook] = field(
        default_factory=lambda: [MemoryIdentityBook()], compare=False, repr=False
    )
    # compacted topics already named in the log
    _compacted_named: set[str] = field(default_factory=set, compare=False, repr=False)

    @property
    def source_index(self) -> int:
        return self.index

    def remember_with(self, book: IdentityBook) -> None:
        self._book[0] = book

    def batch_input(self, checkpoint: CheckpointReader, batch_id: int) -> KafkaBatch | None:
        logged = logged_offsets(
            checkpoint, batch_id, self.index, lambda: _initial_offsets(checkpoint, self.index)
        )
        if logged is None:
            return None
        batch = KafkaBatch(batch_id, logged[0], logged[1], checkpoint)
        # a partition added without records changes the line but reads nothing
        return batch if batch.ranges else None

    def read(self, spark: Any, what: Any) -> Any:
        """The batch's records again, as Spark's Kafka reader gives them; :class:`RecordsGone`
        when they are not all in Kafka as the batch read them."""
        from pyspark.sql import functions as F

        batch: KafkaBatch = what
        ranges = batch.ranges
        if is_connect(spark):
            self._ends_readable(spark, ranges)
        else:
            self._broker_agrees(spark, batch, count_compacted=True)
        fail_on_loss = self.spec.options.get("failOnDataLoss") or "true"
        # as the query: records deleted during the read fail it (then found lost)
        frame = self._reader(spark, ranges, fail_on_loss).load()
        return frame.withColumn(SOURCE_FILE_COL, F.lit(None).cast("string")).withColumn(
            SOURCE_POSITION_COL, F.to_json(F.struct("topic", "partition", "offset"))
        )

    def after_read(self, spark: Any, what: Any, error: BaseException | None) -> None:
        """Spark's reader failed with ``KAFKA_DATA_LOSS``: the batch is lost, not retried; it
        succeeded: the broker is asked again, so that a topic deleted, truncated or replaced
        while the replay read it does not pass (classic PySpark)."""
        batch: KafkaBatch = what
        if error is not None:
            if is_data_loss(error):
                raise RecordsGone(
                    "Spark's Kafka reader found records of the batch missing while it read them "
                    f"again (KAFKA_DATA_LOSS) in {', '.join(sorted(batch.ranges))}: deleted, "
                    "compacted or replaced before the audit reached them; keep records longer "
                    "than the audit's lag"
                ) from None
            return
        if not is_connect(spark):
            self._broker_agrees(spark, batch, count_compacted=False)

    def _reader(
        self, spark: Any, ranges: Mapping[str, Mapping[int, tuple[int, int]]], fail_on_loss: str
    ) -> Any:
        """Spark's Kafka batch reader over ``ranges``, with the query's own client options."""
        options = self.spec.options.without(*_STREAM_ONLY)
        return (
            spark.read.format("kafka")
            .options(**options)
            .option("assign", json.dumps({t: sorted(parts) for t, parts in ranges.items()}))
            .option("startingOffsets", _offsets_json(ranges, 0))
            .option("endingOffsets", _offsets_json(ranges, 1))
            .option("failOnDataLoss", fail_on_loss)
        )

    def _broker_agrees(self, spark: Any, batch: KafkaBatch, *, count_compacted: bool) -> None:
        """Classic PySpark: the broker's view of the batch's topics, through the driver's JVM;
        :class:`RecordsGone` when the batch's records are not all there as it read them."""
        ranges = batch.ranges
        try:
            states = broker_state(
                spark,
                self.spec.options,
                ranges,
                self.broker_timeout_seconds,
                policies=count_compacted,
            )
        except Exception as exc:  # noqa: BLE001 - whatever the broker or py4j raised, said once
            raise AuditError(
                f"the Kafka broker did not describe the topics of {self.spec.description} "
                f"({type(exc).__name__}); retrying later"
            ) from None
        for topic in sorted(ranges):
            topic_id = states[topic].topic_id if topic in states else None
            if topic_id is None:
                continue  # gone, or a broker that gives no ids (before Kafka 2.8): offsets only
            why = check_identity(
                self._book[0], self.index, topic, topic_id, batch.batch_id, batch.newest_batch
            )
            if why is not None:
                raise RecordsGone(why)
        gone = records_gone(ranges, states)
        if gone:
            raise RecordsGone(_gone_reason(gone))
        if count_compacted:
            self._still_whole(spark, ranges, states)

    def _still_whole(
        self,
        spark: Any,
        ranges: Mapping[str, Mapping[int, tuple[int, int]]],
        states: Mapping[str, TopicState],
    ) -> None:
        """A compacted topic (or one whose policy is unknown) keeps only the newest record of
        each key, removing others anywhere above the earliest offset, and Spark's reader skips
        the gaps silently: the batch is read only when every offset of its range still holds a
        record (one count per partition, a small job under the replay's deadline)."""
        maybe = {t: ranges[t] for t in ranges if states[t].compacted is not False}
        if not maybe:
            return
        for topic in sorted(maybe):
            if topic not in self._compacted_named:
                self._compacted_named.add(topic)
                log.warning(
                    "wmwatch: audit of %s: topic %s is compacted%s: a batch is audited only "
                    "when every offset of its range still holds a record, else counted lost",
                    self.spec.description,
                    topic,
                    "" if states[topic].compacted else " (or its cleanup.policy is unreadable)",
                )
        counted = {
            (str(r["topic"]), int(r["partition"])): int(r["count"])
            for r in self._reader(spark, maybe, "false")
            .load()
            .groupBy("topic", "partition")
            .count()
            .collect()
        }
        short = [
            f"{t}-{p} holds {counted.get((t, p), 0)} of the {until - begin} records of "
            f"[{begin}, {until})"
            for t, parts in sorted(maybe.items())
            for p, (begin, until) in sorted(parts.items())
            if counted.get((t, p), 0) < until - begin
        ]
        if short:
            raise RecordsGone(
                "compaction (cleanup.policy=compact) removed records the batch read, or "
                f"transaction markers hold some of its offsets: {'; '.join(short[:5])}; what the "
                "batch dropped cannot be rebuilt from what is left"
            )

    def _ends_readable(
        self, spark: Any, ranges: Mapping[str, Mapping[int, tuple[int, int]]]
    ) -> None:
        """Spark Connect: each partition's first and last record of the batch read with
        ``failOnDataLoss`` on, which fails with ``KAFKA_DATA_LOSS`` when records below the
        first were deleted or the partition ends before the last."""
        first = {t: {p: (b, b + 1) for p, (b, _) in parts.items()} for t, parts in ranges.items()}
        last = {t: {p: (u - 1, u) for p, (_, u) in parts.items()} for t, parts in ranges.items()}
        try:
            with bounded_job(
                spark,
                description=f"wmwatch audit: first and last records of {self.spec.description}",
                timeout_seconds=self.broker_timeout_seconds,
            ):
                probes = [
                    self._reader(spark, probe, "true")
                    .option("kafkaConsumer.pollTimeoutMs", _PROBE_POLL_TIMEOUT_MS)
                    .load()
                    .select("partition")
                    for probe in (first, last)
                ]
                probes[0].union(probes[1]).collect()
        except Exception as exc:  # noqa: BLE001 - py4j and Connect raise many kinds; sorted below
            if is_data_loss(exc):
                ends = [
                    f"{t}-{p} [{b}, {u})"
                    for t, parts in sorted(ranges.items())
                    for p, (b, u) in sorted(parts.items())
                ]
                raise RecordsGone(_gone_reason(ends, some=True)) from None
            raise AuditError(
                f"the Kafka broker did not give the first and last records of "
                f"{self.spec.description} ({type(exc).__name__}); retrying later"
            ) from None


def is_data_loss(exc: BaseException) -> bool:
    """Whether Spark's Kafka reader failed because records were deleted (``KAFKA_DATA_LOSS``)."""
    try:
        condition = str(exc.getCondition() or "")  # type: ignore[attr-defined]  # Connect's errors carry it; typed on none
    except Exception:  # noqa: BLE001 - an error that is not Spark's has no condition
        condition = ""
    return condition.startswith(_DATA_LOSS) or _DATA_LOSS_TEXT in str(exc)


def _gone_reason(partitions: list[str], *, some: bool = False) -> str:
    where = "some of " if some else ""
    return (
        "its Kafka records were deleted (retention or deleteRecords) or their topic deleted, "
        f"truncated or created again before the audit read them: {where}"
        f"{'; '.join(partitions[:5])}; keep records longer than the audit's lag"
    )


def _offsets_json(ranges: Mapping[str, Mapping[int, tuple[int, int]]], end: int) -> str:
    return json.dumps(
        {t: {str(p): r[end] for p, r in sorted(parts.items())} for t, parts in ranges.items()}
    )


KIND = SourceKind(
    name="kafka",
    matches=lambda spark, relation: is_kafka_source(relation),
    found=_found,
    connect_matches=lambda relation: is_kafka_format(relation._format),
    connect_found=_connect_found,
)
