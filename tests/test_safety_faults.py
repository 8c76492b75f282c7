"""Faults: what happens to the watched job and its history when the world breaks under wmwatch.

* The driver SIGKILLed mid-write: the history opens, every committed batch and audit row is
  there exactly once, and wmwatch logs what it recovered.
* The history file made unwritable while a real query runs (immutable as root can't override,
  a full disk on a small tmpfs, the file replaced by a folder): the query keeps running, the
  metrics keep moving, ``wmwatch_store_up`` goes to 0 with the reason logged, and when the fault
  is fixed every batch held in memory (within ``max_pending``) is written.
* The metrics port taken by another process at start: logged and run without the endpoint, or
  ``MetricsServerError`` with ``strict=True``.
* Spark's listener bus dropping streaming events: counted, from both sides.

Root ignores permission bits, so "read-only" here means ``chattr +i`` and a full disk means a
real tmpfs mounted with ``size=``: both need root (CAP_LINUX_IMMUTABLE, CAP_SYS_ADMIN), which
the CI container has; the tests fail loudly rather than skip when it does not.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import generate_latest

import wmwatch
from tests.harness.net import free_port, scrape
from tests.harness.streams import write_events
from tests.scripts.safety_support import NoQueriesSession

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).parent / "scripts"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def _rows(db: Path, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(sql, params or []).fetchall()


def _wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.1)


# ----------------------------------------------------------------------------- SIGKILL


@pytest.mark.slow
def test_sigkill_mid_write_loses_and_duplicates_no_committed_batch_or_audit_row(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    db = tmp_path / "history.duckdb"
    wal = Path(f"{db}.wal")
    child = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "kill_watch_writer.py"), str(db)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    assert child.stdout is not None
    committed = -1
    try:
        for _ in range(3):  # three durable flushes, then kill while a write is in flight
            line = child.stdout.readline()
            died = child.poll() is not None and child.stderr is not None
            assert line.strip().isdigit(), line + (
                child.stderr.read() if died and child.stderr else ""
            )
            committed = int(line)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (wal.exists() and wal.stat().st_size > 0):
            time.sleep(0.0005)
        wal_bytes_at_kill = wal.stat().st_size if wal.exists() else 0
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait(timeout=10)
    assert child.returncode == -signal.SIGKILL
    assert wal_bytes_at_kill > 0, "the kill did not land during a write"

    with caplog.at_level(logging.INFO, logger="wmwatch"):
        # the batches are dated 2026-01-01: keep them, this test is about what the crash left
        watch = wmwatch.attach(
            NoQueriesSession(), db=str(db), metrics_port=None, listener="stock", retention_days=None
        )
        watch.close()
    messages = [r.getMessage() for r in caplog.records]
    recovered = [m for m in messages if "recovered after an unclean stop" in m]
    assert recovered, messages
    assert any("not closed cleanly" in m and "replayed" in m for m in messages)

    for query_id in ("kill_a", "kill_b"):
        ((count, distinct, low, high),) = _rows(
            db,
            "SELECT count(*), count(DISTINCT batch_id), min(batch_id), max(batch_id) FROM batches "
            "WHERE query_id = ?",
            [query_id],
        )
        assert count == distinct == high + 1 and low == 0, (
            "a committed prefix, no gap, no duplicate"
        )
        assert high >= committed
        assert f"{query_id}: {count} batches (last #{high})" in recovered[0]
        assert _rows(db, "SELECT count(*) FROM operators WHERE query_id = ?", [query_id]) == [
            (count,)
        ]
        ((audits, audit_distinct, audit_high),) = _rows(
            db,
            "SELECT count(*), count(DISTINCT batch_id), max(batch_id) FROM audit_batches "
            "WHERE query_id = ?",
            [query_id],
        )
        assert audits == audit_distinct == audit_high + 1 and audit_high >= committed
    print(
        f"\n[faults/sigkill] killed with {wal_bytes_at_kill} bytes in the write-ahead log; "
        f"last batch confirmed durable before the kill #{committed}; reopened: {recovered[0]}"
    )


# ----------------------------------------------------------------------------- unwritable db


@contextlib.contextmanager
def _small_tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(
            "cannot mount a tmpfs to fill a disk (needs root / CAP_SYS_ADMIN): "
            f"{done.stderr.strip()}"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(folder: Path) -> Path:
    """Take every free byte of ``folder``'s filesystem."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_CREAT | os.O_WRONLY, 0o600)
    try:
        for size in (1 << 20, 4096, 1):
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * size):
                    pass
    finally:
        os.close(fd)
    return filler


def _chattr(flag: str, path: Path) -> None:
    done = subprocess.run(["chattr", flag, str(path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.fail(
            f"chattr {flag} failed (needs root / CAP_LINUX_IMMUTABLE): {done.stderr.strip()}"
        )


@pytest.mark.spark
@pytest.mark.slow
def test_db_unwritable_while_running_keeps_query_and_metrics_and_resumes(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    incoming = tmp_path / "in"
    incoming.mkdir()
    stop_feeding = threading.Event()

    def feed() -> None:
        second = 0
        while not stop_feeding.is_set():
            second += 1
            write_events(
                incoming,
                [{"ts": f"2026-01-01T00:{second // 60 % 60:02d}:{second % 60:02d}Z", "user": "u"}],
            )
            time.sleep(0.25)

    figures: list[str] = []
    with (
        _small_tmpfs(tmp_path / "disk", "24m") as disk,
        caplog.at_level(logging.WARNING, logger="wmwatch"),
    ):
        db = disk / "history.duckdb"
        watch = wmwatch.attach(spark, db=str(db), metrics_port=free_port())
        assert watch.metrics_url is not None
        watch.store.flush_interval_seconds = 0.2  # write often, so each fault is hit at once
        url = watch.metrics_url
        query = (
            spark.readStream.schema("ts timestamp, user string")
            .json(str(incoming))
            .withWatermark("ts", "5 seconds")
            .writeStream.format("noop")
            .queryName("keeps_running")
            .trigger(processingTime="200 milliseconds")
            .option("checkpointLocation", str(tmp_path / "cp"))
            .start()
        )
        feeder = threading.Thread(target=feed, daemon=True)
        feeder.start()
        label = (("query", "keeps_running"),)

        def metric(name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
            return scrape(url).get((name, labels), -1.0)

        def phase(name: str, break_it: Callable[[], None], fix_it: Callable[[], None]) -> None:
            _wait_for(
                lambda: (
                    metric("wmwatch_store_up") == 1 and metric("wmwatch_last_batch_id", label) >= 0
                ),
                30,
                "the store up before the fault",
            )
            break_it()
            broken_at = metric("wmwatch_last_batch_id", label)
            began = time.monotonic()
            _wait_for(lambda: metric("wmwatch_store_up") == 0, 30, f"wmwatch_store_up 0 ({name})")
            # metrics keep following the query while the history cannot be written
            _wait_for(
                lambda: metric("wmwatch_last_batch_id", label) >= broken_at + 3,
                60,
                f"batches to go on ({name})",
            )
            assert query.isActive
            pending = metric("wmwatch_store_pending_writes")
            assert pending > 0
            down_for = time.monotonic() - began
            fix_it()
            _wait_for(lambda: metric("wmwatch_store_up") == 1, 30, f"writing to resume ({name})")
            assert watch.flush(timeout=30)
            figures.append(
                f"{name}: down {down_for:.1f} s with {pending:.0f} writes pending, then resumed"
            )

        def contiguous_since(first: int) -> tuple[int, int]:
            # read through the writer: DuckDB allows one attachment of a file per process
            recorded = watch.store.read(
                lambda con: con.execute(
                    "SELECT batch_id FROM batches WHERE query_id = ? ORDER BY 1", [str(query.id)]
                ).fetchall()
            )
            ids = [r[0] for r in recorded if r[0] >= first]
            assert ids == list(range(first, first + len(ids))), "a batch was lost or duplicated"
            return len(ids), ids[-1]

        try:
            # 1. immutable file: even root cannot write it
            phase(
                "immutable file (chattr +i)", lambda: _chattr("+i", db), lambda: _chattr("-i", db)
            )
            # 2. a full disk
            fillers: list[Path] = []
            phase(
                "disk full (tmpfs size=24m)",
                lambda: fillers.append(_fill(disk)),
                lambda: fillers.pop().unlink(),
            )
            count, last = contiguous_since(0)
            assert count == last + 1
            # 3. the file replaced by a folder (deleting it deletes its history: the pending
            #    writes must still land in the new file)
            marker: list[int] = []

            def replace_with_folder() -> None:
                marker.append(int(metric("wmwatch_last_batch_id", label)))
                db.unlink()
                Path(f"{db}.wal").unlink(missing_ok=True)
                db.mkdir()

            phase("file replaced by a folder", replace_with_folder, lambda: shutil.rmtree(db))
            new_count, _ = contiguous_since(marker[0] + 1)
            assert new_count >= 3
            samples = scrape(url)
            assert samples[("wmwatch_store_dropped_writes_total", ())] == 0
            assert samples[("wmwatch_store_errors_total", ())] >= 3
            assert samples[("wmwatch_query_up", label)] == 1
        finally:
            stop_feeding.set()
            query.stop()
            with contextlib.suppress(Exception):
                _chattr("-i", db)
            watch.close()
    messages = [r.getMessage() for r in caplog.records]
    down = [m for m in messages if "cannot write history" in m]
    assert any("read-only or no permission" in m for m in down), down
    assert any("no space left" in m.lower() for m in down), down
    assert len([m for m in messages if "writing history to" in m and "again" in m]) >= 3
    assert any("was deleted while wmwatch was running" in m for m in messages)
    print("\n[faults/unwritable] " + "; ".join(figures) + f"; reasons logged: {down}")


# ----------------------------------------------------------------------------- metrics port


def test_metrics_port_taken_by_another_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import socket,sys,time\n"
            "s=socket.socket(); s.bind(('127.0.0.1',0)); s.listen()\n"
            "print(s.getsockname()[1], flush=True)\n"
            "time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        port = int(holder.stdout.readline())
        with caplog.at_level(logging.ERROR, logger="wmwatch"):
            watch = wmwatch.attach(NoQueriesSession(), db=None, metrics_port=port, listener="stock")
        try:
            assert watch.metrics_url is None
            (logged,) = [r for r in caplog.records if f"port {port}" in r.getMessage()]
            assert logged.levelno == logging.ERROR and "strict=True" in logged.getMessage()
            # watching goes on without the endpoint: the registry still has everything
            watch._events.offer("started", {"id": "q", "runId": "r", "name": "no_endpoint"})
            assert watch.flush(timeout=10)
            text = generate_latest(watch.registry).decode()
            assert 'wmwatch_query_up{query="no_endpoint"} 1.0' in text
            assert "wmwatch_metrics_server_up 0.0" in text
        finally:
            watch.close()
        with pytest.raises(
            wmwatch.MetricsServerError, match=f"port {port} on 127.0.0.1 is already in use"
        ):
            wmwatch.attach(
                NoQueriesSession(),
                db=str(tmp_path / "h.duckdb"),
                metrics_port=port,
                listener="stock",
                strict=True,
            )
    finally:
        holder.kill()
        holder.wait(timeout=10)


# ----------------------------------------------------------------------------- listener bus


@pytest.mark.slow
def test_spark_listener_bus_drops_are_detected_and_counted(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bus_drops.py"), str(tmp_path), "20"],
        capture_output=True,
        text=True,
        timeout=240,
        env=_env(),
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    recorded = out["recorded_batch_ids"]
    gaps = sum(b - a - 1 for a, b in itertools.pairwise(recorded) if b - a > 1)
    print(
        f"\n[faults/listener bus] last batch #{out['last_batch_id']}, "
        f"{len(recorded)} batches reached "
        f"wmwatch, gaps {gaps}; wmwatch_progress_events_missed_total {out['missed_total']}, "
        f"wmwatch_spark_listener_events_dropped_total {out['spark_dropped_total']}"
    )
    assert out["spark_dropped_total"] is not None and out["spark_dropped_total"] > 0
    assert gaps > 0, "the bus dropped no progress event: the test did not put it under pressure"
    assert out["missed_total"] == gaps
    # stopped, even when the bus dropped its termination event
    assert out["query_up_after_stop"] == 0
    assert "Spark's listener bus dropped" in done.stderr
