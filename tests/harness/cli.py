"""The real CLI, through typer's CliRunner."""

from __future__ import annotations

import os
from pathlib import Path

from typer.testing import CliRunner

from wmwatch.cli import app


def sidecar(*args: str) -> tuple[int, str]:
    """``wmwatch sidecar args``: its exit code and stderr."""
    result = CliRunner().invoke(app, ["sidecar", *args])
    return result.exit_code, result.stderr


def sidecar_args(checkpoint: str | os.PathLike[str], db: Path, *more: str) -> list[str]:
    """``wmwatch sidecar`` over the definitions of :mod:`tests.sidecar_defs` (``dropDuplicates``
    of ``$WMWATCH_SIDECAR_TEST_IN``), as its command line."""
    return [
        "sidecar",
        "--checkpoint",
        os.fspath(checkpoint),
        "--events",
        "tests.sidecar_defs:events",
        "--query",
        "tests.sidecar_defs:dedupe",
        "--db",
        str(db),
        *more,
    ]


def one_line(text: str) -> str:
    """The one non-blank line of ``text`` (an error the CLI printed), failing on more."""
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, text
    return lines[0]
