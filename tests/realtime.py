"""A real-time query (``trigger(realTime=...)``) fed through ``LowLatencyMemoryStream``, the
real-time source in Spark's own jar, for the tests that run one."""

from __future__ import annotations

import json
import time
import uuid
from datetime import UTC, datetime
from typing import Any

BASE = datetime(2026, 1, 1, tzinfo=UTC)


class RealTimeRun:
    """A real-time query over a LowLatencyMemoryStream of ``key,seconds`` strings."""

    # whether the audit replays ``events`` as written (else ``parse`` is its ``prepare=``)
    as_written = False

    def __init__(self, spark: Any, tmp: Any) -> None:
        from pyspark.sql import DataFrame

        jvm = spark._jvm
        self.jvm = jvm
        self.spark = spark
        self.tmp = tmp
        self.stream = (
            jvm.org.apache.spark.sql.execution.streaming.sources.LowLatencyMemoryStream.apply(
                spark._jsparkSession, 1, jvm.org.apache.spark.sql.Encoders.STRING()
            )
        )
        self.frame = DataFrame(self.stream.toDF(), spark)
        self.name = f"rt_{uuid.uuid4().hex[:12]}"
        self.query: Any = None

    @staticmethod
    def parse(frame: Any) -> Any:
        """``key,seconds`` strings as (k, ts): for the stream, and for the audit's replay."""
        from pyspark.sql import functions as F

        parts = F.split("value", ",")
        seconds = parts.getItem(1).cast("double") + BASE.timestamp()
        return frame.select(parts.getItem(0).alias("k"), F.timestamp_seconds(seconds).alias("ts"))

    def events(self) -> Any:
        return self.parse(self.frame).withWatermark("ts", "10 seconds")

    def start(self, frame: Any) -> None:
        sink = str(self.tmp / "out.jsonl")

        def append(record: Any) -> None:  # runs on an executor: one JSON line per output row
            with open(sink, "a") as handle:
                handle.write(json.dumps(record.asDict(recursive=True), default=str) + "\n")

        self.sink = self.tmp / "out.jsonl"
        # every stage of a real-time batch runs at once: one source partition and one shuffle
        # partition fit the two local task slots
        saved = self.spark.conf.get("spark.sql.shuffle.partitions")
        self.spark.conf.set("spark.sql.shuffle.partitions", "1")
        try:
            self._start(frame, append)
        finally:
            self.spark.conf.set("spark.sql.shuffle.partitions", saved)

    def _start(self, frame: Any, append: Any) -> None:
        self.query = (
            frame.writeStream.foreach(append)
            .queryName(self.name)
            .outputMode("update")
            .trigger(realTime="5 seconds")
            .option("checkpointLocation", str(self.tmp / "checkpoint"))
            .start()
        )

    def add(self, *values: str) -> None:
        java_list = self.jvm.java.util.ArrayList()
        for value in values:
            java_list.add(value)
        self.stream.addData(self.jvm.scala.jdk.javaapi.CollectionConverters.asScala(java_list))

    def progress(self) -> list[dict[str, Any]]:
        return [json.loads(p.json()) for p in self.query._jsq.recentProgress()]

    def wait_for(self, done: Any, timeout: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in self.progress():
                if done(p):
                    return p
            if self.query.exception() is not None:
                raise AssertionError(str(self.query.exception()))
            time.sleep(0.1)
        raise AssertionError(f"no such progress within {timeout} s: {self.progress()}")

    def output(self) -> list[dict[str, Any]]:
        if not self.sink.exists():
            return []
        return [json.loads(line) for line in self.sink.read_text().splitlines()]

    def stop(self) -> None:
        if self.query is not None:
            self.query.stop()


class KafkaRealTimeRun(RealTimeRun):
    """The same real-time run over a Kafka topic of one partition (one source task and one
    shuffle task fill ``local[2]``'s two slots), ``key,seconds`` strings as record values;
    ``events`` casts ``value`` to text before parsing it, as a Kafka query does, and is
    audited as written."""

    as_written = True

    def __init__(self, spark: Any, tmp: Any, bootstrap: str) -> None:
        from confluent_kafka.admin import AdminClient, NewTopic

        self.jvm = spark._jvm
        self.spark = spark
        self.tmp = tmp
        self.bootstrap = bootstrap
        self.topic = f"rt_{uuid.uuid4().hex[:10]}"
        admin = AdminClient({"bootstrap.servers": bootstrap})
        admin.create_topics([NewTopic(self.topic, 1, 1)])[self.topic].result(30)
        self.frame = (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", bootstrap)
            .option("subscribe", self.topic)
            .option("startingOffsets", "earliest")
            .load()
        )
        self.name = f"rt_{uuid.uuid4().hex[:12]}"
        self.query = None

    @staticmethod
    def parse(frame: Any) -> Any:
        from pyspark.sql import functions as F

        return RealTimeRun.parse(frame.select(F.col("value").cast("string").alias("value")))

    def events(self) -> Any:
        return self.parse(self.frame).withWatermark("ts", "10 seconds")

    def add(self, *values: str) -> None:
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": self.bootstrap, "linger.ms": 0})
        for value in values:
            producer.produce(self.topic, value.encode(), partition=0)
        assert producer.flush(30) == 0
