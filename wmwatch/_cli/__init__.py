"""The ``wmwatch`` commands, one module each; ``demo_job`` is the demo's streaming job.

:func:`echo` is how a command prints a line of its own.
"""

from __future__ import annotations

import typer

from wmwatch._text import clean


def echo(line: str, *, err: bool = False) -> None:
    """Print one line of a command's output or errors. Lines quote paths and URIs as they were
    given, and errors that quote them: credentials are masked and control characters dropped
    (:func:`wmwatch._text.clean`), so neither reaches the terminal or a log that keeps it."""
    typer.echo(clean(line), err=err)
