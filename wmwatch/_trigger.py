"""A query run's trigger: how it runs batches, and how long one lasts in real-time mode.

Progress does not say. Classic PySpark reads it once per run from the query's
``StreamExecution.trigger()`` (``RealTimeTrigger(batchDurationMs)``,
``ProcessingTimeTrigger(intervalMs)``, ...); a Spark Connect client cannot, and says
``unknown``. The mode is a small fixed set, fit for a metric label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

PROCESSING_TIME = "processing_time"
REAL_TIME = "real_time"
AVAILABLE_NOW = "available_now"
ONCE = "once"
CONTINUOUS = "continuous"
UNKNOWN = "unknown"
MODES = (PROCESSING_TIME, REAL_TIME, AVAILABLE_NOW, ONCE, CONTINUOUS, UNKNOWN)

# Spark's trigger classes (org.apache.spark.sql.execution.streaming), and their interval
_BY_CLASS = {
    "ProcessingTimeTrigger": (PROCESSING_TIME, "intervalMs"),
    "RealTimeTrigger": (REAL_TIME, "batchDurationMs"),
    "AvailableNowTrigger": (AVAILABLE_NOW, None),
    "OneTimeTrigger": (ONCE, None),
    "ContinuousTrigger": (CONTINUOUS, "intervalMs"),
}


@dataclass(frozen=True, slots=True)
class Trigger:
    """How a run triggers batches; ``interval_ms`` is None where the mode has none."""

    mode: str = UNKNOWN
    interval_ms: int | None = None

    @property
    def interval_seconds(self) -> float | None:
        return None if self.interval_ms is None else self.interval_ms / 1000.0

    @property
    def real_time(self) -> bool:
        return self.mode == REAL_TIME


def trigger_of_class(class_name: str, interval_ms: int | None) -> Trigger:
    """The trigger a Spark trigger class stands for (``unknown`` for any other class)."""
    found = _BY_CLASS.get(class_name.rstrip("$"))
    if found is None:
        return Trigger()
    mode, accessor = found
    return Trigger(mode, interval_ms if accessor is not None else None)


def read_trigger(query: Any) -> Trigger:
    """The trigger of a running query (classic PySpark; ``unknown`` on Spark Connect or when
    Spark's internals do not answer)."""
    jsq = getattr(query, "_jsq", None)
    if jsq is None:
        return Trigger()
    try:
        trigger = jsq.streamingQuery().trigger()
        name = str(trigger.getClass().getSimpleName())
        accessor = _BY_CLASS.get(name.rstrip("$"), (UNKNOWN, None))[1]
        interval = int(getattr(trigger, accessor)()) if accessor is not None else None
    except Exception:  # noqa: BLE001 - internal API: the mode is then unknown
        return Trigger()
    return trigger_of_class(name, interval)
