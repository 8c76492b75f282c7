"""Starting an audit: checking what it is asked to do, reading the query's plan and source, and
wiring the replay, the history and the watch's audit plugin together; :class:`AuditHandle` is
what the caller gets back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from wmwatch._audit.auditor import Auditor
from wmwatch._audit.checkpoint import CheckpointReader, HadoopFileSystem, local_root
from wmwatch._audit.plugin import audit_plugin
from wmwatch._audit.predicates import OperatorSpec, apply_overrides, parse_plan
from wmwatch._audit.replay import Replayer
from wmwatch._audit.sinks import AuditHistory
from wmwatch._audit.source import file_source_of, source_index
from wmwatch._core.plugins import WatchContext
from wmwatch._errors import AuditError, ConfigError
from wmwatch._progress import query_label

SINKS = ("duckdb", "parquet")
DEFAULT_MAX_ROWS_PER_BATCH = 100_000
DEFAULT_MAX_ROW_BYTES = 16 * 1024
DEFAULT_JOB_TIMEOUT_SECONDS = 900.0


class AuditHandle:
    """A running audit: ``status()``, ``sync()`` and ``stop()``."""

    def __init__(self, auditor: Auditor) -> None:
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


def start_audit(
    watch: WatchContext,
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
    """Start auditing the rows ``query`` drops behind its watermark; returns an
    :class:`AuditHandle`.

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
    store = watch.store
    if sink == "duckdb" and store is None:
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
            "a query in complete output mode keeps every window and drops no late rows; "
            "nothing to audit."
        )
    allow_multiple = str(
        spark.conf.get("spark.sql.streaming.statefulOperator.allowMultiple", "true")
    ).lower()
    if allow_multiple == "false":
        # Spark then filters late rows with the batch's own watermark, a rule not audited here.
        raise AuditError(
            "spark.sql.streaming.statefulOperator.allowMultiple=false changes which watermark "
            "drops late rows and is not supported by the audit; leave it at its default (true)."
        )
    spec = apply_overrides(
        parse_plan(plan_text),
        kind=kind,
        event_time=event_time,
        delay=delay,
        window=window,
        slide=slide,
    )
    source = file_source_of(spark, events, has_prepare=prepare is not None)
    source = replace(source, source_index=source_index(plan_text, source))
    root = str(checkpoint) if checkpoint is not None else str(engine.resolvedCheckpointRoot())
    fs = None if local_root(root) is not None else HadoopFileSystem(spark, root)
    reader = CheckpointReader(root, fs)
    unknown = [c for c in hash_columns if columns is not None and c not in columns]
    if unknown:
        raise ConfigError(f"hash_columns {unknown} are not in columns=; add them or drop them.")
    query_id, query_name = str(query.id), query.name
    label = query_label(query_name, query_id)
    replayer = Replayer(
        spark=spark,
        query_id=query_id,
        query_name=query_name,
        label=label,
        source=source,
        spec=spec,
        prepare=prepare,
        columns=columns,
        hash_columns=hash_columns,
        parquet_path=str(parquet_path) if parquet_path is not None else None,
        pool=pool,
        max_rows_per_batch=max_rows_per_batch,
        max_row_bytes=max_row_bytes,
        job_timeout_seconds=job_timeout_seconds,
    )
    auditor = Auditor(
        query_id=query_id,
        query_name=query_name,
        label=label,
        run_id=str(query.runId),
        checkpoint=reader,
        spec=spec,
        sink=sink,
        replayer=replayer,
        history=(
            AuditHistory(store, query_id=query_id, label=label) if store is not None else None
        ),
        poll_interval_seconds=poll_interval_seconds,
    )
    audit_plugin(watch).add(auditor)
    auditor.start()
    return AuditHandle(auditor)
