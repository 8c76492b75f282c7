"""The audit's tables in the history database: ``late_rows``, ``late_rows_pending`` and
``audit_batches``, every write to them and the audit's own reads of them.

A batch's late rows and its ``audit_batches`` marker are written in one transaction after
deleting the batch's rows, so a batch audited twice (a retry, a restart after a crash) ends up
written once. Rows of a batch too large for one chunk are staged in ``late_rows_pending`` first
and moved with the marker.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wmwatch._audit.identities import IdentityBook, MemoryIdentityBook, SeenIdentity
from wmwatch._errors import AuditError
from wmwatch._text import redact

if TYPE_CHECKING:
    import duckdb

    from wmwatch._core.plugins import HistoryAccess


def local_path(location: str) -> str | None:
    """The local path of an audit folder (``file:`` URIs and plain paths); None for another
    file system (HDFS, an object store), which keeps its own permissions and is not listed."""
    if location.startswith("file:"):
        return re.sub(r"^file:(//)?", "", location)
    return None if re.match(r"^[A-Za-z][\w+.-]*://", location) else location


# The columns of a late row as the replay hands it over, in this order.
LATE_ROW_COLUMNS = (
    "event_time_us",
    "window_start_us",
    "window_end_us",
    "source_file",
    "row_data",
    "operator_kind",
    "operator_index",
    "join_side",
    "source_index",
    "join_key",
)
_LATE_ROW_TYPES = (
    "BIGINT",
    "BIGINT",
    "BIGINT",
    "VARCHAR",
    "VARCHAR",
    "VARCHAR",
    "INTEGER",
    "VARCHAR",
    "INTEGER",
    "VARCHAR",
)
# Bytes a late row costs besides row_data (three longs, the source path, Python objects).
LATE_ROW_OVERHEAD_BYTES = 256
_EPOCH_SQL = "(TIMESTAMPTZ '1970-01-01 00:00:00+00' + to_microseconds({}))"

LateRow = tuple[Any, ...]


def late_rows_bytes(rows: list[LateRow] | None) -> int:
    """About the memory ``rows`` hold: their text values and a fixed cost per row (cheap: one
    ``len`` per value, next to the Spark job that fetched them)."""
    if not rows:
        return 0
    text = sum(len(value) for row in rows for value in row if isinstance(value, str))
    return text + len(rows) * LATE_ROW_OVERHEAD_BYTES


@dataclass(frozen=True, slots=True)
class InputCount:
    """The late rows one input of a batch lost: its operator, join side and source."""

    operator_index: int
    kind: str
    side: str | None
    source_index: int
    rows: int | None
    # why this input's rows could not be read again; rows is then Spark's own count of what its
    # operator dropped (None where Spark's count covers other inputs too, or is unknown)
    payload_missing: str | None = None

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "operator_index": self.operator_index,
            "kind": self.kind,
            "side": self.side,
            "source_index": self.source_index,
            "rows": self.rows,
        }
        if self.payload_missing is not None:
            out["payload_missing"] = self.payload_missing
        return out


@dataclass(frozen=True)
class BatchLateRows:
    """What the replay of one batch found, and where its rows are.

    ``rows``: the late rows themselves, when they fit one chunk (written with the marker).
    ``attempt``/``staged``: rows staged in ``late_rows_pending`` by that attempt.
    ``overflow_location``: a Parquet folder holding every late row of the batch.
    """

    total: int
    rows: list[LateRow] | None = None
    attempt: str | None = None
    staged: int = 0
    overflow_location: str | None = None
    parquet_location: str | None = None
    replayed: bool = True
    # every late row found, per input (operator, side, source): see :func:`input_counts`
    by_input: tuple[InputCount, ...] = ()
    # rows the batch kept although the watermark it reported had passed them (None: not counted)
    kept_behind_watermark: int | None = None

    @classmethod
    def nothing(cls) -> BatchLateRows:
        return cls(total=0, replayed=False)

    @classmethod
    def all_in_parquet(cls, count: int, location: str) -> BatchLateRows:
        return cls(total=count, parquet_location=location)

    @property
    def kept(self) -> int | None:
        """Rows of the batch in ``late_rows`` (None: the Parquet sink keeps them)."""
        if self.parquet_location is not None:
            return None
        return len(self.rows) if self.rows is not None else self.staged

    @property
    def over_cap(self) -> int:
        kept = self.kept
        return 0 if kept is None else max(0, self.total - kept)


class AuditHistory:
    """One query's audit tables, reached through the watch's history store."""

    def __init__(self, store: HistoryAccess, *, query_id: str, label: str) -> None:
        self._store = store
        self.query_id = query_id
        self.label = label
        self._identities: IdentityBook | None = None

    def drop_interrupted_replays(self) -> None:
        """Delete rows a crashed replay staged; the audit replays those batches again."""
        query_id = self.query_id

        def write(con: duckdb.DuckDBPyConnection) -> None:
            con.execute("DELETE FROM late_rows_pending WHERE query_id = ?", [query_id])

        self._store.submit(
            write, description=f"audit {self.label}: drop rows of interrupted replays"
        )

    def last_audited_batch(self) -> int | None:
        """The query's newest batch marked as audited (where the audit resumes); None when
        none is. One number, however long the history."""
        query_id = self.query_id

        def read(con: duckdb.DuckDBPyConnection) -> int | None:
            row = con.execute(
                "SELECT max(batch_id) FROM audit_batches WHERE query_id = ?", [query_id]
            ).fetchone()
            return None if row is None or row[0] is None else int(row[0])

        return self._store.read(read, timeout=30)

    def identity_book(self) -> IdentityBook:
        """What earlier audits of the query saw of its sources' identities (Kafka topic ids),
        kept in ``audit_source_identities`` as this audit sees them change; read once, then the
        same book for every caller (the start's checks and the audit's loop)."""
        if self._identities is not None:
            return self._identities
        query_id = self.query_id

        def read(con: duckdb.DuckDBPyConnection) -> list[tuple[Any, ...]]:
            return con.execute(
                "SELECT source_index, name, identity, since_batch, replaced "
                "FROM audit_source_identities WHERE query_id = ?",
                [query_id],
            ).fetchall()

        rows = self._store.read(read, timeout=30)
        self._identities = _HistoryIdentityBook(
            self._store,
            query_id,
            self.label,
            {
                (int(index), str(name)): SeenIdentity(str(identity), int(since), bool(replaced))
                for index, name, identity, since, replaced in rows
            },
        )
        return self._identities

    def stage(
        self, batch_id: int, attempt: str, rows: list[LateRow], *, timeout_seconds: float
    ) -> int:
        """Write one chunk to ``late_rows_pending`` and wait until it is on disk.

        Waiting keeps at most one chunk in the driver: when the history file is unavailable the
        replay fails here (and is retried later) instead of piling chunks up in memory.
        """
        self._store.submit(
            _pending_writer(self.query_id, batch_id, attempt, rows),
            description=f"audit {self.label} batch {batch_id}: {len(rows)} staged rows",
            payload_bytes=late_rows_bytes(rows),
        )
        if not self.flush(timeout_seconds):
            raise AuditError(
                f"the history file did not take the late rows of batch {batch_id} in time "
                f"({self._last_error() or 'writer busy'}); retrying later"
            )
        return len(rows)

    def commit(
        self,
        *,
        query_name: str | None,
        run_id: str | None,
        batch_id: int,
        late_wm_ms: int | None,
        found: BatchLateRows,
        sink: str,
    ) -> None:
        """Queue the write of one audited batch: its late rows and its marker, together."""
        write = _batch_writer(
            query_id=self.query_id,
            query_name=query_name,
            run_id=run_id,
            batch_id=batch_id,
            late_wm_ms=late_wm_ms,
            found=found,
            sink=sink,
        )
        self._store.submit(
            write,
            description=f"audit {self.label} batch {batch_id}",
            payload_bytes=late_rows_bytes(found.rows),
        )

    def flush(self, timeout_seconds: float) -> bool:
        """Wait until every write queued so far is in the file; True if it was."""
        return self._store.flush(timeout=timeout_seconds)

    def _last_error(self) -> str | None:
        return self._store.health.last_error


class _HistoryIdentityBook(MemoryIdentityBook):
    """The identities in memory, each change also written to the history (queued, as every
    write of the audit's)."""

    def __init__(
        self,
        store: HistoryAccess,
        query_id: str,
        label: str,
        seeded: dict[tuple[int, str], SeenIdentity],
    ) -> None:
        super().__init__(seeded)
        self._store = store
        self._query_id = query_id
        self._label = label

    def record(self, source_index: int, name: str, seen: SeenIdentity) -> None:
        super().record(source_index, name, seen)
        row = [self._query_id, source_index, name, seen.identity, seen.since_batch, seen.replaced]

        def write(con: duckdb.DuckDBPyConnection) -> None:
            con.execute(
                "INSERT OR REPLACE INTO audit_source_identities (query_id, source_index, name, "
                "identity, since_batch, replaced, seen_at) VALUES (?, ?, ?, ?, ?, ?, now())",
                row,
            )

        self._store.submit(write, description=f"audit {self._label}: identity of {name}")


def _rows_as_table(first_param: int) -> str:
    """SQL for late-row tuples passed as five column lists from parameter ``first_param`` on.

    One statement that unnests column lists is far faster than executemany for many rows.
    """
    return "SELECT " + ", ".join(
        f"unnest(${first_param + i}::{kind}[]) AS {name}"
        for i, (name, kind) in enumerate(zip(LATE_ROW_COLUMNS, _LATE_ROW_TYPES, strict=True))
    )


def _columns(rows: list[LateRow]) -> list[list[Any]]:
    if not rows:
        return [[] for _ in LATE_ROW_COLUMNS]
    return [list(column) for column in zip(*rows, strict=True)]


def _pending_writer(
    query_id: str, batch_id: int, attempt: str, rows: list[LateRow]
) -> Callable[[duckdb.DuckDBPyConnection], None]:
    """Stage one chunk of a batch's late rows (moved into late_rows with the batch's marker)."""
    columns = _columns(rows)
    names = ", ".join(LATE_ROW_COLUMNS)

    def write(con: duckdb.DuckDBPyConnection) -> None:
        con.execute(
            f"INSERT INTO late_rows_pending (query_id, batch_id, attempt, {names}) "
            f"SELECT $1, $2, $3, {names} FROM ({_rows_as_table(4)})",
            [query_id, batch_id, attempt, *columns],
        )

    return write


_LATE_ROWS_INSERT = (
    "INSERT INTO late_rows (query_id, query_name, run_id, batch_id, event_time_at, watermark_at, "
    "lateness_seconds, window_start_at, window_end_at, operator_kind, source_file, row_data, "
    "audited_at, operator_index, join_side, source_index, join_key) "
    "SELECT $1, $2, $3, $4, "
    f"{_EPOCH_SQL.format('r.event_time_us')}, {_EPOCH_SQL.format('$5::BIGINT')}, "
    "($5::BIGINT - r.event_time_us) / 1e6, "
    f"{_EPOCH_SQL.format('r.window_start_us')}, {_EPOCH_SQL.format('r.window_end_us')}, "
    "r.operator_kind, r.source_file, r.row_data::JSON, now(), r.operator_index, r.join_side, "
    "r.source_index, r.join_key FROM ({}) AS r"
)


def _batch_writer(
    *,
    query_id: str,
    query_name: str | None,
    run_id: str | None,
    batch_id: int,
    late_wm_ms: int | None,
    found: BatchLateRows,
    sink: str,
) -> Callable[[duckdb.DuckDBPyConnection], None]:
    """An idempotent write of one audited batch: its late rows and its marker, together.

    Rows come from ``found.rows`` or, for a batch staged chunk by chunk, from the pending rows
    of ``found.attempt`` (other attempts' rows are a crashed replay's and are dropped here).
    """
    wm_us = None if late_wm_ms is None else late_wm_ms * 1000
    # $1-$5 describe the batch; the rows' own parameters follow from $6
    params = [query_id, query_name, run_id, batch_id, wm_us]
    pending = ", ".join(LATE_ROW_COLUMNS)

    def write(con: duckdb.DuckDBPyConnection) -> None:
        con.execute(
            "DELETE FROM late_rows WHERE query_id = ? AND batch_id = ?", [query_id, batch_id]
        )
        if found.rows:
            con.execute(
                _LATE_ROWS_INSERT.format(_rows_as_table(len(params) + 1)),
                [*params, *_columns(found.rows)],
            )
        elif found.attempt is not None and found.staged:
            con.execute(
                _LATE_ROWS_INSERT.format(
                    f"SELECT {pending} FROM late_rows_pending "
                    "WHERE query_id = $1 AND batch_id = $4 AND attempt = $6"
                ),
                [*params, found.attempt],
            )
        con.execute(
            "DELETE FROM late_rows_pending WHERE query_id = ? AND batch_id = ?",
            [query_id, batch_id],
        )
        con.execute(
            "INSERT OR REPLACE INTO audit_batches (query_id, batch_id, run_id, late_watermark_at, "
            "late_rows, sink, location, audited_at, rows_kept, rows_over_cap, overflow_location, "
            "late_rows_by_input, rows_kept_behind_watermark) "
            f"VALUES (?, ?, ?, {_EPOCH_SQL.format('?::BIGINT')}, ?, ?, ?, now(), ?, ?, ?, ?, ?)",
            [
                query_id,
                batch_id,
                run_id,
                wm_us,
                found.total,
                sink,
                _location(found.parquet_location),
                found.kept,
                found.over_cap,
                _location(found.overflow_location),
                json.dumps([c.as_json() for c in found.by_input]) if found.by_input else None,
                found.kept_behind_watermark,
            ],
        )

    return write


def _location(path: str | None) -> str | None:
    """A Parquet folder as the history keeps it: credentials in its URL masked (the report
    reads it again with the credentials Spark or Hadoop is configured with, not these)."""
    return None if path is None else redact(path)
