"""The Spark side of the audit: one batch's input read again (each input through its
:class:`~wmwatch._audit.replay.sources.base.BatchSource`), put through ``events``, and the rows
the batch's late-row rule dropped found.

Late rows reach the driver in chunks of at most :data:`CHUNK_BYTES` (each row's ``row_data`` is
at most ``max_row_bytes``), never a batch at once; with the Parquet sink, or for a batch with
more late rows than the driver keeps, Spark writes them to Parquet itself. Every Spark job runs
under a deadline (:mod:`wmwatch._core.spark_jobs`) in the audit's own scheduler pool. Over 500
lines as one class: a batch's late-row frame, its chunked fetch to the driver and its Parquet
write share the batch's plan, pool and deadline.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from wmwatch._audit.replay.predicates import SESSION, WINDOW, OperatorSpec
from wmwatch._audit.replay.sources.base import ATTACHED_COLUMNS, SOURCE_FILE_COL, BatchSource
from wmwatch._audit.sinks import (
    LATE_ROW_COLUMNS,
    LATE_ROW_OVERHEAD_BYTES,
    BatchLateRows,
    InputCount,
    LateRow,
    local_path,
)
from wmwatch._core.sessions import is_connect
from wmwatch._core.spark_jobs import bounded_job
from wmwatch._errors import AuditError, ConfigError
from wmwatch._text import spark_redact

log = logging.getLogger("wmwatch.audit")

# The most late-row bytes that move from Spark to the driver at once (one chunk).
CHUNK_BYTES = 32 * 1024 * 1024
_WINDOW_COL = "__wmwatch_window"
_INPUT_COLUMNS = ("operator_index", "operator_kind", "join_side", "source_index")
# The one-row frame that carries the HMAC key's pads to the executors (see hmac_pads).
_PAD_COLUMNS = ("__wmwatch_hmac_inner", "__wmwatch_hmac_outer")
_SHA256_BLOCK_BYTES = 64

# stage(batch_id, attempt, rows) -> rows staged: writes one chunk and waits until it is written
Stage = Callable[[int, str, list[LateRow]], int]


@dataclass(frozen=True)
class HmacPads:
    """HMAC-SHA256's two padded keys (RFC 2104): ``HMAC(K, m) = H(outer || H(inner || m))``.
    Never printed: either pad gives the key back."""

    inner: bytes = field(repr=False)
    outer: bytes = field(repr=False)


def hmac_pads(key: bytes) -> HmacPads:
    """The pads of HMAC-SHA256 under ``key``, so that executors compute the HMAC with ``sha2``
    alone (Spark's ``hmac`` function is 4.3 or later; wmwatch supports Spark 4.0 on)."""
    if len(key) > _SHA256_BLOCK_BYTES:
        key = hashlib.sha256(key).digest()
    block = key.ljust(_SHA256_BLOCK_BYTES, b"\x00")
    return HmacPads(inner=bytes(b ^ 0x36 for b in block), outer=bytes(b ^ 0x5C for b in block))


@dataclass(frozen=True)
class ReplayInput:
    """One input the audit replays: a source, how its rows become the operator's input
    (``prepare``), and the late-row rule of the stateful operator (and join side) it feeds."""

    source: BatchSource
    spec: OperatorSpec
    prepare: Callable[[Any], Any] | None = None
    join_keys: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        side = f" {self.spec.side} side" if self.spec.side else ""
        return f"operator {self.spec.operator_index} ({self.spec.kind}{side})"


class Replayer:
    """Replays a query's batches, input by input, and applies each input's late-row rule."""

    def __init__(
        self,
        *,
        spark: Any,
        query_id: str,
        query_name: str | None,
        label: str,
        inputs: Sequence[ReplayInput],
        columns: Sequence[str] | None,
        hash_columns: Sequence[str],
        parquet_path: str | None,
        pool: str,
        max_rows_per_batch: int,
        max_row_bytes: int,
        job_timeout_seconds: float,
        one_task: bool = False,
        hash_key: bytes | None = None,
    ) -> None:
        self.spark = spark
        self.query_id = query_id
        self.query_name = query_name
        self.label = label
        self.inputs = tuple(inputs)
        self.columns = tuple(columns) if columns is not None else None
        self.hash_columns = tuple(hash_columns)
        self.parquet_path = parquet_path
        self.pool = pool
        self.max_rows_per_batch = max_rows_per_batch
        self.max_row_bytes = max_row_bytes
        self.job_timeout_seconds = job_timeout_seconds
        self.one_task = one_task
        self.pads = hmac_pads(hash_key) if hash_key is not None else None
        self._pads_frame: Any = None

    def join_pool(self) -> None:
        """Run the calling thread's Spark jobs in the audit's FAIR scheduler pool."""
        with contextlib.suppress(Exception):
            self.spark.sparkContext.setLocalProperty("spark.scheduler.pool", self.pool)

    def replay(
        self,
        batch_id: int,
        reads: Sequence[tuple[ReplayInput, Any]],
        run_id: str | None,
        late_wm_ms: int,
        *,
        sink: str,
        stage: Stage,
        reported_wm_ms: int | None = None,
    ) -> BatchLateRows:
        """The late rows of one batch under the late-row watermark; ``reads`` pairs each input
        that read data in the batch with what its source needs to read that data again.

        With ``reported_wm_ms`` (the watermark the batch reported, above the one it judged late
        rows with) it also counts the rows the batch kept although that watermark had passed
        them: the rows the same rule would call late under it, and not under the older one.
        """
        with (
            bounded_job(
                self.spark,
                description=f"wmwatch audit of {self.label} batch {batch_id}",
                timeout_seconds=self.job_timeout_seconds,
                pool=self.pool,
            ),
            self.checked(reads),
        ):
            frames = [
                self.late_rows_frame(item, self._read(item, what), late_wm_ms)
                for item, what in reads
            ]
            late = frames[0]
            for frame in frames[1:]:
                late = late.unionByName(frame)
            kept_behind = None
            if reported_wm_ms is not None:
                kept_behind = (
                    self.count_kept_behind(reads, late_wm_ms, reported_wm_ms)
                    if reported_wm_ms > late_wm_ms
                    else 0
                )
            found = self._late_rows(late, batch_id, run_id, late_wm_ms, sink, stage, reads)
        return replace(found, kept_behind_watermark=kept_behind)

    def count_kept_behind(
        self, reads: Sequence[tuple[ReplayInput, Any]], late_wm_ms: int, reported_wm_ms: int
    ) -> int:
        """Rows late under the reported watermark but not under the late-row one (one count)."""
        from pyspark.sql import functions as F

        behind = None
        for item, what in reads:
            frame = self.late_rows_frame(item, self._read(item, what), reported_wm_ms)
            behind = frame if behind is None else behind.unionByName(frame)
        assert behind is not None
        rule_us = F.coalesce(F.col("window_end_us"), F.col("event_time_us"))
        return int(behind.where(rule_us > F.lit(late_wm_ms * 1000)).count())

    def _late_rows(
        self,
        late: Any,
        batch_id: int,
        run_id: str | None,
        late_wm_ms: int,
        sink: str,
        stage: Stage,
        reads: Sequence[tuple[ReplayInput, Any]],
    ) -> BatchLateRows:
        """The batch's late rows into the sink: written by Spark, or fetched for DuckDB."""
        if sink == "parquet":
            total = self.write_parquet(late, batch_id, run_id, late_wm_ms)[0]
            return BatchLateRows(
                total=total,
                parquet_location=self.parquet_dir(batch_id),
                by_input=self.input_counts(
                    self.spark.read.parquet(self.parquet_dir(batch_id)), reads
                )
                if total
                else (),
            )
        return self.fetch(late, batch_id, run_id, late_wm_ms, stage, reads)

    @contextlib.contextmanager
    def checked(self, reads: Sequence[tuple[ReplayInput, Any]]) -> Iterator[None]:
        """Run the body's jobs over ``reads``, then let each source say whether what they read
        was the batch's (:meth:`~wmwatch._audit.replay.sources.base.BatchSource.after_read`),
        whether the jobs failed or not: a source that says no turns the replay into a lost
        batch (``CheckpointEntryGone``) rather than an error retried forever or rows audited
        from other data."""
        try:
            yield
        except Exception as exc:
            for item, what in reads:
                item.source.after_read(self.spark, what, exc)
            raise
        for item, what in reads:
            item.source.after_read(self.spark, what, None)

    def _read(self, item: ReplayInput, what: Any) -> Any:
        raw = item.source.read(self.spark, what)
        # beside a real-time query a replay takes one task slot at a time (see the auditor)
        return raw.coalesce(1) if self.one_task else raw

    def late_rows_frame(
        self, item: ReplayInput, raw: Any, late_wm_ms: int, *, keep: Sequence[str] = ()
    ) -> Any:
        """A DataFrame of the late rows of one input's raw rows, in :data:`LATE_ROW_COLUMNS`
        (then the attached columns named in ``keep``, null where the rows lost them)."""
        from pyspark.sql import functions as F
        from pyspark.sql.types import StructType

        frame = item.prepare(raw) if item.prepare is not None else raw
        has_source = SOURCE_FILE_COL in frame.columns
        own_columns = [c for c in frame.columns if c not in ATTACHED_COLUMNS]
        spec = item.spec
        ts_name = spec.event_time_column
        if ts_name not in frame.columns:
            raise AuditError(
                f"the replayed rows have no column {ts_name!r}; pass event_time= or a prepare= "
                "that produces the column the watermark is on."
            )
        if self.columns is not None:
            if len(self.inputs) == 1:
                missing = [c for c in self.columns if c not in own_columns]
                if missing:
                    raise ConfigError(f"columns= names {missing} that the events do not have.")
            own_columns = [c for c in self.columns if c in own_columns]
        column = frame.schema[ts_name]
        struct_end = isinstance(column.dataType, StructType) and "end" in column.dataType.names
        # a window struct (a join keyed by windows) is judged by its end, as Spark does
        ts = F.col(f"{ts_name}.end" if struct_end else ts_name).cast("timestamp")
        watermark = F.timestamp_millis(F.lit(late_wm_ms))
        # A late row is never newer than the watermark (a window or session ends after each of
        # its rows), and this form of the predicate reaches the file reader: Parquet and ORC
        # skip row groups, JSON and CSV skip converting most of each row.
        frame = frame.where(ts <= watermark)
        if spec.kind == WINDOW:
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
        elif struct_end:
            window_start = F.unix_micros(F.col(f"{ts_name}.start").cast("timestamp"))
            window_end = F.unix_micros(ts)
        elif spec.kind == SESSION:
            # the session the row opens on its own: [ts, ts + gap); Spark drops the row when
            # that session would have ended by the watermark
            assert spec.gap_us is not None
            window_start = F.unix_micros(ts)
            window_end = window_start + F.lit(spec.gap_us)
            frame = frame.where(window_end <= F.lit(late_wm_ms * 1000))
        else:
            window_start = F.lit(None).cast("bigint")
            window_end = F.lit(None).cast("bigint")
        # join keys go through the same allow-list and hashing as row_data: often they are
        # user ids or e-mails
        keys = [k for k in item.join_keys if k in frame.columns]
        if self.columns is not None:
            keys = [k for k in keys if k in self.columns]
        if self.pads is not None and any(c in self.hash_columns for c in [*own_columns, *keys]):
            frame = frame.crossJoin(F.broadcast(self.pads_frame()))
        data = [self.protected(c) for c in own_columns]
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
        join_key = (
            F.to_json(F.struct(*[self.protected(k) for k in keys]))
            if keys
            else F.lit(None).cast("string")
        )
        return frame.select(
            F.unix_micros(ts).alias("event_time_us"),
            window_start.alias("window_start_us"),
            window_end.alias("window_end_us"),
            (
                spark_redact(F.regexp_replace(F.col(SOURCE_FILE_COL), "^file:/+", "/"))
                if has_source
                else F.lit(None).cast("string")
            ).alias("source_file"),
            row_data.alias("row_data"),
            F.lit(spec.kind).alias("operator_kind"),
            F.lit(spec.operator_index).cast("int").alias("operator_index"),
            F.lit(spec.side).cast("string").alias("join_side"),
            F.lit(item.source.source_index).cast("int").alias("source_index"),
            join_key.alias("join_key"),
            *[
                (F.col(c) if c in frame.columns else F.lit(None).cast("string")).alias(c)
                for c in keep
            ],
        )

    def protected(self, name: str) -> Any:
        """Column ``name`` as the audit stores it: its value, or its hash when it is one of
        ``hash_columns`` (SHA-256, or HMAC-SHA256 under ``hash_key``; lowercase hex)."""
        from pyspark.sql import functions as F

        if name not in self.hash_columns:
            return F.col(name)
        value = F.col(name).cast("string").cast("binary")
        if self.pads is None:
            digest = F.sha2(value, 256)
        else:
            inner_col, outer_col = _PAD_COLUMNS
            inner = F.unhex(F.sha2(F.concat(F.col(inner_col), value), 256))
            digest = F.sha2(F.concat(F.col(outer_col), inner), 256)
        return digest.alias(name)

    def pads_frame(self) -> Any:
        """One row holding the HMAC pads. Joined rather than written as literals, so the key
        never appears in a plan (Spark UI, event logs, explain output)."""
        if self._pads_frame is None:
            assert self.pads is not None
            from pyspark.sql.types import BinaryType, StructField, StructType

            schema = StructType([StructField(c, BinaryType(), False) for c in _PAD_COLUMNS])
            self._pads_frame = self.spark.createDataFrame(
                [(bytearray(self.pads.inner), bytearray(self.pads.outer))], schema
            )
        return self._pads_frame

    def input_counts(
        self, late: Any, reads: Sequence[tuple[ReplayInput, Any]]
    ) -> tuple[InputCount, ...]:
        """Every late row of the batch counted per input (one small aggregation)."""
        groups = late.groupBy(*_INPUT_COLUMNS).count().collect()
        return _counts({_group_key(g): int(g["count"]) for g in groups}, reads)

    def fetch(
        self,
        late: Any,
        batch_id: int,
        run_id: str | None,
        late_wm_ms: int,
        stage: Stage,
        reads: Sequence[tuple[ReplayInput, Any]],
    ) -> BatchLateRows:
        """The batch's late rows for DuckDB, never more than one chunk in the driver at once.

        The common case (a few late rows) is one Spark job: the first chunk's worth plus one row.
        Only when that row exists does the batch count its rows, keep at most
        ``max_rows_per_batch`` of them (``stage``d chunk by chunk), and, with ``parquet_path``,
        have Spark write every one of them to Parquet.
        """
        first_rows = max(1, CHUNK_BYTES // (self.max_row_bytes + LATE_ROW_OVERHEAD_BYTES))
        head = [tuple(r) for r in late.limit(first_rows + 1).collect()]
        if len(head) <= min(first_rows, self.max_rows_per_batch):
            return BatchLateRows(
                total=len(head), rows=head, by_input=_counts(_count_rows(head), reads)
            )
        del head
        from pyspark.sql import functions as F

        overflow = None
        if self.parquet_path is not None:
            # Every row goes to Parquet, which also counts them; the rows kept in DuckDB are
            # then read back from that Parquet rather than parsed from the input again.
            total, data_bytes = self.write_parquet(late, batch_id, run_id, late_wm_ms)
            overflow = self.parquet_dir(batch_id)
            late = self.spark.read.parquet(overflow).select(*LATE_ROW_COLUMNS)
            by_input = self.input_counts(late, reads)
        else:
            groups = (
                late.groupBy(*_INPUT_COLUMNS)
                .agg(
                    F.count(F.lit(1)).alias("rows"),
                    F.sum(F.octet_length("row_data")).alias("bytes"),
                )
                .collect()
            )
            total = sum(int(g["rows"]) for g in groups)
            data_bytes = sum(int(g["bytes"] or 0) for g in groups)
            by_input = _counts({_group_key(g): int(g["rows"]) for g in groups}, reads)
        kept = min(total, self.max_rows_per_batch)
        row_bytes = data_bytes // max(total, 1) + LATE_ROW_OVERHEAD_BYTES
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
            for row in _partition_by_partition(source, partitions):
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
            total=total,
            attempt=attempt,
            staged=staged,
            overflow_location=overflow,
            by_input=by_input,
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
            "operator_kind",
            "source_file",
            "row_data",
            F.lit(audited_at_us).cast("bigint").alias("audited_at_us"),
            "operator_index",
            "join_side",
            "source_index",
            "join_key",
        )
        written = Observation(f"wmwatch_audit_{batch_id}_{uuid.uuid4().hex[:8]}")
        observed = out.observe(
            written,
            F.count(F.lit(1)).alias("rows"),
            F.sum(F.octet_length("row_data")).alias("bytes"),
        )
        # Late rows are row payloads (often personal data); Spark writes with the umask (files
        # 0644), so the query's folder is made owner-only first (nobody else can enter it while
        # Spark writes) and what Spark wrote is made owner-only after.
        private_folder(directory.rsplit("/", 1)[0])
        # Overwrite makes a re-run after a crash replace, not add to, what a first attempt wrote.
        observed.write.mode("overwrite").parquet(directory)
        private_tree(directory)
        return int(written.get["rows"]), int(written.get["bytes"] or 0)


_PRIVATE_DIR_MODE = 0o700
_PRIVATE_FILE_MODE = 0o600


def private_folder(location: str) -> None:
    """Create ``location`` (a local folder) owner-only, or make it so."""
    local = local_path(location)
    if local is None:
        return
    try:
        os.makedirs(local, mode=_PRIVATE_DIR_MODE, exist_ok=True)
        if not os.path.islink(local):
            os.chmod(local, _PRIVATE_DIR_MODE)
    except OSError as exc:
        log.warning("wmwatch: cannot make %s owner-only: %s", local, exc.strerror or exc)


def private_tree(location: str) -> None:
    """Make every folder and file under ``location`` (a local folder) owner-only; links are
    left alone, never followed."""
    local = local_path(location)
    if local is None:
        return
    try:
        private_folder(local)
        for root, dirs, files in os.walk(local):
            for name in dirs + files:
                path = os.path.join(root, name)
                if not os.path.islink(path):
                    mode = _PRIVATE_DIR_MODE if name in dirs else _PRIVATE_FILE_MODE
                    os.chmod(path, mode)
    except OSError as exc:
        log.warning("wmwatch: cannot make %s owner-only: %s", local, exc.strerror or exc)


_InputKey = tuple[int, str, str | None, int]


def _group_key(group: Any) -> _InputKey:
    """The input a row of a per-input aggregation stands for."""
    return (
        int(group["operator_index"]),
        str(group["operator_kind"]),
        group["join_side"],
        int(group["source_index"]),
    )


def _count_rows(rows: Sequence[LateRow]) -> dict[_InputKey, int]:
    at = {name: LATE_ROW_COLUMNS.index(name) for name in _INPUT_COLUMNS}
    counted: dict[_InputKey, int] = {}
    for row in rows:
        key = (
            int(row[at["operator_index"]]),
            str(row[at["operator_kind"]]),
            row[at["join_side"]],
            int(row[at["source_index"]]),
        )
        counted[key] = counted.get(key, 0) + 1
    return counted


def _counts(
    counted: dict[_InputKey, int], reads: Sequence[tuple[ReplayInput, Any]]
) -> tuple[InputCount, ...]:
    """One count per input that was replayed (zero when it lost no row), in input order."""
    out = []
    for item, _ in reads:
        spec = item.spec
        key = (spec.operator_index, spec.kind, spec.side, item.source.source_index)
        out.append(InputCount(key[0], key[1], key[2], key[3], counted.get(key, 0)))
    return tuple(out)


def _partition_by_partition(frame: Any, partitions: int) -> Iterator[Any]:
    """The rows of ``frame``, fetched one partition at a time.

    Classic PySpark's ``toLocalIterator`` runs one job per partition. A Spark Connect client's
    streams the whole result at once, so there the rows are first held by the executors
    (``localCheckpoint``) and then fetched partition by partition, each its own small job.
    """
    if not is_connect(frame):
        yield from frame.toLocalIterator(prefetchPartitions=False)
        return
    from pyspark.sql import functions as F

    held = frame.localCheckpoint(eager=True)
    for partition in range(max(1, partitions)):
        yield from held.where(F.spark_partition_id() == partition).collect()
