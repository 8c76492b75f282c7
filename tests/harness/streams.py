"""Input for the streaming tests: files written so a file stream takes them one at a time, and
the out-of-order streams the audit tests run (one stream, join pairs, many small files)."""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

SCHEMA = "id int, user string, ts timestamp"
DELAY = "10 seconds"

_counter = iter(range(10**9))


def write_events(
    folder: Path, rows: Iterable[Mapping[str, Any]], *, name: str | None = None
) -> Path:
    """Write one JSON-lines file atomically (write, then rename): no stream sees half a file."""
    index = next(_counter)
    final = folder / (name or f"part-{index:05d}.json")
    tmp = folder.parent / f".{final.name}.tmp"
    with tmp.open("w") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")
    os.replace(tmp, final)
    # file sources take files in modification-time order: keep successive files strictly ordered
    stamp = time.time() + index * 0.001
    os.utime(final, (stamp, stamp))
    return final


def ts(second: int) -> str:
    """Second ``second`` of 2026-01-01 as Spark writes an instant (ISO, UTC, ``Z``)."""
    minute, sec = divmod(second, 60)
    hour, minute = divmod(minute, 60)
    return f"2026-01-01T{hour:02d}:{minute:02d}:{sec:02d}Z"


def epoch_seconds(iso: str) -> float:
    """Spark's ISO UTC string to Unix seconds."""
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


# (id, user, second). Comments give what the tumbling 10 s window query sees with one file per
# batch; Spark runs a no-data batch after each file that moves the watermark.
EDGE_FILES: list[list[tuple[int, str, int]]] = [
    [(1, "a", 1), (2, "b", 4), (3, "c", 12), (4, "a", 25)],  # watermark -> 15
    # filtered with 15 (set by the no-data batch): ts 3 and 5 share the closed window [0,10);
    # ts 10 is behind the watermark but its window [10,20) is open, so it counts
    [(5, "late", 3), (6, "open", 10), (7, "late", 5), (8, "a", 40)],  # watermark -> 30
    # filtered with 30: ts 20's window ends exactly on the watermark (dropped); for the
    # deduplications ts 30 is exactly on the watermark (dropped)
    [(9, "edge", 20), (10, "x", 21), (11, "y", 30), (12, "z", 31), (13, "a", 35), (14, "a", 25)],
]


def stream_files(seed: int = 7) -> list[list[dict[str, Any]]]:
    """The audit tests' stream: :data:`EDGE_FILES`, three random files with late rows and
    duplicates, and one row that moves the watermark past every other window."""
    rng = random.Random(seed)
    files = [list(f) for f in EDGE_FILES]
    next_id = 100
    seen: list[tuple[str, int]] = [(u, s) for f in files for (_, u, s) in f]
    for k in range(3):
        base = 50 + 15 * k
        rows = []
        for _ in range(7):
            if rng.random() < 0.25:
                user, second = rng.choice(seen)  # a plain duplicate of an earlier row
            else:
                user, second = rng.choice("abcd"), base + rng.randint(-30, 8)
            rows.append((next_id, user, second))
            seen.append((user, second))
            next_id += 1
        files.append(rows)
    files.append([(999, "flush", 1000)])  # moves the watermark past every other window
    return [[{"id": i, "user": u, "ts": ts(s)} for (i, u, s) in f] for f in files]


def all_rows(files: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [r for f in files for r in f]


def many_files(count: int, seed: int = 11, start: int = 0) -> list[list[dict[str, Any]]]:
    """``count`` small files of an out-of-order stream (files ``start`` to ``start+count-1`` of
    one endless sequence): event time moves about 4 s a file; some rows come 15-45 s late
    (behind the 10 s watermark), some repeat an earlier user and time (duplicates)."""
    rng = random.Random(seed)
    files, seen = [], [("a", 0)]
    for index in range(start + count):
        base = 20 + 4 * index
        rows = []
        for k in range(4):
            roll = rng.random()
            if roll < 0.2:
                user, second = rng.choice(seen)  # a duplicate of an earlier row
            elif roll < 0.45:
                user, second = rng.choice("abc"), max(0, base - rng.randint(15, 45))
            else:
                user, second = rng.choice("abcd"), base + rng.randint(-3, 3)
            seen.append((user, second))
            rows.append({"id": index * 10 + k, "user": user, "ts": ts(second)})
        files.append(rows)
    return files[start:]
