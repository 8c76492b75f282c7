"""The ``wmwatch report`` command: options, failures as one line, output to stdout.

Building is in :mod:`wmwatch._report.build`, rendering in :mod:`wmwatch._report.render`; duckdb and
rich are imported inside the command so that ``wmwatch --help`` stays instant.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

FORMATS = ("table", "json", "csv")


def _fail(message: str, code: int) -> typer.Exit:
    typer.echo(f"wmwatch report: {message}", err=True)
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
        typer.Option("--format", "-f", help="table (for people), json or csv (for scripts)."),
    ] = "table",
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
    from wmwatch._report.render import render_csv, render_json, render_table
    from wmwatch._store.writer import open_readonly
    from wmwatch._text import first_line

    try:
        with open_readonly(db, timeout=timeout_seconds) as con:
            result = build_report(con, db=str(db), query=query, since_at=since_at)
    except StoreError as exc:
        raise _fail(str(exc), 1) from None
    except UnknownQueryError as exc:
        raise _fail(str(exc.args[0]), 1) from None
    except duckdb.Error as exc:
        raise _fail(f"cannot read {db}: {first_line(str(exc)) or type(exc).__name__}", 1) from None

    if fmt == "json":
        sys.stdout.write(render_json(result))
    elif fmt == "csv":
        sys.stdout.write(render_csv(result))
    else:
        from rich.console import Console

        render_table(result, Console(highlight=False))
