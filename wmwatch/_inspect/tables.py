"""Plan inspection's writes to the history: ``findings``, ``operator_watermarks`` and
``source_watermarks``.

Each function runs inside the store's write transaction on its one writer thread. Every write
is an upsert on the table's key, so a retried write and a restarted process leave the same rows.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from wmwatch._inspect.watermarks import OperatorWatermark, SourceWatermark

if TYPE_CHECKING:
    import duckdb

    from wmwatch._inspect.findings import Finding


def write_finding(con: duckdb.DuckDBPyConnection, finding: Finding) -> None:
    """One finding, never moving ``first_seen_at`` later or ``occurrences`` backwards."""
    con.execute(
        """
        INSERT INTO findings (finding_id, query_id, query_name, operator_id, side, kind, severity,
            status, message, evidence, fix, first_seen_at, last_seen_at, first_batch_id,
            last_batch_id, occurrences)
        VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
        ON CONFLICT (finding_id) DO UPDATE SET
            query_name = excluded.query_name,
            severity = excluded.severity,
            status = excluded.status,
            message = excluded.message,
            evidence = excluded.evidence,
            fix = excluded.fix,
            first_seen_at = least(findings.first_seen_at, excluded.first_seen_at),
            last_seen_at = greatest(findings.last_seen_at, excluded.last_seen_at),
            first_batch_id = coalesce(findings.first_batch_id, excluded.first_batch_id),
            last_batch_id = excluded.last_batch_id,
            occurrences = greatest(findings.occurrences, excluded.occurrences)
        """,
        [
            finding.finding_id,
            finding.query_id,
            finding.query_name,
            finding.operator_id,
            finding.side,
            finding.kind,
            finding.severity,
            finding.status,
            finding.message,
            json.dumps(finding.evidence, sort_keys=True, default=str),
            finding.fix,
            finding.first_seen_at,
            finding.last_seen_at,
            finding.first_batch_id,
            finding.last_batch_id,
            finding.occurrences,
        ],
    )


def write_watermarks(
    con: duckdb.DuckDBPyConnection,
    *,
    query_id: str,
    batch_id: int,
    operators: Sequence[OperatorWatermark],
    sources: Sequence[SourceWatermark],
    policy: str,
    recorded_at: datetime,
) -> None:
    """One batch's per-operator and per-source watermarks."""
    if operators:
        con.executemany(
            """
            INSERT OR REPLACE INTO operator_watermarks (query_id, batch_id, operator_id,
                operator_name, late_watermark_at, eviction_watermark_at, recorded_at)
            VALUES (?, ?, ?, ?, ?, ?, ?)
            """,
            [
                (
                    query_id, batch_id, o.operator_id, o.operator_name, o.late_at, o.eviction_at,
                    recorded_at,
                )
                for o in operators
            ],
        )  # fmt: skip
    if sources:
        con.executemany(
            """
            INSERT OR REPLACE INTO source_watermarks (query_id, batch_id, node_id, source,
                event_time_column, delay_seconds, watermark_at, event_time_max_at, idle_batches,
                holding_back, policy, recorded_at)
            VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
            """,
            [
                (
                    query_id, batch_id, s.node_id, s.source, s.event_time_column,
                    s.delay_seconds, s.watermark_at, s.event_time_max_at, s.idle_batches,
                    s.holding_back, policy, recorded_at,
                )
                for s in sources
            ],
        )  # fmt: skip
