"""The DuckDB history store: the queue and the one writer thread through which every row goes
into the history file, opened only for each flush so that readers get the file in between.
Why, and what happens when the file cannot be opened: docs/architecture.md (The history file).

Over 500 lines as one class on purpose: the queue, its bounds, the writer's health and its
thread share one condition variable, which is what keeps the health snapshot consistent and
the bounds exact; what stands alone lives beside it (the transactions in
:mod:`wmwatch._store.transactions`, the file in :mod:`wmwatch._store.files`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import math
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from wmwatch._errors import StoreError
from wmwatch._events import QueryStarted, QueryTerminated
from wmwatch._progress import ProgressSnapshot
from wmwatch._store.files import (
    FILE_MODE,
    WriterEngine,
    WriterLock,
    create_database,
    drop_empty_wal,
    open_for_writing,
    open_readonly,
    private_wal,
)
from wmwatch._store.rows import (
    ProgressRows,
    QueryHistory,
    progress_rows,
    write_query_started,
    write_query_terminated,
    write_query_trigger,
)
from wmwatch._store.schema import apply_retention, days_to_keep, migrate
from wmwatch._store.transactions import (
    Pending,
    Unavailable,
    Write,
    commit,
    commit_chunk,
    progress_bytes,
    rollback,
    write_size_bytes,
)
from wmwatch._text import error_line, get_logger
from wmwatch._trigger import Trigger

if TYPE_CHECKING:
    import duckdb

__all__ = [
    "HistoryStore",
    "QueryHistory",
    "StoreHealth",
    "Write",
    "apply_retention",
    "migrate",
    "open_readonly",
]

T = TypeVar("T")

_log = get_logger("wmwatch.store")

# Writes per transaction: large enough that a backlog after an outage drains in a few commits,
# small enough that one commit stays well under a second.
_CHUNK_WRITES = 2_000
_MAX_BACKOFF_SECONDS = 5.0
# Least time the writer leaves the file closed between flushes, so readers always get a turn.
_READER_GAP_SECONDS = 0.05
# Longest a paced writer waits between timed flushes, however slow a flush is.
_MAX_PACED_INTERVAL_SECONDS = 30.0
# Memory the pending writes may hold while the file is unavailable: two audit chunks (32 MiB
# each), so a late-row storm keeps its newest batches and never holds more.
DEFAULT_MAX_PENDING_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StoreHealth:
    """A consistent snapshot of the writer's state (exported as ``wmwatch_store_*`` metrics)."""

    up: bool
    pending_writes: int
    # estimated memory the pending writes hold (see :func:`write_size_bytes`)
    pending_bytes: int
    written_total: int
    errors_total: int
    dropped_total: int
    last_error: str | None
    last_flush_at: datetime | None
    # batches recorded without their progress JSON (it could not be kept safely, or DuckDB
    # refused it): the batch row and its numbers are stored all the same
    progress_json_missing_total: int = 0


@dataclass(slots=True)
class _Read:
    fn: Callable[[duckdb.DuckDBPyConnection], Any]
    future: Future[Any]


# Stores still running at interpreter exit are closed first: a writer thread killed inside
# DuckDB during finalisation aborts the whole process.
_OPEN_STORES: weakref.WeakSet[HistoryStore] = weakref.WeakSet()


@atexit.register
def _close_open_stores() -> None:
    for store in list(_OPEN_STORES):
        store.close(timeout=5.0)


class HistoryStore:
    """Durable per-batch history in a DuckDB file, written by one background thread.

    The constructor validates ``path`` and creates or migrates the file synchronously, raising
    :class:`StoreError` with a one-line message when it cannot. :meth:`start` then runs the
    writer thread. ``retention_days`` (optional) deletes history older than that many days
    (None or ``math.inf``: keep everything). ``max_pending`` and ``max_pending_bytes`` bound the
    writes held in memory while the file is unavailable (oldest dropped first, counted).
    ``max_cpu_share`` (optional): the share of one core the writer may spend on timed flushes;
    a flush that cost more than that share of ``flush_interval_seconds`` pushes the next timed
    flush back in proportion (at most 30 s). Explicit flushes, reads, a backlog of
    ``flush_writes`` or of half ``max_pending_bytes``, and closing are never held back.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        flush_interval_seconds: float = 0.5,
        flush_writes: int = 500,
        max_pending: int = 10_000,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        retention_days: float | None = None,
        retention_interval_seconds: float = 600.0,
        lock_wait_seconds: float = 2.0,
        open_timeout_seconds: float = 10.0,
        max_cpu_share: float | None = None,
    ) -> None:
        if flush_interval_seconds <= 0:
            raise StoreError("flush_interval_seconds must be positive")
        if max_pending < 1:
            raise StoreError("max_pending must be at least 1")
        if max_pending_bytes < 1:
            raise StoreError("max_pending_bytes must be at least 1")
        retention_days = days_to_keep(retention_days)
        if max_cpu_share is not None and not 0 < max_cpu_share <= 1:
            raise StoreError("max_cpu_share must be in (0, 1], or None for a fixed interval")
        self.path = Path(path).expanduser().absolute()
        self.flush_interval_seconds = flush_interval_seconds
        self.flush_writes = flush_writes
        self.max_pending = max_pending
        self.max_pending_bytes = max_pending_bytes
        self.retention_days = retention_days
        self.retention_interval_seconds = retention_interval_seconds
        self.lock_wait_seconds = lock_wait_seconds
        self.max_cpu_share = max_cpu_share

        self._cond = threading.Condition()
        self._pending: deque[Pending] = deque()
        self._pending_bytes = 0
        self._reads: deque[_Read] = deque()
        self._seq = itertools.count(1)
        self._submitted_seq = 0
        self._done_seq = 0
        self._flush_requested = False
        self._stopping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._health = StoreHealth(
            up=True,
            pending_writes=0,
            pending_bytes=0,
            written_total=0,
            errors_total=0,
            dropped_total=0,
            last_error=None,
            last_flush_at=None,
        )
        self._next_flush_at = 0.0
        self._next_attempt_at = 0.0
        self._reader_gap_until = 0.0
        self._backoff_seconds = 0.0
        self._next_retention_at = 0.0
        self._dropping_logged = False

        self._verified_file: tuple[int, int] | None = None
        self._engine = WriterEngine()
        self._writer_lock = WriterLock(self.path)
        try:
            opened = open_for_writing(self.path, timeout_seconds=open_timeout_seconds)
        except BaseException:
            self._writer_lock.release()
            raise
        self.history_at_open: tuple[QueryHistory, ...] = opened.history
        # open_for_writing just migrated this very file: the first flush need not again
        with contextlib.suppress(OSError):
            stat = os.stat(self.path)
            self._verified_file = (stat.st_dev, stat.st_ino)
        self.recovered_after_crash = opened.recovered_after_crash
        if self._writer_lock.unlocked_reason is not None:
            _log.warning(
                "%s: writing %s without excluding other processes (a second writer there would "
                "not be detected)",
                self._writer_lock.unlocked_reason,
                self.path,
            )

    # -- public API --

    @property
    def health(self) -> StoreHealth:
        with self._cond:
            return replace(
                self._health,
                pending_writes=len(self._pending),
                pending_bytes=self._pending_bytes,
            )

    def start(self) -> HistoryStore:
        """Start the writer thread (idempotent); returns ``self``."""
        with self._cond:
            if self._closed:
                raise StoreError("this history store is closed: create a new HistoryStore")
            if self._thread is None:
                self._next_flush_at = time.monotonic() + self.flush_interval_seconds
                self._thread = threading.Thread(
                    target=self._run, name="wmwatch-store-writer", daemon=True
                )
                self._thread.start()
                _OPEN_STORES.add(self)
        return self

    def submit(self, write: Write, *, description: str, payload_bytes: int = 0) -> None:
        """Queue an idempotent ``write(con)``; it runs in a transaction on the writer thread.

        If the database is unavailable the write is kept (bounded by ``max_pending`` writes and
        ``max_pending_bytes``, oldest dropped first) and retried; if it raises on its own it is
        logged, counted and skipped. ``payload_bytes``: about how much memory the data ``write``
        carries holds (rows, text), for the byte bound; leave 0 for a small write.
        ``write`` must only touch the database: I/O errors mean "database unavailable".
        """
        self._enqueue(description, write, None, write_size_bytes(description, payload_bytes))

    def _enqueue(
        self,
        description: str,
        write: Write | None,
        progress: ProgressRows | None,
        size_bytes: int,
    ) -> None:
        with self._cond:
            if self._closed:
                self._health = replace(self._health, dropped_total=self._health.dropped_total + 1)
                return
            seq = next(self._seq)
            self._submitted_seq = seq
            self._pending.append(Pending(seq, description, write, progress, size_bytes))
            self._pending_bytes += size_bytes
            self._enforce_bound_locked()
            # the first write after an idle spell wakes the writer, which sleeps while idle
            if self._backlog_locked() or len(self._pending) == 1:
                self._cond.notify_all()

    def record_query_started(self, event: QueryStarted) -> None:
        self.submit(
            lambda con: write_query_started(con, event),
            description=f"query started {event.query_id}",
        )

    def record_query_trigger(self, query_id: str, run_id: str, trigger: Trigger) -> None:
        self.submit(
            lambda con: write_query_trigger(con, query_id, run_id, trigger),
            description=f"query trigger {query_id}",
        )

    def record_query_terminated(self, event: QueryTerminated) -> None:
        # the time wmwatch heard of it, for an event that carries none
        heard_at = datetime.now(UTC)
        self.submit(
            lambda con: write_query_terminated(con, event, heard_at),
            description=f"query terminated {event.query_id}",
        )

    def record_progress(
        self, snapshot: ProgressSnapshot, late_watermark_at: datetime | None = None
    ) -> None:
        """Upsert one batch (with its operators and sources) and the query's last progress.

        ``late_watermark_at`` is the watermark the late-row filter used for this batch; when
        None it is taken from the previous batch's ``watermark_at`` if that batch is recorded.
        A snapshot without its document (``raw_json`` None) is recorded without it, and counted.
        """
        description = f"batch {snapshot.batch_id} of {snapshot.query_id}"
        if snapshot.raw_json is None:
            self._count_progress_json_missing(description, "it could not be serialised")
        rows = progress_rows(snapshot, late_watermark_at, datetime.now(UTC))
        self._enqueue(description, None, rows, write_size_bytes(description, progress_bytes(rows)))

    def flush(self, timeout: float = 10.0) -> bool:
        """Write everything submitted so far; True if it was all written within ``timeout``."""
        self._require_started()
        deadline = time.monotonic() + timeout
        with self._cond:
            target = self._submitted_seq
            self._flush_requested = True
            self._cond.notify_all()
            while self._done_seq < target and not self._stopped_locked():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            return self._done_seq >= target

    def read(self, fn: Callable[[duckdb.DuckDBPyConnection], T], timeout: float = 10.0) -> T:
        """Run ``fn(con)`` on the writer thread after pending writes, and return its result.

        ``fn`` must return plain Python values (the connection closes right after).
        """
        self._require_started()
        if self._closed:
            raise StoreError("the history store is closed")
        if threading.current_thread() is self._thread:
            raise StoreError("HistoryStore.read cannot be called from inside a store write")
        future: Future[T] = Future()
        with self._cond:
            self._reads.append(_Read(fn, future))
            self._cond.notify_all()
        try:
            return future.result(timeout)
        except FutureTimeoutError:
            future.cancel()
            raise StoreError(
                f"reading {self.path} took longer than {timeout:g} s: "
                "the history file is busy or unavailable"
            ) from None

    def close(self, timeout: float = 10.0) -> None:
        """Flush what is pending (up to ``timeout``), then stop the writer thread."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._stopping = True
            _OPEN_STORES.discard(self)
            self._flush_requested = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            # a writer still inside a flush keeps the file: the lock goes when the process does
            self._writer_lock.release()
        with self._cond:
            left = len(self._pending)
            reads = list(self._reads)
            self._reads.clear()
        for request in reads:
            request.future.set_exception(StoreError("the history store is closed"))
        if left:
            _log.error(
                "wmwatch closed with %d history writes not written to %s (%s)",
                left,
                self.path,
                self.health.last_error or "writer did not finish in time",
            )

    def __enter__(self) -> HistoryStore:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the writer thread's connection --

    def _connect_for_write(self) -> duckdb.DuckDBPyConnection:
        # a file made anew may get the inode number of the one deleted: remember that we made it
        recreated = False
        if not self.path.exists():
            try:
                create_database(self.path)
            except StoreError as exc:
                raise Unavailable(str(exc)) from None
            recreated = self._verified_file is not None
        deadline = time.monotonic() + self.lock_wait_seconds
        try:
            con = self._engine.attach(self.path, deadline=deadline)
        except StoreError as exc:
            raise Unavailable(str(exc)) from None
        private_wal(self.path)
        try:
            # The schema check costs a catalog query per flush: only repeat it for a new file.
            stat = os.stat(self.path)
            identity = (stat.st_dev, stat.st_ino)
            if identity != self._verified_file or recreated:
                if self._verified_file is not None:
                    # Not the file written before: it was deleted, and made again above or, when
                    # it vanished between that check and the attach, by DuckDB itself (with the
                    # process umask: make it owner-only again).
                    os.chmod(self.path, FILE_MODE)
                    _log.warning(
                        "history file %s was deleted while wmwatch was running; created a new "
                        "one and writing on (earlier history in it is gone)",
                        self.path,
                    )
                migrate(con, self.path)
                self._verified_file = identity
        except Exception as exc:  # noqa: BLE001 - any failure to open is the file being unavailable
            self._engine.detach()
            raise Unavailable(
                str(exc) if isinstance(exc, StoreError) else error_line(exc)
            ) from None
        return con

    # -- writer thread --

    def _require_started(self) -> None:
        if self._thread is None:
            raise StoreError("the history store is not started: call start() first")

    def _stopped_locked(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def _backlog_locked(self) -> bool:
        # Enough waiting to write now, however the timed flushes are paced: a healthy writer
        # must never come near the bounds, where writes are dropped.
        return (
            len(self._pending) >= self.flush_writes
            or self._pending_bytes >= self.max_pending_bytes // 2
        )

    def _enforce_bound_locked(self) -> None:
        # The newest write stays even when it alone is over the byte bound: it is what the job
        # just did, and the audit stages big batches one chunk at a time, waiting for each.
        dropped = 0
        while len(self._pending) > self.max_pending or (
            self._pending_bytes > self.max_pending_bytes and len(self._pending) > 1
        ):
            self._pending_bytes -= self._pending.popleft().size_bytes
            dropped += 1
        if dropped:
            self._health = replace(self._health, dropped_total=self._health.dropped_total + dropped)
            if not self._dropping_logged:
                self._dropping_logged = True
                _log.error(
                    "more than %d history writes or %g MiB waiting for %s: dropping the oldest "
                    "(%s)",
                    self.max_pending,
                    self.max_pending_bytes / 2**20,
                    self.path,
                    self._health.last_error or "writer behind",
                )

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    now = time.monotonic()
                    urgent = self._stopping or self._flush_requested or bool(self._reads)
                    due = bool(self._pending) and (
                        self._backlog_locked() or now >= self._next_flush_at
                    )
                    retention_due = (
                        self.retention_days is not None and now >= self._next_retention_at
                    )
                    not_before = max(self._next_attempt_at, self._reader_gap_until)
                    if urgent or ((due or retention_due) and now >= not_before):
                        break
                    # Nothing pending: sleep until a write, a flush or a read comes in. Waking
                    # for an overdue flush with nothing to write would spin at the 1 ms floor.
                    wake_at = max(self._next_flush_at, not_before) if self._pending else math.inf
                    if self.retention_days is not None:
                        wake_at = min(wake_at, max(self._next_retention_at, not_before))
                    self._cond.wait(max(0.001, wake_at - now) if wake_at < math.inf else None)
                stopping = self._stopping
                self._flush_requested = False
                reads = list(self._reads)
                self._reads.clear()
                self._next_flush_at = time.monotonic() + self.flush_interval_seconds
            cpu_before = time.thread_time()
            try:
                self._cycle(reads)
                self._reader_gap_until = time.monotonic() + _READER_GAP_SECONDS
            except Exception as exc:  # noqa: BLE001 - the writer thread never dies; counted and logged
                _log.exception("wmwatch history writer failed unexpectedly; it goes on")
                self._count_error(error_line(exc))
            self._pace(time.thread_time() - cpu_before)
            if stopping:
                self._engine.close()
                with self._cond:
                    self._cond.notify_all()
                return

    def _pace(self, cpu_seconds: float) -> None:
        # A flush costs about the same CPU for one batch as for a hundred, and more on a slower
        # machine: at a fixed interval that fixed cost became a share of the cores the watched
        # job needs. Waiting in proportion to what the last flush cost keeps the share bounded;
        # the rows just wait a little longer in memory. (DuckDB runs on this thread only, so
        # the thread's CPU time is the flush's whole cost.)
        # While the file cannot be written, the retries keep the back-off's pace (5 s at most):
        # a failed attempt can cost more CPU than a flush, and pacing by it would leave a fixed
        # disk or a released lock unnoticed for up to the 30 s cap.
        if self.max_cpu_share is None:
            return
        with self._cond:
            longest = _MAX_PACED_INTERVAL_SECONDS if self._health.up else _MAX_BACKOFF_SECONDS
            wait = min(longest, cpu_seconds / self.max_cpu_share)
            self._next_flush_at = max(self._next_flush_at, time.monotonic() + wait)

    def _cycle(self, reads: list[_Read]) -> None:
        try:
            con = self._connect_for_write()
        except Unavailable as exc:
            self._mark_down(str(exc))
            for request in reads:
                request.future.set_exception(StoreError(str(exc)))
            return
        try:
            try:
                self._write_pending(con)
                if self.retention_days is not None and time.monotonic() >= self._next_retention_at:
                    self._apply_retention(con)
            except Unavailable as exc:
                self._mark_down(str(exc))
                for request in reads:
                    request.future.set_exception(StoreError(str(exc)))
                return
            self._mark_up()
            for request in reads:
                if request.future.set_running_or_notify_cancel():
                    try:
                        request.future.set_result(request.fn(con))
                    except Exception as exc:  # noqa: BLE001 - handed to the caller through its future
                        request.future.set_exception(exc)
        finally:
            self._engine.detach()
            drop_empty_wal(self.path)

    def _write_pending(self, con: duckdb.DuckDBPyConnection) -> None:
        # Only what was pending when the cycle began: writes arriving meanwhile wait for the
        # next cycle, so a busy job cannot keep the file locked against readers.
        with self._cond:
            last_seq = self._pending[-1].seq if self._pending else 0
        while True:
            with self._cond:
                chunk: list[Pending] = []
                while (
                    self._pending
                    and len(chunk) < _CHUNK_WRITES
                    and self._pending[0].seq <= last_seq
                ):
                    item = self._pending.popleft()
                    self._pending_bytes -= item.size_bytes
                    chunk.append(item)
            if not chunk:
                return
            written, failed, leftover, reason = commit_chunk(
                con,
                chunk,
                failed=self._note_failed_write,
                kept_bare=self._count_progress_json_missing,
            )
            handled = len(chunk) - len(leftover)
            with self._cond:
                if leftover:
                    self._pending.extendleft(reversed(leftover))
                    self._pending_bytes += sum(item.size_bytes for item in leftover)
                    self._enforce_bound_locked()
                if handled:
                    self._done_seq = max(self._done_seq, chunk[handled - 1].seq)
                    self._health = replace(
                        self._health,
                        written_total=self._health.written_total + written,
                        errors_total=self._health.errors_total + failed,
                        last_flush_at=datetime.now(UTC),
                    )
                    self._cond.notify_all()
            if reason is not None:
                raise Unavailable(reason)

    def _note_failed_write(self, message: str) -> None:
        with self._cond:
            self._health = replace(self._health, last_error=message)

    def _count_progress_json_missing(self, description: str, why: str) -> None:
        """Count a batch kept without its progress JSON; log the first and every 1000th."""
        with self._cond:
            missing = self._health.progress_json_missing_total + 1
            self._health = replace(self._health, progress_json_missing_total=missing)
        if missing == 1 or missing % 1000 == 0:
            _log.error(
                "history %s recorded without its progress JSON (%s); %d such batches so far",
                description,
                why,
                missing,
            )

    def _apply_retention(self, con: duckdb.DuckDBPyConnection) -> None:
        import duckdb

        assert self.retention_days is not None
        cutoff = datetime.now(UTC).timestamp() - self.retention_days * 86_400.0
        try:
            con.execute("BEGIN TRANSACTION")
            deleted = apply_retention(con, cutoff_epoch_seconds=cutoff)
            commit(con)
            if deleted:
                con.execute("CHECKPOINT")
                _log.info(
                    "retention removed %d history rows older than %g days",
                    deleted,
                    self.retention_days,
                )
        except duckdb.Error as exc:
            rollback(con)
            _log.warning("history retention failed (will retry): %s", error_line(exc))
        self._next_retention_at = time.monotonic() + self.retention_interval_seconds

    def _mark_down(self, reason: str) -> None:
        with self._cond:
            was_up = self._health.up
            self._health = replace(
                self._health,
                up=False,
                last_error=reason,
                errors_total=self._health.errors_total + 1,
            )
            self._backoff_seconds = min(
                _MAX_BACKOFF_SECONDS, max(self.flush_interval_seconds, self._backoff_seconds * 2)
            )
            self._next_attempt_at = time.monotonic() + self._backoff_seconds
            pending = len(self._pending)
        if was_up:
            _log.warning(
                "cannot write history to %s (%s); keeping %d writes in memory (up to %d writes "
                "and %g MiB) and retrying",
                self.path,
                reason,
                pending,
                self.max_pending,
                self.max_pending_bytes / 2**20,
            )

    def _mark_up(self) -> None:
        with self._cond:
            was_down = not self._health.up
            self._health = replace(self._health, up=True)
            self._backoff_seconds = 0.0
            self._next_attempt_at = 0.0
            self._dropping_logged = False
            dropped = self._health.dropped_total
        if was_down:
            _log.warning(
                "writing history to %s again (%d writes dropped so far)", self.path, dropped
            )

    def _count_error(self, message: str) -> None:
        with self._cond:
            self._health = replace(
                self._health, errors_total=self._health.errors_total + 1, last_error=message
            )
