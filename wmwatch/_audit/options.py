"""The options an audit is started with, gathered once by ``Watch.audit`` or
``Watch.audit_checkpoint`` and passed on whole (each one is described at
:meth:`wmwatch.Watch.audit`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from wmwatch._audit.jumps.rules import DEFAULT_AHEAD_SECONDS, DEFAULT_JUMP_SECONDS

SINKS = ("duckdb", "parquet")
DEFAULT_MAX_ROWS_PER_BATCH = 100_000
DEFAULT_MAX_ROW_BYTES = 16 * 1024
DEFAULT_JOB_TIMEOUT_SECONDS = 900.0
DEFAULT_POOL = "wmwatch_audit"

# a function from the raw source DataFrame (read as a batch) to the rows ``events`` holds
Prepare = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class AuditOptions:
    """Every option of an audit but the query and its ``events``, with its default."""

    prepare: Prepare | Sequence[Prepare | None] | None = None
    sink: str = "duckdb"
    parquet_path: str | os.PathLike[str] | None = None
    columns: Sequence[str] | None = None
    hash_columns: Sequence[str] = ()
    hash_key: bytes | str | None = None
    event_time: str | None = None
    delay: str | float | None = None
    window: str | float | None = None
    slide: str | float | None = None
    kind: str | None = None
    pool: str = DEFAULT_POOL
    poll_interval_seconds: float = 1.0
    max_rows_per_batch: int = DEFAULT_MAX_ROWS_PER_BATCH
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES
    job_timeout_seconds: float = DEFAULT_JOB_TIMEOUT_SECONDS
    watermark_ahead_seconds: float = DEFAULT_AHEAD_SECONDS
    watermark_jump_seconds: float = DEFAULT_JUMP_SECONDS
