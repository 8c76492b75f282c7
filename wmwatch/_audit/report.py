"""Pure helpers that turn audited late rows into report facts (no DuckDB, no Spark).

The report's late-rows section (wmwatch/_report/build.py) queries the rows; these functions hold the
audit-specific rules: how the Parquet sink's columns map onto the ``late_rows`` table, how much
more watermark delay a row needed, and what that extra delay costs in state.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import gcd

# The Parquet sink stores instants as integer microseconds (time-zone free); the table has
# TIMESTAMPTZ columns of the same names with ``_at``.
PARQUET_MICROS_COLUMNS = {
    "event_time_at": "event_time_us",
    "watermark_at": "watermark_us",
    "window_start_at": "window_start_us",
    "window_end_at": "window_end_us",
    "audited_at": "audited_at_us",
}


def parquet_late_column(column: str, present: Iterable[str]) -> str:
    """SQL that yields ``late_rows.column`` from an audit Parquet file with columns ``present``."""
    have = set(present)
    if column in have:
        return column
    micros = PARQUET_MICROS_COLUMNS.get(column)
    if micros is not None and micros in have:
        return f"(TIMESTAMPTZ '1970-01-01 00:00:00+00' + to_microseconds({micros})) AS {column}"
    return f"NULL AS {column}"


def extra_delay_needed_seconds(
    watermark_s: float, event_time_s: float, window_end_s: float | None
) -> float:
    """How much more delay would have kept this row: the watermark had to stay below the
    window's end (aggregations) or below the event time (deduplication)."""
    limit = window_end_s if window_end_s is not None else event_time_s
    return max(0.0, watermark_s - limit)


def delay_to_keep(needed_seconds: Sequence[float], fraction: float = 0.99) -> float | None:
    """The smallest whole number of extra seconds that keeps ``fraction`` of the rows.

    A row needing N seconds is kept only by a delay strictly larger than N (Spark drops at
    equality), hence the +1 on whole seconds.
    """
    if not needed_seconds:
        return None
    ordered = sorted(needed_seconds)
    index = max(0, math.ceil(fraction * len(ordered)) - 1)
    return float(math.floor(ordered[index]) + 1)


def kept_fraction(needed_seconds: Sequence[float], extra_seconds: float) -> float:
    if not needed_seconds:
        return 0.0
    return sum(1 for n in needed_seconds if n < extra_seconds) / len(needed_seconds)


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


def state_advice(
    needed_seconds: Sequence[float], grid: WindowGrid | None, fraction: float = 0.99
) -> str | None:
    """``a delay of X more would have kept 99% of these rows; state would hold about Y more
    windows`` (or, for deduplication, keys held X longer)."""
    extra = delay_to_keep(needed_seconds, fraction)
    if extra is None:
        return None
    kept = kept_fraction(needed_seconds, extra)
    head = f"a watermark delay of {_seconds(extra)} more would have kept {kept:.0%} of these rows"
    if grid is None:
        return f"{head}; state would keep each key about {_seconds(extra)} longer"
    windows = extra_windows_in_state(extra, grid.slide_seconds)
    return (
        f"{head}; state would hold about {windows} more window{'s' if windows != 1 else ''} per key"
    )


def _seconds(value: float) -> str:
    if value >= 3600 and value % 3600 == 0:
        return f"{value / 3600:g}h"
    if value >= 60 and value % 60 == 0:
        return f"{value / 60:g}m"
    return f"{value:g}s"


def state_advice_from_quantile(
    needed_p99_seconds: float | None, grid: WindowGrid | None
) -> str | None:
    """:func:`state_advice` when only the 99th percentile of the needed delay is at hand."""
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
