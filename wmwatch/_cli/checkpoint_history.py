"""The ``wmwatch checkpoint-history`` command: a query's history from its checkpoint alone.

Reading is in :mod:`wmwatch._checkpoint.history`, writing in :mod:`wmwatch._checkpoint.tables`,
the state counts in :mod:`wmwatch._checkpoint.state`. pyspark starts only when it is needed (a
checkpoint that is not on a local filesystem, or state to count), so a bad path fails in a blink.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from wmwatch._cli import echo

if TYPE_CHECKING:
    from wmwatch._checkpoint.history import CheckpointHistory

_COMMAND = "wmwatch checkpoint-history"


def _fail(message: str, code: int = 1) -> typer.Exit:
    _say(message)
    return typer.Exit(code)


def _say(message: str) -> None:
    echo(f"{_COMMAND}: {message}", err=True)


def checkpoint_history(
    checkpoint: Annotated[
        str,
        typer.Argument(
            help="The query's checkpointLocation: a local folder or any Hadoop filesystem URI "
            "the Spark session can read (hdfs://, s3a://, abfss://, gs://).",
            show_default=False,
        ),
    ],
    db: Annotated[
        Path,
        typer.Option("--db", help="History file to write (created if missing)."),
    ] = Path("wmwatch.duckdb"),
    name: Annotated[
        str | None,
        typer.Option("--name", help="The query's name in the history (the checkpoint has none)."),
    ] = None,
    state: Annotated[
        bool,
        typer.Option(
            "--state/--no-state",
            help="Count the state rows of each retained batch with Spark's state reader "
            "(one Spark job per 25 batches per operator).",
        ),
    ] = True,
    state_batches: Annotated[
        int | None,
        typer.Option(
            "--state-batches", help="Count the state of only the newest N batches.", min=0
        ),
    ] = None,
    timeout_seconds: Annotated[
        float,
        typer.Option(
            "--timeout",
            help="Seconds the state counts may take in all; batches not counted by then keep "
            "no state size.",
            min=1,
        ),
    ] = 600.0,
    master: Annotated[
        str,
        typer.Option(
            "--master", help="Spark master for the session this command starts, if it needs one."
        ),
    ] = "local[2]",
) -> None:
    """Build a query's history from its checkpoint alone (no running query, no listener).

    Writes the tables the listener writes (batches, sources, operators), so `wmwatch report`
    works on the result. Reads the checkpoint only; never writes into it. Running it again
    replaces what it wrote before; batches a listener recorded are kept as they are.
    """
    from wmwatch._checkpoint.fs import inside_checkpoint, local_root

    local = local_root(checkpoint)
    if local is not None and not os.path.isdir(local):
        raise _fail(f"{checkpoint} is not a folder: pass the query's checkpointLocation", 2)
    if not db.parent.is_dir():
        raise _fail(f"--db {db}: folder {db.parent} does not exist", 2)
    if inside_checkpoint(db, checkpoint):
        raise _fail(
            f"--db {db} is inside the checkpoint {checkpoint}, which is only ever read: pass "
            "a file elsewhere",
            2,
        )
    with _spark_when_needed(master) as spark_for:
        history = _read(checkpoint, local, spark_for)
        for line in history.warnings:
            _say(f"warning: {line}")
        state_counted = 0
        if state and history.operators:
            history, state_counted = _count_state(
                history, checkpoint, spark_for(), state_batches, timeout_seconds
            )
    _write(history, db, name, state_counted)


def _read(checkpoint: str, local: str | None, spark_for: Any) -> CheckpointHistory:
    from wmwatch._checkpoint.fs import HadoopFileSystem
    from wmwatch._checkpoint.history import read_checkpoint
    from wmwatch._checkpoint.reader import CheckpointReader
    from wmwatch._errors import WmwatchError
    from wmwatch._text import error_line

    try:
        if local is not None:
            reader = CheckpointReader(local)
        else:
            reader = CheckpointReader(checkpoint, HadoopFileSystem(spark_for(), checkpoint))
        return read_checkpoint(reader)
    except WmwatchError as exc:
        raise _fail(str(exc)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(f"cannot read {checkpoint}: {error_line(exc, 200)}") from None
    except Exception as exc:  # noqa: BLE001 - py4j's errors from a Hadoop filesystem
        raise _fail(
            f"cannot read {checkpoint} through Hadoop: {error_line(exc, 200)}; check the URI "
            "and the session's filesystem settings"
        ) from None


def _count_state(
    history: CheckpointHistory,
    checkpoint: str,
    spark: Any,
    last: int | None,
    timeout_seconds: float,
) -> tuple[CheckpointHistory, int]:
    from wmwatch._checkpoint.history import batches_to_count
    from wmwatch._checkpoint.state import count_state_rows

    ids = batches_to_count(history, last)
    if not ids:
        _say("no retained state to count")
        return history, 0
    _say(f"counting the state rows of {len(ids)} batches ({ids[0]}-{ids[-1]})")
    counts, problems = count_state_rows(
        spark,
        checkpoint,
        history.operators,
        ids,
        timeout_seconds=timeout_seconds,
        state_format_version=history.state_format_version,
        progress=lambda done, total: _say(f"state counted: {done}/{total}"),
    )
    for line in problems:
        _say(f"warning: {line}")
    counted = len({batch_id for batch_id, _ in counts})
    return replace(history, state_rows=counts), counted


def _write(history: CheckpointHistory, db: Path, name: str | None, state_counted: int) -> None:
    from wmwatch._checkpoint.tables import Written, listener_batches, write_history
    from wmwatch._errors import StoreError
    from wmwatch._store.writer import HistoryStore

    read_at = datetime.now(UTC)
    try:
        store = HistoryStore(db).start()
    except StoreError as exc:
        raise _fail(str(exc)) from None
    try:
        if name is None:
            name = store.read(lambda con: listener_batches(con, history.query_id)[1])

        def write(con: Any) -> Written:
            con.execute("BEGIN TRANSACTION")
            try:
                written = write_history(con, history, name, read_at, state_counted)
                con.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(Exception):
                    con.execute("ROLLBACK")
                raise
            return written

        written = store.read(write, timeout=120.0)
    except StoreError as exc:
        raise _fail(str(exc)) from None
    finally:
        store.close(timeout=30.0)
    retention = history.retention
    kept = (
        f"; kept {written.batches_kept} batches a listener recorded" if written.batches_kept else ""
    )
    echo(
        f"wrote {written.batches_written} batches of query {_label(name, history.query_id)} "
        f"to {db}{kept}; offsets reach back to batch "
        f"{retention.oldest_offsets_batch}, commits to {retention.oldest_commit_batch}, state to "
        f"{_or_none(retention.oldest_state_batch)}; state rows counted for {state_counted} batches"
    )


def _label(name: str | None, query_id: str) -> str:
    return f"{name} ({query_id})" if name else query_id


def _or_none(value: int | None) -> str:
    return "none" if value is None else str(value)


@contextlib.contextmanager
def _spark_when_needed(master: str) -> Iterator[Any]:
    """A function that returns a SparkSession, started on first use (the active one if there is
    one) and stopped at the end only if this command started it."""
    started: list[Any] = []

    def spark_for() -> Any:
        if started:
            return started[0]
        try:
            from pyspark.sql import SparkSession
        except ImportError:
            raise _fail(
                "pyspark is not installed (needed for state sizes and Hadoop paths): "
                "pip install 'wmwatch[spark]', or pass --no-state for a local checkpoint"
            ) from None
        active = SparkSession.getActiveSession()
        if active is not None:
            started.append(active)
            return active
        session = (
            SparkSession.builder.master(master)
            .appName("wmwatch-checkpoint-history")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .getOrCreate()
        )
        session.sparkContext.setLogLevel("ERROR")
        started.append(session)
        owned.append(session)
        return session

    owned: list[Any] = []
    try:
        yield spark_for
    finally:
        for session in owned:
            with contextlib.suppress(Exception):
                session.stop()
