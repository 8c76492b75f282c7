"""Every benchmark still runs: each ``benchmarks/bench_*.py`` at ``--tiny`` exits 0.

Only that it runs is checked here; its figures are not judged (they are measured on a quiet
machine and read as ratios, docs/benchmarks.md). As tests, the benchmarks spread over the test
processes with the rest of the suite. ``bench_delta`` runs Delta Lake, so it runs in the pyspark
4.2 environment (``nox -s delta``) with the other Delta tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DELTA

pytestmark = [pytest.mark.spark, pytest.mark.slow]

ROOT = Path(__file__).parents[1]
BENCHMARKS = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))
# well above the slowest tiny run on a loaded 2-core machine (bench_delta's: about 3 minutes)
TIMEOUT_SECONDS = 900


# what the longest take in a two-process run, for the order tests/conftest.py hands them out in
_MINUTES = {
    "bench_audit.py": 4.0,
    "bench_core.py": 2.5,
    "bench_kafka.py": 1.5,
    "bench_delta.py": 2.0,
}


def _param(name: str) -> object:
    marks = [pytest.mark.slow(minutes=_MINUTES.get(name, 1.0))]
    if name == "bench_delta.py":
        marks.append(pytest.mark.delta)
    return pytest.param(name, marks=marks, id=name.removesuffix(".py"))


def test_there_are_benchmarks() -> None:
    assert "bench_core.py" in BENCHMARKS and "bench_delta.py" in BENCHMARKS


@pytest.mark.parametrize("name", [_param(n) for n in BENCHMARKS])
def test_benchmark_runs_tiny(name: str) -> None:
    if name == "bench_delta.py" and not DELTA:
        pytest.fail("bench_delta runs in the pyspark 4.2 environment: run `nox -s delta`")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "SPARK_LOCAL_IP": "127.0.0.1"}
    try:
        run = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / name), "--tiny"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{name} --tiny ran past {TIMEOUT_SECONDS} s: {str(exc.stdout)[-2000:]}")
    assert run.returncode == 0, f"{name} --tiny failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
