"""The public surface: a small, sorted ``__all__``, and a CLI that starts without heavy imports."""

from __future__ import annotations

import subprocess
import sys

import wmwatch


def test_all_is_sorted_and_complete() -> None:
    assert wmwatch.__all__ == sorted(wmwatch.__all__)
    public = {name for name in dir(wmwatch) if not name.startswith("_")} | {"__version__"}
    assert set(wmwatch.__all__) <= public
    for name in wmwatch.__all__:
        assert getattr(wmwatch, name) is not None


def test_every_error_is_a_wmwatch_error() -> None:
    for name in wmwatch.__all__:
        obj = getattr(wmwatch, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, wmwatch.WmwatchError)


def test_cli_help_does_not_import_spark_or_duckdb() -> None:
    code = (
        "import sys; from typer.testing import CliRunner; from wmwatch.cli import app; "
        "r = CliRunner().invoke(app, ['--help']); assert r.exit_code == 0, r.output; "
        "assert 'report' in r.output and 'demo' in r.output; "
        "heavy = [m for m in ('pyspark', 'duckdb', 'grafana_foundation_sdk') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
