"""The contract between the report and the sections each feature owns.

``wmwatch report`` shows each query's core summary (:class:`QuerySummary`, from the tables the
store owns) and then one :class:`Section` per feature that keeps tables of its own (the audit's
late rows, the plan inspection's findings and watermarks). A feature writes its section next to
its tables, against this module only; :mod:`wmwatch._report.sections` lists the sections a report
shows. The row helpers read SQL results by column name, for the core and the sections alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import duckdb
    from rich.console import RenderableType


@dataclass(slots=True)
class QuerySummary:
    """One query's core figures, from the ``queries``, ``batches`` and ``operators`` tables."""

    query_id: str
    query: str
    status: str
    error_class: str | None
    exception: str | None
    runs: int
    batches: int
    first_batch_id: int | None
    last_batch_id: int | None
    first_batch_at: datetime | None
    last_batch_at: datetime | None
    watermark_at: datetime | None
    watermark_lag_p50_seconds: float | None
    watermark_lag_p95_seconds: float | None
    watermark_lag_max_seconds: float | None
    event_time_delay_p50_seconds: float | None
    input_rows: int
    rows_dropped_by_watermark: int | None
    drops_count_groups: bool
    state_rows_first: int | None
    state_rows_last: int | None
    state_rows_growth: int | None
    state_rows_growth_per_hour: float | None
    state_memory_bytes_last: int | None
    state_memory_bytes_max: int | None
    # the latest run's trigger (processing_time, real_time, ...) and its interval
    trigger: str = "unknown"
    trigger_interval_seconds: float | None = None
    operators: list[dict[str, Any]] = field(default_factory=list)
    sections: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Scope:
    """Which history a report covers: these queries, batches at or after ``since_at``.

    ``summaries`` holds each query's core summary, already built: its first batch id in scope
    serves tables keyed by batch that have no batch time of their own (late rows, audit
    batches), its figures serve sections whose advice depends on them.
    """

    query_ids: tuple[str, ...]
    since_at: datetime | None
    summaries: Mapping[str, QuerySummary]

    def first_batch_id(self, query_id: str) -> int:
        summary = self.summaries.get(query_id)
        if summary is None or summary.first_batch_id is None:
            return 0
        return summary.first_batch_id


@dataclass(frozen=True, slots=True)
class Section:
    """One optional part of each query's report, driven by its own table(s).

    ``load`` returns ``{query_id: data}`` only for queries with rows; ``data`` must be plain
    JSON-able values (datetimes allowed) and complete: rendering only reads it. ``render`` turns
    one query's data into a rich renderable; ``csv_values`` maps data (or None) to
    ``csv_columns``.
    """

    key: str
    title: str
    load: Callable[[duckdb.DuckDBPyConnection, Scope], Mapping[str, Any]]
    render: Callable[[Any], RenderableType]
    csv_columns: tuple[str, ...]
    csv_values: Callable[[Any], Mapping[str, Any]]


# -- reading SQL results ---------------------------------------------------------------------

Row = dict[str, Any]


def named_rows(
    con: duckdb.DuckDBPyConnection, sql: str, params: Sequence[Any] | None = None
) -> list[Row]:
    """Every row of ``sql`` as ``{column: value}``, columns named as the query names them."""
    cursor = con.execute(sql, params)
    columns = [column[0] for column in cursor.description or ()]
    return [dict(zip(columns, values, strict=True)) for values in cursor.fetchall()]


def grouped(rows: Sequence[Row], make: Callable[[Row], Any]) -> dict[str, list[Any]]:
    """``{query_id: [make(row), ...]}`` in row order."""
    out: dict[str, list[Any]] = {}
    for row in rows:
        out.setdefault(row["query_id"], []).append(make(row))
    return out


def as_int(value: Any) -> int | None:
    return None if value is None else int(value)


def as_float(value: Any) -> float | None:
    """A finite float or None: NaN and infinities have no place in JSON."""
    if value is None:
        return None
    number = float(value)
    return None if math.isnan(number) or math.isinf(number) else number
