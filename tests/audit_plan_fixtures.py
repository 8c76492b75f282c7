"""Regenerate tests/fixtures/audit_plans/*.txt from real Spark
(``python -m tests.audit_plan_fixtures``).

Each file is the analysed logical plan text of a streaming query, as the audit reads it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

OUT = Path(__file__).parent / "fixtures" / "audit_plans"


def _count_state(key: Any, frames: Any, state: Any) -> Any:
    import pandas as pd

    yield pd.DataFrame({"id": [key[0]], "n": [sum(len(f) for f in frames)]})


def main() -> None:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    spark = (
        SparkSession.builder.master("local[1]")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    base = Path(tempfile.mkdtemp())
    (base / "in").mkdir()
    (base / "in2").mkdir()
    raw = spark.readStream.schema("id int, ts timestamp, v string").json(str(base / "in"))
    events = raw.withWatermark("ts", "10 seconds")
    other = (
        spark.readStream.schema("id int, ts2 timestamp")
        .json(str(base / "in2"))
        .withWatermark("ts2", "10 seconds")
    )
    queries = {
        "tumbling": events.groupBy(F.window("ts", "10 seconds")).count(),
        "sliding": events.groupBy(F.window("ts", "10 seconds", "5 seconds"), "v").count(),
        "offset": events.groupBy(F.window("ts", "10 seconds", "10 seconds", "2 seconds")).count(),
        "alias": events.groupBy(F.window("ts", "1 minute").alias("w")).agg(F.count("*")),
        "dedupe": events.dropDuplicates(["id", "ts"]),
        "dedupe_within_watermark": events.dropDuplicatesWithinWatermark(["id"]),
        "dedupe_without_event_time": events.dropDuplicates(["id"]),
        "aggregate_by_key": events.groupBy("v").count(),
        "no_watermark": raw.groupBy(F.window("ts", "10 seconds")).count(),
        "join": events.join(other, "id"),
        "join_left_outer_range": events.join(
            other.withColumnRenamed("id", "rid"),
            F.expr("id = rid AND ts BETWEEN ts2 - INTERVAL 5 SECONDS AND ts2 + INTERVAL 5 SECONDS"),
            "leftOuter",
        ),
        "join_one_side": events.join(
            spark.readStream.schema("id int, ts2 timestamp").json(str(base / "in2")), "id"
        ),
        "union": events.unionByName(
            spark.readStream.schema("id int, ts timestamp, v string")
            .json(str(base / "in2"))
            .withWatermark("ts", "10 seconds")
        )
        .groupBy(F.window("ts", "10 seconds"))
        .count(),
        "session": events.groupBy("id", F.session_window("ts", "5 seconds")).count(),
        "session_dynamic_gap": events.groupBy(
            "id",
            F.session_window("ts", F.when(F.col("v") == "a", "5 seconds").otherwise("10 seconds")),
        ).count(),
        "raw_event_time": events.groupBy("ts").count(),
        "dedupe_then_window": events.dropDuplicates(["id", "ts"])
        .groupBy(F.window("ts", "10 seconds"))
        .count(),
        "state_event_time": events.groupBy("id").applyInPandasWithState(
            _count_state, "id int, n long", "n long", "append", "EventTimeTimeout"
        ),
        "state_no_timeout": events.groupBy("id").applyInPandasWithState(
            _count_state, "id int, n long", "n long", "append", "NoTimeout"
        ),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    for name, frame in queries.items():
        updates = ("aggregate_by_key", "no_watermark", "raw_event_time")
        mode = "update" if name in updates else "append"
        query = (
            frame.writeStream.format("noop")
            .outputMode(mode)
            .option("checkpointLocation", str(base / f"ck_{name}"))
            .start()
        )
        try:
            text = str(query._jsq.streamingQuery().analyzedPlan().toString())
        finally:
            query.stop()
        (OUT / f"{name}.txt").write_text(text)
        print(name, len(text))
    spark.stop()


if __name__ == "__main__":
    main()
