"""The DuckDB history schema, its migrations and its retention.

The schema is versioned in ``wmwatch_schema``. Migrations are append-only: version N is applied
once, in a transaction, to a database at version N-1. A database written by a newer wmwatch than
this one is refused with a clear error instead of being read wrongly. docs/history.md documents
every table; keep both in step. Over 500 lines because each version's tables and the migration
to it stay side by side in one file, so that the schema a file ends up with is read in one place.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from wmwatch._errors import ConfigError, StoreError

if TYPE_CHECKING:
    import duckdb


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    description: str
    statements: Sequence[str]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "queries, batches, operators, sources, late_rows, audit_batches, findings",
        (
            """
            CREATE TABLE IF NOT EXISTS queries (
                query_id        VARCHAR NOT NULL,
                run_id          VARCHAR NOT NULL,
                query_name      VARCHAR,
                status          VARCHAR NOT NULL,      -- active | terminated | failed
                started_at      TIMESTAMPTZ,
                terminated_at   TIMESTAMPTZ,
                exception       VARCHAR,
                error_class     VARCHAR,
                last_batch_id   BIGINT,
                last_progress_at TIMESTAMPTZ,
                PRIMARY KEY (query_id, run_id)
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS batches (
                query_id            VARCHAR NOT NULL,
                batch_id            BIGINT NOT NULL,
                run_id              VARCHAR NOT NULL,
                query_name          VARCHAR,
                batch_at            TIMESTAMPTZ,        -- trigger start (progress "timestamp")
                watermark_at        TIMESTAMPTZ,        -- watermark computed for this batch
                -- watermark the late-row filter used: the previous batch's
                late_watermark_at   TIMESTAMPTZ,
                event_time_max_at   TIMESTAMPTZ,
                event_time_min_at   TIMESTAMPTZ,
                event_time_avg_at   TIMESTAMPTZ,
                watermark_lag_seconds   DOUBLE,         -- batch_at - watermark_at
                event_time_delay_seconds DOUBLE,        -- event_time_max_at - watermark_at
                input_rows          BIGINT,
                input_rows_per_second     DOUBLE,
                processed_rows_per_second DOUBLE,
                batch_duration_seconds    DOUBLE,
                durations_seconds   JSON,               -- {"addBatch": 0.12, "getBatch": 0.01, ...}
                -- sum over operators (groups for aggregations)
                rows_dropped_by_watermark BIGINT,
                state_rows_total    BIGINT,
                state_memory_bytes  BIGINT,
                sink_output_rows    BIGINT,
                progress_json       JSON,
                recorded_at         TIMESTAMPTZ NOT NULL,
                PRIMARY KEY (query_id, batch_id)
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS operators (
                query_id        VARCHAR NOT NULL,
                batch_id        BIGINT NOT NULL,
                -- index in stateOperators; 0 is the most downstream
                operator_id     INTEGER NOT NULL,
                operator_name   VARCHAR,
                rows_total      BIGINT,
                rows_updated    BIGINT,
                rows_removed    BIGINT,
                rows_dropped_by_watermark BIGINT,
                memory_used_bytes BIGINT,
                shuffle_partitions INTEGER,
                state_store_instances INTEGER,
                custom_metrics  JSON,
                PRIMARY KEY (query_id, batch_id, operator_id)
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS sources (
                query_id        VARCHAR NOT NULL,
                batch_id        BIGINT NOT NULL,
                source_index    INTEGER NOT NULL,       -- matches the checkpoint's sources/<index>
                description     VARCHAR,
                start_offset    VARCHAR,
                end_offset      VARCHAR,
                input_rows      BIGINT,
                input_rows_per_second     DOUBLE,
                processed_rows_per_second DOUBLE,
                PRIMARY KEY (query_id, batch_id, source_index)
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS late_rows (
                query_id        VARCHAR NOT NULL,
                query_name      VARCHAR,
                run_id          VARCHAR,
                batch_id        BIGINT NOT NULL,        -- production batch that dropped the row
                event_time_at   TIMESTAMPTZ,
                watermark_at    TIMESTAMPTZ,            -- the late-row watermark that dropped it
                lateness_seconds DOUBLE,                -- watermark_at - event_time_at
                -- windowed aggregations: the window it missed
                window_start_at TIMESTAMPTZ,
                window_end_at   TIMESTAMPTZ,
                operator_kind   VARCHAR,                -- predicates.KINDS: window, join, ...
                source_file     VARCHAR,
                -- the row's own columns (allow-listed, hashed)
                row_data        JSON,
                audited_at      TIMESTAMPTZ NOT NULL
            )
            """,
            "CREATE INDEX IF NOT EXISTS late_rows_batch ON late_rows (query_id, batch_id)",
            """
            CREATE TABLE IF NOT EXISTS audit_batches (
                query_id        VARCHAR NOT NULL,
                batch_id        BIGINT NOT NULL,
                run_id          VARCHAR,
                late_watermark_at TIMESTAMPTZ,
                late_rows       BIGINT NOT NULL,
                sink            VARCHAR NOT NULL,       -- duckdb | parquet
                location        VARCHAR,                -- parquet directory of this batch, if any
                audited_at      TIMESTAMPTZ NOT NULL,
                PRIMARY KEY (query_id, batch_id)
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS findings (
                finding_id      VARCHAR PRIMARY KEY,    -- stable: query, operator, side and kind
                query_id        VARCHAR NOT NULL,
                query_name      VARCHAR,
                operator_id     INTEGER,
                side            VARCHAR,                -- left | right | NULL
                -- join_state_unbounded, watermark_stalled, ...
                kind            VARCHAR NOT NULL,
                severity        VARCHAR NOT NULL,       -- warning | critical
                status          VARCHAR NOT NULL,       -- active | resolved
                message         VARCHAR NOT NULL,
                evidence        JSON,
                fix             VARCHAR,
                first_seen_at   TIMESTAMPTZ NOT NULL,
                last_seen_at    TIMESTAMPTZ NOT NULL,
                first_batch_id  BIGINT,
                last_batch_id   BIGINT,
                occurrences     BIGINT NOT NULL DEFAULT 1
            )
            """,
        ),
    ),
    Migration(
        2,
        "operator_watermarks, source_watermarks",
        (
            """
            CREATE TABLE IF NOT EXISTS operator_watermarks (
                query_id        VARCHAR NOT NULL,
                batch_id        BIGINT NOT NULL,
                -- stateful operator id; 0 is the most downstream
                operator_id     INTEGER NOT NULL,
                operator_name   VARCHAR,
                late_watermark_at     TIMESTAMPTZ,      -- input watermark for late rows
                eviction_watermark_at TIMESTAMPTZ,      -- input watermark for eviction and output
                recorded_at     TIMESTAMPTZ NOT NULL,
                PRIMARY KEY (query_id, batch_id, operator_id)
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS source_watermarks (
                query_id        VARCHAR NOT NULL,
                batch_id        BIGINT NOT NULL,
                node_id         VARCHAR NOT NULL,       -- the withWatermark node's id in the plan
                -- the input(s) under it, as progress names them
                source          VARCHAR,
                event_time_column VARCHAR,
                delay_seconds   DOUBLE,
                -- this input's own watermark (max event time - delay)
                watermark_at    TIMESTAMPTZ,
                -- max event time this input has seen in the run
                event_time_max_at TIMESTAMPTZ,
                -- consecutive batches in which it read nothing
                idle_batches    INTEGER,
                holding_back    BOOLEAN,                -- the global watermark is waiting for it
                -- multipleWatermarkPolicy in force: min | max
                policy          VARCHAR,
                recorded_at     TIMESTAMPTZ NOT NULL,
                PRIMARY KEY (query_id, batch_id, node_id)
            )
            """,
        ),
    ),
    Migration(
        3,
        "late_rows_pending; audit_batches.rows_kept, rows_over_cap, overflow_location",
        (
            # A batch whose late rows are too many for one transaction is staged here chunk by
            # chunk and moved into late_rows together with its audit_batches marker; rows of an
            # attempt that a crash interrupted are deleted when the audit starts again.
            """
            CREATE TABLE IF NOT EXISTS late_rows_pending (
                query_id        VARCHAR NOT NULL,
                batch_id        BIGINT NOT NULL,
                attempt         VARCHAR NOT NULL,       -- one replay of the batch
                event_time_us   BIGINT,
                window_start_us BIGINT,
                window_end_us   BIGINT,
                source_file     VARCHAR,
                row_data        VARCHAR
            )
            """,
            # late_rows counts every late row found; rows_kept of them are in late_rows, the
            # rest (rows_over_cap) are counted only, or kept in Parquet under overflow_location
            "ALTER TABLE audit_batches ADD COLUMN IF NOT EXISTS rows_kept BIGINT",
            "ALTER TABLE audit_batches ADD COLUMN IF NOT EXISTS rows_over_cap BIGINT",
            "ALTER TABLE audit_batches ADD COLUMN IF NOT EXISTS overflow_location VARCHAR",
        ),
    ),
    Migration(
        4,
        "late rows per operator, join side and source; audit_batches.late_rows_by_input",
        (
            # operator_index is the operator's position in the progress' stateOperators;
            # join_side is left | right for a stream-stream join's input; join_key holds the
            # row's equi-join key values (JSON), the match it lost
            "ALTER TABLE late_rows ADD COLUMN IF NOT EXISTS operator_index INTEGER",
            "ALTER TABLE late_rows ADD COLUMN IF NOT EXISTS join_side VARCHAR",
            "ALTER TABLE late_rows ADD COLUMN IF NOT EXISTS source_index INTEGER",
            "ALTER TABLE late_rows ADD COLUMN IF NOT EXISTS join_key VARCHAR",
            "ALTER TABLE late_rows_pending ADD COLUMN IF NOT EXISTS operator_kind VARCHAR",
            "ALTER TABLE late_rows_pending ADD COLUMN IF NOT EXISTS operator_index INTEGER",
            "ALTER TABLE late_rows_pending ADD COLUMN IF NOT EXISTS join_side VARCHAR",
            "ALTER TABLE late_rows_pending ADD COLUMN IF NOT EXISTS source_index INTEGER",
            "ALTER TABLE late_rows_pending ADD COLUMN IF NOT EXISTS join_key VARCHAR",
            # every late row found, per input: [{operator_index, kind, side, source_index, rows}]
            "ALTER TABLE audit_batches ADD COLUMN IF NOT EXISTS late_rows_by_input JSON",
        ),
    ),
    Migration(
        5,
        "each run's trigger; rows a batch kept behind the watermark it reported",
        (
            # processing_time | real_time | available_now | once | continuous | unknown, and its
            # interval (real time: the checkpoint interval, the length of one batch)
            "ALTER TABLE queries ADD COLUMN IF NOT EXISTS trigger VARCHAR",
            "ALTER TABLE queries ADD COLUMN IF NOT EXISTS trigger_interval_ms BIGINT",
            # rows the batch aggregated or kept although the watermark it reported had passed
            # them (they were judged against the batch before's): counted by the audit's replay
            "ALTER TABLE audit_batches ADD COLUMN IF NOT EXISTS rows_kept_behind_watermark BIGINT",
        ),
    ),
    Migration(
        6,
        "watermark_jumps and watermark_jump_rows: who moved the watermark, and what it cost",
        (
            # a batch whose event time ran ahead of its own time, or that moved the watermark
            # far ahead (found by the audit, see wmwatch._audit.jumps.watch)
            """
            CREATE TABLE IF NOT EXISTS watermark_jumps (
                query_id            VARCHAR NOT NULL,
                batch_id            BIGINT NOT NULL,    -- the batch that read the rows
                run_id              VARCHAR,
                query_name          VARCHAR,
                batch_at            TIMESTAMPTZ,        -- its progress "timestamp"
                event_time_max_at   TIMESTAMPTZ,
                ahead_seconds       DOUBLE,             -- event_time_max_at - batch_at
                watermark_before_at TIMESTAMPTZ,        -- offsets/batch_id: judged batch_id + 1
                watermark_after_at  TIMESTAMPTZ,        -- offsets/batch_id + 1: the one it set
                jump_seconds        DOUBLE,             -- after - before, when flagged a jump
                jump_batch_id       BIGINT,             -- the batch whose watermark jumped
                reasons             VARCHAR,            -- ahead | jump | ahead,jump
                source_index        INTEGER,            -- the input of the top row
                source_description  VARCHAR,
                rows_error          VARCHAR,            -- why the rows could not be read
                -- late rows of the batches since (to the next jump) that the watermark
                -- before would have kept and the one it set dropped
                rows_dropped_since  BIGINT,
                counted_through_batch BIGINT,
                recorded_at         TIMESTAMPTZ NOT NULL,
                PRIMARY KEY (query_id, batch_id)
            )
            """,
            """
            CREATE TABLE IF NOT EXISTS watermark_jump_rows (
                query_id        VARCHAR NOT NULL,
                batch_id        BIGINT NOT NULL,
                row_rank        INTEGER NOT NULL,       -- 1: the largest event time
                event_time_at   TIMESTAMPTZ,
                source_index    INTEGER,
                source_file     VARCHAR,
                kafka_topic     VARCHAR,
                kafka_partition INTEGER,
                kafka_offset    BIGINT,
                row_data        JSON,                   -- columns= / hash_columns= applied
                PRIMARY KEY (query_id, batch_id, row_rank)
            )
            """,
        ),
    ),
    Migration(
        7,
        "history read from a checkpoint: batches.committed, checkpoint_reads",
        (
            # commits/N exists; NULL for a batch the listener recorded (Spark reports a batch's
            # progress only after committing it)
            "ALTER TABLE batches ADD COLUMN IF NOT EXISTS committed BOOLEAN",
            # one row per checkpoint read into the history: how far back it reached
            """
            CREATE TABLE IF NOT EXISTS checkpoint_reads (
                query_id        VARCHAR NOT NULL,
                checkpoint      VARCHAR NOT NULL,       -- the path as given
                read_at         TIMESTAMPTZ NOT NULL,
                oldest_offsets_batch BIGINT,            -- oldest offsets/N still there
                latest_offsets_batch BIGINT,
                oldest_commit_batch  BIGINT,            -- oldest commits/N still there
                latest_commit_batch  BIGINT,
                -- oldest batch whose state every operator can still load
                oldest_state_batch   BIGINT,
                min_batches_to_retain INTEGER,          -- spark.sql.streaming.minBatchesToRetain
                batches_written BIGINT,                 -- batches this read added or replaced
                batches_kept    BIGINT,                 -- batches the listener had recorded
                state_batches_counted BIGINT,           -- batches whose state rows were counted
                PRIMARY KEY (query_id, checkpoint)
            )
            """,
        ),
    ),
    Migration(
        8,
        "audit_source_identities: the identity of each source the checkpoint does not record",
        (
            # one row per source and name (a Kafka topic): the identity the audit last saw
            # (the broker's topic id) and the first batch planned after it saw it; a later
            # audit compares the source with it (see wmwatch._audit.replay.sources.kafka)
            """
            CREATE TABLE IF NOT EXISTS audit_source_identities (
                query_id        VARCHAR NOT NULL,
                source_index    INTEGER NOT NULL,
                name            VARCHAR NOT NULL,       -- a Kafka topic
                identity        VARCHAR NOT NULL,       -- its topic id
                since_batch     BIGINT NOT NULL,        -- first batch planned after it was seen
                replaced        BOOLEAN NOT NULL,       -- another identity was seen first
                seen_at         TIMESTAMPTZ NOT NULL,
                PRIMARY KEY (query_id, source_index, name)
            )
            """,
        ),
    ),
)

LATEST_VERSION = MIGRATIONS[-1].version

VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS wmwatch_schema (
    version     INTEGER NOT NULL,
    description VARCHAR,
    applied_at  TIMESTAMPTZ NOT NULL DEFAULT now()
)
"""


def schema_version(
    con: duckdb.DuckDBPyConnection, path: Path | str, *, reading: bool = False
) -> int:
    """The schema version of the open database (0 for an empty one that is being written).

    Raises :class:`StoreError` when the database is not a wmwatch history (for a reader, an
    empty database is not one either) or was written by a newer wmwatch than this one.
    """
    # every schema: a database whose tables all live outside "main" is another application's
    # as much as one with tables in it
    tables = {
        (str(schema), str(name))
        for schema, name in con.execute(
            "SELECT table_schema, table_name FROM information_schema.tables "
            "WHERE table_catalog = current_database()"
        ).fetchall()
    }
    if ("main", "wmwatch_schema") not in tables:
        if reading:
            raise StoreError(
                f"{path} is not a wmwatch history database: move it aside or pass another --db"
            )
        if tables or _other_schemas(con):
            raise StoreError(
                f"{path} is a DuckDB database of another application, not a wmwatch history: "
                "pass another --db"
            )
        return 0
    row = con.execute("SELECT coalesce(max(version), 0) FROM wmwatch_schema").fetchone()
    version = int(row[0]) if row else 0
    if version > LATEST_VERSION:
        remedy = "upgrade wmwatch to read it" if reading else "upgrade wmwatch or pass another --db"
        raise StoreError(
            f"{path} was written by a newer wmwatch (schema v{version}, this one knows "
            f"v{LATEST_VERSION}): {remedy}"
        )
    return version


def _other_schemas(con: duckdb.DuckDBPyConnection) -> bool:
    """Whether the open database has a schema besides "main" (wmwatch makes none)."""
    row = con.execute(
        "SELECT count(*) FROM duckdb_schemas() "
        "WHERE database_name = current_database() AND NOT internal AND schema_name <> 'main'"
    ).fetchone()
    return bool(row and row[0])


_ADD_COLUMN = re.compile(
    r"^\s*ALTER TABLE (\w+) ADD COLUMN IF NOT EXISTS (\w+) (.+?)\s*$", re.S | re.I
)
_CREATE_TABLE = re.compile(r"^\s*CREATE TABLE IF NOT EXISTS (\w+)", re.I)


def read_as_latest(con: duckdb.DuckDBPyConnection, version: int) -> None:
    """Make a read-only connection to a history of schema ``version`` read like the latest one.

    A reader cannot migrate the file (a job may be writing it, and reading must change
    nothing), so each later migration is mirrored in the connection's temporary catalog, which
    DuckDB resolves first: a new table is an empty temporary table, and a table that gained
    columns is a temporary view of the stored table with those columns as NULL.
    """
    added: dict[str, list[tuple[str, str]]] = {}
    created: set[str] = set()
    for migration in MIGRATIONS:
        if migration.version <= version:
            continue
        for statement in migration.statements:
            table = _CREATE_TABLE.match(statement)
            if table:
                con.execute(_CREATE_TABLE.sub("CREATE TEMP TABLE IF NOT EXISTS \\1", statement))
                created.add(table.group(1))
                continue
            column = _ADD_COLUMN.match(statement)
            if column is None:
                continue  # indexes: nothing to read
            name, col, kind = column.groups()
            if name in created:
                con.execute(statement)
            else:
                added.setdefault(name, []).append((col, kind))
    row = con.execute("SELECT current_database()").fetchone()
    catalog = str(row[0]).replace('"', '""') if row else "main"
    for name, columns in added.items():
        extra = ", ".join(f"NULL::{kind} AS {col}" for col, kind in columns)
        con.execute(f'CREATE TEMP VIEW {name} AS SELECT *, {extra} FROM "{catalog}".main.{name}')


def migrate(con: duckdb.DuckDBPyConnection, path: Path | str) -> int:
    """Bring the database to :data:`LATEST_VERSION`; return the version it was at."""
    version = schema_version(con, path)
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
            with contextlib.suppress(Exception):
                con.execute("ROLLBACK")
            raise
    return version


def days_to_keep(retention_days: float | None) -> float | None:
    """The days of history to keep, or None to keep everything (``None`` or ``math.inf``)."""
    if retention_days is None or retention_days == math.inf:
        return None
    if not retention_days > 0:  # NaN too
        raise ConfigError(
            f"retention_days={retention_days!r}: pass a positive number of days of history to "
            "keep, or None to keep all history"
        )
    return float(retention_days)


def apply_retention(con: duckdb.DuckDBPyConnection, *, cutoff_epoch_seconds: float) -> int:
    """Delete history recorded before the cutoff; returns the number of rows deleted.

    Operators, sources and late rows still staged for a batch (an interrupted replay's, whose
    audit never resumed) go with their batch; late rows and audit batches by their audit time;
    operator and input watermarks by the time they were recorded; resolved findings by their
    last sighting. Query lifecycle rows are kept (one per run). Parquet overflow folders are the
    user's: they are never deleted.
    """
    cutoff = datetime.fromtimestamp(cutoff_epoch_seconds, UTC)
    statements = (
        """DELETE FROM operators o USING batches b
           WHERE o.query_id = b.query_id AND o.batch_id = b.batch_id AND b.batch_at < ?""",
        """DELETE FROM sources s USING batches b
           WHERE s.query_id = b.query_id AND s.batch_id = b.batch_id AND b.batch_at < ?""",
        """DELETE FROM late_rows_pending p USING batches b
           WHERE p.query_id = b.query_id AND p.batch_id = b.batch_id AND b.batch_at < ?""",
        "DELETE FROM batches WHERE batch_at < ?",
        "DELETE FROM late_rows WHERE audited_at < ?",
        "DELETE FROM audit_batches WHERE audited_at < ?",
        "DELETE FROM operator_watermarks WHERE recorded_at < ?",
        "DELETE FROM source_watermarks WHERE recorded_at < ?",
        "DELETE FROM findings WHERE status = 'resolved' AND last_seen_at < ?",
        """DELETE FROM watermark_jump_rows r USING watermark_jumps j
           WHERE r.query_id = j.query_id AND r.batch_id = j.batch_id AND j.recorded_at < ?""",
        "DELETE FROM watermark_jumps WHERE recorded_at < ?",
    )
    deleted = 0
    for statement in statements:
        row = con.execute(statement, (cutoff,)).fetchone()
        deleted += int(row[0]) if row else 0
    return deleted
