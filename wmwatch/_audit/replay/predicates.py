"""The late-row rules of Spark's stateful operators, and reading them off a query plan.

Pure logic, no JVM. Each rule, with the Spark source it comes from and the test that verifies
it: docs/spark-semantics.md. Timestamps are integers in microseconds (``*_us``) as Spark holds
them; watermarks are in milliseconds (``*_ms``) as the checkpoint writes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from wmwatch._errors import AuditError
from wmwatch._time import parse_duration_us

WINDOW = "window"
SESSION = "session"
AGGREGATE = "aggregate"
DEDUPE = "dedupe"
DEDUPE_WITHIN_WATERMARK = "dedupe_within_watermark"
JOIN = "join"
STATE = "state"
KINDS = (WINDOW, SESSION, AGGREGATE, DEDUPE, DEDUPE_WITHIN_WATERMARK, JOIN, STATE)
# Kinds whose Spark count (numRowsDroppedByWatermark) is of groups after partial aggregation, so
# they balance per group against a recomputation rather than row for row.
AGGREGATING_KINDS = (WINDOW, SESSION, AGGREGATE)
SIDES = ("left", "right")


@dataclass(frozen=True, slots=True)
class OperatorSpec:
    """What the audit needs to know about the stateful operator that drops input rows."""

    kind: str
    event_time_column: str
    delay_us: int | None = None
    window_us: int | None = None
    slide_us: int | None = None
    start_us: int = 0
    gap_us: int | None = None
    # which stateful operator (its position in progress ``stateOperators``) and join side
    operator_index: int = 0
    side: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise AuditError(
                f"operator kind {self.kind!r} is unknown; use one of {', '.join(KINDS)}."
            )
        if self.side is not None and self.side not in SIDES:
            raise AuditError(f"join side {self.side!r} is unknown; use left or right.")
        if self.kind == SESSION and (self.gap_us is None or self.gap_us <= 0):
            raise AuditError("a session window needs a positive gap; pass gap=.")
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


def judged_time_us(ts_us: int, spec: OperatorSpec) -> int:
    """The time the operator compares with the watermark for a row at ``ts_us`` (for windows,
    the end of the row's oldest window; for sessions, the end of the row's own session)."""
    if spec.kind == WINDOW:
        return earliest_window_end_us(ts_us, spec)
    if spec.kind == SESSION:
        assert spec.gap_us is not None
        return ts_us + spec.gap_us
    return ts_us


def is_late(ts_us: int | None, late_watermark_ms: int | None, spec: OperatorSpec) -> bool:
    """Whether the operator drops this row (for windows: for at least one of its windows)."""
    if ts_us is None or late_watermark_ms is None:
        return False
    return judged_time_us(ts_us, spec) <= late_watermark_ms * 1000


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
    return judged_time_us(min_event_time_ms * 1000, spec) <= late_watermark_ms * 1000


def override_spec(
    spec: OperatorSpec | None,
    watermark_column: str | None,
    plan_delay_us: int | None,
    *,
    kind: str | None,
    event_time: str | None,
    delay: str | float | None,
    window: str | float | None,
    slide: str | float | None,
    problem: str | None,
) -> OperatorSpec:
    """``spec`` (read off the plan) with explicit overrides; AuditError when still incomplete."""
    if spec is None and kind is None:
        raise AuditError(
            f"cannot audit this query: {problem or 'its plan is not understood'}; "
            "pass kind=, event_time= (and window=, slide= for windows) if it does drop late rows."
        )
    chosen_kind = kind or (spec.kind if spec else None)
    assert chosen_kind is not None
    column = event_time or (spec.event_time_column if spec else None) or watermark_column
    if column is None:
        raise AuditError("the event-time column is unknown; pass event_time=.")
    delay_us = (
        _duration_us(delay) if delay is not None else (spec.delay_us if spec else plan_delay_us)
    )
    window_us = _duration_us(window) if window is not None else (spec.window_us if spec else None)
    if slide is not None:
        slide_us: int | None = _duration_us(slide)
    elif window is not None:
        slide_us = window_us
    else:
        slide_us = spec.slide_us if spec else None
    start_us = spec.start_us if spec and window is None else 0
    operator_index = spec.operator_index if spec else 0
    side = spec.side if spec else None
    if chosen_kind != WINDOW:
        window_us = slide_us = None
        start_us = 0
    return OperatorSpec(
        chosen_kind,
        column,
        delay_us,
        window_us,
        slide_us,
        start_us,
        gap_us=spec.gap_us if spec else None,
        operator_index=operator_index,
        side=side,
    )
