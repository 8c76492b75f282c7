"""The pure rules of the watermark-jump forensics: when a batch is flagged, what an incident
holds, which of a batch's rows are its top rows, and how long an incident can still cost rows.

No Spark, no DuckDB, no threads: text and numbers in, values out.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from wmwatch._errors import ConfigError

DEFAULT_AHEAD_SECONDS = 600.0
DEFAULT_JUMP_SECONDS = 3600.0
# rows kept per incident: enough to name the culprit and see whether it is alone
TOP_ROWS = 5


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a batch is flagged: event time ahead of the batch's time, watermark jump."""

    ahead_seconds: float = DEFAULT_AHEAD_SECONDS
    jump_seconds: float = DEFAULT_JUMP_SECONDS

    def __post_init__(self) -> None:
        for name in ("ahead_seconds", "jump_seconds"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"watermark_{name}={value!r}: pass a positive number of seconds.")


@dataclass(frozen=True, slots=True)
class BatchTimes:
    """What progress said about one batch's times (epoch ms) and inputs."""

    batch_at_ms: int | None
    event_time_max_ms: int | None
    descriptions: tuple[str, ...] = ()


def ahead_seconds(times: BatchTimes | None) -> float | None:
    """How far the batch's largest event time runs ahead of the batch's own time."""
    if times is None or times.batch_at_ms is None or times.event_time_max_ms is None:
        return None
    return (times.event_time_max_ms - times.batch_at_ms) / 1000.0


def jump_seconds(watermark_ms: int | None, previous_ms: int | None) -> float | None:
    """How far the watermark moved from the batch before; None before a first watermark (it
    reads as the epoch until set, and being set is no jump)."""
    if watermark_ms is None or previous_ms is None or previous_ms <= 0:
        return None
    return (watermark_ms - previous_ms) / 1000.0


def flags(ahead: float | None, jump: float | None, thresholds: Thresholds) -> tuple[bool, bool]:
    """(event time too far ahead, watermark jumped too far)."""
    return (
        ahead is not None and ahead > thresholds.ahead_seconds,
        jump is not None and jump > thresholds.jump_seconds,
    )


@dataclass(frozen=True, slots=True)
class TopRow:
    """One of the rows with the largest event times of the batch that moved the watermark."""

    rank: int
    event_time_us: int | None
    source_index: int | None
    source_file: str | None
    row_data: str | None
    kafka_topic: str | None = None
    kafka_partition: int | None = None
    kafka_offset: int | None = None


@dataclass(frozen=True, slots=True)
class Incident:
    """A batch that moved the watermark (``batch_id``) and what is known of it."""

    batch_id: int
    run_id: str | None = None
    batch_at_ms: int | None = None
    event_time_max_ms: int | None = None
    ahead_seconds: float | None = None
    watermark_before_ms: int | None = None
    watermark_after_ms: int | None = None
    jump_seconds: float | None = None
    # the batch whose watermark jumped (batch_id + 1), when the jump was seen
    jump_batch_id: int | None = None
    source_index: int | None = None
    source_description: str | None = None
    rows: tuple[TopRow, ...] = ()
    rows_error: str | None = None

    @property
    def reasons(self) -> str:
        said = [
            name
            for name, on in (("ahead", self.ahead_seconds), ("jump", self.jump_batch_id))
            if on is not None
        ]
        return ",".join(said)


def kafka_position(text: str | None) -> tuple[str | None, int | None, int | None]:
    """(topic, partition, offset) from the position the Kafka source attaches to each row."""
    if not text:
        return None, None, None
    try:
        doc = json.loads(text)
        return str(doc["topic"]), int(doc["partition"]), int(doc["offset"])
    except (ValueError, KeyError, TypeError):
        return None, None, None


def top_rows_of(rows: Sequence[tuple[Any, ...]], limit: int = TOP_ROWS) -> tuple[TopRow, ...]:
    """The ``limit`` rows with the largest event times, from ``(event_time_us, source_index,
    source_file, row_data, position)`` tuples, newest first (ties: input order)."""
    ordered = sorted(
        enumerate(rows), key=lambda ir: (-(ir[1][0] if ir[1][0] is not None else -(2**62)), ir[0])
    )
    out = []
    for rank, (_, row) in enumerate(ordered[:limit], start=1):
        topic, partition, offset = kafka_position(row[4])
        out.append(
            TopRow(
                rank=rank,
                event_time_us=row[0],
                source_index=row[1],
                source_file=row[2],
                row_data=row[3],
                kafka_topic=topic,
                kafka_partition=partition,
                kafka_offset=offset,
            )
        )
    return tuple(out)


def distinct_rows(rows: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``rows`` without repeats, in order (a row a sliding window expanded into copies)."""
    return list(dict.fromkeys(rows))


def still_costing(incident: Incident, batch_at_ms: int | None) -> bool:
    """Whether a batch at ``batch_at_ms`` can still lose rows to the incident: until the clock
    passes the watermark it set. After that, rows that late would be late without the jump
    too, and the count stops growing with the history. A row dated far in the future keeps
    this true for good: the count then grows by each new batch's rows only
    (:data:`wmwatch._audit.jumps.table.COST_SQL`)."""
    after = incident.watermark_after_ms
    return after is None or batch_at_ms is None or batch_at_ms <= after


def describe(incident: Incident) -> str:
    """One line for the log: how far the rows ran ahead and where they came from (never their
    data: row payloads belong in the history, where columns= and hash_columns= apply)."""
    parts = []
    if incident.ahead_seconds is not None:
        parts.append(f"event time {incident.ahead_seconds:,.0f}s ahead of the batch's time")
    if incident.jump_seconds is not None:
        parts.append(f"watermark +{incident.jump_seconds:,.0f}s in batch {incident.jump_batch_id}")
    if incident.source_description:
        parts.append(f"input {incident.source_index} ({incident.source_description})")
    if incident.rows and incident.rows[0].kafka_partition is not None:
        top = incident.rows[0]
        parts.append(f"partition {top.kafka_partition} offset {top.kafka_offset}")
    return "; ".join(parts) or "no detail"
