"""The audit's Parquet folders as a report reads them: which batch folders the history lists,
which files in them may be read (never outside the audit's own folder shape), and how the
Parquet sink's columns map onto the ``late_rows`` table."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from wmwatch._audit.sinks import local_path
from wmwatch._errors import StoreError

if TYPE_CHECKING:
    import duckdb


# The Parquet sink stores instants as integer microseconds (time-zone free); the table has
# TIMESTAMPTZ columns of the same names with ``_at``.
PARQUET_MICROS_COLUMNS = {
    "event_time_at": "event_time_us",
    "watermark_at": "watermark_us",
    "window_start_at": "window_start_us",
    "window_end_at": "window_end_us",
    "audited_at": "audited_at_us",
}


def parquet_late_column(column: str, present: Iterable[str]) -> str:
    """SQL that yields ``late_rows.column`` from an audit Parquet file with columns ``present``."""
    have = set(present)
    if column in have:
        return column
    micros = PARQUET_MICROS_COLUMNS.get(column)
    if micros is not None and micros in have:
        return f"(TIMESTAMPTZ '1970-01-01 00:00:00+00' + to_microseconds({micros})) AS {column}"
    return f"NULL AS {column}"


# The folder the audit writes one batch's Parquet rows to: <parquet_path>/<query id>/batch-<n>
# (see Replayer.parquet_dir, which names them)
_BATCH_FOLDER = re.compile(r"batch-\d{12}")


def audit_folder(location: str, query_id: str) -> Path | None:
    """The local folder the audit wrote for one batch of ``query_id`` (None: another file system).

    A history file may come from someone else: a location not shaped like the audit's own
    folders (``/``, a home folder) is refused with :class:`StoreError` rather than read.
    """
    local = local_path(location)
    if local is None:
        return None
    path = Path(local)
    if (
        not _BATCH_FOLDER.fullmatch(path.name)
        or query_id in ("", ".", "..")
        or path.parent.name != query_id
        # Spark makes both folders: a link there points somewhere the audit never wrote
        or path.is_symlink()
        or path.parent.is_symlink()
    ):
        shown = repr(location[:120])
        raise StoreError(
            f"the history lists {shown} as the Parquet folder of a batch of {query_id[:60]!r}, "
            "but the audit writes only <parquet_path>/<query id>/batch-<n>: the file was "
            "altered, so it is not read; pass a history file written by wmwatch"
        )
    return path


def parquet_files(folder: Path) -> list[str]:
    """The Parquet files Spark wrote in one batch folder: regular files only, no links, no
    subfolders, so nothing outside the folder is read."""
    try:
        with os.scandir(folder) as entries:
            return sorted(
                entry.path
                for entry in entries
                if entry.name.endswith(".parquet") and entry.is_file(follow_symlinks=False)
            )
    except (FileNotFoundError, NotADirectoryError):
        return []


def parquet_locations(
    con: duckdb.DuckDBPyConnection, query_ids: Iterable[str] | None
) -> list[tuple[str, str]]:
    rows = con.execute(
        """
        SELECT DISTINCT query_id, coalesce(overflow_location, location) FROM audit_batches
        WHERE (sink = 'parquet' AND location IS NOT NULL OR overflow_location IS NOT NULL)
          AND ($1::VARCHAR[] IS NULL OR query_id IN (SELECT unnest($1::VARCHAR[])))
        ORDER BY ALL
        """,
        (None if query_ids is None else list(query_ids),),
    ).fetchall()
    return [(str(qid), str(location)) for qid, location in rows]


def audit_parquet_files(con: duckdb.DuckDBPyConnection) -> list[str]:
    """Every Parquet file of the audit's batch folders that the history lists (for
    :func:`wmwatch._store.files.open_readonly`'s ``readable_files``)."""
    files: list[str] = []
    for query_id, location in parquet_locations(con, None):
        folder = audit_folder(location, query_id)
        if folder is not None:
            files.extend(parquet_files(folder))
    return files


def readable_files(con: duckdb.DuckDBPyConnection) -> set[str] | None:
    """The outside files a sealed connection may read (None: it may read any)."""
    row = con.execute(
        "SELECT current_setting('enable_external_access'), current_setting('allowed_paths')"
    ).fetchone()
    if row is None or row[0]:
        return None
    return {str(path) for path in row[1] or ()}
