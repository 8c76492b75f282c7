"""Spark Connect: the join check and operator watermarks come from the explain text."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.spark


def test_connect_join_classified_from_plan_text(tmp_path: Path) -> None:
    script = Path(__file__).parent / "scripts" / "connect_joins.py"
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=240, cwd=Path(__file__).parents[1],
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"no result; stderr tail: {done.stderr[-2000:]}"
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["joins"] == [
        {"operator_id": 0, "case": "one_sided_range", "unbounded_sides": ["left"]}
    ]
    assert result["findings"] == [["join_state_unbounded", "left"]]
    assert result["via"] == ["text"]
    (operator,) = result["operators"]
    assert operator["operator_name"] == "symmetricHashJoin"
    assert operator["eviction_watermark_at"] == "2026-01-01T00:02:00+00:00"
