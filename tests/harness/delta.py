"""The Delta scenario: a Delta table written a commit at a time (pyspark 4.2 with Delta's jars,
``nox -s delta``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.harness.streams import SCHEMA


def require_delta() -> None:
    """Fail (never skip) where Spark runs without Delta."""
    from tests.conftest import DELTA

    if not DELTA:
        pytest.fail("the Delta tests run on pyspark 4.2 with Delta's jars: run `nox -s delta`")


def append(spark: Any, table: Path, rows: list[dict[str, Any]], files: int = 1) -> None:
    """One commit of ``rows`` to the Delta table, in ``files`` data files."""
    from datetime import datetime

    data = [
        (r["id"], r["user"], datetime.fromisoformat(r["ts"].replace("Z", "+00:00"))) for r in rows
    ]
    frame = spark.createDataFrame(data, SCHEMA)
    frame = frame.repartition(files) if files > 1 else frame.coalesce(1)
    frame.write.format("delta").mode("append").save(str(table))
