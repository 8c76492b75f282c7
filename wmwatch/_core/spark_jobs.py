"""Spark jobs that wmwatch starts on the watched application, each bounded in time.

wmwatch shares the SparkContext with the query it watches, so a job of its own (an audit replay,
a state-store count) must never run unbounded: every one runs inside :func:`bounded_job`, which
tags it, names it in the Spark UI, puts it in wmwatch's scheduler pool and cancels it when it
outlives its deadline (on Spark Connect: tags it and has the server interrupt it). Memory is
bounded by how each caller shapes its job (aggregates, limits, chunks); this module bounds time.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from wmwatch._core.sessions import is_connect
from wmwatch._errors import WmwatchError

# after the deadline, how often the body's jobs are cancelled again
_CANCEL_AGAIN_SECONDS = 1.0


class JobTimeoutError(WmwatchError):
    """A wmwatch Spark job ran past its deadline and was cancelled."""


@contextlib.contextmanager
def bounded_job(
    spark: Any, *, description: str, timeout_seconds: float, pool: str | None = None
) -> Iterator[None]:
    """Run the Spark actions of the ``with`` body as wmwatch jobs, cancelled after the deadline.

    Local properties are per thread (PySpark's pinned threads), so this never touches the
    production query's jobs. Raises :class:`JobTimeoutError` when the deadline cancelled them.
    On Spark Connect the body's operations carry a tag (Connect's tags are per thread too) that
    the server interrupts; pools and job descriptions are server settings a client cannot scope
    to its own jobs, so they are left alone there.
    """
    tag = f"wmwatch-{uuid.uuid4().hex[:12]}"
    if is_connect(spark):
        spark.addTag(tag)
        try:
            with _deadline(lambda: spark.interruptTag(tag), description, timeout_seconds):
                yield
        finally:
            with contextlib.suppress(Exception):
                spark.removeTag(tag)
        return
    sc = spark.sparkContext
    if pool is not None:
        sc.setLocalProperty("spark.scheduler.pool", pool)
    sc.setJobDescription(description)
    sc.addJobTag(tag)
    sc.setInterruptOnCancel(True)
    try:
        with _deadline(lambda: sc.cancelJobsWithTag(tag), description, timeout_seconds):
            yield
    finally:
        with contextlib.suppress(Exception):
            sc.removeJobTag(tag)
            sc.setInterruptOnCancel(False)
            sc.setJobDescription(None)


@contextlib.contextmanager
def _deadline(
    cancel: Callable[[], Any], description: str, timeout_seconds: float
) -> Iterator[None]:
    """Call ``cancel`` once the body outlives ``timeout_seconds``, and again every second until
    it ends: a job submitted after the deadline (a slow plan, the body's next action) is
    cancelled too. The body's failure after the deadline is a :class:`JobTimeoutError`."""
    timed_out = threading.Event()
    done = threading.Event()

    def watch() -> None:
        if done.wait(timeout_seconds):
            return
        timed_out.set()
        while not done.is_set():
            with contextlib.suppress(Exception):
                cancel()
            done.wait(_CANCEL_AGAIN_SECONDS)

    watcher = threading.Thread(target=watch, name="wmwatch-job-deadline", daemon=True)
    watcher.start()
    try:
        yield
    except Exception as exc:
        if timed_out.is_set():
            raise JobTimeoutError(
                f"{description} took longer than {timeout_seconds:g} s and was cancelled"
            ) from exc
        raise
    finally:
        done.set()
