"""Kill the driver of an audited Kafka query with SIGKILL mid-stream and restart it on the same
checkpoint and history: each late record is in the history once, every committed batch is
marked, and the late rows equal what Spark dropped, across both runs.

The driver (``tests/audit_kafka_crash_driver.py``) is a process of its own with its own
SparkSession and Spark's Kafka connector; the broker is the run's shared one.
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
from tests.test_audit_kafka_spark import PARTITIONS, event_stream, new_topic, produce, ts
from wmwatch._checkpoint.reader import CheckpointReader

pytestmark = [pytest.mark.spark, pytest.mark.kafka, pytest.mark.slow]

ROOT = Path(__file__).resolve().parent.parent


def _driver(folder: Path, mode: str, bootstrap: str, topic: str, shape: str) -> Any:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.audit_kafka_crash_driver",
            str(folder),
            mode,
            bootstrap,
            topic,
            shape,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def _records(seed: int) -> list[tuple[int, dict[str, Any]]]:
    """``(partition, row)`` with ids in production order; late rows in every partition."""
    return [
        (p, {"id": i, "user": u, "ts": ts(s)})
        for i, (p, s, u) in enumerate(event_stream(seed=seed, count=72))
    ]


def _ends(records: list[tuple[int, dict[str, Any]]]) -> dict[str, int]:
    """The next offset of each partition once ``records`` are in a fresh topic."""
    counts = Counter(p for p, _ in records)
    return {str(p): counts[p] for p in range(PARTITIONS)}


def _progress(folder: Path) -> dict[int, dict[str, Any]]:
    """The progress events the driver recorded, by batch (both runs; a batch runs once)."""
    path = folder / "progress.jsonl"
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    # a line cut off by the kill is not an event
    events = [json.loads(line) for line in lines if line.endswith("}")]
    return {e["batchId"]: e for e in events if e["numInputRows"] or e["stateOperators"]}


def _wait_for_progress_reaching(folder: Path, topic: str, ends: dict[str, int], proc: Any) -> int:
    """Wait until the progress of a batch that read up to ``ends`` was recorded; its id."""
    deadline = time.monotonic() + 240  # guards against a hang only
    while True:
        assert proc.poll() is None, "the driver stopped before reading the new records"
        for batch_id, event in sorted(_progress(folder).items(), reverse=True):
            end = event["sources"][0]["endOffset"]  # an object for Kafka (text for some sources)
            read = (json.loads(end) if isinstance(end, str) else end).get(topic, {})
            if all(read.get(p, 0) >= n for p, n in ends.items()):
                return batch_id
        assert time.monotonic() < deadline, "no batch read the new records"
        time.sleep(0.05)


@pytest.mark.parametrize("shape", ["dedupe", "window"])
def test_kafka_sigkill_mid_stream_then_restart_each_late_row_once(
    spark: Any, kafka: str, tmp_path: Path, shape: str
) -> None:
    topic = new_topic(kafka)
    records = _records(seed=71)
    # 30 records before the driver starts, 18 more before the kill, the rest after it
    before, through_kill = records[:30], records[:48]
    produce(kafka, topic, before)
    proc = _driver(tmp_path, "run", kafka, topic, shape)
    try:
        _wait_for_status(_status_lines(proc), lambda status: status["batches_audited"] >= 2)
        produce(kafka, topic, through_kill[len(before) :])
        # killed as soon as the batch that read the new records has reported its progress: its
        # audit (0.2 s polls) may not have started, be under way or be written; each must end
        # exact after the restart
        _wait_for_progress_reaching(tmp_path, topic, _ends(through_kill), proc)
        proc.send_signal(signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    produce(kafka, topic, records[len(through_kill) :])
    again = _driver(tmp_path, "finish", kafka, topic, shape)
    finished = _wait_for_status(_status_lines(again), lambda status: "done" in status)
    assert again.wait(240) == 0 and finished["done"] is True
    assert finished["errors"] == 0 and finished["batches_lost"] == 0, finished

    with duckdb.connect(str(tmp_path / "history.duckdb"), read_only=True) as con:
        late = con.execute(
            "SELECT batch_id, epoch_ms(event_time_at), epoch_ms(watermark_at), lateness_seconds, "
            "epoch_ms(window_start_at), epoch_ms(window_end_at), operator_kind, source_file, "
            "row_data::VARCHAR FROM late_rows"
        ).fetchall()
        marks = dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())
    reader = CheckpointReader(str(tmp_path / "checkpoint"))
    committed = reader.committed_batches()
    assert sorted(marks) == committed, "every committed batch audited once"
    late_ids = [json.loads(r[8])["id"] for r in late]
    assert late_ids and len(late_ids) == len(set(late_ids)), "a late record audited twice"
    partition_of = {row["id"]: p for p, row in records}
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
        _check_windows_balance(records, output, late, reader)
    else:
        _check_every_record_accounted(records, output, late_ids)


def spark_dropped_by_batch(folder: Path, reader: CheckpointReader) -> dict[int, int]:
    """Spark's own count of rows dropped by the watermark, per committed batch, across both runs.

    Progress reaches a listener after ``commits/N`` is written, so a SIGKILL can fall between
    them: the batch then has no recorded progress. Only a batch that read no input can be in that
    gap here (the kill waits for the progress of the last batch that read data; what follows is
    a no-data batch that moves the watermark), and a batch that read no input dropped none. That
    is checked from the checkpoint, never assumed.
    """
    progress = _progress(folder)
    dropped = {
        batch: sum(op.get("numRowsDroppedByWatermark", 0) for op in event["stateOperators"])
        for batch, event in progress.items()
    }
    for batch in reader.committed_batches():
        if batch in dropped:
            continue
        entry, before = reader.offsets(batch), reader.offsets(batch - 1)
        assert entry is not None and before is not None, f"batch {batch}: offsets missing"
        assert entry.source_offsets == before.source_offsets, (
            f"committed batch {batch} read input but its progress was never recorded"
        )
        dropped[batch] = 0
    return dropped


def _check_every_record_accounted(
    records: list[tuple[int, dict[str, Any]]], output: list[dict[str, Any]], late_ids: list[int]
) -> None:
    """Across both runs every record was emitted, audited late, or a duplicate of an emitted
    one; none both emitted and late."""
    emitted = {r["id"] for r in output}
    assert not emitted & set(late_ids)
    emitted_keys = {(row["user"], row["ts"]) for _, row in records if row["id"] in emitted}
    for _, row in records:
        if row["id"] not in emitted and row["id"] not in late_ids:
            assert (row["user"], row["ts"]) in emitted_keys, f"{row} vanished"


def _check_windows_balance(
    records: list[tuple[int, dict[str, Any]]],
    output: list[dict[str, Any]],
    late: list[Any],
    reader: CheckpointReader,
) -> None:
    """Every window the last batch's watermark closed: emitted count + audited rows == the
    records of that window, across both runs."""
    from tests.test_audit_kafka_spark import sec_of
    from tests.test_audit_spark import assert_windows_balance

    expected = Counter(
        (int(sec_of(row["ts"])) // 10 * 10_000, int(sec_of(row["ts"])) // 10 * 10_000 + 10_000)
        for _, row in records
    )
    last = reader.offsets(reader.committed_batches()[-1])
    assert last is not None
    assert_windows_balance(dict(expected), output, late, last.watermark_ms)
