"""Shared pieces of the safety and load tests: synthetic progress and a session without queries.

``NoQueriesSession`` stands in for a SparkSession that runs no streaming query: it is only the
place a Watch registers its listener, so the worker, queue, collector, store and endpoint can be
driven at rates and volumes a 2-core Spark cannot produce. The events themselves are shaped like
the JSON Spark's listener hands wmwatch (``QueryProgressEvent.json()``: the progress nested under
"progress"), so they take the same path through the worker as real ones.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime, timedelta
from typing import Any

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def iso(at: datetime) -> str:
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


class _Streams:
    def __init__(self) -> None:
        self.listeners: list[Any] = []
        self.active: list[Any] = []

    def addListener(self, listener: Any) -> None:  # noqa: N802 - PySpark's name
        self.listeners.append(listener)

    def removeListener(self, listener: Any) -> None:  # noqa: N802
        self.listeners.remove(listener)

    def get(self, query_id: str) -> Any:
        return None


class NoQueriesSession:
    """A session with no streaming queries (see the module docstring for why it exists)."""

    def __init__(self) -> None:
        self.streams = _Streams()


def progress_doc(
    query_id: str,
    batch_id: int,
    *,
    run_id: str = "run-1",
    name: str | None = None,
    at: datetime | None = None,
    rows: int = 20,
    description: str = "FileStreamSource[file:/data/in]",
) -> dict[str, Any]:
    """A progress document like Spark's for a windowed aggregation over a file stream."""
    batch_at = at or T0 + timedelta(seconds=batch_id)
    watermark = batch_at - timedelta(seconds=30)
    return {
        "id": query_id,
        "runId": run_id,
        "name": name,
        "timestamp": iso(batch_at),
        "batchId": batch_id,
        "batchDuration": 120,
        "numInputRows": rows,
        "inputRowsPerSecond": 50.0,
        "processedRowsPerSecond": 166.6,
        "durationMs": {
            "addBatch": 80,
            "getBatch": 3,
            "latestOffset": 4,
            "queryPlanning": 9,
            "triggerExecution": 120,
            "walCommit": 11,
            "commitOffsets": 9,
        },
        "eventTime": {
            "avg": iso(watermark + timedelta(seconds=20)),
            "max": iso(watermark + timedelta(seconds=29)),
            "min": iso(watermark + timedelta(seconds=5)),
            "watermark": iso(watermark),
        },
        "stateOperators": [
            {
                "operatorName": "stateStoreSave",
                "numRowsTotal": 40 + batch_id % 7,
                "numRowsUpdated": 4,
                "allUpdatesTimeMs": 3,
                "numRowsRemoved": 2,
                "allRemovalsTimeMs": 1,
                "commitTimeMs": 12,
                "memoryUsedBytes": 88_000,
                "numRowsDroppedByWatermark": batch_id % 3,
                "numShufflePartitions": 2,
                "numStateStoreInstances": 2,
                "customMetrics": {
                    "loadedMapCacheHitCount": 8,
                    "loadedMapCacheMissCount": 0,
                    "stateOnCurrentVersionSizeBytes": 9_000,
                },
            }
        ],
        "sources": [
            {
                "description": description,
                "startOffset": {"logOffset": batch_id - 1},
                "endOffset": {"logOffset": batch_id},
                "latestOffset": None,
                "numInputRows": rows,
                "inputRowsPerSecond": 50.0,
                "processedRowsPerSecond": 166.6,
            }
        ],
        "sink": {"description": "MemorySink", "numOutputRows": 2},
    }


def progress_event_json(query_id: str, batch_id: int, **kw: Any) -> str:
    """What the py4j listener puts on the queue for a progress event."""
    return json.dumps({"progress": progress_doc(query_id, batch_id, **kw)})


def rss_bytes() -> int:
    """Resident set size of this process (Linux)."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
