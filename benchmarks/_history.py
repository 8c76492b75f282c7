"""A synthetic history file for the report benchmarks, written through the store's own writers.

Every row goes in the way a running watch puts it there: progress documents shaped like Spark
4.3's (a windowed aggregation over a file source) parsed by ``parse_progress`` and recorded by
``HistoryStore.record_progress``; query starts and a failure through the store's event writers;
late rows and their markers through the audit's ``AuditHistory``; findings and per-input
watermarks through plan inspection's table writers. So the builder follows the schema as it
grows, instead of repeating it in hand-written ``INSERT``s.

Batch times end a minute before now, two seconds apart, so a history of any length stays inside
any retention the store applies.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from wmwatch._audit.sinks import AuditHistory, BatchLateRows, InputCount
from wmwatch._events import QueryStarted, QueryTerminated
from wmwatch._inspect.findings import Finding
from wmwatch._inspect.tables import write_finding, write_watermarks
from wmwatch._inspect.watermarks import SourceWatermark
from wmwatch._progress import parse_progress
from wmwatch._store.writer import HistoryStore

BATCH_SECONDS = 2.0
WATERMARK_DELAY_SECONDS = 600.0
# wait for the writer every this many batches, so the pending bound never drops a write
_FLUSH_EVERY = 2_000


def _iso(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def _us(at: datetime) -> int:
    return int(at.timestamp() * 1_000_000)


def progress_document(
    query_id: str, run_id: str, name: str, batch_id: int, batch_at: datetime, rng: random.Random
) -> dict[str, Any]:
    """One progress document like Spark's for a windowed count over files."""
    watermark = batch_at - timedelta(seconds=WATERMARK_DELAY_SECONDS + batch_id % 37)
    rows = rng.randint(100, 999)
    dropped = rng.randint(1, 5) if rng.random() < 0.05 else 0
    state_bytes = 1_000_000 + batch_id * 10 + rng.randint(0, 4095)
    duration_ms = 200 + batch_id % 300
    return {
        "id": query_id,
        "runId": run_id,
        "name": name,
        "timestamp": _iso(batch_at),
        "batchId": batch_id,
        "batchDuration": duration_ms,
        "numInputRows": rows,
        "inputRowsPerSecond": round(rows / 2.0, 1),
        "processedRowsPerSecond": round(rows / 0.4, 1),
        "durationMs": {
            "addBatch": 150 + batch_id % 250,
            "commitOffsets": 12,
            "getBatch": 3,
            "latestOffset": 9,
            "queryPlanning": 21,
            "triggerExecution": duration_ms,
            "walCommit": 14,
        },
        "eventTime": {
            "avg": _iso(watermark + timedelta(seconds=40)),
            "max": _iso(watermark + timedelta(seconds=60)),
            "min": _iso(watermark - timedelta(seconds=5)),
            "watermark": _iso(watermark),
        },
        "stateOperators": [
            {
                "operatorName": "stateStoreSave",
                "numRowsTotal": 1000 + batch_id // 10 + rng.randint(0, 49),
                "numRowsUpdated": rows % 50,
                "allUpdatesTimeMs": 4,
                "numRowsRemoved": batch_id % 7,
                "allRemovalsTimeMs": 1,
                "commitTimeMs": 38,
                "memoryUsedBytes": state_bytes,
                "numRowsDroppedByWatermark": dropped,
                "numShufflePartitions": 2,
                "numStateStoreInstances": 2,
                "customMetrics": {
                    "loadedMapCacheHitCount": batch_id * 2,
                    "loadedMapCacheMissCount": 0,
                    "stateOnCurrentVersionSizeBytes": state_bytes // 2,
                },
            }
        ],
        "sources": [
            {
                "description": f"FileStreamSource[file:/data/events/{name}]",
                "startOffset": {"logOffset": batch_id},
                "endOffset": {"logOffset": batch_id + 1},
                "latestOffset": None,
                "numInputRows": rows,
                "inputRowsPerSecond": round(rows / 2.0, 1),
                "processedRowsPerSecond": round(rows / 0.4, 1),
            }
        ],
        "sink": {"description": f"FileSink[file:/data/out/{name}]", "numOutputRows": -1},
    }


def _late_rows(
    batch_id: int, watermark: datetime, count: int, rng: random.Random
) -> list[tuple[Any, ...]]:
    """``count`` rows a windowed count dropped: each a few seconds to minutes behind."""
    rows = []
    for _ in range(count):
        event_at = watermark - timedelta(seconds=rng.randint(61, 360))
        window_start = event_at.replace(second=0, microsecond=0)
        rows.append(
            (
                _us(event_at),
                _us(window_start),
                _us(window_start + timedelta(minutes=1)),
                f"file:///data/events/part-{batch_id % 13}.json",
                json.dumps({"user": f"u{rng.randint(1, 500)}", "ts": _iso(event_at)}),
                "window",
                0,
                None,
                0,
                None,
            )
        )
    return rows


def build_history(
    path: Path, *, batches: int, queries: int = 4, watermarks: bool = False, seed: int = 7
) -> None:
    """Write a history of ``batches`` batches spread over ``queries`` queries.

    Query 1 has failed; query 2 has an unbounded join finding (with a state budget estimate
    when ``watermarks``). ``watermarks`` also records two inputs per batch, the second 30 s
    behind and holding the watermark back, so every chart of the HTML report has data.
    """
    rng = random.Random(seed)
    per_query = max(1, batches // queries)
    end = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=1)
    start = end - timedelta(seconds=per_query * BATCH_SECONDS)
    store = HistoryStore(path, flush_interval_seconds=0.2, flush_writes=2_000).start()
    try:
        for n in range(queries):
            query_id = f"q{n:03d}-5d2c-4f0e-9a55-0c3f2b1e7a{n}"
            run_id = f"run-{n}"
            name = f"events_per_window_{n}"
            store.record_query_started(QueryStarted(query_id, run_id, name, start))
            audit = AuditHistory(store, query_id=query_id, label=name)
            for batch_id in range(per_query):
                batch_at = start + timedelta(seconds=batch_id * BATCH_SECONDS)
                doc = progress_document(query_id, run_id, name, batch_id, batch_at, rng)
                snapshot = parse_progress(json.dumps(doc, separators=(",", ":")))
                store.record_progress(snapshot)
                dropped = snapshot.rows_dropped_by_watermark or 0
                if dropped and snapshot.watermark_at is not None:
                    late = _late_rows(batch_id, snapshot.watermark_at, dropped, rng)
                    audit.commit(
                        query_name=name,
                        run_id=run_id,
                        batch_id=batch_id,
                        late_wm_ms=_us(snapshot.watermark_at) // 1000,
                        found=BatchLateRows(
                            total=dropped,
                            rows=late,
                            by_input=(InputCount(0, "window", None, 0, dropped),),
                        ),
                        sink="duckdb",
                    )
                if watermarks and snapshot.watermark_at is not None:
                    _record_inputs(store, query_id, name, batch_id, snapshot.watermark_at)
                if batch_id % _FLUSH_EVERY == _FLUSH_EVERY - 1:
                    store.flush(timeout=300)
            if n == 1:
                store.record_query_terminated(
                    QueryTerminated(
                        query_id,
                        run_id,
                        "java.lang.IllegalStateException: boom",
                        "INTERNAL_ERROR",
                        end,
                    )
                )
            if n == 2:
                _record_join_finding(store, query_id, name, start, end, per_query, watermarks)
        if not store.flush(timeout=600):
            raise SystemExit(f"the synthetic history was not written: {store.health.last_error}")
    finally:
        store.close(timeout=600)


def _record_inputs(
    store: HistoryStore, query_id: str, name: str, batch_id: int, watermark: datetime
) -> None:
    inputs = tuple(
        SourceWatermark(
            node_id=f"node-{i}",
            source=f"FileStreamSource[file:/data/events/{name}-{i}]",
            source_indexes=(i,),
            event_time_column="ts",
            delay_seconds=10.0,
            watermark_at=watermark - timedelta(seconds=30 * i),
            holding_back=i == 1,
        )
        for i in range(2)
    )
    recorded_at = datetime.now(UTC)
    store.submit(
        lambda con: write_watermarks(
            con,
            query_id=query_id,
            batch_id=batch_id,
            operators=(),
            sources=inputs,
            policy="min",
            recorded_at=recorded_at,
        ),
        description=f"watermarks of batch {batch_id}",
    )


def _record_join_finding(
    store: HistoryStore,
    query_id: str,
    name: str,
    start: datetime,
    end: datetime,
    batches: int,
    budget: bool,
) -> None:
    evidence: dict[str, Any] = {}
    if budget:
        evidence = {"state_budget_bytes": 2 * 1024**3, "seconds_to_budget": 86_400.0}
    finding = Finding(
        finding_id=f"join_state_unbounded:{query_id}:0:left",
        query_id=query_id,
        query_name=name,
        kind="join_state_unbounded",
        operator_id=0,
        side="left",
        severity="critical",
        status="active",
        message="left state grows every batch and is never cleaned",
        evidence=evidence,
        fix="add a watermark and a time-range condition on both sides",
        first_seen_at=start + timedelta(minutes=10),
        last_seen_at=end,
        first_batch_id=min(10, batches - 1),
        last_batch_id=batches - 1,
        occurrences=max(1, batches - 10),
    )
    store.submit(lambda con: write_finding(con, finding), description="join finding")
