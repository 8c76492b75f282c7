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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry

import wmwatch
from tests.helpers import write_events
from wmwatch._checkpoint.reader import CheckpointReader

pytestmark = pytest.mark.spark

DELAY = "10 seconds"
LEFT_SCHEMA = "lid int, lk string, lt timestamp"
RIGHT_SCHEMA = "rid int, rk string, rt timestamp"


def ts(second: int) -> str:
    minute, sec = divmod(second, 60)
    return f"2026-01-01T00:{minute:02d}:{sec:02d}Z"


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


def ts_iso_ms(epoch_ms: int) -> str:
    """An instant as progress prints it (ISO, milliseconds, Z): such strings sort by time."""
    from datetime import UTC, datetime

    return datetime.fromtimestamp(epoch_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


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
    before the join (and are the audit's ``prepare`` for it); ``audit_options`` go to audit()."""
    (folder / "l").mkdir(parents=True)
    (folder / "r").mkdir(parents=True)
    left_reader = spark.readStream.schema(LEFT_SCHEMA)
    right_reader = spark.readStream.schema(RIGHT_SCHEMA)
    if batching == "bulk":
        for lrows, rrows in PAIRS:
            write_events(folder / "l", [{"lid": i, "lk": k, "lt": ts(s)} for i, k, s in lrows])
            if rrows:
                write_events(folder / "r", [{"rid": i, "rk": k, "rt": ts(s)} for i, k, s in rrows])
        left_reader = left_reader.option("maxFilesPerTrigger", 1)
        right_reader = right_reader.option("maxFilesPerTrigger", 1)
    left = left_reader.json(str(folder / "l"))
    right = right_reader.json(str(folder / "r"))
    if watermark in ("both", "left"):
        left = left.withWatermark("lt", DELAY)
    if watermark in ("both", "right"):
        right = right.withWatermark("rt", DELAY)
    if left_side is not None:
        left = left_side(left)
    if right_side is not None:
        right = right_side(right)
    writer = (
        build(left, right)
        .writeStream.format("memory")
        .queryName(name)
        .outputMode("append")
        .option("checkpointLocation", str(folder / "checkpoint"))
    )
    if batching == "bulk":
        writer = writer.trigger(availableNow=True)
    db = folder / "history.duckdb"
    registry = CollectorRegistry()
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=registry)
    query = writer.start()
    try:
        handle = watch.audit(  # inputs in any order
            query, [right, left], prepare=[right_side, left_side], **audit_options
        )
        if batching == "bulk":
            query.awaitTermination(180)
        else:
            for lrows, rrows in PAIRS:
                write_events(folder / "l", [{"lid": i, "lk": k, "lt": ts(s)} for i, k, s in lrows])
                if rrows:
                    write_events(
                        folder / "r", [{"rid": i, "rk": k, "rt": ts(s)} for i, k, s in rrows]
                    )
                query.processAllAvailable()
        assert handle.sync(120), handle.status()
        status = handle.status()
        progress = list(query.recentProgress)
        output = [r.asDict(recursive=True) for r in spark.table(name).collect()]
        metrics = {
            side: registry.get_sample_value(
                "wmwatch_late_rows_audited_by_operator_total",
                {"query": name, "operator": "0", "kind": "join", "side": side},
            )
            for side in ("left", "right")
        }
        handle.stop()
    finally:
        query.stop()
        watch.close()
    late = late_rows_of(db)
    with duckdb.connect(str(db), read_only=True) as con:
        by_input = con.execute(
            "SELECT late_rows_by_input::VARCHAR FROM audit_batches "
            "WHERE late_rows_by_input IS NOT NULL"
        ).fetchall()
    return {
        "status": status,
        "progress": progress,
        "output": output,
        "late": late,
        "by_input": [json.loads(r[0]) for r in by_input],
        "metrics": metrics,
        "checkpoint": CheckpointReader(str(folder / "checkpoint")),
    }


def late_rows_of(db: Path) -> list[tuple[Any, ...]]:
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(
            "SELECT batch_id, epoch_ms(event_time_at), epoch_ms(watermark_at), operator_kind, "
            "operator_index, join_side, source_index, join_key, row_data::VARCHAR FROM late_rows"
        ).fetchall()


def dropped(progress: list[dict[str, Any]]) -> int:
    return sum(
        op.get("numRowsDroppedByWatermark", 0) for p in progress for op in p["stateOperators"]
    )


def side_ids(result: dict[str, Any], side: str) -> list[int]:
    column = "lid" if side == "left" else "rid"
    return [json.loads(r[8])[column] for r in result["late"] if r[5] == side]


def check_join(result: dict[str, Any], *, sides: tuple[str, ...]) -> None:
    late = result["late"]
    assert late, "the scenario produced no late rows"
    for _batch, event_ms, wm_ms, kind, op_index, side, source_index, key, _data in late:
        assert kind == "join" and op_index == 0 and side in sides
        assert event_ms <= wm_ms  # on the watermark is late
        assert source_index == (0 if side == "left" else 1)
        assert key is not None and json.loads(key)  # the key whose match the row lost
    audited = {s: side_ids(result, s) for s in ("left", "right")}
    for side, ids in audited.items():
        assert len(ids) == len(set(ids)), f"a {side} row was audited twice"
        assert result["metrics"][side] in ((None, 0.0) if not ids else (float(len(ids)),))
    # Spark counts the join's drops for both sides together
    assert len(late) == dropped(result["progress"])
    # no audited row reached the output, not even null-padded by an outer join
    emitted_left = {r.get("lid") for r in result["output"]} - {None}
    emitted_right = {r.get("rid") for r in result["output"]} - {None}
    assert not set(audited["left"]) & emitted_left
    assert not set(audited["right"]) & emitted_right
    # the markers count every late row per side, and agree with the kept rows
    counted = {"left": 0, "right": 0}
    for batch in result["by_input"]:
        for item in batch:
            counted[item["side"]] += item["rows"]
    assert counted == {s: len(audited[s]) for s in counted}


def range_join(how: str) -> Callable[[Any, Any], Any]:
    from pyspark.sql import functions as F

    condition = F.expr("lk = rk AND lt BETWEEN rt - INTERVAL 5 SECONDS AND rt + INTERVAL 5 SECONDS")
    return lambda left, right: left.join(right, condition, how)


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
    assert len(late) == dropped(result["progress"])
    emitted = {r["lid"] for r in result["output"]}
    assert not {json.loads(r[8])["lid"] for r in late} & emitted


def write_pair(folder: Path, index: int) -> None:
    lrows, rrows = PAIRS[index]
    write_events(folder / "l", [{"lid": i, "lk": k, "lt": ts(s)} for i, k, s in lrows])
    if rrows:
        write_events(folder / "r", [{"rid": i, "rk": k, "rt": ts(s)} for i, k, s in rrows])


def run_union(spark: Any, folder: Path, batching: str) -> dict[str, Any]:
    """Like run_join, but the right source is renamed before the watermark: it needs prepare."""
    (folder / "l").mkdir(parents=True)
    (folder / "r").mkdir(parents=True)
    left_reader = spark.readStream.schema(LEFT_SCHEMA)
    right_reader = spark.readStream.schema(RIGHT_SCHEMA)
    if batching == "bulk":
        for index in range(len(PAIRS)):
            write_pair(folder, index)
        left_reader = left_reader.option("maxFilesPerTrigger", 1)
        right_reader = right_reader.option("maxFilesPerTrigger", 1)
    left = left_reader.json(str(folder / "l")).withWatermark("lt", DELAY)
    raw_right = right_reader.json(str(folder / "r"))

    def rename(frame: Any) -> Any:
        return (
            frame.withColumnRenamed("rid", "lid")
            .withColumnRenamed("rk", "lk")
            .withColumn("lt", frame.rt)
            .drop("rt")
        )

    right = rename(raw_right).withWatermark("lt", DELAY)
    query_frame = left.unionByName(right).dropDuplicates(["lk", "lt"])
    db = folder / "history.duckdb"
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=CollectorRegistry())
    writer = (
        query_frame.writeStream.format("memory")
        .queryName(f"union_dedupe_{batching}")
        .outputMode("append")
        .option("checkpointLocation", str(folder / "checkpoint"))
    )
    if batching == "bulk":
        writer = writer.trigger(availableNow=True)
    query = writer.start()
    try:
        handle = watch.audit(query, [left, right], prepare=[None, rename])
        if batching == "bulk":
            query.awaitTermination(180)
        for index in range(len(PAIRS)) if batching == "each" else ():
            write_pair(folder, index)
            query.processAllAvailable()
        assert handle.sync(120), handle.status()
        progress = list(query.recentProgress)
        output = [
            r.asDict(recursive=True) for r in spark.table(f"union_dedupe_{batching}").collect()
        ]
        handle.stop()
    finally:
        query.stop()
        watch.close()
    return {"late": late_rows_of(db), "progress": progress, "output": output}
