"""Reading the report's SQL results: rows by column name, grouped per query, numbers made safe.

Used by the report core and by each feature's section loader.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import duckdb

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
