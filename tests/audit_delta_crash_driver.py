"""A Spark driver for the Delta crash test: an audited query over a Delta table, status printed.

    python -m tests.audit_delta_crash_driver <folder> run <table>
    python -m tests.audit_delta_crash_driver <folder> finish <table>

``run`` loops until killed; ``finish`` processes what the table holds, syncs the audit and exits.
The query deduplicates on user and event time over ``spark.readStream.format("delta")`` of
<table> (``events`` as written: a derived column before the watermark, no ``prepare=``), writes
Parquet to <folder>/out, checkpoints to <folder>/checkpoint and is audited into
<folder>/history.duckdb. It runs in a process of its own (the test kills it), with Delta's jars
from the jar cache and the Delta session settings of ``tests/conftest.py``. Status lines are
JSON on stdout, one per loop; every progress event is appended to <folder>/progress.jsonl
(:mod:`tests.harness.crash`).
"""

from __future__ import annotations

import sys

from tests.harness.crash import FAIR, driver_session, record_progress, serve


def main(folder: str, mode: str, table: str) -> int:
    from pyspark.sql import functions as F

    import wmwatch
    from tests.conftest import jar_set
    from tests.harness.streams import DELAY

    spark = driver_session(
        "wmwatch-delta-crash-driver",
        conf={
            **FAIR,
            "spark.jars": ",".join(jar_set("delta")),
            "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
            "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
            "spark.databricks.delta.snapshotPartitions": "1",
        },
    )
    events = (
        spark.readStream.format("delta")
        .option("maxFilesPerTrigger", 1)  # several batches per run
        .load(table)
        .withColumn("user", F.upper("user"))
        .withWatermark("ts", DELAY)
    )
    record_progress(spark, folder)
    watch = wmwatch.attach(spark, db=f"{folder}/history.duckdb", metrics_port=None)
    query = (
        events.dropDuplicates(["user", "ts"])
        .writeStream.format("parquet")
        .queryName("delta_dedupe")
        .option("path", f"{folder}/out")
        .option("checkpointLocation", f"{folder}/checkpoint")
        .start()
    )
    handle = watch.audit(query, events, poll_interval_seconds=0.2)
    return serve(spark, watch, [(query, handle)], mode)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
