"""Kill the driver of an audited Kafka query with SIGKILL mid-stream and restart it on the same
checkpoint and history: each late record is in the history once, every committed batch is
marked, and the late rows equal what Spark dropped, across both runs.

The driver (``tests/audit_kafka_crash_driver.py``) is a process of its own with its own
SparkSession and Spark's Kafka connector; the broker is the run's shared one.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests.harness.audited import late_rows
from tests.harness.checks import (
    assert_windows_balance,
    check_every_record_accounted,
    tumbling_counts,
)
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
from tests.harness.kafka import PARTITIONS, new_topic, produce, records
from wmwatch._checkpoint.reader import CheckpointReader

pytestmark = [pytest.mark.spark, pytest.mark.kafka, pytest.mark.slow]

DRIVER = "tests.audit_kafka_crash_driver"


def _ends(records: list[tuple[int, dict[str, Any]]]) -> dict[str, int]:
    """The next offset of each partition once ``records`` are in a fresh topic."""
    counts = Counter(p for p, _ in records)
    return {str(p): counts[p] for p in range(PARTITIONS)}


def _wait_for_progress_reaching(folder: Path, topic: str, ends: dict[str, int], proc: Any) -> int:
    """Wait until the progress of a batch that read up to ``ends`` was recorded; its id."""
    return wait_for_progress(
        folder,
        proc,
        lambda end: all(end.get(topic, {}).get(p, 0) >= n for p, n in ends.items()),
        "records",
    )


@pytest.mark.parametrize("shape", ["dedupe", "window"])
@pytest.mark.slow(minutes=2.5)
def test_kafka_sigkill_mid_stream_then_restart_each_late_row_once(
    spark: Any, kafka: str, tmp_path: Path, shape: str
) -> None:
    topic = new_topic(kafka)
    produced = records(seed=71)
    # 30 records before the driver starts, 18 more before the kill, the rest after it
    before, through_kill = produced[:30], produced[:48]
    produce(kafka, topic, before)
    proc = start_driver(DRIVER, str(tmp_path), "run", kafka, topic, shape)
    try:
        wait_for_status(status_lines(proc), lambda status: status["batches_audited"] >= 2)
        produce(kafka, topic, through_kill[len(before) :])
        # killed as soon as the batch that read the new records has reported its progress: its
        # audit (0.2 s polls) may not have started, be under way or be written; each must end
        # exact after the restart
        _wait_for_progress_reaching(tmp_path, topic, _ends(through_kill), proc)
        sigkill(proc)
    finally:
        ensure_stopped(proc)
    produce(kafka, topic, produced[len(through_kill) :])
    finished = finish(DRIVER, str(tmp_path), "finish", kafka, topic, shape)
    assert finished["errors"] == 0 and finished["batches_lost"] == 0, finished

    late = late_rows(tmp_path / "history.duckdb")
    with duckdb.connect(str(tmp_path / "history.duckdb"), read_only=True) as con:
        marks = dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())
    reader = CheckpointReader(str(tmp_path / "checkpoint"))
    committed = reader.committed_batches()
    assert sorted(marks) == committed, "every committed batch audited once"
    late_ids = [json.loads(r[8])["id"] for r in late]
    assert late_ids and len(late_ids) == len(set(late_ids)), "a late record audited twice"
    partition_of = {row["id"]: p for p, row in produced}
    assert len({partition_of[i] for i in late_ids}) >= 2, "late records in several partitions"
    per_batch = Counter(r[0] for r in late)
    assert per_batch == Counter({b: n for b, n in marks.items() if n})
    # Spark's own count, batch by batch across both runs: input rows for the deduplication,
    # late groups (after partial aggregation) for the windowed count
    dropped = spark_dropped_by_batch(tmp_path, reader)
    groups = Counter(batch for batch, _ in {(r[0], r[4]) for r in late})
    counted = per_batch if shape == "dedupe" else groups
    assert sum(dropped.values()) == sum(counted.values()) > 0
    for batch, count in dropped.items():
        assert counted.get(batch, 0) == count, batch
    output = [r.asDict(recursive=True) for r in spark.read.parquet(str(tmp_path / "out")).collect()]
    if shape == "window":
        _check_windows_balance(produced, output, late, reader)
    else:
        check_every_record_accounted(produced, output, late_ids)


def _check_windows_balance(
    produced: list[tuple[int, dict[str, Any]]],
    output: list[dict[str, Any]],
    late: list[Any],
    reader: CheckpointReader,
) -> None:
    """Every window the last batch's watermark closed: emitted count + audited rows == the
    records of that window, across both runs."""
    expected = tumbling_counts([row["ts"] for _, row in produced])
    last = reader.offsets(reader.committed_batches()[-1])
    assert last is not None
    assert_windows_balance(expected, output, late, last.watermark_ms)
