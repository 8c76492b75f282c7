"""A driver that attaches wmwatch and records history as fast as it can, until it is SIGKILLed.

It feeds progress events for two queries through a real Watch (queue, worker, HistoryStore) and,
for every batch, an audit marker row through ``store.submit`` as the late-row audit does. After
each successful ``watch.flush()`` it prints the highest batch id now committed, so the test knows
what was durable before the kill.
"""

from __future__ import annotations

import sys
from pathlib import Path

import wmwatch
from tests.scripts.safety_support import NoQueriesSession, progress_event_json


def audit_marker(query_id: str, batch_id: int) -> object:
    def write(con: object) -> None:
        con.execute(  # type: ignore[attr-defined]  # a private attribute, on purpose
            "INSERT OR REPLACE INTO audit_batches (query_id, batch_id, run_id, late_watermark_at, "
            "late_rows, sink, location, audited_at) "
            "VALUES (?, ?, 'run-1', NULL, ?, 'duckdb', NULL, now())",
            [query_id, batch_id, batch_id % 5],
        )

    return write


def main(db: Path) -> None:
    watch = wmwatch.attach(NoQueriesSession(), db=str(db), metrics_port=None, listener="stock")
    batch_id = 0
    while True:
        for _ in range(400):
            for query_id in ("kill_a", "kill_b"):
                watch._events.offer(
                    "progress", progress_event_json(query_id, batch_id, name=query_id)
                )
                watch.store.submit(
                    audit_marker(query_id, batch_id), description=f"audit {batch_id}"
                )
            batch_id += 1
        if not watch.flush(timeout=60):
            print("flush failed", flush=True)
            continue
        print(batch_id - 1, flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
