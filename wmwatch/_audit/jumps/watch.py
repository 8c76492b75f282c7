"""Who moved the watermark: batches whose event time runs ahead of the clock or whose watermark
jumps, the rows that did it, and what the jump cost.

Spark's watermark is ``max(event time) - delay``: one row dated hours ahead (a producer with a
wrong clock, seconds taken for milliseconds) moves it hours ahead, and every ordinary row after
it is dropped as late. Per audited batch N (on the audit's own thread, after N is audited):

- *ahead*: N's largest event time (its progress' ``eventTime.max``) is more than
  ``ahead_seconds`` after N's own time (progress ``timestamp``): N holds rows dated in the future.
- *jump*: N's watermark (``offsets/N``) is more than ``jump_seconds`` above N-1's: the batch
  before, N-1, read the rows that moved it (a first watermark, set from the epoch, is no jump).

Either way the batch that moved the watermark (N, or N-1) is an *incident*, kept in
``watermark_jumps``: its watermark before (``offsets/b``, what batch b+1 judged late rows with)
and after (``offsets/b+1``), and the top :data:`~wmwatch._audit.jumps.rules.TOP_ROWS` rows by
event time of its input, read again by the replay with the same ``columns=`` /
``hash_columns=`` rules as late rows (:mod:`wmwatch._audit.jumps.read`), with their input and,
for Kafka, partition and offset (``watermark_jump_rows``). One bounded Spark job per incident,
under the audit's deadline, whether or not the batch had late rows.

*The cost*: the late rows the audit found in the batches after the incident (up to the next
one) that the watermark before it would have kept: those whose late-row time (the window end
for windowed aggregations, else the event time) is after the watermark before the jump and not
after the one it set. Each audited batch adds its own rows to the latest incident's count
(:mod:`wmwatch._audit.jumps.table`), until the batches' time passes the watermark it set (the
clock has caught up with the row: later drops would happen without the jump too), so it is
what the history holds (rows over ``max_rows_per_batch`` are not in it; with
``sink="parquet"`` the cost stays unknown).

This module is the state machine (what is remembered between batches, bounded); the rules are
pure (:mod:`wmwatch._audit.jumps.rules`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from wmwatch._audit.jumps.rules import (
    BatchTimes,
    Incident,
    Thresholds,
    TopRow,
    ahead_seconds,
    describe,
    flags,
    jump_seconds,
    still_costing,
)
from wmwatch._text import clean, error_line, get_logger

if TYPE_CHECKING:
    from wmwatch._audit.jumps.table import JumpHistory
    from wmwatch._checkpoint.reader import CheckpointReader

log = get_logger("wmwatch.audit")

# batches whose progress is kept for the check (the audit trails the query by a few at most)
_KEEP_BATCHES = 1_000
# incidents kept in memory for the cost (older ones keep the cost they had)
_KEEP_INCIDENTS = 20


class JumpWatch:
    """The incidents of one audited query: flagged on the audit's thread, batch by batch.

    :meth:`note` is called from the progress hook (any thread) and only stores a few numbers;
    :meth:`after_batch` runs on the audit's thread after each audited batch.
    """

    def __init__(
        self,
        *,
        thresholds: Thresholds,
        history: JumpHistory | None,
        label: str,
    ) -> None:
        self.thresholds = thresholds
        self.history = history
        self.label = label
        self._lock = threading.Lock()
        self._times: dict[int, BatchTimes] = {}
        self._incidents: dict[int, Incident] = {}
        self._found = 0

    def start(self) -> None:
        """Take up the incidents an earlier audit of the query recorded (for their cost)."""
        if self.history is None:
            return
        for incident in self.history.recent(_KEEP_INCIDENTS):
            self._incidents[incident.batch_id] = incident

    def note(self, batch_id: int, times: BatchTimes) -> None:
        with self._lock:
            self._times[batch_id] = times
            if len(self._times) > _KEEP_BATCHES:
                for old in sorted(self._times)[: _KEEP_BATCHES // 2]:
                    del self._times[old]

    def incidents(self) -> list[Incident]:
        with self._lock:
            return [self._incidents[b] for b in sorted(self._incidents)]

    def status(self) -> dict[str, Any]:
        with self._lock:
            last = self._incidents[max(self._incidents)] if self._incidents else None
            return {
                "watermark_incidents": self._found,
                "last_watermark_incident_batch": last.batch_id if last else None,
            }

    def after_batch(
        self,
        batch_id: int,
        run_id: str | None,
        checkpoint: CheckpointReader,
        read_top: Callable[[int], tuple[tuple[TopRow, ...], int | None]],
    ) -> None:
        """Flag batch ``batch_id`` (replayed, its marker not yet written) and record what moved
        the watermark. Called before the batch's marker is queued, on the same writer, so a kill
        cannot leave a marked batch without its incident (a re-audit replaces the incident).
        Never raises (the batch is audited either way): an error reading the rows leaves the
        incident without them, with why. The cost follows in :meth:`after_recorded`."""
        try:
            self._check(batch_id, run_id, checkpoint, read_top)
        except Exception as exc:  # noqa: BLE001 - logged; the late-row audit goes on
            log.warning(
                "wmwatch: audit of %s: cannot check batch %d for a watermark jump: %s",
                self.label,
                batch_id,
                error_line(exc),
            )

    def _check(
        self,
        batch_id: int,
        run_id: str | None,
        checkpoint: CheckpointReader,
        read_top: Callable[[int], tuple[tuple[TopRow, ...], int | None]],
    ) -> None:
        with self._lock:
            times = self._times.get(batch_id)
        entry = checkpoint.offsets(batch_id)
        previous = checkpoint.offsets(batch_id - 1) if batch_id > 0 else None
        wm_ms = entry.watermark_ms if entry is not None else None
        prev_ms = previous.watermark_ms if previous is not None else None
        if times is not None and times.batch_at_ms is None and entry is not None:
            times = replace(times, batch_at_ms=entry.timestamp_ms)
        ahead = ahead_seconds(times)
        jump = jump_seconds(wm_ms, prev_ms)
        is_ahead, is_jump = flags(ahead, jump, self.thresholds)
        changed: list[Incident] = []
        if is_ahead and times is not None:
            changed.append(
                self._update(
                    batch_id,
                    checkpoint,
                    read_top,
                    run_id=run_id,
                    batch_at_ms=times.batch_at_ms,
                    event_time_max_ms=times.event_time_max_ms,
                    ahead_seconds=ahead,
                )
            )
        if is_jump and batch_id > 0:
            with self._lock:
                setter = self._times.get(batch_id - 1)
            changed.append(
                self._update(
                    batch_id - 1,
                    checkpoint,
                    read_top,
                    run_id=run_id,
                    jump_seconds=jump,
                    jump_batch_id=batch_id,
                    watermark_after_ms=wm_ms,
                    batch_at_ms=setter.batch_at_ms if setter else None,
                    event_time_max_ms=setter.event_time_max_ms if setter else None,
                    ahead_seconds=ahead_seconds(setter),
                )
            )
        with self._lock:
            # the watermark an ahead-only incident set shows in the next batch's offsets
            pending = self._incidents.get(batch_id - 1)
        if pending is not None and pending.watermark_after_ms is None and wm_ms is not None:
            changed.append(self._merge(replace(pending, watermark_after_ms=wm_ms)))
        if self.history is not None:
            for incident in {i.batch_id: i for i in changed}.values():
                self.history.record(incident)

    def after_recorded(self, batch_id: int, checkpoint: CheckpointReader) -> None:
        """Bring the cost of the latest incident before ``batch_id`` up to date, once the batch's
        late rows are written (the recount reads them). Never raises."""
        if self.history is None:
            return
        try:
            with self._lock:
                before = [b for b in self._incidents if b < batch_id]
                latest = self._incidents[max(before)] if before else None
            if latest is None:
                return
            entry = checkpoint.offsets(batch_id)
            batch_at_ms = entry.timestamp_ms if entry is not None else None
            if still_costing(latest, batch_at_ms):
                self.history.update_cost(batch_id)
        except Exception as exc:  # noqa: BLE001 - logged; the late-row audit goes on
            log.warning(
                "wmwatch: audit of %s: cannot count what the watermark jump before batch %d "
                "cost: %s",
                self.label,
                batch_id,
                error_line(exc),
            )

    def _update(
        self,
        batch_id: int,
        checkpoint: CheckpointReader,
        read_top: Callable[[int], tuple[tuple[TopRow, ...], int | None]],
        **values: Any,
    ) -> Incident:
        with self._lock:
            known = self._incidents.get(batch_id)
        incident = known or Incident(batch_id=batch_id)
        fill = {k: v for k, v in values.items() if v is not None}
        incident = replace(incident, **fill)
        if incident.watermark_before_ms is None:
            entry = checkpoint.offsets(batch_id)
            if entry is not None:
                incident = replace(incident, watermark_before_ms=entry.watermark_ms)
        if known is None:
            incident = self._with_rows(incident, read_top)
            log.warning(
                "wmwatch: audit of %s: batch %d moved the watermark (%s): %s",
                self.label,
                batch_id,
                incident.reasons,
                describe(incident),
            )
        return self._merge(incident)

    def _with_rows(
        self,
        incident: Incident,
        read_top: Callable[[int], tuple[tuple[TopRow, ...], int | None]],
    ) -> Incident:
        try:
            rows, source_index = read_top(incident.batch_id)
        except Exception as exc:  # noqa: BLE001 - the incident is kept, without its rows
            log.warning(
                "wmwatch: audit of %s: cannot read the rows of batch %d that moved the "
                "watermark: %s",
                self.label,
                incident.batch_id,
                error_line(exc),
            )
            return replace(incident, rows_error=clean(f"{type(exc).__name__}: {error_line(exc)}"))
        with self._lock:
            times = self._times.get(incident.batch_id)
        description = None
        if (
            source_index is not None
            and times is not None
            and 0 <= source_index < len(times.descriptions)
        ):
            description = times.descriptions[source_index]
        return replace(
            incident, rows=rows, source_index=source_index, source_description=description
        )

    def _merge(self, incident: Incident) -> Incident:
        with self._lock:
            if incident.batch_id not in self._incidents:
                self._found += 1
            self._incidents[incident.batch_id] = incident
            while len(self._incidents) > _KEEP_INCIDENTS:
                del self._incidents[min(self._incidents)]
        return incident
