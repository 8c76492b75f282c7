"""Reading a batch of a Kafka source again: each partition's ``[offsets/N-1, offsets/N)`` through
Spark's Kafka batch reader with the query's own options, after checking that the broker still
holds the range (records deleted before the audit reached them lose the batch, with the reason).
The offsets, the first batch, Spark Connect and secrets: docs/audit-sources.md (Kafka).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.replay.connect import relation_schema_json
from wmwatch._audit.replay.sources.base import (
    SOURCE_FILE_COL,
    SOURCE_POSITION_COL,
    ConnectFound,
    Found,
    SourceKind,
)
from wmwatch._checkpoint.reader import (
    CheckpointEntryGone,
    CheckpointReader,
    logged_offsets,
    parse_offset_json,
)
from wmwatch._core.sessions import is_connect
from wmwatch._core.spark_jobs import bounded_job
from wmwatch._errors import AuditError

# Options of the streaming reader that a batch read refuses or that mean nothing there.
_STREAM_ONLY = frozenset(
    o.lower()
    for o in (
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
)
_SUBSCRIPTIONS = ("subscribe", "subscribePattern", "assign")
# Settings of the admin client that asks the broker for earliest offsets; the rest of the
# query's ``kafka.*`` settings (security) are passed as they are.
_ADMIN_TIMEOUT_MS = "10000"
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


class RecordsGone(CheckpointEntryGone):
    """Records of a batch were deleted from Kafka before the audit read them again."""


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

    options: Mapping[str, str] = field(repr=False)
    schema_json: str

    @property
    def description(self) -> str:
        """The subscription, the one part of the options safe to show."""
        subscribed = [f"{k}={self.options[k]}" for k in _SUBSCRIPTIONS if k in self.options]
        return f"kafka {', '.join(subscribed) or '(no subscription)'}"


def kafka_source_of(relation: Any) -> KafkaSourceSpec:
    """The Kafka source ``relation`` reads, with the options the query gave it."""
    options = {
        str(k): str(v) for k, v in dict(relation.extraOptions().asCaseSensitiveMap()).items()
    }
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
        options=dict(relation._options or {}),
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
    options = {k.lower(): v for k, v in spec.options.items()}
    found = []
    for index, description in enumerate(descriptions):
        match = _DESCRIPTION.match(description)
        if match is None:
            continue
        strategy, value = _STRATEGIES[match.group(1)], match.group(2)
        wanted = options.get(strategy)
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
    """A Kafka offset line as ``{topic: {partition: offset}}``."""
    parsed = parse_offset_json(text, what)
    try:
        return {
            str(topic): {int(p): int(o) for p, o in parts.items()}
            for topic, parts in parsed.items()
        }
    except (AttributeError, TypeError, ValueError) as exc:
        raise AuditError(
            f"the {what} offset {text[:80]!r} is not a Kafka offset line "
            '({"topic":{"0":123}}); the checkpoint is not this source\'s.'
        ) from exc


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


def gone_below(
    ranges: Mapping[str, Mapping[int, tuple[int, int]]], earliest: Mapping[tuple[str, int], int]
) -> list[str]:
    """The partitions whose range starts below the broker's earliest offset now, as text."""
    return [
        f"{topic}-{partition} from {begin} (earliest now {earliest[(topic, partition)]})"
        for topic, parts in sorted(ranges.items())
        for partition, (begin, _) in sorted(parts.items())
        if earliest.get((topic, partition), 0) > begin
    ]


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


def _earliest_offsets(
    spark: Any, options: Mapping[str, str], partitions: list[tuple[str, int]], timeout_s: float
) -> dict[tuple[str, int], int]:
    """The broker's earliest offset of each partition now, asked with the query's own client
    settings (through the driver's JVM, where Spark's connector brings the Kafka client)."""
    jvm = spark.sparkContext._jvm
    props = jvm.java.util.Properties()
    for key, value in options.items():
        if key.lower().startswith("kafka."):
            props.setProperty(key[len("kafka.") :], value)
    for key in ("default.api.timeout.ms", "request.timeout.ms"):
        props.setProperty(key, _ADMIN_TIMEOUT_MS)
    admin_pkg = jvm.org.apache.kafka.clients.admin
    admin = admin_pkg.Admin.create(props)
    try:
        wanted = jvm.java.util.HashMap()
        for topic, partition in partitions:
            wanted.put(
                jvm.org.apache.kafka.common.TopicPartition(topic, partition),
                admin_pkg.OffsetSpec.earliest(),
            )
        found = (
            admin.listOffsets(wanted)
            .all()
            .get(int(timeout_s * 1000), jvm.java.util.concurrent.TimeUnit.MILLISECONDS)
        )
        return {
            (str(tp.topic()), int(tp.partition())): int(info.offset())
            for tp, info in dict(found).items()
        }
    finally:
        admin.close(jvm.java.time.Duration.ofSeconds(5))


@dataclass(frozen=True, slots=True)
class KafkaBatchSource:
    """A Kafka source: batch N read ``[offsets/N-1, offsets/N)`` of each topic partition."""

    spec: KafkaSourceSpec
    index: int
    # the broker is asked at most this long for earliest offsets (a broker that is down makes
    # the read fail; the audit retries later)
    broker_timeout_seconds: float = 30.0

    @property
    def source_index(self) -> int:
        return self.index

    def batch_input(self, checkpoint: CheckpointReader, batch_id: int) -> tuple[str, str] | None:
        logged = logged_offsets(
            checkpoint, batch_id, self.index, lambda: _initial_offsets(checkpoint, self.index)
        )
        if logged is None:
            return None
        start, end = logged
        ranges = batch_ranges(parse_kafka_offsets(start, "start"), parse_kafka_offsets(end, "end"))
        # a partition added without records changes the line but reads nothing
        return logged if ranges else None

    def read(self, spark: Any, what: Any) -> Any:
        """The batch's records again, as Spark's Kafka reader gives them; :class:`RecordsGone`
        when some were deleted since."""
        from pyspark.sql import functions as F

        start, end = what
        ranges = batch_ranges(parse_kafka_offsets(start, "start"), parse_kafka_offsets(end, "end"))
        if is_connect(spark):
            self._first_records_readable(spark, ranges)
        else:
            self._not_deleted(spark, ranges)
        fail_on_loss = self.spec.options.get("failOnDataLoss", "true")
        # as the query: records deleted during the read fail it (then retried and found gone)
        frame = self._reader(spark, ranges, fail_on_loss).load()
        return frame.withColumn(SOURCE_FILE_COL, F.lit(None).cast("string")).withColumn(
            SOURCE_POSITION_COL, F.to_json(F.struct("topic", "partition", "offset"))
        )

    def _reader(
        self, spark: Any, ranges: Mapping[str, Mapping[int, tuple[int, int]]], fail_on_loss: str
    ) -> Any:
        """Spark's Kafka batch reader over ``ranges``, with the query's own client options."""
        options = {k: v for k, v in self.spec.options.items() if k.lower() not in _STREAM_ONLY}
        return (
            spark.read.format("kafka")
            .options(**options)
            .option("assign", json.dumps({t: sorted(parts) for t, parts in ranges.items()}))
            .option("startingOffsets", _offsets_json(ranges, 0))
            .option("endingOffsets", _offsets_json(ranges, 1))
            .option("failOnDataLoss", fail_on_loss)
        )

    def _not_deleted(self, spark: Any, ranges: Mapping[str, Mapping[int, tuple[int, int]]]) -> None:
        """Classic PySpark: the broker's earliest offsets, asked through the driver's JVM."""
        partitions = [(t, p) for t, parts in ranges.items() for p in parts]
        try:
            earliest = _earliest_offsets(
                spark, self.spec.options, partitions, self.broker_timeout_seconds
            )
        except Exception as exc:  # noqa: BLE001 - whatever the broker or py4j raised, said once
            raise AuditError(
                f"the Kafka broker did not give the earliest offsets of {self.spec.description} "
                f"({type(exc).__name__}); retrying later"
            ) from None
        gone = gone_below(ranges, earliest)
        if gone:
            raise RecordsGone(_gone_reason(gone))

    def _first_records_readable(
        self, spark: Any, ranges: Mapping[str, Mapping[int, tuple[int, int]]]
    ) -> None:
        """Spark Connect: each partition's first record of the batch read with
        ``failOnDataLoss`` on, which fails with ``KAFKA_DATA_LOSS`` when it was deleted."""
        first = {t: {p: (b, b + 1) for p, (b, _) in parts.items()} for t, parts in ranges.items()}
        try:
            with bounded_job(
                spark,
                description=f"wmwatch audit: first records of {self.spec.description}",
                timeout_seconds=self.broker_timeout_seconds,
            ):
                self._reader(spark, first, "true").load().select("partition").collect()
        except Exception as exc:  # noqa: BLE001 - py4j and Connect raise many kinds; sorted below
            if is_data_loss(exc):
                starts = [
                    f"{t}-{p} from {b}"
                    for t, parts in sorted(ranges.items())
                    for p, (b, _) in sorted(parts.items())
                ]
                raise RecordsGone(_gone_reason(starts, some=True)) from None
            raise AuditError(
                f"the Kafka broker did not give the first records of {self.spec.description} "
                f"({type(exc).__name__}); retrying later"
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
        "its Kafka records were deleted (retention or deleteRecords) before the audit read them "
        f"again: {where}{'; '.join(partitions[:5])}; keep records longer than the audit's lag"
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
