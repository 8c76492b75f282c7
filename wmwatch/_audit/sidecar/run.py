"""The audit as a sidecar: the same late-row audit, run in a Spark application of its own against
another application's checkpoint, while that query runs or after it stopped. The plan comes
from the user's definition of the query (built, unstarted, in the sidecar's session), the
checkpoint is only read, and the auditor is started through the in-job audit's own wiring
(:func:`wmwatch._audit.start.start_auditor`). How it differs from the in-job audit:
docs/sidecar-audit.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from wmwatch._audit.handle import SidecarHandle
from wmwatch._audit.options import AuditOptions
from wmwatch._audit.replay.engine import ReplayInput
from wmwatch._audit.replay.plan import ReplayPlan
from wmwatch._audit.replay.sources.files import FileBatchSource
from wmwatch._audit.sidecar.history import SidecarHistory
from wmwatch._audit.sidecar.settings import check_event_times, check_recorded_conf
from wmwatch._audit.start import COMPLETE_MODE, QueryPlan, events_list, start_auditor
from wmwatch._checkpoint.fs import (
    CheckpointDamaged,
    HadoopFileSystem,
    inside_checkpoint,
    local_root,
    normalise_path,
)
from wmwatch._checkpoint.history import parse_query_id
from wmwatch._checkpoint.reader import CheckpointReader, parse_source_log
from wmwatch._core.plugins import HistoryAccess, WatchContext
from wmwatch._core.sessions import is_connect
from wmwatch._errors import AuditError, ConfigError, WmwatchError
from wmwatch._text import error_line, redact

# The run id of the ``queries`` row a sidecar writes: the checkpoint records no run ids, and
# the production query's runs are not the sidecar's to name.
SIDECAR_RUN_ID = "sidecar"
_OUTPUT_MODES = ("append", "update", "complete")


def checkpoint_query_id(reader: CheckpointReader) -> str:
    """The query id a checkpoint belongs to (its ``metadata`` file, written when the query is
    first started): a UUID, since the audit names its Parquet folders with it; ConfigError for a
    folder that is no streaming checkpoint."""
    return parse_query_id(reader.fs.read_text(f"{reader.root.rstrip('/')}/metadata"), reader.root)


def _open_checkpoint(spark: Any, root: str) -> tuple[CheckpointReader, str]:
    """A reader of the checkpoint at ``root`` and its query id; one line for a checkpoint that
    cannot be reached (a Hadoop filesystem this application has no settings or classes for)."""
    try:
        fs = None if local_root(root) is not None else HadoopFileSystem(spark, root)
        reader = CheckpointReader(root, fs)
        return reader, checkpoint_query_id(reader)
    except WmwatchError:
        raise
    except Exception as exc:  # noqa: BLE001 - py4j's errors from a Hadoop filesystem, or the OS's
        raise ConfigError(
            f"cannot read the checkpoint {redact(root)}: {error_line(exc, 300)}; check the URI "
            "and the sidecar's filesystem settings (--conf spark.hadoop....)"
        ) from None


def _streaming_frame(value: Any, what: str) -> Any:
    """``value`` if it is a classic PySpark streaming DataFrame; a one-line error otherwise."""
    if getattr(value, "_jdf", None) is None or not hasattr(value, "isStreaming"):
        raise ConfigError(
            f"{what} is a {type(value).__name__}, not a DataFrame; it must be a streaming "
            "DataFrame built with spark.readStream in the sidecar's session."
        )
    if not value.isStreaming:
        raise ConfigError(
            f"{what} is a batch DataFrame; it must be the streaming DataFrame the production "
            "query reads (spark.readStream..., with its withWatermark)."
        )
    return value


def _check_source_count(plan: ReplayPlan, reader: CheckpointReader) -> None:
    """The definition must read as many sources as the checkpoint's query (source indexes are
    positions in that list, so a different definition would replay the wrong source)."""
    latest = reader.latest_offsets()
    if latest is None:
        return  # no batch planned yet: checked by the replay's own source checks
    logged, sources = len(latest.source_offsets), len(plan.inputs)
    if logged != sources:
        raise AuditError(
            f"the checkpoint's query reads {logged} source(s) but the definition given reads "
            f"{sources}; give the events and query exactly as the production query builds them."
        )


def _path_part(uri: str) -> str:
    """A file's path without scheme and authority (``hdfs://nn:8020/a`` and ``hdfs:///a`` are
    one file to the checks below), without a trailing slash."""
    text = normalise_path(uri)
    match = re.match(r"^[A-Za-z][\w+.-]*://[^/]*(/.*)?$", text)
    path = (match.group(1) or "/") if match else text
    if not match and not re.match(r"^[A-Za-z][\w+.-]*:", path):
        path = os.path.abspath(path)  # a relative folder is the session's working directory's
    return path.rstrip("/") or "/"


def _newest_logged_file(reader: CheckpointReader, source_index: int) -> str | None:
    """A file the checkpoint's query took in from source ``source_index`` (the newest log
    entry's last file); None when its log holds none."""
    directory = f"{reader.root.rstrip('/')}/sources/{source_index}"
    names = reader.fs.list_names(directory)
    numbered = sorted(
        (int(m.group(1)), name) for name in names if (m := re.match(r"^(\d+)(\.compact)?$", name))
    )
    for _, name in reversed(numbered):
        try:
            text = reader.fs.read_text(f"{directory}/{name}")
            files = parse_source_log(text, f"sources/{source_index}/{name}") if text else []
        except CheckpointDamaged:
            continue  # costs the batches that read it, when the audit reaches them
        if files:
            return files[-1].path
    return None


def _check_file_sources(inputs: Sequence[ReplayInput], reader: CheckpointReader) -> None:
    """Each file source of the definition must read the folder the checkpoint's query read at
    that position: sources in another order (a join's sides swapped) would replay the wrong
    files."""
    for item in inputs:
        source = item.source
        if not isinstance(source, FileBatchSource):
            continue
        folders = [_path_part(p) for p in source.spec.paths]
        if not folders or any(re.search(r"[*?\[{]", f) for f in folders):
            continue  # a glob: any file may match it
        logged = _newest_logged_file(reader, source.source_index)
        if logged is None:
            continue
        path = _path_part(logged)
        if not any(path == f or path.startswith(f.rstrip("/") + "/") for f in folders):
            raise AuditError(
                f"source {source.source_index} of the checkpoint's query read {redact(path)}, "
                f"which is not under {', '.join(map(redact, source.spec.paths))}, the folder "
                "the definition reads there; give the events in the production query's order."
            )


def _record_query(store: HistoryAccess, query_id: str, name: str | None) -> None:
    """One ``queries`` row, so ``wmwatch report`` lists the audited query under its name; its
    status is unknown here (the sidecar sees the checkpoint, not the query), and its start is
    the sidecar's (the report orders a query's rows by it)."""

    def write(con: Any) -> None:
        con.execute(
            """
            INSERT INTO queries (query_id, run_id, query_name, status, started_at)
            VALUES (?, ?, ?, 'unknown', now())
            ON CONFLICT (query_id, run_id) DO UPDATE SET
                query_name = coalesce(excluded.query_name, queries.query_name),
                started_at = excluded.started_at
            """,
            [query_id, SIDECAR_RUN_ID, name],
        )

    store.submit(write, description=f"sidecar audit of {query_id}: query row")


def start_sidecar(
    watch: WatchContext,
    checkpoint: str | os.PathLike[str],
    events: Any,
    query: Any,
    options: AuditOptions,
    *,
    name: str | None = None,
    output_mode: str = "append",
) -> SidecarHandle:
    """Audit the late rows of the query whose checkpoint is ``checkpoint``, from this session
    (``Watch.audit_checkpoint``, where each argument is described). The checkpoint is only
    read; nothing of this audit runs as a streaming query."""
    spark = watch.spark
    if is_connect(spark):
        raise ConfigError(
            "the sidecar audit needs a classic SparkSession (it reads the definition's plan "
            "through the driver's JVM); start it with SparkSession.builder, not remote()."
        )
    if output_mode.lower() not in _OUTPUT_MODES:
        raise ConfigError(
            f"output_mode={output_mode!r}: give the production query's, append or update."
        )
    if output_mode.lower() == "complete":
        raise AuditError(COMPLETE_MODE)
    if options.poll_interval_seconds <= 0:
        raise ConfigError("poll_interval_seconds must be positive.")
    frames = [
        _streaming_frame(f, f"events[{i}]" if isinstance(events, (list, tuple)) else "events")
        for i, f in enumerate(events_list(events))
    ]
    if query is None and (len(frames) > 1 or options.kind is None):
        raise ConfigError(
            "give the query's DataFrame built on events (query=, or --query module:function): "
            "its stateful operators set the late-row rules (one input may give kind= instead)."
        )
    defined = _streaming_frame(query, "query") if query is not None else frames[0]
    root = os.fspath(checkpoint)
    written = [
        p for p in (getattr(watch.store, "path", None), options.parquet_path) if p is not None
    ]
    for place in written:
        if inside_checkpoint(place, root):
            raise ConfigError(
                f"{redact(os.fspath(place))} is inside the checkpoint {redact(root)}, which the "
                "sidecar only reads: keep the history and the Parquet folder elsewhere"
            )
    reader, query_id = _open_checkpoint(spark, root)

    def plan() -> QueryPlan:
        check_recorded_conf(reader, spark)
        query_plan = defined._jdf.queryExecution().analyzed()
        return QueryPlan(query_plan, str(query_plan.toString()), reader)

    def check_inputs(inputs: Sequence[ReplayInput], seen: CheckpointReader) -> None:
        _check_file_sources(inputs, seen)
        # the sidecar's session must read event times as the production query's did
        check_event_times(
            spark,
            seen,
            inputs,
            query=defined,
            query_plan=defined._jdf.queryExecution().analyzed(),
            timeout_seconds=options.job_timeout_seconds,
        )

    def history(
        store: HistoryAccess, query_id: str, name: str | None, label: str, seen: QueryPlan | None
    ) -> SidecarHistory:
        sidecar_history = SidecarHistory(
            store,
            query_id=query_id,
            label=label,
            reader=reader,
            query_name=name,
            # Spark reports the epoch as a watermarked query's watermark before its first
            has_watermark=seen is not None and "EventTimeWatermark" in seen.text,
        )
        return sidecar_history

    auditor = start_auditor(
        watch,
        frames,
        options,
        query_id=query_id,
        query_name=name,
        run_id=None,
        plan=plan,
        # no production query runs here: no progress, nothing to yield to, every committed
        # batch that read data is replayed
        in_job=False,
        history=history,
        check_plan=_check_source_count,
        check_inputs=check_inputs,
    )
    if watch.store is not None:
        # once the audit started: a sidecar refused at start leaves no row behind
        _record_query(watch.store, query_id, auditor.query_name)
    return SidecarHandle(auditor)
