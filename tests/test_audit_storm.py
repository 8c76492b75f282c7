"""A late-row storm must not take the watched job down (driver of its own, Spark's defaults).

Two million rows, all behind the watermark, land in one batch of a windowed count running on
``local[2]`` with Spark's default driver memory. The audit must move them in bounded chunks:
the query goes on with its next batches, every late row is counted exactly once, at most
``max_rows_per_batch`` of them are kept in DuckDB and every one in the Parquet overflow folder,
and the driver's Python memory stays within the bound docs/guarantees.md documents.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests import jvm_archive

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROWS = 2_000_000
CAP = 100_000  # the audit's default max_rows_per_batch
# docs/guarantees.md, "Survives a late-row storm": the driver's Python RSS grows by less than
# this during a storm
RSS_GROWTH_BOUND_BYTES = 512 * 1024 * 1024

SCRIPT = Path(__file__).parent / "scripts" / "late_storm.py"


def run_storm(tmp_path: Path, rows: int, *extra: str) -> dict[str, Any]:
    env = jvm_archive.both_compilers(
        {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYTHONPATH": str(Path.cwd())}
    )
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), str(rows), "--parquet", *extra],
        capture_output=True,
        text=True,
        timeout=1800,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    result: dict[str, Any] = json.loads(run.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.slow(minutes=5)
def test_two_million_late_rows_in_one_batch(tmp_path: Path) -> None:
    check_storm(run_storm(tmp_path, ROWS), tmp_path, ROWS)


@pytest.mark.slow(minutes=2.5)
def test_late_row_storm_on_spark_connect(tmp_path: Path, connect_url: str) -> None:
    """The same on a Spark Connect server (the run's one): the rows come to the client chunk by
    chunk."""
    rows = 400_000
    result = run_storm(tmp_path / "run", rows, "--remote", connect_url)
    check_storm(result, tmp_path / "run", rows)


def check_storm(result: dict[str, Any], tmp_path: Path, rows: int) -> None:
    # the job survived and went on
    assert result["query_alive"] and result["context_alive"], result
    assert len(result["batches_after_storm"]) >= 2, result
    assert result["synced"], result
    # Spark drops the storm as late groups: one per 5-minute window of the replayed hour
    assert result["spark_groups_dropped"] == 12

    status = result["status"]
    assert status["errors"] == 0, status
    assert status["late_rows"] == rows
    assert status["batches_over_cap"] == 1
    assert status["late_rows_over_cap"] == rows - CAP

    db = tmp_path / "history.duckdb"
    with duckdb.connect(str(db), read_only=True) as con:
        kept = con.execute(
            "SELECT count(*), count(DISTINCT json_extract(row_data, '$.id')::BIGINT), "
            "min(json_extract(row_data, '$.id')::BIGINT), "
            "max(json_extract(row_data, '$.id')::BIGINT) "
            "FROM late_rows WHERE batch_id = ?",
            [result["storm_batch"]],
        ).fetchone()
        mark = con.execute(
            "SELECT late_rows, rows_kept, rows_over_cap, overflow_location FROM audit_batches "
            "WHERE batch_id = ?",
            [result["storm_batch"]],
        ).fetchone()
        pending = con.execute("SELECT count(*) FROM late_rows_pending").fetchone()
        other = con.execute(
            "SELECT count(*) FROM late_rows WHERE batch_id <> ?", [result["storm_batch"]]
        ).fetchone()
        assert mark is not None and kept is not None
        overflow = con.execute(
            "SELECT count(*), count(DISTINCT json_extract(row_data, '$.id')::BIGINT) "
            "FROM read_parquet(? || '/*.parquet')",
            [mark[3]],
        ).fetchone()
    assert kept == (CAP, CAP, kept[2], kept[3]) and kept[2] >= 0 and kept[3] < rows
    assert mark[:3] == (rows, CAP, rows - CAP)
    assert overflow == (rows, rows)  # every late row, each exactly once
    assert pending == (0,) and other == (0,)

    growth = result["rss_peak_bytes"] - result["rss_baseline_bytes"]
    assert growth < RSS_GROWTH_BOUND_BYTES, f"driver RSS grew {growth / 2**20:.0f} MiB"
