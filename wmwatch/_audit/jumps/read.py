"""The Spark side of the watermark-jump forensics: the top rows by event time of the batch that
moved the watermark, read again by the replay with the same protections as late rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from wmwatch._audit.jumps.rules import TOP_ROWS, TopRow, distinct_rows, top_rows_of

if TYPE_CHECKING:
    from wmwatch._audit.replay.engine import Replayer, ReplayInput
    from wmwatch._checkpoint.reader import CheckpointReader

# a timestamp after every real event time: the late-row frame with it filters nothing
_FAR_FUTURE_MS = 253_402_300_799_000  # 9999-12-31T23:59:59Z


def read_top_rows(
    replayer: Replayer, checkpoint: CheckpointReader, batch_id: int, limit: int = TOP_ROWS
) -> tuple[tuple[TopRow, ...], int | None]:
    """The ``limit`` rows of batch ``batch_id`` with the largest event times, over every input
    that read data in it, protected as late rows are; and the input of the first one.

    One top-``limit`` job per input (Spark keeps ``limit`` rows per task, never the batch),
    under the audit's deadline, in its pool, on the calling (audit) thread.
    """
    from pyspark.sql import functions as F

    from wmwatch._audit.replay.sources.base import SOURCE_POSITION_COL
    from wmwatch._core.spark_jobs import bounded_job

    found: list[tuple[Any, ...]] = []
    with bounded_job(
        replayer.spark,
        description=f"wmwatch audit of {replayer.label}: rows that moved the watermark "
        f"in batch {batch_id}",
        timeout_seconds=replayer.job_timeout_seconds,
        pool=replayer.pool,
    ):
        for item in replayer.inputs:
            what = item.source.batch_input(checkpoint, batch_id)
            if what is None:
                continue
            with replayer.checked([(item, what)]):
                found.extend(_top_of_input(replayer, item, what, limit, F, SOURCE_POSITION_COL))
    rows = top_rows_of(found, limit)
    return rows, rows[0].source_index if rows else None


def _top_of_input(
    replayer: Replayer,
    item: ReplayInput,
    what: Any,
    limit: int,
    F: Any,  # noqa: N803 - pyspark.sql.functions, named as PySpark does
    position_col: str,
) -> list[tuple[Any, ...]]:
    raw = replayer._read(item, what)
    frame = replayer.late_rows_frame(item, raw, _FAR_FUTURE_MS, keep=(position_col,))
    # a sliding window repeats each row once per window it falls in: take enough for ``limit``
    # distinct rows, then drop the repeats (bounded: at most 64 copies of each)
    spec = item.spec
    copies = 1
    if spec.window_us and spec.slide_us:
        copies = min(64, -(-spec.window_us // spec.slide_us))
    top = (
        frame.orderBy(F.col("event_time_us").desc_nulls_last())
        .limit(limit * copies)
        .select("event_time_us", "source_index", "source_file", "row_data", position_col)
        .collect()
    )
    rows = [tuple(r) for r in top]
    return distinct_rows(rows)[:limit] if copies > 1 else rows
