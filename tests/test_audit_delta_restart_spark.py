"""Kill the driver of an audited Delta query with SIGKILL mid-stream and restart it on the same
checkpoint and history: each late row is in the history once, every committed batch is marked,
and the late rows equal what Spark dropped, across both runs.

The driver (``tests/audit_delta_crash_driver.py``) is a process of its own with its own
SparkSession and Delta's jars; this test's session writes the table, a commit per input file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests.test_audit_crash import _status_lines, _wait_for_status
from tests.test_audit_delta_spark import append
from tests.test_audit_kafka_restart_spark import (
    _check_every_record_accounted,
    _progress,
    spark_dropped_by_batch,
)
from tests.test_audit_spark import stream_files
from wmwatch._checkpoint.reader import CheckpointReader

pytestmark = [pytest.mark.spark, pytest.mark.delta, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def _driver(folder: Path, mode: str, table: Path) -> Any:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.audit_delta_crash_driver", str(folder), mode, str(table)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _wait_for_progress_reaching(folder: Path, version: int, proc: Any) -> int:
    """Wait until the progress of a batch that read the table's commit ``version`` was
    recorded; its id."""
    deadline = time.monotonic() + 240  # guards against a hang only
    while True:
        assert proc.poll() is None, "the driver stopped before reading the new commits"
        for batch_id, event in sorted(_progress(folder).items(), reverse=True):
            end = event["sources"][0]["endOffset"]  # an object in the progress JSON
            end = json.loads(end) if isinstance(end, str) else end
            if (end["reservoirVersion"], end["index"]) >= (version, 0):
                return batch_id
        assert time.monotonic() < deadline, "no batch read the new commits"
        time.sleep(0.05)


def test_delta_sigkill_mid_stream_then_restart_each_late_row_once(
    spark: Any, tmp_path: Path
) -> None:
    from tests.conftest import DELTA

    if not DELTA:
        pytest.fail("the Delta tests run on pyspark 4.2 with Delta's jars: run `nox -s delta`")
    table = tmp_path / "table"
    files = stream_files()
    # two commits before the driver starts, two more before the kill, the rest after it
    for f in files[:2]:
        append(spark, table, f)
    proc = _driver(tmp_path, "run", table)
    try:
        _wait_for_status(_status_lines(proc), lambda status: status["batches_audited"] >= 2)
        for f in files[2:4]:
            append(spark, table, f)
        # killed as soon as the batch that read the last commit has reported its progress: its
        # audit (0.2 s polls) may not have started, be under way or be written; each must end
        # exact after the restart
        _wait_for_progress_reaching(tmp_path, 3, proc)
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    for f in files[4:]:
        append(spark, table, f)
    again = _driver(tmp_path, "finish", table)
    finished = _wait_for_status(_status_lines(again), lambda status: "done" in status)
    assert again.wait(240) == 0 and finished["done"] is True
    assert finished["errors"] == 0 and finished["batches_lost"] == 0, finished

    with duckdb.connect(str(tmp_path / "history.duckdb"), read_only=True) as con:
        late = con.execute("SELECT batch_id, row_data::VARCHAR FROM late_rows").fetchall()
        marks = dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())
    committed = CheckpointReader(str(tmp_path / "checkpoint")).committed_batches()
    assert sorted(marks) == committed, "every committed batch audited once"
    rows = [json.loads(r[1]) for r in late]
    late_ids = [r["id"] for r in rows]
    assert late_ids and len(late_ids) == len(set(late_ids)), "a late row audited twice"
    assert all(r["user"].isupper() for r in rows), "replayed without the events' withColumn"
    per_batch = Counter(r[0] for r in late)
    assert per_batch == Counter({b: n for b, n in marks.items() if n})
    # Spark's own count of dropped input rows, batch by batch across both runs
    dropped = spark_dropped_by_batch(tmp_path, CheckpointReader(str(tmp_path / "checkpoint")))
    assert sum(dropped.values()) == sum(per_batch.values()) > 0
    for batch, count in dropped.items():
        assert per_batch.get(batch, 0) == count, batch
    output = [r.asDict(recursive=True) for r in spark.read.parquet(str(tmp_path / "out")).collect()]
    records = [(0, {**row, "user": row["user"].upper()}) for f in files for row in f]
    _check_every_record_accounted(records, output, late_ids)
