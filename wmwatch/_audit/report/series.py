"""The audit's series for the HTML report: audited late rows per batch, and how late they were.

The report's late-rows section (:mod:`wmwatch._audit.report.section`) gives totals, quantiles and
top lists; a chart needs the count of every audited batch and a histogram fine enough to draw the
delay advice on. Both are read here, from the same rows the section reads (``late_rows``, the
Parquet folders ``audit_batches`` lists, and ``audit_batches`` itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from wmwatch._audit.report.loading import late_rows_source
from wmwatch._section import Scope, named_rows

if TYPE_CHECKING:
    import duckdb

__all__ = ["BINS_PER_DECADE", "LateRowsHistory", "bin_edges_seconds", "load_late_rows_history"]

BINS_PER_DECADE = 4
"""Histogram bins per power of ten seconds (0.1 s and less fall in the first bin)."""

_FLOOR_SECONDS = 0.1


def bin_edges_seconds(index: int) -> tuple[float, float]:
    """The seconds a histogram bin covers: bin ``i`` is [0.1 * 10^(i/4), 0.1 * 10^((i+1)/4))."""
    return (
        _FLOOR_SECONDS * 10 ** (index / BINS_PER_DECADE),
        _FLOOR_SECONDS * 10 ** ((index + 1) / BINS_PER_DECADE),
    )


@dataclass(frozen=True, slots=True)
class LateRowsHistory:
    """Audited batches (id, late rows found) and two histograms over the same log bins.

    ``lateness``: how far behind the watermark each kept row was; ``needed``: how much more
    watermark delay would have kept it (for windows, watermark minus window end: the quantity
    the delay advice is a quantile of). Histograms map bin index to rows.
    """

    batch_ids: tuple[int, ...]
    late_rows: tuple[int, ...]
    lateness: dict[int, int]
    needed: dict[int, int]


def load_late_rows_history(
    con: duckdb.DuckDBPyConnection, scope: Scope
) -> dict[str, LateRowsHistory]:
    """Per query with audited batches in scope: counts per batch and the two histograms."""
    first_ids = [[qid, str(scope.first_batch_id(qid))] for qid in scope.query_ids]
    batches: dict[str, tuple[list[int], list[int]]] = {}
    for row in named_rows(
        con,
        """
        WITH first_ids AS (SELECT f[1] AS query_id, f[2]::BIGINT AS first_id
                           FROM (SELECT unnest($1::VARCHAR[][]) AS f))
        SELECT a.query_id, a.batch_id, a.late_rows
        FROM audit_batches a JOIN first_ids USING (query_id)
        WHERE a.batch_id >= first_ids.first_id ORDER BY a.query_id, a.batch_id
        """,
        (first_ids,),
    ):
        ids, counts = batches.setdefault(row["query_id"], ([], []))
        ids.append(int(row["batch_id"]))
        counts.append(int(row["late_rows"]))
    if not batches:
        return {}
    source_sql, params, _missing = late_rows_source(con, scope)
    bucket = (
        f"greatest(0, floor(log10(greatest({{col}}, {_FLOOR_SECONDS}) / {_FLOOR_SECONDS}) "
        f"* {BINS_PER_DECADE}))::INTEGER"
    )
    histograms: dict[str, tuple[dict[int, int], dict[int, int]]] = {}
    for row in named_rows(
        con,
        f"""
        WITH first_ids AS (SELECT f[1] AS query_id, f[2]::BIGINT AS first_id
                           FROM (SELECT unnest(${len(params) + 1}::VARCHAR[][]) AS f)),
        late AS (SELECT l.lateness_seconds,
                   greatest(0, coalesce(epoch(l.watermark_at) - epoch(l.window_end_at),
                                        l.lateness_seconds)) AS needed_seconds,
                   l.query_id
                 FROM ({source_sql}) l JOIN first_ids USING (query_id)
                 WHERE l.batch_id >= first_ids.first_id)
        SELECT query_id, 'lateness' AS what, {bucket.format(col="lateness_seconds")} AS bin,
               count(*) AS n
        FROM late WHERE lateness_seconds IS NOT NULL GROUP BY ALL
        UNION ALL
        SELECT query_id, 'needed', {bucket.format(col="needed_seconds")}, count(*)
        FROM late WHERE needed_seconds IS NOT NULL GROUP BY ALL
        """,
        [*params, first_ids],
    ):
        lateness, needed = histograms.setdefault(row["query_id"], ({}, {}))
        target = lateness if row["what"] == "lateness" else needed
        target[int(row["bin"])] = int(row["n"])
    out: dict[str, LateRowsHistory] = {}
    for qid, (ids, counts) in batches.items():
        lateness, needed = histograms.get(qid, ({}, {}))
        out[qid] = LateRowsHistory(tuple(ids), tuple(counts), lateness, needed)
    return out
