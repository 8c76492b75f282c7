"""Benchmark: ``wmwatch report`` over a history of 100,000 batches (target: under 1 s).

Builds a synthetic but realistic history file through the store's own writers (4 queries, one
stateful operator and one file source per batch, a progress JSON of Spark's size per batch,
audited late rows and findings: ``benchmarks/_history.py``), then times the report in-process
through the CLI (CliRunner, each format) and once as a subprocess (``python -m wmwatch.cli``:
interpreter start-up and imports included).

    python benchmarks/bench_report.py [--batches 100000] [--runs 5] [--keep path.duckdb] [--tiny]

``--tiny`` (what CI runs): 200 batches, one run; it shows the benchmark still works, and its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _history import build_history
from _machine import print_machine

TARGET_SECONDS = 1.0


def _time_in_process(db: Path, fmt: str, runs: int) -> list[float]:
    from typer.testing import CliRunner

    from wmwatch.cli import app

    runner = CliRunner()
    timings = []
    for _ in range(runs):
        started = time.perf_counter()
        result = runner.invoke(app, ["report", "--db", str(db), "--format", fmt])
        timings.append(time.perf_counter() - started)
        if result.exit_code != 0:
            raise SystemExit(f"report failed ({fmt}): {result.output}")
    return timings


def _time_subprocess(db: Path) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "wmwatch.cli", "report", "--db", str(db), "--format", "json"],
        capture_output=True,
        text=True,
        check=False,
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"report subprocess failed: {done.stderr}")
    return elapsed


def main() -> int:
    print_machine()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--keep", type=Path, help="build the history here and keep it")
    parser.add_argument("--tiny", action="store_true", help="200 batches, one run (CI)")
    args = parser.parse_args()
    if args.tiny:
        args.batches, args.runs = 200, 1

    with tempfile.TemporaryDirectory(prefix="wmwatch-bench-") as tmp:
        db = args.keep or Path(tmp) / "history.duckdb"
        if db.exists():
            db.unlink()
        started = time.perf_counter()
        build_history(db, batches=args.batches)
        build_seconds = time.perf_counter() - started
        size_mib = db.stat().st_size / 2**20
        print(
            f"history: {args.batches:,} batches, {size_mib:.1f} MiB "
            f"({size_mib / args.batches * 1000:.2f} MiB per 1,000 batches), "
            f"built in {build_seconds:.1f} s"
        )
        rows = []
        for fmt in ("table", "json", "csv"):
            timings = _time_in_process(db, fmt, args.runs)
            rows.append(
                (f"in-process CliRunner, --format {fmt}", statistics.median(timings), max(timings))
            )
        sub = _time_subprocess(db)
        rows.append(("subprocess python -m wmwatch.cli (json)", sub, sub))
        print()
        print(
            f"{'wmwatch report over ' + format(args.batches, ',') + ' batches':<46} "
            f"{'median':>8} {'max':>8}  target"
        )
        for label, median, worst in rows:
            verdict = "ok" if worst < TARGET_SECONDS else "SLOW"
            print(f"{label:<46} {median:>7.3f}s {worst:>7.3f}s  < {TARGET_SECONDS:g}s {verdict}")
        # a tiny run shows the benchmark works; its figures are not judged
        return 0 if args.tiny or all(worst < TARGET_SECONDS for _, _, worst in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
