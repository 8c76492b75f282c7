"""Stream-stream join checks: which side's state Spark can ever clean, and whether state grows.

Pure functions only (no JVM): :func:`classify_join` turns what the plan says about one
``StreamingSymmetricHashJoinExec`` into a :class:`JoinCheck` with the unbounded sides and a fix
the user can apply; :func:`parse_join_lines` reads the same facts from plan text (Spark
Connect); :func:`analyze_growth` judges a join's state from the numbers progress reports. What
Spark exposes per side: docs/findings.md (How the plan is read).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from wmwatch._plantext import PlanNode, parse_plan_tree, physical_plan_section

# Per-side cleanup as Spark plans it (JoinStateKeyWatermarkPredicate / ...ValueWatermarkPredicate).
KEY = "key"
VALUE = "value"
NONE = "none"

# The join cases wmwatch names (SPARK_FACTS.md, "The executed plan").
NO_WATERMARK = "no_watermark"
ONE_SIDE_WATERMARK = "one_side_watermark"
NO_TIME_CONDITION = "no_time_condition"
ONE_SIDED_RANGE = "one_sided_range"
RANGE = "range"
EVENT_TIME_EQUALITY = "event_time_equality"

SIDES = ("left", "right")


@dataclass(frozen=True, slots=True)
class JoinPlan:
    """What the plan says about one stream-stream join operator."""

    operator_id: int
    join_type: str
    left_cleanup: str
    right_cleanup: str
    left_has_watermark: bool
    right_has_watermark: bool
    left_predicate: str | None = None
    right_predicate: str | None = None
    condition: str | None = None
    state_location: str | None = None  # the checkpoint's state folder (for per-side counts)

    def cleanup(self, side: str) -> str:
        return self.left_cleanup if side == "left" else self.right_cleanup

    def has_watermark(self, side: str) -> bool:
        return self.left_has_watermark if side == "left" else self.right_has_watermark


@dataclass(frozen=True, slots=True)
class JoinCheck:
    """The verdict on one join operator from its plan."""

    plan: JoinPlan
    case: str
    unbounded_sides: tuple[str, ...]
    message: str
    fixes: dict[str, str] = field(default_factory=dict)

    @property
    def bounded(self) -> bool:
        return not self.unbounded_sides


def cleanup_kind(predicate_class_or_text: str | None) -> str:
    """``key``/``value``/``none`` from a predicate's class name or its text."""
    if not predicate_class_or_text:
        return NONE
    text = predicate_class_or_text.strip()
    if text == "null" or text == "None":
        return NONE
    if "KeyWatermarkPredicate" in text or text.startswith("key predicate"):
        return KEY
    if "ValueWatermarkPredicate" in text or text.startswith("value predicate"):
        return VALUE
    return NONE


def classify_join(plan: JoinPlan) -> JoinCheck:
    """Name the case and the sides whose state is never cleaned, with a fix per side."""
    left, right = plan.left_cleanup, plan.right_cleanup
    unbounded = tuple(side for side in SIDES if plan.cleanup(side) == NONE)
    if not unbounded:
        case = EVENT_TIME_EQUALITY if KEY in (left, right) else RANGE
        message = (
            f"join operator {plan.operator_id} ({plan.join_type}): both sides are cleaned by the "
            f"watermark ({left} predicate left, {right} predicate right); state stays bounded"
        )
        return JoinCheck(plan, case, (), message)
    if len(unbounded) == 1:
        case = ONE_SIDED_RANGE
        kept = unbounded[0]
        cleaned = "left" if kept == "right" else "right"
        message = (
            f"join operator {plan.operator_id} ({plan.join_type}): the time condition only bounds "
            f"the {cleaned} side, so every {kept} row is kept in state forever"
        )
    elif not plan.left_has_watermark and not plan.right_has_watermark:
        case = NO_WATERMARK
        message = (
            f"join operator {plan.operator_id} ({plan.join_type}): neither input has a watermark, "
            "so every row of both sides is kept in state forever"
        )
    elif plan.left_has_watermark != plan.right_has_watermark:
        case = ONE_SIDE_WATERMARK
        missing = "left" if not plan.left_has_watermark else "right"
        message = (
            f"join operator {plan.operator_id} ({plan.join_type}): only one input has a watermark "
            f"(none on the {missing}) and there is no usable time condition, so every row of both "
            "sides is kept in state forever"
        )
    else:
        case = NO_TIME_CONDITION
        message = (
            f"join operator {plan.operator_id} ({plan.join_type}): both inputs have watermarks but "
            "the join has no time-range or event-time condition, so Spark can never clean its "
            "state and every row of both sides is kept forever"
        )
    fixes = {side: fix_text(plan, case, side) for side in unbounded}
    return JoinCheck(plan, case, unbounded, message, fixes)


def fix_text(plan: JoinPlan, case: str, side: str) -> str:
    """A concrete change that lets Spark clean ``side``'s state."""
    other = "left" if side == "right" else "right"
    range_hint = (
        "a time-range condition such as "
        "r.ts BETWEEN l.ts - INTERVAL 10 MINUTES AND l.ts + INTERVAL 10 MINUTES "
        "(or equal event-time columns / equal windows in the join keys)"
    )
    steps = []
    for s in (side, other):
        if not plan.has_watermark(s):
            steps.append(f"add withWatermark on the {s} input")
    if case == ONE_SIDED_RANGE:
        bound = "upper" if side == "left" else "lower"
        return (
            f"bound the {side} side too: give the condition an {bound} limit on the {other} side's "
            f"event time relative to the {side} side's, e.g. turn r.ts >= l.ts into {range_hint}"
        )
    steps.append(f"add {range_hint}")
    return " and ".join(steps)


# -- plan text (Spark Connect: explain output; classic: executedPlan().toString()) -------------

_OP_ID = re.compile(r"opId = (\d+)")
_CLEANUP = re.compile(
    r"state cleanup \[ left(?: = |\s)(?P<left>.*?), right(?: = |\s)(?P<right>.*?) \]"
)
_JOIN_TYPES = ("LeftOuter", "RightOuter", "FullOuter", "LeftSemi", "LeftAnti", "Inner", "Cross")


def parse_join_lines(plan_text: str) -> list[JoinPlan]:
    """Every stream-stream join in a physical plan's text, most downstream first."""
    joins: list[JoinPlan] = []
    for root in parse_plan_tree(physical_plan_section(plan_text)):
        for node in root.walk():
            if not node.name.startswith("StreamingSymmetricHashJoin"):
                continue
            line = node.line
            op = _OP_ID.search(line)
            cleanup = _CLEANUP.search(line)
            join_type = next((t for t in _JOIN_TYPES if f"], {t}," in line), "Inner")
            left_text = cleanup.group("left") if cleanup else None
            right_text = cleanup.group("right") if cleanup else None
            left_child = node.children[0] if node.children else None
            right_child = node.children[1] if len(node.children) > 1 else None
            joins.append(
                JoinPlan(
                    operator_id=int(op.group(1)) if op else len(joins),
                    join_type=join_type,
                    left_cleanup=cleanup_kind(left_text),
                    right_cleanup=cleanup_kind(right_text),
                    left_has_watermark=_has_watermark(left_child),
                    right_has_watermark=_has_watermark(right_child),
                    left_predicate=None if cleanup_kind(left_text) == NONE else left_text,
                    right_predicate=None if cleanup_kind(right_text) == NONE else right_text,
                    condition=_between(line, "condition = [", " ], state info"),
                    state_location=_between(line, "state info [ checkpoint = ", ", runId"),
                )
            )
    return joins


def _has_watermark(node: PlanNode | None) -> bool:
    if node is None:
        return False
    # attributes carrying a watermark print as ``ts#12-T10000ms`` all the way up the tree
    return any(
        n.name.startswith("EventTimeWatermark") or re.search(r"#\d+-T\d+ms", n.line) is not None
        for n in node.walk()
    )


def _between(text: str, start: str, end: str) -> str | None:
    i = text.find(start)
    if i < 0:
        return None
    j = text.find(end, i)
    return text[i + len(start) : j if j >= 0 else None].strip() or None


# -- behaviour: state size over batches --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StateSample:
    """One batch's numbers for one join operator."""

    batch_id: int
    at: datetime
    watermark_at: datetime | None
    rows_total: int
    rows_removed: int
    memory_bytes: int
    input_rows: int


@dataclass(frozen=True, slots=True)
class Growth:
    """The verdict on a join operator's state from progress alone."""

    growing: bool
    rows_per_second: float
    bytes_per_second: float
    rows_total: int
    memory_bytes: int
    watermark_advance_seconds: float
    rows_removed: int
    batches: int
    first_batch_id: int | None
    last_batch_id: int | None

    def seconds_to_budget(self, budget_bytes: int | None) -> float | None:
        """Seconds until state bytes reach ``budget_bytes`` at the current rate (0 if past it)."""
        if budget_bytes is None or self.bytes_per_second <= 0:
            return None
        return max(0.0, (budget_bytes - self.memory_bytes) / self.bytes_per_second)

    def evidence(self) -> dict[str, object]:
        return {
            "growing": self.growing,
            "state_rows": self.rows_total,
            "state_memory_bytes": self.memory_bytes,
            "rows_per_second": round(self.rows_per_second, 6),
            "bytes_per_second": round(self.bytes_per_second, 3),
            "watermark_advance_seconds": self.watermark_advance_seconds,
            "rows_removed_in_window": self.rows_removed,
            "batches": self.batches,
            "first_batch_id": self.first_batch_id,
            "last_batch_id": self.last_batch_id,
        }


def analyze_growth(samples: Sequence[StateSample], *, min_batches: int = 3) -> Growth:
    """Judge the last batches: is state growing while the watermark advances?

    Only batches that took input count (a no-data batch can neither add rows nor show growth).
    ``growing`` needs at least ``min_batches`` such batches in which the total never shrank and
    rose overall while the watermark moved forward. Whether anything was removed is reported but
    left to the caller: a one-sided range removes one side's rows while the other side grows.
    """
    data = [s for s in samples if s.input_rows > 0]
    if len(data) < 2:
        last = samples[-1] if samples else None
        return Growth(
            False, 0.0, 0.0,
            last.rows_total if last else 0, last.memory_bytes if last else 0,
            0.0, 0, len(data),
            last.batch_id if last else None, last.batch_id if last else None,
        )  # fmt: skip
    first, last = data[0], data[-1]
    rows_rate = _slope([(s.at, s.rows_total) for s in data])
    bytes_rate = _slope([(s.at, s.memory_bytes) for s in data])
    advance = 0.0
    if first.watermark_at is not None and last.watermark_at is not None:
        advance = (last.watermark_at - first.watermark_at).total_seconds()
    never_shrank = all(b.rows_total >= a.rows_total for a, b in itertools.pairwise(data))
    growing = (
        len(data) >= min_batches
        and never_shrank
        and last.rows_total > first.rows_total
        # with no watermark at all nothing could ever be removed, so growth alone is the signal
        and (advance > 0 or last.watermark_at is None)
        and rows_rate > 0
    )
    return Growth(
        growing=growing,
        rows_per_second=max(rows_rate, 0.0),
        bytes_per_second=max(bytes_rate, 0.0),
        rows_total=last.rows_total,
        memory_bytes=last.memory_bytes,
        watermark_advance_seconds=advance,
        # eviction mostly happens in the no-data batches that follow a watermark move
        rows_removed=sum(s.rows_removed for s in samples if s.batch_id > first.batch_id),
        batches=len(data),
        first_batch_id=first.batch_id,
        last_batch_id=last.batch_id,
    )


def _slope(points: Sequence[tuple[datetime, float]]) -> float:
    """Least-squares slope per second; 0 when time does not vary."""
    if len(points) < 2:
        return 0.0
    t0 = points[0][0]
    xs = [(t - t0).total_seconds() for t, _ in points]
    ys = [float(v) for _, v in points]
    n = len(xs)
    mean_x = sum(xs) / n
    mean_y = sum(ys) / n
    var = sum((x - mean_x) ** 2 for x in xs)
    if var <= 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
