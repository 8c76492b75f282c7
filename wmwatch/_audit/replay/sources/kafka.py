"""Reading a batch of a Kafka source again: each partition's ``[offsets/N-1, offsets/N)`` through
Spark's Kafka batch reader with the query's own options, after checking that the broker still
holds the range as the query read it (records deleted or compacted away, a topic deleted and
created again: the batch is lost, with the reason). The offsets, the first batch, Spark Connect
and secrets: docs/audit-sources.md (Kafka).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.replay.connect import relation_schema_json
from wmwatch._audit.replay.sources.base import (
    SOURCE_FILE_COL,
    SOURCE_POSITION_COL,
    ConnectFound,
    Found,
    IdentityBook,
    MemoryIdentityBook,
    SeenIdentity,
    SourceKind,
    SourceOptions,
)
from wmwatch._checkpoint.reader import (
    CheckpointDamaged,
    CheckpointEntryGone,
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
# Settings of the admin client that asks the broker about the batch's topics; the rest of the
# query's ``kafka.*`` settings (security) are passed as they are.
_ADMIN_TIMEOUT_MS = "10000"
# A broker older than Kafka 2.8 gives every topic this id (Uuid.ZERO_UUID): no id at all
_NO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"
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


@dataclass(frozen=True, slots=True)
class TopicState:
    """A topic as the broker describes it now: its id (None when the broker gives none, before
    Kafka 2.8), whether it is compacted (None when its ``cleanup.policy`` could not be read),
    and each partition's earliest and latest offset (a partition missing here does not exist)."""

    exists: bool
    topic_id: str | None = None
    compacted: bool | None = None
    earliest: Mapping[int, int] = field(default_factory=dict)
    latest: Mapping[int, int] = field(default_factory=dict)


def records_gone(
    ranges: Mapping[str, Mapping[int, tuple[int, int]]], states: Mapping[str, TopicState]
) -> list[str]:
    """Where a batch's records are no longer all in Kafka, partition by partition, as text:
    a topic or partition that does not exist, a range that starts below the earliest offset
    (retention, ``deleteRecords``) or ends past the latest (the topic deleted and created again
    with fewer records, or its log truncated)."""
    gone = []
    for topic, parts in sorted(ranges.items()):
        state = states.get(topic, TopicState(exists=False))
        if not state.exists:
            gone.append(f"topic {topic} does not exist now")
            continue
        for partition, (begin, until) in sorted(parts.items()):
            name = f"{topic}-{partition}"
            if partition not in state.latest:
                gone.append(f"{name} does not exist now")
            elif state.earliest.get(partition, 0) > begin:
                gone.append(f"{name} from {begin} (earliest now {state.earliest[partition]})")
            elif state.latest[partition] < until:
                gone.append(f"{name} to {until} (the partition ends at {state.latest[partition]})")
    return gone


def check_identity(
    book: IdentityBook,
    source_index: int,
    topic: str,
    topic_id: str,
    batch_id: int,
    newest_batch: Callable[[], int],
) -> str | None:
    """Why batch ``batch_id`` cannot be shown to have read the topic whose id is ``topic_id``
    now, or None; records what the audit sees.

    Topic ids are never reused, so the same id seen before a batch was planned and after it was
    read proves the batch read this topic. The first id seen is recorded with the first batch
    planned after it (``newest_batch() + 1``): earlier batches were planned before the audit
    looked, and nothing proves which topic they read. Another id than the one recorded means
    the topic was deleted and created again: this batch is lost, and so is every batch planned
    before the audit saw the new id (it may have read either)."""
    seen = book.seen(source_index, topic)
    if seen is None:
        book.record(source_index, topic, SeenIdentity(topic_id, newest_batch() + 1))
        return None
    if seen.identity != topic_id:
        book.record(source_index, topic, SeenIdentity(topic_id, newest_batch() + 1, True))
        return (
            f"topic {topic} was deleted and created again since the audit first read it "
            f"(id {seen.identity} then, {topic_id} now): the records batch {batch_id} read "
            "are gone"
        )
    if seen.replaced and batch_id < seen.since_batch:
        return (
            f"topic {topic} was deleted and created again (id {topic_id} from batch "
            f"{seen.since_batch} on): batch {batch_id} was planned before the audit saw the new "
            "topic, so which of the two it read is unknown"
        )
    return None


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


def _admin(spark: Any, options: Mapping[str, str]) -> Any:
    """A Kafka admin client in the driver's JVM (Spark's connector brings the Kafka client),
    with the query's own client settings and bounded request times."""
    jvm = spark.sparkContext._jvm
    props = jvm.java.util.Properties()
    for key, value in options.items():
        if key.lower().startswith("kafka."):
            props.setProperty(key[len("kafka.") :], value)
    for key in ("default.api.timeout.ms", "request.timeout.ms"):
        props.setProperty(key, _ADMIN_TIMEOUT_MS)
    return jvm.org.apache.kafka.clients.admin.Admin.create(props)


def broker_state(
    spark: Any,
    options: Mapping[str, str],
    ranges: Mapping[str, Mapping[int, tuple[int, int]]],
    timeout_s: float,
    *,
    policies: bool = True,
) -> dict[str, TopicState]:
    """What the broker says now of the topics ``ranges`` reads (one admin client, closed after):
    ids and partitions, earliest and latest offsets, and ``cleanup.policy`` when ``policies``."""
    jvm = spark.sparkContext._jvm
    unit = jvm.java.util.concurrent.TimeUnit.MILLISECONDS
    wait_ms = int(timeout_s * 1000)
    admin = _admin(spark, options)
    try:
        described = dict(admin.describeTopics(sorted(ranges)).topicNameValues())
        states: dict[str, TopicState] = {}
        partitions: dict[str, set[int]] = {}
        for topic in sorted(ranges):
            try:
                description = described[topic].get(wait_ms, unit)
            except Exception as exc:
                if "UnknownTopicOrPartition" not in str(exc):
                    raise
                states[topic] = TopicState(exists=False)
                continue
            topic_id = str(description.topicId().toString())
            states[topic] = TopicState(True, None if topic_id == _NO_TOPIC_ID else topic_id)
            partitions[topic] = {int(p.partition()) for p in description.partitions()}
        compacted = _compaction(jvm, admin, sorted(partitions), wait_ms) if policies else {}
        wanted = [
            (t, p) for t, parts in ranges.items() for p in parts if p in partitions.get(t, ())
        ]
        earliest = _offsets(jvm, admin, wanted, "earliest", wait_ms)
        latest = _offsets(jvm, admin, wanted, "latest", wait_ms)
        for topic in partitions:
            states[topic] = TopicState(
                True,
                states[topic].topic_id,
                compacted.get(topic),
                {p: o for (t, p), o in earliest.items() if t == topic},
                {p: o for (t, p), o in latest.items() if t == topic},
            )
        return states
    finally:
        admin.close(jvm.java.time.Duration.ofSeconds(5))


def _compaction(jvm: Any, admin: Any, topics: list[str], wait_ms: int) -> dict[str, bool]:
    """Whether each topic's ``cleanup.policy`` compacts; none known when the broker does not
    say (an ACL without DescribeConfigs), which the caller treats as maybe compacted."""
    if not topics:
        return {}
    resource = jvm.org.apache.kafka.common.config.ConfigResource
    wanted = {topic: resource(resource.Type.TOPIC, topic) for topic in topics}
    try:
        configs = dict(
            admin.describeConfigs(list(wanted.values()))
            .all()
            .get(wait_ms, jvm.java.util.concurrent.TimeUnit.MILLISECONDS)
        )
    except Exception as exc:  # noqa: BLE001 - any refusal: the policy stays unknown
        log.info("wmwatch: the broker gave no cleanup.policy (%s)", type(exc).__name__)
        return {}
    policies = {}
    for topic, key in wanted.items():
        entry = configs[key].get("cleanup.policy") if key in configs else None
        if entry is not None:
            policies[topic] = "compact" in str(entry.value()).lower()
    return policies


def _offsets(
    jvm: Any, admin: Any, partitions: list[tuple[str, int]], which: str, wait_ms: int
) -> dict[tuple[str, int], int]:
    """Each partition's ``earliest`` or ``latest`` offset now."""
    if not partitions:
        return {}
    spec = jvm.org.apache.kafka.clients.admin.OffsetSpec
    wanted = jvm.java.util.HashMap()
    for topic, partition in partitions:
        wanted.put(
            jvm.org.apache.kafka.common.TopicPartition(topic, partition),
            spec.earliest() if which == "earliest" else spec.latest(),
        )
    found = (
        admin.listOffsets(wanted).all().get(wait_ms, jvm.java.util.concurrent.TimeUnit.MILLISECONDS)
    )
    return {
        (str(tp.topic()), int(tp.partition())): int(info.offset())
        for tp, info in dict(found).items()
    }


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
