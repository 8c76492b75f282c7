"""How the report writes durations and sizes for people."""

from __future__ import annotations


def format_duration(seconds: float | None) -> str:
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


def format_bytes(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
