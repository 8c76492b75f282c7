"""Starting an audit: checking its options, reading the audited query's plan and source, and
wiring the replay, the history and the watch's audit plugin together. :func:`start_auditor` is
the one wiring, for the in-job audit (:func:`start_audit`) and the sidecar alike.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from wmwatch._audit.auditor import Auditor, Resolved
from wmwatch._audit.handle import AuditHandle
from wmwatch._audit.jumps.rules import Thresholds
from wmwatch._audit.jumps.table import JumpHistory
from wmwatch._audit.jumps.watch import JumpWatch
from wmwatch._audit.options import SINKS, AuditOptions, Prepare
from wmwatch._audit.pacing import YIELD_FACTOR
from wmwatch._audit.plugin import audit_plugin
from wmwatch._audit.replay import connect, sources
from wmwatch._audit.replay.engine import Replayer, ReplayInput
from wmwatch._audit.replay.events import as_written
from wmwatch._audit.replay.plan import ReplayPlan, apply_overrides, parse_plan
from wmwatch._audit.replay.predicates import JOIN
from wmwatch._audit.replay.sources.base import ConnectFound, Found, remember_identities
from wmwatch._audit.sinks import AuditHistory
from wmwatch._checkpoint.fs import HadoopFileSystem, local_root
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch._core.plugins import HistoryAccess, WatchContext
from wmwatch._core.sessions import is_connect
from wmwatch._errors import AuditError, ConfigError, UnsupportedSourceError
from wmwatch._progress import clean_name, query_label
from wmwatch._trigger import read_trigger

HASH_KEY_VARIABLE = "WMWATCH_HASH_KEY"
COMPLETE_MODE = (
    "a query in complete output mode keeps every window and drops no late rows; nothing to audit."
)


_DELAY_KEY = "spark.watermarkDelayMs"


def events_list(value: Any, what: str = "events") -> list[Any]:
    """``events`` as a list: one streaming DataFrame, or a non-empty list or tuple of them."""
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
    prepares: Sequence[Prepare | None],
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


@dataclass(frozen=True, slots=True)
class QueryPlan:
    """What an audit reads off the audited query: its analysed plan (a JVM plan, or a
    :class:`~wmwatch._audit.replay.connect.ConnectQuery` on Spark Connect), the plan's text, and
    its checkpoint."""

    plan: Any
    text: str
    checkpoint: CheckpointReader


def _classic_plan(spark: Any, query: Any, checkpoint: str | os.PathLike[str] | None) -> QueryPlan:
    """Classic PySpark: the query's analysed plan (JVM) and its checkpoint."""
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
        raise AuditError(COMPLETE_MODE)
    root = str(checkpoint) if checkpoint is not None else str(engine.resolvedCheckpointRoot())
    fs = None if local_root(root) is not None else HadoopFileSystem(spark, root)
    return QueryPlan(query_plan, str(query_plan.toString()), CheckpointReader(root, fs))


def _connect_plan(
    spark: Any, query: Any, checkpoint: str | os.PathLike[str] | None, timeout_seconds: float
) -> Callable[[], QueryPlan | None]:
    """Spark Connect: the plan and the checkpoint once the query has planned a batch (None
    until then). The checkpoint is read through the server, which sees its filesystem; the
    client may not, or may see another folder at the same path."""
    known = connect.ConnectQuery(query)
    files = connect.SessionFileSystem(spark, timeout_seconds=timeout_seconds)

    def plan() -> QueryPlan | None:
        if not known.planned():
            return None
        if known.complete_mode():
            raise AuditError(COMPLETE_MODE)
        root = str(checkpoint) if checkpoint is not None else known.checkpoint_root()
        return QueryPlan(known, known.plan_text, CheckpointReader(root, files))

    return plan


def start_audit(
    watch: WatchContext,
    query: Any,
    events: Any,
    options: AuditOptions,
    checkpoint: str | os.PathLike[str] | None = None,
) -> AuditHandle:
    """Audit the rows the running ``query`` drops behind its watermark, in its own driver
    (``Watch.audit``, where each option is described); ``checkpoint`` overrides the query's
    checkpoint root."""
    spark = watch.spark
    if is_connect(spark):
        plan = _connect_plan(spark, query, checkpoint, options.job_timeout_seconds)
    else:

        def plan() -> QueryPlan | None:
            return _classic_plan(spark, query, checkpoint)

    auditor = start_auditor(
        watch,
        events_list(events),
        options,
        query_id=str(query.id),
        query_name=query.name,
        run_id=str(query.runId),
        plan=plan,
        # a real-time query judges rows with a watermark a whole interval old (the audit counts
        # the rows kept behind the reported one) and must keep every task slot it needs
        real_time=read_trigger(query).real_time,
    )
    return AuditHandle(auditor)


# What the audit writes its batches through: made from the store, the query's id, its name
# (cleaned), its label and the plan read at the start (None: not planned yet, Spark Connect).
HistoryFactory = Callable[[HistoryAccess, str, str | None, str, QueryPlan | None], AuditHistory]


def _audit_history(
    store: HistoryAccess, query_id: str, name: str | None, label: str, seen: QueryPlan | None
) -> AuditHistory:
    return AuditHistory(store, query_id=query_id, label=label)


def start_auditor(
    watch: WatchContext,
    frames: Sequence[Any],
    options: AuditOptions,
    *,
    query_id: str,
    query_name: str | None,
    run_id: str | None,
    plan: Callable[[], QueryPlan | None],
    in_job: bool = True,
    real_time: bool = False,
    history: HistoryFactory = _audit_history,
    check_plan: Callable[[ReplayPlan, CheckpointReader], None] | None = None,
    check_inputs: Callable[[Sequence[ReplayInput], CheckpointReader], None] | None = None,
) -> Auditor:
    """Check ``options``, read the audited query's plan and start its :class:`Auditor` on the
    watch: the one wiring of every audit.

    ``frames`` are the ``events`` DataFrames, one per input; ``plan()`` gives the query's plan
    and checkpoint, or None while a Spark Connect query has not planned a batch (the audit's
    thread asks again). ``in_job``: the query runs in this application, so its progress comes
    (to skip batches that hold no late row, and to count what an unreadable source dropped),
    its jobs are yielded to, and its watermark jumps are watched; a sidecar has none of these.
    ``history`` makes what the batches are written through (with a history store);
    ``check_plan`` and ``check_inputs`` refuse what the plan read from ``plan()`` cannot audit.
    """
    spark = watch.spark
    frames = list(frames)
    store = watch.store
    prepares, key = checked_options(spark, store, frames, options)
    thresholds = (
        Thresholds(
            ahead_seconds=options.watermark_ahead_seconds,
            jump_seconds=options.watermark_jump_seconds,
        )
        if in_job
        else None
    )
    # Spark Connect: each events DataFrame's source, read off the client's plan
    connect_sources: dict[int, ConnectFound] = {}
    # the name as every other table keeps it (redacted, bounded): late_rows and Parquet too
    name = clean_name(query_name)
    label = query_label(name, query_id)
    # what earlier audits saw of the sources' identities, handed to the sources before the
    # checks below read a batch (a topic created again must not pass for the one it read)
    audit_history: AuditHistory | None = None

    def resolved(seen: QueryPlan) -> Resolved:
        replay_plan = apply_overrides(
            parse_plan(seen.text),
            kind=options.kind,
            event_time=options.event_time,
            delay=options.delay,
            window=options.window,
            slide=options.slide,
        )
        if check_plan is not None:
            check_plan(replay_plan, seen.checkpoint)
        inputs = _replay_inputs(
            spark, replay_plan, seen.text, seen.plan, frames, prepares, connect_sources
        )
        if audit_history is not None:
            remember_identities((i.source for i in inputs), audit_history.identity_book())
        if check_inputs is not None:
            check_inputs(inputs, seen.checkpoint)
        covers = in_job and replay_plan.watermark_nodes <= 1
        return Resolved(seen.checkpoint, inputs, progress_min_covers_inputs=covers)

    if is_connect(spark):
        # the query's plan may not be known yet: events as written is read off each events
        # DataFrame now, so that what cannot be replayed is refused here
        prepares = [
            p if p is not None else as_written(spark, f)
            for f, p in zip(frames, prepares, strict=True)
        ]
        # each events DataFrame's source, read off the client's plan now (its errors raise here)
        connect_sources.update((id(f), sources.connect_source_of(f)) for f in frames)
    seen = plan()
    if store is not None:
        audit_history = history(store, query_id, name, label, seen)
    now = resolved(seen) if seen is not None else None

    def resolve() -> Resolved | None:
        later = plan()
        return resolved(later) if later is not None else None

    replayer = Replayer(
        spark=spark,
        query_id=query_id,
        query_name=name,
        label=label,
        inputs=now.inputs if now is not None else (),
        columns=options.columns,
        hash_columns=options.hash_columns,
        parquet_path=str(options.parquet_path) if options.parquet_path is not None else None,
        pool=options.pool,
        max_rows_per_batch=options.max_rows_per_batch,
        max_row_bytes=options.max_row_bytes,
        job_timeout_seconds=options.job_timeout_seconds,
        one_task=real_time,
        hash_key=key,
    )
    jumps = None
    if thresholds is not None:
        jumps = JumpWatch(
            thresholds=thresholds,
            history=JumpHistory(store, query_id=query_id, query_name=name, label=label)
            if store is not None
            else None,
            label=label,
        )
    auditor = Auditor(
        query_id=query_id,
        query_name=name,
        label=label,
        run_id=run_id,
        checkpoint=now.checkpoint if now is not None else None,
        sink=options.sink,
        replayer=replayer,
        history=audit_history,
        poll_interval_seconds=options.poll_interval_seconds,
        progress_min_covers_inputs=now.progress_min_covers_inputs if now is not None else True,
        # a query that has not planned a batch yet is resolved by the audit's thread once it
        # has; until then the audit waits and status() says plan_known=False
        resolve=resolve if now is None else None,
        count_kept_behind=real_time,
        jumps=jumps,
        # a sidecar's application runs no production job to yield to
        yield_factor=YIELD_FACTOR if in_job else 0.0,
    )
    if not in_job:
        auditor.progress_grace_seconds = 0.0  # no progress will come to wait for
    audit_plugin(watch).add(auditor)
    auditor.start()
    return auditor


def checked_options(
    spark: Any, store: HistoryAccess | None, frames: list[Any], options: AuditOptions
) -> tuple[list[Prepare | None], bytes | None]:
    """Check an audit's options (one line each for what is wrong); the prepare of each events
    DataFrame and the HMAC key."""
    sink, prepare, columns = options.sink, options.prepare, options.columns
    if sink not in SINKS:
        raise ConfigError(f"sink={sink!r} is not one of {', '.join(SINKS)}.")
    if options.max_rows_per_batch < 0:
        raise ConfigError("max_rows_per_batch must be 0 (count only) or more.")
    if options.max_row_bytes < 64:
        raise ConfigError("max_row_bytes must be at least 64 bytes.")
    if options.job_timeout_seconds <= 0:
        raise ConfigError("job_timeout_seconds must be positive.")
    if sink == "parquet" and not options.parquet_path:
        raise ConfigError(
            "sink='parquet' needs parquet_path=, the directory Spark writes late rows to."
        )
    if sink == "duckdb" and store is None:
        raise ConfigError(
            "the watch has no history database; attach with db=... or use sink='parquet'."
        )
    if prepare is None or callable(prepare):
        prepares: list[Prepare | None] = [prepare] * len(frames)
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
    unknown = [c for c in options.hash_columns if columns is not None and c not in columns]
    if unknown:
        raise ConfigError(f"hash_columns {unknown} are not in columns=; add them or drop them.")
    key = resolve_hash_key(options.hash_key, os.environ.get(HASH_KEY_VARIABLE))
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
