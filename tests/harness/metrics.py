"""What the metrics tests share: a progress document, a registry watching a query book, a
scrape's samples, and the committed dashboards' panels and expressions."""

from __future__ import annotations

import json
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from dashboards import generate
from wmwatch._core.health import Health
from wmwatch._core.state import QueryBook
from wmwatch._metrics.collector import WatchCollector
from wmwatch._progress import parse_progress


def progress(batch: int) -> Any:
    return parse_progress(
        {
            "id": "q1", "runId": "r1", "name": "orders", "batchId": batch,
            "timestamp": "2026-01-01T00:01:00.000Z", "numInputRows": 10,
            "eventTime": {"watermark": f"2026-01-01T00:00:{batch % 60:02d}.000Z",
                          "max": "2026-01-01T00:00:59.000Z"},
            "stateOperators": [{"operatorName": "stateStoreSave", "numRowsTotal": 5,
                                "numRowsDroppedByWatermark": 1}],
        }
    )  # fmt: skip


def watched_registry() -> tuple[QueryBook, CollectorRegistry]:
    book = QueryBook()
    registry = CollectorRegistry()
    registry.register(WatchCollector(book, Health(), queue_size=lambda: 0, queue_capacity=10))
    return book, registry


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def panels(board: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in board["panels"] if p["type"] != "row"]


def expressions(board: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in panels(board) for t in p["targets"]]


def load(uid: str) -> dict[str, Any]:
    return dict(json.loads((generate.ROOT / generate.DASHBOARD_DIR / f"{uid}.json").read_text()))
