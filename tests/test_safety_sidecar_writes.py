"""What the sidecar writes, and where it never writes: nothing outside the Parquet folder and the
history it is given, nothing inside the checkpoint it reads.

The query id the sidecar reads from a checkpoint's ``metadata`` names the audit's Parquet folders
(``<parquet_path>/<query id>/batch-<n>``), so a checkpoint whose id is ``..`` or ``../../x``
(a damaged or hostile copy) is refused before anything is written; and "inside the checkpoint"
is decided on resolved, qualified paths (``file:`` URIs, links, ``..``, trailing slashes), for
the history file and the Parquet folder alike.
"""

from __future__ import annotations

import json
import shutil
import stat
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import wmwatch
from tests import sidecar_defs
from tests.harness.cli import one_line, sidecar_args
from tests.harness.streams import write_events
from tests.sidecar_defs import IN_VARIABLE
from tests.sidecar_driver import many_files
from wmwatch._checkpoint.fs import inside_checkpoint
from wmwatch._errors import ConfigError
from wmwatch.cli import app

runner = CliRunner()


def _tree(folder: Path) -> dict[str, int]:
    """Every path under ``folder`` (``folder`` included) and its mode."""
    return {
        str(p.relative_to(folder)): stat.S_IMODE(p.lstat().st_mode)
        for p in [folder, *sorted(folder.rglob("*"))]
    }


@pytest.fixture(scope="module")
def stopped_checkpoint(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of a stopped query (dropDuplicates over a file stream, late rows in it),
    with its input folder beside it."""
    folder = tmp_path_factory.mktemp("stopped")
    (folder / "in").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(IN_VARIABLE, str(folder / "in"))
        query = (
            sidecar_defs.dedupe(sidecar_defs.events(spark))
            .writeStream.format("noop")
            .option("checkpointLocation", str(folder / "checkpoint"))
            .start()
        )
        try:
            for rows in many_files(4):
                write_events(folder / "in", rows)
                query.processAllAvailable()
        finally:
            query.stop()
    return folder


def _copy_with_id(source: Path, target: Path, query_id: str) -> Path:
    shutil.copytree(source / "checkpoint", target)
    (target / "metadata").write_text(json.dumps({"id": query_id}) + "\n")
    return target


@pytest.mark.spark
@pytest.mark.parametrize("query_id", ["..", "../../x", "a/b", ""])
def test_a_checkpoint_whose_query_id_is_a_path_is_refused_and_nothing_is_written(
    spark: Any,
    stopped_checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    query_id: str,
) -> None:
    """A copy of a stopped query's checkpoint with the id in ``metadata`` set to a path, audited
    into a Parquet folder inside a user's folder (0755): refused in one line, by the API and the
    CLI, before anything is written; the user's folder keeps its mode and its contents."""
    checkpoint = _copy_with_id(stopped_checkpoint, tmp_path / "copy", query_id)
    home = tmp_path / "home" / "user"
    (home / "sink").mkdir(parents=True)
    (home / "notes.txt").write_text("mine")
    for folder in (tmp_path / "home", home, home / "sink"):
        folder.chmod(0o755)
    before = _tree(tmp_path / "home")
    monkeypatch.setenv(IN_VARIABLE, str(stopped_checkpoint / "in"))
    events = sidecar_defs.events(spark)
    with (
        wmwatch.attach(spark, db=None, metrics_port=None) as watch,
        pytest.raises(ConfigError, match="metadata holds") as refused,
    ):
        watch.audit_checkpoint(
            checkpoint,
            events,
            sidecar_defs.dedupe(events),
            sink="parquet",
            parquet_path=home / "sink",
            poll_interval_seconds=0.2,
        )
    message = str(refused.value)
    assert "\n" not in message and "restore the file" in message
    assert _tree(tmp_path / "home") == before  # no batch-* folder anywhere, every mode as it was

    # the command line refuses it before a JVM is asked for anything
    result = runner.invoke(app, sidecar_args(checkpoint, tmp_path / "side.duckdb", "--once"))
    assert result.exit_code == 2
    line = one_line(result.stderr)
    assert "metadata holds" in line and "checkpoint is damaged" in line, line
    assert not (tmp_path / "side.duckdb").exists()
    assert _tree(tmp_path / "home") == before


@pytest.mark.spark
def test_a_parquet_folder_inside_the_checkpoint_is_refused_however_it_is_spelled(
    spark: Any, stopped_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint given one way, the Parquet folder another (a ``file:`` URI, ``..``, a
    trailing slash, a link to the checkpoint, the checkpoint given through a link): each is
    refused in one line and the checkpoint is left as it was."""
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(stopped_checkpoint / "checkpoint", checkpoint)
    (tmp_path / "alias").symlink_to(checkpoint, target_is_directory=True)
    before = _tree(checkpoint)
    monkeypatch.setenv(IN_VARIABLE, str(stopped_checkpoint / "in"))
    events = sidecar_defs.events(spark)
    spellings = [
        (str(checkpoint), f"file://{checkpoint}/audit"),
        (str(checkpoint), f"file:{checkpoint}/audit"),
        (f"{checkpoint}/", f"{tmp_path}/other/../checkpoint/audit/"),
        (f"file://{checkpoint}/", f"{checkpoint}/sub/../audit"),
        (str(checkpoint), f"{tmp_path}/alias/audit"),
        (f"{tmp_path}/alias", f"{checkpoint}/audit"),
        (str(checkpoint), str(checkpoint)),
    ]
    with wmwatch.attach(spark, db=None, metrics_port=None) as watch:
        for given, parquet in spellings:
            with pytest.raises(ConfigError, match="is inside the checkpoint") as refused:
                watch.audit_checkpoint(
                    given,
                    events,
                    sidecar_defs.dedupe(events),
                    sink="parquet",
                    parquet_path=parquet,
                )
            assert "\n" not in str(refused.value), (given, parquet)
    assert _tree(checkpoint) == before


@pytest.mark.parametrize(
    ("path", "root", "inside"),
    [
        ("/ck/audit", "/ck", True),
        ("file:///ck/audit", "/ck", True),
        ("file:/ck/audit/", "file:///ck/", True),
        ("/ck/x/../audit", "/ck/", True),
        ("/ck", "/ck", True),
        ("/ck2/audit", "/ck", False),
        ("/c", "/ck", False),
        ("/ck/../elsewhere", "/ck", False),
        ("hdfs://nn:8020/ck/audit", "hdfs://nn/ck", True),
        ("hdfs:///ck/audit", "hdfs://nn:8020/ck/", True),
        ("hdfs://NN/ck/./a//b", "hdfs://nn/ck", True),
        ("hdfs://other/ck/audit", "hdfs://nn/ck", False),
        ("s3a://bucket/ck/audit", "s3a://KEY:SECRET@bucket/ck", True),
        ("s3a://bucket/ck/audit", "hdfs://bucket/ck", False),
        ("/ck/audit", "hdfs://nn/ck", False),
        (
            "abfss://c@acct.dfs.core.windows.net/ck/a",
            "abfss://c@acct.dfs.core.windows.net/ck",
            True,
        ),
        (
            "abfss://d@acct.dfs.core.windows.net/ck/a",
            "abfss://c@acct.dfs.core.windows.net/ck",
            False,
        ),
    ],
)
def test_inside_the_checkpoint_compares_qualified_paths(path: str, root: str, inside: bool) -> None:
    assert inside_checkpoint(path, root) is inside
