"""Join checks against real Spark: every join case classified from the live plan, growth flagged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry

import wmwatch
from tests.harness.streams import write_events
from wmwatch._inspect.joins import (
    EVENT_TIME_EQUALITY,
    NO_TIME_CONDITION,
    NO_WATERMARK,
    ONE_SIDE_WATERMARK,
    ONE_SIDED_RANGE,
    RANGE,
    parse_join_lines,
)
from wmwatch._inspect.plugin import PlanPlugin

pytestmark = pytest.mark.spark

RANGE_COND = "lk = rk AND rts BETWEEN lts - INTERVAL 10 SECONDS AND lts + INTERVAL 10 SECONDS"


def rows(batch: int) -> list[dict[str, Any]]:
    return [
        {"k": batch * 10 + j, "ts": f"2026-01-01T00:{batch:02d}:{j * 5:02d}Z"} for j in range(3)
    ]


def start_join(
    spark: Any,
    folder: Path,
    *,
    left_wm: str | None,
    right_wm: str | None,
    cond: str,
    how: str = "inner",
    third: str | None = None,
) -> Any:
    from pyspark.sql import functions as F

    def side(name: str, wm: str | None, prefix: str) -> Any:
        frame = spark.readStream.schema("k INT, ts TIMESTAMP").json(str(folder / name))
        if wm:
            frame = frame.withWatermark("ts", wm)
        return frame.select(F.col("k").alias(f"{prefix}k"), F.col("ts").alias(f"{prefix}ts"))

    joined = side("l", left_wm, "l").join(side("r", right_wm, "r"), F.expr(cond), how)
    if third is not None:
        joined = joined.drop("rts").join(side("t", "10 seconds", "t"), F.expr(third), "inner")
    return (
        joined.writeStream.format("noop")
        .option("checkpointLocation", str(folder / "checkpoint"))
        .queryName(f"join_{folder.name}"[:60])
        .start()
    )


def plan_plugin(watch: Any) -> PlanPlugin:
    return next(p for p in watch.plugins() if isinstance(p, PlanPlugin))


def run_batches(
    spark: Any,
    folder: Path,
    batches: int,
    *,
    budget: int | None = None,
    side_count_every: int | None = None,
    **kw: Any,
) -> tuple[Any, PlanPlugin, CollectorRegistry, Any]:
    names = ["l", "r", "t"] if kw.get("third") else ["l", "r"]
    for name in names:
        (folder / name).mkdir()
        write_events(folder / name, rows(0))
    registry = CollectorRegistry()
    watch = wmwatch.attach(
        spark,
        db=str(folder / "h.duckdb"),
        metrics_port=None,
        registry=registry,
        state_budget_bytes=budget,
    )
    plugin = plan_plugin(watch)
    plugin.side_count_every_batches = side_count_every
    query = start_join(spark, folder, **kw)
    query.processAllAvailable()
    for batch in range(1, batches + 1):
        for name in names:
            write_events(folder / name, rows(batch))
        query.processAllAvailable()
    watch.flush()
    plugin.wait_idle()
    return query, plugin, registry, watch


CASES = [
    # id, left wm, right wm, condition, how, case, unbounded sides
    ("no_watermark", None, None, "lk = rk", "inner", NO_WATERMARK, ("left", "right")),
    ("one_side", "10 seconds", None, "lk = rk", "inner", ONE_SIDE_WATERMARK, ("left", "right")),
    (
        "no_time",
        "10 seconds",
        "10 seconds",
        "lk = rk",
        "inner",
        NO_TIME_CONDITION,
        ("left", "right"),
    ),
    (
        "one_range",
        "10 seconds",
        "10 seconds",
        "lk = rk AND rts >= lts",
        "inner",
        ONE_SIDED_RANGE,
        ("left",),
    ),
    ("range", "10 seconds", "10 seconds", RANGE_COND, "inner", RANGE, ()),
    (
        "equality",
        "10 seconds",
        "10 seconds",
        "lk = rk AND lts = rts",
        "inner",
        EVENT_TIME_EQUALITY,
        (),
    ),
    ("left_outer", "10 seconds", "10 seconds", RANGE_COND, "leftOuter", RANGE, ()),
    ("full_outer", "10 seconds", "10 seconds", RANGE_COND, "fullOuter", RANGE, ()),
]


@pytest.mark.parametrize(
    ("left_wm", "right_wm", "cond", "how", "case", "unbounded"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_join_case_classified_and_growth_flagged(
    spark: Any,
    stream_dir: Path,
    left_wm: str | None,
    right_wm: str | None,
    cond: str,
    how: str,
    case: str,
    unbounded: tuple[str, ...],
) -> None:
    query, plugin, registry, watch = run_batches(
        spark, stream_dir, 2, left_wm=left_wm, right_wm=right_wm, cond=cond, how=how
    )
    try:
        label = query.name
        summary = plugin.summary()[label]
        assert summary["joins"] == [
            {"operator_id": 0, "case": case, "unbounded_sides": list(unbounded)}
        ]
        # the text path (Spark Connect) must agree with the py4j path on the same plan
        text = query._jsq.streamingQuery().lastExecution().executedPlan().toString()
        (from_text,) = parse_join_lines(str(text))
        from wmwatch._inspect.joins import classify_join

        assert classify_join(from_text).case == case
        findings = [f for f in summary["findings"] if f["kind"] == "join_state_unbounded"]
        assert sorted(f["side"] for f in findings) == sorted(unbounded)
        for side in ("left", "right"):
            value = registry.get_sample_value(
                "wmwatch_join_state_unbounded", {"query": label, "operator": "0", "side": side}
            )
            assert value == (1.0 if side in unbounded else 0.0)
        for finding in findings:
            assert finding["status"] == "active"
            assert finding["fix"]
            # three data batches are enough to see the growth that will not stop
            assert finding["evidence"]["growth"]["growing"] is True
            assert finding["first_batch_id"] <= 2
        if unbounded:
            rate = registry.get_sample_value(
                "wmwatch_state_growth_rows_per_second",
                {"query": label, "operator": "0", "side": unbounded[0]},
            )
            assert rate is not None and rate > 0
    finally:
        query.stop()
        watch.close()


def test_two_joins_in_one_query_each_judged(spark: Any, stream_dir: Path) -> None:
    query, plugin, _registry, watch = run_batches(
        spark,
        stream_dir,
        3,
        left_wm="10 seconds",
        right_wm="10 seconds",
        cond=RANGE_COND,
        third="lk = tk",
    )
    try:
        joins = plugin.summary()[query.name]["joins"]
        # operator 0 is the most downstream: the key-only join with the third stream
        assert joins == [
            {"operator_id": 0, "case": NO_TIME_CONDITION, "unbounded_sides": ["left", "right"]},
            {"operator_id": 1, "case": RANGE, "unbounded_sides": []},
        ]
        fixes = {
            (f["operator_id"], f["side"]): f["fix"]
            for f in plugin.summary()[query.name]["findings"]
            if f["status"] == "active"
        }
        assert set(fixes) == {(0, "left"), (0, "right")}
        assert "time-range condition" in fixes[(0, "right")]
    finally:
        query.stop()
        watch.close()


def test_finding_recorded_once_with_fix_and_budget(spark: Any, stream_dir: Path) -> None:
    query, _plugin, registry, watch = run_batches(
        spark, stream_dir, 5, left_wm="10 seconds", right_wm=None, cond="lk = rk", budget=10_000_000
    )
    query_id = str(query.id)
    label = query.name
    try:
        remaining = registry.get_sample_value(
            "wmwatch_state_budget_seconds_remaining", {"query": label, "operator": "0"}
        )
        assert remaining is not None and remaining > 0
        assert (
            registry.get_sample_value(
                "wmwatch_findings_active", {"query": label, "kind": "join_state_unbounded"}
            )
            == 2.0
        )
    finally:
        query.stop()
        watch.close()
    con = duckdb.connect(str(stream_dir / "h.duckdb"), read_only=True)
    try:
        found = con.execute(
            "SELECT side, kind, status, fix, evidence, occurrences, first_batch_id, last_batch_id "
            "FROM findings WHERE query_id = ? ORDER BY side",
            [query_id],
        ).fetchall()
    finally:
        con.close()
    # one row per side, updated in place over the batches (not one per batch)
    assert [(r[0], r[1], r[2]) for r in found] == [
        ("left", "join_state_unbounded", "active"),
        ("right", "join_state_unbounded", "active"),
    ]
    right = found[1]
    assert "add withWatermark on the right input" in right[3]
    evidence = json.loads(right[4])
    assert evidence["case"] == ONE_SIDE_WATERMARK
    assert evidence["seconds_to_budget"] > 0
    assert right[5] > 1 and right[7] > right[6]


def test_bounded_join_never_flagged_over_a_long_run(spark: Any, stream_dir: Path) -> None:
    query, plugin, _registry, watch = run_batches(
        spark, stream_dir, 10, left_wm="10 seconds", right_wm="10 seconds", cond=RANGE_COND
    )
    try:
        summary = plugin.summary()[query.name]
        assert summary["joins"][0]["unbounded_sides"] == []
        assert summary["findings"] == []
        growth = plugin._queries[str(query.id)].growth[0]
        assert growth.growing is False and growth.rows_removed > 0
    finally:
        query.stop()
        watch.close()


def test_one_sided_range_per_side_counts_show_which_side_grows(
    spark: Any, stream_dir: Path
) -> None:
    query, plugin, registry, watch = run_batches(
        spark,
        stream_dir,
        5,
        side_count_every=2,
        left_wm="10 seconds",
        right_wm="10 seconds",
        cond="lk = rk AND rts >= lts",
    )
    try:
        (finding,) = plugin.summary()[query.name]["findings"]
        evidence = finding["evidence"]
        assert finding["side"] == "left"
        assert evidence["side_rate_source"] == "statestore reader, per side"
        assert evidence["side_state_rows"] >= 9
        assert evidence["side_rows_per_second"] > 0
        counts = plugin._queries[str(query.id)].side_rows[0]
        first, last = counts[0][1], counts[-1][1]
        # the left side keeps every row; the right side is cleaned by the watermark
        # (at most two batches of right rows wait for their eviction, whenever the count ran)
        assert last["left"] >= first["left"] + 6 and last["right"] <= 6
        labels = {"query": query.name, "operator": "0"}
        left_rate = registry.get_sample_value(
            "wmwatch_state_growth_rows_per_second", {**labels, "side": "left"}
        )
        right_rate = registry.get_sample_value(
            "wmwatch_state_growth_rows_per_second", {**labels, "side": "right"}
        )
        assert left_rate is not None and right_rate is not None and left_rate > max(right_rate, 0)
    finally:
        query.stop()
        watch.close()
