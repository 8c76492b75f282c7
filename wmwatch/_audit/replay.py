"""The Spark side of the audit: read one batch's files again and find the rows it dropped.

Late rows reach the driver in chunks of at most :data:`CHUNK_BYTES` (each row's ``row_data`` is
at most ``max_row_bytes``), never a batch at once; with the Parquet sink, or for a batch with
more late rows than the driver keeps, Spark writes them to Parquet itself. Every Spark job runs
under a deadline (:mod:`wmwatch._core.spark_jobs`) in the audit's own scheduler pool.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from wmwatch._audit.predicates import WINDOW, OperatorSpec
from wmwatch._audit.sinks import LATE_ROW_COLUMNS, BatchLateRows, LateRow
from wmwatch._audit.source import FileSourceSpec
from wmwatch._core.spark_jobs import bounded_job
from wmwatch._errors import AuditError, ConfigError

log = logging.getLogger("wmwatch.audit")

# The most late-row bytes that move from Spark to the driver at once (one chunk).
CHUNK_BYTES = 32 * 1024 * 1024
# Bytes a late row costs besides row_data (three longs, the source path, Python objects).
_ROW_OVERHEAD_BYTES = 256
_SOURCE_FILE_COL = "__wmwatch_source_file"
_WINDOW_COL = "__wmwatch_window"

# stage(batch_id, attempt, rows) -> rows staged: writes one chunk and waits until it is written
Stage = Callable[[int, str, list[LateRow]], int]


class Replayer:
    """Replays the batches of one query's file source and applies its operator's late-row rule."""

    def __init__(
        self,
        *,
        spark: Any,
        query_id: str,
        query_name: str | None,
        label: str,
        source: FileSourceSpec,
        spec: OperatorSpec,
        prepare: Callable[[Any], Any] | None,
        columns: Sequence[str] | None,
        hash_columns: Sequence[str],
        parquet_path: str | None,
        pool: str,
        max_rows_per_batch: int,
        max_row_bytes: int,
        job_timeout_seconds: float,
    ) -> None:
        self.spark = spark
        self.query_id = query_id
        self.query_name = query_name
        self.label = label
        self.source = source
        self.spec = spec
        self.prepare = prepare
        self.columns = tuple(columns) if columns is not None else None
        self.hash_columns = tuple(hash_columns)
        self.parquet_path = parquet_path
        self.pool = pool
        self.max_rows_per_batch = max_rows_per_batch
        self.max_row_bytes = max_row_bytes
        self.job_timeout_seconds = job_timeout_seconds

    def join_pool(self) -> None:
        """Run the calling thread's Spark jobs in the audit's FAIR scheduler pool."""
        with contextlib.suppress(Exception):
            self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", self.pool)

    def replay(
        self,
        batch_id: int,
        paths: list[str],
        run_id: str | None,
        late_wm_ms: int,
        *,
        sink: str,
        stage: Stage,
    ) -> BatchLateRows:
        """The late rows of one batch that read ``paths``, under the late-row watermark."""
        with bounded_job(
            self.spark,
            description=f"wmwatch audit of {self.label} batch {batch_id}",
            timeout_seconds=self.job_timeout_seconds,
            pool=self.pool,
        ):
            late = self.late_rows_frame(paths, late_wm_ms)
            if sink == "parquet":
                return BatchLateRows.all_in_parquet(
                    self.write_parquet(late, batch_id, run_id, late_wm_ms)[0],
                    self.parquet_dir(batch_id),
                )
            return self.fetch(late, batch_id, run_id, late_wm_ms, stage)

    def late_rows_frame(self, paths: list[str], late_wm_ms: int) -> Any:
        """A DataFrame of the late rows among ``paths``, in :data:`LATE_ROW_COLUMNS`."""
        from pyspark.sql import functions as F
        from pyspark.sql.types import StructType

        src = self.source
        reader = self.spark.read.format(src.format).schema(
            StructType.fromJson(json.loads(src.schema_json))
        )
        options = {k: v for k, v in src.options.items() if k.lower() not in ("path", "paths")}
        if (
            len(src.paths) == 1
            and not re.search(r"[*?\[{]", src.paths[0])
            and "basePath" not in options
        ):
            # Keeps partition columns (dir/key=value/file) when single files are read.
            options["basePath"] = src.paths[0]
        raw = reader.options(**options).load(paths)
        raw = raw.withColumn(_SOURCE_FILE_COL, F.col("_metadata.file_path"))
        frame = self.prepare(raw) if self.prepare is not None else raw
        has_source = _SOURCE_FILE_COL in frame.columns
        own_columns = [c for c in frame.columns if c != _SOURCE_FILE_COL]
        ts_name = self.spec.event_time_column
        if ts_name not in frame.columns:
            raise AuditError(
                f"the replayed rows have no column {ts_name!r}; pass event_time= or a prepare= "
                "that produces the column the watermark is on."
            )
        if self.columns is not None:
            missing = [c for c in self.columns if c not in own_columns]
            if missing:
                raise ConfigError(f"columns= names {missing} that the events do not have.")
            own_columns = list(self.columns)
        ts = F.col(ts_name).cast("timestamp")
        watermark = F.timestamp_millis(F.lit(late_wm_ms))
        # A late row is never newer than the watermark (a window ends after each of its rows),
        # and this form of the predicate reaches the file reader: Parquet and ORC skip row
        # groups, JSON and CSV skip converting most of each row.
        frame = frame.where(ts <= watermark)
        if self.spec.kind == WINDOW:
            spec = self.spec
            window = F.window(
                ts,
                f"{spec.window_us} microseconds",
                f"{spec.slide_us} microseconds",
                f"{spec.start_us} microseconds",
            )
            frame = frame.select("*", window.alias(_WINDOW_COL)).where(
                F.col(f"{_WINDOW_COL}.end") <= watermark
            )
            window_start = F.unix_micros(F.col(f"{_WINDOW_COL}.start"))
            window_end = F.unix_micros(F.col(f"{_WINDOW_COL}.end"))
        else:
            window_start = F.lit(None).cast("bigint")
            window_end = F.lit(None).cast("bigint")
        data = [
            F.sha2(F.col(c).cast("string"), 256).alias(c) if c in self.hash_columns else F.col(c)
            for c in own_columns
        ]
        row_json = F.to_json(F.struct(*data))
        # A row too large to keep whole is kept as its size and hash, so that a chunk of rows
        # has a fixed upper bound in bytes however wide the input rows are.
        size = F.octet_length(row_json)
        row_data = F.when(
            size > F.lit(self.max_row_bytes),
            F.to_json(
                F.struct(
                    F.lit(True).alias("_truncated"),
                    size.alias("_bytes"),
                    F.sha2(row_json, 256).alias("_sha256"),
                )
            ),
        ).otherwise(row_json)
        return frame.select(
            F.unix_micros(ts).alias("event_time_us"),
            window_start.alias("window_start_us"),
            window_end.alias("window_end_us"),
            (
                F.regexp_replace(F.col(_SOURCE_FILE_COL), "^file:/+", "/")
                if has_source
                else F.lit(None).cast("string")
            ).alias("source_file"),
            row_data.alias("row_data"),
        )

    def fetch(
        self, late: Any, batch_id: int, run_id: str | None, late_wm_ms: int, stage: Stage
    ) -> BatchLateRows:
        """The batch's late rows for DuckDB, never more than one chunk in the driver at once.

        The common case (a few late rows) is one Spark job: the first chunk's worth plus one row.
        Only when that row exists does the batch count its rows, keep at most
        ``max_rows_per_batch`` of them (``stage``d chunk by chunk), and, with ``parquet_path``,
        have Spark write every one of them to Parquet.
        """
        first_rows = max(1, CHUNK_BYTES // (self.max_row_bytes + _ROW_OVERHEAD_BYTES))
        head = [tuple(r) for r in late.limit(first_rows + 1).collect()]
        if len(head) <= min(first_rows, self.max_rows_per_batch):
            return BatchLateRows(total=len(head), rows=head)
        del head
        from pyspark.sql import functions as F

        overflow = None
        if self.parquet_path is not None:
            # Every row goes to Parquet, which also counts them; the rows kept in DuckDB are
            # then read back from that Parquet rather than parsed from the input again.
            total, data_bytes = self.write_parquet(late, batch_id, run_id, late_wm_ms)
            overflow = self.parquet_dir(batch_id)
            late = self.spark.read.parquet(overflow).select(*LATE_ROW_COLUMNS)
        else:
            totals = late.agg(
                F.count(F.lit(1)).alias("rows"), F.sum(F.octet_length("row_data")).alias("bytes")
            ).collect()[0]
            total, data_bytes = int(totals["rows"]), int(totals["bytes"] or 0)
        kept = min(total, self.max_rows_per_batch)
        row_bytes = data_bytes // max(total, 1) + _ROW_OVERHEAD_BYTES
        chunk_rows = max(1, CHUNK_BYTES // row_bytes)
        attempt = uuid.uuid4().hex
        staged = 0
        if kept:
            # limit() gathers the kept rows in one partition (spilled, not held); repartition
            # spreads them so that each partition, fetched one at a time, is about one chunk.
            source = late.limit(kept)
            partitions = math.ceil(kept / chunk_rows)
            if partitions > 1:
                source = source.repartition(partitions)
            chunk: list[LateRow] = []
            for row in source.toLocalIterator(prefetchPartitions=False):
                chunk.append(tuple(row))
                if len(chunk) >= chunk_rows:
                    staged += stage(batch_id, attempt, chunk)
                    chunk = []
            if chunk:
                staged += stage(batch_id, attempt, chunk)
        log.warning(
            "wmwatch: audit of %s batch %d found %s late rows: kept %s in DuckDB "
            "(max_rows_per_batch=%d), %s",
            self.label,
            batch_id,
            f"{total:,}",
            f"{staged:,}",
            self.max_rows_per_batch,
            f"all {total:,} written to {overflow}"
            if overflow
            else f"{total - staged:,} counted only (set parquet_path= to keep every row)",
        )
        return BatchLateRows(
            total=total, attempt=attempt, staged=staged, overflow_location=overflow
        )

    def parquet_dir(self, batch_id: int) -> str:
        assert self.parquet_path is not None
        return f"{self.parquet_path.rstrip('/')}/{self.query_id}/batch-{batch_id:012d}"

    def write_parquet(
        self, late: Any, batch_id: int, run_id: str | None, late_wm_ms: int
    ) -> tuple[int, int]:
        """Have Spark write the batch's late rows to its Parquet folder; (rows, row_data bytes)."""
        from pyspark.sql import Observation
        from pyspark.sql import functions as F

        directory = self.parquet_dir(batch_id)
        audited_at_us = int(time.time() * 1_000_000)
        out = late.select(
            F.lit(self.query_id).alias("query_id"),
            F.lit(self.query_name).cast("string").alias("query_name"),
            F.lit(run_id).cast("string").alias("run_id"),
            F.lit(batch_id).cast("bigint").alias("batch_id"),
            "event_time_us",
            F.lit(late_wm_ms * 1000).cast("bigint").alias("watermark_us"),
            ((F.lit(late_wm_ms * 1000) - F.col("event_time_us")) / 1e6).alias("lateness_seconds"),
            "window_start_us",
            "window_end_us",
            F.lit(self.spec.kind).alias("operator_kind"),
            "source_file",
            "row_data",
            F.lit(audited_at_us).cast("bigint").alias("audited_at_us"),
        )
        written = Observation(f"wmwatch_audit_{batch_id}_{uuid.uuid4().hex[:8]}")
        observed = out.observe(
            written,
            F.count(F.lit(1)).alias("rows"),
            F.sum(F.octet_length("row_data")).alias("bytes"),
        )
        # Overwrite makes a re-run after a crash replace, not add to, what a first attempt wrote.
        observed.write.mode("overwrite").parquet(directory)
        return int(written.get["rows"]), int(written.get["bytes"] or 0)
