"""The DuckDB history store against real files: round trip, upserts, faults, retention, safety."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests.harness.handmade import REPO, T0, iso, progress
from wmwatch._errors import StoreError
from wmwatch._events import parse_started, parse_terminated
from wmwatch._progress import parse_progress
from wmwatch._store.files import open_readonly
from wmwatch._store.schema import LATEST_VERSION, apply_retention
from wmwatch._store.writer import HistoryStore


def rows(path: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    with open_readonly(path) as con:
        return con.execute(sql, params).fetchall()


@pytest.fixture
def store(tmp_path: Path) -> Iterator[HistoryStore]:
    history = HistoryStore(tmp_path / "history.duckdb", flush_interval_seconds=0.05).start()
    try:
        yield history
    finally:
        history.close()


def hold_lock(path: Path, *, read_only: bool = False) -> subprocess.Popen[str]:
    """Another PROCESS holding a connection to ``path`` until it reads a line on stdin."""
    code = (
        "import duckdb, sys\n"
        f"con = duckdb.connect({str(path)!r}, read_only={read_only})\n"
        "print('held', flush=True)\n"
        "sys.stdin.readline()\n"
        "con.close()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout`` passes; whether it held."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def release(child: subprocess.Popen[str]) -> None:
    assert child.stdin is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    child.wait(timeout=10)


# ------------------------------------------------------------------------------- round trip


def test_round_trip_batches_operators_sources_and_lifecycle(store: HistoryStore) -> None:
    store.record_query_started(
        parse_started({"id": "q-1", "runId": "run-1", "name": "clicks", "timestamp": iso(T0)})
    )
    for batch_id in range(5):
        store.record_progress(progress(batch_id, dropped=batch_id % 2))
    store.record_query_terminated(
        parse_terminated(
            {
                "id": "q-1",
                "runId": "run-1",
                "exception": "java.lang.IllegalStateException: boom\n\tat x.y",
                "errorClassOnException": "INTERNAL_ERROR",
                "timestamp": iso(T0 + timedelta(minutes=5)),
            }
        )
    )
    assert store.flush(timeout=10)
    store.close()

    batches = rows(
        store.path,
        "SELECT batch_id, query_name, input_rows, rows_dropped_by_watermark, state_rows_total, "
        "watermark_lag_seconds, event_time_delay_seconds, batch_duration_seconds, "
        "json_extract(progress_json, '$.batchId')::INT FROM batches ORDER BY batch_id",
    )
    assert [b[0] for b in batches] == [0, 1, 2, 3, 4]
    assert batches[3] == (3, "clicks", 10, 1, 103, 60.0, 30.0, 0.25, 3)
    assert rows(store.path, "SELECT count(*), sum(rows_total) FROM operators") == [(5, 510)]
    assert rows(store.path, "SELECT end_offset FROM sources WHERE batch_id = 4") == [
        ('{"logOffset": 5}',)
    ]
    assert rows(
        store.path,
        "SELECT status, error_class, exception LIKE 'java.lang.IllegalStateException: boom%', "
        "last_batch_id, query_name FROM queries",
    ) == [("failed", "INTERNAL_ERROR", True, 4, "clicks")]
    health = store.health
    assert health.up and health.written_total == 7 and health.pending_writes == 0
    assert health.errors_total == 0 and health.last_flush_at is not None


def test_credentials_are_masked_and_bad_utf8_is_stored_safely(store: HistoryStore) -> None:
    """Snapshots and events arrive clean from the parse; the store writes them as they are."""
    secret = "password=hunter2 s3a://AKIA:hunter2@bucket/in"
    doc = json.loads(
        (REPO / "tests" / "fixtures" / "progress_window.json").read_text(encoding="utf-8")
    )
    doc.update(id="q-bad", batchId=0, name=f"bad \ud800 {secret} " + "x" * 300)
    doc["stateOperators"][0]["operatorName"] = "agg\udfff"
    doc["sources"][0]["description"] = f"Kafka[{secret}] \ud800"
    snapshot = parse_progress(json.dumps(doc))  # lone \ud800 escapes in the raw JSON
    assert "\\ud800" in json.dumps(doc)
    store.record_progress(snapshot)
    store.record_query_started(parse_started({"id": "q-bad", "runId": "r", "name": secret}))
    store.record_query_terminated(
        parse_terminated({"id": "q-bad", "runId": "r", "exception": f"boom {secret} \udfff"})
    )
    assert store.flush(timeout=10)
    assert store.health.errors_total == 0
    store.close()

    ((name, progress_json),) = rows(
        store.path, "SELECT query_name, progress_json::VARCHAR FROM batches"
    )
    assert name == snapshot.name and len(name) == 200 and name.startswith("bad ? password=***")
    assert "hunter2" not in progress_json and "\\ud800" not in progress_json
    assert rows(store.path, "SELECT operator_name FROM operators") == [("agg?",)]
    ((description,),) = rows(store.path, "SELECT description FROM sources")
    assert description == "Kafka[password=*** s3a://***@bucket/in] ?"
    ((exception, names),) = rows(
        store.path,
        "SELECT max(exception), string_agg(query_name, ',') FROM queries WHERE query_id = 'q-bad'",
    )
    assert exception == "boom password=*** s3a://***@bucket/in ?"
    assert "hunter2" not in names


def test_retried_batch_id_replaces_and_never_duplicates(store: HistoryStore) -> None:
    store.record_progress(progress(7, input_rows=10, operators=2))
    assert store.flush()
    store.record_progress(progress(7, input_rows=99, operators=1))
    store.record_progress(progress(8))
    store.record_progress(progress(8))  # the same retry within one flush
    assert store.flush()

    def read(con: duckdb.DuckDBPyConnection) -> Any:
        return (
            con.execute("SELECT batch_id, input_rows FROM batches ORDER BY 1").fetchall(),
            con.execute(
                "SELECT batch_id, count(*) FROM operators GROUP BY 1 ORDER BY 1"
            ).fetchall(),
            con.execute("SELECT count(*) FROM sources").fetchone(),
            con.execute("SELECT count(*), max(last_batch_id) FROM queries").fetchone(),
        )

    assert store.read(read) == ([(7, 99), (8, 10)], [(7, 1), (8, 1)], (2,), (1, 8))


def test_late_watermark_taken_from_previous_batch_when_not_given(store: HistoryStore) -> None:
    explicit = T0 - timedelta(days=1)
    store.record_progress(progress(0))
    store.record_progress(progress(1))
    store.record_progress(progress(2), late_watermark_at=explicit)
    store.record_progress(progress(5))  # batches 3 and 4 never recorded: nothing to fill from
    assert store.flush()
    got = store.read(
        lambda con: con.execute(
            "SELECT batch_id, epoch(late_watermark_at), epoch(watermark_at) FROM batches ORDER BY 1"
        ).fetchall()
    )
    watermark_0 = got[0][2]
    assert got[0][1] is None
    assert got[1][1] == watermark_0
    assert got[2][1] == explicit.timestamp()
    assert got[3] == (5, None, got[3][2])


def test_submitted_write_runs_in_order_and_a_bad_one_is_skipped(store: HistoryStore) -> None:
    def good(n: int) -> Any:
        def write(con: duckdb.DuckDBPyConnection) -> None:
            con.execute(
                "INSERT OR REPLACE INTO audit_batches (query_id, batch_id, run_id, "
                "late_watermark_at, late_rows, sink, location, audited_at) "
                "VALUES ('q-1', ?, 'r', NULL, 0, 'duckdb', NULL, now())",
                (n,),
            )

        return write

    def bad(con: duckdb.DuckDBPyConnection) -> None:
        raise ValueError("a bug in a plugin")

    store.submit(good(1), description="one")
    store.submit(bad, description="bad")
    store.submit(good(2), description="two")
    assert store.flush()
    assert store.read(
        lambda con: con.execute("SELECT batch_id FROM audit_batches ORDER BY 1").fetchall()
    ) == [(1,), (2,)]
    health = store.health
    assert health.written_total == 2 and health.errors_total == 1
    assert health.last_error == "a bug in a plugin"


def test_read_before_start_and_after_close_is_a_clear_error(tmp_path: Path) -> None:
    history = HistoryStore(tmp_path / "h.duckdb")
    with pytest.raises(StoreError, match="start"):
        history.read(lambda con: 1)
    history.start()
    assert history.read(lambda con: con.execute("SELECT 42").fetchone()) == (42,)
    history.close()
    with pytest.raises(StoreError, match="closed"):
        history.read(lambda con: 1)


# ------------------------------------------------------------------------------- opening


def test_new_db_file_is_readable_by_its_owner_only(tmp_path: Path) -> None:
    path = tmp_path / "history.duckdb"
    HistoryStore(path).close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["history.duckdb"]


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match=r"folder .*nope does not exist: create it"):
        HistoryStore(tmp_path / "nope" / "history.duckdb")


def test_corrupt_file_is_a_clear_error_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "history.duckdb"
    path.write_bytes(b"this is not a database\n" * 500)
    with pytest.raises(StoreError, match=r"is not a wmwatch/DuckDB database .*move it aside"):
        HistoryStore(path)
    with pytest.raises(StoreError, match="is not a wmwatch/DuckDB database"), open_readonly(path):
        pass
    assert path.read_bytes().startswith(b"this is not a database")


def test_duckdb_file_of_another_application_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "other.duckdb"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE orders (id INT)")
    con.close()
    with pytest.raises(StoreError, match="another application"):
        HistoryStore(path)
    with pytest.raises(StoreError, match="not a wmwatch history"), open_readonly(path):
        pass
    con = duckdb.connect(str(path))
    assert con.execute("SELECT table_name FROM information_schema.tables").fetchall() == [
        ("orders",)
    ]
    con.close()


def test_schema_from_a_newer_wmwatch_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "history.duckdb"
    HistoryStore(path).close()
    con = duckdb.connect(str(path))
    con.execute("INSERT INTO wmwatch_schema (version) VALUES (?)", (LATEST_VERSION + 1,))
    con.close()
    with pytest.raises(StoreError, match=rf"newer wmwatch \(schema v{LATEST_VERSION + 1}"):
        HistoryStore(path)
    with pytest.raises(StoreError, match="newer wmwatch"), open_readonly(path):
        pass


def test_reopen_keeps_history_and_reports_it(tmp_path: Path) -> None:
    path = tmp_path / "history.duckdb"
    with HistoryStore(path) as first:
        for batch_id in range(3):
            first.record_progress(progress(batch_id))
    second = HistoryStore(path)
    assert not second.recovered_after_crash
    assert [
        (h.query_id, h.query_name, h.batches, h.last_batch_id) for h in second.history_at_open
    ] == [("q-1", "clicks", 3, 2)]
    assert rows(path, "SELECT count(*) FROM wmwatch_schema") == [(LATEST_VERSION,)]


def test_file_is_free_for_another_writer_between_flushes(tmp_path: Path) -> None:
    path = tmp_path / "history.duckdb"
    with HistoryStore(path, flush_interval_seconds=60).start() as history:
        history.record_progress(progress(0))
        assert history.flush()
        # the writer keeps its DuckDB instance between flushes, but not the file
        child = hold_lock(path)
        release(child)
        history.record_progress(progress(1))
        assert history.flush()
        assert history.health.up
    assert rows(path, "SELECT list(batch_id ORDER BY batch_id) FROM batches") == [([0, 1],)]


def test_paced_writer_defers_timed_flushes_never_explicit_ones(tmp_path: Path) -> None:
    path = tmp_path / "history.duckdb"
    # a share so small that any flush defers the next timed one to the 30 s cap
    with HistoryStore(path, flush_interval_seconds=0.02, max_cpu_share=1e-9).start() as history:
        history.record_progress(progress(0))
        assert history.flush()
        history.record_progress(progress(1))
        time.sleep(0.5)  # 25 flush intervals: an unpaced writer has written batch 1 by now
        assert rows(path, "SELECT list(batch_id) FROM batches") == [([0],)]
        assert history.health.pending_writes == 1
        assert history.flush()
        assert rows(path, "SELECT list(batch_id ORDER BY batch_id) FROM batches") == [([0, 1],)]


def test_paced_writer_retries_an_outage_on_the_back_off_not_the_pace(tmp_path: Path) -> None:
    path = tmp_path / "history.duckdb"
    # the same tiny share: paced by a failed attempt's CPU, a retry would wait the 30 s cap
    history = HistoryStore(
        path, flush_interval_seconds=0.05, lock_wait_seconds=0.05, max_cpu_share=1e-9
    ).start()
    try:
        history.record_progress(progress(0))
        assert history.flush()
        child = hold_lock(path)
        try:
            history.record_progress(progress(1))
            assert not history.flush(timeout=1.0)
            assert not history.health.up
        finally:
            release(child)
        # no explicit flush: the writer's own retry (back-off at most 5 s) writes batch 1
        assert wait_until(lambda: history.health.up, timeout=12), history.health
        assert wait_until(lambda: history.health.pending_writes == 0, timeout=12)
    finally:
        history.close()
    assert rows(path, "SELECT list(batch_id ORDER BY batch_id) FROM batches") == [([0, 1],)]


def test_cpu_share_out_of_range_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="max_cpu_share"):
        HistoryStore(tmp_path / "history.duckdb", max_cpu_share=0)


def test_locked_at_open_by_another_process_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "history.duckdb"
    HistoryStore(path).close()
    child = hold_lock(path)
    try:
        # the lock is held for the whole attempt: the open gives up on its own and says who holds it
        with pytest.raises(StoreError, match=rf"locked by another process \(PID {child.pid}"):
            HistoryStore(path, open_timeout_seconds=0.3)
        assert child.poll() is None
    finally:
        release(child)


# ------------------------------------------------------------------------------- faults


def test_db_locked_by_another_process_keeps_writes_and_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "history.duckdb"
    history = HistoryStore(path, flush_interval_seconds=0.05, lock_wait_seconds=0.1).start()
    try:
        history.record_progress(progress(0))
        assert history.flush()
        child = hold_lock(path)
        try:
            with caplog.at_level(logging.WARNING, logger="wmwatch.store"):
                for batch_id in range(1, 6):
                    history.record_progress(progress(batch_id))
                assert not history.flush(timeout=1.0)
                health = history.health
                assert not health.up
                assert health.pending_writes == 5
                assert "locked by another process" in (health.last_error or "")
                assert health.errors_total >= 1
                # several retries, each a failed attempt: still one log line for the state change
                retried = wait_until(lambda: history.health.errors_total >= health.errors_total + 3)
                assert retried, history.health
                assert not history.health.up
        finally:
            release(child)
        assert history.flush(timeout=10)
        health = history.health
        assert health.up and health.pending_writes == 0 and health.dropped_total == 0
        down = [r for r in caplog.records if "cannot write history" in r.getMessage()]
        assert len(down) == 1
        assert history.read(lambda c: c.execute("SELECT count(*) FROM batches").fetchone()) == (6,)
    finally:
        history.close()


def test_pending_writes_are_bounded_and_drops_counted(tmp_path: Path) -> None:
    path = tmp_path / "history.duckdb"
    history = HistoryStore(
        path, flush_interval_seconds=0.05, lock_wait_seconds=0.05, max_pending=5
    ).start()
    try:
        child = hold_lock(path)
        try:
            for batch_id in range(8):
                history.record_progress(progress(batch_id))
            health = history.health
            assert health.dropped_total == 3 and health.pending_writes == 5
        finally:
            release(child)
        assert history.flush(timeout=10)
        # The oldest were dropped: the newest five made it.
        assert history.read(
            lambda c: c.execute("SELECT list(batch_id ORDER BY batch_id) FROM batches").fetchone()
        ) == ([3, 4, 5, 6, 7],)
    finally:
        history.close()


def test_db_deleted_while_running_is_recreated_and_writes_resume(
    store: HistoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    store.record_progress(progress(0))
    assert store.flush()
    store.path.unlink()
    with caplog.at_level(logging.WARNING, logger="wmwatch.store"):
        store.record_progress(progress(1))
        store.record_progress(progress(2))
        assert store.flush(timeout=10)
    assert any("was deleted" in r.getMessage() for r in caplog.records)
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert store.read(
        lambda c: c.execute("SELECT list(batch_id ORDER BY batch_id) FROM batches").fetchone()
    ) == ([1, 2],)
    assert store.health.up


_READ_ONLY_SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    from pathlib import Path
    from wmwatch._errors import StoreError
    from wmwatch._store.writer import HistoryStore
    from wmwatch._progress import parse_progress

    folder = Path(sys.argv[1])
    out = {}

    def snap(batch_id):
        return parse_progress({"id": "q", "runId": "r", "batchId": batch_id,
                               "timestamp": "2026-01-01T00:00:00.000Z"})

    locked_dir = folder / "locked"
    locked_dir.mkdir()
    os.chmod(locked_dir, 0o555)
    try:
        HistoryStore(locked_dir / "h.duckdb")
        out["read_only_folder"] = None
    except StoreError as exc:
        out["read_only_folder"] = str(exc)

    path = folder / "h.duckdb"
    store = HistoryStore(path, flush_interval_seconds=0.05, lock_wait_seconds=0.05).start()
    store.record_progress(snap(0))
    out["first_flush"] = store.flush(5)
    os.chmod(path, 0o400)
    store.record_progress(snap(1))
    store.record_progress(snap(2))
    out["flush_while_read_only"] = store.flush(1)
    health = store.health
    out["down"] = {"up": health.up, "pending": health.pending_writes, "error": health.last_error}
    os.chmod(path, 0o600)
    out["flush_after"] = store.flush(10)
    out["up_after"] = store.health.up
    out["batches"] = store.read(lambda c: c.execute(
        "SELECT list(batch_id ORDER BY batch_id) FROM batches").fetchone()[0])
    store.close()
    print(json.dumps(out))
    """
)


def _without_root_override() -> list[str]:
    """Root ignores file modes: drop the override capabilities so read-only means read-only."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.fail(
            "running as root: install util-linux (setpriv) so the test can drop CAP_DAC_OVERRIDE"
        )
    caps = "-dac_override,-dac_read_search"
    return [setpriv, "--bounding-set", caps, "--inh-caps", caps]


def test_read_only_folder_and_file_made_read_only_while_running(tmp_path: Path) -> None:
    script = tmp_path / "scenario.py"
    script.write_text(_READ_ONLY_SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    done = subprocess.run(
        [*_without_root_override(), sys.executable, str(script), str(work)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert "read-only or no permission" in out["read_only_folder"]
    assert out["first_flush"] is True
    assert out["flush_while_read_only"] is False
    assert out["down"]["up"] is False and out["down"]["pending"] == 2
    assert "read-only or no permission" in out["down"]["error"]
    assert out["flush_after"] is True and out["up_after"] is True
    assert out["batches"] == [0, 1, 2]
    assert "cannot write history" in done.stderr  # logged once, at the state change
    assert done.stderr.count("cannot write history") == 1


_KILL_SCRIPT = textwrap.dedent(
    """
    import sys
    from wmwatch._store.writer import HistoryStore
    from wmwatch._progress import parse_progress

    store = HistoryStore(sys.argv[1], flush_interval_seconds=60, flush_writes=10**9).start()
    batch_id = 0
    while True:
        for _ in range(1500):
            store.record_progress(parse_progress({
                "id": "q", "runId": "r", "batchId": batch_id,
                "timestamp": "2026-01-01T00:00:00.000Z",
                "eventTime": {"watermark": "2026-01-01T00:00:00.000Z"},
                "stateOperators": [{"operatorName": "stateStoreSave", "numRowsTotal": batch_id}],
                "sources": [{"description": "FileStreamSource[file:/in]", "numInputRows": 1}],
            }))
            batch_id += 1
        assert store.flush(60)
        print(batch_id, flush=True)
    """
)


def test_sigkill_in_the_middle_of_a_write_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "history.duckdb"
    wal = Path(f"{path}.wal")
    script = tmp_path / "writer.py"
    script.write_text(_KILL_SCRIPT)
    child = subprocess.Popen(
        [sys.executable, str(script), str(path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.stdout is not None
    committed = 0
    try:
        committed = int(child.stdout.readline())  # a first flush is durable
        deadline = time.monotonic() + 30
        # Kill while the writer has a write-ahead log with content: mid-write.
        while time.monotonic() < deadline:
            if wal.exists() and wal.stat().st_size > 0:
                break
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=10)
    recovered = HistoryStore(path)
    (history,) = recovered.history_at_open
    assert history.batches >= committed
    # Batches are committed in whole flushes: a prefix 0..n-1, each with its operator and source.
    assert rows(
        path, "SELECT count(*), count(DISTINCT batch_id), min(batch_id), max(batch_id) FROM batches"
    ) == [(history.batches, history.batches, 0, history.batches - 1)]
    assert rows(path, "SELECT count(*) FROM operators") == [(history.batches,)]
    assert rows(path, "SELECT count(*) FROM sources") == [(history.batches,)]
    assert history.batches % 1500 == 0
    print(
        f"committed before kill: {committed}, recovered: {history.batches}, "
        f"write-ahead log replayed: {recovered.recovered_after_crash}"
    )


# ------------------------------------------------------------------------------- retention


def test_retention_deletes_old_history_and_keeps_the_rest(tmp_path: Path) -> None:
    now = datetime.now(UTC)
    old, recent = now - timedelta(days=10), now - timedelta(hours=1)
    path = tmp_path / "history.duckdb"
    with HistoryStore(path) as history:
        history.record_progress(progress(0, at=old))
        history.record_progress(progress(1, at=old + timedelta(seconds=10)))
        history.record_progress(progress(2, at=recent))

        def audit(con: duckdb.DuckDBPyConnection) -> None:
            con.execute(
                "INSERT INTO late_rows (query_id, batch_id, audited_at) "
                "VALUES ('q-1', 0, ?), ('q-1', 2, ?)",
                (old, recent),
            )
            con.execute(
                "INSERT INTO audit_batches (query_id, batch_id, run_id, late_watermark_at, "
                "late_rows, sink, location, audited_at) "
                "VALUES ('q-1', 0, 'r', NULL, 1, 'duckdb', NULL, ?), "
                "('q-1', 2, 'r', NULL, 1, 'duckdb', NULL, ?)",
                (old, recent),
            )

        history.submit(audit, description="audit rows")
    with HistoryStore(
        path, retention_days=2, retention_interval_seconds=0.05, flush_interval_seconds=0.05
    ) as history:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            left = history.read(
                lambda c: c.execute(
                    "SELECT list(batch_id ORDER BY batch_id) FROM batches"
                ).fetchone()
            )
            if left == ([2],):
                break
            time.sleep(0.05)
        # A new batch, recorded while retention runs, stays.
        history.record_progress(progress(3, at=now))
    assert rows(path, "SELECT list(batch_id ORDER BY batch_id) FROM batches") == [([2, 3],)]
    assert rows(path, "SELECT list(batch_id ORDER BY batch_id) FROM operators") == [([2, 3],)]
    assert rows(path, "SELECT list(batch_id ORDER BY batch_id) FROM sources") == [([2, 3],)]
    assert rows(path, "SELECT list(batch_id) FROM late_rows") == [([2],)]
    assert rows(path, "SELECT list(batch_id) FROM audit_batches") == [([2],)]
    assert rows(path, "SELECT count(*) FROM queries") == [(1,)]


def test_apply_retention_counts_what_it_deletes(tmp_path: Path) -> None:
    path = tmp_path / "history.duckdb"
    with HistoryStore(path) as history:
        for batch_id in range(4):
            history.record_progress(progress(batch_id, at=T0 + timedelta(days=batch_id)))
    con = duckdb.connect(str(path))
    try:
        deleted = apply_retention(con, cutoff_epoch_seconds=(T0 + timedelta(days=2)).timestamp())
        # two batches, each with one operator and one source
        assert deleted == 6
        assert con.execute("SELECT min(batch_id) FROM batches").fetchone() == (2,)
    finally:
        con.close()


def test_open_readonly_on_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with (
        pytest.raises(StoreError, match=r"no wmwatch history at .*missing\.duckdb"),
        open_readonly(tmp_path / "missing.duckdb"),
    ):
        pass
    assert not (tmp_path / "missing.duckdb").exists()


@pytest.mark.parametrize("old_version", [1, 3])
def test_reader_of_an_older_history_sees_the_latest_schema(
    tmp_path: Path, old_version: int
) -> None:
    """A file written by an older wmwatch is read, never migrated, by the report (text and
    HTML): later tables are empty and later columns NULL."""
    from wmwatch._report.build import build_report
    from wmwatch._store.schema import MIGRATIONS, VERSION_TABLE

    db = tmp_path / "old.duckdb"
    with duckdb.connect(str(db)) as con:
        con.execute(VERSION_TABLE)
        for migration in MIGRATIONS[:old_version]:
            for statement in migration.statements:
                con.execute(statement)
            con.execute(
                "INSERT INTO wmwatch_schema (version, description) VALUES (?, ?)",
                (migration.version, migration.description),
            )
        con.execute(
            "INSERT INTO late_rows (query_id, batch_id, audited_at, operator_kind) "
            "VALUES ('q', 3, now(), 'window')"
        )
        con.execute("INSERT INTO queries (query_id, run_id, status) VALUES ('q', 'r', 'active')")
        con.execute(
            "INSERT INTO batches (query_id, batch_id, run_id, recorded_at) "
            "VALUES ('q', 3, 'r', now())"
        )
    assert old_version < LATEST_VERSION
    with open_readonly(db) as con:
        rows = con.execute(
            "SELECT batch_id, operator_index, join_side, join_key FROM late_rows"
        ).fetchall()
        assert rows == [(3, None, None, None)]
        assert con.execute("SELECT late_rows_by_input FROM audit_batches").fetchall() == []
        report = build_report(con, db=str(db))
        assert [q.query_id for q in report.queries] == ["q"]
    from typer.testing import CliRunner

    from wmwatch.cli import app

    for form in ("json", "html"):
        shown = CliRunner().invoke(app, ["report", "--db", str(db), "--format", form])
        assert shown.exit_code == 0, shown.output
    with duckdb.connect(str(db), read_only=True) as con:  # the file itself is unchanged
        version = con.execute("SELECT max(version) FROM wmwatch_schema").fetchone()
        assert version == (old_version,)
