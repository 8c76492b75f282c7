"""The stream-stream join scenario: two file streams (left and right) and the pairs of files
that feed them, with late rows on both sides, rows exactly on the watermark and an idle input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.harness.audited import audited_run
from tests.harness.streams import DELAY, ts, write_events

LEFT_SCHEMA = "lid int, lk string, lt timestamp"
RIGHT_SCHEMA = "rid int, rk string, rt timestamp"

# One (left rows, right rows) pair per batch: (id, key, second). With both sides watermarked
# the global watermark is min(max left, max right) - 10 s.
PAIRS: list[tuple[list[tuple[int, str, int]], list[tuple[int, str, int]]]] = [
    ([(1, "a", 1), (2, "b", 4), (3, "c", 20)], [(101, "a", 2), (102, "b", 5), (103, "c", 21)]),
    # judged against 10: left 3 and 10 (exactly on it) late, right 4 late: both sides at once
    ([(4, "d", 3), (5, "e", 10), (6, "f", 25)], [(104, "d", 4), (107, "e", 11), (106, "f", 26)]),
    # judged against 15: left 14 late; the right input is idle, so the watermark waits for it
    # at 16 however far the left runs ahead
    ([(8, "g", 40), (9, "h", 14)], []),
    # judged against 16: left 16 (exactly) late, right 14 late, right 17 kept
    ([(10, "i", 16), (11, "j", 30)], [(110, "i", 17), (111, "j", 14), (112, "g", 41)]),
    # late on both sides however the batches ran (a join whose state is never cleaned runs
    # no no-data batch, so its late rows are judged a batch later)
    ([(12, "k", 2)], [(113, "k", 3)]),
    ([(99, "z", 1000)], [(199, "z", 1000)]),  # moves the watermark past everything
]


def write_pair(folder: Path, index: int) -> Path:
    """Pair ``index`` of :data:`PAIRS`: its left file under ``folder/l`` (returned), then its
    right file, if any, under ``folder/r``."""
    lrows, rrows = PAIRS[index]
    left = write_events(folder / "l", [{"lid": i, "lk": k, "lt": ts(s)} for i, k, s in lrows])
    if rrows:
        write_events(folder / "r", [{"rid": i, "rk": k, "rt": ts(s)} for i, k, s in rrows])
    return left


def pair_streams(spark: Any, folder: Path, batching: str) -> tuple[Any, Any]:
    """The left and right file streams of :data:`PAIRS` under ``folder/l`` and ``folder/r``, no
    watermark yet. ``bulk``: every pair is written first and read one file per batch; ``each``:
    the caller writes each pair (:func:`write_pair`) and processes it."""
    (folder / "l").mkdir(parents=True)
    (folder / "r").mkdir(parents=True)
    left_reader = spark.readStream.schema(LEFT_SCHEMA)
    right_reader = spark.readStream.schema(RIGHT_SCHEMA)
    if batching == "bulk":
        for index in range(len(PAIRS)):
            write_pair(folder, index)
        left_reader = left_reader.option("maxFilesPerTrigger", 1)
        right_reader = right_reader.option("maxFilesPerTrigger", 1)
    return left_reader.json(str(folder / "l")), right_reader.json(str(folder / "r"))


def range_join(how: str) -> Callable[[Any, Any], Any]:
    from pyspark.sql import functions as F

    condition = F.expr("lk = rk AND lt BETWEEN rt - INTERVAL 5 SECONDS AND rt + INTERVAL 5 SECONDS")
    return lambda left, right: left.join(right, condition, how)


def run_join(
    spark: Any,
    folder: Path,
    build: Callable[[Any, Any], Any],
    *,
    name: str,
    batching: str,
    watermark: str = "both",
    left_side: Callable[[Any], Any] | None = None,
    right_side: Callable[[Any], Any] | None = None,
    **audit_options: Any,
) -> dict[str, Any]:
    """Run ``build(left, right)`` with the audit on; ``left_side``/``right_side`` shape an input
    before the join (and are the audit's ``prepare`` for it); ``audit_options`` go to audit().
    ``late`` in the result is the late rows as the join checks read them."""
    left, right = pair_streams(spark, folder, batching)
    if watermark in ("both", "left"):
        left = left.withWatermark("lt", DELAY)
    if watermark in ("both", "right"):
        right = right.withWatermark("rt", DELAY)
    if left_side is not None:
        left = left_side(left)
    if right_side is not None:
        right = right_side(right)

    def feed(query: Any) -> None:
        if batching == "bulk":
            query.awaitTermination(180)
            return
        for index in range(len(PAIRS)):
            write_pair(folder, index)
            query.processAllAvailable()

    result = audited_run(
        spark,
        folder,
        build(left, right),
        [right, left],  # inputs in any order
        name=name,
        feed=feed,
        available_now=batching == "bulk",
        prepare=[right_side, left_side],
        **audit_options,
    )
    result["late"] = result["late_join"]
    return result
