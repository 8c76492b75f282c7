"""Opening a history file for a report: read-only, sealed off from everything outside it except
the Parquet files the audit wrote for the batches it lists.

A history file is passed around and may come from someone else; see
:func:`wmwatch._store.files.open_readonly` for what the connection cannot do.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from wmwatch._audit.report.folders import audit_parquet_files
from wmwatch._store.files import open_readonly

if TYPE_CHECKING:
    import duckdb

__all__ = ["open_history"]


@contextlib.contextmanager
def open_history(
    path: str | os.PathLike[str], timeout: float = 5.0
) -> Iterator[duckdb.DuckDBPyConnection]:
    """A read-only connection for :func:`wmwatch._report.build.build_report` and the charts."""
    with open_readonly(path, timeout, readable_files=audit_parquet_files) as con:
        yield con
