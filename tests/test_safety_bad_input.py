"""Bad input: hostile progress through the whole pipeline, and bad command lines.

The parser's own fuzz is in test_progress.py. Here random, truncated and hostile progress
documents go where Spark's would: into the py4j listener callback and through a real Watch's
queue and worker into the query book, the DuckDB history and a real /metrics endpoint scraped
over HTTP. Whatever comes in, the listener never raises, the worker survives, and the exposition
always parses with prometheus-client's own parser.
"""

from __future__ import annotations

import json
import math
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

import wmwatch
from tests.harness.net import free_port
from tests.scripts.safety_support import NoQueriesSession, progress_doc
from wmwatch._core.listener import Py4jListener
from wmwatch._store.schema import LATEST_VERSION
from wmwatch._store.writer import HistoryStore
from wmwatch.cli import app

# ----------------------------------------------------------------------------- strategies

# Text that breaks naive exposition or storage: quotes, backslashes, newlines, braces, NULs,
# lone surrogates (valid in JSON escapes, invalid in UTF-8), right-to-left marks, emoji.
HOSTILE_PIECES = [
    '"',
    "\\",
    "\n",
    "\r",
    "}",
    "{",
    "=",
    ",",
    "\x00",
    "\ud800",
    "\udfff",
    "\u202e",
    "😀",
    "# HELP x",
    "\\n",
    "password=hunter2",
    "s3a://AKIA:SECRET@bucket/p",
]
hostile_text = st.one_of(
    st.text(max_size=50),
    st.lists(st.sampled_from(HOSTILE_PIECES) | st.text(max_size=5), max_size=12).map("".join),
    st.text(
        alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF),
        min_size=1000,
        max_size=5000,
    ),
)
numbers = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 2**63 - 1, 2**63, 2**64, 1e308, -1e308, 5e-324]),
)
timestamps = st.one_of(
    st.sampled_from(
        [
            "1970-01-01T00:00:00.000Z",
            "1969-12-31T23:59:59.999Z",
            "0001-01-01T00:00:00.000Z",
            "9999-12-31T23:59:59.999Z",
            "2026-02-30T00:00:00Z",
            "2026-01-01T00:00:00+14:00",
            "",
            "Z",
            "now",
        ]
    ),
    st.datetimes().map(lambda d: d.isoformat() + "Z"),
    hostile_text,
)
scalars = st.one_of(st.none(), st.booleans(), numbers, hostile_text)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(hostile_text, inner, max_size=3),
    max_leaves=8,
)


def _mutated_operator(draw: Any) -> dict[str, Any]:
    op: dict[str, Any] = dict(progress_doc("x", 1)["stateOperators"][0])
    for key in draw(st.lists(st.sampled_from(sorted(op)), max_size=4)):
        op[key] = draw(json_values)
    if draw(st.booleans()):
        op["operatorName"] = draw(hostile_text)
    return op


@st.composite
def hostile_progress(draw: Any) -> str:
    """A progress document like Spark's, some fields replaced by hostile values, as JSON text."""
    query_id = draw(st.sampled_from(["fz-1", "fz-2"]) | hostile_text)
    doc: dict[str, Any] = progress_doc(str(query_id), 1)
    doc["id"] = query_id if draw(st.integers(0, 9)) else draw(json_values)
    doc["batchId"] = draw(st.integers(0, 50) | numbers | scalars)
    doc["name"] = draw(st.none() | hostile_text)
    doc["timestamp"] = draw(timestamps)
    doc["eventTime"] = draw(
        st.dictionaries(st.sampled_from(["watermark", "max", "min", "avg"]), timestamps)
        | json_values
    )
    for field in draw(
        st.lists(
            st.sampled_from(
                [
                    "numInputRows",
                    "inputRowsPerSecond",
                    "processedRowsPerSecond",
                    "batchDuration",
                    "durationMs",
                    "sink",
                    "runId",
                ]
            ),
            max_size=4,
        )
    ):
        doc[field] = draw(json_values)
    doc["stateOperators"] = [_mutated_operator(draw) for _ in range(draw(st.integers(0, 3)))]
    if draw(st.booleans()):
        doc["sources"][0]["description"] = draw(hostile_text)
        doc["sources"][0]["endOffset"] = draw(json_values)
    text = json.dumps(doc, allow_nan=True)
    cut = draw(st.sampled_from([None, None, None, 0.5, 0.9, 0.99]))
    if cut is not None:
        text = text[: int(len(text) * cut)]
    if draw(st.booleans()):
        text = '{"progress":' + text + "}"  # how QueryProgressEvent.json() nests it
    return text


class FakeJvmEvent:
    """What py4j hands the listener: an object whose json() is a JVM call (which can fail)."""

    def __init__(self, text: str | None) -> None:
        self._text = text

    def json(self) -> str:
        if self._text is None:
            raise RuntimeError("py4j.protocol.Py4JNetworkError: Answer from Java side is empty")
        return self._text


# ----------------------------------------------------------------------------- the pipeline


@pytest.fixture(scope="module")
def fuzz_watch(tmp_path_factory: pytest.TempPathFactory) -> Iterator[wmwatch.Watch]:
    db = tmp_path_factory.mktemp("fuzz") / "fuzz.duckdb"
    # retention off: the documents are dated T0 (months back), and a module that outlasts the
    # writer's retention interval (600 s; the fuzz does under load) would see them purged
    watch = wmwatch.attach(
        NoQueriesSession(),
        db=str(db),
        metrics_port=free_port(),
        listener="stock",
        retention_days=None,
    )
    try:
        yield watch
    finally:
        watch.close()


def _scrape_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        body: bytes = response.read()
    return body.decode("utf-8")  # the exposition must be valid UTF-8


def _parse_exposition(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


@settings(
    max_examples=150,
    deadline=None,
    # hostile documents are large on purpose
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(
    documents=st.lists(hostile_progress(), min_size=1, max_size=4),
    lifecycle=st.lists(
        st.tuples(st.sampled_from(["started", "idle", "terminated"]), json_values), max_size=2
    ),
)
def test_hostile_progress_never_escapes_the_listener_and_metrics_always_parse(
    fuzz_watch: wmwatch.Watch, documents: list[str], lifecycle: list[tuple[str, Any]]
) -> None:
    watch = fuzz_watch
    listener = Py4jListener(watch._events, watch.health)
    for text in documents:
        listener.onQueryProgress(FakeJvmEvent(text))  # must not raise, whatever the text
    listener.onQueryProgress(FakeJvmEvent(None))  # the JVM call itself failing
    for kind, payload in lifecycle:
        getattr(
            listener,
            {"started": "onQueryStarted", "idle": "onQueryIdle", "terminated": "onQueryTerminated"}[
                kind
            ],
        )(FakeJvmEvent(json.dumps(payload)))
    # a good batch after the bad ones: the worker is alive and still updates the metrics
    good = next(_good_batch)
    listener.onQueryProgress(
        FakeJvmEvent(json.dumps({"progress": progress_doc("fz-ok", good, name="fz_ok")}))
    )
    assert watch.flush(timeout=30)
    assert watch._worker.is_alive()
    errors = watch.health.copy().errors
    assert isinstance(errors, dict)
    # two hostile queries may share a label (one's name is the other's id): the collector keeps
    # one series of each and counts the rest as "collect:duplicate", which is not a failure
    expected = ("parse:", "receive:", "collect:duplicate")
    assert not [stage for stage in errors if not stage.startswith(expected)], errors

    assert watch.metrics_url is not None
    samples = _parse_exposition(_scrape_text(watch.metrics_url))
    assert samples[("wmwatch_last_batch_id", (("query", "fz_ok"),))] == good
    for (name, labels), value in samples.items():
        assert name.startswith("wmwatch_")
        for key, label_value in labels:
            assert key not in ("batch_id", "run_id")
            if key == "operator_name":
                assert len(label_value) <= 200
        if name.endswith("_total") or name.endswith("_count"):
            assert not math.isnan(value) and value >= 0


_good_batch = iter(range(10**9))


def test_after_the_fuzz_the_history_holds_only_sane_rows(fuzz_watch: wmwatch.Watch) -> None:
    """Runs after the fuzz (same module watch): the store is up and its rows are readable."""
    watch = fuzz_watch
    # the fuzz's backlog handled first: on a loaded machine its events can still fill the
    # bounded queue, which would drop these (as it must) and leave nothing to check
    assert watch.flush(timeout=60)
    for batch in range(3):
        assert watch._events.offer(
            "progress", json.dumps(progress_doc("fz-final", batch, name="fz_final"))
        )
    assert watch.flush(timeout=30)
    assert watch.store.health.up
    rows = watch.store.read(
        lambda con: con.execute(
            "SELECT batch_id FROM batches WHERE query_id = 'fz-final' ORDER BY 1"
        ).fetchall()
    )
    assert rows == [(0,), (1,), (2,)], (watch.store.health, watch.health.copy().errors)
    total = watch.store.read(
        lambda con: con.execute(
            "SELECT count(*), count(*) FILTER (WHERE batch_id < 0) FROM batches"
        ).fetchone()
    )
    assert total[0] >= 3 and total[1] == 0


def test_label_values_that_would_break_the_format_are_escaped(tmp_path: Path) -> None:
    nasty = 'a"b\\c\nd}e{f=g,h # HELP'
    with wmwatch.attach(
        NoQueriesSession(),
        db=str(tmp_path / "h.duckdb"),
        metrics_port=free_port(),
        listener="stock",
    ) as watch:
        doc = progress_doc("nasty-id", 4, name=nasty, description=nasty)
        doc["stateOperators"][0]["operatorName"] = nasty
        watch._events.offer("progress", json.dumps({"progress": doc}))
        assert watch.flush(timeout=10)
        assert watch.metrics_url is not None
        samples = _parse_exposition(_scrape_text(watch.metrics_url))
    assert samples[("wmwatch_last_batch_id", (("query", nasty),))] == 4
    op_labels = (("operator", "0"), ("operator_name", nasty), ("query", nasty))
    assert samples[("wmwatch_state_rows", op_labels)] == doc["stateOperators"][0]["numRowsTotal"]


# ----------------------------------------------------------------------------- the CLI


@pytest.fixture
def history(tmp_path: Path) -> Path:
    db = tmp_path / "history.duckdb"
    with wmwatch.attach(
        NoQueriesSession(), db=str(db), metrics_port=None, listener="stock"
    ) as watch:
        for batch in range(5):
            watch._events.offer(
                "progress", json.dumps(progress_doc("q-known", batch, name="known_query"))
            )
    return db


def _run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, ["report", *args])
    return result.exit_code, result.stdout, result.stderr


def _one_clear_line(code: int, stdout: str, stderr: str, *needles: str) -> None:
    assert code != 0
    assert stdout == ""  # scripts reading stdout get nothing half-written
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_cli_unknown_query(history: Path) -> None:
    _one_clear_line(
        *_run("--db", str(history), "--query", "no_such_query"), "no_such_query", "known_query"
    )


@pytest.mark.parametrize("since", ["yesterday", "15 parsecs", "2026-13-45", "-5m", ""])
def test_cli_bad_since(history: Path, since: str) -> None:
    _one_clear_line(*_run("--db", str(history), "--since", since), "--since")


def test_cli_missing_db(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "history.duckdb"
    _one_clear_line(*_run("--db", str(missing)), str(missing), "--db")


def test_cli_db_from_a_newer_wmwatch(history: Path) -> None:
    with duckdb.connect(str(history)) as con:
        con.execute(
            "INSERT INTO wmwatch_schema (version, description) VALUES (?, 'from the future')",
            [LATEST_VERSION + 7],
        )
    _one_clear_line(
        *_run("--db", str(history)), "newer wmwatch", f"v{LATEST_VERSION + 7}", "upgrade"
    )


@pytest.mark.parametrize("kind", ["folder", "garbage", "other_app", "empty"])
def test_cli_db_that_is_not_a_wmwatch_history(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "thing.duckdb"
    if kind == "folder":
        path.mkdir()
    elif kind == "garbage":
        path.write_bytes(b"this is not a database\n" * 100)
    elif kind == "empty":
        path.write_bytes(b"")
    else:
        with duckdb.connect(str(path)) as con:
            con.execute("CREATE TABLE invoices (id INTEGER)")
    code, stdout, stderr = _run("--db", str(path))
    _one_clear_line(code, stdout, stderr, str(path))


def test_cli_bad_format(history: Path) -> None:
    _one_clear_line(*_run("--db", str(history), "--format", "xml"), "xml", "table, json, csv")


def test_writer_refuses_a_db_from_a_newer_wmwatch_with_one_sentence(history: Path) -> None:
    with duckdb.connect(str(history)) as con:
        con.execute(
            "INSERT INTO wmwatch_schema (version, description) VALUES (?, 'from the future')",
            [LATEST_VERSION + 1],
        )
    with pytest.raises(wmwatch.StoreError) as info:
        HistoryStore(history)
    assert "\n" not in str(info.value) and "newer wmwatch" in str(info.value)
