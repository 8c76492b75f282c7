"""What the tests without a JVM build by hand: progress documents shaped like Spark's, late rows
as the audit's writer takes them, and checkpoints in Spark's formats."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from wmwatch._progress import ProgressSnapshot, parse_progress
from wmwatch._text import SECRET_KEYS

REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def plain_secret_keys() -> list[str]:
    """Every key the redactor masks, spelled plainly (so a new key is tested too)."""
    plain = [re.sub(r"\[_\.\\-\]\?|\(\?:.*?\)\*", "", key) for key in SECRET_KEYS]
    assert all(re.fullmatch(r"[a-z]+", key) for key in plain), plain
    return plain


def iso(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.000Z")


def progress(
    batch_id: int,
    *,
    query_id: str = "q-1",
    run_id: str = "run-1",
    name: str | None = "clicks",
    at: datetime | None = None,
    input_rows: int = 10,
    operators: int = 1,
    dropped: int = 0,
) -> ProgressSnapshot:
    """A progress document shaped like Spark's for a windowed aggregation over files."""
    batch_at = at or T0 + timedelta(seconds=10 * batch_id)
    watermark = batch_at - timedelta(seconds=60)
    doc: dict[str, Any] = {
        "id": query_id,
        "runId": run_id,
        "name": name,
        "batchId": batch_id,
        "timestamp": iso(batch_at),
        "batchDuration": 250,
        "durationMs": {"addBatch": 200, "triggerExecution": 250},
        "numInputRows": input_rows,
        "eventTime": {
            "watermark": iso(watermark),
            "max": iso(watermark + timedelta(seconds=30)),
            "min": iso(watermark - timedelta(seconds=5)),
            "avg": iso(watermark + timedelta(seconds=10)),
        },
        "stateOperators": [
            {
                "operatorName": "stateStoreSave",
                "numRowsTotal": 100 + batch_id,
                "numRowsUpdated": 3,
                "numRowsRemoved": 1,
                "numRowsDroppedByWatermark": dropped,
                "memoryUsedBytes": 4096,
            }
            for _ in range(operators)
        ],
        "sources": [
            {
                "description": "FileStreamSource[file:/data/in]",
                "startOffset": {"logOffset": batch_id},
                "endOffset": {"logOffset": batch_id + 1},
                "numInputRows": input_rows,
            }
        ],
        "sink": {"description": "FileSink[file:/data/out]", "numOutputRows": -1},
    }
    return parse_progress(doc)


# -- late rows as the audit's writer takes them --------------------------------------------------

T = 1_767_225_600  # 2026-01-01T00:00:00Z in seconds
US = 1_000_000


def late(
    event_s: int, start_s: int | None, end_s: int | None, source: str, data: str
) -> tuple[Any, ...]:
    return (
        event_s * US,
        None if start_s is None else start_s * US,
        None if end_s is None else end_s * US,
        source,
        data,
        "window",
        0,
        None,
        0,
        None,
    )


ROWS = [
    late(T + 3, T, T + 10, "/in/a.json", '{"id":5}'),
    late(T + 5, T, T + 10, "/in/a.json", '{"id":7}'),
    late(T + 12, T + 10, T + 20, "/in/b.json", '{"id":9}'),
]


# -- checkpoints in Spark's formats ---------------------------------------------------------------

QUERY_ID = "8108f535-4e0a-404f-807f-886cb667e31c"
# 2026-01-01T00:00:00Z in epoch ms
T0_MS = 1_767_225_600_000
AGGREGATE_METADATA = (
    'v1\n{"operatorInfo":{"operatorId":0,"operatorName":"stateStoreSave"},'
    '"stateStoreInfo":[{"storeName":"default","numColsPrefixKey":0,"numPartitions":2}]}'
)
JOIN_METADATA = (
    'v1\n{"operatorInfo":{"operatorId":1,"operatorName":"symmetricHashJoin"},"stateStoreInfo":['
    + ",".join(
        f'{{"storeName":"{side}-{kind}","numColsPrefixKey":0,"numPartitions":4}}'
        for side in ("left", "right")
        for kind in ("keyToNumValues", "keyWithIndexToValue")
    )
    + "]}"
)


def offsets_text(watermark_ms: int, timestamp_ms: int, *lines: str) -> str:
    meta = {
        "batchWatermarkMs": watermark_ms,
        "batchTimestampMs": timestamp_ms,
        "conf": {"spark.sql.streaming.multipleWatermarkPolicy": "min"},
    }
    return "\n".join(["v1", json.dumps(meta), *lines])


def make_checkpoint(root: Path, batches: int = 4, committed: int | None = None) -> Path:
    """A checkpoint of a one-file-source windowed count: batch N read log entry N // 2 (a data
    batch, then the no-data batch that moves the watermark); the last batch is uncommitted
    unless ``committed`` says how many are."""
    committed = batches - 1 if committed is None else committed
    (root / "offsets").mkdir(parents=True)
    (root / "commits").mkdir()
    (root / "metadata").write_text(json.dumps({"id": QUERY_ID}))
    for n in range(batches):
        watermark = 0 if n == 0 else T0_MS + 5_000 * n
        (root / "offsets" / str(n)).write_text(
            offsets_text(watermark, T0_MS + 60_000 + 1_000 * n, json.dumps({"logOffset": n // 2}))
        )
        (root / "offsets" / f".{n}.crc").write_bytes(b"crc")
        if n < committed:
            (root / "commits" / str(n)).write_text(
                "v1\n" + json.dumps({"nextBatchWatermarkMs": watermark})
            )
    return root


def add_state(root: Path, versions: range) -> None:
    meta = root / "state" / "0" / "_metadata"
    meta.mkdir(parents=True)
    (meta / "metadata").write_text(AGGREGATE_METADATA)
    for partition in ("0", "1"):
        folder = root / "state" / "0" / partition
        folder.mkdir(exist_ok=True)
        for version in versions:
            (folder / f"{version}.delta").write_bytes(b"")


def fake_checkpoint(folder: Path) -> Path:
    """A folder with a checkpoint's metadata file, enough for the checks made before Spark."""
    folder.mkdir()
    (folder / "metadata").write_text('{"id":"5f1c0b1e-0000-4000-8000-000000000000"}')
    return folder
