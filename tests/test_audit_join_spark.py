"""The late-row audit of stream-stream joins and unions against real Spark.

Two file streams (left and right) feed one stateful operator. Spark counts a join's dropped
input rows in one figure for both sides, so each join runs three times over the same data:
watermarks on both sides (the audited total must equal Spark's count), and on one side only
(Spark's count is then that side's alone, which proves the per-side split). Every scenario also
checks that no audited row reached the output. The data has rows exactly on the watermark,
late rows on both sides in one batch, an idle input, and no-data batches that move the
watermark; it is run with one file pair per batch and again with availableNow batching.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.harness.audited import audited_run
from tests.harness.checks import check_join, dropped_by_watermark, side_ids
from tests.harness.joins import PAIRS, pair_streams, range_join, run_join, write_pair
from tests.harness.streams import DELAY

pytestmark = pytest.mark.spark


def ts_iso_ms(epoch_ms: int) -> str:
    """An instant as progress prints it (ISO, milliseconds, Z): such strings sort by time."""
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


@pytest.mark.parametrize(
    ("how", "batching"),
    [
        ("inner", "each"),
        ("inner", "bulk"),
        ("leftOuter", "each"),
        ("rightOuter", "each"),
        ("fullOuter", "bulk"),
        ("leftSemi", "each"),
    ],
)
def test_join_sides_balance(spark: Any, stream_dir: Path, how: str, batching: str) -> None:
    result = run_join(
        spark, stream_dir, range_join(how), name=f"join_{how}_{batching}", batching=batching
    )
    check_join(result, sides=("left", "right"))
    if batching == "each":
        # 5 and 10 are exactly on the watermark
        assert sorted(side_ids(result, "left")) == [4, 5, 9, 10, 12]
        assert sorted(side_ids(result, "right")) == [104, 111, 113]
    if (how, batching) == ("inner", "each"):
        check_report(stream_dir / "history.duckdb")
    if batching == "bulk":
        # progress' eventTime describes one withWatermark node only: a batch's reported
        # minimum can be later than a late row another input read in it, which is why the
        # audit of a query with several watermarks does not skip batches by that minimum
        progress = {p["batchId"]: p for p in result["progress"]}
        behind = [
            (batch, event_ms)
            for batch, event_ms, _wm, _k, _op, side, *_ in result["late"]
            if side == "right"
        ]
        assert any(
            progress[batch]["eventTime"]["min"] > ts_iso_ms(event_ms) for batch, event_ms in behind
        )


def check_report(db: Path) -> None:
    """The real CLI shows a join's late rows per side and the keys that lost matches."""
    from typer.testing import CliRunner

    from wmwatch.cli import app

    runner = CliRunner()
    data = runner.invoke(app, ["report", "--db", str(db), "--format", "json"])
    assert data.exit_code == 0, data.output
    (query,) = json.loads(data.output)["queries"]
    late = query["late_rows"]
    assert [(o["side"], o["late_rows"]) for o in late["by_operator"]] == [("left", 5), ("right", 3)]
    lost = {(m["side"], m["join_key"]) for m in late["lost_matches"]}
    assert ("left", '{"lk":"d"}') in lost and ("right", '{"rk":"d"}') in lost
    text = runner.invoke(app, ["report", "--db", str(db)], terminal_width=200)
    assert text.exit_code == 0, text.output
    assert "operator 0 join left side: 5" in text.output
    assert 'operator 0 right side, key {"rk":"d"}: 1 late rows' in text.output


@pytest.mark.parametrize("side", ["left", "right"])
def test_join_one_watermarked_side_is_that_sides_count(
    spark: Any, stream_dir: Path, side: str
) -> None:
    result = run_join(
        spark,
        stream_dir,
        range_join("inner"),
        name=f"join_only_{side}",
        batching="each",
        watermark=side,
    )
    # Spark's count is now this side's alone: the per-side split is exact
    check_join(result, sides=(side,))
    assert side_ids(result, side)


def test_join_on_event_time_key(spark: Any, stream_dir: Path) -> None:
    """Key-based state watermark (the event time is part of the equi-join key)."""
    from pyspark.sql import functions as F

    result = run_join(
        spark,
        stream_dir,
        lambda left, right: left.join(right, F.expr("lk = rk AND lt = rt")),
        name="join_key_time",
        batching="each",
    )
    check_join(result, sides=("left", "right"))


def test_join_with_mixed_state_watermarks(spark: Any, stream_dir: Path) -> None:
    """Mixed: only the left side's join key carries a watermark (the right key is a plain copy
    of its time), which Spark uses to clean both sides by key (``state cleanup [ left key
    predicate, right key predicate ]``), while the right side's own event time is another
    column with its own watermark and a range condition. Each side's late-row filter is still
    its own event time."""
    from pyspark.sql import functions as F

    result = run_join(
        spark,
        stream_dir,
        lambda left, right: left.join(
            right,
            F.expr(
                "lk = rk AND lt = r_at "
                "AND rt BETWEEN lt - INTERVAL 5 SECONDS AND lt + INTERVAL 5 SECONDS"
            ),
        ),
        name="join_mixed",
        batching="each",
        # a copy of the right time without the watermark's metadata: a key, not an event time
        right_side=lambda f: f.withColumn("r_at", F.col("rt") + F.expr("INTERVAL 0 SECONDS")),
    )
    check_join(result, sides=("left", "right"))


def test_join_on_event_time_windows(spark: Any, stream_dir: Path) -> None:
    """Windows in the join keys: each side's late rule judges its window's end."""
    from pyspark.sql import functions as F

    result = run_join(
        spark,
        stream_dir,
        lambda left, right: left.join(right, F.expr("lk = rk AND lw = rw")),
        name="join_key_window",
        batching="each",
        left_side=lambda f: f.select("lid", "lk", F.window("lt", "10 seconds").alias("lw")),
        right_side=lambda f: f.select("rid", "rk", F.window("rt", "10 seconds").alias("rw")),
    )
    check_join(result, sides=("left", "right"))
    for _batch, event_ms, wm_ms, *_ in result["late"]:
        assert event_ms % 10_000 == 0 and event_ms <= wm_ms  # the window's end was judged


@pytest.mark.parametrize(
    ("batching", "policy"), [("each", "min"), ("bulk", "min"), ("each", "max")]
)
def test_union_of_two_sources_balances(
    spark: Any, stream_dir: Path, batching: str, policy: str
) -> None:
    """Two sources unioned into one deduplication: each replayed from its own source log, under
    either multiple-watermark policy (the checkpoint holds the watermark the policy chose)."""
    key = "spark.sql.streaming.multipleWatermarkPolicy"
    before = spark.conf.get(key, None)
    spark.conf.set(key, policy)
    try:
        result = run_union(spark, stream_dir, batching)
    finally:
        if before is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, before)
    late = result["late"]
    assert late
    assert {r[6] for r in late} == {0, 1}  # late rows from both sources
    assert len(late) == dropped_by_watermark(result["progress"])
    emitted = {r["lid"] for r in result["output"]}
    assert not {json.loads(r[8])["lid"] for r in late} & emitted


def run_union(spark: Any, folder: Path, batching: str) -> dict[str, Any]:
    """Like run_join, but the right source is renamed before the watermark: it needs prepare."""
    raw_left, raw_right = pair_streams(spark, folder, batching)
    left = raw_left.withWatermark("lt", DELAY)

    def rename(frame: Any) -> Any:
        return (
            frame.withColumnRenamed("rid", "lid")
            .withColumnRenamed("rk", "lk")
            .withColumn("lt", frame.rt)
            .drop("rt")
        )

    right = rename(raw_right).withWatermark("lt", DELAY)

    def feed(query: Any) -> None:
        if batching == "bulk":
            query.awaitTermination(180)
        for index in range(len(PAIRS)) if batching == "each" else ():
            write_pair(folder, index)
            query.processAllAvailable()

    result = audited_run(
        spark,
        folder,
        left.unionByName(right).dropDuplicates(["lk", "lt"]),
        [left, right],
        name=f"union_dedupe_{batching}",
        feed=feed,
        available_now=batching == "bulk",
        prepare=[None, rename],
    )
    return {**result, "late": result["late_join"]}
