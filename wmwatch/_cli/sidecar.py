"""The ``wmwatch sidecar`` command: audit another application's query from its checkpoint.

It starts a Spark application of its own (pyspark is imported inside the command), builds the
user's definition of the query in it, and runs :func:`wmwatch._audit.sidecar.run.start_sidecar`
until stopped (Ctrl-C, SIGTERM) or, with ``--once``, until what is committed is audited.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer

from wmwatch._cli import echo

# how often a status line is printed while the sidecar follows the query
_STATUS_EVERY_SECONDS = 5.0


def _fail(message: str, code: int = 2) -> typer.Exit:
    echo(f"wmwatch sidecar: {message}", err=True)
    return typer.Exit(code)


def sidecar(
    checkpoint: Annotated[
        str,
        typer.Option(
            "--checkpoint",
            help="The production query's checkpointLocation (a local path or any Hadoop path "
            "this application can read); only read, never written.",
        ),
    ],
    events: Annotated[
        str,
        typer.Option(
            "--events",
            help="module:function (or path/to/file.py:function) called with the SparkSession; "
            "returns the streaming DataFrame the query reads, with its withWatermark (a list "
            "for several inputs).",
        ),
    ],
    query: Annotated[
        str,
        typer.Option(
            "--query",
            help="module:function called with what --events returned; returns the query's "
            "DataFrame (what the production code calls writeStream on), whose stateful "
            "operators set the late-row rules.",
        ),
    ],
    db: Annotated[
        Path,
        typer.Option("--db", help="History file the late rows and markers are written to."),
    ] = Path("wmwatch.duckdb"),
    name: Annotated[
        str | None,
        typer.Option("--name", help="The query's name, as the history and metrics label it."),
    ] = None,
    output_mode: Annotated[
        str, typer.Option("--output-mode", help="The production query's: append or update.")
    ] = "append",
    once: Annotated[
        bool,
        typer.Option(
            "--once",
            help="Audit the batches committed so far, then exit (for a stopped query); "
            "without it the sidecar follows the query until stopped.",
        ),
    ] = False,
    timeout_seconds: Annotated[
        float,
        typer.Option("--timeout", help="With --once: give up (exit 1) after this many seconds."),
    ] = 3600.0,
    poll_seconds: Annotated[
        float, typer.Option("--poll", help="Seconds between looks for new commits.", min=0.05)
    ] = 1.0,
    metrics_port: Annotated[
        int,
        typer.Option("--port", help="Port for /metrics on 127.0.0.1 (0: none).", min=0, max=65535),
    ] = 0,
    columns: Annotated[
        str | None,
        typer.Option("--columns", help="Comma-separated columns kept in row_data (default all)."),
    ] = None,
    hash_columns: Annotated[
        str | None,
        typer.Option("--hash-columns", help="Comma-separated columns stored as SHA-256 (or HMAC)."),
    ] = None,
    master: Annotated[
        str | None,
        typer.Option("--master", help="Spark master of the sidecar's application."),
    ] = None,
    conf: Annotated[
        list[str] | None,
        typer.Option("--conf", help="KEY=VALUE Spark setting of the sidecar (repeatable)."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Status lines as JSON (for scripts).")
    ] = False,
) -> None:
    """Audit the late rows of a query running (or stopped) in another Spark application.

    Reads the query's checkpoint and replays each committed batch through the definition given
    by --events and --query, writing the same late rows, audit markers and metrics as
    watch.audit(); `wmwatch report --db` reads them. Restarting resumes after the batches the
    history marks.
    """
    from wmwatch._audit.sidecar.definition import load_function
    from wmwatch._audit.sidecar.run import checkpoint_query_id
    from wmwatch._checkpoint.fs import inside_checkpoint, local_root
    from wmwatch._checkpoint.reader import CheckpointReader
    from wmwatch._errors import WmwatchError

    if inside_checkpoint(db, checkpoint):
        raise _fail(
            f"--db {db} is inside the checkpoint {checkpoint}, which is only ever read: pass "
            "a file elsewhere"
        )
    try:
        if local_root(checkpoint) is not None:
            # a local checkpoint is checked before a JVM starts: a wrong path fails in a moment
            checkpoint_query_id(CheckpointReader(checkpoint))
        events_fn = load_function(events, "--events")
        query_fn = load_function(query, "--query")
        settings = _settings(conf or [])
    except WmwatchError as exc:
        raise _fail(str(exc)) from None
    spark = _session(master, settings)
    _run(
        spark,
        checkpoint=checkpoint,
        events_spec=events,
        query_spec=query,
        events_fn=events_fn,
        query_fn=query_fn,
        db=db,
        options={
            "name": name,
            "output_mode": output_mode,
            "poll_interval_seconds": poll_seconds,
            "columns": _names(columns),
            "hash_columns": _names(hash_columns) or (),
        },
        metrics_port=metrics_port,
        once=once,
        timeout_seconds=timeout_seconds,
        as_json=as_json,
    )


def _names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    return [n.strip() for n in text.split(",") if n.strip()]


def _settings(pairs: list[str]) -> dict[str, str]:
    from wmwatch._errors import ConfigError

    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--conf {pair!r} is not KEY=VALUE.")
        out[key.strip()] = value
    return out


def _session(master: str | None, settings: dict[str, str]) -> Any:
    """The sidecar's SparkSession (the running one when called inside an application)."""
    try:
        from pyspark.sql import SparkSession
    except ImportError:
        raise _fail("pyspark is not installed: pip install 'wmwatch[spark]'", 1) from None
    builder = SparkSession.builder.appName("wmwatch-sidecar")
    if master is not None:
        builder = builder.master(master)
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


def _run(
    spark: Any,
    *,
    checkpoint: str,
    events_spec: str,
    query_spec: str,
    events_fn: Any,
    query_fn: Any,
    db: Path,
    options: dict[str, Any],
    metrics_port: int,
    once: bool,
    timeout_seconds: float,
    as_json: bool,
) -> None:
    import wmwatch
    from wmwatch._audit.sidecar.definition import call_definition
    from wmwatch._errors import WmwatchError

    watch = wmwatch.attach(spark, db=str(db), metrics_port=metrics_port or None, strict=True)
    handle = None
    try:
        try:
            frames = call_definition(events_fn, spark, "--events", events_spec)
            result = call_definition(query_fn, frames, "--query", query_spec)
            handle = watch.audit_checkpoint(checkpoint, frames, result, **options)
        except WmwatchError as exc:
            raise _fail(str(exc)) from None
        stop = threading.Event()
        previous = _on_sigterm(stop)
        try:
            ok = _follow(handle, stop, once=once, timeout_seconds=timeout_seconds, as_json=as_json)
        except KeyboardInterrupt:
            ok = True
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        _print(handle.status(), as_json, final=True)
        if not ok:
            raise _fail(
                "not every committed batch was audited in time; run it again (it resumes) "
                "or raise --timeout",
                1,
            )
    finally:
        if handle is not None:
            handle.stop()
        watch.close()


def _on_sigterm(stop: threading.Event) -> Any:
    """Make SIGTERM stop the sidecar cleanly; the handler it replaces (None where signals
    cannot be handled: not the main thread)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    try:
        return signal.signal(signal.SIGTERM, handler)
    except ValueError:
        return None


def _follow(
    handle: Any, stop: threading.Event, *, once: bool, timeout_seconds: float, as_json: bool
) -> bool:
    """Print status until stopped; with ``once``, until what is committed is audited (True) or
    the timeout passes (False)."""
    deadline = time.monotonic() + timeout_seconds
    last = None
    while not stop.is_set():
        if once:
            if handle.sync(min(_STATUS_EVERY_SECONDS, max(0.1, deadline - time.monotonic()))):
                return True
            if time.monotonic() >= deadline:
                return False
        else:
            stop.wait(_STATUS_EVERY_SECONDS)
        status = handle.status()
        shown = (status["last_audited_batch"], status["late_rows"], status["batches_lost"])
        if shown != last or as_json:
            _print(status, as_json)
            last = shown
    return True


def _print(status: dict[str, Any], as_json: bool, *, final: bool = False) -> None:
    if as_json:
        from wmwatch._text import redact_json

        typer.echo(json.dumps(redact_json({"final": final, **status})))
        return
    echo(
        f"{status['query']}: audited up to batch {status['last_audited_batch']} of "
        f"{status['latest_committed_batch']} committed; {status['late_rows']:,} late rows, "
        f"{status['batches_lost']} batches lost, {status['errors']} errors"
        + (f" (last: {status['last_error']})" if status["last_error"] else "")
    )
