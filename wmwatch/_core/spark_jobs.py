"""Spark jobs that wmwatch starts on the watched application, each bounded in time.

wmwatch shares the SparkContext with the query it watches, so a job of its own (an audit replay,
a state-store count) must never run unbounded: every one runs inside :func:`bounded_job`, which
tags it, names it in the Spark UI, puts it in wmwatch's scheduler pool and cancels it when it
outlives its deadline. Memory is bounded by how each caller shapes its job (aggregates, limits,
chunks); this module bounds time.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from wmwatch._errors import WmwatchError


class JobTimeoutError(WmwatchError):
    """A wmwatch Spark job ran past its deadline and was cancelled."""


@contextlib.contextmanager
def bounded_job(
    spark: Any, *, description: str, timeout_seconds: float, pool: str | None = None
) -> Iterator[None]:
    """Run the Spark actions of the ``with`` body as wmwatch jobs, cancelled after the deadline.

    Local properties are per thread (PySpark's pinned threads), so this never touches the
    production query's jobs. Raises :class:`JobTimeoutError` when the deadline cancelled them.
    """
    sc = spark.sparkContext
    tag = f"wmwatch-{uuid.uuid4().hex[:12]}"
    timed_out = threading.Event()

    def cancel() -> None:
        timed_out.set()
        with contextlib.suppress(Exception):
            sc.cancelJobsWithTag(tag)

    timer = threading.Timer(timeout_seconds, cancel)
    timer.daemon = True
    if pool is not None:
        sc.setLocalProperty("spark.scheduler.pool", pool)
    sc.setJobDescription(description)
    sc.addJobTag(tag)
    sc.setInterruptOnCancel(True)
    timer.start()
    try:
        yield
    except Exception as exc:
        if timed_out.is_set():
            raise JobTimeoutError(
                f"{description} took longer than {timeout_seconds:g} s and was cancelled"
            ) from exc
        raise
    finally:
        timer.cancel()
        with contextlib.suppress(Exception):
            sc.removeJobTag(tag)
            sc.setInterruptOnCancel(False)
            sc.setJobDescription(None)
