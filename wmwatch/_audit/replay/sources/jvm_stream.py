"""Reading a batch of a JVM streaming source (a DataSource V2 ``MicroBatchStream``) again, real-time
mode included: a batch DataFrame over the partitions the stream plans between the batch's two
logged offsets, read by executors through the stream's own reader factory. Which streams it
reaches, and why Kafka's is not one of them: docs/audit-sources.md (JVM streams).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.replay.sources.base import SOURCE_FILE_COL, Found, SourceKind
from wmwatch._checkpoint.reader import CheckpointReader, logged_offsets
from wmwatch._errors import UnsupportedSourceError
from wmwatch._text import first_line

# the stream interface whose planInputPartitions(start, end) is the batch-restart contract
_MICRO_BATCH_STREAM = "org.apache.spark.sql.connector.read.streaming.MicroBatchStream"
# streams that still hold a committed batch's rows (the micro-batch MemoryStream drops them on
# commit, so a replay of it would find nothing and look like "no late rows")
_KEEPS_COMMITTED_DATA = frozenset(
    {"org.apache.spark.sql.execution.streaming.sources.LowLatencyMemoryStream"}
)


def stream_of(spark: Any, relation: Any) -> Any | None:
    """The V2 stream a streaming relation (JVM logical plan node) reads, where its table holds
    one (a memory stream); None otherwise."""
    try:
        if str(relation.nodeName()) != "StreamingRelationV2":
            return None
        table = relation.table()
        if not str(table.getClass().getName()).endswith(".MemoryStreamTable"):
            return None
        stream = table.stream()
        if str(stream.getClass().getName()) not in _KEEPS_COMMITTED_DATA:
            return None
        micro_batch = spark.sparkContext._jvm.java.lang.Class.forName(_MICRO_BATCH_STREAM)
        return stream if micro_batch.isInstance(stream) else None
    except Exception:  # noqa: BLE001 - not a V2 stream the audit can read again
        return None


def _found(spark: Any, events: Any, relation: Any, positions: list[int], plan_text: str) -> Found:
    stream = stream_of(spark, relation)
    if stream is None:  # matched a moment ago: its table no longer holds that stream
        raise UnsupportedSourceError(
            f"events reads {first_line(str(relation.toString()), 120)}, whose stream cannot be "
            "read again."
        )
    schema_json = str(relation.schema().json())
    what = str(stream.toString())[:200]
    return Found(
        positions,
        lambda index: JvmStreamBatchSource(stream, schema_json, index, what),
        f"stream {what}",
    )


@dataclass(frozen=True, slots=True)
class JvmStreamBatchSource:
    """A JVM V2 stream: batch N read from ``offsets/N-1``'s offset to ``offsets/N``'s."""

    stream: Any = field(compare=False)
    schema_json: str
    index: int
    description: str

    @property
    def source_index(self) -> int:
        return self.index

    def batch_input(self, checkpoint: CheckpointReader, batch_id: int) -> tuple[str, str] | None:
        return logged_offsets(
            checkpoint, batch_id, self.index, lambda: str(self.stream.initialOffset().json())
        )

    def read(self, spark: Any, what: Any) -> Any:
        """The rows between two logged offsets, read by executors through the stream's own
        partitions and reader factory."""
        from pyspark.sql import DataFrame
        from pyspark.sql import functions as F

        start, end = what
        stream = self.stream
        partitions = stream.planInputPartitions(
            stream.deserializeOffset(start), stream.deserializeOffset(end)
        )
        jvm = spark.sparkContext._jvm
        options = jvm.java.util.ArrayList()
        for partition in partitions:
            options.add(jvm.scala.Option.apply(partition))
        utils = jvm.org.apache.spark.api.python.PythonUtils
        rdd = jvm.org.apache.spark.sql.execution.datasources.v2.DataSourceRDD(
            spark.sparkContext._jsc.sc(),
            utils.toSeq(options),
            stream.createReaderFactory(),
            False,
            utils.toScalaMap(jvm.java.util.HashMap()),
        )
        schema = jvm.org.apache.spark.sql.types.DataType.fromJson(self.schema_json)
        frame = DataFrame(spark._jsparkSession.internalCreateDataFrame(rdd, schema, False), spark)
        return frame.withColumn(SOURCE_FILE_COL, F.lit(None).cast("string"))

    def after_read(self, spark: Any, what: Any, error: BaseException | None) -> None:
        return None  # the stream's own reader over its own offsets: the same rows


KIND = SourceKind(
    name="jvm_stream",
    matches=lambda spark, relation: stream_of(spark, relation) is not None,
    found=_found,
)
