"""An audit that follows a query for a million batches, without a JVM: the real auditor, its
retention, status and jump watch over a :class:`~tests.synthetic_checkpoint.RollingCheckpoint`
read by the real checkpoint reader, through a real file source. Progress is handed to the
auditor as the watch's plugin hands it (``note_progress``, ``JumpWatch.note``); the audit runs
on its own thread and ``sync()`` waits for it, as a user's code would.

Shared by ``tests/test_audit_bounded.py`` (flat memory, asserted with a generous bound) and
``benchmarks/bench_long_run.py`` (the figures).
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.synthetic_checkpoint import QUERY_ID, RollingCheckpoint
from wmwatch._audit.auditor import Auditor
from wmwatch._audit.jumps.rules import BatchTimes, Thresholds
from wmwatch._audit.jumps.watch import JumpWatch
from wmwatch._audit.replay.engine import Replayer, ReplayInput
from wmwatch._audit.replay.predicates import OperatorSpec
from wmwatch._audit.replay.sources.files import FileBatchSource, FileSourceSpec


def synthetic_auditor(checkpoint: RollingCheckpoint) -> Auditor:
    """An in-job audit of a deduplication over one file source, keeping no history."""
    spec = OperatorSpec(kind="dedupe", event_time_column="ts", delay_us=10_000_000)
    source = FileBatchSource(FileSourceSpec("json", "{}", {}, ("/in",)))
    replayer = Replayer(
        spark=None,
        query_id=QUERY_ID,
        query_name="long_run",
        label="long_run",
        inputs=[ReplayInput(source, spec)],
        columns=None,
        hash_columns=(),
        parquet_path=None,
        pool="wmwatch_audit",
        max_rows_per_batch=1000,
        max_row_bytes=1024,
        job_timeout_seconds=60.0,
    )
    return Auditor(
        query_id=QUERY_ID,
        query_name="long_run",
        label="long_run",
        run_id="run-1",
        checkpoint=checkpoint,
        sink="duckdb",
        replayer=replayer,
        history=None,
        poll_interval_seconds=0.01,
        jumps=JumpWatch(thresholds=Thresholds(), history=None, label="long_run"),
        yield_factor=0.0,
    )


@dataclass
class LongRun:
    """What a run measured: traced Python memory (bytes) after each stretch of batches."""

    batches: list[int] = field(default_factory=list)
    traced_bytes: list[int] = field(default_factory=list)
    peak_bytes: int = 0
    status: dict[str, Any] = field(default_factory=dict)


def run(
    total: int,
    *,
    first_batch: int = 0,
    per_pass: int = 50,
    retain: int = 100,
    samples: int = 10,
    progress_for_purged: bool = True,
    on_sample: Callable[[int, int], None] | None = None,
) -> LongRun:
    """Commit ``total`` batches, ``per_pass`` between audit passes (more than ``retain``: the
    checkpoint purges the rest before the audit sees them, and they are lost), and trace the
    memory held after every ``total // samples`` batches (tracemalloc on for the whole run).
    ``progress_for_purged=False`` hands the audit the progress of the batches it will find in
    the checkpoint only (the rest cost the run's time, not the audit's memory)."""
    checkpoint = RollingCheckpoint(retain=retain, first_batch=first_batch, jump_every=100_000)
    auditor = synthetic_auditor(checkpoint)
    out = LongRun()
    every = max(per_pass, total // samples)
    # a driver has pyspark loaded: its import (about 10 MiB, first done by the jump watch's
    # read of an incident's rows) is not the audit's growth
    import pyspark.sql.functions  # noqa: F401

    tracemalloc.start()
    auditor.start()
    try:
        done = 0
        while done < total:
            step = min(per_pass, total - done)
            start = checkpoint.latest + 1
            # progress first: here the commits are dated in the past, so the audit would not
            # wait for it (it waits a few seconds after a fresh commit)
            first_noted = start if progress_for_purged else max(start, start + step - retain)
            for batch_id in range(first_noted, start + step):
                auditor.note_progress(
                    batch_id, checkpoint.min_event_time_ms(batch_id), "run-1", has_rows=True
                )
                assert auditor.jumps is not None
                auditor.jumps.note(
                    batch_id,
                    BatchTimes(
                        checkpoint.batch_at_ms(batch_id), checkpoint.max_event_time_ms(batch_id)
                    ),
                )
            checkpoint.commit(step)
            if not auditor.sync(120):
                raise AssertionError(f"the audit did not catch up by batch {checkpoint.latest}")
            done += step
            if done % every == 0 or done == total:
                auditor.status()  # the scrape's path, as /metrics takes it
                gc.collect()
                current, peak = tracemalloc.get_traced_memory()
                out.batches.append(done)
                out.traced_bytes.append(current)
                out.peak_bytes = max(out.peak_bytes, peak)
                if on_sample is not None:
                    on_sample(done, current)
        out.status = auditor.status()
    finally:
        auditor.stop(30)
        tracemalloc.stop()
    return out
