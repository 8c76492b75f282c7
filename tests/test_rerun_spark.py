"""Re-runs against real Spark and real files: attach run twice, two writers on one history file,
and a query that was running long before attach.

* ``attach`` on a session that already has a live watch returns that watch (one listener, no
  port or file conflict); different options are named in a warning; after ``close`` a new
  watch can be attached.
* A history file has one writer: a second one, on another session of this process or in
  another process, is refused with one line (``strict=True``: ``StoreError``) until the first
  closes.
* ``attach`` records the progress Spark still holds for queries already running, in batch
  order, without counting a batch twice.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

import wmwatch
from tests.harness.net import free_port, scrape
from tests.harness.streams import epoch_seconds, write_events
from tests.scripts.safety_support import NoQueriesSession, progress_doc
from wmwatch._progress import parse_progress
from wmwatch._store.writer import HistoryStore
from wmwatch.cli import app

REPO = Path(__file__).resolve().parents[1]


def ts(second: int) -> str:
    minute, sec = divmod(second, 60)
    return f"2026-01-01T00:{minute:02d}:{sec:02d}Z"


# one file per batch; ts(3) in the fourth file is behind the watermark (its window ended)
FILES = [
    [{"ts": ts(1), "user": "a"}, {"ts": ts(4), "user": "b"}],
    [{"ts": ts(25), "user": "a"}, {"ts": ts(12), "user": "c"}],
    [{"ts": ts(41), "user": "a"}],
    [{"ts": ts(3), "user": "late"}, {"ts": ts(55), "user": "a"}],
    [{"ts": ts(70), "user": "a"}],
    [{"ts": ts(90), "user": "b"}],
]


def start_windowed(spark: Any, folder: Path, name: str) -> Any:
    from pyspark.sql import functions as F

    events = (
        spark.readStream.schema("ts timestamp, user string")
        .json(str(folder / "in"))
        .withWatermark("ts", "10 seconds")
    )
    return (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.outputMode("append")
        .format("noop")
        .queryName(name)
        .option("checkpointLocation", str(folder / "checkpoint"))
        .start()
    )


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.05)


def stop_and_settle(watch: Any, query: Any, name: str) -> list[dict[str, Any]]:
    """Stop the query, wait until the watch has seen its last event; Spark's progress of the run."""
    query.stop()
    progress = list(query.recentProgress)
    state = lambda: next((q for q in watch.queries() if q.name == name), None)  # noqa: E731
    wait_for(lambda: (s := state()) is not None and s.status == "terminated", f"{name} stopped")
    assert watch.flush(timeout=60)
    assert len(progress) < 100, "Spark forgot batches of this run: the test must keep it shorter"
    return progress


def batch_rows(db: Path, query_id: str) -> list[tuple[Any, ...]]:
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(
            "SELECT batch_id, epoch_ms(watermark_at), epoch_ms(late_watermark_at), input_rows "
            "FROM batches WHERE query_id = ? ORDER BY batch_id",
            [query_id],
        ).fetchall()


# --------------------------------------------------------------------- attach run twice


@pytest.mark.spark
def test_attach_twice_on_one_session_returns_the_live_watch(
    spark: Any, stream_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = stream_dir / "history.duckdb"
    port = free_port()
    with caplog.at_level(logging.INFO, logger="wmwatch"):
        first = wmwatch.attach(spark, db=str(db), metrics_port=port)
        try:
            again = wmwatch.attach(spark, db=str(db), metrics_port=port)  # the cell run again
            assert again is first
            assert first.problems == []
            query = start_windowed(spark, stream_dir, "rerun_cell")
            for rows in FILES[:3]:
                write_events(stream_dir / "in", rows)
                query.processAllAvailable()
            progress = stop_and_settle(first, query, "rerun_cell")
            samples = scrape(first.metrics_url or "")
            # one listener: every progress event once, every batch once
            assert samples[("wmwatch_events_received_total", (("kind", "progress"),))] == len(
                progress
            )
            assert samples[("wmwatch_batches_total", (("query", "rerun_cell"),))] == len(progress)
            assert first.store.health.errors_total == 0
            # read through the writer: DuckDB allows one attachment of a file per process
            recorded = first.store.read(
                lambda con: con.execute(
                    "SELECT batch_id FROM batches WHERE query_id = ? ORDER BY 1", [str(query.id)]
                ).fetchall()
            )
            assert [r[0] for r in recorded] == [p["batchId"] for p in progress]

            # different options: still the live watch, and a warning names what was ignored
            other_db = stream_dir / "other.duckdb"
            changed = wmwatch.attach(spark, db=str(other_db), metrics_port=port, queue_capacity=5)
            assert changed is first
            assert not other_db.exists()
        finally:
            first.close()
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name.startswith("wmwatch")]
    returned = [m for level, m in messages if "already has a live watch" in m]
    assert len(returned) == 2 and all(str(db) in m for m in returned), messages
    (ignored,) = [m for level, m in messages if level == logging.WARNING and "attach ignored" in m]
    assert "db, queue_capacity" in ignored and "metrics_port" not in ignored
    assert "watch.close()" in ignored
    # nothing fought over the port or the file
    assert not [m for level, m in messages if level >= logging.ERROR], messages
    assert not [m for _, m in messages if "constraint" in m.lower() or "in use" in m]

    # after close, attach makes a new watch with the same port and file
    with wmwatch.attach(spark, db=str(db), metrics_port=port) as fresh:
        assert fresh is not first
        assert fresh.problems == [] and fresh.metrics_url is not None and fresh.store is not None


@pytest.mark.spark
def test_each_session_gets_its_own_watch_and_one_history_file_one_writer(
    spark: Any, stream_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = stream_dir / "history.duckdb"
    first = wmwatch.attach(spark, db=str(db), metrics_port=None)
    try:
        other_session = spark.newSession()
        with caplog.at_level(logging.ERROR, logger="wmwatch"):
            second = wmwatch.attach(other_session, db=str(db), metrics_port=None)
        try:
            assert second is not first  # listeners are per session: it needs its own
            assert second.store is None  # runs without history rather than fight for the file
            (problem,) = second.problems
            assert problem == (
                f"{db} is already being written by another wmwatch in this process "
                f"(PID {os.getpid()}): close that watch or pass another db"
            )
            assert [r.getMessage() for r in caplog.records].count(
                f"wmwatch: {problem} (continuing without it; pass strict=True to fail instead)"
            ) == 1
            assert wmwatch.attach(other_session, db=None, metrics_port=None) is second
            with pytest.raises(
                wmwatch.StoreError, match="already being written by another wmwatch"
            ):
                wmwatch.attach(spark.newSession(), db=str(db), metrics_port=None, strict=True)
        finally:
            second.close()
    finally:
        first.close()
    # the first closed: another session may write the file now
    with wmwatch.attach(spark.newSession(), db=str(db), metrics_port=None, strict=True) as third:
        assert third.store is not None and third.problems == []


_SECOND_PROCESS = textwrap.dedent(
    """
    import json, logging, sys
    import wmwatch
    from wmwatch._progress import parse_progress
    from wmwatch._store.writer import HistoryStore
    from tests.scripts.safety_support import NoQueriesSession, progress_doc

    db = sys.argv[1]
    out = {}
    try:
        with HistoryStore(db) as store:
            store.record_progress(parse_progress(progress_doc("from_second_process", 0)))
        out["store"] = "written"
    except wmwatch.StoreError as exc:
        out["store"] = str(exc)
    try:
        wmwatch.attach(
            NoQueriesSession(), db=db, metrics_port=None, listener="stock", strict=True
        ).close()
        out["strict"] = "attached"
    except wmwatch.StoreError as exc:
        out["strict"] = str(exc)
    logging.basicConfig(level=logging.ERROR)
    watch = wmwatch.attach(NoQueriesSession(), db=db, metrics_port=None, listener="stock")
    out["lenient"] = {"history": watch.store is not None, "problems": watch.problems}
    watch.close()
    print(json.dumps(out))
    """
)


def _second_process(script: Path, db: Path) -> tuple[dict[str, Any], str]:
    done = subprocess.run(
        [sys.executable, str(script), str(db)],
        capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_second_process_cannot_write_the_file_until_the_first_closes(tmp_path: Path) -> None:
    db = tmp_path / "history.duckdb"
    script = tmp_path / "second.py"
    script.write_text(_SECOND_PROCESS)
    refused = (
        f"{db} is already being written by another wmwatch (PID {os.getpid()}): "
        "close that watch or pass another db"
    )
    first = wmwatch.attach(NoQueriesSession(), db=str(db), metrics_port=None, listener="stock")
    try:
        out, stderr = _second_process(script, db)
        assert out["store"] == refused
        assert out["strict"] == refused
        assert out["lenient"] == {"history": False, "problems": [refused]}
        assert stderr.count(refused) == 1  # logged once, on one line
        # the first writer's history is untouched and still written
        first._events.offer("started", {"id": "q", "runId": "r", "name": "first_process"})
        assert first.flush(timeout=30)
    finally:
        first.close()
    out, _ = _second_process(script, db)
    assert out == {
        "store": "written",
        "strict": "attached",
        "lenient": {"history": True, "problems": []},
    }
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT query_id FROM queries ORDER BY 1").fetchall() == [
            ("from_second_process",), ("q",),
        ]  # fmt: skip
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.duckdb", "second.py"]


def test_after_close_attach_serves_on_the_same_port_again(tmp_path: Path) -> None:
    session, port = NoQueriesSession(), free_port()
    with wmwatch.attach(
        session, db=str(tmp_path / "h.duckdb"), metrics_port=port, listener="stock"
    ) as first:
        assert scrape(first.metrics_url or "")  # a scrape leaves the port in TIME_WAIT after close
    with wmwatch.attach(
        session, db=str(tmp_path / "h.duckdb"), metrics_port=port, listener="stock"
    ) as second:
        assert second is not first
        assert second.problems == [] and second.metrics_url == f"http://127.0.0.1:{port}/metrics"
        assert scrape(second.metrics_url)


def test_a_failed_attach_leaves_the_file_registry_and_session_free(tmp_path: Path) -> None:
    db, registry, session = tmp_path / "history.duckdb", CollectorRegistry(), NoQueriesSession()
    with pytest.raises(wmwatch.ConfigError, match="listener mode"):
        wmwatch.attach(session, db=str(db), metrics_port=None, registry=registry, listener="bogus")
    with wmwatch.attach(
        session, db=str(db), metrics_port=None, registry=registry, strict=True
    ) as watch:
        assert watch.store is not None and watch.problems == []


def test_the_lock_goes_with_a_killed_writer(tmp_path: Path) -> None:
    db = tmp_path / "history.duckdb"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom wmwatch._store.writer import HistoryStore\n"
         f"store = HistoryStore({str(db)!r}).start()\nprint('open', flush=True)\ntime.sleep(120)"],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "open"
        with pytest.raises(wmwatch.StoreError, match=rf"another wmwatch \(PID {holder.pid}\)"):
            HistoryStore(db)
    finally:
        holder.kill()
        holder.wait(timeout=10)
    with HistoryStore(db) as store:  # no stale lock: the kernel released it with the process
        store.record_progress(parse_progress(progress_doc("after_kill", 0)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.duckdb"]


# --------------------------------------------------------------------- history from before attach


def test_live_events_wait_behind_the_seeded_batches() -> None:
    from wmwatch._core.health import Health
    from wmwatch._core.listener import EventQueue

    events = EventQueue(10, Health())
    with events.live_events_held() as offer_first:
        events.offer("progress", "live batch 7")  # the listener, while attach is still seeding
        offer_first("progress", "remembered batch 5")
        offer_first("progress", "remembered batch 6")
    events.offer("progress", "live batch 8")
    order = [e.payload for e in iter(lambda: events.get(timeout=0.01), None)]
    assert order == ["remembered batch 5", "remembered batch 6", "live batch 7", "live batch 8"]


@pytest.mark.spark
def test_attach_records_the_batches_spark_still_holds_once_and_in_order(
    spark: Any, stream_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = stream_dir / "history.duckdb"
    query = start_windowed(spark, stream_dir, "ran_before_attach")
    try:
        for rows in FILES[:4]:
            write_events(stream_dir / "in", rows)
            query.processAllAvailable()
        before = [p["batchId"] for p in query.recentProgress]
        assert len(before) >= 4
        registry = CollectorRegistry()
        with caplog.at_level(logging.INFO, logger="wmwatch"):
            watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=registry)
        try:
            for rows in FILES[4:]:
                write_events(stream_dir / "in", rows)
                query.processAllAvailable()
            progress = stop_and_settle(watch, query, "ran_before_attach")
            labels = {"query": "ran_before_attach"}
            # every batch of the run counted once: the ones before attach too, none twice
            assert registry.get_sample_value("wmwatch_batches_total", labels) == len(progress)
            assert registry.get_sample_value("wmwatch_progress_events_missed_total", labels) == 0
            assert registry.get_sample_value("wmwatch_input_rows_total", labels) == sum(
                p["numInputRows"] for p in progress
            )
            assert (
                registry.get_sample_value(
                    "wmwatch_rows_dropped_by_watermark_total",
                    {**labels, "operator": "0", "operator_name": "stateStoreSave"},
                )
                == sum(
                    op["numRowsDroppedByWatermark"] for p in progress for op in p["stateOperators"]
                )
                >= 1
            )
        finally:
            watch.close()
    finally:
        query.stop()
    (seeded,) = [r.getMessage() for r in caplog.records if "already running" in r.getMessage()]
    recovered = re.search(r"ran_before_attach: (\d+)", seeded)
    assert recovered is not None and int(recovered.group(1)) >= len(before), seeded

    rows = batch_rows(db, str(query.id))
    assert [r[0] for r in rows] == [p["batchId"] for p in progress] == list(range(len(progress)))
    assert rows[0][0] == 0 and before[0] == 0  # history starts where Spark's memory starts
    watermark_ms = {
        p["batchId"]: epoch_seconds(p["eventTime"]["watermark"]) * 1000 for p in progress
    }
    for (batch_id, watermark, late_watermark, input_rows), p in zip(rows, progress, strict=True):
        assert watermark == watermark_ms[batch_id]
        assert late_watermark == (watermark_ms[batch_id - 1] if batch_id > 0 else None)
        assert input_rows == p["numInputRows"]

    result = CliRunner().invoke(app, ["report", "--db", str(db), "--format", "json"])
    assert result.exit_code == 0, result.stderr
    (summary,) = json.loads(result.stdout)["queries"]
    assert summary["batches"] == len(progress)
    assert summary["input_rows"] == sum(p["numInputRows"] for p in progress)


def test_an_event_taken_and_not_yet_handled_is_still_unfinished() -> None:
    """What ``Watch.flush`` waits on: an event off the queue counts until it is handled."""
    from wmwatch._core.health import Health
    from wmwatch._core.listener import EventQueue

    events = EventQueue(10, Health())
    assert events.offer("progress", "batch 1")
    assert events.unfinished() == 1
    taken = events.get(timeout=0.01)
    assert taken is not None and taken.payload == "batch 1"
    assert events.size() == 0 and events.unfinished() == 1  # off the queue, not handled yet
    events.task_done()
    assert events.unfinished() == 0


def test_an_idle_worker_sleeps_until_an_event_and_ends_at_once_when_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker waits on its queue without polling while no event comes (it woke ten times
    a second before: more CPU than a busy query's events), handles what is queued, and a stop
    ends it at once rather than at its next check of Spark's bus."""
    from wmwatch._core import worker as worker_module
    from wmwatch._core.health import Health
    from wmwatch._core.listener import EventQueue
    from wmwatch._core.state import QueryBook
    from wmwatch._core.worker import Worker

    # the bus check an hour away: only the stop can end the worker's wait within the join below
    monkeypatch.setattr(worker_module, "SPARK_BUS_POLL_SECONDS", 3600.0)

    class CountedGets(EventQueue):
        def __init__(self) -> None:
            super().__init__(10, Health())
            self.gets = 0

        def get(self, timeout: float) -> Any:
            self.gets += 1
            return super().get(timeout)

    events = CountedGets()
    book = QueryBook()
    worker = Worker(None, events, book, Health(), None, list)
    worker.start()
    try:
        time.sleep(1.0)
        assert events.gets <= 2  # one wait (and a bus check at the start), not ten a second
        events.offer("started", {"id": "q1", "runId": "r1", "name": "idle_worker"})
        assert worker.wait_idle(timeout=10)
        assert book.get("q1") is not None
        worker.stop()
        worker.join(timeout=60)
        assert not worker.is_alive()  # woken by the stop, not by the bus check an hour away
    finally:
        worker.stop()
