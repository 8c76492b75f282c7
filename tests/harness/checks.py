"""The conservation checks: what the query emitted plus what the audit stored is exactly the
input, and the audit's rows agree with Spark's own drop counts, batch by batch."""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.harness.streams import SCHEMA, all_rows, epoch_seconds
from wmwatch._checkpoint.reader import CheckpointReader


def final_watermark_ms(progress: list[dict[str, Any]]) -> int:
    return max(
        int(epoch_seconds(p["eventTime"]["watermark"])) * 1000
        for p in progress
        if p["eventTime"].get("watermark")
    )


def dropped_by_watermark(progress: list[dict[str, Any]]) -> int:
    """Spark's count of rows (input rows, or late groups for an aggregation) dropped as late."""
    return sum(
        op.get("numRowsDroppedByWatermark", 0) for p in progress for op in p["stateOperators"]
    )


def per_batch_dropped(progress: list[dict[str, Any]]) -> dict[int, int]:
    return {
        p["batchId"]: sum(op.get("numRowsDroppedByWatermark", 0) for op in p["stateOperators"])
        for p in progress
    }


def assert_marks_complete(result: dict[str, Any]) -> None:
    """Every committed batch is marked once, and a DuckDB marker counts the rows stored."""
    committed = result["checkpoint"].committed_batches()
    marked = sorted(b for b, *_ in result["marks"])
    assert marked == committed
    per_batch = Counter(r[0] for r in result["late"])
    for batch_id, late_rows, _, _ in result["marks"]:
        if result["marks"][0][2] == "duckdb":
            assert per_batch.get(batch_id, 0) == late_rows


def assert_moved_by_no_data_batch(reader: CheckpointReader) -> None:
    """The stream must contain a no-data batch that moved the watermark before a data batch."""
    found = False
    for b in reader.committed_batches()[1:-1]:
        prev, cur = reader.offsets(b - 1), reader.offsets(b)
        assert prev is not None and cur is not None
        if (
            not reader.batch_files(b)
            and cur.watermark_ms != prev.watermark_ms
            and reader.batch_files(b + 1)
        ):
            found = True
    assert found, "the scenario lost its watermark-moving no-data batch"


def batch_window_counts(
    spark: Any, folder: Path, window: str, slide: str
) -> dict[tuple[int, int], int]:
    """Counts per window from a plain batch query over all the input: the ground truth."""
    from pyspark.sql import functions as F

    rows = (
        spark.read.schema(SCHEMA)
        .json(str(folder / "in"))
        .groupBy(F.window("ts", window, slide))
        .count()
        .collect()
    )
    return {
        (
            int(r["window"]["start"].timestamp() * 1000),
            int(r["window"]["end"].timestamp() * 1000),
        ): r["count"]
        for r in rows
    }


def tumbling_counts(times: list[str], size_seconds: int = 10) -> dict[tuple[int, int], int]:
    """Counts per tumbling window of the instants ``times`` (ISO text): the ground truth."""
    counts: Counter[tuple[int, int]] = Counter()
    for text in times:
        second = int(epoch_seconds(text))
        start = second - second % size_seconds
        counts[(start * 1000, (start + size_seconds) * 1000)] += 1
    return dict(counts)


def assert_windows_balance(
    expected: dict[tuple[int, int], int], output: list[dict[str, Any]], late: list[Any], wm_ms: int
) -> None:
    """For every closed window: emitted count + audited rows == count over all input."""
    emitted = {
        (
            int(r["window"]["start"].timestamp() * 1000),
            int(r["window"]["end"].timestamp() * 1000),
        ): r["count"]
        for r in output
    }
    audited = Counter((r[4], r[5]) for r in late)
    assert audited, "the scenario produced no late rows"
    for window in audited:
        assert window[1] <= wm_ms
    closed = [w for w in expected if w[1] <= wm_ms]
    assert len(closed) >= 8
    for window in closed:
        assert emitted.get(window, 0) + audited.get(window, 0) == expected[window], window


def check_windows(
    result: dict[str, Any], spark: Any, folder: Path, window: str, slide: str
) -> None:
    """A windowed count over a file stream balances, and the audit's counts and metrics agree."""
    wm_ms = final_watermark_ms(result["progress"])
    expected = batch_window_counts(spark, folder, window, slide)
    assert_windows_balance(expected, result["output"], result["late"], wm_ms)
    # Spark counts late groups per batch (after merging partial aggregates), not rows.
    assert len({(r[0], r[4]) for r in result["late"]}) == dropped_by_watermark(result["progress"])
    assert result["status"]["late_rows"] == len(result["late"])
    assert result["metrics"]["wmwatch_late_rows_audited_total"] == len(result["late"])
    # an availableNow run ends by itself; its audit then finishes what the run committed and
    # ends, after which it no longer exports a lag
    assert result["metrics"]["wmwatch_audit_lag_batches"] in (0, None)
    assert result["status"]["lag_batches"] == 0
    assert result["metrics"]["wmwatch_audit_errors_total"] == 0
    for _, _, wm, _, _, w_end, kind, source, _ in result["late"]:
        assert kind == "window" and w_end <= wm and source and source.startswith("/")
    assert_marks_complete(result)


def check_dedupe(result: dict[str, Any], key: Callable[[dict[str, Any]], Any], kind: str) -> None:
    """Every input row was emitted, audited late once, or is a duplicate of an emitted one."""
    rows = all_rows(result["files"])
    emitted_ids = {r["id"] for r in result["output"]}
    audited_ids = [json.loads(r[8])["id"] for r in result["late"]]
    assert audited_ids, "the scenario produced no late rows"
    assert len(audited_ids) == len(set(audited_ids))  # no row audited twice
    assert not set(audited_ids) & emitted_ids  # the audit never claims a row the query kept
    emitted_keys = {key(r) for r in rows if r["id"] in emitted_ids}
    for row in rows:
        if row["id"] not in emitted_ids and row["id"] not in audited_ids:
            assert key(row) in emitted_keys, (
                f"row {row} vanished: neither emitted, late, nor a duplicate"
            )
    # for deduplication Spark counts dropped input rows, so the totals must agree exactly
    assert len(audited_ids) == dropped_by_watermark(result["progress"])
    for _batch_id, event_ms, wm, lateness, w_start, w_end, op_kind, _, _ in result["late"]:
        assert op_kind == kind and event_ms <= wm and w_start is None and w_end is None
        assert lateness == pytest.approx((wm - event_ms) / 1000)
    assert_marks_complete(result)


def side_ids(result: dict[str, Any], side: str) -> list[int]:
    """The ids of a join side's audited rows (``late`` as the join checks read it)."""
    column = "lid" if side == "left" else "rid"
    return [json.loads(r[8])[column] for r in result["late"] if r[5] == side]


def check_join(result: dict[str, Any], *, sides: tuple[str, ...]) -> None:
    """A join's late rows: each once, on the right side, none in the output, and as many as
    Spark counted for both sides together; the markers and metrics split them by side."""
    late = result["late"]
    assert late, "the scenario produced no late rows"
    for _batch, event_ms, wm_ms, kind, op_index, side, source_index, key, _data in late:
        assert kind == "join" and op_index == 0 and side in sides
        assert event_ms <= wm_ms  # on the watermark is late
        assert source_index == (0 if side == "left" else 1)
        assert key is not None and json.loads(key)  # the key whose match the row lost
    audited = {s: side_ids(result, s) for s in ("left", "right")}
    for side, ids in audited.items():
        assert len(ids) == len(set(ids)), f"a {side} row was audited twice"
        assert result["metrics"][side] in ((None, 0.0) if not ids else (float(len(ids)),))
    # Spark counts the join's drops for both sides together
    assert len(late) == dropped_by_watermark(result["progress"])
    # no audited row reached the output, not even null-padded by an outer join
    emitted_left = {r.get("lid") for r in result["output"]} - {None}
    emitted_right = {r.get("rid") for r in result["output"]} - {None}
    assert not set(audited["left"]) & emitted_left
    assert not set(audited["right"]) & emitted_right
    # the markers count every late row per side, and agree with the kept rows
    counted = {"left": 0, "right": 0}
    for batch in result["by_input"]:
        for item in batch:
            counted[item["side"]] += item["rows"]
    assert counted == {s: len(audited[s]) for s in counted}


def check_every_record_accounted(
    records: list[tuple[int, dict[str, Any]]], output: list[dict[str, Any]], late_ids: list[int]
) -> None:
    """Across both runs every record was emitted, audited late, or a duplicate of an emitted
    one; none both emitted and late."""
    emitted = {r["id"] for r in output}
    assert not emitted & set(late_ids)
    emitted_keys = {(row["user"], row["ts"]) for _, row in records if row["id"] in emitted}
    for _, row in records:
        if row["id"] not in emitted and row["id"] not in late_ids:
            assert (row["user"], row["ts"]) in emitted_keys, f"{row} vanished"


def offsets_moved(reader: CheckpointReader, batch_id: int) -> bool:
    """Whether batch ``batch_id`` read anything: its offsets differ from the batch before's."""
    entry, before = reader.offsets(batch_id), reader.offsets(batch_id - 1)
    assert entry is not None and before is not None
    return bool(entry.source_offsets != before.source_offsets)


@contextlib.contextmanager
def py4j_calls(spark: Any) -> Iterator[list[int]]:
    """Count the py4j commands this thread sends to the driver's JVM while the block runs (each
    a round trip: the driver's cost per JVM object touched); the commands still go through."""
    client = spark.sparkContext._gateway._gateway_client
    send = client.send_command
    me = threading.get_ident()
    count = [0]

    def counting(*args: Any, **kwargs: Any) -> Any:
        if threading.get_ident() == me:
            count[0] += 1
        return send(*args, **kwargs)

    client.send_command = counting
    try:
        yield count
    finally:
        del client.send_command
