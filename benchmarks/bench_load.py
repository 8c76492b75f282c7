"""Load benchmark of wmwatch's worker without Spark: sustained events/s, queue and memory.

Feeds realistic progress events (the JSON Spark's listener hands wmwatch) for 20 queries into a
real Watch (queue -> worker -> query book -> DuckDB writer thread -> /metrics) from several
threads, first at fixed rates (is every event handled with no drop and a short queue?), then as
fast as possible (what the worker sustains). Last, the worker's cost per event, step by step
(decode and parse, query book, history rows, plan plugin hook), without threads or I/O. The
Spark-level figures (20 real queries in one local[2] session) come from tests/test_load.py.

    python benchmarks/bench_load.py [--seconds 10] [--rates 500,1000,2000,4000] [--tiny]

``--tiny`` (what CI runs): half a second at one rate and a short per-event pass; it shows the
benchmark still works, and its figures mean nothing.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import print_machine

import wmwatch
from tests.scripts.safety_support import (
    NoQueriesSession,
    progress_doc,
    progress_event_json,
    rss_bytes,
)

THREADS = 4
QUERIES_PER_THREAD = 5


def run_rate(rate: float, seconds: float, work: Path) -> dict[str, Any]:
    """Offer ``rate`` events/s for ``seconds``; 0 means as fast as the feeders can."""
    db = work / f"rate-{int(rate)}.duckdb"
    watch = wmwatch.attach(NoQueriesSession(), db=str(db), metrics_port=None, listener="stock")
    per_thread = int((rate or 20_000) * seconds / THREADS)
    payloads = [
        [
            progress_event_json(f"t{t}q{i % QUERIES_PER_THREAD}", i // QUERIES_PER_THREAD)
            for i in range(per_thread)
        ]
        for t in range(THREADS)
    ]

    def feed(items: list[str]) -> None:
        begin = time.perf_counter()
        for index, payload in enumerate(items):
            if rate:
                delay = begin + index / (rate / THREADS) - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            watch._events.offer("progress", payload)

    rss_before = rss_bytes()
    threads = [threading.Thread(target=feed, args=(p,)) for p in payloads]
    begin = time.perf_counter()
    for thread in threads:
        thread.start()
    queue_max = 0
    while any(t.is_alive() for t in threads):
        queue_max = max(queue_max, watch._events.size())
        time.sleep(0.01)
    offered_seconds = time.perf_counter() - begin
    watch.flush(timeout=300)
    total_seconds = time.perf_counter() - begin
    health = watch.health.copy()
    handled = health.processed.get("progress", 0)
    dropped = health.dropped.get("progress", 0)
    rss_after = rss_bytes()
    watch.close()
    return {
        "rate": rate,
        "offered": per_thread * THREADS,
        "handled": handled,
        "dropped": dropped,
        "offered_seconds": offered_seconds,
        "handled_per_second": handled / total_seconds,
        "queue_max": queue_max,
        "rss_before": rss_before,
        "rss_after": rss_after,
        "db_bytes": db.stat().st_size,
    }


def per_event_costs(events: int = 5000) -> dict[str, float]:
    """Microseconds per progress event for each step of the worker, on the same progress as
    above, compact as ``QueryProgressEvent.json()`` delivers it (best of three passes)."""
    import json
    from datetime import UTC, datetime

    from wmwatch._core.state import QueryBook
    from wmwatch._inspect.plugin import PlanPlugin
    from wmwatch._progress import parse_progress_event
    from wmwatch._store.rows import progress_rows as _progress_rows

    texts = [
        '{"progress":' + json.dumps(progress_doc("q", batch, name="q"), separators=(",", ":")) + "}"
        for batch in range(events)
    ]

    class _NoQueries:
        store = None
        spark = None

        def get_query(self, query_id: str) -> None:
            return None

    best: dict[str, float] = {}
    for _ in range(3):
        book = QueryBook()
        plan = PlanPlugin(_NoQueries())
        try:
            began = time.perf_counter()
            snapshots = [parse_progress_event(text) for text in texts]
            parsed = time.perf_counter()
            late = [book.on_progress(snapshot) for snapshot in snapshots]
            booked = time.perf_counter()
            now = datetime.now(UTC)
            for snapshot, watermark in zip(snapshots, late, strict=True):
                _progress_rows(snapshot, watermark, now)
            rows = time.perf_counter()
            for snapshot in snapshots:
                plan.on_progress(snapshot)
            planned = time.perf_counter()
        finally:
            plan.close()
        for step, seconds in (
            ("decode and parse", parsed - began),
            ("query book", booked - parsed),
            ("history rows", rows - booked),
            ("plan plugin hook", planned - rows),
        ):
            best[step] = min(best.get(step, float("inf")), seconds / events * 1e6)
    return best


def main() -> None:
    print_machine()
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rates", default="500,1000,2000,4000")
    parser.add_argument("--tiny", action="store_true", help="one short rate (CI)")
    args = parser.parse_args()
    if args.tiny:
        args.seconds, args.rates = 0.5, "500"
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        print(
            f"{THREADS} feeder threads, {THREADS * QUERIES_PER_THREAD} queries, "
            f"{args.seconds:g} s per rate"
        )
        print(
            f"{'offered/s':>10} {'handled':>8} {'dropped':>8} {'handled/s':>10} "
            f"{'queue max':>9} {'RSS MB':>14}"
        )
        for rate in [float(r) for r in args.rates.split(",")] + [0.0]:
            r = run_rate(rate, args.seconds, work)
            label = f"{rate:.0f}" if rate else "max"
            print(
                f"{label:>10} {r['handled']:>8} {r['dropped']:>8} {r['handled_per_second']:>10.0f} "
                f"{r['queue_max']:>9} {r['rss_before'] / 1e6:>6.1f}->{r['rss_after'] / 1e6:<6.1f}"
            )
    costs = per_event_costs(200 if args.tiny else 5000)
    print("\nper progress event on the worker (the progress above, compact, best of 3):")
    for step, micros in costs.items():
        print(f"  {step:<18} {micros:>7.1f} us")
    print(
        f"  {'total':<18} {sum(costs.values()):>7.1f} us = "
        f"{1e6 / sum(costs.values()):,.0f} events/s on one core"
    )


if __name__ == "__main__":
    main()
