"""The ``wmwatch demo`` command: a real local streaming query with wmwatch attached.

pyspark is imported inside the command, so ``wmwatch --help`` stays instant and a missing
pyspark is one clear line.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Annotated, Any

import typer

_MASTER = re.compile(r"^(local(\[(\d+|\*)(,\d+)?\])?|spark://[\w.-]+:\d+(,[\w.-]+:\d+)*)$")


def demo(
    duration: Annotated[
        float,
        typer.Option(
            "--duration", "-d", help="Seconds to stream before printing the report.", min=5
        ),
    ] = 60.0,
    port: Annotated[
        int,
        typer.Option(
            "--port",
            "-p",
            help="Port for /metrics on 127.0.0.1 (0: no endpoint).",
            min=0,
            max=65535,
        ),
    ] = 9108,
    workdir: Annotated[
        Path,
        typer.Option(
            "--workdir",
            help="Folder for input files, checkpoint and history: a new or empty folder, or "
            "one an earlier demo made (the demo clears only what it made there).",
        ),
    ] = Path("wmwatch-demo"),
    audit: Annotated[
        bool,
        typer.Option(
            "--audit/--no-audit", help="Divert the rows the watermark drops into late_rows."
        ),
    ] = True,
    master: Annotated[
        str,
        typer.Option(
            "--master",
            help="Spark master: local[2] (default) or a cluster such as spark://host:7077; "
            "its executors must see --workdir at the same path.",
        ),
    ] = "local[2]",
    source_format: Annotated[
        str,
        typer.Option(
            "--format",
            help="json: the query reads the landing files; delta: a bronze query copies them "
            "into a Delta table and the query reads that table as a stream (needs pyspark 4.2 "
            "or older; wmwatch fetches Delta's two jars from Maven Central once and caches them).",
        ),
    ] = "json",
) -> None:
    """Stream an out-of-order event stream through a windowed count, watched by wmwatch.

    Generates its own input (files landing every half second, about 5% of rows late), serves
    Prometheus metrics while it runs, keeps history in <workdir>/wmwatch.duckdb, prints the
    report at the end and writes it as charts to <workdir>/report.html.
    """
    if not _MASTER.match(master):
        typer.echo(
            f"wmwatch demo: --master {master!r} is not a Spark master URL: use local[2], "
            "local[*] or spark://HOST:PORT",
            err=True,
        )
        raise typer.Exit(2)
    from wmwatch._cli.demo_job import claim_workdir
    from wmwatch._errors import ConfigError

    try:
        workdir = claim_workdir(workdir)
    except ConfigError as exc:
        typer.echo(f"wmwatch demo: {exc}", err=True)
        raise typer.Exit(2) from None
    if source_format not in ("json", "delta"):
        typer.echo(f"wmwatch demo: --format {source_format!r}: use json or delta", err=True)
        raise typer.Exit(2)
    try:
        import pyspark
    except ImportError:
        typer.echo("wmwatch demo: pyspark is not installed: pip install 'wmwatch[spark]'", err=True)
        raise typer.Exit(1) from None
    if source_format == "delta" and not delta_supports(pyspark.__version__):
        typer.echo(
            f"wmwatch demo: --format delta needs pyspark {DELTA_NEWEST_PYSPARK} or older (no Delta "
            f"Lake release runs on {pyspark.__version__}): pip install 'pyspark==4.2.0'",
            err=True,
        )
        raise typer.Exit(1)
    if shutil.which("java") is None:
        typer.echo(
            "wmwatch demo: Java 17 is needed by Spark: install a JDK 17 and put java on PATH",
            err=True,
        )
        raise typer.Exit(1)
    from rich.console import Console
    from rich.markup import escape

    from wmwatch._cli.demo_job import run_demo
    from wmwatch._errors import SparkStartError
    from wmwatch._report.build import build_report
    from wmwatch._report.reading import open_history
    from wmwatch._report.render import render_table

    console = Console(highlight=False)
    try:
        result = run_demo(
            duration_seconds=duration,
            metrics_port=port,
            workdir=workdir,
            console=console,
            audit=audit,
            master=master,
            source_format=source_format,
        )
    except SparkStartError as exc:
        typer.echo(f"wmwatch demo: {exc}", err=True)
        raise typer.Exit(1) from None
    console.print(
        f"\nStreamed {result.input_rows} rows in {result.batches} batches; Spark dropped "
        f"{result.rows_dropped} late group(s)"
        + (
            f"; wmwatch audited {result.late_rows_audited} late row(s)"
            if result.late_rows_audited is not None
            else ""
        )
        + ".\n"
    )
    with open_history(result.db) as con:
        built = build_report(con, db=str(result.db))
        render_table(built, console)
        page = _write_html(con, built, workdir / "report.html")
    console.print(
        escape(f"\nHistory: {result.db}   (try: wmwatch report --db {result.db} --format json)")
    )
    console.print(escape(page))


# The newest pyspark a Delta Lake release runs on (Delta 4.4), and that Delta's jar on Maven Central
DELTA_NEWEST_PYSPARK = "4.2"


def delta_supports(pyspark_version: str) -> bool:
    """Whether Delta Lake runs on this pyspark (4.2 and older; every read fails on 4.3)."""
    parts = [int(x) for x in re.findall(r"\d+", pyspark_version)[:2]]
    newest = [int(x) for x in DELTA_NEWEST_PYSPARK.split(".")]
    return parts <= newest


def _write_html(con: Any, built: Any, target: Path) -> str:
    """The HTML report next to the history; a line saying where it is, or what it needs."""
    from wmwatch._report.html import MISSING_EXTRA, html_available

    if not html_available():
        return f"HTML report: not written, {MISSING_EXTRA}"
    from wmwatch._cli.report import write_whole
    from wmwatch._report.history import load_history
    from wmwatch._report.html import render_html

    write_whole(target, render_html(built, load_history(con, built)))
    return f"HTML report: {target.resolve()}"
