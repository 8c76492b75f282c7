"""The late-row audit: every input row a query's stateful operator drops as late, in a table.

Design (chosen over a side streaming query, see the README): after the production query commits
batch N, replay exactly N's input and apply N's late-row rule in Spark.

- *Which rows*: the files batch N read, from the production checkpoint (offsets + the file
  source's log, see :mod:`wmwatch._audit.checkpoint`); files are immutable, so re-reading gives N's rows.
- *Which rule*: the watermark in ``offsets/N-1`` (Spark's late-row filter in N uses the previous
  batch's watermark) and the operator's predicate (:mod:`wmwatch._audit.predicates`).
- *Cheap when nothing is late*: when progress says N's smallest event time cannot be late, N is
  recorded as audited with 0 rows and no Spark job runs.
- *Exactly once*: the late rows of N and its ``audit_batches`` marker are written in one DuckDB
  transaction after deleting N's rows (Parquet: the batch directory is overwritten first, the
  marker written after); on start the audit resumes after the batches already marked.
- *Bounded, whatever the data does*: late rows reach the driver in chunks of at most
  :data:`CHUNK_BYTES` (each row's ``row_data`` is at most ``max_row_bytes``), never a batch at
  once. A batch that fits one chunk is written in one transaction; a larger one is staged chunk
  by chunk in ``late_rows_pending`` and moved into ``late_rows`` together with its marker. At most
  ``max_rows_per_batch`` rows of a batch are kept in DuckDB; the rest are counted (and written to
  Parquet when ``parquet_path`` is set). Every Spark job runs under a deadline
  (:mod:`wmwatch._core.spark_jobs`).

The work runs on the audit's own thread in its own FAIR scheduler pool; the plugin hook on the
watch's worker thread only records "batch N finished, min event time X" and wakes that thread.
One :class:`AuditPlugin` per watch holds every audit and exports each metric family once, with
counters that continue across a query's runs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from wmwatch._audit.checkpoint import CheckpointReader, HadoopFileSystem, local_root, normalise_path
from wmwatch._audit.predicates import (
    WINDOW,
    OperatorSpec,
    ReplayPlan,
    apply_overrides,
    batch_may_have_late_rows,
    parse_plan,
)
from wmwatch._core.plugins import WatchPlugin
from wmwatch._core.spark_jobs import bounded_job
from wmwatch._errors import AuditError, ConfigError, UnsupportedSourceError
from wmwatch._progress import ProgressSnapshot, query_label

log = logging.getLogger("wmwatch.audit")

SUPPORTED_FORMATS = ("json", "csv", "parquet", "orc", "text", "avro")
# The most late-row bytes that move from Spark to the driver at once (one chunk).
CHUNK_BYTES = 32 * 1024 * 1024
DEFAULT_MAX_ROWS_PER_BATCH = 100_000
DEFAULT_MAX_ROW_BYTES = 16 * 1024
DEFAULT_JOB_TIMEOUT_SECONDS = 900.0
# Bytes a late row costs besides row_data (three longs, the source path, Python objects).
_ROW_OVERHEAD_BYTES = 256
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
    late_rows_over_cap: int = 0
    batches_over_cap: int = 0
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


@dataclass
class _QueryTotals:
    """Counters of a query's audits that ended, so its counters continue across runs."""

    late_rows: int = 0
    late_rows_over_cap: int = 0
    batches_over_cap: int = 0
    errors: int = 0

    def add(self, status: dict[str, Any]) -> None:
        self.late_rows += int(status["late_rows"])
        self.late_rows_over_cap += int(status["late_rows_over_cap"])
        self.batches_over_cap += int(status["batches_over_cap"])
        self.errors += int(status["errors"])


class AuditPlugin(WatchPlugin):
    """Every audit of one watch: wake-ups from progress, and one set of metric families.

    A query has at most one running audit. When its run stops, the audit finishes the batches
    that run committed and ends; auditing the restarted query starts a new audit that resumes
    from the checkpoint. Counters are per query label and continue across those audits, so a
    restart neither resets them nor exports the same series twice.
    """

    name = "audit"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, _Auditor] = {}
        self._ended: dict[str, _QueryTotals] = {}

    def add(self, auditor: _Auditor) -> None:
        """Register a started audit, ending the query's previous one first."""
        with self._lock:
            previous = self._running.get(auditor.query_id)
        if previous is not None:
            previous.stop(30.0)
        with self._lock:
            self._running[auditor.query_id] = auditor
        auditor.on_stop = lambda: self._ended_audit(auditor)

    def _ended_audit(self, auditor: _Auditor) -> None:
        status = auditor.status()
        with self._lock:
            if self._running.get(auditor.query_id) is auditor:
                del self._running[auditor.query_id]
            self._ended.setdefault(auditor.label, _QueryTotals()).add(status)

    def running(self) -> list[_Auditor]:
        with self._lock:
            return list(self._running.values())

    def on_progress(self, snapshot: ProgressSnapshot) -> None:
        with self._lock:
            auditor = self._running.get(snapshot.query_id)
        if auditor is not None:
            auditor.note_progress(
                snapshot.batch_id,
                _ms(snapshot.event_time_min_at),
                snapshot.run_id,
                has_rows=bool(snapshot.input_rows),
            )

    def on_query_terminated(self, event: Any) -> None:
        with self._lock:
            auditor = self._running.get(getattr(event, "query_id", ""))
        if auditor is not None and auditor.run_id in (None, getattr(event, "run_id", None)):
            auditor.finish()

    def collect(self) -> Iterable[Metric]:
        late = CounterMetricFamily(
            "wmwatch_late_rows_audited",
            "Input rows the audit found dropped as late.",
            labels=["query"],
        )
        over_cap = CounterMetricFamily(
            "wmwatch_late_rows_over_cap",
            "Late rows found in batches over max_rows_per_batch and not kept in DuckDB.",
            labels=["query"],
        )
        storms = CounterMetricFamily(
            "wmwatch_audit_batches_over_cap",
            "Audited batches with more late rows than max_rows_per_batch.",
            labels=["query"],
        )
        lag_b = GaugeMetricFamily(
            "wmwatch_audit_lag_batches", "Committed batches not yet audited.", labels=["query"]
        )
        lag_s = GaugeMetricFamily(
            "wmwatch_audit_lag_seconds",
            "Age of the oldest committed batch not yet audited.",
            labels=["query"],
        )
        errors = CounterMetricFamily(
            "wmwatch_audit_errors", "Audit attempts that failed (retried).", labels=["query"]
        )
        with self._lock:
            running = list(self._running.values())
            totals = {label: replace(t) for label, t in self._ended.items()}
        lags: dict[str, tuple[float, float]] = {}
        for auditor in running:
            status = auditor.status()
            totals.setdefault(auditor.label, _QueryTotals()).add(status)
            lags[auditor.label] = (float(status["lag_batches"]), float(status["lag_seconds"]))
        for label, t in sorted(totals.items()):
            late.add_metric([label], float(t.late_rows))
            over_cap.add_metric([label], float(t.late_rows_over_cap))
            storms.add_metric([label], float(t.batches_over_cap))
            errors.add_metric([label], float(t.errors))
        for label, (batches, seconds) in sorted(lags.items()):
            lag_b.add_metric([label], batches)
            lag_s.add_metric([label], seconds)
        return [late, over_cap, storms, lag_b, lag_s, errors]

    def close(self) -> None:
        for auditor in self.running():
            auditor.stop(10.0)


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
        max_rows_per_batch: int = DEFAULT_MAX_ROWS_PER_BATCH,
        max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
        job_timeout_seconds: float = DEFAULT_JOB_TIMEOUT_SECONDS,
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
        self.max_rows_per_batch = max_rows_per_batch
        self.max_row_bytes = max_row_bytes
        self.job_timeout_seconds = job_timeout_seconds
        self.progress_grace_seconds = 3.0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        # set when the audited run stopped: audit what it committed, then end
        self._finish_at: float | None = None
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

    def finish(self) -> None:
        """The audited run stopped: audit the batches it committed, then end (on its thread)."""
        with self._lock:
            if self._finish_at is None:
                self._finish_at = time.monotonic()
        self._wake.set()

    def _finishing(self) -> bool:
        with self._lock:
            return self._finish_at is not None

    def _finished(self) -> bool:
        """Caught up after the run stopped, and long enough after it that no commit is late.

        Spark can deliver the termination before the run's last commit file is visible (seen
        with availableNow: the final batch's commit after the event), so one caught-up pass
        right after the event is not proof that the run's last batch was seen.
        """
        with self._lock:
            finish_at = self._finish_at
        return finish_at is not None and time.monotonic() - finish_at >= self.progress_grace_seconds

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        if self.store is not None:
            # rows a crashed replay staged; this audit replays those batches again
            query_id = self.query_id
            self.store.submit(
                lambda con: con.execute(
                    "DELETE FROM late_rows_pending WHERE query_id = ?", [query_id]
                ),
                description=f"audit {self.label}: drop rows of interrupted replays",
            )
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
        self._ended()

    def _ended(self) -> None:
        with self._lock:
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
                "late_rows_over_cap": c.late_rows_over_cap,
                "batches_over_cap": c.batches_over_cap,
                "max_rows_per_batch": self.max_rows_per_batch,
                "lag_batches": lag_batches,
                "lag_seconds": lag_seconds,
                "errors": c.errors,
                "last_error": c.last_error,
                "replay_seconds": c.replay_seconds,
            }

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
                caught_up = self._audit_pending()
                failures = 0
                if caught_up and self._finished():
                    log.info("wmwatch: audit of %s finished: its query run stopped", self.label)
                    break
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
                if self._finishing() and failures >= 5:
                    break  # the run is gone; a later audit of the query resumes from here
                self._stop.wait(min(30.0, 0.5 * 2 ** min(failures, 6)))
            self._wake.wait(self.poll_interval_seconds)
            self._wake.clear()
        self._ended()

    def _audit_pending(self) -> bool:
        """Audit committed batches in order; True when every one of them is done."""
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
                return False
            if not self._audit_batch(batch_id):
                return False  # waiting for this batch's progress; batches are audited in order
            with self._lock:
                rest = [b for b in pending if b not in self._done]
                self._counters.oldest_pending_commit_at = (
                    self.checkpoint.commit_mtime_seconds(rest[0]) if rest else None
                )
        return True

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
            self._commit(batch_id, run_id, late_wm_ms, found=_Found.nothing())
            return True
        started = time.perf_counter()
        with bounded_job(
            self.spark,
            description=f"wmwatch audit of {self.label} batch {batch_id}",
            timeout_seconds=self.job_timeout_seconds,
            pool=self.pool,
        ):
            late = self._late_rows_frame([f.path for f in files], late_wm_ms)
            if self.sink == "parquet":
                found = _Found.all_in_parquet(
                    self._write_parquet(late, batch_id, run_id, late_wm_ms)[0],
                    self.parquet_dir(batch_id),
                )
            else:
                found = self._fetch(late, batch_id, run_id, late_wm_ms)
        with self._lock:
            self._counters.replay_seconds += time.perf_counter() - started
        self._commit(batch_id, run_id, late_wm_ms, found=found)
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

    def _fetch(self, late: Any, batch_id: int, run_id: str | None, late_wm_ms: int) -> _Found:
        """The batch's late rows for DuckDB, never more than one chunk in the driver at once.

        The common case (a few late rows) is one Spark job: the first chunk's worth plus one row.
        Only when that row exists does the batch count its rows, keep at most
        ``max_rows_per_batch`` of them (staged chunk by chunk), and, with ``parquet_path``,
        have Spark write every one of them to Parquet.
        """
        first_rows = max(1, CHUNK_BYTES // (self.max_row_bytes + _ROW_OVERHEAD_BYTES))
        head = [tuple(r) for r in late.limit(first_rows + 1).collect()]
        if len(head) <= min(first_rows, self.max_rows_per_batch):
            return _Found(total=len(head), rows=head)
        del head
        from pyspark.sql import functions as F

        overflow = None
        if self.parquet_path is not None:
            # Every row goes to Parquet, which also counts them; the rows kept in DuckDB are
            # then read back from that Parquet rather than parsed from the input again.
            total, data_bytes = self._write_parquet(late, batch_id, run_id, late_wm_ms)
            overflow = self.parquet_dir(batch_id)
            late = self.spark.read.parquet(overflow).select(*_LATE_ROW_COLUMNS)
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
            chunk: list[tuple[Any, ...]] = []
            for row in source.toLocalIterator(prefetchPartitions=False):
                chunk.append(tuple(row))
                if len(chunk) >= chunk_rows:
                    staged += self._stage(batch_id, attempt, chunk)
                    chunk = []
            if chunk:
                staged += self._stage(batch_id, attempt, chunk)
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
        return _Found(total=total, attempt=attempt, staged=staged, overflow_location=overflow)

    def _stage(self, batch_id: int, attempt: str, rows: list[tuple[Any, ...]]) -> int:
        """Write one chunk to ``late_rows_pending`` and wait until it is on disk.

        Waiting keeps at most one chunk in the driver: when the history file is unavailable the
        replay fails here (and is retried later) instead of piling chunks up in memory.
        """
        if self.store is None:
            return 0
        self.store.submit(
            _pending_writer(self.query_id, batch_id, attempt, rows),
            description=f"audit {self.label} batch {batch_id}: {len(rows)} staged rows",
        )
        if not self.store.flush(timeout=self.job_timeout_seconds):
            raise AuditError(
                f"the history file did not take the late rows of batch {batch_id} in time "
                f"({self.store.health.last_error or 'writer busy'}); retrying later"
            )
        return len(rows)

    def parquet_dir(self, batch_id: int) -> str:
        assert self.parquet_path is not None
        return f"{self.parquet_path.rstrip('/')}/{self.query_id}/batch-{batch_id:012d}"

    def _write_parquet(
        self, late: Any, batch_id: int, run_id: str | None, late_wm_ms: int
    ) -> tuple[int, int]:
        """Have Spark write the batch's late rows to its Parquet folder; (rows, row_data bytes)."""
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

        written = Observation(f"wmwatch_audit_{batch_id}_{uuid.uuid4().hex[:8]}")
        observed = out.observe(
            written,
            F.count(F.lit(1)).alias("rows"),
            F.sum(F.octet_length("row_data")).alias("bytes"),
        )
        # Overwrite makes a re-run after a crash replace, not add to, what a first attempt wrote.
        observed.write.mode("overwrite").parquet(directory)
        return int(written.get["rows"]), int(written.get["bytes"] or 0)

    # -- the store side -------------------------------------------------------------------------------

    def _commit(
        self, batch_id: int, run_id: str | None, late_wm_ms: int | None, *, found: _Found
    ) -> None:
        write = _batch_writer(
            query_id=self.query_id,
            query_name=self.query_name,
            run_id=run_id,
            batch_id=batch_id,
            late_wm_ms=late_wm_ms,
            kind=self.spec.kind,
            found=found,
            sink=self.sink,
        )
        if self.store is not None:
            self.store.submit(write, description=f"audit {self.label} batch {batch_id}")
        with self._audited_cond:
            self._done.add(batch_id)
            c = self._counters
            c.batches_audited += 1
            c.late_rows += found.total
            if found.over_cap:
                c.batches_over_cap += 1
                c.late_rows_over_cap += found.over_cap
            if found.replayed:
                c.batches_replayed += 1
            else:
                c.batches_skipped += 1
            c.last_audited_batch = (
                batch_id if c.last_audited_batch is None else max(c.last_audited_batch, batch_id)
            )
            self._audited_cond.notify_all()


@dataclass(frozen=True)
class _Found:
    """What the replay of one batch found, and where its rows are.

    ``rows``: the late rows themselves, when they fit one chunk (written with the marker).
    ``attempt``/``staged``: rows staged in ``late_rows_pending`` by that attempt.
    ``overflow_location``: a Parquet folder holding every late row of the batch.
    """

    total: int
    rows: list[tuple[Any, ...]] | None = None
    attempt: str | None = None
    staged: int = 0
    overflow_location: str | None = None
    parquet_location: str | None = None
    replayed: bool = True

    @classmethod
    def nothing(cls) -> _Found:
        return cls(total=0, replayed=False)

    @classmethod
    def all_in_parquet(cls, count: int, location: str) -> _Found:
        return cls(total=count, parquet_location=location)

    @property
    def kept(self) -> int | None:
        """Rows of the batch in ``late_rows`` (None: the Parquet sink keeps them)."""
        if self.parquet_location is not None:
            return None
        return len(self.rows) if self.rows is not None else self.staged

    @property
    def over_cap(self) -> int:
        kept = self.kept
        return 0 if kept is None else max(0, self.total - kept)


_LATE_ROW_TYPES = ("BIGINT", "BIGINT", "BIGINT", "VARCHAR", "VARCHAR")


def _rows_as_table(first_param: int) -> str:
    """SQL for late-row tuples passed as five column lists from parameter ``first_param`` on.

    One statement that unnests column lists is far faster than executemany for many rows.
    """
    return "SELECT " + ", ".join(
        f"unnest(${first_param + i}::{kind}[]) AS {name}"
        for i, (name, kind) in enumerate(zip(_LATE_ROW_COLUMNS, _LATE_ROW_TYPES, strict=True))
    )


def _columns(rows: list[tuple[Any, ...]]) -> list[list[Any]]:
    if not rows:
        return [[] for _ in _LATE_ROW_COLUMNS]
    return [list(column) for column in zip(*rows, strict=True)]


def _pending_writer(
    query_id: str, batch_id: int, attempt: str, rows: list[tuple[Any, ...]]
) -> Callable[[Any], None]:
    """Stage one chunk of a batch's late rows (moved into late_rows with the batch's marker)."""
    columns = _columns(rows)

    def write(con: Any) -> None:
        con.execute(
            f"INSERT INTO late_rows_pending SELECT $1, $2, $3, * FROM ({_rows_as_table(4)})",
            [query_id, batch_id, attempt, *columns],
        )

    return write


def _batch_writer(
    *,
    query_id: str,
    query_name: str | None,
    run_id: str | None,
    batch_id: int,
    late_wm_ms: int | None,
    kind: str,
    found: _Found,
    sink: str,
) -> Callable[[Any], None]:
    """An idempotent write of one audited batch: its late rows and its marker, together.

    Rows come from ``found.rows`` or, for a batch staged chunk by chunk, from the pending rows
    of ``found.attempt`` (other attempts' rows are a crashed replay's and are dropped here).
    """
    wm_us = None if late_wm_ms is None else late_wm_ms * 1000
    # $1-$6 describe the batch; the rows' own parameters follow from $7
    insert = (
        "INSERT INTO late_rows SELECT $1, $2, $3, $4, "
        f"{_EPOCH_SQL.format('r.event_time_us')}, {_EPOCH_SQL.format('$5::BIGINT')}, "
        "($5::BIGINT - r.event_time_us) / 1e6, "
        f"{_EPOCH_SQL.format('r.window_start_us')}, {_EPOCH_SQL.format('r.window_end_us')}, "
        "$6, r.source_file, r.row_data::JSON, now() FROM ({}) AS r"
    )
    params = [query_id, query_name, run_id, batch_id, wm_us, kind]

    def write(con: Any) -> None:
        con.execute(
            "DELETE FROM late_rows WHERE query_id = ? AND batch_id = ?", [query_id, batch_id]
        )
        if found.rows:
            con.execute(
                insert.format(_rows_as_table(len(params) + 1)), [*params, *_columns(found.rows)]
            )
        elif found.attempt is not None and found.staged:
            con.execute(
                insert.format(
                    "SELECT * EXCLUDE (query_id, batch_id, attempt) FROM late_rows_pending "
                    "WHERE query_id = $1 AND batch_id = $4 AND attempt = $7"
                ),
                [*params, found.attempt],
            )
        con.execute(
            "DELETE FROM late_rows_pending WHERE query_id = ? AND batch_id = ?",
            [query_id, batch_id],
        )
        con.execute(
            "INSERT OR REPLACE INTO audit_batches (query_id, batch_id, run_id, late_watermark_at, "
            "late_rows, sink, location, audited_at, rows_kept, rows_over_cap, overflow_location) "
            f"VALUES (?, ?, ?, {_EPOCH_SQL.format('?::BIGINT')}, ?, ?, ?, now(), ?, ?, ?)",
            [
                query_id,
                batch_id,
                run_id,
                wm_us,
                found.total,
                sink,
                found.parquet_location,
                found.kept,
                found.over_cap,
                found.overflow_location,
            ],
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
    max_rows_per_batch: int = DEFAULT_MAX_ROWS_PER_BATCH,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    job_timeout_seconds: float = DEFAULT_JOB_TIMEOUT_SECONDS,
) -> AuditHandle:
    """Start auditing the rows ``query`` drops behind its watermark; returns an :class:`AuditHandle`.

    ``events`` is the streaming DataFrame the query reads before its stateful operator. When it is
    more than ``spark.readStream...load()`` plus ``withWatermark``, pass ``prepare``: the function
    that turns the raw source DataFrame (read as a batch) into the same rows. The operator kind,
    event-time column, delay and window come from the query's plan; the keyword arguments
    override them. ``sink="parquet"`` writes each batch's late rows with Spark under
    ``parquet_path`` instead of collecting them into DuckDB.

    Bounds: at most ``max_rows_per_batch`` late rows of one batch are kept in DuckDB (the rest
    are counted, and written to Parquet when ``parquet_path`` is given with the DuckDB sink);
    ``row_data`` longer than ``max_row_bytes`` is kept as its size and SHA-256; every Spark job
    of the audit is cancelled after ``job_timeout_seconds`` (and retried later).
    """
    if sink not in SINKS:
        raise ConfigError(f"sink={sink!r} is not one of {', '.join(SINKS)}.")
    if max_rows_per_batch < 0:
        raise ConfigError("max_rows_per_batch must be 0 (count only) or more.")
    if max_row_bytes < 64:
        raise ConfigError("max_row_bytes must be at least 64 bytes.")
    if job_timeout_seconds <= 0:
        raise ConfigError("job_timeout_seconds must be positive.")
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
    facts: ReplayPlan = parse_plan(plan_text)
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
        max_rows_per_batch=max_rows_per_batch,
        max_row_bytes=max_row_bytes,
        job_timeout_seconds=job_timeout_seconds,
    )
    _audit_plugin(watch).add(auditor)
    auditor.start()
    return AuditHandle(auditor)


_PLUGIN_LOCK = threading.Lock()


def _audit_plugin(watch: Any) -> AuditPlugin:
    """The watch's one audit plugin, added on first use."""
    with _PLUGIN_LOCK:
        for plugin in watch.plugins():
            if isinstance(plugin, AuditPlugin):
                return plugin
        plugin = AuditPlugin()
        watch.add_plugin(plugin)
        return plugin
