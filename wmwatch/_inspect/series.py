"""Plan inspection's series for the HTML report: each input's watermark over batches, which
input held the global watermark back, and the state budget estimates of unbounded joins.

The report's watermarks section (:mod:`wmwatch._inspect.section`) shows the latest batch only; a
chart needs every recorded batch of ``source_watermarks``, and the budget estimate is kept in the
``findings`` evidence.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wmwatch._section import Scope, as_float, named_rows

if TYPE_CHECKING:
    import duckdb

__all__ = ["InputSeries", "JoinBudget", "WatermarksHistory", "load_watermarks_history"]


@dataclass(frozen=True, slots=True)
class InputSeries:
    """One ``withWatermark`` input over batches (instants as epoch seconds, None if unknown)."""

    source: str
    event_time_column: str | None
    delay_seconds: float | None
    batch_ids: tuple[int, ...]
    watermark_seconds: tuple[float | None, ...]
    event_time_max_seconds: tuple[float | None, ...]
    holding_back: tuple[bool, ...]


@dataclass(frozen=True, slots=True)
class JoinBudget:
    operator_id: int
    state_budget_bytes: int
    seconds_to_budget: float


@dataclass(slots=True)
class WatermarksHistory:
    policy: str | None = None
    inputs: list[InputSeries] = field(default_factory=list)
    budgets: list[JoinBudget] = field(default_factory=list)


def load_watermarks_history(
    con: duckdb.DuckDBPyConnection, scope: Scope
) -> dict[str, WatermarksHistory]:
    """Per query with recorded inputs or budget estimates: its series (batches in scope)."""
    ids = list(scope.query_ids)
    first_ids = [[qid, str(scope.first_batch_id(qid))] for qid in ids]
    out: dict[str, WatermarksHistory] = {}
    rows = named_rows(
        con,
        """
        WITH first_ids AS (SELECT f[1] AS query_id, f[2]::BIGINT AS first_id
                           FROM (SELECT unnest($1::VARCHAR[][]) AS f))
        SELECT s.query_id, coalesce(s.source, s.node_id) AS source, s.batch_id,
               s.event_time_column, s.delay_seconds, epoch(s.watermark_at) AS wm_s,
               epoch(s.event_time_max_at) AS max_s, coalesce(s.holding_back, false) AS back,
               s.policy
        FROM source_watermarks s JOIN first_ids USING (query_id)
        WHERE s.batch_id >= first_ids.first_id
        ORDER BY s.query_id, source, s.batch_id
        """,
        (first_ids,),
    )
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        series.setdefault((row["query_id"], row["source"]), []).append(row)
        entry = out.setdefault(row["query_id"], WatermarksHistory())
        entry.policy = row["policy"] or entry.policy
    for (qid, source), points in series.items():
        out[qid].inputs.append(
            InputSeries(
                source=source,
                event_time_column=points[-1]["event_time_column"],
                delay_seconds=as_float(points[-1]["delay_seconds"]),
                batch_ids=tuple(int(p["batch_id"]) for p in points),
                watermark_seconds=tuple(as_float(p["wm_s"]) for p in points),
                event_time_max_seconds=tuple(as_float(p["max_s"]) for p in points),
                holding_back=tuple(bool(p["back"]) for p in points),
            )
        )
    for row in named_rows(
        con,
        """
        SELECT query_id, operator_id, evidence FROM findings
        WHERE status = 'active' AND kind = 'join_state_unbounded' AND evidence IS NOT NULL
          AND query_id IN (SELECT unnest($1::VARCHAR[]))
        ORDER BY query_id, operator_id, side
        """,
        (ids,),
    ):
        budget = _budget(row["operator_id"], row["evidence"])
        if budget is None:
            continue
        entry = out.setdefault(row["query_id"], WatermarksHistory())
        if all(b.operator_id != budget.operator_id for b in entry.budgets):
            entry.budgets.append(budget)
    return out


def _budget(operator_id: Any, evidence: Any) -> JoinBudget | None:
    try:
        doc = json.loads(evidence) if isinstance(evidence, str) else evidence
    except ValueError:
        return None
    if not isinstance(doc, dict) or operator_id is None:
        return None
    budget, remaining = doc.get("state_budget_bytes"), as_float(doc.get("seconds_to_budget"))
    if not isinstance(budget, int | float) or remaining is None:
        return None
    return JoinBudget(int(operator_id), int(budget), remaining)
