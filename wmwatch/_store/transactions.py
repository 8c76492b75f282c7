"""The history writer's transactions: what a pending write holds (and costs in memory), and how a
chunk of pending writes is committed: in one transaction, a write that fails on its own skipped
alone, a batch DuckDB refuses kept without its progress JSON, and I/O failures raised as the
file being unavailable (to retry later)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from wmwatch._store.rows import ProgressRows, write_progress_rows
from wmwatch._text import error_line, get_logger

if TYPE_CHECKING:
    import duckdb

Write = Callable[["duckdb.DuckDBPyConnection"], None]

_log = get_logger("wmwatch.store")

# What a write costs in memory beyond its payload (closure, description, queue entry).
_WRITE_OVERHEAD_BYTES = 512
# What a progress row (batch, operator or source) costs in memory beyond its JSON text.
_PROGRESS_ROW_BYTES = 512


@dataclass(slots=True)
class Pending:
    seq: int
    description: str
    write: Write | None
    progress: ProgressRows | None = None
    size_bytes: int = _WRITE_OVERHEAD_BYTES


class Unavailable(Exception):
    """The database file cannot be opened or committed to right now (retry later)."""


def write_size_bytes(description: str, payload_bytes: int) -> int:
    """The memory a pending write holds, estimated cheaply: its payload (as its submitter
    counts it) and a fixed overhead. Estimates, not measurements: they bound memory to within
    Python's per-object overhead, which the payload estimates include per row."""
    return _WRITE_OVERHEAD_BYTES + len(description) + max(0, payload_bytes)


def progress_bytes(rows: ProgressRows) -> int:
    # the progress JSON dominates; every row also holds a dozen small Python objects
    count = 1 + len(rows.operators) + len(rows.sources)
    return len(rows.batch.progress_json or "") + count * _PROGRESS_ROW_BYTES


def rollback(con: duckdb.DuckDBPyConnection) -> None:
    with contextlib.suppress(Exception):
        con.execute("ROLLBACK")


def begin(con: duckdb.DuckDBPyConnection) -> None:
    import duckdb

    try:
        con.execute("BEGIN TRANSACTION")
    except (duckdb.Error, OSError) as exc:
        raise Unavailable(error_line(exc)) from None


def commit(con: duckdb.DuckDBPyConnection) -> None:
    import duckdb

    try:
        con.execute("COMMIT")
    except (duckdb.Error, OSError) as exc:
        rollback(con)
        raise Unavailable(error_line(exc)) from None


def run_writes(con: duckdb.DuckDBPyConnection, items: list[Pending]) -> None:
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
            write_progress_rows(con, run)
        for item in items:
            if item.progress is None and item.write is not None:
                item.write(con)
    except (duckdb.IOException, OSError) as exc:
        raise Unavailable(error_line(exc)) from None


def commit_chunk(
    con: duckdb.DuckDBPyConnection,
    chunk: list[Pending],
    *,
    failed: Callable[[str], None],
    kept_bare: Callable[[str, str], None],
) -> tuple[int, int, list[Pending], str | None]:
    """Commit ``chunk`` in one transaction; if a write is bad, skip it and commit the rest.

    ``failed(message)`` is told of each write skipped, ``kept_bare(description, why)`` of each
    batch written without its progress JSON. Returns (written, failed, not handled, why the
    database became unavailable).
    """
    try:
        begin(con)
        run_writes(con, chunk)
        commit(con)
        return len(chunk), 0, [], None
    except Unavailable as exc:
        rollback(con)
        return 0, 0, chunk, str(exc)
    except Exception:  # noqa: BLE001 - retried one write at a time below
        rollback(con)
    # Some write raised on its own: run each in its own transaction so only it is skipped.
    written = failures = 0
    for index, item in enumerate(chunk):
        try:
            begin(con)
            try:
                run_writes(con, [item])
            except Unavailable:
                raise
            except Exception as exc:  # noqa: BLE001 - one bad write is skipped and counted, never the rest
                rollback(con)
                message = error_line(exc)
                if _write_without_progress_json(con, item, message, kept_bare):
                    written += 1
                    continue
                failures += 1
                _log.error("history write %r failed and was skipped: %s", item.description, message)
                failed(message)
                continue
            commit(con)
        except Unavailable as exc:
            rollback(con)
            return written, failures, chunk[index:], str(exc)
        written += 1
    return written, failures, [], None


def _write_without_progress_json(
    con: duckdb.DuckDBPyConnection,
    item: Pending,
    why: str,
    kept_bare: Callable[[str, str], None],
) -> bool:
    """Write a batch DuckDB refused again without its progress JSON; True if it is written.

    The batch's numbers matter more than its document: a batch is never lost for its JSON.
    Raises :class:`Unavailable` when the file became unavailable meanwhile.
    """
    progress = item.progress
    if progress is None or progress.batch.progress_json is None:
        return False
    bare = replace(progress, batch=progress.batch._replace(progress_json=None))
    begin(con)
    try:
        run_writes(con, [replace(item, progress=bare)])
    except Unavailable:
        raise
    except Exception:  # noqa: BLE001 - the write is then skipped, as any failing write
        rollback(con)
        return False
    commit(con)
    kept_bare(item.description, why)
    return True
