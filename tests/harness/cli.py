"""The real CLI, through typer's CliRunner."""

from __future__ import annotations

from typer.testing import CliRunner

from wmwatch.cli import app


def sidecar(*args: str) -> tuple[int, str]:
    """``wmwatch sidecar args``: its exit code and stderr."""
    result = CliRunner().invoke(app, ["sidecar", *args])
    return result.exit_code, result.stderr
