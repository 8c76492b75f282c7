"""An audit that follows a query for a million batches, and one started at batch 5,000,000:
what the audit holds in memory as the batches go by (tracemalloc), no JVM.

The real auditor, its retention, status and jump watch, over a checkpoint of a query that
commits one batch a second and keeps the newest 100 (tests/synthetic_checkpoint.py), through a
real file source; the audit runs on its own thread and keeps up (``sync()`` after every 50
batches), so every batch is audited. Printed: the memory traced after each tenth of the run
(what the audit holds; one int per batch would add about 3.5 MiB per 100,000 batches), the
CPU per batch on the audit's thread and the driver's, and, for an audit first started on a
query whose batches begin at 5,000,000, the peak traced memory and the lost batches.

The same on real Spark (a query restarted by Spark at 5,000,0xx, with the audit and the sidecar)
is the test tests/test_audit_started_late_spark.py.

Run: python benchmarks/bench_long_run.py [--tiny] [--batches N]
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _machine import print_machine

from tests.long_run import run, synthetic_auditor
from tests.synthetic_checkpoint import RollingCheckpoint

MiB = 1024 * 1024


def started_late(first_batch: int) -> tuple[float, dict[str, object], float]:
    """Peak traced MiB of an audit first started on a query whose batches begin at
    ``first_batch``, its status, and the seconds until it caught up."""
    checkpoint = RollingCheckpoint(first_batch=first_batch)
    auditor = synthetic_auditor(checkpoint)
    for batch_id in range(first_batch, first_batch + 20):
        auditor.note_progress(
            batch_id, checkpoint.min_event_time_ms(batch_id), "run-1", has_rows=True
        )
    checkpoint.commit(20)
    tracemalloc.start()
    started = time.perf_counter()
    try:
        auditor.start()
        assert auditor.sync(600)
        took = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
    finally:
        auditor.stop(30)
        tracemalloc.stop()
    return peak / MiB, auditor.status(), took


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tiny", action="store_true", help="20,000 batches (CI)")
    parser.add_argument("--batches", type=int, default=1_000_000)
    args = parser.parse_args()
    print_machine()
    logging.getLogger("wmwatch").setLevel(logging.ERROR)
    total = 20_000 if args.tiny else args.batches
    cpu_before = time.process_time()
    wall_before = time.perf_counter()

    def sample(batches: int, traced: int) -> None:
        print(f"   after {batches:>9,} batches: {traced / MiB:6.2f} MiB traced", flush=True)

    print(f"1. an audit that keeps up with {total:,} batches (50 per pass), memory traced:")
    result = run(total, per_pass=50, on_sample=sample)
    cpu = time.process_time() - cpu_before
    wall = time.perf_counter() - wall_before
    status = result.status
    growth = (result.traced_bytes[-1] - result.traced_bytes[0]) / MiB
    print(
        f"   held {result.traced_bytes[0] / MiB:.2f} MiB after the first tenth, "
        f"{result.traced_bytes[-1] / MiB:.2f} MiB at the end ({growth:+.2f} MiB); peak "
        f"{result.peak_bytes / MiB:.2f} MiB; {status['batches_audited']:,} audited, "
        f"{status['batches_lost']:,} lost, {status['watermark_incidents']} watermark incidents"
    )
    print(
        f"   {cpu / total * 1e6:.0f} us CPU per batch (audit thread and driver, tracemalloc on), "
        f"{wall:.0f} s"
    )
    first = 5_000_000
    peak, late, took = started_late(first)
    print(
        f"2. an audit started at batch {first:,}: peak {peak:.2f} MiB traced, "
        f"{late['batches_lost']:,} batches lost (one range), {late['batches_audited']} audited, "
        f"caught up in {took:.2f} s"
    )


if __name__ == "__main__":
    main()
