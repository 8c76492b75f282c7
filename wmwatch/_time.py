"""Time in wmwatch: the one duration parser, the one conversion each way, and how times and
durations read for people.

Everything wmwatch keeps is an aware UTC ``datetime`` (``*_at``) or a number of seconds
(``*_seconds``); Spark hands over ISO strings, epoch milliseconds and interval text, and people
type durations such as ``10 seconds`` or ``2h``. Each of those crosses into wmwatch here.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from typing import Any

EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

_US_PER_UNIT = {
    "microsecond": 1,
    "millisecond": 1_000,
    "second": 1_000_000,
    "minute": 60_000_000,
    "hour": 3_600_000_000,
    "day": 86_400_000_000,
    "week": 7 * 86_400_000_000,
}
# the short forms people type (``2h``, ``15m``, ``500ms``) and Spark prints (``10 sec``)
_UNIT_ALIASES = {
    "us": "microsecond",
    "ms": "millisecond",
    "s": "second",
    "sec": "second",
    "m": "minute",
    "min": "minute",
    "h": "hour",
    "d": "day",
    "w": "week",
}
_AMOUNT_UNIT = re.compile(r"(-?\d+(?:\.\d+)?)\s*([a-zA-Z]+)")


def _unit(word: str) -> str | None:
    word = word.lower()
    if word in _UNIT_ALIASES:
        return _UNIT_ALIASES[word]
    word = word.rstrip("s")
    if word in _US_PER_UNIT:
        return word
    return _UNIT_ALIASES.get(word)


def parse_duration_us(text: str | float | int) -> int:
    """``"10 seconds"``, ``"1 minute 30 seconds"``, ``"500 ms"``, ``"1h30m"`` or a number of
    seconds, as whole microseconds. Raises ``ValueError`` with a sentence a person can act on."""
    if isinstance(text, int | float):
        return round(float(text) * 1_000_000)
    pairs = _AMOUNT_UNIT.findall(text.strip())
    if not pairs or _AMOUNT_UNIT.sub("", text).strip(" ,"):
        raise ValueError(f"cannot read the duration {text!r}; write it like '10 seconds'.")
    total = 0.0
    for number, word in pairs:
        unit = _unit(word)
        if unit is None:
            raise ValueError(
                f"unknown time unit {word!r} in {text!r}; use seconds, minutes, hours or days."
            )
        total += float(number) * _US_PER_UNIT[unit]
    return round(total)


def interval_seconds(text: str | None) -> float | None:
    """Spark's interval text as it appears in plans (``10 seconds``, ``interval 2 hours``,
    ``1 minutes 30 seconds``) in seconds; None when it holds no duration."""
    if not text:
        return None
    total, found = 0, False
    for number, word in _AMOUNT_UNIT.findall(text):
        unit = _unit(word)
        if unit is not None:
            total += round(float(number) * _US_PER_UNIT[unit])
            found = True
    return total / 1_000_000 if found else None


def as_utc(value: datetime | None) -> datetime | None:
    """An aware UTC datetime; a naive one is taken to be UTC already (as DuckDB returns them)."""
    if value is None:
        return None
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


def parse_timestamp(value: Any) -> datetime | None:
    """Spark's ISO-8601 timestamps (``2026-01-01T00:00:00.000Z``) as UTC; ``None`` if invalid."""
    if not isinstance(value, str) or not value:
        return None
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    return as_utc(parsed)


def from_epoch_seconds(seconds: float | None) -> datetime | None:
    if seconds is None:
        return None
    return datetime.fromtimestamp(seconds, UTC)


def to_epoch_seconds(value: datetime | None) -> float | None:
    if value is None:
        return None
    return value.timestamp()


def from_epoch_ms(value: Any) -> datetime | None:
    """Epoch milliseconds as Spark hands them over (an int, a string, py4j's ``None``) as UTC;
    ``None`` for anything that is not a positive number (0 is Spark's "no watermark yet")."""
    if value is None or value == "None":
        return None
    try:
        ms = int(value)
    except (TypeError, ValueError):
        return None
    if ms <= 0:
        return None
    return datetime.fromtimestamp(ms / 1000.0, tz=UTC)


def to_epoch_ms(value: datetime | None) -> int | None:
    """Whole epoch milliseconds, rounded down as Spark's watermark is."""
    if value is None:
        return None
    return int((value - EPOCH).total_seconds() * 1000 // 1)


def format_at(value: datetime | str | None, *, zone: bool = True) -> str:
    """``2026-01-31 08:00:00 UTC`` for people (``zone=False`` drops the suffix); ``-`` for none."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    text = (value.astimezone(UTC) if value.tzinfo else value).strftime("%Y-%m-%d %H:%M:%S")
    return f"{text} UTC" if zone else text


def format_duration(seconds: float | None) -> str:
    """``750ms``, ``12.3s``, ``1m 15s``, ``2h 1m``, ``1d 1h`` for people; ``-`` for none."""
    if seconds is None:
        return "-"
    sign = "-" if seconds < 0 else ""
    value = abs(seconds)
    if value < 1:
        return f"{sign}{value * 1000:.0f}ms"
    if value < 60:
        return f"{sign}{value:.1f}s"
    if value < 3600:
        return f"{sign}{int(value // 60)}m {int(value % 60)}s"
    if value < 86_400:
        return f"{sign}{int(value // 3600)}h {int(value % 3600 // 60)}m"
    return f"{sign}{int(value // 86_400)}d {int(value % 86_400 // 3600)}h"
