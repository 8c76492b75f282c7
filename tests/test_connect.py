"""Spark Connect: events come through the stock listener in the client, and still match."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import iso

pytestmark = pytest.mark.spark


def test_spark_connect_queries_are_watched_with_the_stock_listener(tmp_path: Path) -> None:
    script = Path(__file__).parent / "scripts" / "connect_watch.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=Path(__file__).parents[1],
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result; stderr tail: {done.stderr[-2000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["mode"] == "stock"
    assert result["batch_id"] == result["expected_batch_id"]
    from datetime import datetime

    assert datetime.fromisoformat(result["watermark"]).timestamp() == iso(
        result["expected_watermark"]
    )
    # started before attach: the history starts at the query's first batch, each batch once
    assert (
        result["recorded_batches"]
        == result["expected_batches"]
        == list(range(len(result["expected_batches"])))
    )
    assert result["batches_total"] == len(result["expected_batches"])
