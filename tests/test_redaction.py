"""Redaction: every form of credential the OWASP logging cheat sheet keeps out of logs is masked
in text, in progress JSON (value by value, so the document stays whole), in log lines and in the
JVM; a batch whose progress JSON cannot be kept is still recorded, and counted."""

from __future__ import annotations

import ast
import importlib
import json
import logging
import pkgutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import duckdb
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

import wmwatch
from tests.harness.handmade import plain_secret_keys, progress
from tests.scripts.safety_support import NoQueriesSession
from wmwatch._progress import clean_name, parse_progress, parse_progress_event
from wmwatch._store.writer import HistoryStore
from wmwatch._text import (
    _REDACTING,
    _SECRET_NAME,
    REDACTED,
    _apply_rules,
    clean,
    clean_json,
    error_line,
    get_logger,
    is_secret_name,
    may_be_redacted,
    printable,
    redact,
    redact_json,
)

SECRET = "hunter2"

# (text, what must be left of it): every form the security review found unmasked, and the
# ones masked before.
FORMS = [
    ('password="hunter2"', 'password="***"'),
    ("password='hunter2'", "password='***'"),
    ('orders password="hunter2\\"x"', 'orders password="***"'),
    ('password="hunter2', 'password="***'),  # cut before its closing quote
    ('{"password": "hunter2"}', '{"password": "***"}'),
    ("{'db_password': 'hunter2'}", "{'db_password': '***'}"),
    ('{\\"password\\": \\"hunter2\\"}', '{\\"password\\": \\"***\\"}'),  # JSON inside JSON
    ('"pass\\u0077ord": "hunter2"', '"password": "***"'),
    ("pass\\u0077ord=hunter2", "password=***"),
    ("fs.s3a.secret.key=hunter2/cd+ef", "fs.s3a.secret.key=***"),
    ("s3a://AKIAFAKE:hunter2/XUtn+F@bucket/x", "s3a://***@bucket/x"),
    ("s3a://AKIAFAKE:hunter2@bucket/x", "s3a://***@bucket/x"),
    (
        "https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIA/2026&X-Amz-Signature=hunter2",
        "https://b.s3.amazonaws.com/k?X-Amz-Credential=***&X-Amz-Signature=***",
    ),
    ("?sv=2024&se=2026&Signature=hunter2", "?sv=2024&se=2026&Signature=***"),
    ("?sv=2024&sig=hunter2&sp=r", "?sv=2024&sig=***&sp=r"),
    (
        "spark.hadoop.fs.azure.account.key.myacct.blob.core.windows.net=hunter2==",
        "spark.hadoop.fs.azure.account.key.myacct.blob.core.windows.net=***",
    ),
    ("fs.azure.sas.c.a.dfs.core.windows.net=hunter2", "fs.azure.sas.c.a.dfs.core.windows.net=***"),
    ("Authorization: Bearer hunter2.abc-def", "Authorization: ***"),
    ("Authorization: Basic aHVudGVyMg==", "Authorization: ***"),
    ("the header was Bearer hunter2.abc", "the header was Bearer ***"),
    ("passphrase=hunter2", "passphrase=***"),
    ("ssl.key.password: hunter2", "ssl.key.password: ***"),
    ("jdbc:sqlserver://h;user=sa;password=hunter2@x;db=y", "jdbc:sqlserver://h;user=sa;password=***;db=y"),
    ("JSESSIONID=hunter2", "JSESSIONID=***"),
    ("api_key: hunter2", "api_key: ***"),
    ("token=hunter2&x=1", "token=***&x=1"),
]  # fmt: skip


@pytest.mark.parametrize(("text", "masked"), FORMS, ids=[f[0][:40] for f in FORMS])
def test_every_form_of_credential_is_masked(text: str, masked: str) -> None:
    assert redact(text) == masked
    assert redact(masked) == masked  # masking twice changes nothing
    name = clean_name(text)
    assert name is not None and SECRET not in name


@pytest.mark.parametrize("text", ["orders_per_minute", "FileStreamSource[file:/data/in]", "a=b"])
def test_text_without_credentials_is_left_as_it_is(text: str) -> None:
    assert redact(text) == text


@pytest.mark.parametrize(("text", "masked"), FORMS, ids=[f[0][:40] for f in FORMS])
def test_every_form_is_masked_in_a_parsed_progress_document(text: str, masked: str) -> None:
    doc = {
        "id": "q",
        "runId": "r",
        "batchId": 3,
        "name": text,
        "numInputRows": 5,
        "sources": [{"description": f"Kafka[{text}]", "numInputRows": 5}],
        "sink": {"description": text},
    }
    for ascii_json in (True, False):
        snap = parse_progress_event(json.dumps({"progress": doc}, ensure_ascii=ascii_json))
        assert snap.raw_json is not None and SECRET not in snap.raw_json
        kept = json.loads(snap.raw_json)  # still one JSON document
        assert (kept["id"], kept["batchId"], kept["numInputRows"]) == ("q", 3, 5)
        assert kept["name"] == snap.name == redact(text)
        assert SECRET not in snap.sources[0].description


def test_json_values_are_masked_by_key_whatever_they_hold() -> None:
    doc = {
        "id": "q",
        "runId": "r",
        "batchId": 0,
        "options": {
            "pass\u0077ord": 'hunter2"\\',  # a value that ends in an escaped quote and backslash
            "fs.s3a.secret.key": "ab/hunter2+ef",
            "apiKey": 123456,
            "tokens": ["hunter2", "hunter2"],
            "kafka.bootstrap.servers": "broker:9092",
            "enabled": True,
        },
    }
    text = json.dumps(doc)  # ASCII JSON: the key's letters stay escaped in the raw text
    text = text.replace('"password"', '"pass\\u0077ord"')
    snap = parse_progress(text)
    assert snap.raw_json is not None and SECRET not in snap.raw_json
    options = json.loads(snap.raw_json)["options"]
    assert options == {
        "password": REDACTED,
        "fs.s3a.secret.key": REDACTED,
        "apiKey": REDACTED,
        "tokens": [REDACTED, REDACTED],
        "kafka.bootstrap.servers": "broker:9092",
        "enabled": True,
    }


def test_a_document_without_secrets_is_kept_byte_for_byte() -> None:
    text = '{"id":"q","runId":"r","batchId":1,"durationMs":{"addBatch":5},"name":"plain"}'
    assert parse_progress(text).raw_json == text


# -- property: the masked document parses, DuckDB takes it, and nothing else changes ---------

_SECRET_KEY_EXAMPLES = ["password", "fs.s3a.secret.key", "X-Amz-Signature", "passphrase", "apiKey"]
_SECRET_VALUES = [form for form, _ in FORMS]
# keys that name no secret: letters that spell no stem, and a few of Spark's own
_plain_keys = st.text(alphabet="abcxyz_ ", max_size=6) | st.sampled_from(
    ["numInputRows", "description", "eventTime", "watermark", "customMetrics"]
)
_plain_text = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters="\\@:/=\"'"), max_size=10
).filter(lambda s: redact(s) == s)
_leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _plain_text
    | st.sampled_from(_SECRET_VALUES)
)
_documents = st.recursive(
    _leaves,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(_plain_keys | st.sampled_from(_SECRET_KEY_EXAMPLES), inner, max_size=4)
    ),
    max_leaves=25,
)


def _assert_kept(original: Any, kept: Any) -> None:
    """Every field that is no secret is kept as it was, cleaned (no control characters); every
    secret is masked."""
    if isinstance(original, dict):
        assert isinstance(kept, dict) and set(kept) == {clean(k) for k in original}
        for key, value in original.items():
            if is_secret_name(key):
                assert SECRET not in json.dumps(kept[key])
            else:
                _assert_kept(value, kept[key])
    elif isinstance(original, list):
        assert isinstance(kept, list) and len(kept) == len(original)
        for value, masked in zip(original, kept, strict=True):
            _assert_kept(value, masked)
    elif isinstance(original, str):
        assert kept == clean(original) and SECRET not in kept
    else:
        assert kept == original


_duck = duckdb.connect()


@settings(max_examples=300, deadline=None)
@given(body=_documents, ascii_json=st.booleans())
def test_masked_progress_json_parses_and_keeps_every_other_field(
    body: Any, ascii_json: bool
) -> None:
    doc = {"id": "q", "runId": "r", "batchId": 1, "extra": body}
    text = json.dumps(doc, ensure_ascii=ascii_json)
    out = clean_json(json.loads(text), text)
    assert out is not None
    out.encode("utf-8")
    assert SECRET not in out
    kept = json.loads(out)
    assert (kept["id"], kept["runId"], kept["batchId"]) == ("q", "r", 1)
    _assert_kept(body, kept["extra"])
    assert _duck.execute("SELECT json_valid(?::JSON)", [out]).fetchone() == (True,)
    # the snapshot keeps the same document
    assert parse_progress(text).raw_json == out


def test_non_finite_numbers_and_lone_surrogates_become_valid_json() -> None:
    text = '{"id":"q","runId":"r","batchId":1,"rate":NaN,"x":Infinity,"s":"a\\ud800b"}'
    out = parse_progress(text).raw_json
    assert out is not None
    assert json.loads(out) == {
        "id": "q", "runId": "r", "batchId": 1, "rate": None, "x": None, "s": "a?b"
    }  # fmt: skip
    assert _duck.execute("SELECT ?::JSON IS NOT NULL", [out]).fetchone() == (True,)


def test_a_document_too_deep_to_serialise_is_none_not_an_exception() -> None:
    deep: Any = "password=hunter2"
    for _ in range(5000):
        deep = [deep]
    assert clean_json(deep, "[...password...]") is None
    nested = {"password": {"nested": [1, "x", None]}}
    assert redact_json(nested) == {"password": {"nested": [REDACTED, REDACTED, None]}}


# -- the store never loses a batch for its JSON ------------------------------------------------


def test_a_batch_whose_progress_json_cannot_be_kept_is_still_recorded_and_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "history.duckdb"
    refused = replace(progress(0), raw_json='{"name": "a\\"')  # DuckDB refuses this JSON
    missing = replace(progress(1), raw_json=None)  # could not be serialised at all
    fine = progress(2)
    registry = CollectorRegistry()
    with (
        caplog.at_level(logging.ERROR, logger="wmwatch.store"),
        wmwatch.attach(
            NoQueriesSession(),
            db=str(db),
            metrics_port=None,
            registry=registry,
            listener="stock",
            retention_days=None,  # the batches are dated long ago: keep them
        ) as watch,
    ):
        assert watch.store is not None
        for snap in (refused, missing, fine):
            watch.store.record_progress(snap)
        assert watch.store.flush(timeout=30)
        health = watch.store.health
        exported = registry.get_sample_value("wmwatch_store_progress_json_missing_total")
    assert health.progress_json_missing_total == 2 and exported == 2
    assert health.errors_total == 0
    with duckdb.connect(str(db), read_only=True) as con:
        rows = con.execute(
            "SELECT batch_id, input_rows, progress_json IS NULL FROM batches ORDER BY batch_id"
        ).fetchall()
        operators = con.execute("SELECT count(DISTINCT batch_id) FROM operators").fetchone()
    assert rows == [(0, 10, True), (1, 10, True), (2, 10, False)]
    assert operators == (3,)
    lines = [r for r in caplog.records if "without its progress JSON" in r.getMessage()]
    assert len(lines) == 1, lines  # one line, not one per batch


def test_a_store_without_wmwatch_attach_counts_too(tmp_path: Path) -> None:
    with HistoryStore(tmp_path / "h.duckdb", flush_interval_seconds=0.05) as store:
        store.record_progress(replace(progress(0), raw_json='{"broken'))
        assert store.flush(timeout=30)
        assert store.health.progress_json_missing_total == 1


# -- log lines ----------------------------------------------------------------------------------


def _logger_names() -> set[str]:
    """Every logger name wmwatch's modules log through, read off their source."""
    root = Path(wmwatch.__file__).parent
    names: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", None))
                in ("getLogger", "get_logger")
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                names.add(str(node.args[0].value))
    return names


def test_every_wmwatch_logger_redacts() -> None:
    for module in pkgutil.walk_packages(wmwatch.__path__, "wmwatch."):
        importlib.import_module(module.name)
    names = _logger_names()
    assert {"wmwatch", "wmwatch.audit", "wmwatch.store"} <= names
    for name in names:
        assert _REDACTING in logging.getLogger(name).filters, name


def test_log_lines_and_tracebacks_are_redacted(caplog: pytest.LogCaptureFixture) -> None:
    log = get_logger("wmwatch.audit")
    with caplog.at_level(logging.INFO, logger="wmwatch.audit"):
        log.warning("audit of %s failed: %s", 'orders password="hunter2\\"x"', "token=hunter2")
        try:
            raise RuntimeError("cannot open s3a://AKIA:hunter2/x@bucket/in")
        except RuntimeError:
            log.exception("replay failed")
    assert len(caplog.records) == 2
    assert SECRET not in caplog.text
    assert 'password="***"' in caplog.text and "s3a://***@bucket/in" in caplog.text
    formatted = logging.Formatter().format(caplog.records[1])
    assert "RuntimeError" in formatted and SECRET not in formatted


def test_error_lines_are_redacted() -> None:
    line = error_line(ValueError('bad option password="hunter2\\"x" for Authorization: Bearer x'))
    assert SECRET not in line and 'password="***"' in line


# -- the same rules in the JVM --------------------------------------------------------------


@pytest.mark.spark
def test_spark_redact_cleans_exactly_as_clean(spark: Any) -> None:
    from pyspark.sql import functions as F

    from wmwatch._text import spark_redact

    texts = [t for t, _ in FORMS if "\\u" not in t] + [
        "/data/in/password=hunter2/a.json",
        "/data/in/plain/late[1].json",
        "s3a://bucket/keys/day=1/a.json",
        "/data/API_KEY=abc/x.json",
        "/data/in/date=2026-01-01/part-0.json",
        "/tmp/ſecret=hunter2/x.json",
        "/data/in/\x1b[2J\x1b]0;title\x07/\x9b31mred\r.json",
    ]
    frame = spark.createDataFrame([(t,) for t in texts], "t string")
    got = [r[0] for r in frame.select(spark_redact(F.col("t"))).collect()]
    assert got == [clean(t) for t in texts]
    assert not any(SECRET in g for g in got)


# secret key names in any case and with any separator
_SECRET_KEY_FORMS = [
    "password", "PASSWORD", "PassWd", "passphrase", "PWD", "Pwd", "secret", "Token",
    "access_key", "Secret-Key", "privatekey", "session.token", "SeSsIoN_Id", "apiKey", "API-KEY",
    "account.key.a1", "SAS", "sas.c1", "sig", "Sig", "Signature", "Credential", "credentials",
    "Authorization",
]  # fmt: skip
# texts the JVM's rules might change: pieces of every form above, of secret key names,
# schemes, user info and headers, glued by path and option punctuation
_RULE_PIECES = [
    *(form for form, _ in FORMS if "\\u" not in form),
    *_SECRET_KEY_EXAMPLES,
    *_SECRET_KEY_FORMS,
    "s3a://", "user:pw@", "@", "Bearer ", "BEARER\t", "=", ":", " : ", "'", '"', "/", ".json",
    "data", "in", "\x1b", "\x9b", "\x7f", "\u017f", "\u212a", "\t", "\n",
]  # fmt: skip
_KEY_VALUES = st.tuples(
    st.sampled_from(_SECRET_KEY_FORMS),
    st.sampled_from(["=", ":", " = ", '"=', "':", "\t:"]),
    st.sampled_from(["hunter2", '"x"', "'y'", "Bearer z"]),
).map("".join)


@pytest.mark.parametrize("key", plain_secret_keys())
def test_every_secret_key_is_one_the_jvm_checks(key: str) -> None:
    # a key added to SECRET_KEYS without a word of _KEY_WORDS would pass the JVM unmasked
    for spelled in (key, key.upper(), key.title()):
        text = f"/data/{spelled}=hunter2/a.json"
        assert _apply_rules(text) != text and may_be_redacted(text), spelled


@settings(max_examples=400, deadline=None)
@given(
    pieces=st.lists(st.sampled_from(_RULE_PIECES) | _KEY_VALUES | st.text(max_size=4), max_size=8)
)
def test_a_text_the_jvm_leaves_unchecked_is_one_no_rule_changes(pieces: list[str]) -> None:
    # spark_redact skips its regular expressions where may_be_redacted is False: for such a
    # text the rules and the control-character filter must both be no-ops
    text = "".join(pieces)
    if not may_be_redacted(text):
        assert printable(_apply_rules(text)) == text


@pytest.mark.parametrize(
    "hostile",
    [
        "a://b:" * 20_000,
        "password" * 15_000,
        "account.key" + ".a" * 50_000,
        "s3a://x:" + "y" * 100_000,
        'password="' + "\\x" * 50_000,
        "\\u0070" * 20_000,
    ],
    ids=["schemes", "keys", "azure-key", "userinfo", "open-quote", "escapes"],
)
def test_hostile_text_is_masked_in_linear_time(hostile: str) -> None:
    # ~100 kB: a quadratic pattern takes tens of seconds here, the linear ones well under one
    started = time.perf_counter()
    redact(hostile)
    assert time.perf_counter() - started < 5.0


@settings(max_examples=300, deadline=None)
@given(name=st.text(max_size=30) | st.sampled_from(_SECRET_KEY_EXAMPLES).map(lambda k: "x." + k))
def test_the_fast_secret_name_check_agrees_with_the_pattern(name: str) -> None:
    assert is_secret_name(name) == (_SECRET_NAME.search(name) is not None)
