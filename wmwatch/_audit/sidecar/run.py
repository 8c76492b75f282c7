"""The audit as a sidecar: the same late-row audit, run in a Spark application of its own against
another application's checkpoint, while that query runs or after it stopped.

The in-job audit learns three things from the running query: its plan (which operators judge
which source's rows late), its checkpoint (what each batch read, and the watermark it judged
with) and its progress (which batches may be skipped, and Spark's own drop counts). A sidecar has
no running query and no progress: the plan comes from the user's definition of the query (the
``events`` DataFrames and the query's DataFrame built on them, unstarted, in the sidecar's
session), the checkpoint is read as the in-job audit reads it (never written), and every
committed batch that read data is replayed. Spark's drop counts are not known here, so what an
unreplayable source dropped is stored as unknown (NULL), never as 0.

Everything else is the in-job audit's own: :class:`~wmwatch._audit.auditor.Auditor` loops over
the committed batches, polls for new commits, resumes after the batches its history marks, and
counts purged batches as lost; the rows, markers and metrics are the same.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from wmwatch._audit.auditor import Auditor
from wmwatch._audit.plugin import audit_plugin
from wmwatch._audit.replay.engine import Replayer, ReplayInput
from wmwatch._audit.replay.plan import apply_overrides, parse_plan
from wmwatch._audit.replay.sources.files import FileBatchSource
from wmwatch._audit.sidecar.history import SidecarHistory
from wmwatch._audit.sidecar.settings import check_event_times, check_recorded_conf
from wmwatch._audit.start import (
    _COMPLETE_MODE,
    DEFAULT_JOB_TIMEOUT_SECONDS,
    DEFAULT_MAX_ROW_BYTES,
    DEFAULT_MAX_ROWS_PER_BATCH,
    AuditHandle,
    _as_list,
    _replay_inputs,
    checked_options,
)
from wmwatch._checkpoint.history import parse_query_id
from wmwatch._checkpoint.reader import (
    CheckpointDamaged,
    CheckpointReader,
    HadoopFileSystem,
    inside_checkpoint,
    local_root,
    normalise_path,
    parse_source_log,
)
from wmwatch._core.plugins import HistoryAccess, WatchContext
from wmwatch._core.sessions import is_connect
from wmwatch._errors import AuditError, ConfigError, WmwatchError
from wmwatch._progress import clean_name, query_label
from wmwatch._text import error_line, redact

# The run id of the ``queries`` row a sidecar writes: the checkpoint records no run ids, and
# the production query's runs are not the sidecar's to name.
SIDECAR_RUN_ID = "sidecar"
_OUTPUT_MODES = ("append", "update", "complete")


class SidecarHandle(AuditHandle):
    """A running sidecar audit: ``status()``, ``sync()``, ``stop()`` as for the in-job audit,
    and ``finish()``, which ends it once every batch committed so far is audited."""

    def finish(self) -> None:
        """Audit what is committed (and what commits meanwhile), then end on its own."""
        self._auditor.finish()

    @property
    def running(self) -> bool:
        return bool(self._auditor.status()["running"])


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


def _check_source_count(reader: CheckpointReader, sources: int) -> None:
    """The definition must read as many sources as the checkpoint's query (source indexes are
    positions in that list, so a different definition would replay the wrong source)."""
    latest = reader.latest_offsets()
    if latest is None:
        return  # no batch planned yet: checked by the replay's own source checks
    logged = len(latest.source_offsets)
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


def _check_file_sources(reader: CheckpointReader, inputs: Sequence[ReplayInput]) -> None:
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
    query: Any = None,
    *,
    name: str | None = None,
    output_mode: str = "append",
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
    pool: str = "wmwatch_audit",
    poll_interval_seconds: float = 1.0,
    max_rows_per_batch: int = DEFAULT_MAX_ROWS_PER_BATCH,
    max_row_bytes: int = DEFAULT_MAX_ROW_BYTES,
    job_timeout_seconds: float = DEFAULT_JOB_TIMEOUT_SECONDS,
) -> SidecarHandle:
    """Audit the late rows of the query whose checkpoint is ``checkpoint``, from this session.

    ``events`` is the streaming DataFrame (a list for several inputs) the production query
    reads, built the same way in this session; ``query`` the query's DataFrame built on them
    (what the production code calls ``writeStream`` on, unstarted), from which the operators
    and their late-row rules are read; without it the rule comes from ``kind=`` and the other
    overrides. ``name`` is the query's name for the history and metrics; ``output_mode`` the
    production query's (complete mode drops nothing). The other options are those of
    ``watch.audit``. The checkpoint is only read; nothing of this audit runs as a streaming
    query.
    """
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
        raise AuditError(_COMPLETE_MODE)
    if poll_interval_seconds <= 0:
        raise ConfigError("poll_interval_seconds must be positive.")
    frames = [
        _streaming_frame(f, f"events[{i}]" if isinstance(events, (list, tuple)) else "events")
        for i, f in enumerate(_as_list(events, "events"))
    ]
    if query is None and (len(frames) > 1 or kind is None):
        raise ConfigError(
            "give the query's DataFrame built on events (query=, or --query module:function): "
            "its stateful operators set the late-row rules (one input may give kind= instead)."
        )
    defined = _streaming_frame(query, "query") if query is not None else frames[0]
    root = os.fspath(checkpoint)
    written = [p for p in (getattr(watch.store, "path", None), parquet_path) if p is not None]
    for place in written:
        if inside_checkpoint(place, root):
            raise ConfigError(
                f"{redact(os.fspath(place))} is inside the checkpoint {redact(root)}, which the "
                "sidecar only reads: keep the history and the Parquet folder elsewhere"
            )
    reader, query_id = _open_checkpoint(spark, root)
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
    check_recorded_conf(reader, spark)
    query_plan = defined._jdf.queryExecution().analyzed()
    plan_text = str(query_plan.toString())
    plan = apply_overrides(
        parse_plan(plan_text),
        kind=kind,
        event_time=event_time,
        delay=delay,
        window=window,
        slide=slide,
    )
    _check_source_count(reader, len(plan.inputs))
    inputs = _replay_inputs(spark, plan, plan_text, query_plan, frames, prepares, {})
    _check_file_sources(reader, inputs)
    check_event_times(
        spark,
        reader,
        inputs,
        query=defined,
        query_plan=query_plan,
        timeout_seconds=job_timeout_seconds,
    )
    query_name = clean_name(name)
    label = query_label(query_name, query_id)
    replayer = Replayer(
        spark=spark,
        query_id=query_id,
        query_name=query_name,
        label=label,
        inputs=inputs,
        columns=columns,
        hash_columns=hash_columns,
        parquet_path=str(parquet_path) if parquet_path is not None else None,
        pool=pool,
        max_rows_per_batch=max_rows_per_batch,
        max_row_bytes=max_row_bytes,
        job_timeout_seconds=job_timeout_seconds,
        hash_key=key,
    )
    store = watch.store
    auditor = Auditor(
        query_id=query_id,
        query_name=query_name,
        label=label,
        run_id=None,
        checkpoint=reader,
        sink=sink,
        replayer=replayer,
        history=(
            SidecarHistory(
                store,
                query_id=query_id,
                label=label,
                reader=reader,
                query_name=query_name,
                # Spark reports the epoch as a watermarked query's watermark before its first
                has_watermark="EventTimeWatermark" in plan_text,
            )
            if store
            else None
        ),
        poll_interval_seconds=poll_interval_seconds,
        # no progress: every committed batch that read data is replayed
        progress_min_covers_inputs=False,
        # no production job runs in this application to yield to
        yield_factor=0.0,
    )
    # no progress will come to wait for
    auditor.progress_grace_seconds = 0.0
    if store is not None:
        _record_query(store, query_id, query_name)
    audit_plugin(watch).add(auditor)
    auditor.start()
    return SidecarHandle(auditor)


# -- the definition as the command line names it ---------------------------------------------------


def load_function(spec: str, option: str) -> Callable[..., Any]:
    """The function ``module:function`` or ``path/to/file.py:function`` names."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise ConfigError(
            f"{option} {spec!r} names no function; give module:function or "
            "path/to/file.py:function."
        )
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ConfigError(f"{option} {spec!r}: there is no file {where}.")
            module_name = f"wmwatch_definition_{path.stem}"
            found = importlib.util.spec_from_file_location(module_name, path)
            if found is None or found.loader is None:
                raise ConfigError(f"{option} {spec!r}: {where} cannot be loaded as Python.")
            module = importlib.util.module_from_spec(found)
            sys.modules[module_name] = module
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's module: its error, in one line
        raise ConfigError(
            f"{option} {spec!r}: importing {where} failed ({type(exc).__name__}: "
            f"{error_line(exc)}); put the module on PYTHONPATH or give path/to/file.py:function."
        ) from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise ConfigError(
            f"{option} {spec!r}: {where} has no function {attr!r}; name the function that "
            "builds it."
        )
    return function  # type: ignore[no-any-return]  # a user's function, checked callable above


def call_definition(function: Callable[..., Any], argument: Any, option: str, spec: str) -> Any:
    """``function(argument)``, with whatever it raises as one line naming the option."""
    try:
        return function(argument)
    except Exception as exc:  # noqa: BLE001 - the user's code: its error, in one line
        raise ConfigError(
            f"{option} {spec!r} raised {type(exc).__name__}: {error_line(exc)}; fix the "
            "function (it must build the streaming DataFrame as the production query does)."
        ) from None
