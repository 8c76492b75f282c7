"""The late-row rules and plan reading, without a JVM.

The plan texts in tests/fixtures/audit_plans/ are ``analyzedPlan().toString()`` of real Spark 4.3
streaming queries (regenerate with ``python -m tests.audit_plan_fixtures``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from wmwatch._audit.replay.plan import ReplayPlan, apply_overrides, parse_plan
from wmwatch._audit.replay.predicates import (
    AGGREGATE,
    DEDUPE,
    DEDUPE_WITHIN_WATERMARK,
    JOIN,
    SESSION,
    STATE,
    WINDOW,
    OperatorSpec,
    batch_may_have_late_rows,
    earliest_window_end_us,
    is_late,
    late_windows,
    windows_of,
)
from wmwatch._errors import AuditError

PLANS = Path(__file__).parent / "fixtures" / "audit_plans"
S = 1_000_000  # microseconds per second


def plan(name: str) -> str:
    return (PLANS / f"{name}.txt").read_text()


def test_tumbling_windows() -> None:
    assert windows_of(5 * S, 10 * S, 10 * S) == [(0, 10 * S)]
    assert windows_of(10 * S, 10 * S, 10 * S) == [(10 * S, 20 * S)]  # start inclusive
    assert windows_of(-1, 10 * S, 10 * S) == [(-10 * S, 0)]


def test_sliding_and_offset_windows() -> None:
    assert windows_of(12 * S, 10 * S, 5 * S) == [(5 * S, 15 * S), (10 * S, 20 * S)]
    assert windows_of(3 * S, 10 * S, 10 * S, 2 * S) == [(2 * S, 12 * S)]
    assert windows_of(1 * S, 10 * S, 10 * S, 2 * S) == [(-8 * S, 2 * S)]


@given(
    ts=st.integers(-(10**12), 10**12),
    window=st.integers(1, 10**8),
    slide_divisor=st.integers(1, 6),
    start=st.integers(0, 10**8),
)
def test_windows_match_their_definition(
    ts: int, window: int, slide_divisor: int, start: int
) -> None:
    slide = max(1, window // slide_divisor)
    start = start % slide
    got = windows_of(ts, window, slide, start)
    assert got and all(s <= ts < e and e - s == window and (s - start) % slide == 0 for s, e in got)
    assert len(got) == len({s for s, _ in got})
    # no window of the grid that holds ts is missing
    assert got[0][0] - slide <= ts - window and got[-1][0] + slide > ts
    assert got == sorted(got)


def test_window_rule_drops_at_equality_and_per_window() -> None:
    tumbling = OperatorSpec(WINDOW, "ts", window_us=10 * S, slide_us=10 * S)
    assert is_late(3 * S, 10_000, tumbling)  # window [0,10) ends exactly on the watermark
    assert not is_late(10 * S, 10_000, tumbling)  # [10,20) still open
    assert not is_late(9 * S, 9_999, tumbling)  # behind the watermark, window open
    sliding = OperatorSpec(WINDOW, "ts", window_us=10 * S, slide_us=5 * S)
    assert late_windows(12 * S, 15_000, sliding) == [(5 * S, 15 * S)]
    assert late_windows(12 * S, 14_999, sliding) == []
    assert late_windows(12 * S, None, sliding) == []


def test_dedupe_rule_drops_at_equality() -> None:
    for kind in (DEDUPE, DEDUPE_WITHIN_WATERMARK):
        spec = OperatorSpec(kind, "ts")
        assert is_late(30 * S, 30_000, spec)
        assert not is_late(30 * S + 1, 30_000, spec)
        assert not is_late(None, 30_000, spec)
        assert not is_late(1, None, spec)


@given(
    kind=st.sampled_from([WINDOW, DEDUPE]),
    wm_ms=st.integers(0, 10**7),
    min_ms=st.integers(0, 10**7),
    rows_us=st.lists(st.integers(0, 10**10), max_size=20),
    window_s=st.integers(1, 30),
    slide_div=st.integers(1, 3),
)
def test_skip_decision_is_safe(
    kind: str, wm_ms: int, min_ms: int, rows_us: list[int], window_s: int, slide_div: int
) -> None:
    """When the batch minimum says "nothing late", no row at or above that minimum is late."""
    if kind == WINDOW:
        window = window_s * S
        spec = OperatorSpec(WINDOW, "ts", window_us=window, slide_us=max(1, window // slide_div))
    else:
        spec = OperatorSpec(DEDUPE, "ts")
    if not batch_may_have_late_rows(spec, wm_ms, min_ms):
        # progress truncates the minimum to the millisecond: rows lie at or above min_ms * 1000
        for extra in rows_us:
            assert not is_late(min_ms * 1000 + extra, wm_ms, spec)


def test_skip_decision_examples() -> None:
    dedupe = OperatorSpec(DEDUPE, "ts")
    assert batch_may_have_late_rows(dedupe, 30_000, 30_000)
    assert not batch_may_have_late_rows(dedupe, 30_000, 30_001)
    assert batch_may_have_late_rows(dedupe, 30_000, None)  # unknown: replay
    assert not batch_may_have_late_rows(dedupe, None, 0)  # batch 0 filters nothing
    window = OperatorSpec(WINDOW, "ts", window_us=10 * S, slide_us=10 * S)
    # rows behind the watermark whose windows are all open: nothing late
    assert not batch_may_have_late_rows(window, 15_000, 10_000)
    assert batch_may_have_late_rows(window, 15_000, 9_999)
    assert (
        earliest_window_end_us(12 * S, OperatorSpec(WINDOW, "ts", window_us=10 * S, slide_us=5 * S))
        == 15 * S
    )


def overridden(facts: ReplayPlan, **given: str | float | None) -> OperatorSpec:
    options: dict[str, str | float | None] = dict.fromkeys(
        ("kind", "event_time", "delay", "window", "slide")
    )
    options.update(given)
    spec = apply_overrides(facts, **options).spec  # type: ignore[arg-type]  # options of every type, as a user passes them
    assert spec is not None
    return spec


def test_durations() -> None:
    facts = parse_plan(plan("tumbling"))

    def window_us(window: str | float) -> int | None:
        return overridden(facts, window=window).window_us

    assert window_us("10 seconds") == 10 * S
    assert window_us("1 minute 30 seconds") == 90 * S
    assert window_us("500 milliseconds") == S // 2
    assert window_us("2 hours") == 7200 * S
    assert window_us(2.5) == 2_500_000
    with pytest.raises(AuditError, match="duration"):
        window_us("soon")
    with pytest.raises(AuditError, match="unit"):
        window_us("3 fortnights")


def test_plan_tumbling_window() -> None:
    facts = parse_plan(plan("tumbling"))
    assert facts.spec == OperatorSpec(WINDOW, "ts", 10 * S, 10 * S, 10 * S, 0)


def test_plan_sliding_window() -> None:
    facts = parse_plan(plan("sliding"))
    assert facts.spec == OperatorSpec(WINDOW, "ts", 10 * S, 10 * S, 5 * S, 0)
    assert facts.spec is not None and facts.spec.is_sliding


def test_plan_window_with_start_offset_and_alias() -> None:
    offset = parse_plan(plan("offset")).spec
    assert offset is not None and (offset.window_us, offset.slide_us, offset.start_us) == (
        10 * S,
        10 * S,
        2 * S,
    )
    alias = parse_plan(plan("alias")).spec
    assert alias is not None and alias.window_us == 60 * S


def test_plan_deduplications() -> None:
    assert parse_plan(plan("dedupe")).spec == OperatorSpec(DEDUPE, "ts", 10 * S)
    assert parse_plan(plan("dedupe_within_watermark")).spec == OperatorSpec(
        DEDUPE_WITHIN_WATERMARK, "ts", 10 * S
    )


def test_plans_that_drop_nothing_say_why() -> None:
    keys = parse_plan(plan("dedupe_without_event_time"))
    assert keys.spec is None and keys.problem and "without the event-time column" in keys.problem
    agg = parse_plan(plan("aggregate_by_key"))
    assert agg.spec is None and agg.problem and "event time" in agg.problem
    none = parse_plan(plan("no_watermark"))
    assert none.spec is None and none.problem and "no watermark" in none.problem


def test_plan_join_sides() -> None:
    facts = parse_plan(plan("join"))
    left, right = facts.inputs
    assert (left.source_index, right.source_index) == (0, 1)
    assert left.spec == OperatorSpec(JOIN, "ts", 10 * S, side="left")
    assert right.spec == OperatorSpec(JOIN, "ts2", 10 * S, side="right")
    assert left.join_keys == ("id",) and right.join_keys == ("id",)


def test_overrides() -> None:
    facts = parse_plan(plan("tumbling"))
    spec = overridden(facts, window="1 minute")
    assert (spec.window_us, spec.slide_us, spec.start_us) == (60 * S, 60 * S, 0)
    spec = overridden(facts, kind="dedupe", event_time="event_at")
    assert spec == OperatorSpec(DEDUPE, "event_at", 10 * S)
    blank = parse_plan(plan("no_watermark"))
    with pytest.raises(AuditError, match="kind="):
        overridden(blank)
    with pytest.raises(AuditError, match="window"):
        overridden(blank, kind="window", event_time="ts")
    with pytest.raises(AuditError, match="several"):
        overridden(parse_plan(plan("join")), delay="5 seconds")
    with pytest.raises(AuditError, match="gap"):
        OperatorSpec(SESSION, "ts")
    with pytest.raises(AuditError, match="kind"):
        OperatorSpec("sessions", "ts")


def test_plan_join_outer_with_time_range_and_renamed_key() -> None:
    left, right = parse_plan(plan("join_left_outer_range")).inputs
    # the range condition moves state eviction only: both sides judge their own column
    assert left.spec == OperatorSpec(JOIN, "ts", 10 * S, side="left")
    assert right.spec == OperatorSpec(JOIN, "ts2", 10 * S, side="right")
    assert (left.join_keys, right.join_keys) == (("id",), ("rid",))


def test_plan_join_side_without_watermark_drops_nothing() -> None:
    left, right = parse_plan(plan("join_one_side")).inputs
    assert left.spec is not None and left.spec.side == "left"
    assert right.spec is None and not right.drops and "no watermark" in (right.reason or "")


def test_plan_union_feeds_one_operator_from_two_sources() -> None:
    facts = parse_plan(plan("union"))
    assert [i.source_index for i in facts.audited] == [0, 1]
    assert {i.spec for i in facts.audited} == {OperatorSpec(WINDOW, "ts", 10 * S, 10 * S, 10 * S)}


def test_plan_session_window_with_a_gap_expression_is_refused_with_why() -> None:
    facts = parse_plan(plan("session_dynamic_gap"))
    (source,) = facts.inputs
    assert source.spec is None and source.drops
    assert source.reason and "gap" in source.reason and "CASE WHEN" in source.reason
    with pytest.raises(AuditError, match="gap"):
        overridden(facts)


def test_plan_session_window_and_raw_event_time() -> None:
    assert parse_plan(plan("session")).spec == OperatorSpec(SESSION, "ts", 10 * S, gap_us=5 * S)
    assert parse_plan(plan("raw_event_time")).spec == OperatorSpec(AGGREGATE, "ts", 10 * S)


def test_plan_chain_audits_the_first_operator_above_the_source() -> None:
    facts = parse_plan(plan("dedupe_then_window"))
    assert facts.stateful_operators == ("Aggregate", "Deduplicate")
    assert facts.spec == OperatorSpec(DEDUPE, "ts", 10 * S, operator_index=1)


def test_plan_state_functions_drop_only_with_an_event_time_timeout() -> None:
    assert parse_plan(plan("state_event_time")).spec == OperatorSpec(STATE, "ts", 10 * S)
    silent = parse_plan(plan("state_no_timeout"))
    assert silent.spec is None and not silent.inputs[0].drops


def test_session_rule_judges_the_session_end() -> None:
    spec = OperatorSpec(SESSION, "ts", gap_us=5 * S)
    assert is_late(25 * S, 30_000, spec)  # session [25, 30) ends on the watermark
    assert not is_late(25 * S + 1, 30_000, spec)
    assert not batch_may_have_late_rows(spec, 30_000, 25_001)
    assert batch_may_have_late_rows(spec, 30_000, 25_000)


def test_plan_relations_are_the_streaming_leaves_not_the_nodes_above_them() -> None:
    facts = parse_plan(plan("tumbling"))
    (only,) = facts.inputs
    assert only.relation.startswith("StreamingRelation FileSource[")
    assert facts.spec == OperatorSpec(WINDOW, "ts", 10 * S, 10 * S, 10 * S, 0)


def test_spark_connect_explain_text_gives_the_same_rules() -> None:
    """A Connect client sees only the last batch's plans: each source stands as the lowest
    streaming ("~") node above that batch's data, in source order."""
    from wmwatch._audit.replay.connect import ConnectQuery

    class Explained:  # what a Connect StreamingQuery answers, recorded from a real server
        def __init__(self, text: str) -> None:
            self.text = text

        def _execute_streaming_query_cmd(self, cmd: object) -> object:
            return type("R", (), {"explain": type("E", (), {"result": self.text})()})()

    window = ConnectQuery(Explained(plan("connect_tumbling_explain")))
    assert window.planned()
    assert window.checkpoint_root() == "file:/data/checkpoints/clicks"
    assert not window.complete_mode()
    facts = parse_plan(window.plan_text)
    (only,) = facts.inputs
    assert only.relation.startswith("~Project [id#")  # the batch's data for source 0
    assert facts.spec == OperatorSpec(WINDOW, "ts", 10 * S, 10 * S, 10 * S, 0)

    join = ConnectQuery(Explained(plan("connect_join_explain")))
    assert join.planned() and join.checkpoint_root() == "file:/data/checkpoints/joined"
    left, right = parse_plan(join.plan_text).inputs
    assert (left.source_index, right.source_index) == (0, 1)
    assert left.spec is not None and right.spec is not None
    assert (left.spec.kind, left.spec.side, left.spec.event_time_column) == (JOIN, "left", "ts")
    assert (right.spec.side, right.spec.event_time_column) == ("right", "ts2")
    assert left.join_keys == ("k",) and right.join_keys == ("k",)
