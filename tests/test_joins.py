"""Join classification and state-growth analysis: pure logic, no JVM."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from wmwatch._inspect.joins import (
    EVENT_TIME_EQUALITY,
    KEY,
    NO_TIME_CONDITION,
    NO_WATERMARK,
    NONE,
    ONE_SIDE_WATERMARK,
    ONE_SIDED_RANGE,
    RANGE,
    VALUE,
    JoinPlan,
    StateSample,
    analyze_growth,
    classify_join,
    cleanup_kind,
)
from wmwatch._plantext import parse_plan_tree

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def join(left: str, right: str, lwm: bool = True, rwm: bool = True, how: str = "Inner") -> JoinPlan:
    return JoinPlan(0, how, left, right, lwm, rwm)


@pytest.mark.parametrize(
    ("plan", "case", "unbounded"),
    [
        (join(NONE, NONE, False, False), NO_WATERMARK, ("left", "right")),
        (join(NONE, NONE, True, False), ONE_SIDE_WATERMARK, ("left", "right")),
        (join(NONE, NONE), NO_TIME_CONDITION, ("left", "right")),
        (join(NONE, VALUE), ONE_SIDED_RANGE, ("left",)),
        (join(VALUE, NONE), ONE_SIDED_RANGE, ("right",)),
        (join(VALUE, VALUE), RANGE, ()),
        (join(KEY, KEY), EVENT_TIME_EQUALITY, ()),
        (join(VALUE, VALUE, how="FullOuter"), RANGE, ()),
    ],
)
def test_classify(plan: JoinPlan, case: str, unbounded: tuple[str, ...]) -> None:
    check = classify_join(plan)
    assert check.case == case
    assert check.unbounded_sides == unbounded
    assert set(check.fixes) == set(unbounded)
    assert check.bounded is (not unbounded)


def test_fix_names_the_missing_watermark_and_a_range_condition() -> None:
    check = classify_join(join(NONE, NONE, True, False))
    assert check.fixes["right"].startswith(
        "add withWatermark on the right input and add a time-range"
    )
    assert (
        "r.ts BETWEEN l.ts - INTERVAL 10 MINUTES AND l.ts + INTERVAL 10 MINUTES"
        in check.fixes["right"]
    )
    assert "withWatermark" not in classify_join(join(NONE, NONE)).fixes["left"]
    one_sided = classify_join(join(NONE, VALUE)).fixes["left"]
    assert one_sided.startswith("bound the left side too")


def test_cleanup_kind() -> None:
    assert cleanup_kind("JoinStateKeyWatermarkPredicate") == KEY
    assert cleanup_kind("value predicate: (rts#1 <= 5)") == VALUE
    assert cleanup_kind("null") == NONE
    assert cleanup_kind(None) == NONE


def test_parse_plan_tree_depths() -> None:
    text = "A\n+- B\n   :- C\n   :  +- D\n   +- E\n"
    (root,) = parse_plan_tree(text)
    assert root.name == "A"
    (b,) = root.children
    assert [c.name for c in b.children] == ["C", "E"]
    assert b.children[0].children[0].name == "D"


def samples(
    rows: list[int], *, removed: list[int] | None = None, watermark: bool = True
) -> list[StateSample]:
    out = []
    for i, total in enumerate(rows):
        out.append(
            StateSample(
                batch_id=i,
                at=T0 + timedelta(seconds=10 * i),
                watermark_at=(T0 + timedelta(minutes=i)) if watermark else None,
                rows_total=total,
                rows_removed=(removed or [0] * len(rows))[i],
                memory_bytes=total * 100,
                input_rows=6,
            )
        )
    return out


def test_growth_while_the_watermark_advances() -> None:
    growth = analyze_growth(samples([6, 12, 18, 24]))
    assert growth.growing
    assert growth.rows_per_second == pytest.approx(0.6)
    assert growth.bytes_per_second == pytest.approx(60.0)
    # 2400 bytes now, 60 more a second: 10 000 bytes in (10000 - 2400) / 60 s
    assert growth.seconds_to_budget(10_000) == pytest.approx(7600 / 60)
    assert growth.seconds_to_budget(None) is None
    assert growth.evidence()["growing"] is True


def test_growth_without_any_watermark_counts() -> None:
    assert analyze_growth(samples([6, 12, 18], watermark=False)).growing


def test_bounded_state_is_not_growth() -> None:
    growth = analyze_growth(samples([6, 12, 12, 6, 12, 12, 6], removed=[0, 0, 6, 6, 0, 6, 6]))
    assert not growth.growing
    assert growth.rows_removed == 24


def test_too_few_batches_are_not_growth() -> None:
    assert not analyze_growth(samples([6, 12])).growing
    assert not analyze_growth([]).growing


def test_no_data_batches_are_ignored_for_growth() -> None:
    data = samples([6, 12, 18])
    idle = StateSample(3, T0 + timedelta(seconds=35), T0 + timedelta(minutes=3), 18, 0, 1800, 0)
    growth = analyze_growth([*data, idle])
    assert growth.growing and growth.last_batch_id == 2
