"""The DuckDB history store: the one place where rows go into the history file.

DuckDB lets one process write a database file and locks the file while any connection is open,
so a writer that kept its connection open would lock ``wmwatch report`` (and every other reader)
out for as long as the job runs. :class:`HistoryStore` therefore owns ONE writer thread that
opens the file only for each flush: it writes everything pending in one transaction and closes,
leaving the file free for readers in between. When the file cannot be opened (held by a reader,
made read-only, deleted, disk full), the writes stay in memory (bounded), the store reports
itself down in :attr:`HistoryStore.health`, and it retries with backoff. Readers in other
processes use :func:`open_readonly`, which retries while the writer holds the lock.

Every write is idempotent (upserts on the tables' primary keys), so a retried write or a
retried Spark batch replaces rows instead of duplicating them. Nothing already committed is
deleted, except by the optional retention.

A file has one writer at a time: a store holds an exclusive lock on ``<db>.lock`` for its whole
life (see :class:`_WriterLock`), so a second writer, in this process or another, is refused with
one line instead of two writers fighting over the same batches. Readers never take it.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import itertools
import json
import logging
import math
import os
import re
import shutil
import tempfile
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from wmwatch._errors import StoreError
from wmwatch._events import QueryStarted, QueryTerminated
from wmwatch._progress import ProgressSnapshot
from wmwatch._store.schema import LATEST_VERSION, MIGRATIONS, VERSION_TABLE
from wmwatch._text import redact
from wmwatch._text import valid_utf8 as _utf8

if TYPE_CHECKING:
    import duckdb

__all__ = [
    "HistoryStore",
    "QueryHistory",
    "StoreHealth",
    "open_readonly",
]

T = TypeVar("T")
Write = Callable[["duckdb.DuckDBPyConnection"], None]

_log = logging.getLogger("wmwatch.store")

# Writes per transaction: large enough that a backlog after an outage drains in a few commits,
# small enough that one commit stays well under a second.
_CHUNK_WRITES = 2_000
_MAX_BACKOFF_SECONDS = 5.0
_LOCK_POLL_SECONDS = 0.005
# Least time the writer leaves the file closed between flushes, so readers always get a turn.
_READER_GAP_SECONDS = 0.05
_FILE_MODE = 0o600
# Longest a paced writer waits between timed flushes, however slow a flush is.
_MAX_PACED_INTERVAL_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class StoreHealth:
    """A consistent snapshot of the writer's state (exported as ``wmwatch_store_*`` metrics)."""

    up: bool
    pending_writes: int
    written_total: int
    errors_total: int
    dropped_total: int
    last_error: str | None
    last_flush_at: datetime | None


@dataclass(frozen=True, slots=True)
class QueryHistory:
    """What the file held for one query when the store opened it."""

    query_id: str
    query_name: str | None
    batches: int
    last_batch_id: int | None


@dataclass(slots=True)
class _Pending:
    seq: int
    description: str
    write: Write | None
    progress: _ProgressRows | None = None


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


class _Unavailable(Exception):
    """The database file cannot be opened or committed to right now (retry later)."""


_ATTACHED_AS = "wmwatch_history"


class _WriterEngine:
    """The writer thread's DuckDB instance, in memory, with the history file attached per flush.

    Starting a DuckDB instance (function catalog, settings, thread pool) costs about as much CPU
    as a small flush's writes, and a flush every ``flush_interval_seconds`` would pay it each
    time. Attaching the file to a live instance costs a tenth of that, and
    DETACH, like closing a connection, checkpoints and releases the file lock: readers get the
    file between flushes exactly as before. One thread: a flush is a handful of small
    statements, and a pool would compete with Spark's tasks for every core.
    """

    def __init__(self) -> None:
        self._con: duckdb.DuckDBPyConnection | None = None

    def attach(self, path: Path, *, deadline: float) -> duckdb.DuckDBPyConnection:
        """The engine with ``path`` attached and in use; retries lock conflicts until ``deadline``."""
        import duckdb

        if self._con is None:
            try:
                con = duckdb.connect(":memory:", config={"threads": 1})
                con.execute("SET TimeZone = 'UTC'")
            except (duckdb.Error, OSError) as exc:
                raise StoreError(f"cannot start DuckDB: {_first_line(exc)}") from None
            self._con = con
        con = self._con
        quoted = str(path).replace("'", "''")

        def attach_once() -> duckdb.DuckDBPyConnection:
            try:
                con.execute(f"ATTACH '{quoted}' AS {_ATTACHED_AS}")
                con.execute(f"USE {_ATTACHED_AS}")
            except BaseException:
                self.detach()
                raise
            return con

        return _until_unlocked(path, deadline, attach_once)

    def detach(self) -> None:
        """Release the file (checkpoint, lock); the instance stays for the next flush."""
        con = self._con
        if con is None:
            return
        try:
            con.execute("USE memory")
            con.execute(f"DETACH DATABASE IF EXISTS {_ATTACHED_AS}")
        except Exception:  # noqa: BLE001 - the lock must not outlive the flush: drop the instance
            _log.debug("detaching the history file failed; closing the DuckDB instance", exc_info=True)
            self.close()

    def close(self) -> None:
        con, self._con = self._con, None
        if con is not None:
            with contextlib.suppress(Exception):
                con.close()


class HistoryStore:
    """Durable per-batch history in a DuckDB file, written by one background thread.

    The constructor validates ``path`` and creates or migrates the file synchronously, raising
    :class:`StoreError` with a one-line message when it cannot. :meth:`start` then runs the
    writer thread. ``retention_days`` (optional) deletes history older than that many days.
    ``max_cpu_share`` (optional): the share of one core the writer may spend on timed flushes;
    a flush that cost more than that share of ``flush_interval_seconds`` pushes the next timed
    flush back in proportion (at most 30 s). Explicit flushes, reads, a backlog of
    ``flush_writes`` and closing are never held back.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        flush_interval_seconds: float = 0.5,
        flush_writes: int = 500,
        max_pending: int = 10_000,
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
        if max_cpu_share is not None and not 0 < max_cpu_share <= 1:
            raise StoreError("max_cpu_share must be in (0, 1], or None for a fixed interval")
        if retention_days is not None and retention_days <= 0:
            raise StoreError("retention_days must be positive, or None to keep all history")
        self.path = Path(path).expanduser().absolute()
        self.flush_interval_seconds = flush_interval_seconds
        self.flush_writes = flush_writes
        self.max_pending = max_pending
        self.retention_days = retention_days
        self.retention_interval_seconds = retention_interval_seconds
        self.lock_wait_seconds = lock_wait_seconds
        self.max_cpu_share = max_cpu_share

        self._cond = threading.Condition()
        self._pending: deque[_Pending] = deque()
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
        self._engine = _WriterEngine()
        self.recovered_after_crash = False
        self.history_at_open: tuple[QueryHistory, ...] = ()
        self._writer_lock = _WriterLock(self.path)
        try:
            self._open_initial(open_timeout_seconds)
        except BaseException:
            self._writer_lock.release()
            raise
        if self._writer_lock.unlocked_reason is not None:
            _log.warning(
                "%s: writing %s without excluding other processes (a second writer there would "
                "not be detected)",
                self._writer_lock.unlocked_reason,
                self.path,
            )

    # ------------------------------------------------------------------ public API

    @property
    def health(self) -> StoreHealth:
        with self._cond:
            return replace(self._health, pending_writes=len(self._pending))

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

    def submit(self, write: Write, *, description: str) -> None:
        """Queue an idempotent ``write(con)``; it runs in a transaction on the writer thread.

        If the database is unavailable the write is kept (bounded by ``max_pending``, oldest
        dropped first) and retried; if it raises on its own it is logged, counted and skipped.
        ``write`` must only touch the database: I/O errors mean "database unavailable".
        """
        self._enqueue(description, write, None)

    def _enqueue(
        self, description: str, write: Write | None, progress: _ProgressRows | None
    ) -> None:
        with self._cond:
            if self._closed:
                self._health = replace(self._health, dropped_total=self._health.dropped_total + 1)
                return
            seq = next(self._seq)
            self._submitted_seq = seq
            self._pending.append(_Pending(seq, description, write, progress))
            self._enforce_bound_locked()
            # the first write after an idle spell wakes the writer, which sleeps while idle
            if len(self._pending) >= self.flush_writes or len(self._pending) == 1:
                self._cond.notify_all()

    def record_query_started(self, event: QueryStarted) -> None:
        name = _clean_name(event.name)
        params = (event.query_id, event.run_id, name, event.started_at)

        def write(con: duckdb.DuckDBPyConnection) -> None:
            con.execute(
                """
                INSERT INTO queries (query_id, run_id, query_name, status, started_at)
                VALUES (?, ?, ?, 'active', ?)
                ON CONFLICT (query_id, run_id) DO UPDATE SET
                    query_name = coalesce(excluded.query_name, queries.query_name),
                    started_at = coalesce(excluded.started_at, queries.started_at)
                """,
                params,
            )

        self.submit(write, description=f"query started {event.query_id}")

    def record_query_terminated(self, event: QueryTerminated) -> None:
        status = "failed" if event.failed else "terminated"
        params = (
            event.query_id,
            event.run_id,
            status,
            event.terminated_at or datetime.now(UTC),
            event.exception,
            event.error_class,
        )

        def write(con: duckdb.DuckDBPyConnection) -> None:
            con.execute(
                """
                INSERT INTO queries (query_id, run_id, status, terminated_at, exception, error_class)
                VALUES (?, ?, ?, ?, ?, ?)
                ON CONFLICT (query_id, run_id) DO UPDATE SET
                    status = excluded.status,
                    terminated_at = excluded.terminated_at,
                    exception = excluded.exception,
                    error_class = excluded.error_class
                """,
                params,
            )

        self.submit(write, description=f"query terminated {event.query_id}")

    def record_progress(
        self, snapshot: ProgressSnapshot, late_watermark_at: datetime | None = None
    ) -> None:
        """Upsert one batch (with its operators and sources) and the query's last progress.

        ``late_watermark_at`` is the watermark the late-row filter used for this batch; when
        None it is taken from the previous batch's ``watermark_at`` if that batch is recorded.
        """
        self._enqueue(
            f"batch {snapshot.batch_id} of {snapshot.query_id}",
            None,
            _progress_rows(snapshot, late_watermark_at, datetime.now(UTC)),
        )

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
                f"reading {self.path} took longer than {timeout:g} s: the history file is busy or unavailable"
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

    # ------------------------------------------------------------------ opening

    def _open_initial(self, timeout_seconds: float) -> None:
        path = self.path
        if path.is_dir():
            raise StoreError(f"{path} is a folder: pass a file path for the wmwatch history db")
        if not path.parent.is_dir():
            raise StoreError(
                f"folder {path.parent} does not exist: create it or pass another db path"
            )
        if not path.exists():
            _create_database(path)
        wal = Path(f"{path}.wal")
        unclean = wal.exists() and wal.stat().st_size > 0
        deadline = time.monotonic() + timeout_seconds
        con = _connect(path, read_only=False, deadline=deadline)
        _private_wal(path)
        try:
            migrate(con, path)
            rows = con.execute(
                """
                SELECT query_id, arg_max(query_name, batch_id), count(*), max(batch_id)
                FROM batches GROUP BY query_id ORDER BY query_id
                """
            ).fetchall()
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(_describe_open_error(path, exc)) from None
        finally:
            con.close()
            _drop_empty_wal(path)
        if not os.access(path.parent, os.W_OK | os.X_OK) or not os.access(path, os.W_OK):
            raise StoreError(
                f"cannot write to {path} (read-only or no permission): pass a db path in a writable folder"
            )
        self.history_at_open = tuple(QueryHistory(r[0], r[1], int(r[2]), r[3]) for r in rows)
        self.recovered_after_crash = unclean
        if unclean:
            summary = ", ".join(
                f"{h.query_name or h.query_id}: {h.batches} batches up to batch {h.last_batch_id}"
                for h in self.history_at_open
            )
            _log.warning(
                "%s was not closed cleanly; DuckDB replayed its write-ahead log and the history "
                "holds %s",
                path,
                summary or "no batches",
            )

    def _connect_for_write(self) -> duckdb.DuckDBPyConnection:
        # a file made anew may get the inode number of the one deleted: remember that we made it
        recreated = False
        if not self.path.exists():
            try:
                _create_database(self.path)
            except StoreError as exc:
                raise _Unavailable(str(exc)) from None
            recreated = self._verified_file is not None
        deadline = time.monotonic() + self.lock_wait_seconds
        try:
            con = self._engine.attach(self.path, deadline=deadline)
        except StoreError as exc:
            raise _Unavailable(str(exc)) from None
        _private_wal(self.path)
        try:
            # The schema check costs a catalog query per flush: only repeat it for a new file.
            stat = os.stat(self.path)
            identity = (stat.st_dev, stat.st_ino)
            if identity != self._verified_file or recreated:
                if self._verified_file is not None:
                    # Not the file written before: it was deleted, and made again above or, when
                    # it vanished between that check and the attach, by DuckDB itself (with the
                    # process umask: make it owner-only again).
                    os.chmod(self.path, _FILE_MODE)
                    _log.warning(
                        "history file %s was deleted while wmwatch was running; created a new "
                        "one and writing on (earlier history in it is gone)",
                        self.path,
                    )
                migrate(con, self.path)
                self._verified_file = identity
        except Exception as exc:
            self._engine.detach()
            raise _Unavailable(
                str(exc) if isinstance(exc, StoreError) else _first_line(exc)
            ) from None
        return con

    # ------------------------------------------------------------------ writer thread

    def _require_started(self) -> None:
        if self._thread is None:
            raise StoreError("the history store is not started: call start() first")

    def _stopped_locked(self) -> bool:
        return self._thread is not None and not self._thread.is_alive()

    def _enforce_bound_locked(self) -> None:
        dropped = 0
        while len(self._pending) > self.max_pending:
            self._pending.popleft()
            dropped += 1
        if dropped:
            self._health = replace(self._health, dropped_total=self._health.dropped_total + dropped)
            if not self._dropping_logged:
                self._dropping_logged = True
                _log.error(
                    "more than %d history writes waiting for %s: dropping the oldest (%s)",
                    self.max_pending,
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
                        len(self._pending) >= self.flush_writes or now >= self._next_flush_at
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
            except Exception as exc:
                _log.exception("wmwatch history writer failed unexpectedly; it goes on")
                self._count_error(_first_line(exc))
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
        if self.max_cpu_share is None:
            return
        wait = min(_MAX_PACED_INTERVAL_SECONDS, cpu_seconds / self.max_cpu_share)
        with self._cond:
            self._next_flush_at = max(self._next_flush_at, time.monotonic() + wait)

    def _cycle(self, reads: list[_Read]) -> None:
        try:
            con = self._connect_for_write()
        except _Unavailable as exc:
            self._mark_down(str(exc))
            for request in reads:
                request.future.set_exception(StoreError(str(exc)))
            return
        try:
            try:
                self._write_pending(con)
                if self.retention_days is not None and time.monotonic() >= self._next_retention_at:
                    self._apply_retention(con)
            except _Unavailable as exc:
                self._mark_down(str(exc))
                for request in reads:
                    request.future.set_exception(StoreError(str(exc)))
                return
            self._mark_up()
            for request in reads:
                if request.future.set_running_or_notify_cancel():
                    try:
                        request.future.set_result(request.fn(con))
                    except Exception as exc:
                        request.future.set_exception(exc)
        finally:
            self._engine.detach()
            _drop_empty_wal(self.path)

    def _write_pending(self, con: duckdb.DuckDBPyConnection) -> None:
        # Only what was pending when the cycle began: writes arriving meanwhile wait for the
        # next cycle, so a busy job cannot keep the file locked against readers.
        with self._cond:
            last_seq = self._pending[-1].seq if self._pending else 0
        while True:
            with self._cond:
                chunk: list[_Pending] = []
                while (
                    self._pending
                    and len(chunk) < _CHUNK_WRITES
                    and self._pending[0].seq <= last_seq
                ):
                    chunk.append(self._pending.popleft())
            if not chunk:
                return
            written, failed, leftover, reason = self._commit_chunk(con, chunk)
            handled = len(chunk) - len(leftover)
            with self._cond:
                if leftover:
                    self._pending.extendleft(reversed(leftover))
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
                raise _Unavailable(reason)

    def _commit_chunk(
        self, con: duckdb.DuckDBPyConnection, chunk: list[_Pending]
    ) -> tuple[int, int, list[_Pending], str | None]:
        """Commit ``chunk`` in one transaction; if a write is bad, skip it and commit the rest.

        Returns (written, failed, not handled, why the database became unavailable).
        """
        try:
            _begin(con)
            _run_writes(con, chunk)
            _commit(con)
            return len(chunk), 0, [], None
        except _Unavailable as exc:
            _rollback(con)
            return 0, 0, chunk, str(exc)
        except Exception:
            _rollback(con)
        # Some write raised on its own: run each in its own transaction so only it is skipped.
        written = failed = 0
        for index, item in enumerate(chunk):
            try:
                _begin(con)
                try:
                    _run_writes(con, [item])
                except _Unavailable:
                    raise
                except Exception as exc:
                    _rollback(con)
                    failed += 1
                    message = _first_line(exc)
                    _log.error(
                        "history write %r failed and was skipped: %s", item.description, message
                    )
                    with self._cond:
                        self._health = replace(self._health, last_error=message)
                    continue
                _commit(con)
            except _Unavailable as exc:
                _rollback(con)
                return written, failed, chunk[index:], str(exc)
            written += 1
        return written, failed, [], None

    def _apply_retention(self, con: duckdb.DuckDBPyConnection) -> None:
        import duckdb

        assert self.retention_days is not None
        cutoff = datetime.now(UTC).timestamp() - self.retention_days * 86_400.0
        try:
            con.execute("BEGIN TRANSACTION")
            deleted = apply_retention(con, cutoff_epoch_seconds=cutoff)
            _commit(con)
            if deleted:
                con.execute("CHECKPOINT")
                _log.info(
                    "retention removed %d history rows older than %g days",
                    deleted,
                    self.retention_days,
                )
        except duckdb.Error as exc:
            _rollback(con)
            _log.warning("history retention failed (will retry): %s", _first_line(exc))
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
                "cannot write history to %s (%s); keeping %d writes in memory (up to %d) and retrying",
                self.path,
                reason,
                pending,
                self.max_pending,
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


# ---------------------------------------------------------------------- one writer per file


# Paths of the history files this process writes (see _WriterLock).
_WRITTEN_HERE: set[str] = set()
_WRITTEN_HERE_GUARD = threading.Lock()


class _WriterLock:
    """Exclusive right to write one history file, held from open to close.

    Two writers on one file upsert the same batches in turn and fail each other's commits, so the
    second one is refused at open. Across processes: ``flock`` on ``<db>.lock`` (0600, holding the
    owner's PID for the message); the kernel drops it when the process dies, so a crash never
    leaves a file locked. Within this process: a set of held paths, because a filesystem may
    emulate ``flock`` with per-process locks. The lock file is removed on release, so a closed
    store leaves only its database behind; whoever locks it checks that the path still names the
    file it locked, and retries otherwise.

    Where the lock file cannot be created (a read-only or missing folder) the store goes on
    without the cross-process lock rather than fail on the lock: DuckDB cannot write its log in
    such a folder either, so opening the database reports the real problem. If the database opens
    all the same, the in-process check still applies and :attr:`unlocked_reason` says why other
    processes are not excluded (the store logs it).
    """

    def __init__(self, db: Path) -> None:
        self._db = db
        self._key = os.path.realpath(db)
        self._lock_path = Path(f"{db}.lock")
        self._fd: int | None = None
        self._owns_key = False
        self.unlocked_reason: str | None = None
        with _WRITTEN_HERE_GUARD:
            if self._key in _WRITTEN_HERE:
                raise StoreError(
                    f"{db} is already being written by another wmwatch in this process "
                    f"(PID {os.getpid()}): close that watch or pass another db"
                )
            _WRITTEN_HERE.add(self._key)
            self._owns_key = True
        try:
            self._fd = self._lock_file()
        except BaseException:
            self.release()
            raise

    def _lock_file(self) -> int | None:
        for _ in range(10):
            try:
                fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _FILE_MODE)
            except OSError as exc:
                self.unlocked_reason = f"cannot create {self._lock_path}: {exc.strerror or exc}"
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_pid(fd)
                os.close(fd)
                who = f" (PID {holder})" if holder else ""
                raise StoreError(
                    f"{self._db} is already being written by another wmwatch{who}: "
                    "close that watch or pass another db"
                ) from None
            except OSError as exc:  # a filesystem without flock (ENOLCK, EINVAL)
                os.close(fd)
                self.unlocked_reason = f"cannot lock {self._lock_path}: {exc.strerror or exc}"
                return None
            if _same_file(fd, self._lock_path):
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                return fd
            os.close(fd)  # its owner removed it between our open and our lock: take the new one
        self.unlocked_reason = f"{self._lock_path} kept being replaced"
        return None

    def release(self) -> None:
        """Give the file up (idempotent); the process exiting does the same."""
        fd, self._fd = self._fd, None
        if fd is not None:
            # removed while still locked, so nobody can lock this inode and take it for current
            with contextlib.suppress(OSError):
                if _same_file(fd, self._lock_path):
                    self._lock_path.unlink()
            os.close(fd)
        if self._owns_key:
            self._owns_key = False
            with _WRITTEN_HERE_GUARD:
                _WRITTEN_HERE.discard(self._key)

    def __del__(self) -> None:
        # a store dropped without close(): free the file for the next writer in this process
        with contextlib.suppress(Exception):
            self.release()


def _same_file(fd: int, path: Path) -> bool:
    try:
        opened, named = os.fstat(fd), os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ENOENT:
            return False
        raise
    return (opened.st_dev, opened.st_ino) == (named.st_dev, named.st_ino)


def _read_pid(fd: int) -> int | None:
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(fd, 32, 0).decode().strip())
    return None


# ---------------------------------------------------------------------- schema and files


def migrate(con: duckdb.DuckDBPyConnection, path: Path | str) -> int:
    """Bring the database to :data:`LATEST_VERSION`; return the version it was at."""
    tables = {
        row[0]
        for row in con.execute(
            "SELECT table_name FROM information_schema.tables "
            "WHERE table_catalog = current_database() AND table_schema = 'main'"
        ).fetchall()
    }
    if "wmwatch_schema" in tables:
        current = con.execute("SELECT coalesce(max(version), 0) FROM wmwatch_schema").fetchone()
        version = int(current[0]) if current else 0
    elif tables:
        raise StoreError(
            f"{path} is a DuckDB database of another application, not a wmwatch history: "
            "pass another --db"
        )
    else:
        version = 0
    if version > LATEST_VERSION:
        raise StoreError(
            f"{path} was written by a newer wmwatch (schema v{version}, this one knows "
            f"v{LATEST_VERSION}): upgrade wmwatch or pass another --db"
        )
    for migration in MIGRATIONS:
        if migration.version <= version:
            continue
        con.execute("BEGIN TRANSACTION")
        try:
            con.execute(VERSION_TABLE)
            for statement in migration.statements:
                con.execute(statement)
            con.execute(
                "INSERT INTO wmwatch_schema (version, description) VALUES (?, ?)",
                (migration.version, migration.description),
            )
            con.execute("COMMIT")
        except BaseException:
            _rollback(con)
            raise
    return version


def apply_retention(con: duckdb.DuckDBPyConnection, *, cutoff_epoch_seconds: float) -> int:
    """Delete history recorded before the cutoff; returns the number of rows deleted.

    Operators and sources go with their batch; late rows and audit batches by their audit time;
    resolved findings by their last sighting. Query lifecycle rows are kept (one per run).
    """
    cutoff = datetime.fromtimestamp(cutoff_epoch_seconds, UTC)
    statements = (
        """DELETE FROM operators o USING batches b
           WHERE o.query_id = b.query_id AND o.batch_id = b.batch_id AND b.batch_at < ?""",
        """DELETE FROM sources s USING batches b
           WHERE s.query_id = b.query_id AND s.batch_id = b.batch_id AND b.batch_at < ?""",
        "DELETE FROM batches WHERE batch_at < ?",
        "DELETE FROM late_rows WHERE audited_at < ?",
        "DELETE FROM audit_batches WHERE audited_at < ?",
        "DELETE FROM findings WHERE status = 'resolved' AND last_seen_at < ?",
    )
    deleted = 0
    for statement in statements:
        row = con.execute(statement, (cutoff,)).fetchone()
        deleted += int(row[0]) if row else 0
    return deleted


@contextlib.contextmanager
def open_readonly(
    path: str | os.PathLike[str], timeout: float = 5.0
) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only connection to a history file that a running job may be writing.

    Retries while the writer holds the lock (it does so only while flushing). Raises
    :class:`StoreError` when the file is missing, not a wmwatch database, or newer than this
    wmwatch. The connection's time zone is UTC.
    """
    db = Path(path).expanduser().absolute()
    if not db.exists():
        raise StoreError(
            f"no wmwatch history at {db}: attach wmwatch to a job (wmwatch.attach(spark, db=...)) "
            "or pass the right --db"
        )
    if db.is_dir():
        raise StoreError(f"{db} is a folder, not a wmwatch history file: pass the file with --db")
    con = _connect(db, read_only=True, deadline=time.monotonic() + timeout)
    try:
        try:
            tables = {
                row[0]
                for row in con.execute(
                    "SELECT table_name FROM information_schema.tables "
                    "WHERE table_catalog = current_database() AND table_schema = 'main'"
                ).fetchall()
            }
            if "wmwatch_schema" not in tables:
                raise StoreError(
                    f"{db} is not a wmwatch history database: move it aside or pass another --db"
                )
            row = con.execute("SELECT coalesce(max(version), 0) FROM wmwatch_schema").fetchone()
        except StoreError:
            raise
        except Exception as exc:
            raise StoreError(_describe_open_error(db, exc)) from None
        version = int(row[0]) if row else 0
        if version > LATEST_VERSION:
            raise StoreError(
                f"{db} was written by a newer wmwatch (schema v{version}, this one knows "
                f"v{LATEST_VERSION}): upgrade wmwatch to read it"
            )
        con.execute("SET TimeZone = 'UTC'")
        yield con
    finally:
        con.close()


def _until_unlocked(path: Path, deadline: float, open_once: Callable[[], T]) -> T:
    """``open_once()``, tried again while another connection holds ``path``'s lock, until
    ``deadline``; any other failure, or the deadline, is a one-line :class:`StoreError`."""
    import duckdb

    while True:
        try:
            return open_once()
        except (duckdb.Error, OSError) as exc:
            if _is_lock_conflict(exc) and time.monotonic() < deadline:
                time.sleep(_LOCK_POLL_SECONDS)
                continue
            raise StoreError(_describe_open_error(path, exc)) from None


def _connect(path: Path, *, read_only: bool, deadline: float) -> duckdb.DuckDBPyConnection:
    """Open ``path``, retrying lock conflicts until ``deadline``; StoreError otherwise."""
    import duckdb

    con = _until_unlocked(path, deadline, lambda: duckdb.connect(str(path), read_only=read_only))
    if not read_only:
        con.execute("SET TimeZone = 'UTC'")
    return con


def _private_wal(path: Path) -> None:
    """Create the write-ahead log, empty and 0600, before this connection's first write.

    DuckDB creates ``<db>.wal`` with the process umask (0644 with the usual 022) and it holds the
    rows of every flush until the connection closes; DuckDB keeps the mode of a file it finds.
    Call right after connecting: an empty log present at open is deleted and recreated.
    """
    with contextlib.suppress(OSError):
        fd = os.open(f"{path}.wal", os.O_CREAT | os.O_WRONLY, _FILE_MODE)
        try:
            os.fchmod(fd, _FILE_MODE)
        finally:
            os.close(fd)


def _drop_empty_wal(path: Path) -> None:
    """Remove the log :func:`_private_wal` made when the connection closed without writing."""
    wal = Path(f"{path}.wal")
    with contextlib.suppress(OSError):
        if wal.stat().st_size == 0:
            wal.unlink()


def _create_database(path: Path) -> None:
    """Create a migrated database at ``path``, readable by its owner only.

    DuckDB creates files with the process umask, so the file is built in a private (0700)
    folder next to the target, made 0600, and linked into place: it is never visible with
    wider permissions, and a file created meanwhile by someone else is not overwritten.
    """
    import duckdb

    try:
        workdir = Path(tempfile.mkdtemp(prefix=".wmwatch-new-", dir=path.parent))
    except FileNotFoundError:
        raise StoreError(
            f"folder {path.parent} does not exist: create it or pass another db path"
        ) from None
    except OSError as exc:
        raise StoreError(
            f"cannot create {path} (read-only or no permission: {exc.strerror or exc}): "
            "pass a db path in a writable folder"
        ) from None
    try:
        fresh = workdir / "history.duckdb"
        try:
            con = duckdb.connect(str(fresh))
            try:
                migrate(con, path)
            finally:
                con.close()
            os.chmod(fresh, _FILE_MODE)
            try:
                os.link(fresh, path)
            except FileExistsError:
                pass
            except OSError:
                if not path.exists():
                    os.replace(fresh, path)
        except (duckdb.Error, OSError) as exc:
            raise StoreError(f"cannot create {path}: {_first_line(exc)}") from None
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


_LOCK_PATTERNS = (
    "could not set lock",
    "conflicting lock",
    "different configuration",
    # the same file opened again inside this process (a reader while the writer flushes)
    "unique file handle conflict",
    "already attached",
)


def _is_lock_conflict(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(pattern in text for pattern in _LOCK_PATTERNS)


def _describe_open_error(path: Path, exc: BaseException) -> str:
    text = str(exc)
    lower = text.lower()
    if "not a valid duckdb database" in lower or "corrupt" in lower or "checksum" in lower:
        return f"{path} is not a wmwatch/DuckDB database or is damaged: move it aside or pass another --db"
    if _is_lock_conflict(exc):
        holder = re.search(r"held in (.+?) \(PID (\d+)\)", text)
        who = f" (PID {holder.group(2)}, {holder.group(1)})" if holder else ""
        return f"{path} is locked by another process{who}: stop it, or pass another db path"
    if (
        "permission denied" in lower
        or "read-only" in lower
        or "read only" in lower
        # EPERM: an immutable file (chattr +i), which even root cannot write
        or "operation not permitted" in lower
    ):
        return f"cannot write to {path} (read-only or no permission): pass a db path in a writable folder"
    if "is a directory" in lower:
        return f"{path} is a folder, not a file: move it aside or pass another db path"
    if "no such file or directory" in lower:
        return f"{path} or its folder does not exist: create the folder or pass another db path"
    if "newer version" in lower or "storage version" in lower or "older version" in lower:
        return (
            f"{path} was written by another DuckDB version ({_first_line(exc)}): pass another --db"
        )
    if "no space left" in lower or "disk full" in lower:
        return f"no space left on the device of {path}: free some space"
    return f"cannot open {path}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return redact(text[0] if text else exc.__class__.__name__)[:500]


def _rollback(con: duckdb.DuckDBPyConnection) -> None:
    with contextlib.suppress(Exception):
        con.execute("ROLLBACK")


def _begin(con: duckdb.DuckDBPyConnection) -> None:
    import duckdb

    try:
        con.execute("BEGIN TRANSACTION")
    except (duckdb.Error, OSError) as exc:
        raise _Unavailable(_first_line(exc)) from None


def _commit(con: duckdb.DuckDBPyConnection) -> None:
    import duckdb

    try:
        con.execute("COMMIT")
    except (duckdb.Error, OSError) as exc:
        _rollback(con)
        raise _Unavailable(_first_line(exc)) from None


def _run_writes(con: duckdb.DuckDBPyConnection, items: list[_Pending]) -> None:
    """Run all progress rows in bulk, then the submitted writes in order.

    Plugins submit a write per batch, so keeping strict interleaving would cut the bulk insert
    into one ~10-statement upsert per batch: under Spark load that made a flush of a few hundred
    batches take over 10 s and the writer fall behind. Progress rows are upserts of their own
    rows that no submitted write has to precede, so they go first. I/O failures mean "database
    unavailable".
    """
    import duckdb

    try:
        run = [item.progress for item in items if item.progress is not None]
        if run:
            _write_progress_rows(con, run)
        for item in items:
            if item.progress is None and item.write is not None:
                item.write(con)
    except (duckdb.IOException, OSError) as exc:
        raise _Unavailable(_first_line(exc)) from None


def _clean_name(name: str | None) -> str | None:
    return _utf8(redact(name)[:200]) if name else None


# A \uD800-\uDFFF escape that is not half of a pair: Python's json accepts it, DuckDB's JSON
# type refuses the whole document (and the batch row with it).
_LONE_SURROGATE_ESCAPE = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def _utf8_json(text: str) -> str:
    text = _utf8(text)
    if "\\u" in text:
        text = _LONE_SURROGATE_ESCAPE.sub("\\\\ufffd", text)
    return text


@dataclass(frozen=True, slots=True)
class _ProgressRows:
    """One progress snapshot as rows, built on the caller's thread and written in bulk."""

    batch: tuple[Any, ...]
    operators: tuple[tuple[Any, ...], ...]
    sources: tuple[tuple[Any, ...], ...]


# (column, DuckDB type) of the staged batch rows, in the order _progress_rows builds them.
_STAGE_BATCH = (
    ("query_id", "VARCHAR"),
    ("batch_id", "BIGINT"),
    ("run_id", "VARCHAR"),
    ("query_name", "VARCHAR"),
    ("batch_at", "TIMESTAMPTZ"),
    ("watermark_at", "TIMESTAMPTZ"),
    ("late_watermark_at", "TIMESTAMPTZ"),
    ("event_time_max_at", "TIMESTAMPTZ"),
    ("event_time_min_at", "TIMESTAMPTZ"),
    ("event_time_avg_at", "TIMESTAMPTZ"),
    ("watermark_lag_seconds", "DOUBLE"),
    ("event_time_delay_seconds", "DOUBLE"),
    ("input_rows", "BIGINT"),
    ("input_rows_per_second", "DOUBLE"),
    ("processed_rows_per_second", "DOUBLE"),
    ("batch_duration_seconds", "DOUBLE"),
    ("durations_seconds", "VARCHAR"),
    ("rows_dropped_by_watermark", "BIGINT"),
    ("state_rows_total", "BIGINT"),
    ("state_memory_bytes", "BIGINT"),
    ("sink_output_rows", "BIGINT"),
    ("progress_json", "VARCHAR"),
    ("recorded_at", "TIMESTAMPTZ"),
    ("operator_count", "INTEGER"),
    ("source_count", "INTEGER"),
    ("seq", "BIGINT"),
)
_STAGE_OPERATOR = (
    ("query_id", "VARCHAR"),
    ("batch_id", "BIGINT"),
    ("operator_id", "INTEGER"),
    ("operator_name", "VARCHAR"),
    ("rows_total", "BIGINT"),
    ("rows_updated", "BIGINT"),
    ("rows_removed", "BIGINT"),
    ("rows_dropped_by_watermark", "BIGINT"),
    ("memory_used_bytes", "BIGINT"),
    ("shuffle_partitions", "INTEGER"),
    ("state_store_instances", "INTEGER"),
    ("custom_metrics", "VARCHAR"),
    ("seq", "BIGINT"),
)
_STAGE_SOURCE = (
    ("query_id", "VARCHAR"),
    ("batch_id", "BIGINT"),
    ("source_index", "INTEGER"),
    ("description", "VARCHAR"),
    ("start_offset", "VARCHAR"),
    ("end_offset", "VARCHAR"),
    ("input_rows", "BIGINT"),
    ("input_rows_per_second", "DOUBLE"),
    ("processed_rows_per_second", "DOUBLE"),
    ("seq", "BIGINT"),
)

_JSON_COLUMNS = {"durations_seconds", "progress_json", "custom_metrics"}


def _stage(
    con: duckdb.DuckDBPyConnection,
    table: str,
    columns: tuple[tuple[str, str], ...],
    rows: list[tuple[Any, ...]],
) -> None:
    # One statement that unnests column lists: ~20x faster than executemany for a flush.
    select = ", ".join(
        f"unnest(${i + 1}::{kind}[]) AS {name}" for i, (name, kind) in enumerate(columns)
    )
    values = [list(col) for col in zip(*rows, strict=True)] if rows else [[] for _ in columns]
    con.execute(f"CREATE OR REPLACE TEMP TABLE {table} AS SELECT {select}", values)


def _write_progress_rows(con: duckdb.DuckDBPyConnection, items: list[_ProgressRows]) -> None:
    """Upsert many snapshots at once; a batch retried within the flush keeps its last version."""
    _stage(con, "wmwatch_stage_all", _STAGE_BATCH, [item.batch for item in items])
    con.execute(
        """
        CREATE OR REPLACE TEMP TABLE wmwatch_stage_batches AS
        SELECT * FROM wmwatch_stage_all
        QUALIFY row_number() OVER (PARTITION BY query_id, batch_id ORDER BY seq DESC) = 1
        """
    )
    batch_columns = [name for name, _ in _STAGE_BATCH[:23]]
    select = ", ".join(
        "coalesce(s.late_watermark_at, ps.watermark_at, pb.watermark_at)"
        if name == "late_watermark_at"
        else f"s.{name}::JSON"
        if name in _JSON_COLUMNS
        else f"s.{name}"
        for name in batch_columns
    )
    # The previous batch's watermark is the one Spark's late-row filter used for this batch;
    # it may be in this flush (ps) or already in the file (pb).
    con.execute(
        f"""
        INSERT OR REPLACE INTO batches ({", ".join(batch_columns)})
        SELECT {select}
        FROM wmwatch_stage_batches s
        LEFT JOIN wmwatch_stage_batches ps
               ON ps.query_id = s.query_id AND ps.batch_id = s.batch_id - 1
        LEFT JOIN (SELECT query_id, batch_id, watermark_at FROM batches
                   WHERE batch_id >= (SELECT min(batch_id) - 1 FROM wmwatch_stage_batches)) pb
               ON pb.query_id = s.query_id AND pb.batch_id = s.batch_id - 1
        """
    )
    operators = [row for item in items for row in item.operators]
    if operators:
        _stage(con, "wmwatch_stage_operators", _STAGE_OPERATOR, operators)
        names = [name for name, _ in _STAGE_OPERATOR[:-1]]
        con.execute(
            f"""
            INSERT OR REPLACE INTO operators ({", ".join(names)})
            SELECT {", ".join(f"o.{n}::JSON" if n in _JSON_COLUMNS else f"o.{n}" for n in names)}
            FROM wmwatch_stage_operators o
            JOIN wmwatch_stage_batches s USING (query_id, batch_id, seq)
            """
        )
    sources = [row for item in items for row in item.sources]
    if sources:
        _stage(con, "wmwatch_stage_sources", _STAGE_SOURCE, sources)
        names = [name for name, _ in _STAGE_SOURCE[:-1]]
        con.execute(
            f"""
            INSERT OR REPLACE INTO sources ({", ".join(names)})
            SELECT {", ".join(f"o.{n}" for n in names)}
            FROM wmwatch_stage_sources o
            JOIN wmwatch_stage_batches s USING (query_id, batch_id, seq)
            """
        )
    # A retried batch that reports fewer operators or sources than its first attempt.
    con.execute(
        """
        DELETE FROM operators o USING wmwatch_stage_batches s
        WHERE o.query_id = s.query_id AND o.batch_id = s.batch_id
          AND o.operator_id >= s.operator_count
        """
    )
    con.execute(
        """
        DELETE FROM sources o USING wmwatch_stage_batches s
        WHERE o.query_id = s.query_id AND o.batch_id = s.batch_id
          AND o.source_index >= s.source_count
        """
    )
    con.execute(
        """
        INSERT INTO queries (query_id, run_id, query_name, status, last_batch_id, last_progress_at)
        SELECT query_id, run_id, arg_max(query_name, seq), 'active', max(batch_id),
               max(coalesce(batch_at, recorded_at))
        FROM wmwatch_stage_all GROUP BY query_id, run_id
        ON CONFLICT (query_id, run_id) DO UPDATE SET
            query_name = coalesce(excluded.query_name, queries.query_name),
            last_batch_id = greatest(coalesce(queries.last_batch_id, -1), excluded.last_batch_id),
            last_progress_at = greatest(queries.last_progress_at, excluded.last_progress_at)
        """
    )


_seq_for_rows = itertools.count(1)


def _progress_rows(
    snapshot: ProgressSnapshot, late_watermark_at: datetime | None, recorded_at: datetime
) -> _ProgressRows:
    """The rows of one snapshot, built on the caller's thread (the writer only stages them)."""
    has_operators = bool(snapshot.operators)
    # Orders versions of the same batch within a flush: the last recorded wins.
    seq = next(_seq_for_rows)
    batch = (
        snapshot.query_id,
        snapshot.batch_id,
        snapshot.run_id,
        _clean_name(snapshot.name),
        snapshot.timestamp_at,
        snapshot.watermark_at,
        late_watermark_at,
        snapshot.event_time_max_at,
        snapshot.event_time_min_at,
        snapshot.event_time_avg_at,
        snapshot.watermark_lag_seconds,
        snapshot.event_time_delay_seconds,
        snapshot.input_rows,
        snapshot.input_rows_per_second,
        snapshot.processed_rows_per_second,
        snapshot.batch_duration_seconds,
        json.dumps(dict(snapshot.durations_seconds), sort_keys=True),
        snapshot.rows_dropped_by_watermark if has_operators else None,
        snapshot.state_rows_total if has_operators else None,
        snapshot.state_memory_bytes if has_operators else None,
        snapshot.sink_output_rows,
        _utf8_json(snapshot.raw_json),
        recorded_at,
        len(snapshot.operators),
        len(snapshot.sources),
        seq,
    )
    operators = tuple(
        (
            snapshot.query_id,
            snapshot.batch_id,
            op.operator_id,
            _utf8(op.name),
            op.rows_total,
            op.rows_updated,
            op.rows_removed,
            op.rows_dropped_by_watermark,
            op.memory_used_bytes,
            op.shuffle_partitions,
            op.state_store_instances,
            json.dumps(dict(op.custom_metrics), sort_keys=True),
            seq,
        )
        for op in snapshot.operators
    )
    sources = tuple(
        (
            snapshot.query_id,
            snapshot.batch_id,
            src.index,
            _utf8(src.description),
            src.start_offset,
            src.end_offset,
            src.input_rows,
            src.input_rows_per_second,
            src.processed_rows_per_second,
            seq,
        )
        for src in snapshot.sources
    )
    return _ProgressRows(batch, operators, sources)
