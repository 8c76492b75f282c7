"""The watermark-jump forensics' tables, ``watermark_jumps`` and ``watermark_jump_rows``: every
write to them (an incident and its rows, the rows it cost) and the watch's read of them.

*The cost* of the latest incident grows batch by batch: each audited batch adds the late rows
of the batches not yet counted (normally just itself) that the watermark before the jump would
have kept, so the work per batch is that batch's rows, however long the incident keeps costing
(a row dated in 2100 keeps it costing for good).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from wmwatch._audit.jumps.rules import Incident

if TYPE_CHECKING:
    import duckdb

    from wmwatch._core.plugins import HistoryAccess

_INCIDENT_COLUMNS = (
    "query_id, batch_id, run_id, query_name, batch_at, event_time_max_at, ahead_seconds, "
    "watermark_before_at, watermark_after_at, jump_seconds, jump_batch_id, reasons, "
    "source_index, source_description, rows_error, recorded_at"
)
_MS = "(TIMESTAMPTZ '1970-01-01 00:00:00+00' + to_milliseconds(?::BIGINT))"
_US = "(TIMESTAMPTZ '1970-01-01 00:00:00+00' + to_microseconds(?::BIGINT))"

# Rows the jump made late: late rows of the batches after the incident, before the next one,
# whose late-row time the watermark before the jump would have kept and the one it set not.
# Only the batches after ``counted_through_batch`` are read (they are added to the count), so a
# batch is counted once whatever the history holds; a batch audited into Parquet (no rows in
# late_rows) makes the cost unknown (NULL) for good.
COST_SQL = """
UPDATE watermark_jumps AS j SET
    rows_dropped_since = CASE
        WHEN (j.counted_through_batch IS NOT NULL AND j.rows_dropped_since IS NULL)
          OR EXISTS (
              SELECT 1 FROM audit_batches a
              WHERE a.query_id = j.query_id
                AND a.batch_id > coalesce(j.counted_through_batch, j.batch_id)
                AND a.batch_id <= $2
                AND a.sink = 'parquet')
        THEN NULL
        ELSE coalesce(j.rows_dropped_since, 0) + (
            SELECT count(*) FROM late_rows l
            WHERE l.query_id = j.query_id
              AND l.batch_id > coalesce(j.counted_through_batch, j.batch_id)
              AND l.batch_id <= $2
              AND l.batch_id < coalesce((
                  SELECT min(n.batch_id) FROM watermark_jumps n
                  WHERE n.query_id = j.query_id AND n.batch_id > j.batch_id), $2 + 1)
              AND coalesce(l.window_end_at, l.event_time_at) > j.watermark_before_at
              AND (j.watermark_after_at IS NULL
                   OR coalesce(l.window_end_at, l.event_time_at) <= j.watermark_after_at))
    END,
    counted_through_batch = $2
WHERE j.query_id = $1
  AND j.batch_id = (SELECT max(batch_id) FROM watermark_jumps
                    WHERE query_id = $1 AND batch_id < $2)
  AND j.watermark_before_at IS NOT NULL
  AND coalesce(j.counted_through_batch, j.batch_id) < $2
"""


class JumpHistory:
    """One query's ``watermark_jumps`` and ``watermark_jump_rows``, through the watch's store."""

    def __init__(
        self, store: HistoryAccess, *, query_id: str, query_name: str | None, label: str
    ) -> None:
        self._store = store
        self.query_id = query_id
        self.query_name = query_name
        self.label = label

    def record(self, incident: Incident) -> None:
        """Queue the write of one incident and its rows (replacing what was recorded of it)."""
        query_id, query_name = self.query_id, self.query_name

        def write(con: duckdb.DuckDBPyConnection) -> None:
            write_incident(con, query_id, query_name, incident)

        self._store.submit(
            write,
            description=f"audit {self.label}: batch {incident.batch_id} moved the watermark",
            payload_bytes=sum(len(r.row_data or "") for r in incident.rows),
        )

    def update_cost(self, through_batch: int) -> None:
        """Queue adding the rows of the batches up to ``through_batch`` to the latest
        incident's cost."""
        query_id = self.query_id

        def write(con: duckdb.DuckDBPyConnection) -> None:
            con.execute(COST_SQL, [query_id, through_batch])

        self._store.submit(
            write, description=f"audit {self.label}: rows the watermark jumps dropped"
        )

    def recent(self, count: int) -> list[Incident]:
        query_id = self.query_id

        def read(con: duckdb.DuckDBPyConnection) -> list[Incident]:
            return read_incidents(con, query_id, count)

        return list(self._store.read(read, timeout=30))


def write_incident(
    con: duckdb.DuckDBPyConnection, query_id: str, query_name: str | None, incident: Incident
) -> None:
    """Replace the incident's row and rows (one transaction: the store's writer's)."""
    i = incident
    if i.rows:
        # an incident taken up from the history comes without its rows: those stay
        con.execute(
            "DELETE FROM watermark_jump_rows WHERE query_id = ? AND batch_id = ?",
            [query_id, i.batch_id],
        )
    kept = con.execute(
        "SELECT rows_dropped_since, counted_through_batch FROM watermark_jumps "
        "WHERE query_id = ? AND batch_id = ?",
        [query_id, i.batch_id],
    ).fetchone()
    con.execute(
        f"INSERT OR REPLACE INTO watermark_jumps ({_INCIDENT_COLUMNS}, rows_dropped_since, "
        f"counted_through_batch) VALUES (?, ?, ?, ?, {_MS}, {_MS}, ?, {_MS}, {_MS}, ?, ?, ?, ?, "
        "?, ?, now(), ?, ?)",
        [
            query_id,
            i.batch_id,
            i.run_id,
            query_name,
            i.batch_at_ms,
            i.event_time_max_ms,
            i.ahead_seconds,
            i.watermark_before_ms,
            i.watermark_after_ms,
            i.jump_seconds,
            i.jump_batch_id,
            i.reasons,
            i.source_index,
            i.source_description,
            i.rows_error,
            kept[0] if kept else None,
            kept[1] if kept else None,
        ],
    )
    for row in i.rows:
        con.execute(
            "INSERT INTO watermark_jump_rows (query_id, batch_id, row_rank, event_time_at, "
            "source_index, source_file, kafka_topic, kafka_partition, kafka_offset, row_data) "
            f"VALUES (?, ?, ?, {_US}, ?, ?, ?, ?, ?, ?::JSON)",
            [
                query_id,
                i.batch_id,
                row.rank,
                row.event_time_us,
                row.source_index,
                row.source_file,
                row.kafka_topic,
                row.kafka_partition,
                row.kafka_offset,
                row.row_data,
            ],
        )


def read_incidents(con: duckdb.DuckDBPyConnection, query_id: str, count: int) -> list[Incident]:
    """The query's latest ``count`` incidents, as the watch needs them for their cost."""
    rows = con.execute(
        "SELECT batch_id, run_id, epoch_ms(batch_at), epoch_ms(event_time_max_at), "
        "ahead_seconds, epoch_ms(watermark_before_at), epoch_ms(watermark_after_at), "
        "jump_seconds, jump_batch_id, source_index, source_description, rows_error "
        "FROM watermark_jumps WHERE query_id = ? ORDER BY batch_id DESC LIMIT ?",
        [query_id, count],
    ).fetchall()
    return [
        Incident(
            batch_id=int(r[0]),
            run_id=r[1],
            batch_at_ms=r[2],
            event_time_max_ms=r[3],
            ahead_seconds=r[4],
            watermark_before_ms=r[5],
            watermark_after_ms=r[6],
            jump_seconds=r[7],
            jump_batch_id=r[8],
            source_index=r[9],
            source_description=r[10],
            rows_error=r[11],
        )
        for r in reversed(rows)
    ]
