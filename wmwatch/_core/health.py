"""wmwatch's own health counters: what the listener received, dropped, failed on, and how fast.

Incremented from py4j callback threads and the worker thread, read at scrape time.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass

# Seconds; handling one event is expected to take well under a millisecond to a few ms.
HANDLING_BUCKETS_SECONDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class Health:
    """Counters written by the listener's and the worker's threads; :meth:`copy` reads them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.received: defaultdict[str, int] = defaultdict(int)
        self.dropped: defaultdict[str, int] = defaultdict(int)
        self.processed: defaultdict[str, int] = defaultdict(int)
        self.errors: defaultdict[str, int] = defaultdict(int)
        self.handling_buckets = [0] * len(HANDLING_BUCKETS_SECONDS)
        self.handling_count = 0
        self.handling_sum_seconds = 0.0
        self.listener_mode = "none"
        self.metrics_server_up = False
        self.spark_listener_bus_dropped = 0
        # False until the bus could be read (Spark Connect and stand-in sessions never can)
        self.spark_listener_bus_readable = False

    def count(self, table: defaultdict[str, int], key: str, amount: int = 1) -> None:
        with self._lock:
            table[key] += amount

    def error(self, stage: str) -> None:
        self.count(self.errors, stage)

    def observe_handling(self, seconds: float) -> None:
        with self._lock:
            self.handling_count += 1
            self.handling_sum_seconds += seconds
            for index, bound in enumerate(HANDLING_BUCKETS_SECONDS):
                if seconds <= bound:
                    self.handling_buckets[index] += 1

    def copy(self) -> HealthSnapshot:
        with self._lock:
            return HealthSnapshot(
                received=dict(self.received),
                dropped=dict(self.dropped),
                processed=dict(self.processed),
                errors=dict(self.errors),
                handling_buckets=tuple(self.handling_buckets),
                handling_count=self.handling_count,
                handling_sum_seconds=self.handling_sum_seconds,
                listener_mode=self.listener_mode,
                metrics_server_up=self.metrics_server_up,
                spark_listener_bus_dropped=self.spark_listener_bus_dropped,
                spark_listener_bus_readable=self.spark_listener_bus_readable,
            )


@dataclass(frozen=True, slots=True)
class HealthSnapshot:
    """The counters of :class:`Health` at one moment, read together under its lock."""

    received: dict[str, int]
    dropped: dict[str, int]
    processed: dict[str, int]
    errors: dict[str, int]
    # one count per bound of HANDLING_BUCKETS_SECONDS, cumulative as Prometheus buckets are
    handling_buckets: tuple[int, ...]
    handling_count: int
    handling_sum_seconds: float
    listener_mode: str
    metrics_server_up: bool
    spark_listener_bus_dropped: int
    spark_listener_bus_readable: bool
