"""The audit's advice, pure arithmetic: how much more watermark delay would have kept the late
rows, and what that extra delay costs in state (windows per key)."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from math import gcd

from wmwatch._time import format_duration


@dataclass(frozen=True, slots=True)
class WindowGrid:
    window_seconds: float
    slide_seconds: float


def window_grid(windows: Iterable[tuple[float, float]]) -> WindowGrid | None:
    """Window length and slide seen in audited rows (start, end in seconds); None if no windows.

    The slide is the greatest common step between window starts, capped at the length: exact
    once rows from two neighbouring windows were audited, an upper bound before that.
    """
    pairs = [(round(s * 1000), round(e * 1000)) for s, e in windows]
    if not pairs:
        return None
    length = Counter(e - s for s, e in pairs).most_common(1)[0][0]
    starts = sorted({s for s, _ in pairs})
    step = 0
    for a, b in itertools.pairwise(starts):
        step = gcd(step, b - a)
    slide = min(step, length) if step else length
    return WindowGrid(length / 1000, slide / 1000)


def extra_windows_in_state(extra_delay_seconds: float, slide_seconds: float) -> int:
    """Windows per key that stay open longer: each slide of extra delay keeps one more window."""
    if slide_seconds <= 0:
        return 0
    return math.ceil(extra_delay_seconds / slide_seconds)


def state_advice_from_quantile(
    needed_p99_seconds: float | None, grid: WindowGrid | None
) -> str | None:
    """``a watermark delay of X more would have kept about 99% of these rows; state would hold
    about Y more windows per key`` (or, without windows, keep each key X longer).

    ``needed_p99_seconds`` is the 99th percentile of the extra delay each row needed (watermark
    minus window end, or its lateness without a window). A row needing N seconds is kept only by
    a delay strictly larger than N (Spark drops at equality), hence the +1 on whole seconds.
    """
    if needed_p99_seconds is None:
        return None
    extra = float(math.floor(max(needed_p99_seconds, 0.0)) + 1)
    head = f"a watermark delay of {_seconds(extra)} more would have kept about 99% of these rows"
    if grid is None:
        return f"{head}; state would keep each key about {_seconds(extra)} longer"
    windows = extra_windows_in_state(extra, grid.slide_seconds)
    return (
        f"{head}; state would hold about {windows} more window{'s' if windows != 1 else ''} per key"
    )


def watermark_delay_advice(
    current_delay_seconds: float | None,
    extra_p95_seconds: float | None,
    extra_p99_seconds: float | None,
) -> str | None:
    """One sentence on how much more watermark delay would have kept most late rows."""
    if extra_p95_seconds is None:
        return None
    extra95 = max(extra_p95_seconds, 0.0)
    extra99 = max(extra_p99_seconds or extra95, extra95)
    if current_delay_seconds is not None and current_delay_seconds > 0:
        return (
            f"a watermark delay of about {format_duration(current_delay_seconds + extra95)} "
            f"(now ~{format_duration(current_delay_seconds)}) would have kept 95% of these rows, "
            f"{format_duration(current_delay_seconds + extra99)} 99%; each second of delay adds "
            "output latency and state"
        )
    return (
        f"about {format_duration(extra95)} more watermark delay would have kept 95% of these rows "
        f"({format_duration(extra99)} for 99%); each second of delay adds output latency and state"
    )


def _seconds(value: float) -> str:
    if value >= 3600 and value % 3600 == 0:
        return f"{value / 3600:g}h"
    if value >= 60 and value % 60 == 0:
        return f"{value / 60:g}m"
    return f"{value:g}s"
