"""Which input rows Spark 4.3's stateful operators drop as late, pinned against real runs.

Every test feeds a streaming query one JSON file per micro-batch and checks two things: the
operator's ``numRowsDroppedByWatermark`` in that batch's progress, and which rows reached the
output. No-data batches are switched off so that each batch is exactly one file and the watermark
each batch judges late rows with is known: batch N uses ``batchWatermarkMs`` of ``offsets/N-1``
(the watermark computed after batch N-2's data). The rules are written up in
docs/spark-semantics.md, which names the test behind each one.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.harness.streams import write_events

pytestmark = pytest.mark.spark

BASE = datetime(2026, 1, 1, tzinfo=UTC)
SCHEMA = "side STRING, k STRING, ts TIMESTAMP"


def t(seconds: float) -> str:
    """The event time ``seconds`` after BASE, as the ISO string the JSON files carry."""
    return (BASE + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def sec(value: datetime | None) -> float | None:
    """A timestamp read back from Spark (UTC session) as seconds after BASE."""
    if value is None:
        return None
    return (value.replace(tzinfo=UTC) - BASE).total_seconds()


def row(side: str, k: str, seconds: float) -> dict[str, str]:
    return {"side": side, "k": k, "ts": t(seconds)}


class Run:
    """One streaming query into a memory sink, fed one file per micro-batch."""

    def __init__(self, spark: Any, folder: Path) -> None:
        self.spark = spark
        self.folder = folder
        self.name = f"sem_{uuid.uuid4().hex[:12]}"
        self.query: Any = None

    def source(self, name: str = "in", schema: str = SCHEMA) -> Any:
        path = self.folder / name
        path.mkdir(exist_ok=True)
        return self.spark.readStream.schema(schema).json(str(path))

    def start(self, frame: Any, mode: str = "append", conf: Mapping[str, str] | None = None) -> Run:
        settings = {"spark.sql.streaming.noDataMicroBatches.enabled": "false", **(conf or {})}
        saved = {key: self.spark.conf.get(key, None) for key in settings}
        for key, value in settings.items():
            self.spark.conf.set(key, value)
        try:  # the query keeps a copy of the session conf taken at start
            self.query = (
                frame.writeStream.format("memory")
                .queryName(self.name)
                .outputMode(mode)
                .option("checkpointLocation", str(self.folder / "checkpoint"))
                .start()
            )
        finally:
            for key, value in saved.items():
                if value is None:
                    self.spark.conf.unset(key)
                else:
                    self.spark.conf.set(key, value)
        return self

    def batch(self, rows: Sequence[Mapping[str, Any]], source: str = "in") -> dict[str, Any]:
        """Run one micro-batch over ``rows`` and return its progress."""
        write_events(self.folder / source, rows)
        self.query.processAllAvailable()
        progress: dict[str, Any] = json.loads(self.query._jsq.lastProgress().json())
        return progress

    def dropped(self, rows: Sequence[Mapping[str, Any]], source: str = "in") -> list[int]:
        """Run one micro-batch; each stateful operator's numRowsDroppedByWatermark in it."""
        progress = self.batch(rows, source)
        return [op["numRowsDroppedByWatermark"] for op in progress["stateOperators"]]

    def output(self) -> list[Any]:
        return list(self.spark.table(self.name).collect())

    def batch_watermark(self, batch_id: int) -> float | None:
        """``batchWatermarkMs`` of ``offsets/<batch_id>`` in seconds after BASE (None if unset)."""
        lines = (self.folder / "checkpoint" / "offsets" / str(batch_id)).read_text().splitlines()
        ms = int(json.loads(lines[1])["batchWatermarkMs"])
        return None if ms == 0 else ms / 1000 - BASE.timestamp()

    def stop(self) -> None:
        if self.query is not None:
            self.query.stop()


@pytest.fixture
def run(spark: Any, tmp_path: Path) -> Iterator[Run]:
    handle = Run(spark, tmp_path)
    yield handle
    handle.stop()


# --------------------------------------------------------------------------------------------
# a. Stream-stream joins
# --------------------------------------------------------------------------------------------


def join_sides(run: Run, left_wm: str | None = "10 seconds", right_wm: str | None = "10 seconds"):
    """Left and right rows from one file source (``side`` = l or r), so each file is one batch."""
    from pyspark.sql import functions as F

    src = run.source()

    def side(name: str, wm: str | None) -> Any:
        frame = src.where(F.col("side") == name)
        if wm is not None:
            frame = frame.withWatermark("ts", wm)
        return frame.select(F.col("k").alias(f"{name}k"), F.col("ts").alias(f"{name}ts"))

    return side("l", left_wm), side("r", right_wm)


RANGE = "lk = rk AND rts BETWEEN lts - INTERVAL 5 SECONDS AND lts + INTERVAL 5 SECONDS"
KEY = "lk = rk AND lts = rts"

# Batch 0 moves both sides' max to 100 s; with a 10 s delay the watermark becomes 90 s and is
# written into offsets/1. Batch 1 still judges late rows with offsets/0 (0), batch 2 with 90 s.
WARMUP = [row("l", "w", 100), row("r", "w", 100)]


def test_join_late_filter_uses_previous_batch_watermark_on_both_sides(run: Run) -> None:
    from pyspark.sql import functions as F

    left, right = join_sides(run)
    run.start(left.join(right, F.expr(KEY)))
    assert run.dropped(WARMUP) == [0]
    # 80 s is behind the 90 s watermark already computed, but batch 1 judges with offsets/0 = 0
    assert run.dropped([row("l", "a", 80), row("r", "a", 80)]) == [0]
    assert run.batch_watermark(0) is None
    assert run.batch_watermark(1) == 90
    # batch 2 judges with 90 s: 90 (on the watermark) is late on each side, 91 is not
    dropped = run.dropped(
        [
            row("l", "b", 90),
            row("r", "b", 90),
            row("l", "c", 91),
            row("r", "c", 91),
        ]
    )
    assert dropped == [2]  # one per side, summed in the join operator
    assert sorted(r.lk for r in run.output()) == ["a", "c", "w"]


def start_join(run: Run, cond: str, how: str = "inner", **wms: str | None) -> Run:
    from pyspark.sql import functions as F

    left, right = join_sides(run, **wms)
    return run.start(left.join(right, F.expr(cond), how))


def warm_up(run: Run) -> None:
    """Batches 0 and 1: after them, late rows are judged against 90 s."""
    assert run.dropped(WARMUP) == [0]
    assert run.dropped([row("l", "f", 100), row("r", "f", 100)]) == [0]
    assert run.batch_watermark(1) == 90


def test_join_range_condition_does_not_shift_the_late_threshold(run: Run) -> None:
    start_join(run, RANGE)
    warm_up(run)
    dropped = run.dropped(
        [
            row("l", "b", 90), row("r", "b", 93),  # left on the watermark: late
            row("r", "c", 90), row("l", "c", 93),  # right on the watermark: late
            row("l", "d", 88), row("r", "d", 92),  # left 88 > 90 - 5: still late
            row("r", "e", 88), row("l", "e", 92),  # right 88 > 90 - 5: still late
            row("l", "g", 91), row("r", "g", 94),  # left 91 < 90 + 5: kept
            row("r", "h", 91), row("l", "h", 95),  # right 91 < 90 + 5: kept
        ]
    )  # fmt: skip
    assert dropped == [4]
    assert sorted(r.lk for r in run.output()) == ["f", "g", "h", "w"]


@pytest.mark.parametrize(
    ("how", "padded"),
    [("left_outer", ["d"]), ("right_outer", ["e"]), ("full_outer", ["d", "e"])],
)
def test_join_late_outer_row_is_never_null_padded(run: Run, how: str, padded: list[str]) -> None:
    start_join(run, RANGE, how)
    warm_up(run)
    dropped = run.dropped(
        [
            row("l", "b", 90),  # late, no partner
            row("r", "c", 90),  # late, no partner
            row("l", "d", 93),  # on time, no partner
            row("r", "e", 93),  # on time, no partner
        ]
    )
    assert dropped == [2]
    # move the watermark far ahead: every unmatched row still in state is evicted and emitted
    run.dropped([row("l", "z", 300), row("r", "z", 300)])
    run.dropped([row("l", "y", 300), row("r", "y", 300)])
    assert run.batch_watermark(4) == 290
    unmatched = sorted((r.lk or r.rk) for r in run.output() if r.lk is None or r.rk is None)
    assert unmatched == padded


def test_join_left_semi_drops_late_rows_on_both_sides(run: Run) -> None:
    start_join(run, RANGE, "left_semi")
    warm_up(run)
    dropped = run.dropped(
        [
            row("l", "b", 90), row("r", "b", 93),  # late left: never emitted
            row("r", "c", 90), row("l", "c", 93),  # late right: never matches
            row("l", "g", 91), row("r", "g", 94),  # on time: emitted
        ]
    )  # fmt: skip
    assert dropped == [2]
    assert sorted(r.lk for r in run.output()) == ["f", "g", "w"]


@pytest.mark.parametrize("watermarked", ["l", "r"])
def test_join_side_without_watermark_drops_nothing(run: Run, watermarked: str) -> None:
    other = "r" if watermarked == "l" else "l"
    wms = {
        "left_wm": None,
        "right_wm": None,
        f"{'left' if watermarked == 'l' else 'right'}_wm": "10 seconds",
    }
    start_join(run, "lk = rk", **wms)
    warm_up(run)
    dropped = run.dropped(
        [
            row(watermarked, "b", 90), row(other, "b", 95),  # watermarked side, late
            row(other, "c", 10), row(watermarked, "c", 95),  # unwatermarked side, 80 s behind
        ]
    )  # fmt: skip
    assert dropped == [1]
    assert sorted(r.lk for r in run.output()) == ["c", "f", "w"]


def window_sides(run: Run, keep_ts: bool) -> tuple[Any, Any]:
    from pyspark.sql import functions as F

    src = run.source()

    def side(name: str) -> Any:
        frame = src.where(F.col("side") == name).withWatermark("ts", "10 seconds")
        cols = [F.col("k").alias(f"{name}k"), F.window("ts", "10 seconds").alias(f"{name}w")]
        if keep_ts:
            cols.append(F.col("ts").alias(f"{name}ts"))
        return frame.select(*cols)

    return side("l"), side("r")


def test_join_on_window_key_judges_window_end(run: Run) -> None:
    from pyspark.sql import functions as F

    left, right = window_sides(run, keep_ts=False)
    run.start(left.join(right, F.expr("lk = rk AND lw = rw")))
    warm_up(run)
    dropped = run.dropped(
        [
            row("l", "b", 90), row("r", "b", 95),  # window [90, 100): end 100 > 90, kept
            row("l", "c", 85), row("r", "c", 85),  # window [80, 90): end 90 <= 90, late
        ]
    )  # fmt: skip
    assert dropped == [2]
    assert sorted(r.lk for r in run.output()) == ["b", "f", "w"]


def test_join_side_with_window_and_raw_time_fails(run: Run) -> None:
    from pyspark.errors import StreamingQueryException
    from pyspark.sql import functions as F

    left, right = window_sides(run, keep_ts=True)
    run.start(left.join(right, F.expr("lk = rk AND lw = rw")))
    with pytest.raises(StreamingQueryException, match="MULTIPLE_EVENT_TIME_COLUMNS"):
        run.batch(WARMUP)


# --------------------------------------------------------------------------------------------
# b. Several inputs: a union of two watermarked streams into a windowed aggregation
# --------------------------------------------------------------------------------------------


def start_union(
    run: Run, policy: str | None = None, watermarked: tuple[str, ...] = ("a", "b"), mode="append"
) -> Run:
    from pyspark.sql import functions as F

    def side(name: str) -> Any:
        frame = run.source(name)
        return frame.withWatermark("ts", "10 seconds") if name in watermarked else frame

    counts = (
        side("a")
        .unionByName(side("b"))
        .groupBy(F.window("ts", "10 seconds"))
        .agg(F.count("*").alias("n"))
        .select(F.col("window.start").alias("start"), "n")
    )
    conf = {"spark.sql.streaming.multipleWatermarkPolicy": policy} if policy else None
    return run.start(counts, mode, conf)


def starts(run: Run) -> list[float | None]:
    return sorted(sec(r.start) for r in run.output())


def test_union_min_policy_idle_inputs_hold_the_watermark(run: Run) -> None:
    start_union(run)
    p0 = run.batch([row("a", "x", 100)], "a")
    p1 = run.batch([row("b", "x", 50)], "b")
    # b had never had a row in batch 0: it counted as watermark 0 and held the global minimum
    assert run.batch_watermark(1) is None
    # b stops; a runs far ahead, the global watermark stays at b's 40
    p2 = run.batch([row("a", "x", 200)], "a")
    assert run.batch_watermark(2) == 40  # min(100 - 10, 50 - 10)
    # batch 3 judges with offsets/2 = 40: window [30, 40) ends on it and is late, [40, 50) is not
    p3 = run.batch([row("a", "x", 35), row("a", "x", 41), row("a", "x", 42)], "a")
    assert run.batch_watermark(3) == 40
    assert p3["stateOperators"][0]["numRowsDroppedByWatermark"] == 1
    # the progress reports the batch's own offsets/N watermark
    for n, p in enumerate([p0, p1, p2, p3]):
        wm = run.batch_watermark(n)
        expected = "1970-01-01T00:00:00.000Z" if wm is None else t(wm)
        assert p["eventTime"]["watermark"] == expected
    # b resumes: the watermark moves to min(200, 300) - 10 and the open windows are emitted
    run.batch([row("b", "x", 300)], "b")
    run.batch([row("a", "x", 300)], "a")
    assert run.batch_watermark(5) == 190
    assert sorted((sec(r.start), r.n) for r in run.output()) == [(40, 2), (50, 1), (100, 1)]


def test_union_max_policy_follows_the_fastest_input(run: Run) -> None:
    start_union(run, "max")
    run.batch([row("a", "x", 100)], "a")
    run.batch([row("b", "x", 50)], "b")
    assert run.batch_watermark(1) == 90  # b had never had a row: the maximum is a's
    # batch 2 judges with 90: b's window [80, 90) is late although b's own watermark is 40
    dropped = run.dropped([row("b", "x", 85), row("b", "x", 95)], "b")
    assert run.batch_watermark(2) == 90
    assert dropped == [1]


@pytest.mark.parametrize(("watermarked", "late"), [(("a",), 1), (("b",), 0)])
def test_union_keeps_the_first_childs_event_time_column(
    run: Run, watermarked: tuple[str, ...], late: int
) -> None:
    start_union(run, watermarked=watermarked, mode="update")
    source = watermarked[0]
    run.batch([row(source, "x", 100)], source)
    run.batch([row(source, "x", 100)], source)
    assert run.batch_watermark(1) == 90  # the watermark advances in both cases
    # a row of window [80, 90) arriving on each input: late only if the union's column (the
    # first child's) carries the watermark
    dropped = run.dropped([row("a", "x", 85)], "a")
    dropped += run.dropped([row("b", "x", 85)], "b")
    assert dropped == [late, late]


# --------------------------------------------------------------------------------------------
# c. Session windows
# --------------------------------------------------------------------------------------------

# batch 2 judges with 90 s; with a 5 s gap a lone row's session ends at ts + 5
SESSION_ROWS = [
    row("", "a", 84),  # ends 89: late
    row("", "b", 85),  # ends 90, on the watermark: late
    row("", "c", 86),  # ends 91: kept although ts 86 is behind the watermark
    row("", "d", 80),  # d: two late rows of one session [80, 87)
    row("", "d", 82),
    row("", "e", 81),  # e: two late rows with the same time
    row("", "e", 81),
]


@pytest.mark.parametrize(("merge_local", "late"), [("false", 5), ("true", 4)])
def test_session_window_judges_session_end(run: Run, merge_local: str, late: int) -> None:
    from pyspark.sql import functions as F

    counts = (
        run.source()
        .withWatermark("ts", "10 seconds")
        .groupBy("k", F.session_window("ts", "5 seconds").alias("s"))
        .agg(F.count("*").alias("n"))
    )
    conf = {"spark.sql.streaming.sessionWindow.merge.sessions.in.local.partition": merge_local}
    run.start(counts, "append", conf)
    run.batch([row("", "w", 100)])
    run.batch([row("", "f", 100)])
    assert run.dropped(SESSION_ROWS) == [late]
    # close every session and read what survived
    run.batch([row("", "z", 300)])
    run.batch([row("", "y", 300)])
    assert sorted((r.k, r.n) for r in run.output()) == [("c", 1), ("f", 1), ("w", 1)]


# --------------------------------------------------------------------------------------------
# f. Aggregation keyed by the raw event time
# --------------------------------------------------------------------------------------------

RAW_KEY_ROWS = [
    row("", "a", 90), row("", "a", 90), row("", "b", 90),  # on the watermark: late
    row("", "a", 89),  # behind it: late
    row("", "a", 91),  # kept
]  # fmt: skip


@pytest.mark.parametrize("mode", ["update", "append"])
@pytest.mark.parametrize(("keys", "late"), [(("ts",), 2), (("k", "ts"), 3)])
def test_aggregation_on_raw_time_counts_late_groups(
    run: Run, mode: str, keys: tuple[str, ...], late: int
) -> None:
    from pyspark.sql import functions as F

    counts = (
        run.source().withWatermark("ts", "10 seconds").groupBy(*keys).agg(F.count("*").alias("n"))
    )
    run.start(counts, mode)
    run.batch([row("", "w", 100)])
    run.batch([row("", "f", 100)])
    # four late rows in three (k, ts) groups, two ts groups: the count is of groups
    assert run.dropped(RAW_KEY_ROWS) == [late]
    run.batch([row("", "z", 300)])
    run.batch([row("", "y", 300)])
    survivors = {sec(r.ts): r.n for r in run.output() if sec(r.ts) < 100}
    assert survivors == {91: 1}


# --------------------------------------------------------------------------------------------
# g. Chains of stateful operators
# --------------------------------------------------------------------------------------------

CHAIN_BATCHES = [
    [row("", "a", 100), row("", "b", 101)],
    [row("", "a", 95), row("", "c", 112)],  # judged with 0: nothing late
    [row("", "a", 85), row("", "b", 102), row("", "c", 125)],  # judged with 91: [80, 90) late
    [row("", "a", 105), row("", "d", 131), row("", "e", 140)],  # judged with 102
    [row("", "f", 300)],
    [row("", "g", 300)],
]


def run_chain(run: Run, frame: Any) -> list[list[int]]:
    run.start(frame, "append")
    return [run.dropped(rows) for rows in CHAIN_BATCHES]


def test_chain_window_then_aggregation_second_drops_nothing(run: Run) -> None:
    from pyspark.sql import functions as F

    per_key = (
        run.source()
        .withWatermark("ts", "10 seconds")
        .groupBy("k", F.window("ts", "10 seconds").alias("w"))
        .agg(F.count("*").alias("n"))
    )
    per_window = per_key.groupBy("w").agg(F.sum("n").alias("n"), F.count("*").alias("keys"))
    dropped = run_chain(run, per_window)
    # operator 0 is the downstream aggregation, 1 the upstream one
    assert [d[0] for d in dropped] == [0] * len(CHAIN_BATCHES)
    assert [d[1] for d in dropped] == [0, 0, 1, 0, 0, 0]
    got = sorted((sec(r.w.start), r.n) for r in run.output())
    assert got == [(90, 1), (100, 4), (110, 1), (120, 1), (130, 1), (140, 1)]


def test_chain_dedup_then_window_second_drops_nothing(run: Run) -> None:
    from pyspark.sql import functions as F

    per_window = (
        run.source()
        .withWatermark("ts", "10 seconds")
        .dropDuplicates(["k", "ts"])
        .groupBy(F.window("ts", "10 seconds").alias("w"))
        .agg(F.count("*").alias("n"))
    )
    dropped = run_chain(run, per_window)
    assert [d[0] for d in dropped] == [0] * len(CHAIN_BATCHES)
    # dedup counts input rows with ts <= 91: the row at 85
    assert [d[1] for d in dropped] == [0, 0, 1, 0, 0, 0]
    got = sorted((sec(r.w.start), r.n) for r in run.output())
    assert got == [(90, 1), (100, 4), (110, 1), (120, 1), (130, 1), (140, 1)]


# --------------------------------------------------------------------------------------------
# d. applyInPandasWithState
# --------------------------------------------------------------------------------------------

# judged with 90 s: three late input rows (two of them in one group) and one on time
PY_ROWS = [row("", "a", 90), row("", "a", 85), row("", "b", 91), row("", "b", 90)]


@pytest.mark.parametrize(("timeout", "late"), [("EventTimeTimeout", 3), ("NoTimeout", 0)])
def test_apply_in_pandas_with_state_drops_only_with_event_time_timeout(
    run: Run, timeout: str, late: int
) -> None:
    def passthrough(key: Any, frames: Any, state: Any) -> Any:
        # every row the function is given comes back out, so the sink shows what got through
        yield from (frame[["k", "ts"]] for frame in frames)

    out = (
        run.source()
        .withWatermark("ts", "10 seconds")
        .groupBy("k")
        .applyInPandasWithState(passthrough, "k string, ts timestamp", "n long", "update", timeout)
    )
    run.start(out, "update")
    run.batch([row("", "w", 100)])
    run.batch([row("", "f", 100)])
    assert run.dropped(PY_ROWS) == [late]
    seen = sorted((r.k, sec(r.ts)) for r in run.output() if r.k in "ab")
    kept = [("a", 85), ("a", 90), ("b", 90), ("b", 91)] if late == 0 else [("b", 91)]
    assert seen == kept


# --------------------------------------------------------------------------------------------
# e. transformWithStateInPandas
# --------------------------------------------------------------------------------------------

ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


@pytest.mark.parametrize(
    ("time_mode", "late"), [("EventTime", 3), ("None", 0), ("ProcessingTime", 0)]
)
def test_transform_with_state_drops_only_in_event_time_mode(
    run: Run, time_mode: str, late: int
) -> None:
    from pyspark.sql.streaming import StatefulProcessor

    class Passthrough(StatefulProcessor):
        def init(self, handle: Any) -> None:
            pass

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:  # noqa: N802, N803
            yield from (frame[["k", "ts"]] for frame in rows)

        def close(self) -> None:
            pass

    out = (
        run.source()
        .withWatermark("ts", "10 seconds")
        .groupBy("k")
        .transformWithStateInPandas(Passthrough(), "k string, ts timestamp", "Update", time_mode)
    )
    run.start(out, "update", {"spark.sql.streaming.stateStore.providerClass": ROCKSDB})
    run.batch([row("", "w", 100)])
    run.batch([row("", "f", 100)])
    assert run.dropped(PY_ROWS) == [late]
    seen = sorted((r.k, sec(r.ts)) for r in run.output() if r.k in "ab")
    kept = [("a", 85), ("a", 90), ("b", 90), ("b", 91)] if late == 0 else [("b", 91)]
    assert seen == kept


def test_join_row_behind_state_watermark_is_joined_then_evicted(run: Run) -> None:
    start_join(run, RANGE, "left_outer")
    assert run.dropped(WARMUP) == [0]
    # batch 1 judges late rows with 0 but evicts with 90: the left state keeps only rows that a
    # right row after 90 could still match (lts > 85), so rows at 80 are in and out in this batch
    dropped = run.dropped([row("l", "q", 80), row("l", "m", 80), row("r", "m", 82)])
    assert dropped == [0]
    got = sorted((r.lk, r.rk) for r in run.output() if r.lk != "w")
    assert got == [("m", "m"), ("q", None)]
