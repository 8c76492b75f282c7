"""Run a query with the audit on, wait for the audit, and read what it stored: one way for every
kind of source (the scenario says how to feed the query; this does the rest)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
from prometheus_client import CollectorRegistry

import wmwatch
from tests.harness.streams import DELAY, SCHEMA, stream_files, write_events
from wmwatch._checkpoint.reader import CheckpointReader

# A late row as the window and deduplication checks read it (``late`` in a run's result)
LATE_SELECT = (
    "SELECT batch_id, epoch_ms(event_time_at), epoch_ms(watermark_at), lateness_seconds, "
    "epoch_ms(window_start_at), epoch_ms(window_end_at), operator_kind, source_file, "
    "row_data::VARCHAR FROM late_rows"
)
# A late row as the join checks read it (``late_join``)
JOIN_LATE_SELECT = (
    "SELECT batch_id, epoch_ms(event_time_at), epoch_ms(watermark_at), operator_kind, "
    "operator_index, join_side, source_index, join_key, row_data::VARCHAR FROM late_rows"
)
_QUERY_SAMPLES = (
    "wmwatch_late_rows_audited_total",
    "wmwatch_audit_lag_batches",
    "wmwatch_audit_errors_total",
)


def late_rows(db: Path) -> list[tuple[Any, ...]]:
    """Every late row of the history, as :data:`LATE_SELECT` reads it."""
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(LATE_SELECT).fetchall()


def late_rows_of(db: Path) -> list[tuple[Any, ...]]:
    """Every late row of the history, as :data:`JOIN_LATE_SELECT` reads it."""
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(JOIN_LATE_SELECT).fetchall()


def stored(db: Path) -> dict[str, Any]:
    """What the audit stored: ``late`` and ``late_join`` (its rows, two ways), ``marks`` (one
    per audited batch: id, late rows, sink, location) and ``by_input`` (each marker's split)."""
    with duckdb.connect(str(db), read_only=True) as con:
        marks = con.execute(
            "SELECT batch_id, late_rows, sink, location FROM audit_batches"
        ).fetchall()
        by_input = con.execute(
            "SELECT late_rows_by_input::VARCHAR FROM audit_batches "
            "WHERE late_rows_by_input IS NOT NULL"
        ).fetchall()
    return {
        "late": late_rows(db),
        "late_join": late_rows_of(db),
        "marks": marks,
        "by_input": [json.loads(r[0]) for r in by_input],
    }


def audited_run(
    spark: Any,
    folder: Path,
    query_frame: Any,
    events: Any,
    *,
    name: str,
    feed: Callable[[Any], None],
    available_now: bool = False,
    before_audit: Callable[[Any], None] | None = None,
    sync_seconds: float = 120,
    **audit_options: Any,
) -> dict[str, Any]:
    """Start ``query_frame`` into a memory table ``name`` (checkpoint ``folder/checkpoint``),
    audit it into ``folder/history.duckdb``, ``feed(query)`` until it has read its input, wait
    for the audit, and return what the checks need.

    The audit starts with the query, as in production (progress lets it skip batches with no
    late row); with ``before_audit(query)`` it starts after ``feed`` and that call instead.
    The result: ``status``, ``progress``, ``output`` (the memory table), ``metrics`` (the
    query's audit samples, and ``left``/``right``: the join's late rows by side), the stored
    rows of :func:`stored`, and ``checkpoint`` (a reader of it).
    """
    writer = (
        query_frame.writeStream.format("memory")
        .queryName(name)
        .outputMode("append")
        .option("checkpointLocation", str(folder / "checkpoint"))
    )
    if available_now:
        writer = writer.trigger(availableNow=True)
    db = folder / "history.duckdb"
    registry = CollectorRegistry()
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=registry)
    query = writer.start()
    try:
        if before_audit is None:
            handle = watch.audit(query, events, **audit_options)
            feed(query)
        else:
            feed(query)
            before_audit(query)
            handle = watch.audit(query, events, **audit_options)
        assert handle.sync(sync_seconds), handle.status()
        status = handle.status()
        progress = list(query.recentProgress)
        output = [r.asDict(recursive=True) for r in spark.table(name).collect()]
        metrics: dict[str, Any] = {
            sample: registry.get_sample_value(sample, {"query": name}) for sample in _QUERY_SAMPLES
        }
        for side in ("left", "right"):
            metrics[side] = registry.get_sample_value(
                "wmwatch_late_rows_audited_by_operator_total",
                {"query": name, "operator": "0", "kind": "join", "side": side},
            )
        handle.stop()
    finally:
        query.stop()
        watch.close()
    return {
        "status": status,
        "progress": progress,
        "output": output,
        "metrics": metrics,
        "checkpoint": CheckpointReader(str(folder / "checkpoint")),
        **stored(db),
    }


def run_audited(
    spark: Any,
    folder: Path,
    build: Callable[[Any], Any],
    *,
    batching: str,
    name: str,
    sink: str = "duckdb",
    files: list[list[dict[str, Any]]] | None = None,
    read: Callable[[Any, str], Any] | None = None,
    **audit_options: Any,
) -> dict[str, Any]:
    """Run ``build(events)`` over a file stream with the audit on (:func:`audited_run`).

    ``batching``: ``each`` writes a file per batch (with the no-data batches Spark inserts),
    ``bulk`` writes every file first and reads two per batch with availableNow. ``read(reader,
    folder)`` makes events from the stream reader (default: JSON with :data:`SCHEMA`,
    watermarked on ``ts``); ``files`` replaces :func:`stream_files` (also in the result).
    """
    files = files if files is not None else stream_files()
    reader = spark.readStream
    if batching == "bulk":
        for f in files:
            write_events(folder / "in", f)
        reader = reader.option("maxFilesPerTrigger", 2)
    if read is not None:
        events = read(reader, str(folder / "in"))
    else:
        events = reader.schema(SCHEMA).json(str(folder / "in")).withWatermark("ts", DELAY)
    if sink == "parquet":
        audit_options.setdefault("parquet_path", str(folder / "late"))

    def feed(query: Any) -> None:
        if batching == "bulk":
            query.awaitTermination(120)
            return
        for f in files:
            write_events(folder / "in", f)
            query.processAllAvailable()

    result = audited_run(
        spark,
        folder,
        build(events),
        events,
        name=name,
        feed=feed,
        available_now=batching == "bulk",
        sink=sink,
        **audit_options,
    )
    return {**result, "files": files}


def sidecar_status(
    spark: Any, db: Path, checkpoint: Path, events: Any, query: Any, *, name: str
) -> dict[str, Any]:
    """Audit a stopped query's checkpoint from this session into ``db`` until every committed
    batch is handled, and give the audit's last status."""
    with wmwatch.attach(spark, db=str(db), metrics_port=None) as watch:
        handle = watch.audit_checkpoint(
            checkpoint, events, query, name=name, poll_interval_seconds=0.2
        )
        assert handle.sync(180), handle.status()
        status = handle.status()
        handle.stop()
    return status
