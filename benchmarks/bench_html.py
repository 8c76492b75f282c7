"""Benchmark: ``wmwatch report --format html`` over a history of 100,000 batches.

Bars: the file under 5 MB, drawn in headless Chromium in under 2 s. Builds the synthetic history
of ``bench_report.py`` (through the store's own schema) and adds two inputs' watermarks per query
and a join budget estimate, so every chart has data; then, for each history, times the report
(in-process, through the CLI), measures the file, and opens it in Debian's chromium over the
DevTools pipe: time from navigation to the second animation frame after load (every SVG parsed
and painted), console errors and requests. A 1,000-batch history is measured in the same run:
thinning keeps the page about the same size however long the history.

    python benchmarks/bench_html.py [--batches 100000] [--runs 3] [--keep folder]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import duckdb
from _machine import print_machine
from bench_report import build_history

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.chromium import Chromium  # noqa: E402

SIZE_BAR_BYTES = 5 * 10**6
DRAWN_BAR_SECONDS = 2.0


def add_watermarks(path: Path) -> None:
    """Two inputs per query, the second trailing by 30 s and holding the watermark back."""
    con = duckdb.connect(str(path))
    try:
        con.execute("SET TimeZone = 'UTC'")
        con.execute(
            """
            INSERT INTO source_watermarks
            SELECT b.query_id, b.batch_id, 'node-' || s.i,
                   'FileStreamSource[file:/data/events/' || b.query_name || '-' || s.i || ']',
                   'ts', 10.0, b.watermark_at - to_seconds(s.i * 30),
                   b.event_time_max_at - to_seconds(s.i * 30), 0, s.i = 1, 'min',
                   b.recorded_at
            FROM batches b, range(2) s(i)
            """
        )
        con.execute(
            """
            UPDATE findings SET evidence = '{"state_budget_bytes": 2147483648,
                                             "seconds_to_budget": 86400.0}'
            """
        )
        con.execute("CHECKPOINT")
    finally:
        con.close()


def render(db: Path, out: Path) -> float:
    from typer.testing import CliRunner

    from wmwatch.cli import app

    started = time.perf_counter()
    result = CliRunner().invoke(
        app, ["report", "--db", str(db), "--format", "html", "--output", str(out)]
    )
    elapsed = time.perf_counter() - started
    if result.exit_code != 0:
        raise SystemExit(f"report failed: {result.output}")
    return elapsed


def measure(label: str, db: Path, out: Path, runs: int) -> bool:
    renders = [render(db, out) for _ in range(runs)]
    size = out.stat().st_size
    drawn: list[float] = []
    errors: list[str] = []
    with Chromium() as browser:
        for _ in range(runs):
            load = browser.open(out)
            drawn.append(load.seconds_to_drawn)
            errors += load.console_errors + load.failed_requests
            charts = browser.evaluate("document.querySelectorAll('figure.chart svg').length")
    ok = size < SIZE_BAR_BYTES and max(drawn) < DRAWN_BAR_SECONDS and not errors
    print(
        f"{label}: file {size / 1e6:.2f} MB ({charts} charts); report "
        f"{statistics.median(renders):.2f} s (median of {runs}); drawn in Chromium "
        f"median {statistics.median(drawn):.3f} s, max {max(drawn):.3f} s; "
        f"console errors and failed requests: {len(errors)}  "
        f"[bars: < 5 MB, < 2 s: {'ok' if ok else 'MISSED'}]"
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="keep the histories and pages in this folder")
    args = parser.parse_args()
    print_machine()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="wmwatch-bench-html-"))
    folder.mkdir(parents=True, exist_ok=True)
    ok = True
    for batches, queries in ((args.batches, 1), (args.batches, 4), (1_000, 1)):
        db = folder / f"h-{batches}-{queries}.duckdb"
        if not db.exists():
            started = time.perf_counter()
            build_history(db, batches=batches, queries=queries)
            add_watermarks(db)
            print(f"built {batches:,} batches over {queries} quer{'y' if queries == 1 else 'ies'} "
                  f"in {time.perf_counter() - started:.1f} s")
        label = f"{batches:,} batches, {queries} quer{'y' if queries == 1 else 'ies'}"
        ok &= measure(label, db, folder / f"report-{batches}-{queries}.html", args.runs)
    print(f"pages in {folder}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
