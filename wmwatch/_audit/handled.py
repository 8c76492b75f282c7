"""The batches an audit has handled (audited, or counted lost), kept as ranges of batch ids.

An audit that runs for a year at one batch a second handles about 30 million batches, and one
started on a query (or a checkpoint) whose first batch is numbered in the millions finds
millions of batch ids purged before it: remembering them one id at a time would grow the
driver's memory for as long as it runs. Batches are handled in order, so what is handled is
"everything below a floor" plus a few runs above it (a batch still waiting for its progress, a
hole in the commits): a floor and a short list of ``[first, last]`` ranges, whatever the count.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

# One run of batch ids, first and last included.
BatchRange = tuple[int, int]


def range_count(ranges: list[BatchRange]) -> int:
    """How many batch ids ``ranges`` hold."""
    return sum(last - first + 1 for first, last in ranges)


class HandledBatches:
    """Batch ids below :attr:`floor` and in a few disjoint ranges above it.

    Not thread-safe: the auditor holds its lock around every call.
    """

    __slots__ = ("_ends", "_starts", "floor")

    def __init__(self, floor: int = 0) -> None:
        # every batch below this is handled (or was an earlier audit's)
        self.floor = floor
        # sorted, disjoint, not touching each other or the floor
        self._starts: list[int] = []
        self._ends: list[int] = []

    def __contains__(self, batch_id: int) -> bool:
        if batch_id < self.floor:
            return True
        at = bisect.bisect_right(self._starts, batch_id) - 1
        return at >= 0 and batch_id <= self._ends[at]

    def ranges(self) -> Iterator[BatchRange]:
        """The runs above the floor (at most a few while batches are handled in order)."""
        return zip(self._starts, self._ends, strict=True)

    def add(self, first: int, last: int | None = None) -> None:
        """Mark ``first`` to ``last`` (inclusive; ``first`` alone without it) handled."""
        last = first if last is None else last
        if last < first:
            return
        first = max(first, self.floor)
        if last < first:
            return  # all below the floor already
        # the ranges this one touches or overlaps are merged into it
        lo = bisect.bisect_left(self._ends, first - 1)
        hi = bisect.bisect_right(self._starts, last + 1)
        if lo < hi:
            first = min(first, self._starts[lo])
            last = max(last, self._ends[hi - 1])
        self._starts[lo:hi] = [first]
        self._ends[lo:hi] = [last]
        if self._starts[0] <= self.floor:
            # the run reaches the floor: the floor moves up past it
            self.floor = self._ends[0] + 1
            del self._starts[0], self._ends[0]

    def missing(self, first: int, last: int) -> list[BatchRange]:
        """The runs of ``first`` to ``last`` (inclusive) not handled, in order."""
        gaps: list[BatchRange] = []
        at = max(first, self.floor)
        for start, end in self.ranges():
            if at > last:
                break
            if end < at:
                continue
            if start > at:
                gaps.append((at, min(last, start - 1)))
            at = max(at, end + 1)
        if at <= last:
            gaps.append((at, last))
        return gaps
