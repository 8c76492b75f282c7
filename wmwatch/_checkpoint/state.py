"""State rows per batch, counted with Spark's ``statestore`` reader from a checkpoint.

``spark.read.format("statestore").option("batchId", N)`` loads state version N+1, the state
batch N committed, whose row count is the ``numRowsTotal`` the listener reports for batch N (a
stream-stream join: the rows of both sides' ``joinSide`` reads, which is what Spark counts).
Many batches are counted in one Spark job (a union of one read per batch, grouped by batch), a
chunk at a time, each chunk bounded in time by :func:`wmwatch._core.spark_jobs.bounded_job`;
when the overall budget runs out the remaining batches are left uncounted, never waited for.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from wmwatch._checkpoint.history import StateOperator
from wmwatch._core.spark_jobs import JobTimeoutError, bounded_job
from wmwatch._text import error_line, get_logger

_log = get_logger("wmwatch.checkpoint")

# Batches per Spark job: one job plans a read per batch, so a chunk must stay quick to plan.
CHUNK_BATCHES = 25
# A checkpoint written with state format 2 (RocksDB's per-batch state ids) loads only when the
# reading session says so; Spark's state reader does not find it out by itself (seen in 4.3).
_FORMAT_KEY = "spark.sql.streaming.stateStore.checkpointFormatVersion"


def count_state_rows(
    spark: Any,
    checkpoint: str,
    operators: Sequence[StateOperator],
    batch_ids: Sequence[int],
    *,
    timeout_seconds: float,
    state_format_version: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[dict[tuple[int, int], int], list[str]]:
    """Rows per (batch id, operator id) for ``batch_ids``, and a line per part left uncounted."""
    with _session_conf(spark, _FORMAT_KEY, str(state_format_version)):
        return _count(spark, checkpoint, operators, batch_ids, timeout_seconds, progress)


@contextlib.contextmanager
def _session_conf(spark: Any, key: str, value: str) -> Iterator[None]:
    """Set a session conf for the reads, and put back what it was (the session may be the
    user's)."""
    before = spark.conf.get(key, None)
    spark.conf.set(key, value)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):
            if before is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, before)


def _count(
    spark: Any,
    checkpoint: str,
    operators: Sequence[StateOperator],
    batch_ids: Sequence[int],
    timeout_seconds: float,
    progress: Callable[[int, int], None] | None,
) -> tuple[dict[tuple[int, int], int], list[str]]:
    counts: dict[tuple[int, int], int] = {}
    problems: list[str] = []
    deadline = time.monotonic() + timeout_seconds
    countable = [op for op in operators if op.countable]
    problems.extend(
        f"operator {op.operator_id} ({op.name}): its state is not counted (kept in column families)"
        for op in operators
        if not op.countable
    )
    done = 0
    total = len(batch_ids) * len(countable)
    for op in countable:
        for start in range(0, len(batch_ids), CHUNK_BATCHES):
            chunk = list(batch_ids[start : start + CHUNK_BATCHES])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                problems.append(
                    f"operator {op.operator_id}: state of batches {chunk[0]}.. not counted, "
                    f"out of time (--timeout {timeout_seconds:g})"
                )
                break
            try:
                with bounded_job(
                    spark,
                    description=f"wmwatch: state rows of operator {op.operator_id}",
                    timeout_seconds=remaining,
                ):
                    found = _count_chunk(spark, checkpoint, op, chunk)
            except JobTimeoutError:
                problems.append(
                    f"operator {op.operator_id}: state of batches {chunk[0]}.. not counted, "
                    f"out of time (--timeout {timeout_seconds:g})"
                )
                break
            except Exception as exc:  # noqa: BLE001 - Spark's errors are many; each is a line
                line = error_line(exc, limit=200)
                _log.warning("state of operator %s not counted: %s", op.operator_id, line)
                problems.append(
                    f"operator {op.operator_id}: state of batches {chunk[0]}-{chunk[-1]} not "
                    f"counted: {line}"
                )
                continue
            for batch_id, rows in found.items():
                counts[(batch_id, op.operator_id)] = rows
            done += len(chunk)
            if progress is not None:
                progress(done, total)
    return counts, problems


def _count_chunk(
    spark: Any, checkpoint: str, op: StateOperator, batch_ids: Sequence[int]
) -> dict[int, int]:
    from pyspark.sql import functions as F

    frames = [
        _read(spark, checkpoint, op, batch_id, side).select(F.lit(batch_id).alias("batch_id"))
        for batch_id in batch_ids
        for side in (("left", "right") if op.is_join else (None,))
    ]
    union = frames[0]
    for frame in frames[1:]:
        union = union.unionAll(frame)
    rows = union.groupBy("batch_id").count().collect()
    found = {int(row["batch_id"]): int(row["count"]) for row in rows}
    # a version with no rows has no group: it holds 0 rows
    return {batch_id: found.get(batch_id, 0) for batch_id in batch_ids}


def _read(spark: Any, checkpoint: str, op: StateOperator, batch_id: int, side: str | None) -> Any:
    reader = (
        spark.read.format("statestore")
        .option("batchId", batch_id)
        .option("operatorId", op.operator_id)
    )
    if side is not None:
        reader = reader.option("joinSide", side)
    elif op.store_names and op.store_names[0] != "default":
        reader = reader.option("storeName", op.store_names[0])
    return reader.load(checkpoint)
