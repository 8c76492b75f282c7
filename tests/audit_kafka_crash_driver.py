"""A Spark driver for the Kafka crash test: an audited query over a Kafka topic, status printed.

    python -m tests.audit_kafka_crash_driver <folder> run <bootstrap> <topic> [shape]
    python -m tests.audit_kafka_crash_driver <folder> finish <bootstrap> <topic> [shape]

``run`` loops until killed; ``finish`` processes what the topic holds, syncs the audit and exits.
Shapes: ``dedupe`` (the default; ``dropDuplicates`` on user and event time) and ``window`` (a
count per 10 s window). The query reads JSON records with ``maxOffsetsPerTrigger`` (several
batches per run), writes Parquet to <folder>/out, checkpoints to <folder>/checkpoint and is
audited into <folder>/history.duckdb, with the same parsing passed as ``prepare=``. It runs in
a process of its own (the test kills it), with Spark's Kafka connector from the jar cache.
Status lines are JSON on stdout, one per loop; every progress event is appended to
<folder>/progress.jsonl as it comes (:mod:`tests.harness.crash`).
"""

from __future__ import annotations

import sys

from tests.harness.crash import FAIR, driver_session, record_progress, serve

PER_TRIGGER = 6


def main(folder: str, mode: str, bootstrap: str, topic: str, shape: str = "dedupe") -> int:
    from pyspark.sql import functions as F

    import wmwatch
    from tests.harness.kafka import kafka_stream, parse
    from tests.harness.streams import SCHEMA
    from tests.kafka_broker import connector_jars

    spark = driver_session(
        "wmwatch-kafka-crash-driver", conf={**FAIR, "spark.jars": ",".join(connector_jars())}
    )
    events = parse(SCHEMA)(kafka_stream(spark, bootstrap, topic, PER_TRIGGER)).withWatermark(
        "ts", "10 seconds"
    )
    if shape == "window":
        result = events.groupBy(F.window("ts", "10 seconds")).count()
    else:
        result = events.dropDuplicates(["user", "ts"])
    record_progress(spark, folder)
    watch = wmwatch.attach(spark, db=f"{folder}/history.duckdb", metrics_port=None)
    query = (
        result.writeStream.format("parquet")
        .queryName(f"kafka_{shape}")
        .outputMode("append")
        .option("path", f"{folder}/out")
        .option("checkpointLocation", f"{folder}/checkpoint")
        .start()
    )
    handle = watch.audit(query, events, prepare=parse(SCHEMA), poll_interval_seconds=0.2)
    return serve(spark, watch, [(query, handle)], mode)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:6]))
