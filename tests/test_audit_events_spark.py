"""The audit replays ``events`` as the user wrote it (classic PySpark), against real Spark.

The stream is JSON *text*: ``format("text")``, ``from_json``, ``select("j.*")``, a filter, new
columns, then ``withWatermark``, with no ``prepare=``. The input carries rows the filter removes
(very late ones, and ones whose time does not parse): an audit that did not replay the filter
would count them as late, and the balance below would break.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

import wmwatch
from tests.harness.audited import run_audited
from tests.harness.checks import (
    assert_marks_complete,
    assert_windows_balance,
    check_dedupe,
    dropped_by_watermark,
    final_watermark_ms,
)
from tests.harness.streams import DELAY, SCHEMA, stream_files, ts, write_events
from wmwatch._audit.replay.events import as_written
from wmwatch._errors import AuditError

pytestmark = pytest.mark.spark


def parse(raw: Any) -> Any:
    """What users write over a text (or Kafka value) stream before the watermark."""
    from pyspark.sql import functions as F

    return (
        raw.select(F.from_json("value", SCHEMA).alias("j"))
        .select("j.*")
        .where(F.col("ts").isNotNull() & (F.col("user") != "ignored"))
        .withColumn("user", F.upper("user"))
        .withColumn("score", F.col("id") * 10)
    )


def read_text(reader: Any, folder: str) -> Any:
    return parse(reader.format("text").load(folder)).withWatermark("ts", DELAY)


def noisy_files() -> list[list[dict[str, Any]]]:
    """The audit's usual stream, each file after the first with a row the filter removes that
    is far behind every watermark, and one whose time does not parse."""
    files = stream_files()
    for index, rows in enumerate(files[1:-1], start=1):
        rows.append({"id": 5000 + index, "user": "ignored", "ts": ts(0)})
        rows.append({"id": 6000 + index, "user": "bad", "ts": "not a time"})
    return files


def kept(files: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """The rows events lets through, file by file."""
    return [[r for r in f if r["user"] not in ("ignored", "bad")] for f in files]


@pytest.mark.parametrize("batching", ["each", "bulk"])
def test_window_count_over_parsed_text_is_audited_as_written(
    spark: Any, stream_dir: Path, batching: str
) -> None:
    from pyspark.sql import functions as F

    result = run_audited(
        spark,
        stream_dir,
        lambda e: e.groupBy(F.window("ts", "10 seconds")).count(),
        batching=batching,
        name=f"as_written_{batching}",
        files=noisy_files(),
        read=read_text,
    )
    status = result["status"]
    assert status["errors"] == 0 and status["lag_batches"] == 0, status
    rows = (
        parse(spark.read.text(str(stream_dir / "in")))
        .groupBy(F.window("ts", "10 seconds"))
        .count()
        .collect()
    )
    expected = {
        (
            int(r["window"]["start"].timestamp() * 1000),
            int(r["window"]["end"].timestamp() * 1000),
        ): r["count"]
        for r in rows
    }
    late = result["late"]
    assert_windows_balance(expected, result["output"], late, final_watermark_ms(result["progress"]))
    # Spark counts late groups per batch (after partial aggregation), not rows
    assert len({(r[0], r[4]) for r in late}) == dropped_by_watermark(result["progress"])
    assert status["late_rows"] == len(late)
    for row in late:
        data = json.loads(row[8])
        # the rows as events made them: parsed, filtered, with the new and replaced columns
        assert data["user"] == data["user"].upper() and data["user"] not in ("IGNORED", "BAD")
        assert data["score"] == data["id"] * 10
        assert row[7] and row[7].startswith("/") and row[7].endswith(".json")
    assert_marks_complete(result)


def test_drop_duplicates_over_parsed_text_is_audited_as_written(
    spark: Any, stream_dir: Path
) -> None:
    files = noisy_files()
    result = run_audited(
        spark,
        stream_dir,
        lambda e: e.dropDuplicates(["user", "ts"]),
        batching="each",
        name="as_written_dedupe",
        files=files,
        read=read_text,
    )
    assert result["status"]["errors"] == 0, result["status"]
    # the conservation check sees the rows events lets through (ids stay what they were)
    check_dedupe({**result, "files": kept(files)}, lambda r: (r["user"], r["ts"]), "dedupe")


def test_a_non_deterministic_filter_is_refused_and_prepare_overrides(
    spark: Any, stream_dir: Path
) -> None:
    from pyspark.sql import functions as F

    raw = spark.readStream.format("text").load(str(stream_dir / "in"))
    # keeps every row, but no replay can know that rand() did
    events = parse(raw).where(F.rand(7) < 2).withWatermark("ts", DELAY)
    query = (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.format("memory")
        .queryName("as_written_rand")
        .outputMode("append")
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    db = stream_dir / "history.duckdb"
    try:
        with wmwatch.attach(
            spark, db=str(db), metrics_port=None, registry=CollectorRegistry()
        ) as watch:
            with pytest.raises(AuditError, match=r"rand\(7L?\).*not deterministic") as refused:
                watch.audit(query, events)
            assert "\n" not in str(refused.value) and "prepare=" in str(refused.value)
            handle = watch.audit(
                query, events, prepare=lambda df: parse(df).withWatermark("ts", DELAY)
            )
            for f in stream_files()[:3]:
                write_events(stream_dir / "in", f)
                query.processAllAvailable()
            assert handle.sync(60), handle.status()
            status = handle.status()
            handle.stop()
    finally:
        query.stop()
    assert status["errors"] == 0
    import duckdb

    with duckdb.connect(str(db), read_only=True) as con:
        late = [
            json.loads(r[0])
            for r in con.execute("SELECT row_data::VARCHAR FROM late_rows").fetchall()
        ]
    assert {r["id"] for r in late} == {5, 7, 9, 10, 14}


def test_what_cannot_be_replayed_is_named(spark: Any, stream_dir: Path) -> None:
    from pyspark.sql import functions as F

    raw = spark.readStream.format("text").load(str(stream_dir / "in"))
    other = spark.readStream.format("text").load(str(stream_dir / "out"))
    refused = {
        "current_timestamp": raw.withColumn("seen", F.current_timestamp()),
        "uuid": raw.withColumn("u", F.expr("uuid()")),
        "sample": raw.sample(0.5),
        "stateful step (Aggregate)": raw.groupBy("value").count(),
        "2 streaming sources": raw.unionByName(other),
        "another DataFrame (Join)": raw.join(
            spark.createDataFrame([("x",)], "value string"), "value"
        ),
    }
    for reason, events in refused.items():
        with pytest.raises(AuditError, match=re.escape(reason)):
            as_written(spark, events)
    # a deterministic chain is accepted, and a batch run through it is a batch
    batch = spark.createDataFrame(
        [(json.dumps({"id": 1, "user": "a", "ts": ts(3)}),), ('{"user": "ignored"}',)],
        "value string",
    )
    replayed = as_written(spark, parse(raw).withWatermark("ts", DELAY))(batch)
    assert not replayed.isStreaming
    (row,) = replayed.collect()
    assert (row["id"], row["user"], row["score"]) == (1, "A", 10)
    assert row["ts"].isoformat().startswith("2026-01-01T00:00:03")


def test_a_plan_past_the_expression_bound_is_checked_whole(spark: Any, stream_dir: Path) -> None:
    """One column of over 20,000 expressions (the number the audit walks one by one at most),
    a non-deterministic or batch-time call as its last argument: refused, never accepted
    unchecked; without that call the same plan is accepted."""
    from pyspark.sql import functions as F

    raw = spark.readStream.format("text").load(str(stream_dir / "in"))
    # 5,100 arguments of 4 expressions each (an addition, its two sides, the length's column),
    # parsed by Spark from one string (a Column per argument takes a py4j call each)
    wide = ", ".join(f"length(value) + {i}" for i in range(5_100))
    refused = {
        "rand(": f"greatest({wide}, rand() * 0)",
        "current_timestamp()": f"greatest({wide}, unix_timestamp(current_timestamp()) * 0)",
    }
    for reason, sql in refused.items():
        with pytest.raises(AuditError, match=re.escape(reason)):
            as_written(spark, raw.select("value", F.expr(sql).alias("widest")))
    accepted = raw.select("value", F.expr(f"greatest({wide})").alias("widest"))
    replay = as_written(spark, accepted)
    batch = spark.createDataFrame([("abc",)], "value string")
    assert replay(batch).columns == ["value", "widest"]


def test_a_python_udf_marked_non_deterministic_is_refused(spark: Any, stream_dir: Path) -> None:
    """Classic PySpark and Spark Connect alike: a Python UDF marked non-deterministic is
    refused with the reason (and prepare= then audits the query); the same UDF deterministic is
    accepted. On Connect a UDF called by a registered name, whose determinism the client cannot
    read, is refused too."""
    from pyspark.sql import functions as F

    from wmwatch._core.sessions import is_connect

    raw = spark.readStream.format("text").load(str(stream_dir / "in"))
    jitter = F.udf(lambda v: v, "string").asNondeterministic()
    with pytest.raises(AuditError, match=r"not deterministic.*pass prepare="):
        as_written(spark, raw.withColumn("v", jitter("value")))
    with pytest.raises(AuditError, match=r"not deterministic"):
        as_written(spark, raw.where(jitter("value").isNotNull()))
    same = F.udf(lambda v: v, "string")
    replay = as_written(spark, raw.withColumn("v", same("value")))
    assert replay is not None
    spark.udf.register("wmwatch_same_by_name", same)
    by_name = raw.withColumn("v", F.expr("wmwatch_same_by_name(value)"))
    if is_connect(spark):
        with pytest.raises(AuditError, match="wmwatch_same_by_name by a registered name"):
            as_written(spark, by_name)
    else:
        as_written(spark, by_name)  # the driver's plan says it is deterministic
