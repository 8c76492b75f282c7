"""The report's series over batch time, for the HTML report's charts.

The summary in :mod:`wmwatch._report.build` gives one figure per query; a chart needs the figures
of every batch. This module reads them from the core tables (``batches``, ``operators``) and asks
each feature for the series of its own tables (:mod:`wmwatch._audit.report.series`,
:mod:`wmwatch._inspect.series`). Series are column arrays (epoch seconds for instants, NaN for
missing values) so that 100,000 batches cost one fetch each, not 100,000 Python objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from wmwatch._audit.report.series import LateRowsHistory, load_late_rows_history
from wmwatch._inspect.series import WatermarksHistory, load_watermarks_history
from wmwatch._report.model import Report
from wmwatch._section import Scope

if TYPE_CHECKING:
    import duckdb
    import numpy as np
    import numpy.typing as npt

    Floats = npt.NDArray[np.float64]
else:
    Floats = Any

__all__ = ["LagQuantiles", "OperatorSeries", "QueryHistory", "load_history"]

LAG_QUANTILE_BUCKETS = 300
"""At most this many points for the lag quantiles over time (each a quantile of its bucket)."""

LAG_BATCHES_PER_BUCKET = 5
"""A bucket holds at least this many batches, so a quantile is one of several batches."""


@dataclass(frozen=True, slots=True)
class LagQuantiles:
    at_seconds: Floats
    p50_seconds: Floats
    p95_seconds: Floats


@dataclass(frozen=True, slots=True)
class OperatorSeries:
    operator_id: int
    operator_name: str | None
    at_seconds: Floats
    rows: Floats
    memory_bytes: Floats


@dataclass(slots=True)
class QueryHistory:
    """Every batch of one query in scope, oldest first."""

    query_id: str
    batch_ids: Floats
    batch_at_seconds: Floats
    watermark_seconds: Floats
    event_time_max_seconds: Floats
    event_time_min_seconds: Floats
    event_time_avg_seconds: Floats
    rows_dropped: Floats
    restarts_at_seconds: Floats
    lag: LagQuantiles
    operators: list[OperatorSeries] = field(default_factory=list)
    late_rows: LateRowsHistory | None = None
    watermarks: WatermarksHistory | None = None

    @property
    def batches(self) -> int:
        return len(self.batch_at_seconds)

    def times_of(self, batch_ids: Any) -> Floats:
        """The batch time of each batch id (NaN for a batch outside the history)."""
        import numpy as np

        wanted = np.asarray(batch_ids, dtype=np.float64)
        order = np.argsort(self.batch_ids, kind="stable")
        ids = self.batch_ids[order]
        pos = np.clip(np.searchsorted(ids, wanted), 0, max(len(ids) - 1, 0))
        if not len(ids):
            return np.full(len(wanted), np.nan)
        found = ids[pos] == wanted
        return np.where(found, self.batch_at_seconds[order][pos], np.nan)


_BATCHES_SQL = """
    SELECT batch_id, epoch(batch_at) AS at_s, epoch(watermark_at) AS wm_s,
           epoch(event_time_max_at) AS max_s, epoch(event_time_min_at) AS min_s,
           epoch(event_time_avg_at) AS avg_s, rows_dropped_by_watermark::DOUBLE AS dropped,
           run_id
    FROM batches
    WHERE query_id = $1 AND batch_at IS NOT NULL
      AND ($2::DOUBLE IS NULL OR batch_at >= to_timestamp($2::DOUBLE))
    ORDER BY batch_at, batch_id
"""

_LAG_SQL = """
    WITH b AS (
        SELECT batch_id, epoch(batch_at) AS at_s, watermark_lag_seconds AS lag FROM batches
        WHERE query_id = $1 AND batch_at IS NOT NULL
          AND ($2::DOUBLE IS NULL OR batch_at >= to_timestamp($2::DOUBLE))
    ), span AS (SELECT min(at_s) AS t0, greatest(max(at_s) - min(at_s), 1e-9) AS width FROM b)
    SELECT avg(at_s) AS at_s,
           quantile_cont(lag, 0.5) AS p50, quantile_cont(lag, 0.95) AS p95
    FROM b, span
    GROUP BY least(floor((at_s - t0) / width * $3::BIGINT), $3::BIGINT - 1)
    HAVING count(lag) > 0
    ORDER BY 1
"""

_OPERATORS_SQL = """
    SELECT o.operator_id, arg_max(o.operator_name, o.batch_id) OVER w AS name,
           epoch(b.batch_at) AS at_s, o.rows_total::DOUBLE AS rows,
           o.memory_used_bytes::DOUBLE AS mem
    FROM operators o JOIN batches b USING (query_id, batch_id)
    WHERE o.query_id = $1 AND b.batch_at IS NOT NULL
      AND ($2::DOUBLE IS NULL OR b.batch_at >= to_timestamp($2::DOUBLE))
    WINDOW w AS (PARTITION BY o.operator_id)
    ORDER BY o.operator_id, b.batch_at, o.batch_id
"""


def load_history(con: duckdb.DuckDBPyConnection, report: Report) -> dict[str, QueryHistory]:
    """The series of every query of ``report`` that has batches in scope."""
    import numpy as np

    since = report.since_at.timestamp() if report.since_at else None
    scope = Scope(
        query_ids=tuple(s.query_id for s in report.queries),
        since_at=report.since_at,
        summaries={s.query_id: s for s in report.queries},
    )
    late = load_late_rows_history(con, scope) if scope.query_ids else {}
    marks = load_watermarks_history(con, scope) if scope.query_ids else {}
    out: dict[str, QueryHistory] = {}
    for summary in report.queries:
        qid = summary.query_id
        if not summary.batches:
            continue
        cols = con.execute(_BATCHES_SQL, (qid, since)).fetchnumpy()
        runs = cols["run_id"]
        starts = [i for i in range(1, len(runs)) if runs[i] != runs[i - 1]]
        at = _floats(cols["at_s"])
        buckets = max(1, min(LAG_QUANTILE_BUCKETS, len(at) // LAG_BATCHES_PER_BUCKET))
        lag = con.execute(_LAG_SQL, (qid, since, buckets)).fetchnumpy()
        history = QueryHistory(
            query_id=qid,
            batch_ids=_floats(cols["batch_id"]),
            batch_at_seconds=at,
            watermark_seconds=_floats(cols["wm_s"]),
            event_time_max_seconds=_floats(cols["max_s"]),
            event_time_min_seconds=_floats(cols["min_s"]),
            event_time_avg_seconds=_floats(cols["avg_s"]),
            rows_dropped=_floats(cols["dropped"]),
            restarts_at_seconds=at[np.asarray(starts, dtype=np.int64)],
            lag=LagQuantiles(_floats(lag["at_s"]), _floats(lag["p50"]), _floats(lag["p95"])),
            late_rows=late.get(qid),
            watermarks=marks.get(qid),
        )
        ops = con.execute(_OPERATORS_SQL, (qid, since)).fetchnumpy()
        op_ids = np.asarray(ops["operator_id"])
        for op_id in dict.fromkeys(op_ids.tolist()):
            sel = op_ids == op_id
            history.operators.append(
                OperatorSeries(
                    operator_id=int(op_id),
                    operator_name=str(np.asarray(ops["name"])[sel][0] or "") or None,
                    at_seconds=_floats(ops["at_s"])[sel],
                    rows=_floats(ops["rows"])[sel],
                    memory_bytes=_floats(ops["mem"])[sel],
                )
            )
        out[qid] = history
    return out


def _floats(column: Any) -> Floats:
    """A DuckDB numpy column (masked where NULL) as float64 with NaN for NULL."""
    import numpy as np

    if isinstance(column, np.ma.MaskedArray):
        return np.ma.filled(column.astype(np.float64), np.nan)
    return np.asarray(column, dtype=np.float64)
