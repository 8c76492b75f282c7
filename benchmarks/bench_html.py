"""Benchmark: ``wmwatch report --format html`` over a history of 100,000 batches.

Bars: the file under 5 MB, drawn in headless Chromium in under 2 s. Builds the synthetic history
of ``bench_report.py`` (through the store's own writers: ``benchmarks/_history.py``) with two
inputs' watermarks per query and a join budget estimate, so every chart has data; then, for
each history, times the report (in-process, through the CLI), measures the file, and opens it
in Debian's chromium over the DevTools pipe: time from navigation to the second animation frame
after load (every SVG parsed and painted), console errors and requests. A 1,000-batch history
is measured in the same run: thinning keeps the page about the same size however long the
history.

    python benchmarks/bench_html.py [--batches 100000] [--runs 3] [--keep folder] [--tiny]

``--tiny`` (what CI runs): 300 and 100 batches, one run; it shows the benchmark still works, and
its figures mean nothing.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _history import build_history
from _machine import print_machine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.chromium import Chromium

SIZE_BAR_BYTES = 5 * 10**6
DRAWN_BAR_SECONDS = 2.0


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


def measure(label: str, db: Path, out: Path, runs: int, *, judged: bool = True) -> bool:
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
    # a tiny run shows the benchmark works: its figures are not judged, errors still are
    bars = size < SIZE_BAR_BYTES and max(drawn) < DRAWN_BAR_SECONDS
    ok = (bars or not judged) and not errors
    print(
        f"{label}: file {size / 1e6:.2f} MB ({charts} charts); report "
        f"{statistics.median(renders):.2f} s (median of {runs}); drawn in Chromium "
        f"median {statistics.median(drawn):.3f} s, max {max(drawn):.3f} s; "
        f"console errors and failed requests: {len(errors)}  "
        f"[bars: < 5 MB, < 2 s: {'ok' if bars else 'MISSED'}]"
    )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="keep the histories and pages in this folder")
    parser.add_argument("--tiny", action="store_true", help="a few hundred batches, one run (CI)")
    args = parser.parse_args()
    if args.tiny:
        args.batches, args.runs = 300, 1
    print_machine()
    folder = args.keep or Path(tempfile.mkdtemp(prefix="wmwatch-bench-html-"))
    folder.mkdir(parents=True, exist_ok=True)
    ok = True
    small = 100 if args.tiny else 1_000
    for batches, queries in ((args.batches, 1), (args.batches, 4), (small, 1)):
        db = folder / f"h-{batches}-{queries}.duckdb"
        if not db.exists():
            started = time.perf_counter()
            build_history(db, batches=batches, queries=queries, watermarks=True)
            print(
                f"built {batches:,} batches over {queries} quer{'y' if queries == 1 else 'ies'} "
                f"in {time.perf_counter() - started:.1f} s"
            )
        label = f"{batches:,} batches, {queries} quer{'y' if queries == 1 else 'ies'}"
        out = folder / f"report-{batches}-{queries}.html"
        ok &= measure(label, db, out, args.runs, judged=not args.tiny)
    if args.tiny and not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"pages in {folder}")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
