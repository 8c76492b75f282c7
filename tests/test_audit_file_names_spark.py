"""The audit reads exactly the files a batch logged, whatever their names, against real Spark.

A windowed count reads files whose names are glob patterns (``late[1].json``, ``b*.json``,
``c?.json``, ``d{a,b}.json``) or hold a space, ``%``, ``#`` and ``,``, in a folder whose own name
holds a space, ``%`` and ``#``; beside them lie the files those patterns would match
(``late1.json``, ``bX.json``, ...), read by the first batch. Each hostile file brings one late row:
the audit must record exactly those rows, from those files, and as many late groups as Spark's
``numRowsDroppedByWatermark``.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from tests.harness.audited import audited_run
from tests.harness.checks import assert_windows_balance, dropped_by_watermark, final_watermark_ms
from tests.harness.streams import DELAY, SCHEMA, ts, write_events

pytestmark = pytest.mark.spark

# (file name, [(id, second)]): files the first batch reads, each one of the names a hostile
# name below would match as a glob or when decoded wrongly; 25 s moves the watermark to 15 s
DECOYS = [
    ("late1.json", [(1, 2)]),
    ("bX.json", [(2, 3)]),
    ("cZ.json", [(3, 4)]),
    ("da.json", [(4, 6)]),
    ("db.json", [(5, 7)]),
    ("e f #g,h.json", [(6, 8)]),
    ("pA.json", [(7, 9), (8, 25)]),
]
# One file per batch; its first row is late (its 10 s window ended at or before the watermark
# the batch judges by), its second moves the watermark 11 s past that window's end.
HOSTILE = [
    ("late[1].json", [(10, 5), (11, 41)]),
    ("b*.json", [(20, 12), (21, 52)]),
    ("c?.json", [(30, 22), (31, 63)]),
    ("d{a,b}.json", [(40, 33), (41, 74)]),
    ("e f%20#g,h.json", [(50, 44), (51, 85)]),
    ("p%41.json", [(60, 55), (61, 1000)]),
]


def rows_of(pairs: list[tuple[int, int]]) -> list[dict[str, Any]]:
    return [{"id": i, "user": "u", "ts": ts(s)} for i, s in pairs]


def test_glob_characters_in_file_names_keep_the_audit_exact(spark: Any, stream_dir: Path) -> None:
    from pyspark.sql import functions as F

    folder = stream_dir / "in dir %#"
    folder.mkdir()
    for name, pairs in DECOYS:
        write_events(folder, rows_of(pairs), name=name)
    events = spark.readStream.schema(SCHEMA).json(str(folder)).withWatermark("ts", DELAY)

    def feed(query: Any) -> None:
        query.processAllAvailable()
        for file_name, pairs in HOSTILE:
            write_events(folder, rows_of(pairs), name=file_name)
            query.processAllAvailable()

    result = audited_run(
        spark,
        stream_dir,
        events.groupBy(F.window("ts", "10 seconds")).count(),
        events,
        name="hostile_file_names",
        feed=feed,
    )
    status, progress, output, late = (
        result["status"],
        result["progress"],
        result["output"],
        result["late"],
    )
    assert status["last_error"] is None and status["late_rows"] == len(late)
    # every hostile file was read by the query itself, each in its own batch
    files_read = [s["numInputRows"] for p in progress for s in p["sources"] if s["numInputRows"]]
    assert files_read == [sum(len(p) for _, p in DECOYS)] + [2] * len(HOSTILE)
    # exactly the late rows, each from its own file: none from a file a glob would match
    by_id = {json.loads(r[8])["id"]: r for r in late}
    assert sorted(by_id) == [pairs[0][0] for _, pairs in HOSTILE]
    for file_name, pairs in HOSTILE:
        source = by_id[pairs[0][0]][7]
        assert unquote(source) == f"{folder}/{file_name}", source
    # as many late groups as Spark dropped, and every window balances
    assert len({(r[0], r[4]) for r in late}) == dropped_by_watermark(progress) == len(HOSTILE)
    start_ms = int(datetime.fromisoformat(ts(0).replace("Z", "+00:00")).timestamp() * 1000)
    expected = Counter(
        (start_ms + (s // 10) * 10_000, start_ms + (s // 10 + 1) * 10_000)
        for _, pairs in DECOYS + HOSTILE
        for _, s in pairs
    )
    assert_windows_balance(dict(expected), output, late, final_watermark_ms(progress))
