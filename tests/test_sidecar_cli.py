"""The ``wmwatch sidecar`` command's refusals made before any JVM starts: a folder that is no
checkpoint, a definition that cannot be found. Each is one line on stderr saying what to do."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.harness.cli import sidecar
from tests.harness.handmade import fake_checkpoint
from wmwatch.cli import app

runner = CliRunner()


def test_a_folder_that_is_no_checkpoint_is_one_line(tmp_path: Path) -> None:
    code, err = sidecar(
        "--checkpoint",
        str(tmp_path),
        "--events",
        "tests.sidecar_defs:events",
        "--query",
        "tests.sidecar_defs:window",
    )
    assert code == 2
    assert err.count("\n") == 1 and "is not a streaming query's checkpoint" in err
    assert "checkpointLocation" in err


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("tests.sidecar_defs:nope", "has no function 'nope'"),
        ("tests.no_such_module:events", "importing tests.no_such_module failed"),
        ("events", "names no function"),
        ("missing/defs.py:events", "there is no file missing/defs.py"),
    ],
)
def test_an_events_function_that_is_not_there_is_one_line(
    tmp_path: Path, spec: str, says: str
) -> None:
    checkpoint = fake_checkpoint(tmp_path / "checkpoint")
    code, err = sidecar(
        "--checkpoint", str(checkpoint), "--events", spec, "--query", "tests.sidecar_defs:window"
    )
    assert code == 2
    assert err.count("\n") == 1 and says in err, err


def test_a_query_function_that_is_not_there_is_one_line(tmp_path: Path) -> None:
    checkpoint = fake_checkpoint(tmp_path / "checkpoint")
    code, err = sidecar(
        "--checkpoint",
        str(checkpoint),
        "--events",
        "tests.sidecar_defs:events",
        "--query",
        "tests.sidecar_defs:windows",
    )
    assert code == 2
    assert err.count("\n") == 1 and "--query 'tests.sidecar_defs:windows'" in err, err


def test_help_names_what_the_sidecar_needs() -> None:
    result = runner.invoke(app, ["sidecar", "--help"])
    assert result.exit_code == 0
    for option in ("--checkpoint", "--events", "--query", "--db", "--once"):
        assert option in result.stdout


@pytest.mark.parametrize("where", ["audit.duckdb", "sub/audit.duckdb", "link/audit.duckdb"])
def test_a_history_inside_the_checkpoint_is_refused_and_nothing_is_written(
    tmp_path: Path, where: str
) -> None:
    checkpoint = fake_checkpoint(tmp_path / "checkpoint")
    (checkpoint / "sub").mkdir()
    (tmp_path / "link").symlink_to(checkpoint, target_is_directory=True)
    db = checkpoint / where if not where.startswith("link/") else tmp_path / where
    before = sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*"))
    code, err = sidecar(
        "--checkpoint",
        str(checkpoint),
        "--events",
        "tests.sidecar_defs:events",
        "--query",
        "tests.sidecar_defs:window",
        "--db",
        str(db),
    )
    assert code == 2
    assert err.count("\n") == 1 and "inside the checkpoint" in err and "elsewhere" in err, err
    assert sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*")) == before
