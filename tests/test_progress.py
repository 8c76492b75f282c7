"""The progress parser: one recorded document, partial and malformed ones, and fuzzing."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.harness.handmade import plain_secret_keys
from wmwatch import ProgressParseError, parse_progress
from wmwatch._events import parse_started, parse_terminated
from wmwatch._progress import clean_name, parse_progress_event, query_label
from wmwatch._text import _mask, redact
from wmwatch._time import EPOCH, parse_timestamp

FIXTURE = Path(__file__).parent / "fixtures" / "progress_window.json"


def minimal(**extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {"id": "q1", "runId": "r1", "batchId": 0}
    doc.update(extra)
    return doc


def test_recorded_progress_becomes_typed_snapshot() -> None:
    snap = parse_progress(FIXTURE.read_text())
    assert snap.label == "orders_per_minute"
    assert snap.batch_id == 7
    assert snap.watermark_at == datetime(2026, 1, 1, 0, 1, 40, tzinfo=UTC)
    assert snap.event_time_min_at == datetime(2026, 1, 1, 0, 0, 30, tzinfo=UTC)
    assert snap.watermark_lag_seconds == 20.0
    assert snap.event_time_delay_seconds == 10.0
    assert snap.event_time_spread_seconds == 80.0
    assert snap.batch_duration_seconds == pytest.approx(0.341)
    assert snap.durations_seconds["addBatch"] == pytest.approx(0.177)
    (op,) = snap.operators
    assert (op.operator_id, op.name, op.rows_total, op.rows_dropped_by_watermark) == (
        0,
        "stateStoreSave",
        4,
        1,
    )
    assert op.custom_metrics["stateOnCurrentVersionSizeBytes"] == 408
    (source,) = snap.sources
    assert source.end_offset == '{"logOffset": 7}'
    assert snap.sink_output_rows == 2


def test_credentials_in_source_descriptions_are_redacted_everywhere() -> None:
    snap = parse_progress(FIXTURE.read_text())
    assert "wJalrSECRET" not in snap.sources[0].description
    assert "wJalrSECRET" not in snap.raw_json
    assert "s3a://***@bucket/orders" in snap.sources[0].description


def test_no_event_time_means_no_watermark_figures() -> None:
    snap = parse_progress(minimal(eventTime={}, stateOperators=[]))
    assert snap.watermark_at is None
    assert snap.watermark_lag_seconds is None
    assert snap.event_time_delay_seconds is None
    assert snap.operators == ()


def test_epoch_watermark_is_reported_as_not_yet_set() -> None:
    snap = parse_progress(
        minimal(
            timestamp="2026-01-01T00:00:00.000Z",
            eventTime={"watermark": "1970-01-01T00:00:00.000Z"},
        )
    )
    assert snap.watermark_at == EPOCH
    assert not snap.has_watermark
    assert snap.watermark_lag_seconds is None


def test_unknown_fields_and_wrong_types_are_ignored_not_fatal() -> None:
    snap = parse_progress(
        minimal(
            numInputRows="many",
            batchDuration=-5,
            durationMs={"addBatch": "x", "getBatch": 3},
            stateOperators=[{"operatorName": 5, "numRowsTotal": 1.5}, "junk"],
            sources="nope",
            futureField={"a": [1, 2]},
            eventTime={"watermark": "not a time", "max": 12},
        )
    )
    assert snap.input_rows is None
    assert snap.batch_duration_seconds is None
    assert snap.durations_seconds == {"getBatch": 0.003}
    assert len(snap.operators) == 1 and snap.operators[0].rows_total is None
    assert snap.sources == ()
    assert snap.watermark_at is None and snap.event_time_max_at is None


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "{",
        "[1,2]",
        "null",
        '{"id": "q"}',
        '{"id": "q", "runId": "r", "batchId": -1}',
        '{"id": "q", "runId": "r", "batchId": "seven"}',
    ],
)
def test_documents_without_batch_identity_are_refused_with_a_clear_error(raw: str) -> None:
    with pytest.raises(ProgressParseError, match="progress"):
        parse_progress(raw)


def test_timestamps_parse_with_and_without_zone() -> None:
    assert parse_timestamp("2026-03-01T10:00:00.123Z") == datetime(
        2026, 3, 1, 10, 0, 0, 123000, tzinfo=UTC
    )
    assert parse_timestamp("2026-03-01T10:00:00") == datetime(2026, 3, 1, 10, tzinfo=UTC)
    assert parse_timestamp("") is None
    assert parse_timestamp(None) is None


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)

timestamps = st.one_of(
    st.datetimes(min_value=datetime(1, 1, 1), max_value=datetime(9999, 12, 31)).map(
        lambda d: d.isoformat() + "Z"
    ),
    st.text(max_size=30),
)


@settings(max_examples=300, deadline=None)
@given(
    batch=st.one_of(
        st.integers(min_value=-(2**70), max_value=2**70), st.floats(allow_nan=True), st.text()
    ),
    name=st.one_of(st.none(), st.text(max_size=500)),
    event_time=st.dictionaries(st.sampled_from(["watermark", "max", "min", "avg"]), timestamps),
    operators=st.lists(st.dictionaries(st.text(max_size=20), json_values, max_size=6), max_size=3),
    junk=json_values,
)
def test_fuzzed_documents_parse_or_fail_cleanly(
    batch: Any, name: Any, event_time: Any, operators: Any, junk: Any
) -> None:
    doc = {
        "id": "q",
        "runId": "r",
        "batchId": batch,
        "name": name,
        "eventTime": event_time,
        "stateOperators": operators,
        "junk": junk,
    }
    text = json.dumps(doc, allow_nan=True)
    for raw in (text, text[: len(text) // 2]):
        try:
            snap = parse_progress(raw)
        except ProgressParseError:
            continue
        for value in (
            snap.watermark_lag_seconds,
            snap.event_time_spread_seconds,
            snap.event_time_delay_seconds,
        ):
            assert value is None or math.isfinite(value)
        assert len(snap.label) <= 200


# ----------------------------------------------------------------------------- listener events


def _decoded_then_parsed(event: str) -> Any:
    """The reference: decode the whole event, take the nested mapping, parse that."""
    try:
        doc = json.loads(event)
    except (ValueError, RecursionError):
        return ProgressParseError
    if isinstance(doc, dict) and isinstance(doc.get("progress"), dict):
        doc = doc["progress"]
    try:
        return parse_progress(doc)
    except ProgressParseError:
        return ProgressParseError


def _fields(snap: Any) -> Any:
    """A snapshot's parsed fields, NaN-safe (the raw text is compared on its own)."""
    if snap is ProgressParseError:
        return snap
    return repr([getattr(snap, name) for name in snap.__slots__ if name != "raw_json"])


def test_a_listener_event_keeps_the_progress_text_as_spark_wrote_it() -> None:
    progress_text = json.dumps(json.loads(FIXTURE.read_text()), separators=(",", ":"))
    event = '{"progress":' + progress_text + "}"  # QueryProgressEvent.json()
    snap = parse_progress_event(event)
    assert _fields(snap) == _fields(parse_progress(progress_text))
    # the stored raw progress is the nested document itself, with the credential masked
    assert snap.raw_json == progress_text.replace("AKIAEXAMPLE:wJalrSECRET@", "***@")
    assert json.loads(snap.raw_json)["batchId"] == 7


@pytest.mark.parametrize(
    "event",
    [
        '{"progress" : {"id": "q", "runId": "r", "batchId": 3} }\n',
        '{"progress":{"id":"q","runId":"r","batchId":3},"extra":1}',  # more keys: decoded whole
        '{"progress":{"id":"q","runId":"r","batchId":3},"progress":{"id":"q","runId":"r","batchId":4}}',
        '{"progress":[{"id":"q","runId":"r","batchId":3}]}',
        '{"progress":{"id":"q","runId":"r","batchId":3}',
        '{"progress":{"id":"q","runId":"r","batchId":3}}\x0c',
        '{"progress":{"id":"q","runId":"r","batchId":NaN}}',
        '{"progress":{"id":"q","runId":"r","batchId":3,"name":"\\ud800"}}',
        '{"progress":{"id":"q","runId":"r","batchId":1180591620717411303424}}',
        '{"progress":}',
        '{"progress"',
        '{"progressive":{"id":"q","runId":"r","batchId":3}}',
        '{"id":"q","runId":"r","batchId":3}',
    ],
)
def test_unusual_listener_events_parse_as_if_decoded_whole(event: str) -> None:
    try:
        snap: Any = parse_progress_event(event)
    except ProgressParseError:
        snap = ProgressParseError
    assert _fields(snap) == _fields(_decoded_then_parsed(event))


@settings(max_examples=300, deadline=None)
@given(
    doc=st.dictionaries(
        st.sampled_from(["id", "runId", "batchId", "name", "eventTime", "sources", "sink", "x"]),
        json_values,
    ),
    spacing=st.sampled_from([(",", ":"), (", ", ": ")]),
    cut=st.sampled_from([None, None, 0.5, 0.9]),
)
def test_fuzzed_listener_events_parse_as_if_decoded_whole(
    doc: dict[str, Any], spacing: tuple[str, str], cut: float | None
) -> None:
    doc.setdefault("id", "q")
    doc.setdefault("runId", "r")
    doc.setdefault("batchId", 1)
    event = json.dumps({"progress": doc}, separators=spacing, allow_nan=True)
    if cut is not None:
        event = event[: int(len(event) * cut)]
    try:
        snap: Any = parse_progress_event(event)
    except ProgressParseError:
        snap = ProgressParseError
    assert _fields(snap) == _fields(_decoded_then_parsed(event))


# ----------------------------------------------------------------------------- redaction


@pytest.mark.parametrize("key", plain_secret_keys())
def test_every_secret_key_is_masked_in_parsed_progress(key: str) -> None:
    for spelled in (key, key.upper(), key.replace("s", "ſ"), key.replace("k", "\u212a")):
        doc = minimal(sources=[{"description": f"Kafka[{spelled}=hunter2]"}])
        snap = parse_progress(json.dumps(doc))
        assert "hunter2" not in snap.sources[0].description, spelled
        assert snap.raw_json is not None and "hunter2" not in snap.raw_json, spelled


@settings(max_examples=400, deadline=None)
@given(
    text=st.lists(
        st.sampled_from(
            [
                *plain_secret_keys(),
                "=",
                ": ",
                "@",
                "://",
                "s3a://u:p@h/",
                "ſ",
                "\u212a",
                "İ",
                "ı",
                "PassWord",
                "x",
                " ",
                '"',
                "'",
                "\\",
                '\\"',
                "\\u0077",
                "\\u0070ass",
                "Bearer ",
                "acct.",
                ",",
            ]
        )
        | st.text(max_size=6),
        max_size=12,
    ).map("".join)
)
def test_the_fast_redaction_path_agrees_with_the_redactor(text: str) -> None:
    assert redact(text) == _mask(text)


# ------------------------------------------------------------------------ clean at the boundary

# Credentials in shapes the redactor knows, lone surrogates, text past every length bound.
_DIRTY_PIECES = [
    '"',
    "\n",
    "\x00",
    "\ud800",
    "\udfff",
    "😀",
    "é",
    "=",
    "@",
    "://",
    "x" * 150,
    "password=hunter2",
    "s3a://AKIA:hunter2@bucket/p",
    "token: hunter2",
    "ſecret=hunter2",
]
dirty_text = st.lists(st.sampled_from(_DIRTY_PIECES), min_size=1, max_size=10).map(" ".join)


def _assert_clean(text: str | None, limit: int | None = None) -> None:
    if text is None:
        return
    text.encode("utf-8")  # raises on a lone surrogate
    assert "hunter2" not in text
    assert limit is None or len(text) <= limit


def _json_strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield key
            yield from _json_strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _json_strings(item)


@settings(max_examples=200, deadline=None)
@given(text=dirty_text, ascii_json=st.booleans(), nested=st.booleans())
def test_every_text_field_of_a_snapshot_is_clean(text: str, ascii_json: bool, nested: bool) -> None:
    doc = minimal(
        id="q\ud800",
        name=text,
        durationMs={text: 5},
        stateOperators=[{"operatorName": text, "customMetrics": {text: 1}}],
        sources=[{"description": text, "startOffset": text, "endOffset": {"k": text}}],
        sink={"description": text},
    )
    raw = json.dumps({"progress": doc} if nested else doc, ensure_ascii=ascii_json)
    snap = parse_progress_event(raw)
    snap.query_id.encode("utf-8")
    _assert_clean(snap.name, 200)
    assert snap.label == (snap.name or snap.query_id)  # a name of control characters is none
    for key in snap.durations_seconds:
        _assert_clean(key, 200)
    (op,) = snap.operators
    _assert_clean(op.name, 200)
    for key in op.custom_metrics:
        _assert_clean(key, 200)
    (source,) = snap.sources
    _assert_clean(source.description, 1000)
    _assert_clean(source.start_offset)
    assert source.end_offset is not None
    source.end_offset.encode("utf-8")  # JSON text: some letters of a key are \u escapes
    _assert_clean(snap.sink_description, 1000)
    # the raw document: valid UTF-8 JSON whatever the masks (a value that ends in an escaped
    # quote too), no escape in it decodes to a lone surrogate, and no secret in it
    assert snap.raw_json is not None
    snap.raw_json.encode("utf-8")
    for string in _json_strings(json.loads(snap.raw_json)):
        string.encode("utf-8")
    assert "hunter2" not in snap.raw_json


@settings(max_examples=200, deadline=None)
@given(name=dirty_text, exception=dirty_text, error_class=dirty_text)
def test_every_text_field_of_an_event_is_clean(name: str, exception: str, error_class: str) -> None:
    started = parse_started({"id": "q\ud800", "runId": "r", "name": name})
    started.query_id.encode("utf-8")
    _assert_clean(started.name, 200)
    assert started.label == (started.name or started.query_id)
    ended = parse_terminated(
        {"id": "q", "runId": "r", "exception": exception, "errorClassOnException": error_class}
    )
    _assert_clean(ended.exception, 20_000)
    _assert_clean(ended.error_class, 200)


@settings(max_examples=300, deadline=None)
@given(name=dirty_text | st.text(max_size=300))
def test_a_clean_name_stays_as_it_is(name: str) -> None:
    """Labels made from a snapshot's name equal the cleaned name of the raw document."""
    cleaned = clean_name(name)
    assert clean_name(cleaned) == cleaned
    assert query_label(name, "id") == (cleaned or "id")


def test_a_credential_cut_by_the_length_bound_is_still_masked() -> None:
    name = "n" * 195 + "password=hunter2"
    assert clean_name(name) == "n" * 195 + "passw"
    url = "x" * 190 + " s3a://AKIA:hunter2@bucket"
    assert "hunter" not in (clean_name(url) or "")


def test_an_operator_that_did_not_run_has_no_dropped_count() -> None:
    """Spark's progress of a batch run again after a restart that its file sink had already
    written (the sink skips it; seen on 4.3): the operator opened no state store and its 0 is
    no count. It is kept as unknown in the snapshot and the history, not as 0 dropped."""
    from wmwatch._store.rows import progress_rows

    skipped = {
        "operatorName": "sessionWindowStateStoreSaveExec",
        "numRowsTotal": 0,
        "numRowsDroppedByWatermark": 0,
        "numShufflePartitions": 1,
        "numStateStoreInstances": 0,
    }
    ran = {**skipped, "numRowsDroppedByWatermark": 4, "numStateStoreInstances": 1}
    now = datetime.now(UTC)
    for operator, dropped in ((skipped, None), (ran, 4)):
        snap = parse_progress(json.dumps(minimal(numInputRows=0, stateOperators=[operator])))
        assert snap.operators[0].rows_dropped_by_watermark == dropped
        assert snap.operators[0].ran is (dropped is not None)
        rows = progress_rows(snap, None, now)
        assert rows.batch.rows_dropped_by_watermark == dropped
        assert rows.operators[0].rows_dropped_by_watermark == dropped
