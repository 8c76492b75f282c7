"""What a Kafka broker holds now of the topics a batch read, asked through an admin client in
the driver's JVM with the query's own client settings: each topic's id and ``cleanup.policy``,
each partition's earliest and latest offsets; and the rules that say from those whether a
batch's records are still in Kafka as the batch read them (:mod:`.kafka` reads them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.identities import IdentityBook, SeenIdentity
from wmwatch._text import get_logger

log = get_logger("wmwatch.audit")

# Settings of the admin client that asks the broker about the batch's topics; the rest of the
# query's ``kafka.*`` settings (security) are passed as they are.
_ADMIN_TIMEOUT_MS = "10000"
# A broker older than Kafka 2.8 gives every topic this id (Uuid.ZERO_UUID): no id at all
_NO_TOPIC_ID = "AAAAAAAAAAAAAAAAAAAAAA"


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
