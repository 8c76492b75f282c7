"""The ``wmwatch`` command line: one typer app; each command lives in its own module.

Commands import their heavy dependencies (duckdb, pyspark, rich tables) inside the command, so
``wmwatch --help`` is instant.
"""

from __future__ import annotations

import typer

from wmwatch._cli.checkpoint_history import checkpoint_history
from wmwatch._cli.demo import demo
from wmwatch._cli.report import report
from wmwatch._cli.sidecar import sidecar

app = typer.Typer(
    name="wmwatch",
    help="Watermark monitoring and late-data auditing for Spark Structured Streaming.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Watermark monitoring and late-data auditing for Spark Structured Streaming."""


app.command("report")(report)
app.command("demo")(demo)
app.command("checkpoint-history")(checkpoint_history)
app.command("sidecar")(sidecar)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
