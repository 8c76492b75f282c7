"""A checkpoint read through a Spark Connect server has the classic reader's bounds: regular
files only (a folder or a FIFO where a file belongs is a damaged checkpoint, and the FIFO is
never opened), at most 256 MiB each (a larger one is refused on its length, never read), and no
file's text quoted in an error. A damaged file costs its batch (counted lost with the reason),
never a retry forever.

Run on a real Connect server by ``tests/test_connect_suite.py`` (the checkpoint is on the
server's filesystem, which here is this machine's).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from wmwatch._audit.replay.connect import SessionFileSystem
from wmwatch._checkpoint.fs import MAX_FILE_BYTES, CheckpointDamaged
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch._errors import AuditError

pytestmark = [pytest.mark.spark, pytest.mark.connect]

SHADOW = "root:$6$Qx7sEcReT$h4sh3dPa55w0rd:19000:0:99999:7:::"


def _offsets(watermark_ms: int) -> str:
    meta = {"batchWatermarkMs": watermark_ms, "batchTimestampMs": 1_700_000_000_000, "conf": {}}
    return f'v1\n{json.dumps(meta)}\n{{"logOffset":0}}'


def test_connect_checkpoint_reads_take_regular_files_within_the_bound_only(
    spark: Any, tmp_path: Path
) -> None:
    from wmwatch._core.sessions import is_connect

    assert is_connect(spark), "run through tests/test_connect_suite.py (a Connect session)"
    root = tmp_path / "checkpoint"
    offsets = root / "offsets"
    offsets.mkdir(parents=True)
    (offsets / "0").write_text(_offsets(1_000))
    # 1: past the bound, sparse (no disk used); it must be refused without being read
    with (offsets / "1").open("wb") as handle:
        handle.truncate(MAX_FILE_BYTES + 1)
    # 2: a folder where a file belongs, holding a file that looks like an offsets file
    (offsets / "2").mkdir()
    (offsets / "2" / "part").write_text(_offsets(2_000))
    # 3: a link to a file that is not the checkpoint's (followed by the server's filesystem:
    # its text must not reach the error)
    shadow = tmp_path / "shadow"
    shadow.write_text(SHADOW + "\n")
    (offsets / "3").symlink_to(shadow)
    # 4: a FIFO (opening it would block the reading task until a writer comes)
    os.mkfifo(offsets / "4")
    reader = CheckpointReader(f"file://{root}", SessionFileSystem(spark, timeout_seconds=60))

    assert reader.offsets(0).watermark_ms == 1_000
    assert reader.fs.read_text(f"file://{offsets}/9") is None  # missing: not damaged

    started = time.monotonic()
    with pytest.raises(CheckpointDamaged, match=r"more than the 268,435,456 wmwatch reads"):
        reader.offsets(1)
    assert time.monotonic() - started < 60  # refused on its length, never read

    with pytest.raises(CheckpointDamaged, match="is not a regular file; the checkpoint is damaged"):
        reader.offsets(2)

    with pytest.raises(AuditError) as linked:
        reader.offsets(3)
    assert "Qx7sEcReT" not in str(linked.value) and "root:" not in str(linked.value)

    started = time.monotonic()
    with pytest.raises(CheckpointDamaged, match="is not a regular file; the checkpoint is damaged"):
        reader.offsets(4)
    assert time.monotonic() - started < 60  # never opened: no hang
