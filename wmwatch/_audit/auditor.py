"""One running audit of one query: its own thread, the loop over committed batches in order,
progress notes, status, ``sync`` and ``stop``. The loop's steps and where each lives:
docs/architecture.md (The audit's loop); why the audit replays committed batches:
docs/audit.md (How it works). Over 500 lines as one class: the loop's state (batches done,
progress notes, counters) is kept by its one thread under one lock; what stands alone is a
module of its own (``status``, ``pacing``, ``retention``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from wmwatch._audit.handled import BatchRange, HandledBatches
from wmwatch._audit.identities import IdentityBook, MemoryIdentityBook
from wmwatch._audit.jumps.read import read_top_rows
from wmwatch._audit.jumps.rules import TopRow
from wmwatch._audit.jumps.watch import JumpWatch
from wmwatch._audit.pacing import YIELD_FACTOR, IdleWait, SlotGate
from wmwatch._audit.replay.engine import Replayer, ReplayInput
from wmwatch._audit.replay.predicates import OperatorSpec, batch_may_have_late_rows
from wmwatch._audit.replay.sources.base import UnreplayableSource, remember_identities
from wmwatch._audit.retention import Retention, log_lost
from wmwatch._audit.sinks import AuditHistory, BatchLateRows, InputCount, LateRow
from wmwatch._audit.status import AuditCounters, audit_status
from wmwatch._checkpoint.fs import CheckpointEntryGone
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch._errors import AuditError
from wmwatch._text import get_logger

log = get_logger("wmwatch.audit")


@dataclass
class _BatchInfo:
    """What progress said about a batch: its smallest event time and the run that ran it."""

    min_event_time_ms: int | None = None
    run_id: str | None = None
    # Spark's numRowsDroppedByWatermark per stateful operator (its index in stateOperators)
    dropped_by_operator: dict[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Resolved:
    """What the audit learns from the query's plan: where its checkpoint is, what to replay."""

    checkpoint: CheckpointReader
    inputs: Sequence[ReplayInput]
    progress_min_covers_inputs: bool


class Auditor:
    """The audit of one query run: its committed batches, audited in order on its own thread."""

    def __init__(
        self,
        *,
        query_id: str,
        query_name: str | None,
        label: str,
        run_id: str | None,
        checkpoint: CheckpointReader | None,
        sink: str,
        replayer: Replayer,
        history: AuditHistory | None,
        poll_interval_seconds: float,
        progress_min_covers_inputs: bool = True,
        resolve: Callable[[], Resolved | None] | None = None,
        count_kept_behind: bool = False,
        jumps: JumpWatch | None = None,
        yield_factor: float = YIELD_FACTOR,
    ) -> None:
        self.query_id = query_id
        # who moved the watermark: checked after each audited batch (wmwatch._audit.jumps.watch)
        self.jumps = jumps
        self.query_name = query_name
        self.label = label
        # the run whose batches this audit follows: its end ends the audit
        self.run_id = run_id
        # what only the query's first planned batch tells (Spark Connect): until then, resolve()
        # gives None, and the audit waits
        self.resolve = resolve if checkpoint is None else None
        self._resolved = threading.Event()
        if checkpoint is not None:
            self._resolved.set()
        self.checkpoint: CheckpointReader = checkpoint  # type: ignore[assignment]  # None until resolved
        self.sink = sink
        self.replayer = replayer
        self.history = history
        self.poll_interval_seconds = poll_interval_seconds
        # whether progress' eventTime.min is the minimum over every input (one watermark node)
        self.progress_min_covers_inputs = progress_min_covers_inputs
        self.progress_grace_seconds = 3.0
        # a real-time query judges late rows with a watermark a whole interval old: count the
        # rows each batch kept behind the watermark it reported (replaying the batches that
        # may hold one)
        self.count_kept_behind = count_kept_behind
        self._slots = SlotGate(label)
        # 0: nothing to yield to (a sidecar runs no production job)
        self._idle = IdleWait(yield_factor)
        self._retention = Retention(replayer.spark, query_id)
        self._retention_at = 0.0  # when the retention gauges were last brought up to date
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # set when the audited run stopped: audit what it committed, then end
        self._finish_at: float | None = None
        # progress of batches not yet handled (a handled batch's is dropped)
        self._progress: dict[int, _BatchInfo] = {}
        # batches handled: ranges, never one id each (an audit runs for months)
        self._done = HandledBatches()
        self._counters = AuditCounters()
        # what the audit saw of identities the checkpoint does not record (Kafka topic ids)
        self._identities: IdentityBook = MemoryIdentityBook()
        self._audited_cond = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self.on_stop: Callable[[], None] | None = None

    # -- hooks (any thread) ----------------------------------------------------------------------

    @property
    def spec(self) -> OperatorSpec | None:
        """The rule of the first replayed input (the only one for a single-source query); None
        until the query's plan is known."""
        return self.replayer.inputs[0].spec if self.replayer.inputs else None

    def note_progress(
        self,
        batch_id: int,
        min_event_time_ms: int | None,
        run_id: str | None,
        *,
        has_rows: bool,
        dropped_by_operator: dict[int, int] | None = None,
    ) -> None:
        with self._lock:
            if batch_id in self._done:
                return  # audited already (without waiting for this): nothing reads it
            info = self._progress.setdefault(batch_id, _BatchInfo())
            # A trigger that ran no batch reports the next batch id with no rows; keep what a
            # real batch said.
            if has_rows or info.run_id is None:
                info.min_event_time_ms = min_event_time_ms if has_rows else info.min_event_time_ms
                info.run_id = run_id
                info.dropped_by_operator = dropped_by_operator
            if len(self._progress) > 10_000:
                for old in sorted(self._progress)[:5_000]:
                    del self._progress[old]
        self._wake.set()

    def finish(self) -> None:
        """The audited run stopped: audit the batches it committed, then end (on its thread)."""
        with self._lock:
            if self._finish_at is None:
                self._finish_at = time.monotonic()
        self._wake.set()

    def _finishing(self) -> bool:
        with self._lock:
            return self._finish_at is not None

    def _finished(self, pass_started: float) -> bool:
        """Caught up after the run stopped, and long enough after it that no commit is late.

        Spark can deliver the termination before the run's last commit file is visible (seen
        with availableNow: the final batch's commit after the event), so one caught-up pass
        right after the event is not proof that the run's last batch was seen. The pass must
        have listed the commits that long after the event, not merely ended then (a long
        replay would otherwise hide a commit that appeared while it ran).
        """
        with self._lock:
            finish_at = self._finish_at
        return finish_at is not None and pass_started - finish_at >= self.progress_grace_seconds

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        for item in self.replayer.inputs:
            if isinstance(item.source, UnreplayableSource):
                log.warning(
                    "wmwatch: audit of %s: source %d cannot be read again (%s); the rows Spark "
                    "drops from it are counted from its progress, without their payload",
                    self.label,
                    item.source.source_index,
                    item.source.reason,
                )
        last_audited: int | None = None
        if self.history is not None:
            self.history.drop_interrupted_replays()
            last_audited = self.history.last_audited_batch()
            self._identities = self.history.identity_book()
        self._hand_identities()
        if self.jumps is not None:
            self.jumps.start()
        with self._lock:
            # Batches are audited (or found lost) in order, so everything up to the last marked
            # batch was handled by an earlier audit. Without history the audit answers for the
            # query from its first batch: batches the checkpoint no longer holds are reported
            # as lost rather than passed over.
            self._done = HandledBatches(last_audited + 1 if last_audited is not None else 0)
            self._counters.batches_audited = 0
            self._counters.last_audited_batch = last_audited
        self._thread = threading.Thread(
            target=self._run, name=f"wmwatch-audit-{self.label}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._ended()

    def _ended(self) -> None:
        with self._lock:
            on_stop, self.on_stop = self.on_stop, None
        if on_stop is not None:
            on_stop()

    def sync(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        self._wake.set()
        while not self._resolved.wait(0.1):
            if time.monotonic() > deadline or self._thread is None or not self._thread.is_alive():
                return False
        target = self._pending_target()
        self._wake.set()
        with self._audited_cond:
            while not self._all_done_up_to(target):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._audited_cond.wait(min(remaining, 0.1))
        if self.history is not None:
            return self.history.flush(max(0.1, deadline - time.monotonic()))
        return True

    def _pending_target(self) -> list[int]:
        committed = self.checkpoint.committed_batches()
        with self._lock:
            return [b for b in committed if b not in self._done]

    def _all_done_up_to(self, target: list[int]) -> bool:
        return all(b in self._done for b in target)

    # -- status ------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._lock:
            return audit_status(
                self._counters,
                query_id=self.query_id,
                label=self.label,
                inputs=self.replayer.inputs,
                plan_known=self._resolved.is_set(),
                sink=self.sink,
                running=self._thread is not None and self._thread.is_alive(),
                max_rows_per_batch=self.replayer.max_rows_per_batch,
                now_seconds=time.time(),
                jumps=self.jumps.status() if self.jumps is not None else None,
            )

    # -- the loop ---------------------------------------------------------------------------------

    def _run(self) -> None:
        self.replayer.join_pool()
        failures = 0
        while not self._stop.is_set():
            try:
                pass_started = time.monotonic()
                if not self._ready():
                    if self._finishing():
                        break  # the run stopped before it planned a batch: nothing to audit
                    self._wake.wait(self.poll_interval_seconds)
                    self._wake.clear()
                    continue
                caught_up = self._audit_pending()
                failures = 0
                if caught_up and self._finished(pass_started):
                    log.info("wmwatch: audit of %s finished: its query run stopped", self.label)
                    break
            except Exception as exc:  # noqa: BLE001 - a failed pass is counted and retried; the loop never dies
                failures += 1
                with self._lock:
                    self._counters.add_error(exc)
                log.warning(
                    "wmwatch: audit of %s failed (attempt %d, retrying): %s",
                    self.label,
                    failures,
                    exc,
                )
                if self._finishing() and failures >= 5:
                    break  # the run is gone; a later audit of the query resumes from here
                self._stop.wait(min(30.0, 0.5 * 2 ** min(failures, 6)))
            self._wake.wait(self.poll_interval_seconds)
            self._wake.clear()
        self._ended()

    def _ready(self) -> bool:
        """Whether the query's plan is known, taking it the first time it is. A plan that
        cannot be audited ends the audit (there is nothing to retry), with the reason in
        ``status()`` and the log."""
        if self.resolve is None:
            return True
        try:
            resolved = self.resolve()
        except AuditError as exc:
            with self._lock:
                self._counters.add_error(exc)
            log.error("wmwatch: cannot audit %s: %s", self.label, exc)
            self._stop.set()
            return False
        if resolved is None:
            return False
        self.checkpoint = resolved.checkpoint
        self.replayer.inputs = tuple(resolved.inputs)
        self.progress_min_covers_inputs = resolved.progress_min_covers_inputs
        self._hand_identities()
        self.resolve = None
        self._resolved.set()
        log.info("wmwatch: audit of %s: the query's plan is known, auditing", self.label)
        return True

    def _hand_identities(self) -> None:
        """Give the sources that check an identity the checkpoint does not record what the
        audit (and earlier audits of the query) saw of it."""
        remember_identities((i.source for i in self.replayer.inputs), self._identities)

    def _audit_pending(self) -> bool:
        """Audit committed batches in order; True when every one of them is done."""
        committed = self.checkpoint.committed_batches()
        with self._lock:
            pending = [b for b in committed if b not in self._done]
            self._counters.latest_committed_batch = committed[-1] if committed else None
            self._counters.oldest_pending_commit_mtime_seconds = (
                self.checkpoint.commit_mtime_seconds(pending[0]) if pending else None
            )
        self._lose_purged_gap(committed)
        self._update_retention(pending[0] if pending else None, committed)
        for index, batch_id in enumerate(pending):
            if self._stop.is_set():
                return False
            try:
                if not self._audit_batch(batch_id):
                    return False  # waiting for this batch's progress; batches go in order
            except CheckpointEntryGone as exc:
                self._lose([(batch_id, batch_id)], str(exc))
            # batches go in order: the next pending one is the oldest not yet handled
            following = pending[index + 1] if index + 1 < len(pending) else None
            with self._lock:
                self._counters.oldest_pending_commit_mtime_seconds = (
                    self.checkpoint.commit_mtime_seconds(following)
                    if following is not None
                    else None
                )
            if following is None or time.monotonic() - self._retention_at >= 1.0:
                # a listing of offsets/: once a second while catching up, not once a batch
                self._update_retention(following, committed)
        return True

    # -- batches the checkpoint no longer holds ---------------------------------------------------

    def _update_retention(self, oldest_pending: int | None, committed: list[int]) -> None:
        self._retention_at = time.monotonic()
        retain = self._retention.retain_batches(self.checkpoint)
        remaining = self._retention.batches_remaining(self.checkpoint, oldest_pending, committed)
        with self._lock:
            self._counters.min_batches_to_retain = retain
            self._counters.retention_batches_remaining = remaining

    def _lose_purged_gap(self, committed: list[int]) -> None:
        """Batches below the oldest commit the checkpoint still holds, never audited: lost,
        one range per run of them (millions of purged ids are one range, never a list)."""
        with self._lock:
            gone = self._retention.purged_gap(committed, self._done)
        if gone:
            self._lose(gone, self._retention.purged_reason(self.checkpoint))

    def _lose(self, ranges: list[BatchRange], reason: str) -> None:
        """Batches that can never be audited: one log line per range (bounded), counted,
        passed."""
        log_lost(self.label, ranges, reason)
        with self._audited_cond:
            for first, last in ranges:
                self._done.add(first, last)
            self._counters.add_lost(ranges, reason)
            self._forget_progress()
            self._audited_cond.notify_all()

    def _forget_progress(self) -> None:
        """Drop the progress of handled batches (under the lock): nothing reads it again."""
        if len(self._progress) > 64:
            for batch_id in [b for b in self._progress if b in self._done]:
                del self._progress[batch_id]

    # -- one batch --------------------------------------------------------------------------------

    def _audit_batch(self, batch_id: int) -> bool:
        """Audit one committed batch; False when it should wait a moment for its progress."""
        late_wm_ms = self.checkpoint.late_watermark_ms(batch_id)
        with self._lock:
            info = self._progress.get(batch_id)
        min_ms = info.min_event_time_ms if info is not None else None
        run_id = info.run_id if info is not None else None
        if not self.progress_min_covers_inputs:
            min_ms = None  # replay every batch that read data
        reported_ms = None
        if self.count_kept_behind and late_wm_ms is not None:
            entry = self.checkpoint.offsets(batch_id)
            reported_ms = entry.watermark_ms if entry is not None else None
        # the watermark the skip decision must clear: the reported one when rows kept behind
        # it are counted too
        judged_ms = max(late_wm_ms or 0, reported_ms or 0) if late_wm_ms is not None else None
        reads = [
            (item, what)
            for item in self.replayer.inputs
            if (what := item.source.batch_input(self.checkpoint, batch_id)) is not None
        ]
        unread = [i for i in self.replayer.inputs if isinstance(i.source, UnreplayableSource)]
        if unread and info is None and self._progress_may_come(batch_id):
            return False  # their count comes from this batch's progress
        if (
            reads
            and min_ms is None
            and self.progress_min_covers_inputs
            and late_wm_ms is not None
            and self._progress_may_come(batch_id)
        ):
            # Spark writes commits/N just before it posts N's progress; its minimum event time
            # usually saves the whole replay, so give it a moment instead of racing it.
            return False
        if (
            not reads
            or (
                info is not None
                and min_ms is not None
                and judged_ms is not None
                and not any(
                    batch_may_have_late_rows(item.spec, judged_ms, min_ms) for item, _ in reads
                )
            )
            or late_wm_ms is None
        ):
            nothing = BatchLateRows.nothing()
            if self.count_kept_behind:
                nothing = replace(nothing, kept_behind_watermark=0)
            self._record(batch_id, run_id, late_wm_ms, found=self._with_unread(nothing, info))
            return True
        if self.count_kept_behind and not self._real_time_slot_free():
            return False  # try again in a moment; batches go in order
        self._yield_to_other_jobs()
        started = time.perf_counter()
        found = self.replayer.replay(
            batch_id,
            reads,
            run_id,
            late_wm_ms,
            sink=self.sink,
            stage=self._stage,
            reported_wm_ms=reported_ms,
        )
        took = time.perf_counter() - started
        self._idle.last_replay_seconds = took
        with self._lock:
            self._counters.replay_seconds += took
        self._record(batch_id, run_id, late_wm_ms, found=self._with_unread(found, info))
        return True

    def _check_jump(self, batch_id: int) -> None:
        """Who moved the watermark, once the batch is audited (never raises)."""
        if self.jumps is None:
            return
        with self._lock:
            info = self._progress.get(batch_id)

        def read_top(setter: int) -> tuple[tuple[TopRow, ...], int | None]:
            if self.count_kept_behind:
                self._wait_for_slot()
            self._yield_to_other_jobs()
            return read_top_rows(self.replayer, self.checkpoint, setter)

        self.jumps.after_batch(
            batch_id, info.run_id if info is not None else None, self.checkpoint, read_top
        )

    def _wait_for_slot(self) -> None:
        """Beside a real-time query, wait (bounded) for a spare task slot, else give up."""
        deadline = time.monotonic() + self.replayer.job_timeout_seconds
        while not self._real_time_slot_free():
            if time.monotonic() > deadline or self._stop.wait(self.poll_interval_seconds):
                raise AuditError(
                    "no spare task slot beside the real-time query; give the application one "
                    "more core"
                )

    def _yield_to_other_jobs(self) -> None:
        """Wait, bounded, for the application to idle before a Spark job of the audit; after
        the audited run stopped nothing competes."""
        if not self._finishing():
            waited = self._idle.wait(self.replayer.spark, self._stop)
            with self._lock:
                self._counters.yield_seconds += waited

    def _with_unread(self, found: BatchLateRows, info: _BatchInfo | None) -> BatchLateRows:
        """Add the inputs that cannot be read again: Spark's count of what their operator
        dropped in the batch, when that operator reads no other input (Spark counts all its
        inputs together), else None."""
        inputs = self.replayer.inputs
        extra = []
        for item in inputs:
            if not isinstance(item.source, UnreplayableSource):
                continue
            op = item.spec.operator_index
            alone = sum(1 for other in inputs if other.spec.operator_index == op) == 1
            dropped = info.dropped_by_operator if info is not None else None
            rows = dropped.get(op, 0) if dropped is not None and alone and op is not None else None
            extra.append(
                InputCount(
                    op if op is not None else 0,
                    item.spec.kind,
                    item.spec.side,
                    item.source.source_index,
                    rows,
                    payload_missing=item.source.reason,
                )
            )
        return replace(found, by_input=found.by_input + tuple(extra)) if extra else found

    def _real_time_slot_free(self) -> bool:
        """Whether a replay may run beside the real-time query now; after its run stopped,
        nothing competes."""
        free = self._finishing() or self._slots.free(self.replayer.spark)
        with self._lock:
            self._counters.waiting_for_slot = not free
        return free

    def _progress_may_come(self, batch_id: int) -> bool:
        if self._stop.is_set():
            return False
        committed_at = self.checkpoint.commit_mtime_seconds(batch_id)
        return committed_at is not None and time.time() - committed_at < self.progress_grace_seconds

    # -- the store side ---------------------------------------------------------------------------

    def _stage(self, batch_id: int, attempt: str, rows: list[LateRow]) -> int:
        if self.history is None:
            return 0
        return self.history.stage(
            batch_id, attempt, rows, timeout_seconds=self.replayer.job_timeout_seconds
        )

    def _record(
        self, batch_id: int, run_id: str | None, late_wm_ms: int | None, *, found: BatchLateRows
    ) -> None:
        """Write one audited batch (when the watch keeps a history) and count it."""
        # who moved the watermark: queued before the batch's marker (a kill between them
        # re-audits the batch and replaces the incident), and before the batch counts as done,
        # so that sync() also waits for it
        self._check_jump(batch_id)
        if self.history is not None:
            self.history.commit(
                query_name=self.query_name,
                run_id=run_id,
                batch_id=batch_id,
                late_wm_ms=late_wm_ms,
                found=found,
                sink=self.sink,
            )
        if self.jumps is not None:
            self.jumps.after_recorded(batch_id, self.checkpoint)  # the cost reads the rows
        with self._audited_cond:
            self._done.add(batch_id)
            self._progress.pop(batch_id, None)
            self._counters.add_batch(batch_id, found)
            self._audited_cond.notify_all()
