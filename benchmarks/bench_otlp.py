"""Benchmark: what one OTLP export costs the driver, side by side with one /metrics scrape.

Fills a watch's query book with ``--queries`` queries (each a windowed aggregation with three
stateful operators, a file source and a Kafka source of 12 partitions, as parsed from progress),
then, alternating, times a scrape of the registry (``generate_latest``, what Prometheus costs)
and an OTLP export of the same registry to a real OpenTelemetry Collector over HTTP and over gRPC
(``tests/otelcol_server.py``; built by ``.ci/build_otelcol.sh``). CPU is this thread's
(``time.thread_time``): the export runs on the exporter's own thread in a watch, the scrape on the
HTTP server's. Prints the export/scrape CPU ratio, the figures, and the CPU share of one core at
the default interval (10 s).

    python benchmarks/bench_otlp.py [--queries 20] [--runs 30] [--tiny]

``--tiny`` (what CI runs): 2 queries, 3 runs; it shows the benchmark still works, and its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _machine import print_machine

# the Collector helper lives with the tests; CI runs benchmarks with the repo root on PYTHONPATH
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

INTERVAL_SECONDS = 10.0


def _progress(query: int, batch: int) -> dict[str, Any]:
    operator = {
        "operatorName": "stateStoreSave",
        "numRowsTotal": 4000,
        "numRowsUpdated": 200,
        "numRowsRemoved": 150,
        "memoryUsedBytes": 1_200_000,
        "numRowsDroppedByWatermark": 3,
        "numStateStoreInstances": 2,
    }
    offsets = {"orders": {str(p): 1000 * batch + p for p in range(12)}}
    return {
        "id": f"00000000-0000-0000-0000-{query:012d}",
        "runId": f"10000000-0000-0000-0000-{query:012d}",
        "name": f"query_{query}",
        "batchId": batch,
        "timestamp": "2026-01-01T00:02:00.000Z",
        "batchDuration": 340,
        "numInputRows": 1200,
        "inputRowsPerSecond": 55.6,
        "processedRowsPerSecond": 88.0,
        "durationMs": {"addBatch": 177, "getBatch": 9, "latestOffset": 36, "queryPlanning": 28,
                       "triggerExecution": 341, "walCommit": 41, "commitOffsets": 48},
        "eventTime": {"avg": "2026-01-01T00:01:20.000Z", "max": "2026-01-01T00:01:50.000Z",
                      "min": "2026-01-01T00:00:30.000Z", "watermark": "2026-01-01T00:01:40.000Z"},
        "stateOperators": [operator] * 3,
        "sources": [
            {"description": "FileStreamSource[s3a://bucket/orders]", "numInputRows": 600,
             "startOffset": {"logOffset": batch - 1}, "endOffset": {"logOffset": batch}},
            {"description": "KafkaV2[Subscribe[orders]]", "numInputRows": 600,
             "startOffset": offsets, "endOffset": offsets, "latestOffset": offsets},
        ],
    }  # fmt: skip


def _registry(queries: int) -> Any:
    from prometheus_client import CollectorRegistry

    from wmwatch._core.health import Health
    from wmwatch._core.state import QueryBook
    from wmwatch._metrics.collector import WatchCollector
    from wmwatch._progress import parse_progress

    book = QueryBook(forget_after_seconds=600)
    for query in range(queries):
        for batch in range(1, 4):
            book.on_progress(parse_progress(json.loads(json.dumps(_progress(query, batch)))))
    health = Health()
    for _ in range(100):
        health.observe_handling(0.002)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(WatchCollector(book, health, queue_size=lambda: 0, queue_capacity=10_000))
    return registry


def _cpu(action: Callable[[], object]) -> float:
    started = time.thread_time()
    action()
    return time.thread_time() - started


def main() -> int:
    print_machine()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=20)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help="2 queries, 3 runs (CI)")
    args = parser.parse_args()
    if args.tiny:
        args.queries, args.runs = 2, 3

    from prometheus_client import generate_latest

    from tests import otelcol_server as otelcol
    from wmwatch._metrics.otlp.exporter import OtlpPlugin, otlp_settings

    registry = _registry(args.queries)
    samples = sum(len(f.samples) for f in registry.collect())
    with tempfile.TemporaryDirectory(prefix="wmwatch-bench-otlp-") as tmp:
        collector = otelcol.configure(Path(tmp), otelcol.make_tls(Path(tmp) / "tls"))
        with otelcol.running(collector):
            plugins = {
                protocol: OtlpPlugin(
                    registry.collect,
                    otlp_settings(
                        collector.endpoint("plain", protocol),
                        protocol=protocol,
                        interval_seconds=3600,  # only the exports timed here
                    ),
                    {"service.name": "bench"},
                )
                for protocol in ("http", "grpc")
            }
            try:
                for plugin in plugins.values():  # connections made, imports done
                    if not plugin.export_now():
                        raise SystemExit("the Collector refused an export: see its log")
                scrape: list[float] = []
                export: dict[str, list[float]] = {p: [] for p in plugins}
                wall: dict[str, list[float]] = {p: [] for p in plugins}
                for _ in range(args.runs):
                    scrape.append(_cpu(lambda: generate_latest(registry)))
                    for protocol, plugin in plugins.items():
                        started = time.perf_counter()
                        export[protocol].append(_cpu(plugin.export_now))
                        wall[protocol].append(time.perf_counter() - started)
                if any(p.dropped_total["metrics"] for p in plugins.values()):
                    raise SystemExit("an export was dropped during the benchmark")
            finally:
                for plugin in plugins.values():
                    plugin.close()
    scrape_ms = statistics.median(scrape) * 1000
    print(
        f"{args.queries} queries, {samples} samples a scrape; median of {args.runs} runs, "
        "alternated:"
    )
    print(f"  /metrics scrape: {scrape_ms:.2f} ms CPU")
    for protocol in plugins:
        cpu_ms = statistics.median(export[protocol]) * 1000
        share = cpu_ms / 1000 / INTERVAL_SECONDS * 100
        print(
            f"  OTLP export over {protocol}: {cpu_ms:.2f} ms CPU "
            f"({cpu_ms / scrape_ms:.1f}x a scrape), {statistics.median(wall[protocol]) * 1000:.1f}"
            f" ms wall; every {INTERVAL_SECONDS:g} s that is {share:.3f}% of one core"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
