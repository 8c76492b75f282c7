"""``wmwatch demo --format``: which pyspark Delta Lake runs on, and the refusals (no Spark).

The demo's Delta pipeline itself runs in the pyspark 4.2 environment
(``tests/test_audit_delta_spark.py``); this file runs in the main one, on a pyspark no Delta
release supports."""

from __future__ import annotations

import importlib.metadata

from typer.testing import CliRunner

from wmwatch._cli.demo import delta_supports
from wmwatch.cli import app


def test_delta_runs_on_pyspark_up_to_4_2() -> None:
    assert delta_supports("4.2.0") and delta_supports("4.1.1") and delta_supports("3.5.6")
    assert not delta_supports("4.3.0") and not delta_supports("5.0.0.dev1")


def test_demo_refuses_delta_on_a_pyspark_delta_does_not_run_on() -> None:
    version = importlib.metadata.version("pyspark")
    assert not delta_supports(version), "this test belongs to the main (newest pyspark) run"
    result = CliRunner().invoke(app, ["demo", "--format", "delta", "--port", "0"])
    assert result.exit_code == 1
    assert "--format delta needs pyspark 4.2 or older" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_demo_refuses_an_unknown_format() -> None:
    result = CliRunner().invoke(app, ["demo", "--format", "parquet"])
    assert result.exit_code == 2
    assert "use json or delta" in result.output
    assert len(result.output.strip().splitlines()) == 1
