"""When a replay may run beside the application it audits.

Under FIFO, where scheduler pools are ignored, a replay submitted while the production queries
run takes the slots of the jobs submitted after it: :class:`IdleWait` waits (bounded) for a
moment when the application runs no job, which is how the audit yields there. A real-time query
fails a batch that cannot get every task slot it needs at once: :class:`SlotGate` lets a replay
start beside one only when a slot is left over.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from wmwatch._core.sessions import is_connect
from wmwatch._text import get_logger

log = get_logger("wmwatch.audit")

# Before a replay the audit waits for a moment when no Spark job runs, at most this many times
# the last replay's duration: where the application never idles, the replays then take at most
# about a tenth of its time (FIFO ignores pools, so this is how the audit yields there).
YIELD_FACTOR = 9.0
_YIELD_MIN_SECONDS = 1.0
_YIELD_MAX_SECONDS = 60.0
_YIELD_POLL_SECONDS = 0.1
# a real-time query's slots are read twice this far apart before a replay starts beside it
_SLOT_CHECK_SECONDS = 0.25


class IdleWait:
    """Waits, bounded, until the application runs no Spark job, so a replay fills idle time.

    Waiting for a moment without jobs (between micro-batches) keeps a replay out of the
    queries' way. The wait is at most ``factor`` times the last replay, so where the
    application never idles the audit still advances, using about a tenth of the time.
    """

    def __init__(self, factor: float = YIELD_FACTOR) -> None:
        self.factor = factor
        self.last_replay_seconds = 0.0

    def wait(self, spark: Any, stop: threading.Event) -> float:
        """Wait for the application to idle; the seconds waited. Nothing to wait for where
        Spark gives no job status."""
        if self.factor <= 0:
            return 0.0
        budget = self.factor * self.last_replay_seconds
        deadline = time.monotonic() + min(_YIELD_MAX_SECONDS, max(_YIELD_MIN_SECONDS, budget))
        started = time.monotonic()
        try:
            while application_busy(spark) and time.monotonic() < deadline:
                if stop.wait(_YIELD_POLL_SECONDS):
                    break
        except Exception:  # noqa: BLE001 - no status to wait on: replay right away
            pass
        return time.monotonic() - started


def application_busy(spark: Any) -> bool:
    """A Spark job runs, or a streaming query of the session is in a trigger or has data
    waiting (between its jobs a busy query runs none, so jobs alone would look idle)."""
    if not is_connect(spark) and spark.sparkContext.statusTracker().getActiveJobsIds():
        return True  # a Spark Connect client sees no jobs, only its queries' status
    for query in spark.streams.active:
        status = query.status
        if status.get("isTriggerActive") or status.get("isDataAvailable"):
            return True
    return False


class SlotGate:
    """Whether a replay may run beside a real-time query now.

    A real-time batch must get every task slot its stages need at once, or Spark fails the
    query (``CONCURRENT_SCHEDULER_INSUFFICIENT_SLOT``); its tasks hold their slots for the
    whole batch. So while the audited run lasts, a replay (one task at a time) starts only
    when, twice in a row, a batch is running and a slot is left over beside the most tasks
    ever seen running at once: a batch's ending stages free their slots one by one (a
    source's task ends before the aggregation that drains it), and a replay started in
    that moment would hold a slot the next batch needs.
    """

    def __init__(self, label: str) -> None:
        self._label = label
        self._warned = False
        # the most tasks seen running at once while the real-time run lasts: what its batches
        # hold (the audit's own replays never run while it looks)
        self._most_tasks_seen = 0

    def free(self, spark: Any) -> bool:
        for attempt in range(2):
            if attempt:
                time.sleep(_SLOT_CHECK_SECONDS)
            slots = task_slots(spark)
            if slots is not None:
                self._most_tasks_seen = max(self._most_tasks_seen, slots[1])
            if slots is None or slots[1] == 0 or slots[0] - self._most_tasks_seen < 1:
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "wmwatch: audit of real-time query %s waits for a spare task slot: "
                        "the query's batches hold every slot, and Spark fails a real-time "
                        "batch that cannot get all of them, so replays wait (Spark's dropped "
                        "counts are still recorded); give the application one more core to "
                        "audit while it runs",
                        self._label,
                    )
                return False
        return True


def task_slots(spark: Any) -> tuple[int, int] | None:
    """(task slots of the application, tasks running now); None where Spark does not say."""
    if is_connect(spark):
        return None
    try:
        tracker = spark.sparkContext.statusTracker()
        running = 0
        for stage_id in tracker.getActiveStageIds():
            info = tracker.getStageInfo(stage_id)
            running += info.numActiveTasks if info is not None else 0
        return int(spark.sparkContext.defaultParallelism), running
    except Exception:  # noqa: BLE001 - unknown: the replay waits
        return None
