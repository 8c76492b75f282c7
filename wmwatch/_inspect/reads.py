"""The plan reads' own thread: the newest request per query, at most one read per interval.

py4j reads compete with the watched query for the driver and can stall, so they never run on the
watch's worker thread. A query that completes many batches a second gets one read per
``min_interval_seconds`` (the newest progress wins); the others are dropped, not queued. A key
that ends (a query that stopped) has its waiting request read at once, then is forgotten.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class LatestReads(Generic[T]):
    """Runs ``read(key, request)`` on one daemon thread for the newest request of each key.

    ``read`` must not raise: the thread serves every query of the watch.
    """

    def __init__(
        self, read: Callable[[str, T], None], *, min_interval_seconds: float, name: str
    ) -> None:
        self._min_interval_seconds = min_interval_seconds
        self._read = read
        self._requests: dict[str, T] = {}
        self._last_read: dict[str, float] = {}
        # keys whose waiting request is read at once and which are then forgotten
        self._finishing: set[str] = set()
        self._cond = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def min_interval_seconds(self) -> float:
        return self._min_interval_seconds

    @min_interval_seconds.setter
    def min_interval_seconds(self, seconds: float) -> None:
        with self._cond:
            self._min_interval_seconds = seconds
            self._cond.notify_all()  # the waiting requests may be due sooner

    def submit(self, key: str, request: T) -> None:
        """Ask for a read; replaces a request of the same key still waiting."""
        with self._cond:
            waiting = key in self._requests
            self._requests[key] = request
            # a request replacing one still waiting is due when that one was: the thread's
            # timer already covers it (waking it for nothing cost a context switch per batch)
            if not waiting:
                self._cond.notify_all()

    def discard(self, key: str) -> None:
        """Forget ``key``: its waiting request and when it was last read."""
        with self._cond:
            self._requests.pop(key, None)
            self._last_read.pop(key, None)
            self._finishing.discard(key)

    def finish(self, key: str) -> bool:
        """Read ``key``'s waiting request now, whatever the interval, then forget ``key``.

        Returns True if a request was waiting (it is read on the thread), False if ``key`` is
        already forgotten.
        """
        with self._cond:
            if key not in self._requests:
                self._last_read.pop(key, None)
                self._finishing.discard(key)
                return False
            self._finishing.add(key)
            self._cond.notify_all()
            return True

    def keys(self) -> set[str]:
        """The keys with a waiting request or a remembered read."""
        with self._cond:
            return set(self._requests) | set(self._last_read) | self._finishing

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Wait until every waiting request is read; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._requests or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(min(remaining, 0.05))
        return True

    def close(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    waits = {
                        key: self._last_read.get(key, -math.inf) + self._min_interval_seconds - now
                        for key in self._requests
                    }
                    ready = [
                        key for key, wait in waits.items() if wait <= 0 or key in self._finishing
                    ]
                    if ready:
                        break
                    # nothing due: sleep until a request (or close) notifies, no polling
                    self._cond.wait(min(waits.values(), default=None))
                key = ready[0]
                request = self._requests.pop(key)
                self._last_read[key] = now
                self._busy = True
            try:
                self._read(key, request)
            finally:
                with self._cond:
                    self._busy = False
                    if key in self._finishing and key not in self._requests:
                        self._finishing.discard(key)
                        self._last_read.pop(key, None)
                    self._cond.notify_all()
