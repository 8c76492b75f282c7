"""The ``wmwatch report`` command: options, failures as one line, output to stdout or a file.

Building is in :mod:`wmwatch._report.build`, rendering in :mod:`wmwatch._report.render` (the HTML
page in :mod:`wmwatch._report.html`); duckdb, rich and matplotlib are imported inside the command
so that ``wmwatch --help`` stays instant.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer

from wmwatch._cli import echo

FORMATS = ("table", "json", "csv", "html")


def _fail(message: str, code: int) -> typer.Exit:
    echo(f"wmwatch report: {message}", err=True)
    return typer.Exit(code)


def report(
    db: Annotated[
        Path,
        typer.Option("--db", help="History file written by wmwatch.attach(spark, db=...)."),
    ] = Path("wmwatch.duckdb"),
    query: Annotated[
        str | None,
        typer.Option("--query", "-q", help="Only this query (its name or id)."),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(
            "--since",
            help="Only batches since then: a duration ago (15m, 2h, 7d) or an ISO timestamp.",
        ),
    ] = None,
    output_format: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            help="table (for people), json or csv (for scripts), html (one self-contained page "
            "of charts; needs wmwatch[html]).",
        ),
    ] = "table",
    output: Annotated[
        str,
        typer.Option(
            "--output", "-o", help="Write the report to this file instead of stdout ('-')."
        ),
    ] = "-",
    timeout_seconds: Annotated[
        float,
        typer.Option(
            "--timeout", help="Seconds to wait while a running job holds the file.", min=0
        ),
    ] = 5.0,
) -> None:
    """Summarise the watermark history per query: lag, drops, state, late rows, findings.

    Works while the watched job is running: the job opens the file only briefly to write.
    """
    fmt = output_format.strip().lower()
    if fmt not in FORMATS:
        raise _fail(f"--format {output_format!r} is not one of {', '.join(FORMATS)}", 2)
    if fmt == "html":
        from wmwatch._report.html import MISSING_EXTRA, html_available

        if not html_available():
            raise _fail(MISSING_EXTRA, 1)
    target = None if output == "-" else Path(output)
    if target is not None and not target.parent.is_dir():
        raise _fail(f"--output {output}: folder {target.parent} does not exist", 2)
    if target is not None and _is_history(target, db):
        raise _fail(
            f"--output {output} is the history file {db} or its log or lock: "
            "pass another file for the report",
            2,
        )
    from wmwatch._report.build import parse_since

    since_at = None
    if since is not None:
        try:
            since_at = parse_since(since)
        except ValueError as exc:
            raise _fail(str(exc), 2) from None

    import duckdb

    from wmwatch._errors import StoreError, UnknownQueryError
    from wmwatch._report.build import build_report
    from wmwatch._report.reading import open_history
    from wmwatch._report.render import render_csv, render_json, render_table
    from wmwatch._text import clean, first_line

    histories: dict[str, Any] = {}
    try:
        with open_history(db, timeout=timeout_seconds) as con:
            # the path as the report shows it: as given, cleaned like every text that enters
            result = build_report(con, db=clean(str(db)), query=query, since_at=since_at)
            if fmt == "html":
                from wmwatch._report.history import load_history

                histories = dict(load_history(con, result))
    except StoreError as exc:
        raise _fail(str(exc), 1) from None
    except UnknownQueryError as exc:
        raise _fail(str(exc.args[0]), 1) from None
    except duckdb.Error as exc:
        raise _fail(f"cannot read {db}: {first_line(str(exc)) or type(exc).__name__}", 1) from None

    if fmt == "table":
        from rich.console import Console

        if target is None:
            render_table(result, Console(highlight=False))
            return
        text = io.StringIO()
        render_table(result, Console(file=text, highlight=False, width=120))
        _write(target, text.getvalue())
        return
    if fmt == "json":
        doc = render_json(result)
    elif fmt == "csv":
        doc = render_csv(result)
    else:
        from wmwatch._report.html import render_html

        doc = render_html(result, histories)
    if target is None:
        sys.stdout.write(doc)
    else:
        _write(target, doc)


def _write(target: Path, text: str) -> None:
    try:
        write_whole(target, text)
    except OSError as exc:
        raise _fail(f"cannot write {target}: {exc.strerror or exc}", 1) from None


def write_whole(target: Path, text: str) -> None:
    """Write the whole report or nothing: a reader never sees half a file.

    The partial file gets a fresh name made with O_EXCL (``mkstemp``) in the target's folder,
    so a link planted at a predictable name cannot redirect the write; ``os.replace`` then
    replaces ``target`` itself, never a file a link at ``target`` points to. Owner-only, as
    the history it is read from.
    """
    fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(partial, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        raise


def _is_history(target: Path, db: Path) -> bool:
    """True when writing ``target`` would overwrite the history file, its log or its lock."""
    resolved = os.path.realpath(target)
    base = os.path.realpath(db)
    if resolved in (base, f"{base}.wal", f"{base}.lock"):
        return True
    with contextlib.suppress(OSError):
        return any(
            os.path.samefile(target, other)
            for other in (db, f"{db}.wal", f"{db}.lock")
            if os.path.exists(other)
        )
    return False
