"""Per-operator and per-source watermarks, and the watermark findings drawn from them.

Progress shows one global watermark. Spark keeps more: each ``withWatermark`` node's own value
(``max event time - delay``, in the query's WatermarkTracker) from which the multiple-watermark
policy (``min`` by default) picks the global one, and each stateful operator's late-row and
eviction watermarks. This module holds the pure logic over those values:
:func:`holding_back` names the input the global watermark waits for (an idle input included),
and :class:`WatermarkMonitor` turns a query's progress into ``watermark_stalled`` (rows flow,
the watermark does not move) and ``watermark_jump`` (one batch moves it far ahead; the rows
dropped afterwards are attributed to the jump) verdicts. No JVM here: ``plan`` reads Spark.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from wmwatch._progress import ProgressSnapshot
from wmwatch._time import EPOCH, format_duration, from_epoch_ms, to_epoch_ms

MIN_POLICY = "min"
MAX_POLICY = "max"


@dataclass(frozen=True, slots=True)
class SourceWatermark:
    """One ``withWatermark`` input: its own watermark and the max event time behind it."""

    node_id: str
    source: str  # the stream(s) under the node, as progress describes them
    source_indexes: tuple[int, ...]
    event_time_column: str | None
    delay_seconds: float | None
    watermark_at: datetime | None  # None: no rows seen by this node in this run yet
    idle_batches: int = 0  # consecutive batches in which its sources read nothing
    holding_back: bool = False

    @property
    def event_time_max_at(self) -> datetime | None:
        if self.watermark_at is None or self.delay_seconds is None:
            return None
        return self.watermark_at + timedelta(seconds=self.delay_seconds)


@dataclass(frozen=True, slots=True)
class OperatorWatermark:
    """A stateful operator's two watermarks (input for late rows, and for eviction/output)."""

    operator_id: int
    operator_name: str
    late_at: datetime | None
    eviction_at: datetime | None


def holding_back(sources: Sequence[SourceWatermark], policy: str) -> list[SourceWatermark]:
    """Mark the input(s) the global watermark waits for.

    Under the ``min`` policy with several inputs, that is the input whose own watermark is the
    lowest while another is ahead of it. Under ``max`` nothing holds the watermark back (a slow
    input's rows are dropped instead). An input with no rows yet in this run is not counted.
    """
    known = [s.watermark_at for s in sources if s.watermark_at is not None]
    marked = []
    lowest = min(known, default=None)
    highest = max(known, default=None)
    for s in sources:
        back = (
            policy.lower() == MIN_POLICY
            and len(known) >= 2
            and s.watermark_at is not None
            and lowest is not None
            and highest is not None
            and s.watermark_at == lowest
            and highest > lowest
        )
        marked.append(replace(s, holding_back=back))
    return marked


def policy_from_conf(conf: dict[str, str] | None) -> str:
    """The multiple-watermark policy in force (Spark's default is ``min``)."""
    value = (conf or {}).get("spark.sql.streaming.multipleWatermarkPolicy", MIN_POLICY)
    return value.strip().lower() or MIN_POLICY


@dataclass(frozen=True, slots=True)
class Verdict:
    """Something the monitor wants opened, updated or resolved as a finding."""

    kind: str
    action: str  # open | resolve
    message: str
    evidence: dict[str, object]
    fix: str | None = None
    severity: str = "warning"


@dataclass
class _Jump:
    """A watermark jump being followed: the rows dropped as late until the event times catch up
    with the new watermark (or ``batches_left`` runs out) are attributed to it."""

    batch_id: int
    watermark_before_at: datetime | None
    watermark_after_at: datetime
    jump_seconds: float
    typical_advance_seconds: float | None
    ahead_of_batch_time_seconds: float | None
    caused_by_event_time_max_at: datetime | None
    caused_by_batch_id: int
    batches_left: int
    dropped_after_jump: int = 0
    batches_with_drops: list[int] = field(default_factory=list)

    def evidence(self) -> dict[str, object]:
        before_at, caused_at = self.watermark_before_at, self.caused_by_event_time_max_at
        return {
            "batch_id": self.batch_id,
            "watermark_before_at": before_at and before_at.isoformat(),
            "watermark_after_at": self.watermark_after_at.isoformat(),
            "jump_seconds": self.jump_seconds,
            "typical_advance_seconds": self.typical_advance_seconds,
            "ahead_of_batch_time_seconds": self.ahead_of_batch_time_seconds,
            "caused_by_event_time_max_at": caused_at and caused_at.isoformat(),
            "caused_by_batch_id": self.caused_by_batch_id,
            "dropped_after_jump": self.dropped_after_jump,
            "batches_with_drops": self.batches_with_drops,
        }


@dataclass
class WatermarkMonitor:
    """Watches one query's global watermark batch by batch.

    Stalled: ``stall_batches`` batches in a row took input but left the watermark where it was.
    Jump: one batch moved it by at least ``jump_min_seconds`` and by ``jump_factor`` times the
    usual advance; every row dropped by watermark afterwards is attributed to the jump until the
    event times catch up with the new watermark (or ``attribute_batches`` batches passed).
    """

    stall_batches: int = 5
    jump_min_seconds: float = 3600.0
    jump_factor: float = 10.0
    attribute_batches: int = 200
    _last: ProgressSnapshot | None = None
    _deltas: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    _stall_since: ProgressSnapshot | None = None
    _stall_batches: int = 0
    _stall_rows: int = 0
    _stall_event_time_max_at: datetime | None = None
    _stalled_open: bool = False
    _jump: _Jump | None = None

    def observe(
        self, snap: ProgressSnapshot, *, holding: Sequence[SourceWatermark] = ()
    ) -> list[Verdict]:
        verdicts: list[Verdict] = []
        last, self._last = self._last, snap
        if snap.watermark_at is None:
            return verdicts  # the query has no watermark
        verdicts.extend(self._attribute(snap))
        if last is None or last.watermark_at is None:
            return verdicts
        moved = snap.watermark_at != last.watermark_at
        verdicts.extend(self._stall(snap, last, moved, holding))
        if moved and last.watermark_at != EPOCH and snap.watermark_at > last.watermark_at:
            delta = (snap.watermark_at - last.watermark_at).total_seconds()
            verdicts.extend(self._maybe_jump(snap, last, delta))
            self._deltas.append(delta)
        return verdicts

    # -- stalled ---------------------------------------------------------------------------

    def _stall(
        self,
        snap: ProgressSnapshot,
        last: ProgressSnapshot,
        moved: bool,
        holding: Sequence[SourceWatermark],
    ) -> list[Verdict]:
        if moved:
            self._stall_since, self._stall_batches, self._stall_rows = None, 0, 0
            self._stall_event_time_max_at = None
            if self._stalled_open:
                self._stalled_open = False
                return [
                    Verdict(
                        "watermark_stalled",
                        "resolve",
                        f"the watermark moved again in batch {snap.batch_id}",
                        {"batch_id": snap.batch_id},
                    )
                ]
            return []
        if not snap.input_rows:
            return []
        if self._stall_since is None:
            self._stall_since = last
        self._stall_batches += 1
        self._stall_rows += snap.input_rows
        if snap.event_time_max_at is not None and (
            self._stall_event_time_max_at is None
            or snap.event_time_max_at > self._stall_event_time_max_at
        ):
            self._stall_event_time_max_at = snap.event_time_max_at
        if self._stall_batches < self.stall_batches:
            return []
        self._stalled_open = True
        since = self._stall_since
        stalled_seconds = (
            (snap.timestamp_at - since.timestamp_at).total_seconds()
            if snap.timestamp_at and since.timestamp_at
            else None
        )
        back = [s for s in holding if s.holding_back]
        watermark_at = snap.watermark_at and snap.watermark_at.isoformat()
        seen_max_at = self._stall_event_time_max_at and self._stall_event_time_max_at.isoformat()
        evidence: dict[str, object] = {
            "watermark_at": watermark_at,
            "since_batch_id": since.batch_id,
            "batches": self._stall_batches,
            "input_rows": self._stall_rows,
            "stalled_seconds": stalled_seconds,
            "event_time_max_at": seen_max_at,
        }
        if back:
            evidence["holding_back"] = [s.source for s in back]
            evidence["holding_back_idle_batches"] = {s.source: s.idle_batches for s in back}
            who = ", ".join(
                f"{s.source} (idle for {s.idle_batches} batches)"
                if s.idle_batches
                else f"{s.source} (behind)"
                for s in back
            )
            message = (
                f"the watermark has stayed at {watermark_at} for {self._stall_batches} "
                f"batches while {self._stall_rows} rows arrived; it is held back by {who}"
            )
            fix = (
                "an input that stops receiving data holds the global watermark under the default "
                "multipleWatermarkPolicy=min: feed it (or a heartbeat row), drop it from the "
                "query, or set spark.sql.streaming.multipleWatermarkPolicy=max if dropping its "
                "late rows is acceptable"
            )
        else:
            message = (
                f"the watermark has stayed at {watermark_at} for {self._stall_batches} "
                f"batches while {self._stall_rows} rows arrived (max event time seen "
                f"{seen_max_at}): their event times do not move it forward"
            )
            fix = (
                "check that the withWatermark column carries event time that advances "
                "(not a constant, a parse failure or replayed old data)"
            )
        return [Verdict("watermark_stalled", "open", message, evidence, fix)]

    # -- jump ------------------------------------------------------------------------------

    def _maybe_jump(
        self, snap: ProgressSnapshot, last: ProgressSnapshot, delta: float
    ) -> list[Verdict]:
        typical = statistics.median(self._deltas) if self._deltas else None
        if delta < self.jump_min_seconds:
            return []
        if typical is not None and delta < self.jump_factor * typical:
            return []
        ahead = (
            (snap.watermark_at - snap.timestamp_at).total_seconds()
            if snap.watermark_at and snap.timestamp_at
            else None
        )
        assert snap.watermark_at is not None  # observe() returns before when there is none
        self._jump = _Jump(
            batch_id=snap.batch_id,
            watermark_before_at=last.watermark_at,
            watermark_after_at=snap.watermark_at,
            jump_seconds=delta,
            typical_advance_seconds=typical,
            ahead_of_batch_time_seconds=ahead,
            # the row that moved it arrived in the previous data batch (watermarks trail a batch)
            caused_by_event_time_max_at=last.event_time_max_at or snap.event_time_max_at,
            caused_by_batch_id=last.batch_id if last.event_time_max_at else snap.batch_id,
            batches_left=self.attribute_batches,
        )
        return [self._jump_verdict(self._jump, "open")]

    def _attribute(self, snap: ProgressSnapshot) -> list[Verdict]:
        jump = self._jump
        if jump is None or snap.batch_id == jump.batch_id:
            return []
        dropped = snap.rows_dropped_by_watermark
        if dropped:
            jump.dropped_after_jump += dropped
            if len(jump.batches_with_drops) < 50:
                jump.batches_with_drops.append(snap.batch_id)
        jump.batches_left -= 1
        caught_up = (
            snap.event_time_max_at is not None and snap.event_time_max_at >= jump.watermark_after_at
        )
        if caught_up or jump.batches_left <= 0:
            self._jump = None
            return [self._jump_verdict(jump, "resolve")]
        return [self._jump_verdict(jump, "open")] if dropped else []

    @staticmethod
    def _jump_verdict(jump: _Jump, action: str) -> Verdict:
        evidence = jump.evidence()
        message = (
            f"the watermark jumped {jump.jump_seconds / 3600:.1f} h ahead in batch "
            f"{jump.batch_id} (to {evidence['watermark_after_at']}), moved by a row with event "
            f"time {evidence['caused_by_event_time_max_at']}; {jump.dropped_after_jump} rows "
            "dropped as late since then are attributed to it"
        )
        fix = (
            "filter or quarantine future-dated rows before withWatermark (e.g. keep only rows "
            "with ts <= current_timestamp() + INTERVAL 5 MINUTES); rows already dropped can be "
            "recovered with the late-row audit"
        )
        return Verdict("watermark_jump", action, message, evidence, fix, severity="critical")


class ProgressMark(NamedTuple):
    """What one batch's progress tells about the nodes' watermarks."""

    watermark_ms: int | None
    max_event_ms: int | None
    rows_by_source: dict[int, int]

    @classmethod
    def of(cls, snapshot: ProgressSnapshot) -> ProgressMark:
        return cls(
            to_epoch_ms(snapshot.watermark_at) if snapshot.has_watermark else None,
            to_epoch_ms(snapshot.event_time_max_at),
            {s.index: s.input_rows or 0 for s in snapshot.sources},
        )


@dataclass
class NodeWatermarks:
    """Each ``withWatermark`` node's own watermark, followed from progress alone (Spark
    Connect: a client cannot read the query's watermark tracker).

    Spark keeps one watermark per node: the highest ``max event time - delay`` of the rows that
    reached it. A batch's ``eventTime`` describes the first node (plan order) that saw rows, so
    that node's value is exact; another node that saw rows in the same batch is then known only
    as a lower bound. The global watermark gives the rest: once it has moved in this run it is
    the policy's pick over the nodes (``min``: the lowest; a node without rows counts as 0), so a
    single node not known exactly, with every known node above (``min``) or below (``max``) the
    global value, has exactly that value. Only exact values are reported; the others are None.
    """

    order: tuple[str, ...]  # node ids in plan order
    delays_ms: dict[str, int]
    sources: dict[str, tuple[int, ...]]  # the source indexes under each node
    policy: str = MIN_POLICY
    values_ms: dict[str, int] = field(default_factory=dict)
    exact: set[str] = field(default_factory=set)
    seen: set[str] = field(default_factory=set)  # nodes that saw rows in this run
    global_ms: int | None = None
    global_moved: bool = False

    def observe(
        self, watermark_ms: int | None, max_event_ms: int | None, rows_by_source: dict[int, int]
    ) -> None:
        """One batch's progress: its watermark (the global one after the batch before), its
        ``eventTime.max`` and the rows each source read."""
        if watermark_ms is not None:
            if self.global_ms is not None and watermark_ms > self.global_ms:
                self.global_moved = True
            self.global_ms = max(watermark_ms, self.global_ms or watermark_ms)
            if self.global_moved:
                self._infer_from_global(self.global_ms)
        with_rows = [
            n for n in self.order if any(rows_by_source.get(i, 0) > 0 for i in self.sources[n])
        ]
        if not with_rows or max_event_ms is None:
            return
        first, *others = with_rows
        value = max_event_ms - self.delays_ms.get(first, 0)
        if first not in self.seen:
            self.exact.add(first)  # the first rows this node saw in the run
        if value > self.values_ms.get(first, value - 1):
            self.values_ms[first] = value
        for node in others:  # it saw rows, but how late they were is not reported
            self.exact.discard(node)
        self.seen.update(with_rows)

    def _infer_from_global(self, global_ms: int) -> None:
        unknown = [n for n in self.order if n not in self.exact]
        known = [self.values_ms[n] for n in self.order if n in self.exact]
        if len(unknown) != 1:
            return
        if self.policy.lower() == MIN_POLICY:
            pinned = all(v > global_ms for v in known)
        else:
            pinned = all(v < global_ms for v in known)
        if pinned:
            self.values_ms[unknown[0]] = global_ms
            self.exact.add(unknown[0])

    def watermarks(self) -> dict[str, datetime | None]:
        """Each node's watermark where it is known exactly."""
        return {
            n: from_epoch_ms(self.values_ms[n]) if n in self.exact else None for n in self.order
        }


def real_time_costs(
    interval_seconds: float,
    delay_seconds: float | None,
    state_rows: int | None,
    state_bytes: int | None,
) -> dict[str, Any]:
    """What a real-time query's checkpoint interval costs, in its own figures.

    The watermark moves only when a batch (one interval) ends, and a batch judges late rows
    with the watermark of the batch before: rows are judged against a watermark up to two
    intervals old, and state waits up to the interval plus the delay before it is evicted. The
    interval's share of the state is estimated as interval / (interval + delay) of it: state
    held for the delay alone would be the rest.
    """
    delay = delay_seconds or 0.0
    held = interval_seconds + delay
    share = interval_seconds / held if held > 0 else None
    costs: dict[str, Any] = {
        "interval_seconds": interval_seconds,
        "delay_seconds": delay_seconds,
        "watermark_age_max_seconds": 2 * interval_seconds,
        "lateness_kept_max_seconds": delay + 2 * interval_seconds,
        "state_held_max_seconds": held,
        "state_interval_share": share,
        "state_rows_for_interval": (
            round(state_rows * share) if state_rows is not None and share is not None else None
        ),
        "state_bytes_for_interval": (
            round(state_bytes * share) if state_bytes is not None and share is not None else None
        ),
    }
    costs["text"] = _real_time_text(costs)
    return costs


def _real_time_text(c: Mapping[str, Any]) -> str:
    interval = format_duration(c["interval_seconds"])
    delay = format_duration(c["delay_seconds"]) if c["delay_seconds"] is not None else "?"
    text = (
        f"Real-time mode, checkpoint interval {interval}: the watermark moves only when a batch "
        f"ends, so state waits up to {format_duration(c['state_held_max_seconds'])} (interval "
        f"+ delay {delay}) before it is evicted"
    )
    if c["state_rows_for_interval"] is not None:
        text += (
            f"; about {c['state_interval_share']:.0%} of the state "
            f"({c['state_rows_for_interval']:,} rows"
            + (
                f", {c['state_bytes_for_interval'] / 2**20:.1f} MiB"
                if c["state_bytes_for_interval"] is not None
                else ""
            )
            + ") is there for the interval (an estimate)"
        )
    return text + (
        f". Each batch judges late rows against the watermark of the batch before, up to "
        f"{format_duration(c['watermark_age_max_seconds'])} old: a row up to "
        f"{format_duration(c['lateness_kept_max_seconds'])} behind the newest event time can "
        "still be kept, even behind the watermark the batch reports (the audit counts those). "
        "A shorter interval frees that state and judges rows against a fresher watermark."
    )
