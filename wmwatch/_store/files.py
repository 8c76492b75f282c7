"""The history file on disk: creating it, opening it, and the one writer allowed at a time.

DuckDB creates files with the process umask and locks a file while any connection is open;
this module makes the file and its write-ahead log owner-only, retries while another
connection holds the lock, turns every failure to open into one sentence a person can act on,
and keeps a second writer off a file that one store is writing (:class:`WriterLock`). Over 500
lines because each way into the file (read-only, created, written, locked) is guarded here,
in the one place that knows DuckDB's locking.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from wmwatch._errors import StoreError
from wmwatch._store.rows import QueryHistory, read_history
from wmwatch._store.schema import LATEST_VERSION, migrate, read_as_latest, schema_version
from wmwatch._text import error_line, get_logger

if TYPE_CHECKING:
    import duckdb

T = TypeVar("T")

_log = get_logger("wmwatch.store")

_LOCK_POLL_SECONDS = 0.005
FILE_MODE = 0o600


# -- opening --


@contextlib.contextmanager
def open_readonly(
    path: str | os.PathLike[str],
    timeout: float = 5.0,
    *,
    readable_files: Callable[[duckdb.DuckDBPyConnection], Sequence[str]] | None = None,
) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only connection to a history file that a running job may be writing.

    Retries while the writer holds the lock (it does so only while flushing). Raises
    :class:`StoreError` when the file is missing, not a wmwatch database, holds views or macros
    (wmwatch writes neither), or is newer than this wmwatch. The connection's time zone is UTC.

    A history file may come from someone else, so the connection cannot reach anything outside
    it: no external access (files, network, Python variables), no extension loading, settings
    locked. ``readable_files(con)``, given such a connection, names the only outside files the
    caller may then read (the audit's Parquet files): the file is opened twice, once to ask.
    """
    db = Path(path).expanduser().absolute()
    if not db.exists():
        raise StoreError(
            f"no wmwatch history at {db}: attach wmwatch to a job (wmwatch.attach(spark, db=...)) "
            "or pass the right --db"
        )
    if db.is_dir():
        raise StoreError(f"{db} is a folder, not a wmwatch history file: pass the file with --db")
    refuse_planted_links(db)
    deadline = time.monotonic() + timeout
    allowed: list[str] = []
    if readable_files is not None:
        with _reader(db, deadline, ()) as con:
            allowed = list(readable_files(con))
    with _reader(db, deadline, allowed) as con:
        yield con


# DuckDB reads these at start-up only; external access is switched off after the allowed files
# are set (DuckDB takes no list of allowed files at start-up).
_READER_CONFIG = {
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "python_enable_replacements": False,
}


@contextlib.contextmanager
def _reader(
    db: Path, deadline: float, allowed_files: Sequence[str]
) -> Iterator[duckdb.DuckDBPyConnection]:
    import duckdb

    con = until_unlocked(
        db,
        deadline,
        lambda: duckdb.connect(str(db), read_only=True, config=dict(_READER_CONFIG)),
    )
    try:
        try:
            if allowed_files:
                con.execute("SET allowed_paths = $1", [list(allowed_files)])
            con.execute("SET enable_external_access = false")
            con.execute("SET TimeZone = 'UTC'")
            con.execute("SET lock_configuration = true")
            refuse_views_and_macros(con, db)
            version = schema_version(con, db, reading=True)
            if version < LATEST_VERSION:
                read_as_latest(con, version)
        except StoreError:
            raise
        except Exception as exc:  # noqa: BLE001 - DuckDB raises many kinds; each becomes one StoreError line
            raise StoreError(describe_open_error(db, exc)) from None
        yield con
    finally:
        con.close()


def refuse_views_and_macros(con: duckdb.DuckDBPyConnection, db: Path) -> None:
    """StoreError when the file holds a view or a macro: wmwatch creates only tables, and a view
    or macro named like one of them would run someone else's query with the reader's rights."""
    found = con.execute(
        """
        SELECT 'view ' || view_name FROM duckdb_views()
        WHERE database_name = current_database() AND NOT internal
        UNION ALL
        SELECT 'macro ' || function_name FROM duckdb_functions()
        WHERE database_name = current_database() AND NOT internal
          AND function_type IN ('macro', 'table_macro')
        ORDER BY 1 LIMIT 3
        """
    ).fetchall()
    if found:
        names = ", ".join(repr(name)[1:-1][:60] for (name,) in found)
        raise StoreError(
            f"{db} holds {names}, which wmwatch never writes: the file was altered, "
            "so it is not read; pass a history file written by wmwatch"
        )


def refuse_planted_links(db: Path) -> None:
    """StoreError when ``<db>.wal`` or ``<db>.lock`` is a symbolic link.

    DuckDB and the writer lock open those names as they find them: a link planted there would
    have the history's rows written into, or truncate, whatever file it points to.
    """
    for side in (Path(f"{db}.wal"), Path(f"{db}.lock")):
        if side.is_symlink():
            raise StoreError(
                f"{side} is a symbolic link, which wmwatch does not follow: "
                "remove it (the history needs no link there) and try again"
            )


def until_unlocked(path: Path, deadline: float, open_once: Callable[[], T]) -> T:
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
            raise StoreError(describe_open_error(path, exc)) from None


def connect(path: Path, *, read_only: bool, deadline: float) -> duckdb.DuckDBPyConnection:
    """Open ``path``, retrying lock conflicts until ``deadline``; StoreError otherwise."""
    import duckdb

    con = until_unlocked(path, deadline, lambda: duckdb.connect(str(path), read_only=read_only))
    if not read_only:
        con.execute("SET TimeZone = 'UTC'")
    return con


def private_wal(path: Path) -> None:
    """Create the write-ahead log, empty and 0600, before this connection's first write.

    DuckDB creates ``<db>.wal`` with the process umask (0644 with the usual 022) and it holds the
    rows of every flush until the connection closes; DuckDB keeps the mode of a file it finds.
    Call right after connecting: an empty log present at open is deleted and recreated.
    """
    # O_NOFOLLOW: a link planted at <db>.wal must not have its target's mode changed
    with contextlib.suppress(OSError):
        fd = os.open(
            f"{path}.wal", os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE
        )
        try:
            os.fchmod(fd, FILE_MODE)
        finally:
            os.close(fd)


def drop_empty_wal(path: Path) -> None:
    """Remove the log :func:`private_wal` made when the connection closed without writing."""
    wal = Path(f"{path}.wal")
    with contextlib.suppress(OSError):
        info = wal.lstat()
        if stat.S_ISREG(info.st_mode) and info.st_size == 0:
            wal.unlink()


def create_database(path: Path) -> None:
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
            os.chmod(fresh, FILE_MODE)
            try:
                os.link(fresh, path)
            except FileExistsError:
                pass
            except OSError:
                if not path.exists():
                    os.replace(fresh, path)
        except (duckdb.Error, OSError) as exc:
            raise StoreError(f"cannot create {path}: {error_line(exc)}") from None
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


def cannot_write(path: Path) -> str:
    return (
        f"cannot write to {path} (read-only or no permission): pass a db path in a writable folder"
    )


def _is_lock_conflict(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(pattern in text for pattern in _LOCK_PATTERNS)


def describe_open_error(path: Path, exc: BaseException) -> str:
    text = str(exc)
    lower = text.lower()
    if "not a valid duckdb database" in lower or "corrupt" in lower or "checksum" in lower:
        return (
            f"{path} is not a wmwatch/DuckDB database or is damaged: "
            "move it aside or pass another --db"
        )
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
        return cannot_write(path)
    if "is a directory" in lower:
        return f"{path} is a folder, not a file: move it aside or pass another db path"
    if "no such file or directory" in lower:
        return f"{path} or its folder does not exist: create the folder or pass another db path"
    if "newer version" in lower or "storage version" in lower or "older version" in lower:
        return (
            f"{path} was written by another DuckDB version ({error_line(exc)}): pass another --db"
        )
    if "no space left" in lower or "disk full" in lower:
        return f"no space left on the device of {path}: free some space"
    return f"cannot open {path}: {error_line(exc)}"


# -- the writer's engine --


_ATTACHED_AS = "wmwatch_history"


class WriterEngine:
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
        """The engine with ``path`` attached and in use; retries lock conflicts until
        ``deadline``."""
        import duckdb

        if self._con is None:
            try:
                con = duckdb.connect(":memory:", config={"threads": 1})
                con.execute("SET TimeZone = 'UTC'")
            except (duckdb.Error, OSError) as exc:
                raise StoreError(f"cannot start DuckDB: {error_line(exc)}") from None
            self._con = con
        con = self._con
        refuse_planted_links(path)
        quoted = str(path).replace("'", "''")

        def attach_once() -> duckdb.DuckDBPyConnection:
            try:
                con.execute(f"ATTACH '{quoted}' AS {_ATTACHED_AS}")
                con.execute(f"USE {_ATTACHED_AS}")
            except BaseException:
                self.detach()
                raise
            return con

        return until_unlocked(path, deadline, attach_once)

    def detach(self) -> None:
        """Release the file (checkpoint, lock); the instance stays for the next flush."""
        con = self._con
        if con is None:
            return
        try:
            con.execute("USE memory")
            con.execute(f"DETACH DATABASE IF EXISTS {_ATTACHED_AS}")
        except Exception:  # noqa: BLE001 - the lock must not outlive the flush: drop the instance
            _log.debug(
                "detaching the history file failed; closing the DuckDB instance", exc_info=True
            )
            self.close()

    def close(self) -> None:
        con, self._con = self._con, None
        if con is not None:
            with contextlib.suppress(Exception):
                con.close()


# -- one writer per file --


# Paths of the history files this process writes (see WriterLock).
_WRITTEN_HERE: set[str] = set()
_WRITTEN_HERE_GUARD = threading.Lock()


class WriterLock:
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
                # O_NOFOLLOW: a link planted at <db>.lock must not get its target truncated
                fd = os.open(
                    self._lock_path,
                    os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                    FILE_MODE,
                )
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    refuse_planted_links(self._db)
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


@dataclass(frozen=True, slots=True)
class OpenedHistory:
    """What opening the file for writing found: each query's history, and whether DuckDB had to
    replay a write-ahead log left by a process that did not close the file."""

    history: tuple[QueryHistory, ...]
    recovered_after_crash: bool


def refuse_shared_file(path: Path) -> None:
    """StoreError when others than the owner may write the history file: they could replace what
    it holds (views, rows) under every later reader, and wmwatch makes its own files 0600."""
    with contextlib.suppress(FileNotFoundError):
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise StoreError(
                f"{path} is writable by others (mode {mode:04o}): make it owner-only "
                f"(chmod 600 {path}) or pass another db path"
            )


def open_for_writing(path: Path, *, timeout_seconds: float) -> OpenedHistory:
    """Create or migrate the history file at ``path`` and check it can be written, raising
    :class:`StoreError` with a one-line message when it cannot (a folder, a missing folder, a
    file of another kind, no write permission, a lock held too long)."""
    if path.is_dir():
        raise StoreError(f"{path} is a folder: pass a file path for the wmwatch history db")
    if not path.parent.is_dir():
        raise StoreError(f"folder {path.parent} does not exist: create it or pass another db path")
    refuse_planted_links(path)
    if not path.exists():
        create_database(path)
    refuse_shared_file(path)
    wal = Path(f"{path}.wal")
    unclean = wal.exists() and wal.stat().st_size > 0
    deadline = time.monotonic() + timeout_seconds
    con = connect(path, read_only=False, deadline=deadline)
    private_wal(path)
    try:
        migrate(con, path)
        history = read_history(con)
    except StoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - DuckDB raises many kinds; each becomes one StoreError line
        raise StoreError(describe_open_error(path, exc)) from None
    finally:
        con.close()
        drop_empty_wal(path)
    if not os.access(path.parent, os.W_OK | os.X_OK) or not os.access(path, os.W_OK):
        raise StoreError(cannot_write(path))
    if unclean:
        summary = ", ".join(
            f"{h.query_name or h.query_id}: {h.batches} batches up to batch {h.last_batch_id}"
            for h in history
        )
        _log.warning(
            "%s was not closed cleanly; DuckDB replayed its write-ahead log and the history "
            "holds %s",
            path,
            summary or "no batches",
        )
    return OpenedHistory(history=history, recovered_after_crash=unclean)
