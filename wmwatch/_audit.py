"""The late-row audit: every input row a query's stateful operator drops as late, in a table.

Design (chosen over a side streaming query, see the README): after the production query commits
batch N, replay exactly N's input and apply N's late-row rule in Spark.

- *Which rows*: the files batch N read, from the production checkpoint (offsets + the file
  source's log, see :mod:`wmwatch._checkpoint`); files are immutable, so re-reading gives N's rows.
- *Which rule*: the watermark in ``offsets/N-1`` (Spark's late-row filter in N uses the previous
  batch's watermark) and the operator's predicate (:mod:`wmwatch._audit_predicates`).
- *Cheap when nothing is late*: when progress says N's smallest event time cannot be late, N is
  recorded as audited with 0 rows and no Spark job runs.
- *Exactly once*: the late rows of N and its ``audit_batches`` marker are written in one DuckDB
  transaction after deleting N's rows (Parquet: the batch directory is overwritten first, the
  marker written after); on start the audit resumes after the batches already marked.

The work runs on the audit's own thread in its own FAIR scheduler pool; the plugin hook on the
watch's worker thread only records "batch N finished, min event time X" and wakes that thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from wmwatch._audit_predicates import (
    WINDOW,
    OperatorSpec,
    PlanFacts,
    apply_overrides,
    batch_may_have_late_rows,
    parse_plan,
)
from wmwatch._checkpoint import CheckpointReader, HadoopFileSystem, local_root, normalise_path
from wmwatch._errors import AuditError, ConfigError, UnsupportedSourceError
from wmwatch._plugins import WatchPlugin
from wmwatch._progress import ProgressSnapshot, query_label

log = logging.getLogger("wmwatch.audit")

SUPPORTED_FORMATS = ("json", "csv", "parquet", "orc", "text", "avro")
SINKS = ("duckdb", "parquet")
_SOURCE_FILE_COL = "__wmwatch_source_file"
_WINDOW_COL = "__wmwatch_window"
_EPOCH_SQL = "(TIMESTAMPTZ '1970-01-01 00:00:00+00' + to_microseconds({}))"
_LATE_ROW_COLUMNS = (
    "event_time_us",
    "window_start_us",
    "window_end_us",
    "source_file",
    "row_data",
)


@dataclass(frozen=True, slots=True)
class FileSourceSpec:
    """How to read the production query's file source again, as a batch."""

    format: str
    schema_json: str
    options: dict[str, str]
    paths: tuple[str, ...]
    source_index: int = 0


@dataclass
class _BatchInfo:
    min_event_time_ms: int | None = None
    run_id: str | None = None


@dataclass
class _Counters:
    batches_audited: int = 0
    batches_replayed: int = 0
    batches_skipped: int = 0
    late_rows: int = 0
    errors: int = 0
    last_error: str | None = None
    last_audited_batch: int | None = None
    latest_committed_batch: int | None = None
    oldest_pending_commit_at: float | None = None
    replay_seconds: float = 0.0
    started_at: float = field(default_factory=time.time)


def _jvm_of(spark: Any) -> Any:
    return spark.sparkContext._jvm


def _scala_map(spark: Any, scala_map: Any) -> dict[str, str]:
    converted = _jvm_of(spark).scala.jdk.javaapi.CollectionConverters.asJava(scala_map)
    return {str(k): str(v) for k, v in dict(converted).items()}


def _scala_seq(spark: Any, seq: Any) -> list[str]:
    return [str(x) for x in _jvm_of(spark).scala.jdk.javaapi.CollectionConverters.asJava(seq)]


def _plan_nodes(node: Any) -> Iterable[Any]:
    """Pre-order walk of a JVM logical plan."""
    yield node
    children = node.children()
    for i in range(children.size()):
        yield from _plan_nodes(children.apply(i))


def file_source_of(spark: Any, events: Any, *, has_prepare: bool) -> FileSourceSpec:
    """The file source ``events`` reads, from its logical plan (classic PySpark only)."""
    jdf = getattr(events, "_jdf", None)
    if jdf is None:
        raise AuditError(
            "events is not a classic PySpark DataFrame (Spark Connect?); the audit needs the driver "
            "JVM to read the source and checkpoint, so run it in the driver process."
        )
    if not events.isStreaming:
        raise ConfigError(
            "events must be the streaming DataFrame the query reads (spark.readStream...)."
        )
    plan = jdf.queryExecution().analyzed()
    nodes = list(_plan_nodes(plan))
    relations = [n for n in nodes if n.nodeName().startswith("Streaming")]
    if len(relations) != 1:
        raise UnsupportedSourceError(
            f"events reads {len(relations)} streaming sources; the audit replays exactly one file "
            f"source ({', '.join(SUPPORTED_FORMATS)}): pass the DataFrame of that source."
        )
    relation = relations[0]
    if relation.nodeName() != "StreamingRelation":
        raise UnsupportedSourceError(
            f"events reads {relation.toString().splitlines()[0][:120]}, which cannot be replayed "
            f"batch by batch; the audit supports file sources ({', '.join(SUPPORTED_FORMATS)})."
        )
    ds = relation.dataSource()
    fmt = str(ds.className())
    short = fmt.rsplit(".", 1)[-1].lower()
    short = {
        "jsonfileformat": "json",
        "csvfileformat": "csv",
        "parquetfileformat": "parquet",
        "orcfileformat": "orc",
        "textfileformat": "text",
        "avrofileformat": "avro",
    }.get(short, short)
    if short not in SUPPORTED_FORMATS:
        raise UnsupportedSourceError(
            f"events reads a {fmt!r} source, which cannot be replayed batch by batch; the audit "
            f"supports file sources ({', '.join(SUPPORTED_FORMATS)})."
        )
    options = _scala_map(spark, ds.options())
    clean = options.get("cleanSource", "off").lower()
    if clean != "off":
        raise UnsupportedSourceError(
            f"the file source moves or deletes its files (cleanSource={clean}), so batches cannot "
            "be read again; turn cleanSource off to audit this query."
        )
    paths = tuple(_scala_seq(spark, ds.paths()))
    if not paths and "path" in options:
        paths = (options["path"],)
    if not has_prepare:
        extra = [
            n.nodeName()
            for n in nodes
            if n.nodeName() not in ("EventTimeWatermark", "StreamingRelation")
        ]
        if extra:
            raise AuditError(
                f"events transforms the source ({', '.join(dict.fromkeys(extra))}); pass prepare=, "
                "a function that turns the raw source DataFrame into events, so batches can be replayed."
            )
    return FileSourceSpec(
        format=short, schema_json=str(relation.schema().json()), options=options, paths=paths
    )


def _source_index(plan_text: str, source: FileSourceSpec) -> int:
    """Position of the source in the query's source list (= the checkpoint's sources/<i>)."""
    found = re.findall(
        r"(StreamingRelation\w*|StreamingExecutionRelation|StreamingDataSourceV2\w*) (\S+?)\[([^\]]*)\]",
        plan_text,
    )
    if len(found) <= 1:
        return 0
    wanted = {normalise_path(p) for p in source.paths}
    matches = [i for i, (_, _, path) in enumerate(found) if normalise_path(path) in wanted]
    if len(matches) != 1:
        raise UnsupportedSourceError(
            "the query reads several sources and the audited file source cannot be matched to one "
            "of them by path; audit a query that reads one file source."
        )
    return matches[0]


def _ms(at: datetime | None) -> int | None:
    if at is None:
        return None
    return int((at - datetime(1970, 1, 1, tzinfo=UTC)).total_seconds() * 1000 // 1)


class AuditHandle:
    """A running audit: ``status()``, ``sync()`` and ``stop()``."""

    def __init__(self, auditor: _Auditor) -> None:
        self._auditor = auditor

    @property
    def query_id(self) -> str:
        return self._auditor.query_id

    @property
    def spec(self) -> OperatorSpec:
        return self._auditor.spec

    def status(self) -> dict[str, Any]:
        """Batches audited, last audited batch, late rows, lag, errors (a fresh dict)."""
        return self._auditor.status()

    def sync(self, timeout: float = 60.0) -> bool:
        """Wait until every batch committed so far is audited and written; True if it was."""
        return self._auditor.sync(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop auditing (what is committed to the store stays; a later audit resumes)."""
        self._auditor.stop(timeout)

    def __enter__(self) -> AuditHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class AuditPlugin(WatchPlugin):
    """Hooks the audit onto the watch: wake-ups from progress, metrics at scrape time."""

    name = "audit"

    def __init__(self, auditor: _Auditor) -> None:
        self._auditor = auditor

    def on_progress(self, snapshot: ProgressSnapshot) -> None:
        if snapshot.query_id == self._auditor.query_id:
            self._auditor.note_progress(
                snapshot.batch_id,
                _ms(snapshot.event_time_min_at),
                snapshot.run_id,
                has_rows=bool(snapshot.input_rows),
            )

    def on_query_terminated(self, event: Any) -> None:
        if getattr(event, "query_id", None) == self._auditor.query_id:
            self._auditor.wake()

    def collect(self) -> Iterable[Metric]:
        return self._auditor.metrics()

    def close(self) -> None:
        self._auditor.stop(10.0)


class _Auditor:
    def __init__(
        self,
        *,
        spark: Any,
        store: Any,
        query_id: str,
        query_name: str | None,
        run_id: str | None,
        checkpoint: CheckpointReader,
        source: FileSourceSpec,
        spec: OperatorSpec,
        prepare: Callable[[Any], Any] | None,
        sink: str,
        parquet_path: str | None,
        columns: Sequence[str] | None,
        hash_columns: Sequence[str],
        pool: str,
        poll_interval_seconds: float,
    ) -> None:
        self.spark = spark
        self.store = store
        self.query_id = query_id
        self.query_name = query_name
        self.label = query_label(query_name, query_id)
        self.run_id = run_id
        self.checkpoint = checkpoint
        self.source = source
        self.spec = spec
        self.prepare = prepare
        self.sink = sink
        self.parquet_path = parquet_path
        self.columns = tuple(columns) if columns is not None else None
        self.hash_columns = tuple(hash_columns)
        self.pool = pool
        self.poll_interval_seconds = poll_interval_seconds
        self.progress_grace_seconds = 3.0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._progress: dict[int, _BatchInfo] = {}
        self._done: set[int] = set()
        self._floor: int | None = None
        self._counters = _Counters()
        self._audited_cond = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self.on_stop: Callable[[], None] | None = None

    # -- hooks (any thread) ----------------------------------------------------------------------

    def note_progress(
        self, batch_id: int, min_event_time_ms: int | None, run_id: str | None, *, has_rows: bool
    ) -> None:
        with self._lock:
            info = self._progress.setdefault(batch_id, _BatchInfo())
            # A trigger that ran no batch reports the next batch id with no rows; keep what a
            # real batch said.
            if has_rows or info.run_id is None:
                info.min_event_time_ms = min_event_time_ms if has_rows else info.min_event_time_ms
                info.run_id = run_id
            if len(self._progress) > 10_000:
                for old in sorted(self._progress)[:5_000]:
                    del self._progress[old]
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        audited = self._audited_batches()
        with self._lock:
            self._done = set(audited)
            self._floor = min(audited) if audited else None
            self._counters.batches_audited = 0
            if audited:
                self._counters.last_audited_batch = max(audited)
        self._thread = threading.Thread(
            target=self._run, name=f"wmwatch-audit-{self.label}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        on_stop, self.on_stop = self.on_stop, None
        if on_stop is not None:
            on_stop()

    def sync(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        target = self._pending_target()
        self._wake.set()
        with self._audited_cond:
            while not self._all_done_up_to(target):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                self._audited_cond.wait(min(remaining, 0.1))
        if self.store is not None and hasattr(self.store, "flush"):
            return bool(self.store.flush(timeout=max(0.1, deadline - time.monotonic())))
        return True

    def _pending_target(self) -> list[int]:
        committed = self.checkpoint.committed_batches()
        with self._lock:
            floor = self._floor if self._floor is not None else self._first_auditable(committed)
        return [b for b in committed if floor is not None and b >= floor]

    def _all_done_up_to(self, target: list[int]) -> bool:
        return all(b in self._done for b in target)

    # -- status and metrics -------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        with self._lock:
            c = self._counters
            latest = c.latest_committed_batch
            last = c.last_audited_batch
            lag_batches = (
                0 if latest is None else max(0, latest - (last if last is not None else -1))
            )
            lag_seconds = (
                0.0
                if c.oldest_pending_commit_at is None
                else max(0.0, time.time() - c.oldest_pending_commit_at)
            )
            return {
                "query_id": self.query_id,
                "query": self.label,
                "operator_kind": self.spec.kind,
                "event_time_column": self.spec.event_time_column,
                "sink": self.sink,
                "running": self._thread is not None and self._thread.is_alive(),
                "batches_audited": c.batches_audited,
                "batches_replayed": c.batches_replayed,
                "batches_skipped": c.batches_skipped,
                "last_audited_batch": last,
                "latest_committed_batch": latest,
                "late_rows": c.late_rows,
                "lag_batches": lag_batches,
                "lag_seconds": lag_seconds,
                "errors": c.errors,
                "last_error": c.last_error,
                "replay_seconds": c.replay_seconds,
            }

    def metrics(self) -> Iterable[Metric]:
        s = self.status()
        late = CounterMetricFamily(
            "wmwatch_late_rows_audited",
            "Input rows the audit found dropped as late.",
            labels=["query"],
        )
        late.add_metric([self.label], float(s["late_rows"]))
        lag_b = GaugeMetricFamily(
            "wmwatch_audit_lag_batches", "Committed batches not yet audited.", labels=["query"]
        )
        lag_b.add_metric([self.label], float(s["lag_batches"]))
        lag_s = GaugeMetricFamily(
            "wmwatch_audit_lag_seconds",
            "Age of the oldest committed batch not yet audited.",
            labels=["query"],
        )
        lag_s.add_metric([self.label], float(s["lag_seconds"]))
        errors = CounterMetricFamily(
            "wmwatch_audit_errors", "Audit attempts that failed (retried).", labels=["query"]
        )
        errors.add_metric([self.label], float(s["errors"]))
        return [late, lag_b, lag_s, errors]

    # -- the loop -------------------------------------------------------------------------------------

    def _audited_batches(self) -> list[int]:
        if self.store is None:
            return []

        def read(con: Any) -> list[int]:
            rows = con.execute(
                "SELECT batch_id FROM audit_batches WHERE query_id = ? ORDER BY batch_id",
                [self.query_id],
            ).fetchall()
            return [int(r[0]) for r in rows]

        result = self.store.read(read, timeout=30)
        return list(result)

    def _first_auditable(self, committed: list[int]) -> int | None:
        """The oldest committed batch whose late-row watermark the checkpoint still holds."""
        if not committed:
            return None
        offsets = set(self.checkpoint.offset_batches())
        for b in committed:
            if b == 0 or (b - 1) in offsets:
                return b
        return None

    def _run(self) -> None:
        with contextlib.suppress(Exception):
            sc = self.spark.sparkContext
            sc.setLocalProperty("spark.scheduler.pool", self.pool)
        failures = 0
        while not self._stop.is_set():
            try:
                self._audit_pending()
                failures = 0
            except Exception as exc:
                failures += 1
                with self._lock:
                    self._counters.errors += 1
                    self._counters.last_error = f"{type(exc).__name__}: {str(exc)[:500]}"
                log.warning(
                    "wmwatch: audit of %s failed (attempt %d, retrying): %s",
                    self.label,
                    failures,
                    exc,
                )
                self._stop.wait(min(30.0, 0.5 * 2 ** min(failures, 6)))
            self._wake.wait(self.poll_interval_seconds)
            self._wake.clear()

    def _audit_pending(self) -> None:
        committed = self.checkpoint.committed_batches()
        with self._lock:
            if self._floor is None:
                self._floor = self._first_auditable(committed)
            floor = self._floor
            pending = [
                b for b in committed if floor is not None and b >= floor and b not in self._done
            ]
            self._counters.latest_committed_batch = committed[-1] if committed else None
            self._counters.oldest_pending_commit_at = (
                self.checkpoint.commit_mtime_seconds(pending[0]) if pending else None
            )
        for batch_id in pending:
            if self._stop.is_set():
                return
            if not self._audit_batch(batch_id):
                return  # waiting for this batch's progress; batches are audited in order
            with self._lock:
                rest = [b for b in pending if b not in self._done]
                self._counters.oldest_pending_commit_at = (
                    self.checkpoint.commit_mtime_seconds(rest[0]) if rest else None
                )

    def _audit_batch(self, batch_id: int) -> bool:
        """Audit one committed batch; False when it should wait a moment for its progress."""
        late_wm_ms = self.checkpoint.late_watermark_ms(batch_id)
        with self._lock:
            info = self._progress.get(batch_id)
        min_ms = info.min_event_time_ms if info is not None else None
        run_id = info.run_id if info is not None else None
        files = self.checkpoint.batch_files(batch_id, self.source.source_index)
        if (
            files
            and min_ms is None
            and late_wm_ms is not None
            and self._progress_may_come(batch_id)
        ):
            # Spark writes commits/N just before it posts N's progress; its minimum event time
            # usually saves the whole replay, so give it a moment instead of racing it.
            return False
        if (
            not files
            or (
                info is not None
                and min_ms is not None
                and not batch_may_have_late_rows(self.spec, late_wm_ms, min_ms)
            )
            or late_wm_ms is None
        ):
            self._commit(batch_id, run_id, late_wm_ms, rows=None, replayed=False)
            return True
        started = time.perf_counter()
        sc = self.spark.sparkContext
        sc.setLocalProperty("spark.scheduler.pool", self.pool)
        sc.setJobDescription(f"wmwatch audit of {self.label} batch {batch_id}")
        try:
            late = self._late_rows_frame([f.path for f in files], late_wm_ms)
            if self.sink == "parquet":
                rows: Any = self._write_parquet(late, batch_id, run_id, late_wm_ms)
            else:
                rows = self._collect(late)
        finally:
            sc.setJobDescription(None)
        with self._lock:
            self._counters.replay_seconds += time.perf_counter() - started
        self._commit(batch_id, run_id, late_wm_ms, rows=rows, replayed=True)
        return True

    def _progress_may_come(self, batch_id: int) -> bool:
        if self._stop.is_set():
            return False
        committed_at = self.checkpoint.commit_mtime_seconds(batch_id)
        return committed_at is not None and time.time() - committed_at < self.progress_grace_seconds

    # -- Spark side -----------------------------------------------------------------------------

    def _late_rows_frame(self, paths: list[str], late_wm_ms: int) -> Any:
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
        return frame.select(
            F.unix_micros(ts).alias("event_time_us"),
            window_start.alias("window_start_us"),
            window_end.alias("window_end_us"),
            (
                F.regexp_replace(F.col(_SOURCE_FILE_COL), "^file:/+", "/")
                if has_source
                else F.lit(None).cast("string")
            ).alias("source_file"),
            F.to_json(F.struct(*data)).alias("row_data"),
        )

    def _collect(self, late: Any) -> Any:
        try:
            import pyarrow  # noqa: F401

            return late.toArrow()
        except ImportError:
            return [tuple(r) for r in late.collect()]

    def parquet_dir(self, batch_id: int) -> str:
        assert self.parquet_path is not None
        return f"{self.parquet_path.rstrip('/')}/{self.query_id}/batch-{batch_id:012d}"

    def _write_parquet(self, late: Any, batch_id: int, run_id: str | None, late_wm_ms: int) -> int:
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
        from pyspark.sql import Observation

        written = Observation(f"wmwatch_audit_{batch_id}")
        # Overwrite makes a re-run after a crash replace, not add to, what a first attempt wrote.
        out.observe(written, F.count(F.lit(1)).alias("rows")).write.mode("overwrite").parquet(
            directory
        )
        return int(written.get["rows"])

    # -- the store side -------------------------------------------------------------------------------

    def _commit(
        self,
        batch_id: int,
        run_id: str | None,
        late_wm_ms: int | None,
        *,
        rows: Any,
        replayed: bool,
    ) -> None:
        if rows is None:
            count = 0
        elif isinstance(rows, int):
            count = rows
        else:
            count = int(rows.num_rows) if hasattr(rows, "num_rows") else len(rows)
        location = self.parquet_dir(batch_id) if self.sink == "parquet" and replayed else None
        write = _batch_writer(
            query_id=self.query_id,
            query_name=self.query_name,
            run_id=run_id,
            batch_id=batch_id,
            late_wm_ms=late_wm_ms,
            kind=self.spec.kind,
            rows=rows if self.sink == "duckdb" and replayed else None,
            count=count,
            sink=self.sink,
            location=location,
        )
        if self.store is not None:
            self.store.submit(write, description=f"audit {self.label} batch {batch_id}")
        with self._audited_cond:
            self._done.add(batch_id)
            c = self._counters
            c.batches_audited += 1
            c.late_rows += count
            if replayed:
                c.batches_replayed += 1
            else:
                c.batches_skipped += 1
            c.last_audited_batch = (
                batch_id if c.last_audited_batch is None else max(c.last_audited_batch, batch_id)
            )
            self._audited_cond.notify_all()


def _batch_writer(
    *,
    query_id: str,
    query_name: str | None,
    run_id: str | None,
    batch_id: int,
    late_wm_ms: int | None,
    kind: str,
    rows: Any,
    count: int,
    sink: str,
    location: str | None,
) -> Callable[[Any], None]:
    """An idempotent write of one audited batch: its late rows and its marker, together."""
    wm_us = None if late_wm_ms is None else late_wm_ms * 1000

    def write(con: Any) -> None:
        con.execute(
            "DELETE FROM late_rows WHERE query_id = ? AND batch_id = ?", [query_id, batch_id]
        )
        if rows is not None and count:
            insert = (
                "INSERT INTO late_rows SELECT ?, ?, ?, ?, "
                f"{_EPOCH_SQL.format('r.event_time_us')}, {_EPOCH_SQL.format('?::BIGINT')}, "
                "(?::BIGINT - r.event_time_us) / 1e6, "
                f"{_EPOCH_SQL.format('r.window_start_us')}, {_EPOCH_SQL.format('r.window_end_us')}, "
                "?, r.source_file, r.row_data::JSON, now() FROM {} AS r"
            )
            params = [query_id, query_name, run_id, batch_id, wm_us, wm_us, kind]
            if hasattr(rows, "num_rows"):
                name = f"wmwatch_audit_rows_{batch_id}"
                con.register(name, rows)
                try:
                    con.execute(insert.format(name), params)
                finally:
                    con.unregister(name)
            else:
                con.execute(
                    "CREATE TEMP TABLE IF NOT EXISTS wmwatch_audit_rows (event_time_us BIGINT, "
                    "window_start_us BIGINT, window_end_us BIGINT, source_file VARCHAR, row_data VARCHAR)"
                )
                con.execute("DELETE FROM wmwatch_audit_rows")
                con.executemany("INSERT INTO wmwatch_audit_rows VALUES (?, ?, ?, ?, ?)", rows)
                con.execute(insert.format("wmwatch_audit_rows"), params)
        con.execute(
            "INSERT OR REPLACE INTO audit_batches VALUES (?, ?, ?, "
            f"{_EPOCH_SQL.format('?::BIGINT')}, ?, ?, ?, now())",
            [query_id, batch_id, run_id, wm_us, count, sink, location],
        )

    return write


def start_audit(
    watch: Any,
    query: Any,
    events: Any,
    *,
    prepare: Callable[[Any], Any] | None = None,
    sink: str = "duckdb",
    parquet_path: str | os.PathLike[str] | None = None,
    columns: Sequence[str] | None = None,
    hash_columns: Sequence[str] = (),
    event_time: str | None = None,
    delay: str | float | None = None,
    window: str | float | None = None,
    slide: str | float | None = None,
    kind: str | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    pool: str = "wmwatch_audit",
    poll_interval_seconds: float = 1.0,
) -> AuditHandle:
    """Start auditing the rows ``query`` drops behind its watermark; returns an :class:`AuditHandle`.

    ``events`` is the streaming DataFrame the query reads before its stateful operator. When it is
    more than ``spark.readStream...load()`` plus ``withWatermark``, pass ``prepare``: the function
    that turns the raw source DataFrame (read as a batch) into the same rows. The operator kind,
    event-time column, delay and window come from the query's plan; the keyword arguments
    override them. ``sink="parquet"`` writes each batch's late rows with Spark under
    ``parquet_path`` instead of collecting them into DuckDB.
    """
    if sink not in SINKS:
        raise ConfigError(f"sink={sink!r} is not one of {', '.join(SINKS)}.")
    if sink == "parquet" and not parquet_path:
        raise ConfigError(
            "sink='parquet' needs parquet_path=, the directory Spark writes late rows to."
        )
    if sink == "duckdb" and getattr(watch, "store", None) is None:
        raise ConfigError(
            "the watch has no history database; attach with db=... or use sink='parquet'."
        )
    if prepare is not None and not callable(prepare):
        raise ConfigError("prepare must be a function from the raw source DataFrame to events.")
    spark = watch.spark
    jsq_wrapper = getattr(query, "_jsq", None)
    if jsq_wrapper is None:
        raise AuditError(
            "the query has no JVM handle (Spark Connect?); the audit needs the driver JVM to read "
            "plans and checkpoints, so run watch.audit() in the driver process."
        )
    engine = jsq_wrapper.streamingQuery()
    try:
        plan_text = str(engine.analyzedPlan().toString())
    except Exception:
        plan_text = str(engine.logicalPlan().toString())
    try:
        output_mode = str(engine.outputMode().toString())
    except Exception:
        output_mode = None
    if output_mode and output_mode.lower() == "complete":
        raise AuditError(
            "a query in complete output mode keeps every window and drops no late rows; nothing to audit."
        )
    allow_multiple = str(
        spark.conf.get("spark.sql.streaming.statefulOperator.allowMultiple", "true")
    ).lower()
    if allow_multiple == "false":
        # Spark then filters late rows with the batch's own watermark, a rule not audited here.
        raise AuditError(
            "spark.sql.streaming.statefulOperator.allowMultiple=false changes which watermark drops "
            "late rows and is not supported by the audit; leave it at its default (true)."
        )
    facts: PlanFacts = parse_plan(plan_text)
    spec = apply_overrides(
        facts, kind=kind, event_time=event_time, delay=delay, window=window, slide=slide
    )
    source = file_source_of(spark, events, has_prepare=prepare is not None)
    source = FileSourceSpec(
        source.format,
        source.schema_json,
        source.options,
        source.paths,
        _source_index(plan_text, source),
    )
    root = str(checkpoint) if checkpoint is not None else str(engine.resolvedCheckpointRoot())
    fs = None if local_root(root) is not None else HadoopFileSystem(spark, root)
    reader = CheckpointReader(root, fs)
    unknown = [c for c in hash_columns if columns is not None and c not in columns]
    if unknown:
        raise ConfigError(f"hash_columns {unknown} are not in columns=; add them or drop them.")
    auditor = _Auditor(
        spark=spark,
        store=getattr(watch, "store", None),
        query_id=str(query.id),
        query_name=query.name,
        run_id=str(query.runId),
        checkpoint=reader,
        source=source,
        spec=spec,
        prepare=prepare,
        sink=sink,
        parquet_path=str(parquet_path) if parquet_path is not None else None,
        columns=columns,
        hash_columns=hash_columns,
        pool=pool,
        poll_interval_seconds=poll_interval_seconds,
    )
    plugin = AuditPlugin(auditor)
    remove = getattr(watch, "remove_plugin", None)
    if remove is not None:
        auditor.on_stop = lambda: remove(plugin)
    auditor.start()
    watch.add_plugin(plugin)
    return AuditHandle(auditor)
