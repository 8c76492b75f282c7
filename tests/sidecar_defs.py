"""The query the sidecar tests audit, defined once for the production driver and the sidecar.

``events(spark)`` reads the JSON files of ``$WMWATCH_SIDECAR_TEST_IN`` (one folder per test) with
a 10 s watermark; ``window`` counts them per 10 s window, ``dedupe`` drops duplicates of user
and event time. The sidecar is given ``--events tests.sidecar_defs:events --query
tests.sidecar_defs:window`` (or ``:dedupe``), exactly as a user names their own module.
``kafka_events`` reads the topic ``$WMWATCH_SIDECAR_TEST_TOPIC`` of the broker at
``$WMWATCH_SIDECAR_TEST_KAFKA`` as ``tests/audit_kafka_crash_driver.py`` does.
"""

from __future__ import annotations

import os
from typing import Any

from tests.harness.streams import SCHEMA

IN_VARIABLE = "WMWATCH_SIDECAR_TEST_IN"


def events(spark: Any) -> Any:
    return (
        spark.readStream.schema(SCHEMA)
        .json(os.environ[IN_VARIABLE])
        .withWatermark("ts", "10 seconds")
    )


def window(frame: Any) -> Any:
    from pyspark.sql import functions as F

    return frame.groupBy(F.window("ts", "10 seconds")).count()


def dedupe(frame: Any) -> Any:
    return frame.dropDuplicates(["user", "ts"])


def raises(spark: Any) -> Any:
    raise RuntimeError("no such table: orders")


def batch(spark: Any) -> Any:
    return spark.read.schema(SCHEMA).json(os.environ[IN_VARIABLE])


KAFKA_VARIABLE = "WMWATCH_SIDECAR_TEST_KAFKA"  # bootstrap address
TOPIC_VARIABLE = "WMWATCH_SIDECAR_TEST_TOPIC"


def kafka_events(spark: Any) -> Any:
    """The Kafka query of ``tests/audit_kafka_crash_driver.py``: JSON records parsed, with the
    same 10 s watermark and records per trigger."""
    from tests.audit_kafka_crash_driver import PER_TRIGGER
    from tests.harness.kafka import kafka_stream, parse

    raw = kafka_stream(spark, os.environ[KAFKA_VARIABLE], os.environ[TOPIC_VARIABLE], PER_TRIGGER)
    return parse(SCHEMA)(raw).withWatermark("ts", "10 seconds")
