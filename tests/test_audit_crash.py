"""Kill the driver with SIGKILL in the middle of an audited stream, restart it on the same
checkpoints: the audit table still balances against the query's output, with no duplicates."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests.helpers import write_events
from tests.test_audit_spark import assert_windows_balance, batch_window_counts, stream_files
from wmwatch._audit.checkpoint import CheckpointReader

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def _driver(folder: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.audit_crash_driver", str(folder), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _status_lines(proc: subprocess.Popen[str], out: list[dict[str, Any]]) -> threading.Thread:
    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                out.append(json.loads(line))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def test_sigkill_mid_stream_then_restart_balances(spark: Any, stream_dir: Path) -> None:
    files = stream_files()
    for f in files[:3]:
        write_events(stream_dir / "in", f)
    first = _driver(stream_dir, "run")
    seen: list[dict[str, Any]] = []
    _status_lines(first, seen)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (seen and seen[-1]["batches_audited"] >= 2):
            time.sleep(0.2)
        assert seen and seen[-1]["batches_audited"] >= 2, seen[-1:] or "the driver never reported"
        # more input right before the crash, so batches are in flight when it lands
        write_events(stream_dir / "in", files[3])
        time.sleep(1.0)
        first.send_signal(signal.SIGKILL)
    finally:
        if first.poll() is None:
            first.kill()
        first.wait(30)
    written = 4
    assert first.returncode == -signal.SIGKILL
    with duckdb.connect(str(stream_dir / "history.duckdb"), read_only=True) as con:
        marked_at_kill = {
            r[0] for r in con.execute("SELECT batch_id FROM audit_batches").fetchall()
        }
    for f in files[written:]:
        write_events(stream_dir / "in", f)
    second = _driver(stream_dir, "finish")
    done: list[dict[str, Any]] = []
    pump = _status_lines(second, done)
    assert second.wait(240) == 0
    pump.join(10)
    assert done and done[-1]["done"] is True
    committed = CheckpointReader(str(stream_dir / "checkpoint")).committed_batches()
    # the restarted audit resumed after what the killed one had written, and redid nothing else
    assert done[-1]["batches_audited"] == len(set(committed) - marked_at_kill) > 0

    with duckdb.connect(str(stream_dir / "history.duckdb"), read_only=True) as con:
        late = con.execute(
            "SELECT batch_id, epoch_ms(event_time_at), epoch_ms(watermark_at), lateness_seconds, "
            "epoch_ms(window_start_at), epoch_ms(window_end_at), operator_kind, source_file, "
            "row_data::VARCHAR FROM late_rows"
        ).fetchall()
        marks = dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())
    assert len(late) == len(set(late)), "duplicated audit rows"
    assert sorted(marks) == CheckpointReader(str(stream_dir / "checkpoint")).committed_batches()
    assert Counter(r[0] for r in late) == Counter({b: n for b, n in marks.items() if n})
    output = [
        r.asDict(recursive=True) for r in spark.read.parquet(str(stream_dir / "out")).collect()
    ]
    reader = CheckpointReader(str(stream_dir / "checkpoint"))
    last = reader.committed_batches()[-1]
    last_offsets = reader.offsets(last)
    assert last_offsets is not None
    # windows ending at or before the last batch's watermark have been emitted or dropped
    expected = batch_window_counts(spark, stream_dir, "10 seconds", "10 seconds")
    assert_windows_balance(expected, output, late, last_offsets.watermark_ms)
