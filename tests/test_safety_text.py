"""Text that reaches a terminal or a log: no control characters, no credentials, no file's bytes.

A query is named with terminal escape sequences (clear the screen, set the window title, an
OSC 8 link, an 8-bit CSI), its checkpoint lives in a folder whose name holds control characters
and a presigned URL's signature, and one of its offsets files is a link to a shadow-like file.
Watched in the job, audited by the sidecar (the real CLI, ``--json`` and the status line), read back
with ``wmwatch report`` and ``wmwatch checkpoint-history``: no output line and no log record
carries a control character, the signature, or a byte of the linked file, and
``status()["last_lost_reason"]`` says why the damaged batch was lost, cleaned. A checkpoint URI
with credentials (``s3a://KEY:SECRET@bucket``, ``X-Amz-Signature=``) is never printed as given.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import wmwatch
from tests import sidecar_defs
from tests.harness.cli import sidecar_args
from tests.harness.streams import write_events
from tests.sidecar_defs import IN_VARIABLE
from tests.sidecar_driver import many_files
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch._text import clean
from wmwatch.cli import app

pytestmark = pytest.mark.spark

# clear the screen, set the window title (BEL-ended OSC), an OSC 8 hyperlink (ST-ended), a
# carriage return over the line, and a one-byte (C1) CSI
NAME = (
    "orders\x1b[2J\x1b]0;owned\x07 "
    "\x1b]8;;https://evil.example/\x1b\\click\x1b]8;;\x1b\\\r \x9b31mred"
)
SIGNATURE = "d1e5ec0ffee0ddba11"
SHADOW = "root:$6$Qx7sEcReT$h4sh3dPa55w0rd:19000:0:99999:7:::"
# C0 controls but tab and newline, DEL, C1 controls; and the same as JSON escapes
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]|\\u00[01][0-9a-fA-F]|\\u007[fF]|\\u009")

runner = CliRunner()


def _clean_output(text: str, *, where: str) -> None:
    found = CONTROL.search(text)
    assert found is None, (where, text[max(0, found.start() - 60) : found.end() + 60])
    for secret in (SIGNATURE, "Qx7sEcReT", "h4sh3dPa55w0rd"):
        assert secret not in text, (where, secret)


@pytest.fixture
def hostile_checkpoint(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> Path:
    """A stopped query named NAME, watched (its history in <folder>/injob.duckdb), its
    checkpoint in a folder named with control characters and a signature, offsets/1 then
    replaced by a link to a shadow-like file."""
    caplog.set_level(logging.INFO, logger="wmwatch")
    folder = tmp_path / f"ck\x1b[31m\x07 X-Amz-Signature={SIGNATURE}"
    folder.mkdir()
    # the input beside it: a file source globs its folder, and "[" opens a glob class
    (tmp_path / "in").mkdir()
    monkeypatch.setenv(IN_VARIABLE, str(tmp_path / "in"))
    checkpoint = folder / "checkpoint"
    with wmwatch.attach(spark, db=str(folder / "injob.duckdb"), metrics_port=None) as watch:
        events = sidecar_defs.events(spark)
        query = (
            sidecar_defs.dedupe(events)
            .writeStream.format("noop")
            .queryName(NAME)
            .option("checkpointLocation", str(checkpoint))
            .start()
        )
        try:
            for rows in many_files(3):
                write_events(tmp_path / "in", rows)
                query.processAllAvailable()
            watch.flush()
        finally:
            query.stop()
    committed = CheckpointReader(str(checkpoint)).committed_batches()
    assert len(committed) >= 3 and 1 in committed
    shadow = tmp_path / "shadow"
    shadow.write_text(SHADOW + "\n")
    (checkpoint / "offsets" / "1").unlink()
    (checkpoint / "offsets" / "1").symlink_to(shadow)
    return checkpoint


def test_names_paths_and_linked_files_reach_no_terminal_or_log_uncleaned(
    spark: Any,
    hostile_checkpoint: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    checkpoint = hostile_checkpoint
    folder = checkpoint.parent

    # the sidecar, through the API: the damaged batch is lost, and the status says why, cleaned
    events = sidecar_defs.events(spark)
    with wmwatch.attach(spark, db=str(tmp_path / "api.duckdb"), metrics_port=None) as watch:
        handle = watch.audit_checkpoint(
            checkpoint, events, sidecar_defs.dedupe(events), name=NAME, poll_interval_seconds=0.2
        )
        try:
            assert handle.sync(120), handle.status()
            status = handle.status()
        finally:
            handle.stop()
    assert status["batches_lost"] >= 1
    reason = status["last_lost_reason"]
    # the mask runs from the signature to the next space: the rest of the path goes with it
    assert "X-Amz-Signature=*** is not a regular file" in reason, reason
    _clean_output(json.dumps(status, ensure_ascii=False), where="status()")
    assert status["query"] == clean(NAME)

    # the sidecar, through the command line: its JSON lines and its status line
    command = sidecar_args(checkpoint, tmp_path / "side.duckdb", "--name", NAME, "--once")
    as_json = runner.invoke(app, [*command, "--json"])
    assert as_json.exit_code == 0, as_json.output
    _clean_output(as_json.output, where="sidecar --json")
    final = json.loads(as_json.stdout.splitlines()[-1])
    assert final["batches_lost"] >= 1 and final["last_lost_reason"] == reason
    as_text = runner.invoke(app, command)  # resumes: audits nothing, prints the status line
    assert as_text.exit_code == 0, as_text.output
    assert "orders" in as_text.stdout
    _clean_output(as_text.output, where="sidecar")

    # the reports of both histories, in the terminal
    for db in (folder / "injob.duckdb", tmp_path / "side.duckdb"):
        shown = runner.invoke(app, ["report", "--db", str(db)], env={"COLUMNS": "250"})
        assert shown.exit_code == 0, shown.output
        assert "orders" in shown.stdout and "owned" in shown.stdout
        _clean_output(shown.output, where=f"report {db.name}")

    # the history read from the checkpoint: the linked file costs its batch, in one clean
    # warning line, and every other batch is written
    history = runner.invoke(
        app,
        ["checkpoint-history", str(checkpoint), "--db", str(tmp_path / "h.duckdb"), "--no-state"],
    )
    _clean_output(history.output, where="checkpoint-history")
    assert history.exit_code == 0, history.output
    warnings = [line for line in history.output.splitlines() if "warning" in line]
    assert len(warnings) == 1, history.output
    assert "is not a regular file" in warnings[0] and "left out" in warnings[0], warnings

    # and every log line wmwatch wrote meanwhile, the in-job run's included
    records = [
        r for r in caplog.get_records("setup") + caplog.records if r.name.startswith("wmwatch")
    ]
    logged = "\n".join(logging.Formatter().format(r) for r in records)
    assert "lost batch 1, not audited" in logged, logged
    _clean_output(logged, where="logs")


CREDENTIALS = (
    "s3a://AKIAEXAMPLEKEY:wJalrXUtnFEMI0K7MDENG@bucket/checkpoints/orders?X-Amz-Signature=5ec7e7519"
)


def test_credentials_in_a_checkpoint_uri_are_never_printed(spark: Any, tmp_path: Path) -> None:
    """The filesystem cannot be reached (no S3 classes here): each command says so in one line,
    naming the checkpoint with its credentials masked."""
    history = runner.invoke(
        app, ["checkpoint-history", CREDENTIALS, "--db", str(tmp_path / "h.duckdb")]
    )
    sidecar = runner.invoke(
        app,
        sidecar_args(CREDENTIALS, tmp_path / "side.duckdb", "--once"),
        env={IN_VARIABLE: str(tmp_path)},
    )
    for result, command in ((history, "checkpoint-history"), (sidecar, "sidecar")):
        assert result.exit_code in (1, 2), (command, result.output, result.exception)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, (command, result.output)
        assert "s3a://***@bucket/checkpoints/orders" in lines[0], (command, lines[0])
        for secret in ("wJalrXUtnFEMI0K7MDENG", "5ec7e7519"):
            assert secret not in result.output, (command, secret)
