"""Plan-text parsing (the Spark Connect path) over plans captured from real Spark 4.3 runs."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from wmwatch._inspect.joins import (
    EVENT_TIME_EQUALITY,
    KEY,
    NO_WATERMARK,
    NONE,
    ONE_SIDED_RANGE,
    RANGE,
    VALUE,
    classify_join,
)
from wmwatch._inspect.plan import facts_from_text, operator_watermarks_from_text
from wmwatch._time import interval_seconds

PLANS = Path(__file__).parent / "fixtures" / "plans"


def plan(name: str) -> str:
    return (PLANS / f"{name}.txt").read_text()


@pytest.mark.parametrize(
    ("name", "join_type", "cleanup", "watermarks", "case", "unbounded"),
    [
        (
            "join_no_watermark",
            "Inner",
            (NONE, NONE),
            (False, False),
            NO_WATERMARK,
            ("left", "right"),
        ),
        ("join_one_sided_range", "Inner", (NONE, VALUE), (True, True), ONE_SIDED_RANGE, ("left",)),
        ("join_equality", "Inner", (KEY, KEY), (True, True), EVENT_TIME_EQUALITY, ()),
        ("join_range_left_outer", "LeftOuter", (VALUE, VALUE), (True, True), RANGE, ()),
    ],
)
def test_join_facts_from_explain_text(
    name: str,
    join_type: str,
    cleanup: tuple[str, str],
    watermarks: tuple[bool, bool],
    case: str,
    unbounded: tuple[str, ...],
) -> None:
    facts = facts_from_text(plan(name))
    (join,) = facts.joins
    assert join.operator_id == 0
    assert join.join_type == join_type
    assert (join.left_cleanup, join.right_cleanup) == cleanup
    assert (join.left_has_watermark, join.right_has_watermark) == watermarks
    check = classify_join(join)
    assert check.case == case
    assert check.unbounded_sides == unbounded
    assert facts.operators == ((0, "symmetricHashJoin"),)


def test_one_sided_range_keeps_the_predicate_text() -> None:
    (join,) = facts_from_text(plan("join_one_sided_range")).joins
    assert join.left_predicate is None
    assert join.right_predicate is not None and join.right_predicate.startswith(
        "value predicate: (rts#"
    )
    assert join.condition is not None and "rts#75-T10000ms >= lts#70-T10000ms" in join.condition


def test_chained_aggregation_operators_and_watermark_nodes_from_text() -> None:
    text = plan("union_chained_aggregation")
    facts = facts_from_text(text)
    assert facts.joins == ()
    assert facts.operators == ((0, "stateStoreSave"), (1, "stateStoreSave"))
    assert sorted(n.delay_seconds or 0 for n in facts.watermark_nodes) == [10.0, 60.0]
    at = datetime(2025, 12, 31, 23, 59, tzinfo=UTC)
    assert operator_watermarks_from_text(text) == [(0, at, at), (1, at, at)]


def test_join_operator_watermarks_from_text() -> None:
    (found,) = operator_watermarks_from_text(plan("join_one_sided_range"))
    assert found == (
        0,
        datetime(2026, 1, 1, 0, 0, tzinfo=UTC),
        datetime(2026, 1, 1, 0, 1, tzinfo=UTC),
    )


def test_interval_seconds() -> None:
    assert interval_seconds("10 seconds") == 10.0
    assert interval_seconds("1 minutes") == 60.0
    assert interval_seconds("interval 2 hours 30 minutes") == 9000.0
    assert interval_seconds("soon") is None
    assert interval_seconds(None) is None
