"""The Kafka source's pure rules: which offsets a batch read, which are gone since, whether its
topic is still the one it read, and that its options (credentials) are never shown. The
real-broker tests are in tests/test_audit_kafka_spark.py and
tests/test_audit_kafka_gone_spark.py."""

from __future__ import annotations

import pytest

from wmwatch._audit.identities import MemoryIdentityBook, SeenIdentity
from wmwatch._audit.replay.sources.kafka import (
    KafkaSourceSpec,
    TopicState,
    batch_ranges,
    check_identity,
    is_data_loss,
    kafka_positions,
    parse_kafka_offsets,
    records_gone,
)
from wmwatch._checkpoint.fs import CheckpointDamaged


def test_batch_ranges_per_partition_with_added_partitions_from_zero() -> None:
    start = parse_kafka_offsets('{"a":{"0":5,"1":7}}', "start")
    end = parse_kafka_offsets('{"a":{"0":9,"1":7,"2":3},"b":{"0":4}}', "end")
    # partition 1 read nothing; a-2 and topic b were added since and read from their start
    assert batch_ranges(start, end) == {"a": {0: (5, 9), 2: (0, 3)}, "b": {0: (0, 4)}}


def test_a_new_empty_partition_reads_nothing() -> None:
    assert batch_ranges({"a": {0: 5}}, {"a": {0: 5, 1: 0}}) == {}


def test_records_gone_names_each_partition_and_why() -> None:
    ranges = {"a": {0: (5, 9), 1: (0, 3), 2: (4, 6)}, "b": {0: (0, 1)}}
    whole = TopicState(True, "id-a", False, {0: 5, 1: 0, 2: 0}, {0: 9, 1: 3, 2: 8})
    assert (
        records_gone(ranges, {"a": whole, "b": TopicState(True, "id-b", None, {0: 0}, {0: 1})})
        == []
    )
    truncated = TopicState(True, "id-a", False, {0: 6, 1: 0}, {0: 9, 1: 2})
    assert records_gone(ranges, {"a": truncated, "b": TopicState(exists=False)}) == [
        "a-0 from 5 (earliest now 6)",
        "a-1 to 3 (the partition ends at 2)",
        "a-2 does not exist now",
        "topic b does not exist now",
    ]


def test_a_topic_id_seen_first_is_recorded_from_the_next_planned_batch() -> None:
    book = MemoryIdentityBook()
    assert check_identity(book, 0, "a", "X", 4, lambda: 9) is None
    assert book.seen(0, "a") == SeenIdentity("X", 10)
    # the same id later: nothing to say, nothing changed
    assert check_identity(book, 0, "a", "X", 12, lambda: 20) is None
    assert book.seen(0, "a") == SeenIdentity("X", 10)


def test_another_topic_id_loses_the_batch_and_those_planned_before_it_was_seen() -> None:
    book = MemoryIdentityBook({(0, "a"): SeenIdentity("X", 3)})
    why = check_identity(book, 0, "a", "Y", 5, lambda: 8)
    assert why is not None and "deleted and created again" in why and "X" in why and "Y" in why
    assert book.seen(0, "a") == SeenIdentity("Y", 9, replaced=True)
    # batches planned before the audit saw Y may have read either topic
    later = check_identity(book, 0, "a", "Y", 8, lambda: 8)
    assert later is not None and "planned before" in later
    # a batch planned after it read Y
    assert check_identity(book, 0, "a", "Y", 9, lambda: 12) is None
    # another source's topic of the same name is its own entry
    assert check_identity(book, 1, "a", "Z", 0, lambda: 0) is None


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        '{"a":[1]}',
        '{"a":{"x":1}}',
        '{"a":{"-1":1}}',
        '{"a":{"0":-7}}',
        '{"a":{"0":"7"}}',
        '{"a":{"0":true}}',
        '{"a":{"0":1.5}}',
        f'{{"a":{{"0":{2**63}}}}}',
        f'{{"a":{{"{2**31}":1}}}}',
        "[1]",
        "[" * 100_000 + "]" * 100_000,
    ],
)
def test_a_damaged_offset_line_costs_its_batch(text: str) -> None:
    """Damage the audit counts as a lost batch (CheckpointDamaged), never an error it
    retries; the line itself is never echoed."""
    with pytest.raises(CheckpointDamaged, match="end offset") as raised:
        parse_kafka_offsets(text, "end")
    assert "not json" not in str(raised.value)


def test_options_are_never_shown() -> None:
    secret = "org.apache.kafka.common.security.plain.PlainLoginModule password='s3cret'"
    spec = KafkaSourceSpec(
        options={"subscribe": "clicks", "kafka.sasl.jaas.config": secret}, schema_json="{}"
    )
    assert "s3cret" not in repr(spec) and "s3cret" not in spec.description
    assert spec.description == "kafka subscribe=clicks"


def test_kafka_sources_found_by_their_progress_description() -> None:
    """On Spark Connect a Kafka source's position comes from its progress description."""
    descriptions = [
        "FileStreamSource[file:/in]",
        "KafkaV2[Subscribe[clicks, views]]",
        "KafkaV2[SubscribePattern[p_.*]]",
        "KafkaV2[Assign[orders-0, orders-1]]",
        "KafkaV2[Subscribe[clicks]]",
    ]

    def spec(**options: str) -> KafkaSourceSpec:
        return KafkaSourceSpec(options=options, schema_json="{}")

    assert kafka_positions(descriptions, spec(subscribe="views,clicks")) == [1]
    assert kafka_positions(descriptions, spec(subscribe="clicks")) == [4]
    assert kafka_positions(descriptions, spec(subscribePattern="p_.*")) == [2]
    assert kafka_positions(descriptions, spec(assign='{"orders":[0,1]}')) == [3]
    assert kafka_positions(descriptions, spec(subscribe="other")) == []


def test_data_loss_is_told_from_other_failures() -> None:
    lost = RuntimeError(
        "Job aborted due to stage failure: ... KafkaIllegalStateException: Some data may have "
        "been lost because they are not available in Kafka any more;\neither the data ..."
    )
    assert is_data_loss(lost)
    assert not is_data_loss(RuntimeError("Timeout of 60000ms expired before the position"))
