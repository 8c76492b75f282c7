"""Starting an audit: checking what it is asked to do, reading the query's plan and source, and
wiring the replay, the history and the watch's audit plugin together; :class:`AuditHandle` is
what the caller gets back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from wmwatch._audit.auditor import Auditor, Resolved
from wmwatch._audit.jumps.rules import DEFAULT_AHEAD_SECONDS, DEFAULT_JUMP_SECONDS, Thresholds
from wmwatch._audit.jumps.table import JumpHistory
from wmwatch._audit.jumps.watch import JumpWatch
from wmwatch._audit.plugin import audit_plugin
from wmwatch._audit.replay import connect, sources
from wmwatch._audit.replay.engine import Replayer, ReplayInput
from wmwatch._audit.replay.events import as_written
from wmwatch._audit.replay.plan import ReplayPlan, apply_overrides, parse_plan
from wmwatch._audit.replay.predicates import JOIN, OperatorSpec
from wmwatch._audit.replay.sources.base import ConnectFound, Found
from wmwatch._audit.sinks import AuditHistory
from wmwatch._checkpoint.reader import CheckpointReader, HadoopFileSystem, local_root
from wmwatch._core.plugins import HistoryAccess, WatchContext
from wmwatch._core.sessions import is_connect
from wmwatch._errors import AuditError, ConfigError, UnsupportedSourceError
from wmwatch._progress import clean_name, query_label
from wmwatch._trigger import read_trigger

SINKS = ("duckdb", "parquet")
DEFAULT_MAX_ROWS_PER_BATCH = 100_000
DEFAULT_MAX_ROW_BYTES = 16 * 1024
DEFAULT_JOB_TIMEOUT_SECONDS = 900.0
HASH_KEY_VARIABLE = "WMWATCH_HASH_KEY"
_COMPLETE_MODE = (
    "a query in complete output mode keeps every window and drops no late rows; nothing to audit."
)


class AuditHandle:
    """A running audit: ``status()``, ``sync()`` and ``stop()``."""

    def __init__(self, auditor: Auditor) -> None:
        self._auditor = auditor

    @property
    def query_id(self) -> str:
        return self._auditor.query_id

    @property
    def spec(self) -> OperatorSpec | None:
        """The rule of the first audited input; None on Spark Connect until the query has
        planned a batch."""
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


_DELAY_KEY = "spark.watermarkDelayMs"


def _as_list(value: Any, what: str) -> list[Any]:
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError(f"{what} is empty; pass one streaming DataFrame per input.")
        return list(value)
    return [value]


def _watermarked_column(events: Any) -> str | None:
    """The column of ``events`` that carries a watermark (Spark's event-time column)."""
    try:
        fields = events.schema.fields
    except Exception:  # noqa: BLE001 - a frame whose schema cannot be read has no watermark here
        return None
    return next((f.name for f in fields if _DELAY_KEY in (f.metadata or {})), None)


def _source_of(
    spark: Any,
    frame: Any,
    query_plan: Any,
    plan_text: str,
    connect_sources: Mapping[int, ConnectFound],
) -> Found:
    """Where the source ``frame`` reads sits in the query (candidate source indexes), how to
    read it again given its index, and a name for messages (:mod:`wmwatch._audit.replay.sources`).
    On Spark Connect the source was read off the client's plan when the audit started; its position
    comes from the query's progress (a query with one source needs none)."""
    if isinstance(query_plan, connect.ConnectQuery):
        return connect_sources[id(frame)](query_plan.source_descriptions())
    return sources.source_of(spark, frame, query_plan, plan_text)


def _replay_inputs(
    spark: Any,
    plan: ReplayPlan,
    plan_text: str,
    query_plan: Any,
    events: list[Any],
    prepares: list[Callable[[Any], Any] | None],
    connect_sources: Mapping[int, ConnectFound],
) -> list[ReplayInput]:
    """Match each events DataFrame to the query's source it reads and that source's rule."""
    by_index = {i.source_index: i for i in plan.inputs}
    taken: set[int] = set()
    inputs: list[ReplayInput] = []
    for position, (frame, prepare) in enumerate(zip(events, prepares, strict=True)):
        replayable = True
        try:
            found = _source_of(spark, frame, query_plan, plan_text, connect_sources)
        except UnsupportedSourceError as exc:
            if query_plan is None or isinstance(query_plan, connect.ConnectQuery):
                raise
            # audited without its rows: what Spark dropped from it is counted from progress
            found = sources.unreplayable(frame, query_plan, exc)
            replayable = False
        candidates = [i for i in found.positions if i not in taken]
        if not candidates:
            raise AuditError(
                f"events[{position}] reads {found.description}, which the query does not read "
                "(or another events DataFrame already stands for it); pass the streaming "
                "DataFrames the query reads."
            )
        index = candidates[0]
        taken.add(index)
        planned = by_index.get(index)
        if planned is None or planned.spec is None:
            if planned is not None and planned.drops:
                raise AuditError(f"cannot audit source {index}: {planned.reason}.")
            continue  # Spark drops none of this source's rows: nothing to replay
        spec = planned.spec
        own = _watermarked_column(frame)
        if own is not None and (spec.kind == JOIN or spec.event_time_column not in frame.columns):
            # a join side judges the one column of its input that carries the watermark, which
            # is a window struct when the join keys hold windows
            spec = replace(spec, event_time_column=own)
        if prepare is None and replayable and not isinstance(query_plan, connect.ConnectQuery):
            # events as written: its own plan, over each batch of its source's raw rows
            prepare = as_written(spark, frame)
        inputs.append(
            ReplayInput(
                source=found.at(index),
                spec=spec,
                prepare=prepare,
                join_keys=planned.join_keys,
            )
        )
    missing = [i for i in plan.audited if i.source_index not in taken]
    if missing:
        names = ", ".join(f"source {i.source_index} ({i.relation[:80]})" for i in missing)
        raise AuditError(
            f"the query also drops late rows of {names}; pass the streaming DataFrame of every "
            "input that reaches a stateful operator (events=[...], in any order)."
        )
    if not inputs:
        raise AuditError(
            f"cannot audit this query: {plan.problem or 'none of its inputs drops late rows'}."
        )
    return inputs


def _classic_plan(query: Any, checkpoint: str | os.PathLike[str] | None) -> tuple[Any, str]:
    """Classic PySpark: the query's analysed plan (JVM) and its checkpoint root."""
    jsq_wrapper = getattr(query, "_jsq", None)
    if jsq_wrapper is None:
        raise AuditError(
            "the query has no JVM handle; pass the StreamingQuery that start() returned in "
            "this session."
        )
    engine = jsq_wrapper.streamingQuery()
    try:
        query_plan = engine.analyzedPlan()
    except Exception:  # noqa: BLE001 - older Spark: no analysed plan on the engine
        query_plan = engine.logicalPlan()
    try:
        complete = str(engine.outputMode().toString()).lower() == "complete"
    except Exception:  # noqa: BLE001 - internal API: unknown means not complete mode
        complete = False
    if complete:
        raise AuditError(_COMPLETE_MODE)
    root = str(checkpoint) if checkpoint is not None else str(engine.resolvedCheckpointRoot())
    return query_plan, root


def _connect_resolver(
    spark: Any,
    query: Any,
    frames: list[Any],
    checkpoint: str | os.PathLike[str] | None,
    timeout_seconds: float,
    resolved: Callable[[Any, str, CheckpointReader], Resolved],
) -> Callable[[], Resolved | None]:
    """Spark Connect: the plan, the checkpoint root and the sources' positions once the query
    has planned a batch. The checkpoint is read through the server, which sees its filesystem;
    the client may not, or may see another folder at the same path."""
    known = connect.ConnectQuery(query)
    files = connect.SessionFileSystem(spark, timeout_seconds=timeout_seconds)

    def resolve() -> Resolved | None:
        if not known.planned():
            return None
        if known.complete_mode():
            raise AuditError(_COMPLETE_MODE)
        root = str(checkpoint) if checkpoint is not None else known.checkpoint_root()
        return resolved(known, known.plan_text, CheckpointReader(root, files))

    return resolve


def start_audit(
    watch: WatchContext,
    query: Any,
    events: Any,
    *,
    prepare: Callable[[Any], Any] | Sequence[Callable[[Any], Any] | None] | None = None,
    sink: str = "duckdb",
    parquet_path: str | os.PathLike[str] | None = None,
    columns: Sequence[str] | None = None,
    hash_columns: Sequence[str] = (),
    hash_key: bytes | str | None = None,
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
    watermark_ahead_seconds: float = DEFAULT_AHEAD_SECONDS,
    watermark_jump_seconds: float = DEFAULT_JUMP_SECONDS,
) -> AuditHandle:
    """Start auditing the rows ``query`` drops behind its watermark; returns an
    :class:`AuditHandle`.

    ``events`` is the streaming DataFrame the query reads before its stateful operator, or, for a
    query with several inputs (a join, a union), a list of them, one per source. Each batch is
    replayed through ``events`` as written: its own transformation of the source (parsing,
    filters, new columns) runs over the batch's raw rows, on classic PySpark and Spark Connect;
    what cannot be replayed (a non-deterministic expression, a stateful step inside ``events``)
    is refused with the reason. ``prepare`` overrides that: the function (a list of them, one
    per events DataFrame, None where not needed) that turns the raw source DataFrame (read as a
    batch) into the same rows. Each input's
    operator, join side, event-time column, delay and window come from the query's plan; for a
    query with one audited input the keyword arguments override them. ``sink="parquet"`` writes
    each batch's late rows with Spark under ``parquet_path`` instead of collecting them into
    DuckDB.

    On Spark Connect the audit works the same through the session; a query that has not
    planned a batch yet is read once it has (``status()["plan_known"]``), and a plan that cannot
    be audited then ends the audit with the reason in ``status()["last_error"]``.

    ``columns`` (an allow-list) and ``hash_columns`` apply to ``row_data`` and to a join's
    ``join_key`` alike. A hashed column is SHA-256 of its value, or, with ``hash_key`` (bytes,
    or a str taken as UTF-8; default ``$WMWATCH_HASH_KEY``), HMAC-SHA256 under that key, which
    a dictionary of likely values cannot reverse without the key.

    Bounds: at most ``max_rows_per_batch`` late rows of one batch are kept in DuckDB (the rest
    are counted, and written to Parquet when ``parquet_path`` is given with the DuckDB sink);
    ``row_data`` longer than ``max_row_bytes`` is kept as its size and SHA-256; every Spark job
    of the audit is cancelled after ``job_timeout_seconds`` (and retried later).

    Who moved the watermark (docs/forensics-watermark.md): a batch whose largest event time is
    more than ``watermark_ahead_seconds`` (10 min) after the batch's own time, or whose
    watermark is more than ``watermark_jump_seconds`` (1 h) above the batch before's, is
    recorded in ``watermark_jumps`` with the rows that moved the watermark (the top rows by
    event time, same ``columns``/``hash_columns`` rules) and the late rows the jump cost.
    """
    spark = watch.spark
    frames = _as_list(events, "events")
    prepares, key = checked_options(
        spark,
        watch.store,
        frames,
        prepare=prepare,
        sink=sink,
        parquet_path=parquet_path,
        columns=columns,
        hash_columns=hash_columns,
        hash_key=hash_key,
        max_rows_per_batch=max_rows_per_batch,
        max_row_bytes=max_row_bytes,
        job_timeout_seconds=job_timeout_seconds,
    )
    store = watch.store
    thresholds = Thresholds(
        ahead_seconds=watermark_ahead_seconds, jump_seconds=watermark_jump_seconds
    )
    # Spark Connect: each events DataFrame's source, read off the client's plan
    connect_sources: dict[int, ConnectFound] = {}

    def resolved(query_plan: Any, plan_text: str, reader: CheckpointReader) -> Resolved:
        plan = apply_overrides(
            parse_plan(plan_text),
            kind=kind,
            event_time=event_time,
            delay=delay,
            window=window,
            slide=slide,
        )
        inputs = _replay_inputs(
            spark, plan, plan_text, query_plan, frames, prepares, connect_sources
        )
        return Resolved(reader, inputs, progress_min_covers_inputs=plan.watermark_nodes <= 1)

    resolve: Callable[[], Resolved | None] | None = None
    if is_connect(spark):
        # the query's plan may not be known yet: events as written is read off each events
        # DataFrame now, so that what cannot be replayed is refused here
        prepares = [
            p if p is not None else as_written(spark, f)
            for f, p in zip(frames, prepares, strict=True)
        ]
        # each events DataFrame's source, read off the client's plan now (its errors raise here)
        connect_sources.update((id(f), sources.connect_source_of(f)) for f in frames)
        resolve = _connect_resolver(spark, query, frames, checkpoint, job_timeout_seconds, resolved)
        now = resolve()
        # a query that has not planned a batch yet is resolved by the audit's thread once it
        # has; until then the audit waits and status() says plan_known=False
        resolve = resolve if now is None else None
    else:
        query_plan, root = _classic_plan(query, checkpoint)
        fs = None if local_root(root) is not None else HadoopFileSystem(spark, root)
        now = resolved(query_plan, str(query_plan.toString()), CheckpointReader(root, fs))
    # the name as every other table keeps it (redacted, bounded): late_rows and Parquet too
    query_id, query_name = str(query.id), clean_name(query.name)
    label = query_label(query_name, query_id)
    # a real-time query judges rows with a watermark a whole interval old (the audit counts
    # the rows kept behind the reported one) and must keep every task slot it needs
    real_time = read_trigger(query).real_time
    replayer = Replayer(
        spark=spark,
        query_id=query_id,
        query_name=query_name,
        label=label,
        inputs=now.inputs if now is not None else (),
        columns=columns,
        hash_columns=hash_columns,
        parquet_path=str(parquet_path) if parquet_path is not None else None,
        pool=pool,
        max_rows_per_batch=max_rows_per_batch,
        max_row_bytes=max_row_bytes,
        job_timeout_seconds=job_timeout_seconds,
        one_task=real_time,
        hash_key=key,
    )
    auditor = Auditor(
        query_id=query_id,
        query_name=query_name,
        label=label,
        run_id=str(query.runId),
        checkpoint=now.checkpoint if now is not None else None,
        sink=sink,
        replayer=replayer,
        history=(
            AuditHistory(store, query_id=query_id, label=label) if store is not None else None
        ),
        poll_interval_seconds=poll_interval_seconds,
        progress_min_covers_inputs=now.progress_min_covers_inputs if now is not None else True,
        resolve=resolve,
        count_kept_behind=real_time,
        jumps=JumpWatch(
            thresholds=thresholds,
            history=JumpHistory(store, query_id=query_id, query_name=query_name, label=label)
            if store is not None
            else None,
            label=label,
        ),
    )
    audit_plugin(watch).add(auditor)
    auditor.start()
    return AuditHandle(auditor)


def checked_options(
    spark: Any,
    store: HistoryAccess | None,
    frames: list[Any],
    *,
    prepare: Callable[[Any], Any] | Sequence[Callable[[Any], Any] | None] | None,
    sink: str,
    parquet_path: str | os.PathLike[str] | None,
    columns: Sequence[str] | None,
    hash_columns: Sequence[str],
    hash_key: bytes | str | None,
    max_rows_per_batch: int,
    max_row_bytes: int,
    job_timeout_seconds: float,
) -> tuple[list[Callable[[Any], Any] | None], bytes | None]:
    """Check an audit's options (one line each for what is wrong); the prepare of each events
    DataFrame and the HMAC key. Shared by the in-job audit and the sidecar."""
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
    if sink == "duckdb" and store is None:
        raise ConfigError(
            "the watch has no history database; attach with db=... or use sink='parquet'."
        )
    if prepare is None or callable(prepare):
        prepares: list[Callable[[Any], Any] | None] = [prepare] * len(frames)
    else:
        prepares = list(prepare)
    if len(prepares) != len(frames) or not all(p is None or callable(p) for p in prepares):
        raise ConfigError(
            "prepare must be a function from the raw source DataFrame to events, or a list with "
            "one such function (or None) per events DataFrame."
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
    unknown = [c for c in hash_columns if columns is not None and c not in columns]
    if unknown:
        raise ConfigError(f"hash_columns {unknown} are not in columns=; add them or drop them.")
    key = resolve_hash_key(hash_key, os.environ.get(HASH_KEY_VARIABLE))
    return prepares, key


def resolve_hash_key(option: bytes | str | None, variable: str | None) -> bytes | None:
    """The HMAC key for hashed columns: the option, else the environment variable's value;
    None for plain SHA-256."""
    key = option if option is not None else variable
    if key is None:
        return None
    if not isinstance(key, (bytes, bytearray, str)):
        raise ConfigError("hash_key must be bytes or a str.")
    raw = key.encode("utf-8") if isinstance(key, str) else bytes(key)
    if not raw:
        where = "hash_key" if option is not None else f"${HASH_KEY_VARIABLE}"
        raise ConfigError(f"{where} is empty; give a secret key, or leave it unset for SHA-256.")
    return raw
