"""Parsing of streaming progress documents: the one place where JSON becomes typed snapshots.

Every progress document wmwatch sees (from the listener, from ``query.lastProgress``, from a
recorded fixture) goes through :func:`parse_progress`, or :func:`parse_progress_event` for what a
listener hands over (``QueryProgressEvent.json()`` nests the document under "progress").
Milliseconds become seconds, ISO-8601 strings become aware UTC datetimes, and anything missing
or malformed becomes ``None`` rather than an exception, except the three fields that identify a
batch (``id``, ``runId``, ``batchId``). Text is cleaned here, once: every text field of a snapshot
is redacted, bounded and valid UTF-8, and whatever stores, exports or reports it uses it as is.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from wmwatch._errors import ProgressParseError
from wmwatch._text import clean, clean_json, valid_utf8
from wmwatch._time import EPOCH, parse_timestamp

# Longest name (of a query, operator, metric or error class) and description wmwatch keeps.
_MAX_NAME_CHARS = 200
_MAX_DESCRIPTION_CHARS = 1000
# QueryProgressEvent.json() on the JVM side: {"progress":{...}}
_EVENT_PREFIX = '{"progress"'
_EVENT_COLON = re.compile(r"[ \t\n\r]*:")
_JSON_SPACE = " \t\n\r"


@dataclass(frozen=True, slots=True)
class OperatorProgress:
    """One stateful operator's numbers for one batch; ``operator_id`` 0 is the most downstream."""

    operator_id: int
    name: str
    rows_total: int | None = None
    rows_updated: int | None = None
    rows_removed: int | None = None
    rows_dropped_by_watermark: int | None = None
    memory_used_bytes: int | None = None
    shuffle_partitions: int | None = None
    state_store_instances: int | None = None
    custom_metrics: Mapping[str, float] = field(default_factory=dict)

    @property
    def ran(self) -> bool:
        """Whether the operator ran in the batch. One that opened no state store did not: a
        batch run again after a restart that its sink had already written is skipped by the
        sink, and Spark then reports zeros it never counted."""
        return self.state_store_instances != 0


@dataclass(frozen=True, slots=True)
class KafkaPartition:
    """One partition a Kafka source reads: where the batch ended and the newest offset Spark
    saw (``latestOffset``; None when the progress does not say)."""

    topic: str
    partition: int
    end_offset: int
    latest_offset: int | None = None

    @property
    def offsets_behind_latest(self) -> int | None:
        """Records the query has not read yet (0 when caught up)."""
        if self.latest_offset is None:
            return None
        return max(0, self.latest_offset - self.end_offset)


@dataclass(frozen=True, slots=True)
class SourceProgress:
    """One source's numbers for one batch; ``index`` matches the checkpoint's
    ``sources/<index>``."""

    index: int
    description: str
    start_offset: str | None = None
    end_offset: str | None = None
    latest_offset: str | None = None
    input_rows: int | None = None
    input_rows_per_second: float | None = None
    processed_rows_per_second: float | None = None
    kafka_partitions: tuple[KafkaPartition, ...] = ()


@dataclass(frozen=True, slots=True)
class ProgressSnapshot:
    """Everything wmwatch uses from one ``StreamingQueryProgress``."""

    query_id: str
    run_id: str
    name: str | None
    batch_id: int
    timestamp_at: datetime | None
    batch_duration_seconds: float | None
    durations_seconds: Mapping[str, float]
    watermark_at: datetime | None
    event_time_max_at: datetime | None
    event_time_min_at: datetime | None
    event_time_avg_at: datetime | None
    input_rows: int | None
    input_rows_per_second: float | None
    processed_rows_per_second: float | None
    operators: tuple[OperatorProgress, ...]
    sources: tuple[SourceProgress, ...]
    sink_description: str | None
    sink_output_rows: int | None
    # the document as JSON text, every secret in it masked; None when it could not be kept
    # (the store then records the batch without it, and counts that)
    raw_json: str | None

    @property
    def label(self) -> str:
        """The ``query`` label: the query's name, or its id when it has none."""
        return self.name or self.query_id

    @property
    def has_watermark(self) -> bool:
        """True once Spark has computed a watermark (it reports the epoch before that)."""
        return self.watermark_at is not None and self.watermark_at != EPOCH

    @property
    def watermark_lag_seconds(self) -> float | None:
        """Batch time minus watermark: how far the watermark trails the clock."""
        if not self.has_watermark or self.timestamp_at is None:
            return None
        return _seconds_between(self.timestamp_at, self.watermark_at)

    @property
    def event_time_delay_seconds(self) -> float | None:
        """Event-time max minus watermark: the delay the watermark currently allows."""
        if not self.has_watermark or self.event_time_max_at is None:
            return None
        return _seconds_between(self.event_time_max_at, self.watermark_at)

    @property
    def event_time_spread_seconds(self) -> float | None:
        """Event-time max minus min within the batch (input rows, late ones included)."""
        if self.event_time_max_at is None or self.event_time_min_at is None:
            return None
        return _seconds_between(self.event_time_max_at, self.event_time_min_at)

    @property
    def rows_dropped_by_watermark(self) -> int:
        """Sum over operators; for aggregations Spark counts late groups, not rows."""
        return sum(op.rows_dropped_by_watermark or 0 for op in self.operators)

    @property
    def state_rows_total(self) -> int:
        return sum(op.rows_total or 0 for op in self.operators)

    @property
    def state_memory_bytes(self) -> int:
        return sum(op.memory_used_bytes or 0 for op in self.operators)


def query_label(name: str | None, query_id: str) -> str:
    """The value of the ``query`` label: the name (cleaned as ``clean_name`` does) or the id."""
    return clean_name(name) or query_id


def clean_name(name: str | None) -> str | None:
    """A name from Spark (a query's, an error class) as wmwatch keeps it: cleaned
    (:func:`wmwatch._text.clean`: redacted, no control characters, valid UTF-8) and bounded;
    None for no name, or one made of control characters only.

    Cleaning a cleaned name changes nothing, so a name from a snapshot or event passes as is."""
    return (_cleaned(name, _MAX_NAME_CHARS) or None) if name else None


def parse_progress(raw: str | bytes | Mapping[str, Any]) -> ProgressSnapshot:
    """Parse one progress document (JSON text or an already decoded mapping).

    Raises ``ProgressParseError`` when the document is not a JSON object or lacks
    ``id``, ``runId`` or ``batchId``; every other field is optional.
    """
    if isinstance(raw, Mapping):
        return _snapshot(raw, _dumps(raw))
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return _snapshot(_loads(text), text)


def parse_progress_event(raw: str | bytes | Mapping[str, Any]) -> ProgressSnapshot:
    """Parse what a listener hands over: ``QueryProgressEvent.json()`` (the progress nested under
    "progress"), a bare progress document, or a decoded mapping. Errors as :func:`parse_progress`.
    """
    if isinstance(raw, Mapping):
        return parse_progress(raw)
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    if not text.startswith(_EVENT_PREFIX):
        return parse_progress(text)
    inner = _event_inner_text(text)
    if inner is not None:
        # Decode only the nested document and keep its text as the raw progress: one decode
        # per event, and nothing serialised again.
        try:
            doc = _loads(inner)
        except ProgressParseError:
            doc = None
        if isinstance(doc, Mapping):
            return _snapshot(doc, inner)
    # Any other shape (more keys, a non-object "progress", broken text): decode it whole.
    event = _loads(text)
    if isinstance(event, Mapping) and isinstance(event.get("progress"), Mapping):
        return parse_progress(event["progress"])
    if isinstance(event, Mapping):
        return parse_progress(event)
    return _snapshot(event, text)


def _event_inner_text(text: str) -> str | None:
    """The text of the value of ``{"progress": <value>}``, or None when ``text`` has another shape.

    Only the shape is checked: the caller decodes the value, and falls back to decoding the whole
    event when it is not one JSON object.
    """
    colon = _EVENT_COLON.match(text, len(_EVENT_PREFIX))
    body = text.rstrip(_JSON_SPACE)
    if colon is None or not body.endswith("}"):
        return None
    return body[colon.end() : -1].strip(_JSON_SPACE)


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProgressParseError(f"progress is not valid JSON ({exc.__class__.__name__})") from None


def _snapshot(doc: Any, raw_json: str) -> ProgressSnapshot:
    if not isinstance(doc, Mapping):
        raise ProgressParseError("progress is not a JSON object")

    query_id = _as_str(doc.get("id"))
    run_id = _as_str(doc.get("runId"))
    batch_id = _as_int(doc.get("batchId"))
    if not query_id or not run_id or batch_id is None or batch_id < 0:
        raise ProgressParseError("progress lacks id, runId or batchId")
    # Ids are kept whole (a cut or a mask could make two queries one); they only need to be
    # valid UTF-8.
    query_id, run_id = valid_utf8(query_id), valid_utf8(run_id)

    event_time = doc.get("eventTime")
    if not isinstance(event_time, Mapping):
        event_time = {}
    durations = doc.get("durationMs")
    durations_seconds: dict[str, float] = {}
    if isinstance(durations, Mapping):
        for key, value in durations.items():
            ms = _as_float(value)
            if ms is not None and ms >= 0:
                durations_seconds[_key(key)] = ms / 1000.0
    batch_duration_ms = _as_float(doc.get("batchDuration"))
    sink = doc.get("sink")
    if not isinstance(sink, Mapping):
        sink = {}
    sink_rows = _as_int(sink.get("numOutputRows"))

    return ProgressSnapshot(
        query_id=query_id,
        run_id=run_id,
        name=clean_name(_as_str(doc.get("name"))),
        batch_id=batch_id,
        timestamp_at=parse_timestamp(doc.get("timestamp")),
        batch_duration_seconds=(
            batch_duration_ms / 1000.0
            if batch_duration_ms is not None and batch_duration_ms >= 0
            else None
        ),
        durations_seconds=durations_seconds,
        watermark_at=parse_timestamp(event_time.get("watermark")),
        event_time_max_at=parse_timestamp(event_time.get("max")),
        event_time_min_at=parse_timestamp(event_time.get("min")),
        event_time_avg_at=parse_timestamp(event_time.get("avg")),
        input_rows=_as_nonneg_int(doc.get("numInputRows")),
        input_rows_per_second=_as_nonneg_float(doc.get("inputRowsPerSecond")),
        processed_rows_per_second=_as_nonneg_float(doc.get("processedRowsPerSecond")),
        operators=_parse_operators(doc.get("stateOperators")),
        sources=_parse_sources(doc.get("sources")),
        sink_description=_description(sink.get("description")) or None,
        sink_output_rows=sink_rows if sink_rows is not None and sink_rows >= 0 else None,
        raw_json=clean_json(doc, raw_json),
    )


def _seconds_between(later: datetime | None, earlier: datetime | None) -> float | None:
    if later is None or earlier is None:
        return None
    return (later - earlier).total_seconds()


def _parse_operators(value: Any) -> tuple[OperatorProgress, ...]:
    if not isinstance(value, list):
        return ()
    operators = []
    for index, item in enumerate(value):
        if not isinstance(item, Mapping):
            continue
        custom = item.get("customMetrics")
        custom_metrics: dict[str, float] = {}
        if isinstance(custom, Mapping):
            for key, metric in custom.items():
                number = _as_float(metric)
                if number is not None:
                    custom_metrics[_key(key)] = number
        instances = _as_nonneg_int(item.get("numStateStoreInstances"))
        dropped = _as_nonneg_int(item.get("numRowsDroppedByWatermark"))
        operators.append(
            OperatorProgress(
                operator_id=index,
                name=_cleaned(_as_str(item.get("operatorName")) or "unknown", _MAX_NAME_CHARS),
                rows_total=_as_nonneg_int(item.get("numRowsTotal")),
                rows_updated=_as_nonneg_int(item.get("numRowsUpdated")),
                rows_removed=_as_nonneg_int(item.get("numRowsRemoved")),
                # an operator that did not run counted nothing (see OperatorProgress.ran)
                rows_dropped_by_watermark=None if instances == 0 else dropped,
                memory_used_bytes=_as_nonneg_int(item.get("memoryUsedBytes")),
                shuffle_partitions=_as_nonneg_int(item.get("numShufflePartitions")),
                state_store_instances=instances,
                custom_metrics=custom_metrics,
            )
        )
    return tuple(operators)


def _parse_sources(value: Any) -> tuple[SourceProgress, ...]:
    if not isinstance(value, list):
        return ()
    sources = []
    for index, item in enumerate(value):
        if not isinstance(item, Mapping):
            continue
        description = _description(item.get("description"))
        sources.append(
            SourceProgress(
                index=index,
                description=description,
                start_offset=_offset(item.get("startOffset")),
                end_offset=_offset(item.get("endOffset")),
                latest_offset=_offset(item.get("latestOffset")),
                input_rows=_as_nonneg_int(item.get("numInputRows")),
                input_rows_per_second=_as_nonneg_float(item.get("inputRowsPerSecond")),
                processed_rows_per_second=_as_nonneg_float(item.get("processedRowsPerSecond")),
                kafka_partitions=_kafka_partitions(item) if description.startswith("Kafka") else (),
            )
        )
    return tuple(sources)


# Partitions kept per Kafka source: a topic with thousands of partitions must not make every
# snapshot (and every scrape) that large.
_MAX_KAFKA_PARTITIONS = 1000


def _kafka_partitions(item: Mapping[str, Any]) -> tuple[KafkaPartition, ...]:
    """A Kafka source's offsets per partition: ``{"topic": {"0": 1234, ...}}`` (the shape of its
    ``endOffset`` and ``latestOffset``, also as text); () for any other shape."""
    end = _offset_map(item.get("endOffset"))
    latest = _offset_map(item.get("latestOffset"))
    partitions = [
        KafkaPartition(topic, partition, offset, latest.get((topic, partition)))
        for (topic, partition), offset in sorted(end.items())
    ]
    return tuple(partitions[:_MAX_KAFKA_PARTITIONS])


def _offset_map(value: Any) -> dict[tuple[str, int], int]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return {}
    if not isinstance(value, Mapping):
        return {}
    offsets: dict[tuple[str, int], int] = {}
    for topic, by_partition in value.items():
        if not isinstance(topic, str) or not isinstance(by_partition, Mapping):
            continue
        name = _cleaned(topic, _MAX_NAME_CHARS)
        for partition, offset in by_partition.items():
            number = _as_nonneg_int(offset)
            index = _as_nonneg_int(partition)
            if number is not None and index is not None:
                offsets[(name, index)] = number
    return offsets


# Cleaned names by (text, limit): emptied when full, so its size stays bounded whatever the names.
_CLEANED: dict[tuple[str, int], str] = {}
_MAX_CLEANED = 4096


def _cleaned(text: str, limit: int) -> str:
    """``clean(text, limit)`` for the text that comes again in every progress of a query (its
    name, its operators', sources' and metrics' names): cleaned once, then looked up, so that
    cleaning every field costs the worker next to nothing."""
    key = (text, limit)
    cleaned = _CLEANED.get(key)
    if cleaned is None:
        if len(_CLEANED) >= _MAX_CLEANED:
            _CLEANED.clear()
        cleaned = _CLEANED[key] = clean(text, limit)
    return cleaned


def _offset(value: Any) -> str | None:
    # Offsets are kept whole: a source's offsets (one per Kafka partition) can be long.
    if value is None:
        return None
    return clean(value if isinstance(value, str) else _dumps(value))


def _description(value: Any) -> str:
    return _cleaned(_as_str(value) or "", _MAX_DESCRIPTION_CHARS)


def _key(key: Any) -> str:
    """The name of a duration phase (an exported label value) or of a custom metric."""
    return _cleaned(str(key), _MAX_NAME_CHARS)


def _dumps(value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True, default=str, allow_nan=False)
    except (ValueError, TypeError):
        return json.dumps(str(value))


def _as_str(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return str(value)
    return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return None
    else:
        return None
    if math.isnan(number) or math.isinf(number):
        return None
    return number


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    number = _as_float(value)
    if number is None or not number.is_integer():
        return None
    return int(number)


def _as_nonneg_int(value: Any) -> int | None:
    number = _as_int(value)
    return number if number is not None and number >= 0 else None


def _as_nonneg_float(value: Any) -> float | None:
    number = _as_float(value)
    return number if number is not None and number >= 0 else None
