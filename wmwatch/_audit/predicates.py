"""The late-row rules of Spark's stateful operators, and reading them off a query plan.

Pure logic, no JVM. What Spark does (re-checked by the conservation tests in
tests/test_audit_spark.py):

- batch N filters late rows with the watermark of batch N-1 (``offsets/N-1``);
- a windowed aggregation drops a row for a window when ``window.end <= watermark``; a sliding
  window is judged per window, so one row can be dropped for some windows and kept for others;
- ``dropDuplicates`` with the event time in its keys and ``dropDuplicatesWithinWatermark`` drop a
  row when ``event_time <= watermark``.

Timestamps are integers in microseconds (``*_us``) as Spark holds them; watermarks are in
milliseconds (``*_ms``) as the checkpoint writes them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from wmwatch._errors import AuditError
from wmwatch._time import parse_duration_us

WINDOW = "window"
DEDUPE = "dedupe"
DEDUPE_WITHIN_WATERMARK = "dedupe_within_watermark"
KINDS = (WINDOW, DEDUPE, DEDUPE_WITHIN_WATERMARK)


@dataclass(frozen=True, slots=True)
class OperatorSpec:
    """What the audit needs to know about the stateful operator that drops input rows."""

    kind: str
    event_time_column: str
    delay_us: int | None = None
    window_us: int | None = None
    slide_us: int | None = None
    start_us: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise AuditError(
                f"operator kind {self.kind!r} is unknown; use one of {', '.join(KINDS)}."
            )
        if self.kind == WINDOW:
            if not self.window_us or self.window_us <= 0:
                raise AuditError(
                    "a window aggregation needs a positive window length; pass window=."
                )
            if self.slide_us is None or self.slide_us <= 0 or self.slide_us > self.window_us:
                raise AuditError(
                    "the window slide must be positive and at most the window length; pass slide=."
                )

    @property
    def is_sliding(self) -> bool:
        return self.kind == WINDOW and self.slide_us != self.window_us


def _duration_us(value: str | float) -> int:
    """A duration given to the audit, in microseconds; unreadable text is an :class:`AuditError`."""
    try:
        return parse_duration_us(value)
    except ValueError as exc:
        raise AuditError(str(exc)) from exc


# -- the rules ---------------------------------------------------------------------------------


def windows_of(
    ts_us: int, window_us: int, slide_us: int, start_us: int = 0
) -> list[tuple[int, int]]:
    """The windows ``[start, end)`` holding ``ts_us``, oldest first, as Spark's ``window()``."""
    last_start = ts_us - ((ts_us - start_us) % slide_us)
    starts = []
    s = last_start
    while s > ts_us - window_us:
        starts.append(s)
        s -= slide_us
    return [(s, s + window_us) for s in reversed(starts)]


def earliest_window_end_us(ts_us: int, spec: OperatorSpec) -> int:
    """The end of the oldest window holding ``ts_us``: no window of this row ends earlier."""
    assert spec.window_us is not None and spec.slide_us is not None
    return windows_of(ts_us, spec.window_us, spec.slide_us, spec.start_us)[0][1]


def late_windows(
    ts_us: int, late_watermark_ms: int | None, spec: OperatorSpec
) -> list[tuple[int, int]]:
    """The windows for which a window aggregation drops the row (``end <= watermark``)."""
    if late_watermark_ms is None:
        return []
    assert spec.window_us is not None and spec.slide_us is not None
    limit_us = late_watermark_ms * 1000
    return [
        w
        for w in windows_of(ts_us, spec.window_us, spec.slide_us, spec.start_us)
        if w[1] <= limit_us
    ]


def is_late(ts_us: int | None, late_watermark_ms: int | None, spec: OperatorSpec) -> bool:
    """Whether the operator drops this row (for windows: for at least one of its windows)."""
    if ts_us is None or late_watermark_ms is None:
        return False
    if spec.kind == WINDOW:
        return bool(late_windows(ts_us, late_watermark_ms, spec))
    return ts_us <= late_watermark_ms * 1000


def batch_may_have_late_rows(
    spec: OperatorSpec, late_watermark_ms: int | None, min_event_time_ms: int | None
) -> bool:
    """False only when the batch's smallest event time proves that no row is late.

    Progress reports ``eventTime.min`` in whole milliseconds, truncated, so it is a lower bound
    of the true minimum and the test stays safe. Unknown minimum means: replay.
    """
    if late_watermark_ms is None:
        return False
    if min_event_time_ms is None:
        return True
    if spec.kind == WINDOW:
        return earliest_window_end_us(min_event_time_ms * 1000, spec) <= late_watermark_ms * 1000
    return min_event_time_ms <= late_watermark_ms


# -- the plan ----------------------------------------------------------------------------------

_WATERMARK_NODE = re.compile(
    r"EventTimeWatermark [0-9a-f-]+, ([^\n]+?)#\d+: [a-z_]+, ([^\n]+?)\s*$", re.M
)
_WATERMARKED_ATTR = re.compile(r"([^\s,\[\]()]+)#\d+-T\d+ms")
_STATEFUL = re.compile(
    r"^[\s:+|-]*~?(Aggregate|Deduplicate|DeduplicateWithinWatermark|Join|FlatMapGroupsWithState|"
    r"TransformWithState\w*|FlatMapGroupsInPandasWithState|SessionWindow\w*)\b(.*)$",
    re.M,
)
_SLIDE = re.compile(r"% (\d+)\)")
_OFFSET = re.compile(r"- (-?\d+)\) % \d+\)")
_WINDOW_LEN = re.compile(r"\+ (\d+)\), LongType, TimestampType\)")


def parse_window_expression(plan_text: str) -> tuple[int, int, int]:
    """(window_us, slide_us, start_us) from the analysed ``window()`` arithmetic in a plan."""
    slides = {int(v) for v in _SLIDE.findall(plan_text)}
    lengths = {int(v) for v in _WINDOW_LEN.findall(plan_text)}
    offsets = {int(v) for v in _OFFSET.findall(plan_text)}
    if len(slides) != 1 or len(lengths) != 1 or len(offsets) > 1:
        raise AuditError(
            "cannot read the window length and slide from the query plan; pass window= and "
            "slide= (and kind='window') to audit()."
        )
    return lengths.pop(), slides.pop(), offsets.pop() if offsets else 0


@dataclass(frozen=True, slots=True)
class ReplayPlan:
    """What a query's plan says about replaying it: the operator whose late-row rule the audit
    applies (``spec``), or, when there is none it can audit, the ``problem``."""

    spec: OperatorSpec | None
    watermark_column: str | None
    delay_us: int | None
    stateful_operators: tuple[str, ...]
    problem: str | None = None


def parse_plan(plan_text: str) -> ReplayPlan:
    """Read the operator the audit needs from a streaming query's analysed logical plan text.

    The audited operator is the first stateful operator above the source (the deepest in the
    printed tree): it is the one that sees input rows.
    """
    wm = _WATERMARK_NODE.search(plan_text)
    watermark_column = wm.group(1) if wm else None
    delay_us = None
    if wm:
        try:
            delay_us = parse_duration_us(wm.group(2))
        except ValueError:
            delay_us = None
    if len(_WATERMARK_NODE.findall(plan_text)) > 1:
        return ReplayPlan(
            None, watermark_column, delay_us, (), "the query has more than one watermark"
        )
    lines = plan_text.splitlines()
    stateful: list[tuple[int, str, str]] = []
    for index, line in enumerate(lines):
        m = _STATEFUL.match(line)
        if m:
            stateful.append((index, m.group(1), m.group(2)))
    names = tuple(name for _, name, _ in stateful)
    if not stateful:
        return ReplayPlan(
            None, watermark_column, delay_us, names, "the query has no stateful operator"
        )
    if watermark_column is None:
        return ReplayPlan(
            None, None, None, names, "the query has no watermark, so it drops no late rows"
        )
    index, name, rest = stateful[-1]
    if name == "DeduplicateWithinWatermark":
        spec = OperatorSpec(DEDUPE_WITHIN_WATERMARK, watermark_column, delay_us)
        return ReplayPlan(spec, watermark_column, delay_us, names)
    if name == "Deduplicate":
        keys = _WATERMARKED_ATTR.findall(rest)
        if not keys:
            return ReplayPlan(
                None,
                watermark_column,
                delay_us,
                names,
                "dropDuplicates without the event-time column in its keys drops no late rows",
            )
        return ReplayPlan(
            OperatorSpec(DEDUPE, keys[0], delay_us), watermark_column, delay_us, names
        )
    if name == "Aggregate":
        grouping = rest.split("], [", 1)[0]
        keys = _WATERMARKED_ATTR.findall(grouping)
        if not keys:
            return ReplayPlan(
                None,
                watermark_column,
                delay_us,
                names,
                "the aggregation does not group by an event-time window, so it drops no late rows",
            )
        # The window struct is built by the Project or Expand right below the aggregate.
        below = "\n".join(lines[index + 1 : index + 4])
        if keys[0] == watermark_column or "precisetimestampconversion" not in below:
            return ReplayPlan(
                None,
                watermark_column,
                delay_us,
                names,
                "the aggregation groups by the event-time column itself rather than a window()",
            )
        try:
            window_us, slide_us, start_us = parse_window_expression(below)
        except AuditError as exc:
            return ReplayPlan(None, watermark_column, delay_us, names, str(exc))
        spec = OperatorSpec(WINDOW, watermark_column, delay_us, window_us, slide_us, start_us)
        return ReplayPlan(spec, watermark_column, delay_us, names)
    return ReplayPlan(
        None,
        watermark_column,
        delay_us,
        names,
        f"the first stateful operator is {name}, which the audit does not support "
        "(supported: window aggregations, dropDuplicates with the event time, "
        "dropDuplicatesWithinWatermark)",
    )


def apply_overrides(
    plan: ReplayPlan,
    *,
    kind: str | None,
    event_time: str | None,
    delay: str | float | None,
    window: str | float | None,
    slide: str | float | None,
) -> OperatorSpec:
    """The plan's spec with explicit keyword overrides; raises AuditError when still incomplete."""
    spec = plan.spec
    if spec is None and kind is None:
        raise AuditError(
            f"cannot audit this query: {plan.problem or 'its plan is not understood'}; "
            "pass kind=, event_time= (and window=, slide= for windows) if it does drop late rows."
        )
    chosen_kind = kind or (spec.kind if spec else None)
    assert chosen_kind is not None
    column = event_time or (spec.event_time_column if spec else None) or plan.watermark_column
    if column is None:
        raise AuditError("the event-time column is unknown; pass event_time=.")
    delay_us = (
        _duration_us(delay) if delay is not None else (spec.delay_us if spec else plan.delay_us)
    )
    window_us = _duration_us(window) if window is not None else (spec.window_us if spec else None)
    if slide is not None:
        slide_us: int | None = _duration_us(slide)
    elif window is not None:
        slide_us = window_us
    else:
        slide_us = spec.slide_us if spec else None
    start_us = spec.start_us if spec and window is None else 0
    if chosen_kind != WINDOW:
        return OperatorSpec(chosen_kind, column, delay_us)
    return OperatorSpec(WINDOW, column, delay_us, window_us, slide_us, start_us)
