"""Kill the driver of an audited Delta query with SIGKILL mid-stream and restart it on the same
checkpoint and history: each late row is in the history once, every committed batch is marked,
and the late rows equal what Spark dropped, across both runs.

The driver (``tests/audit_delta_crash_driver.py``) is a process of its own with its own
SparkSession and Delta's jars; this test's session writes the table, a commit per input file.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests.harness.checks import check_every_record_accounted
from tests.harness.crash import (
    ensure_stopped,
    finish,
    sigkill,
    spark_dropped_by_batch,
    start_driver,
    status_lines,
    wait_for_progress,
    wait_for_status,
)
from tests.harness.delta import append, require_delta
from tests.harness.streams import stream_files
from wmwatch._checkpoint.reader import CheckpointReader

pytestmark = [pytest.mark.spark, pytest.mark.delta, pytest.mark.slow]

DRIVER = "tests.audit_delta_crash_driver"


def _wait_for_progress_reaching(folder: Path, version: int, proc: Any) -> int:
    """Wait until the progress of a batch that read the table's commit ``version`` was
    recorded; its id."""
    return wait_for_progress(
        folder, proc, lambda end: (end["reservoirVersion"], end["index"]) >= (version, 0), "commits"
    )


def test_delta_sigkill_mid_stream_then_restart_each_late_row_once(
    spark: Any, tmp_path: Path
) -> None:
    require_delta()
    table = tmp_path / "table"
    files = stream_files()
    # two commits before the driver starts, two more before the kill, the rest after it
    for f in files[:2]:
        append(spark, table, f)
    proc = start_driver(DRIVER, str(tmp_path), "run", str(table))
    try:
        wait_for_status(status_lines(proc), lambda status: status["batches_audited"] >= 2)
        for f in files[2:4]:
            append(spark, table, f)
        # killed as soon as the batch that read the last commit has reported its progress: its
        # audit (0.2 s polls) may not have started, be under way or be written; each must end
        # exact after the restart
        _wait_for_progress_reaching(tmp_path, 3, proc)
        sigkill(proc)
    finally:
        ensure_stopped(proc)
    for f in files[4:]:
        append(spark, table, f)
    finished = finish(DRIVER, str(tmp_path), "finish", str(table))
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
    check_every_record_accounted(records, output, late_ids)
