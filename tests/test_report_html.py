"""``wmwatch report --format html``, looked at the way a person would: in real headless Chromium.

The history comes from real Spark runs (built once for the module): a windowed count with late
rows, audited, restarted once (two run ids); and a stream-stream join of two inputs with
watermarks but no time condition (both sides unbounded, a state budget estimate, one input
holding the global watermark back). The page is opened from disk in Debian's chromium; the test
fails on any console error or request, checks every chart drew its series, and saves a
screenshot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

import wmwatch
from tests.chromium import Chromium, chromium_path
from tests.harness.streams import write_events
from wmwatch._inspect.plugin import PlanPlugin
from wmwatch._report.html_charts import minmax_downsample
from wmwatch._store.writer import HistoryStore
from wmwatch.cli import app

runner = CliRunner()
SCHEMA = "k INT, ts TIMESTAMP"
LATE_QUERY, JOIN_QUERY = "late_counts", "join_two_inputs"
BUDGET_BYTES = 64 * 2**20


# event time near batch time, as in a live stream: ten minutes ago, on a whole minute
BASE = datetime.fromtimestamp((time.time() // 60 - 10) * 60, UTC)


def ts(second: int) -> str:
    return (BASE + timedelta(seconds=second)).isoformat().replace("+00:00", "Z")


def report(*args: str) -> Any:
    return runner.invoke(app, ["report", *args])


# -- the history of real runs ---------------------------------------------------------------------


def _late_counts(spark: Any, folder: Path, watch: Any, files: list[list[dict[str, Any]]]) -> None:
    from pyspark.sql import functions as F

    events = (
        spark.readStream.schema(SCHEMA).json(str(folder / "in")).withWatermark("ts", "10 seconds")
    )
    query = (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.format("noop")
        .queryName(LATE_QUERY)
        .outputMode("append")
        .option("checkpointLocation", str(folder / "late-checkpoint"))
        .start()
    )
    try:
        handle = watch.audit(query, events)
        for rows in files:
            write_events(folder / "in", rows)
            query.processAllAvailable()
        assert handle.sync(120), handle.status()
        handle.stop()
    finally:
        query.stop()


@pytest.fixture(scope="module")
def history(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One history file with both queries, written by a real watch."""
    from pyspark.sql import functions as F

    folder = tmp_path_factory.mktemp("html_history")
    for sub in ("in", "left", "right"):
        (folder / sub).mkdir()
    db = folder / "h.duckdb"
    watch = wmwatch.attach(
        spark,
        db=str(db),
        metrics_port=None,
        registry=CollectorRegistry(),
        state_budget_bytes=BUDGET_BYTES,
    )
    try:
        # windowed count: event time moves 20 s a batch; every other batch brings rows that are
        # 30-50 s behind, in windows the watermark has closed
        def batch(i: int) -> list[dict[str, Any]]:
            rows = [{"k": i * 10 + j, "ts": ts(40 + i * 20 + j)} for j in range(4)]
            if i % 2 == 1:
                rows += [{"k": 900 + i * 10 + j, "ts": ts(i * 20 - 10 + 3 * j)} for j in range(3)]
            return rows

        _late_counts(spark, folder, watch, [batch(i) for i in range(5)])
        _late_counts(spark, folder, watch, [batch(i) for i in range(5, 8)])  # a restart

        # a join of two inputs without a time condition: both sides are kept forever; the right
        # input's event time trails the left's, so it holds the global watermark back
        def side(name: str) -> Any:
            frame = spark.readStream.schema(SCHEMA).json(str(folder / name))
            frame = frame.withWatermark("ts", "10 seconds")
            return frame.select(F.col("k").alias(f"{name[0]}k"), F.col("ts").alias(f"{name[0]}ts"))

        joined = side("left").join(side("right"), F.expr("lk = rk"), "inner")
        query = (
            joined.writeStream.format("noop")
            .queryName(JOIN_QUERY)
            .option("checkpointLocation", str(folder / "join-checkpoint"))
            .start()
        )
        try:
            for i in range(6):
                write_events(
                    folder / "left", [{"k": i * 10 + j, "ts": ts(60 * i + j)} for j in range(3)]
                )
                write_events(
                    folder / "right", [{"k": i * 10 + j, "ts": ts(20 * i + j)} for j in range(3)]
                )
                query.processAllAvailable()
            watch.flush()
            next(p for p in watch.plugins() if isinstance(p, PlanPlugin)).wait_idle()
        finally:
            query.stop()
    finally:
        watch.close()
    return db


@pytest.fixture(scope="module")
def page(history: Path) -> Path:
    target = history.parent / "report.html"
    result = report("--db", str(history), "--format", "html", "--output", str(target))
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # the page went to the file
    return target


def _expected(db: Path) -> dict[str, dict[str, Any]]:
    """What the page must show per query, read from the history itself."""
    with duckdb.connect(str(db), read_only=True) as con:
        out: dict[str, dict[str, Any]] = {}
        for qid, name, runs in con.execute(
            "SELECT query_id, any_value(query_name), count(DISTINCT run_id) FROM batches GROUP BY 1"
        ).fetchall():
            operators = con.execute(
                "SELECT count(DISTINCT operator_id) FROM operators WHERE query_id = ?", [qid]
            ).fetchone()
            inputs = con.execute(
                "SELECT count(DISTINCT source) FROM source_watermarks WHERE query_id = ?", [qid]
            ).fetchone()
            audited = con.execute(
                "SELECT count(*) FROM audit_batches WHERE query_id = ?", [qid]
            ).fetchone()
            late = con.execute(
                "SELECT count(*) FROM late_rows WHERE query_id = ?", [qid]
            ).fetchone()
            fixes = [
                r[0]
                for r in con.execute(
                    "SELECT fix FROM findings WHERE query_id = ? AND status = 'active' "
                    "AND kind = 'join_state_unbounded'",
                    [qid],
                ).fetchall()
            ]
            out[name] = {
                "runs": runs,
                "operators": operators[0] if operators else 0,
                "inputs": inputs[0] if inputs else 0,
                "audited": audited[0] if audited else 0,
                "late_rows": late[0] if late else 0,
                "join_fixes": fixes,
            }
    return out


@pytest.mark.spark
def test_the_runs_recorded_what_the_page_must_show(history: Path) -> None:
    expected = _expected(history)
    assert expected[LATE_QUERY]["runs"] == 2
    assert expected[LATE_QUERY]["late_rows"] > 0
    assert expected[JOIN_QUERY]["inputs"] == 2
    assert expected[JOIN_QUERY]["join_fixes"]


def _figures(browser: Chromium) -> list[dict[str, Any]]:
    value = browser.evaluate(
        """[...document.querySelectorAll('section.query')].flatMap(section =>
             [...section.querySelectorAll('figure.chart')].map(f => {
               const svg = f.querySelector('svg'); const r = svg.getBoundingClientRect();
               return {query: section.querySelector('h2').textContent, chart: f.dataset.chart,
                       declared: Number(f.dataset.series),
                       drawn: svg.querySelectorAll('[id^="series-"]').length,
                       paths: svg.querySelectorAll('[id^="series-"] path, path[id^="series-"]')
                              .length,
                       text: svg.textContent,
                       // labels with an exponent: their last piece drawn smaller than the
                       // first (a log axis' 10^1, 2x10^1)
                       powers: [...svg.querySelectorAll('text')].filter(t => {
                         const s = [...t.querySelectorAll('tspan')];
                         return s.length >= 3
                           && s.map(x => x.textContent).join('').includes('10')
                           && parseFloat(getComputedStyle(s[s.length - 1]).fontSize)
                              < parseFloat(getComputedStyle(s[0]).fontSize);
                       }).length,
                       x: r.left + window.scrollX, y: r.top + window.scrollY,
                       width: r.width, height: r.height};
             }))"""
    )
    assert isinstance(value, list)
    return value


def _ink(png: Path, figure: dict[str, Any]) -> tuple[float, int, float]:
    """Share of non-white pixels, number of distinct colours, and share of coloured (not grey:
    the series, never the axes or the text) pixels inside a chart's box."""
    from PIL import Image

    with Image.open(png) as image:
        box = (
            int(figure["x"]),
            int(figure["y"]),
            int(figure["x"] + figure["width"]),
            int(figure["y"] + figure["height"]),
        )
        pixels = np.asarray(image.convert("RGB").crop(box))
    ink = (pixels < 235).any(axis=2).mean()
    colours = len({tuple(p) for p in pixels.reshape(-1, 3)[::7].tolist()})
    spread = pixels.max(axis=2).astype(int) - pixels.min(axis=2).astype(int)
    coloured = (spread > 40).mean()
    return float(ink), colours, float(coloured)


@pytest.mark.spark
def test_page_draws_every_chart_in_chromium(history: Path, page: Path) -> None:
    expected = _expected(history)
    screenshot = page.parent / "report.png"
    with Chromium(width=1200, height=900) as browser:
        load = browser.open(page)
        figures = _figures(browser)
        nothing = browser.evaluate("document.getElementById('nothing-yet') === null")
        tables = browser.evaluate(
            "Object.fromEntries([...document.querySelectorAll('table[data-table]')]"
            ".map(t => [t.closest('section').querySelector('h2').textContent + '/' + "
            "t.dataset.table, t.innerText]))"
        )
        browser.screenshot(screenshot)
    print(f"screenshot: {screenshot}")
    if os.environ.get("WMWATCH_HTML_SCREENSHOT"):
        shutil.copy(screenshot, os.environ["WMWATCH_HTML_SCREENSHOT"])

    assert load.console_errors == []
    assert load.failed_requests == []
    assert load.requests == [page.resolve().as_uri()]  # nothing but the file itself
    assert nothing is True

    by_query: dict[str, dict[str, dict[str, Any]]] = {}
    for figure in figures:
        by_query.setdefault(figure["query"], {})[figure["chart"]] = figure
    late, join = by_query[LATE_QUERY], by_query[JOIN_QUERY]
    assert set(late) >= {
        "timeline",
        "lag",
        "late_per_batch",
        "histogram",
        "state_rows",
        "state_memory",
    }
    assert set(join) >= {
        "timeline",
        "lag",
        "late_per_batch",
        "state_rows",
        "state_memory",
        "inputs",
    }
    for name, charts in by_query.items():
        facts = expected[name]
        for key, figure in charts.items():
            assert figure["drawn"] == figure["declared"] > 0, (name, key, figure["drawn"])
            assert figure["paths"] >= figure["drawn"], (name, key)
            # drawn, not a blank box: axes and text alone leave grey ink, the series colour
            # (how much ink depends on the run's data: two flat lines leave under 2%)
            ink, colours, coloured = _ink(screenshot, figure)
            assert ink > 0.01 and colours >= 4 and coloured > 0.0001, (
                name,
                key,
                ink,
                colours,
                coloured,
            )
        assert charts["timeline"]["drawn"] == 4  # watermark, event time max, avg, min
        assert charts["lag"]["drawn"] == 2
        assert charts["state_rows"]["drawn"] == facts["operators"]
        assert charts["state_memory"]["drawn"] == facts["operators"]
        if "inputs" in charts:
            # each input's watermark and max event time, and the global watermark
            assert charts["inputs"]["drawn"] == 2 * facts["inputs"] + 1
        for key in ("timeline", "lag", "late_per_batch"):
            assert "batch time (UTC)" in charts[key]["text"]

    # no chart shows TeX source; the lateness histogram's log axis reads 10^1, 2x10^1, ...
    # with the exponent drawn smaller (mathtext), while names from the history stay out of
    # mathtext
    for name, charts in by_query.items():
        for key, figure in charts.items():
            assert "mathdefault" not in figure["text"], (name, key)
            assert "$" not in figure["text"], (name, key)
    assert late["histogram"]["powers"] >= 1, late["histogram"]["text"]

    # the restart is marked; the audit's rows and the advice are drawn
    assert "restart (new run id)" in late["timeline"]["text"]
    assert "restart" not in join["timeline"]["text"]
    assert late["late_per_batch"]["drawn"] == 2  # Spark's count and the audited rows
    assert "keeps 95%" in late["histogram"]["text"]
    assert "keeps 99%" in late["histogram"]["text"]
    # the join: unbounded sides named, the budget estimate, the input holding the watermark back
    assert "left and right sides unbounded" in join["state_rows"]["text"]
    assert "budget 64.0 MiB reached in" in join["state_memory"]["text"]
    assert "right] held the global watermark back" in join["inputs"]["text"]
    assert "left] held the global watermark back" not in join["inputs"]["text"]

    # tables: findings with their fix, top late windows and source files
    findings = tables[f"{JOIN_QUERY}/findings"]
    for fix in expected[JOIN_QUERY]["join_fixes"]:
        assert " ".join(fix.split()) in " ".join(findings.split())
    assert "top-windows" in {key.split("/")[1] for key in tables if key.startswith(LATE_QUERY)}
    sources = tables[f"{LATE_QUERY}/top-sources"]
    assert ".json" in sources


@pytest.mark.spark
def test_page_is_self_contained(page: Path) -> None:
    text = page.read_text()
    assert "<script" not in text
    assert "mathdefault" not in text  # no TeX source anywhere in the page
    for scheme in ("http://", "https://", "//cdn"):
        # only the SVG namespace declarations name a URL, and they are never fetched
        for line in text.splitlines():
            if scheme in line:
                assert "xmlns" in line or "w3.org" in line, line[:200]
    assert "default-src 'none'" in text


@pytest.mark.spark
def test_stdout_gets_the_same_page(history: Path, page: Path) -> None:
    result = report("--db", str(history), "--format", "html", "--query", JOIN_QUERY)
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("<!DOCTYPE html>")
    assert JOIN_QUERY in result.stdout and f"<h2>{LATE_QUERY}</h2>" not in result.stdout
    assert 'data-chart="inputs"' in result.stdout


# -- empty and bad input --------------------------------------------------------------------------


@pytest.fixture
def empty_db(tmp_path: Path) -> Path:
    db = tmp_path / "empty.duckdb"
    HistoryStore(db).close()
    return db


def test_empty_history_is_a_page_that_says_so(empty_db: Path, tmp_path: Path) -> None:
    if chromium_path() is None:
        pytest.fail("chromium is needed for the browser tests: apt-get install chromium")
    target = tmp_path / "empty.html"
    result = report("--db", str(empty_db), "--format", "html", "-o", str(target))
    assert result.exit_code == 0, result.output
    with Chromium() as browser:
        load = browser.open(target)
        heading = browser.evaluate("document.querySelector('#nothing-yet h2').textContent")
        charts = browser.evaluate("document.querySelectorAll('figure.chart').length")
    assert load.console_errors == [] and load.failed_requests == []
    assert heading == "Nothing recorded yet"
    assert charts == 0


def test_a_stateless_query_with_one_batch_draws_what_it_has(empty_db: Path) -> None:
    with duckdb.connect(str(empty_db)) as con:
        con.execute(
            "INSERT INTO batches (query_id, batch_id, run_id, query_name, batch_at, input_rows, "
            "recorded_at) VALUES ('q1', 0, 'r1', 'copy_files', now(), 5, now())"
        )
    result = report("--db", str(empty_db), "--format", "html")
    assert result.exit_code == 0, result.output
    page = result.stdout
    assert "<h2>copy_files</h2>" in page and 'id="nothing-yet"' not in page
    assert 'data-series="0"' not in page
    assert "No late-row audit recorded for this query" in page


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--query", "nope"], 1, "no query named or with id 'nope'"),
        (["--since", "yesterday"], 2, "--since 'yesterday'"),
        (["--output", "/nonexistent-folder/r.html"], 2, "does not exist"),
    ],
)
def test_bad_input_is_one_line_and_non_zero(
    empty_db: Path, tmp_path: Path, args: list[str], code: int, says: str
) -> None:
    result = report("--db", str(empty_db), "--format", "html", *args)
    assert result.exit_code == code
    assert says in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stdout == ""


def test_missing_db_is_one_line(tmp_path: Path) -> None:
    target = tmp_path / "r.html"
    result = report("--db", str(tmp_path / "none.duckdb"), "--format", "html", "-o", str(target))
    assert result.exit_code != 0
    assert len(result.stderr.strip().splitlines()) == 1
    assert not target.exists()


def test_without_the_extra_it_says_what_to_install(empty_db: Path) -> None:
    # a Python where matplotlib cannot be imported, running the real CLI
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.argv = ['wmwatch'] + sys.argv[1:]; "
        "from wmwatch.cli import main; main()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "report", "--db", str(empty_db), "--format", "html"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "wmwatch report: the HTML report needs matplotlib: pip install 'wmwatch[html]'"
    )
    assert done.stdout == ""


# -- thinning for drawing -------------------------------------------------------------------------


@given(
    st.lists(st.floats(-1e9, 1e9, allow_nan=False), min_size=1, max_size=3000),
    st.integers(1, 200),
)
def test_downsampling_never_drops_an_extreme(values: list[float], buckets: int) -> None:
    y = np.asarray(values)
    x = np.arange(len(y), dtype=np.float64) * 2.5
    dx, dy = minmax_downsample(x, y, buckets)
    assert len(dx) <= max(2 * buckets, len(y) if len(y) <= 2 * buckets else 0)
    assert dy.max() == y.max() and dy.min() == y.min()
    assert np.all(np.diff(dx) > 0)  # still in time order, each point a real one
    assert set(zip(dx.tolist(), dy.tolist(), strict=True)) <= set(
        zip(x.tolist(), y.tolist(), strict=True)
    )
    if len(y) > 2 * buckets:
        # every bucket keeps its own minimum and maximum
        span = x[-1] - x[0]
        index = np.minimum(((x - x[0]) / span * buckets).astype(int), buckets - 1)
        kept = np.minimum(((dx - x[0]) / span * buckets).astype(int), buckets - 1)
        for b in np.unique(index):
            assert dy[kept == b].max() == y[index == b].max()
            assert dy[kept == b].min() == y[index == b].min()


def test_downsampling_drops_missing_values() -> None:
    x = np.arange(10, dtype=np.float64)
    y = np.array([1, np.nan, 3, 4, np.nan, 6, 7, 8, 9, 10], dtype=np.float64)
    dx, dy = minmax_downsample(x, y, 100)
    assert dx.tolist() == [0, 2, 3, 5, 6, 7, 8, 9]
    assert not np.isnan(dy).any()


@pytest.mark.spark
def test_page_json_and_html_agree_on_late_rows(history: Path, page: Path) -> None:
    doc = json.loads(report("--db", str(history), "--format", "json").stdout)
    late = next(q for q in doc["queries"] if q["query"] == LATE_QUERY)["late_rows"]
    text = page.read_text()
    assert f"<strong>{late['late_rows']:,}</strong> late rows audited" in text
