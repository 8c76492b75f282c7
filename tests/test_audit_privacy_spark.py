"""What the audit stores of a join's keys, against real Spark: ``columns=`` and ``hash_columns=``
cover ``join_key`` as they cover ``row_data``, and ``hash_key=`` makes the hash HMAC-SHA256.

The join keys are e-mail addresses. The left key is left out of ``columns=``, the right key is
allowed and hashed under a key: no address may appear in any column of any table of the history
file, nor in its bytes, and each stored hash must be Python's ``hmac`` of the address.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import duckdb
import pytest

from tests.harness.checks import dropped_by_watermark
from tests.harness.joins import PAIRS, range_join, run_join
from wmwatch._audit.replay.engine import hmac_pads

pytestmark = pytest.mark.spark

HASH_KEY = b"\x00wmwatch-test-key\xff"
DOMAIN = "@mail.test"


def address(key: str) -> str:
    return f"{key}{DOMAIN}"


def keyed(value: str) -> str:
    return hmac.new(HASH_KEY, value.encode(), hashlib.sha256).hexdigest()


def every_value(db: Path) -> list[str]:
    """Every value of every column of every table in the history file, as text."""
    values: list[str] = []
    with duckdb.connect(str(db), read_only=True) as con:
        tables = [r[0] for r in con.execute("SELECT table_name FROM duckdb_tables()").fetchall()]
        assert "late_rows" in tables
        for table in tables:
            columns = [r[0] for r in con.execute(f'DESCRIBE "{table}"').fetchall()]
            for column in columns:
                rows = con.execute(f'SELECT "{column}"::VARCHAR FROM "{table}"').fetchall()
                values.extend(r[0] for r in rows if r[0] is not None)
    return values


def test_join_keys_follow_columns_and_hash_columns_with_a_hash_key(
    spark: Any, stream_dir: Path
) -> None:
    from pyspark.sql import functions as F

    def as_address(column: str) -> Any:
        return lambda frame: frame.withColumn(column, F.concat(F.col(column), F.lit(DOMAIN)))

    result = run_join(
        spark,
        stream_dir,
        range_join("inner"),
        name="join_private_keys",
        batching="each",
        left_side=as_address("lk"),
        right_side=as_address("rk"),
        columns=["lid", "lt", "rid", "rk", "rt"],
        hash_columns=["rk"],
        hash_key=HASH_KEY,
    )
    late = result["late"]
    assert late and len(late) == dropped_by_watermark(result["progress"])  # still exact
    right_keys = {i: k for _, rrows in PAIRS for i, k, _ in rrows}
    sides = {"left": 0, "right": 0}
    for *_, side, _source, join_key, row_data in late:
        data = json.loads(row_data)
        sides[side] += 1
        if side == "left":
            # not in columns=: neither the key nor the column is stored
            assert join_key is None and "lk" not in data and set(data) == {"lid", "lt"}
        else:
            expected = keyed(address(right_keys[data["rid"]]))
            assert json.loads(join_key) == {"rk": expected}
            assert data["rk"] == expected  # the same hash in row_data
            # keyed: not the plain SHA-256 that a dictionary of addresses reverses
            assert expected != hashlib.sha256(address(right_keys[data["rid"]]).encode()).hexdigest()
    assert sides["left"] and sides["right"]
    db = stream_dir / "history.duckdb"
    addresses = {address(k) for lrows, rrows in PAIRS for _, k, _ in [*lrows, *rrows]}
    values = every_value(db)
    assert values
    leaked = [v for v in values for a in addresses if a in v]
    assert not leaked, leaked[:3]
    raw = b"".join(p.read_bytes() for p in stream_dir.glob("history.duckdb*") if p.is_file())
    assert not [a for a in addresses if a.encode() in raw]
    assert HASH_KEY not in raw and HASH_KEY.hex() not in raw.decode("latin-1")
    if hasattr(spark, "_jsparkSession"):  # classic: the plans Spark's UI and event log show
        plans = spark_ui_plans(spark)
        assert any(DOMAIN in p for p in plans)  # literals do show there
        pads = hmac_pads(HASH_KEY)
        secrets = [s.hex().upper() for s in (HASH_KEY, pads.inner, pads.outer)]
        assert not [p for p in plans for s in secrets if s in p.upper()]


def spark_ui_plans(spark: Any) -> list[str]:
    """The physical plan of every SQL execution the session ran, as its status store (the SQL
    tab of Spark's UI, and the event log) holds it."""
    store = spark._jsparkSession.sharedState().statusStore()
    executions = spark._jvm.scala.jdk.javaapi.CollectionConverters.asJava(store.executionsList())
    return [str(e.physicalPlanDescription()) for e in executions]
