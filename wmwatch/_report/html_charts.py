"""The HTML report's charts: static SVG drawn by matplotlib, one function per chart.

Static SVG needs no script and no network to display, draws as soon as the page is parsed, prints
as vectors, and stays a few hundred KB however long the history: series are thinned first by
:func:`minmax_downsample`, which keeps the smallest and the largest value of every bucket so no
spike or dip disappears. Colours are the Okabe-Ito palette (distinct for the common colour-vision
deficiencies) and every series also has its own line style, so charts still read in greyscale
print. Every data series is drawn with an SVG id starting ``series-``, which the browser test
counts. matplotlib is imported here only, behind the ``html`` extra. Over 500 lines because it
holds one function per chart and the one style they share.
"""

from __future__ import annotations

import io
import math
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from wmwatch._audit.report.series import bin_edges_seconds
from wmwatch._inspect.series import InputSeries, JoinBudget
from wmwatch._report.history import Floats, QueryHistory

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = ["Chart", "chart_set", "minmax_downsample"]

BUCKETS = 600
"""Buckets per series when thinning: two points each, about one bucket per pixel of plot."""

MAX_MARKERS = 80
"""Markers per series at most (which batches an input held the watermark back)."""

MAX_RESTART_MARKS = 60

# Okabe & Ito (2008): black, orange, sky blue, bluish green, yellow, blue, vermillion, purple
BLACK, ORANGE, SKY, GREEN, YELLOW, BLUE, VERMILLION, PURPLE = (
    "#000000",
    "#E69F00",
    "#56B4E9",
    "#009E73",
    "#F0E442",
    "#0072B2",
    "#D55E00",
    "#CC79A7",
)
CYCLE = (BLUE, ORANGE, GREEN, PURPLE, SKY, VERMILLION, YELLOW)
STYLES = ("-", "--", "-.", ":", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 1)))


@dataclass(frozen=True, slots=True)
class Chart:
    key: str
    title: str
    explanation: str
    svg: str
    series: int


def minmax_downsample(x: Floats, y: Floats, buckets: int = BUCKETS) -> tuple[Floats, Floats]:
    """At most ``2 * buckets`` points of (x, y), keeping each x-bucket's minimum and maximum.

    Points with a NaN coordinate are dropped; ``x`` must be ascending. Within a bucket the
    minimum and the maximum keep their own x and their order, so a line through the result
    reaches every extreme of the original.
    """
    import numpy as np

    keep = ~(np.isnan(x) | np.isnan(y))
    x, y = np.asarray(x)[keep], np.asarray(y)[keep]
    if len(x) <= 2 * buckets:
        return x, y
    span = x[-1] - x[0]
    if span <= 0:
        index = np.array(sorted({int(np.argmin(y)), int(np.argmax(y))}))
        return x[index], y[index]
    bucket = np.minimum(((x - x[0]) / span * buckets).astype(np.int64), buckets - 1)
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    ends = np.r_[starts[1:], len(x)]
    picked: list[int] = []
    for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
        part = y[start:end]
        low, high = start + int(np.argmin(part)), start + int(np.argmax(part))
        picked.extend(sorted({low, high}))
    index = np.asarray(picked, dtype=np.int64)
    return x[index], y[index]


def chart_set(
    history: QueryHistory,
    *,
    salt: str,
    late_rows: Mapping[str, Any] | None,
    findings: Sequence[Mapping[str, Any]],
) -> list[Chart]:
    """Every chart a query's history has data for, in page order."""
    with _style():
        charts: list[Chart | None] = [
            _timeline(history, salt),
            _lag(history, salt),
            _late_per_batch(history, salt),
            _histogram(history, late_rows, salt),
            *_state(history, findings, salt),
            _inputs(history, salt),
        ]
    # a chart without a series (a stateless query has no watermark) would be an empty frame
    return [chart for chart in charts if chart is not None and chart.series > 0]


# -- charts ---------------------------------------------------------------------------------------


def _timeline(h: QueryHistory, salt: str) -> Chart:
    import numpy as np

    fig, ax = _figure()
    at = h.batch_at_seconds
    watermark = np.where(h.watermark_seconds > 0, h.watermark_seconds, np.nan)
    wx, wy = minmax_downsample(at, watermark)
    event_span = float(np.nanmax(h.event_time_max_seconds, initial=0)) - float(
        np.nanmin(h.event_time_min_seconds, initial=0)
    )
    lag = float(np.nanmedian(at - watermark)) if len(wx) else 0.0
    # a replay of old data lags by months: the batch-time line would flatten everything else
    if len(wx) and lag <= 10 * max(event_span, at[-1] - at[0], 1.0):
        ax.fill_between(_days(wx), _days(wy), _days(wx), color="#d9d9d9", lw=0, label="lag")
        ax.plot(
            _days(at[[0, -1]]),
            _days(at[[0, -1]]),
            color="#777777",
            ls=(0, (2, 2)),
            lw=1,
            label="batch time (no lag)",
        )
    count = 0
    for label, values, colour, style, width in (
        ("event time max", h.event_time_max_seconds, VERMILLION, "--", 1.2),
        ("event time avg", h.event_time_avg_seconds, BLUE, "-.", 1.0),
        ("event time min", h.event_time_min_seconds, SKY, ":", 1.4),
        ("watermark", watermark, BLACK, "-", 2.0),
    ):
        x, y = minmax_downsample(at, values)
        if len(x):
            _series(ax, _days(x), _days(y), label, colour, style, width, count)
            count += 1
    _restarts(ax, h)
    _batch_axis(ax, h)
    _time_axis(ax, "y", "event time (UTC)")
    _legend(ax, loc="upper left", fontsize=8, ncols=3)
    return Chart(
        "timeline",
        "Watermark and event time",
        "Event time Spark saw in each batch and the watermark it computed; the grey gap between "
        "the dotted batch-time line and the watermark is the watermark lag; vertical lines mark "
        "restarts.",
        _svg(fig, salt + "-timeline"),
        count,
    )


def _lag(h: QueryHistory, salt: str) -> Chart:
    fig, ax = _figure()
    count = 0
    for label, values, colour, style in (
        ("p50", h.lag.p50_seconds, BLUE, "-"),
        ("p95", h.lag.p95_seconds, VERMILLION, "--"),
    ):
        x, y = minmax_downsample(h.lag.at_seconds, values)
        if len(x):
            _series(ax, _days(x), y, label, colour, style, 1.6, count, markers=len(x) < 60)
            count += 1
    _restarts(ax, h)
    _batch_axis(ax, h)
    ax.set_ylabel("watermark lag (seconds)")
    ax.set_ylim(bottom=0)
    _legend(ax, loc="upper left", fontsize=8)
    return Chart(
        "lag",
        "Watermark lag p50 / p95",
        "How far the watermark stayed behind batch time: the median and 95th percentile of the "
        "batches in each stretch of time; a rising line is a watermark falling behind.",
        _svg(fig, salt + "-lag"),
        count,
    )


def _late_per_batch(h: QueryHistory, salt: str) -> Chart:
    import numpy as np

    fig, ax = _figure()
    count = 0
    x, y = minmax_downsample(h.batch_at_seconds, h.rows_dropped)
    if len(x):
        _series(
            ax,
            _days(x),
            y,
            "dropped by Spark (groups for aggregations)",
            ORANGE,
            "-",
            1.4,
            count,
            markers=len(x) < 60,
        )
        count += 1
    if h.late_rows is not None and h.late_rows.batch_ids:
        at = h.times_of(h.late_rows.batch_ids)
        order = np.argsort(at, kind="stable")
        x, y = minmax_downsample(at[order], np.asarray(h.late_rows.late_rows, float)[order])
        if len(x):
            _series(
                ax,
                _days(x),
                y,
                "late rows audited",
                GREEN,
                "--",
                1.4,
                count,
                markers=len(x) < 60,
                marker="s",
            )
            count += 1
    _restarts(ax, h)
    _batch_axis(ax, h)
    ax.set_ylabel("rows per batch")
    ax.set_ylim(bottom=0)
    if count:
        _legend(ax, loc="upper left", fontsize=8)
    return Chart(
        "late_per_batch",
        "Late rows per batch",
        "Rows the watermark dropped in each batch: Spark's own count (late groups for "
        "aggregations) and the input rows wmwatch's audit found behind the watermark.",
        _svg(fig, salt + "-late"),
        count,
    )


def _histogram(h: QueryHistory, late_rows: Mapping[str, Any] | None, salt: str) -> Chart | None:
    audit = h.late_rows
    if audit is None or not (audit.lateness or audit.needed):
        return None
    fig, ax = _figure()
    bins = sorted(set(audit.lateness) | set(audit.needed))
    edges = [bin_edges_seconds(i) for i in range(bins[0], bins[-1] + 1)]
    lefts = [lo for lo, _ in edges]
    widths = [hi - lo for lo, hi in edges]
    counts = [audit.lateness.get(i, 0) for i in range(bins[0], bins[-1] + 1)]
    needed = [audit.needed.get(i, 0) for i in range(bins[0], bins[-1] + 1)]
    bars = ax.bar(
        lefts,
        counts,
        width=widths,
        align="edge",
        color=SKY,
        edgecolor=BLUE,
        lw=0.6,
        hatch="//",
        label="behind the watermark by",
    )
    bars.patches[0].set_gid("series-0")  # one id for the bars: the test counts series
    steps_x = [*lefts, edges[-1][1]]
    (line,) = ax.step(
        steps_x,
        [*needed, needed[-1]],
        where="post",
        color=BLACK,
        lw=1.6,
        label="more watermark delay needed to keep it",
    )
    line.set_gid("series-1")
    ax.set_xscale("log")
    top = max(max(counts), max(needed), 1)
    late = late_rows or {}
    for share, key, colour, style in (
        ("95%", "extra_delay_p95_seconds", ORANGE, "--"),
        ("99%", "extra_delay_p99_seconds", VERMILLION, ":"),
    ):
        value = late.get(key)
        if value is None:
            continue
        where = max(float(value), bin_edges_seconds(bins[0])[0])
        ax.axvline(
            where,
            color=colour,
            ls=style,
            lw=2,
            label=f"delay advice: +{_short(value)} keeps {share}",
        )
    ax.set_xlabel("seconds (log scale; the first bar holds 0.1 s and less)")
    ax.set_ylabel("late rows")
    ax.set_ylim(top=top * 1.3)  # room for the legend above the bars
    _legend(ax, loc="upper left", fontsize=8, ncols=2)
    return Chart(
        "histogram",
        "How late the late rows were",
        "Audited late rows by how far behind the watermark they arrived (bars) and by how much "
        "more watermark delay would have kept them (line); the dashed lines are the delay "
        "advice: that much more delay keeps 95% / 99% of them.",
        _svg(fig, salt + "-histogram"),
        2,
    )


def _state(h: QueryHistory, findings: Sequence[Mapping[str, Any]], salt: str) -> list[Chart]:
    import numpy as np

    if not h.operators:
        return []
    unbounded: dict[int, list[str]] = {}
    for finding in findings:
        if finding.get("kind") == "join_state_unbounded" and finding.get("operator_id") is not None:
            sides = unbounded.setdefault(int(finding["operator_id"]), [])
            if finding.get("side"):
                sides.append(str(finding["side"]))
    budgets: dict[int, JoinBudget] = {
        b.operator_id: b for b in (h.watermarks.budgets if h.watermarks else [])
    }
    charts = []
    for key, title, unit, explanation in (
        (
            "state_rows",
            "State rows per stateful operator",
            "state rows",
            "Rows each stateful operator keeps in its state store; a line that only climbs is "
            "state that is never cleaned (joins marked unbounded by a finding are drawn thick).",
        ),
        (
            "state_memory",
            "State memory per stateful operator",
            "state memory",
            "Memory each stateful operator's state store uses; with a state budget, the horizontal "
            "line is the budget and the legend says when a growing join reaches it.",
        ),
    ):
        fig, ax = _figure()
        scale, suffix = (1.0, "") if key == "state_rows" else _byte_scale(h)
        for index, op in enumerate(h.operators):
            values = op.rows if key == "state_rows" else op.memory_bytes / scale
            label = f"operator {op.operator_id} {op.operator_name or ''}".rstrip()
            width, colour = 1.4, CYCLE[index % len(CYCLE)]
            if op.operator_id in unbounded:
                named = " and ".join(sorted(set(unbounded[op.operator_id]))) or "state"
                label += f": join {named} side{'s' if ' and ' in named else ''} unbounded"
                width, colour = 2.6, VERMILLION
            budget = budgets.get(op.operator_id)
            if budget is not None and key == "state_memory":
                label += (
                    f"; budget {_bytes(budget.state_budget_bytes)} reached in "
                    f"~{_short(budget.seconds_to_budget)}"
                )
            x, y = minmax_downsample(op.at_seconds, values)
            _series(
                ax,
                _days(x),
                y,
                label,
                colour,
                STYLES[index % len(STYLES)],
                width,
                index,
                markers=len(x) < 60,
            )
        if key == "state_memory":
            peak = max(float(np.nanmax(op.memory_bytes, initial=0)) for op in h.operators)
            for budget in budgets.values():
                if budget.state_budget_bytes > 5 * peak:
                    continue  # far away: the line would flatten the series; the legend says it
                ax.axhline(
                    budget.state_budget_bytes / scale,
                    color=BLACK,
                    ls=(0, (6, 3)),
                    lw=1,
                    label=f"state budget {budget.state_budget_bytes / scale:,.1f}{suffix}",
                )
        _restarts(ax, h)
        _batch_axis(ax, h)
        ax.set_ylabel(f"{unit}{f' ({suffix.strip()})' if suffix else ' (rows)'}")
        ax.set_ylim(bottom=0)
        _legend(ax, loc="upper left", fontsize=8)
        charts.append(Chart(key, title, explanation, _svg(fig, f"{salt}-{key}"), len(h.operators)))
    return charts


def _inputs(h: QueryHistory, salt: str) -> Chart | None:
    import numpy as np

    inputs: list[InputSeries] = h.watermarks.inputs if h.watermarks else []
    if not inputs:
        return None
    fig, ax = _figure()
    count = 0
    for index, series in enumerate(inputs):
        at = h.times_of(series.batch_ids)
        colour = CYCLE[index % len(CYCLE)]
        name = _source_name(series.source)
        wm = np.array([np.nan if v is None else v for v in series.watermark_seconds], float)
        mx = np.array([np.nan if v is None else v for v in series.event_time_max_seconds], float)
        wm = np.where(wm > 0, wm, np.nan)
        for label, values, style, width in (
            (f"{name}: watermark", wm, STYLES[index % len(STYLES)], 1.8),
            (f"{name}: max event time", mx, ":", 1.0),
        ):
            x, y = minmax_downsample(at, values)
            _series(ax, _days(x), _days(y), label, colour, style, width, count)
            count += 1
        back = np.asarray(series.holding_back, bool) & ~np.isnan(wm) & ~np.isnan(at)
        if back.any():
            picked = np.flatnonzero(back)
            picked = picked[
                np.linspace(0, len(picked) - 1, min(len(picked), MAX_MARKERS)).astype(int)
            ]
            bx, by = at[picked], wm[picked]
            ax.plot(
                _days(bx),
                _days(by),
                ls="none",
                marker="v",
                ms=6,
                color=colour,
                markeredgecolor=BLACK,
                label=f"{name} held the global watermark back",
            )
    glob = np.where(h.watermark_seconds > 0, h.watermark_seconds, np.nan)
    x, y = minmax_downsample(h.batch_at_seconds, glob)
    _series(ax, _days(x), _days(y), "global watermark", BLACK, "-", 2.4, count)
    count += 1
    _batch_axis(ax, h)
    _time_axis(ax, "y", "event time (UTC)")
    policy = h.watermarks.policy if h.watermarks else None
    _legend(
        ax,
        loc="upper left",
        fontsize=7,
        ncols=2,
        title=f"multipleWatermarkPolicy = {policy}" if policy else None,
        title_fontsize=7,
    )
    return Chart(
        "inputs",
        "Watermark per input",
        "Each withWatermark input's own watermark and max event time, and the global watermark "
        "Spark used; triangles mark the batches in which that input held the global watermark "
        "back.",
        _svg(fig, salt + "-inputs"),
        count,
    )


# -- drawing helpers ------------------------------------------------------------------------------


@contextmanager
def _style() -> Iterator[None]:
    import matplotlib

    with matplotlib.rc_context(
        {
            "svg.fonttype": "none",
            "font.family": "sans-serif",
            "font.size": 9,
            "axes.grid": True,
            "grid.color": "#e6e6e6",
            "axes.spines.top": False,
            "axes.spines.right": False,
            "path.simplify": True,
            # mathtext stays on: the log axis draws its ticks with it (10 with a superscript);
            # text from the history is kept out of it where it is drawn (see _legend)
            "text.usetex": False,
        }
    ):
        yield


def _figure() -> tuple[Figure, Axes]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.6, 3.4), dpi=100, layout="constrained")
    return fig, fig.add_subplot()


def _series(
    ax: Axes,
    x: Any,
    y: Any,
    label: str,
    colour: str,
    style: Any,
    width: float,
    index: int,
    *,
    markers: bool = False,
    marker: str = "o",
) -> None:
    (line,) = ax.plot(
        x,
        y,
        color=colour,
        ls=style,
        lw=width,
        label=label,
        marker=marker if markers else None,
        ms=3,
    )
    line.set_gid(f"series-{index}")


def _legend(ax: Axes, **options: Any) -> None:
    """A legend, when something is drawn with a label (matplotlib warns on an empty one).

    Legends are where text from the history (operator, source and query names, the watermark
    policy) is drawn: each of their texts is taken literally, so "$a$" in a name is text, not
    TeX (mathtext would typeset it, or fail the whole page on "$\\frac$")."""
    if ax.get_legend_handles_labels()[0]:
        legend = ax.legend(**options)
        for text in (*legend.get_texts(), legend.get_title()):
            text.set_parse_math(False)


def _restarts(ax: Axes, h: QueryHistory) -> None:
    marks = h.restarts_at_seconds
    if not len(marks):
        return
    step = max(1, math.ceil(len(marks) / MAX_RESTART_MARKS))
    for i, at in enumerate(marks[::step]):
        ax.axvline(
            float(at) / 86400.0,
            color=PURPLE,
            ls=(0, (1, 2)),
            lw=1.2,
            label="restart (new run id)" if i == 0 else None,
        )


def _batch_axis(ax: Axes, h: QueryHistory) -> None:
    """Batch time on x, over exactly the batches in scope (one point would span years)."""
    _time_axis(ax, "x", "batch time (UTC)")
    if not len(h.batch_at_seconds):
        return  # no batch has a time: the chart has no series and is left out
    first, last = float(h.batch_at_seconds[0]), float(h.batch_at_seconds[-1])
    pad = max((last - first) * 0.02, 1.0)
    ax.set_xlim((first - pad) / 86400.0, (last + pad) / 86400.0)


def _time_axis(ax: Axes, which: str, label: str) -> None:
    import datetime as dt

    import matplotlib.dates as mdates

    axis = ax.xaxis if which == "x" else ax.yaxis
    locator = mdates.AutoDateLocator(tz=dt.UTC, maxticks=8)  # type: ignore[no-untyped-call]  # unannotated in matplotlib
    axis.set_major_locator(locator)
    formatter = mdates.ConciseDateFormatter(locator, tz=dt.UTC)  # type: ignore[no-untyped-call]  # unannotated in matplotlib
    axis.set_major_formatter(formatter)
    axis.axis_date(tz=dt.UTC)
    (ax.set_xlabel if which == "x" else ax.set_ylabel)(label)


def _days(seconds: Any) -> Any:
    """Epoch seconds as matplotlib date numbers (days since 1970-01-01 UTC)."""
    import numpy as np

    return np.asarray(seconds, dtype=np.float64) / 86400.0


def _byte_scale(h: QueryHistory) -> tuple[float, str]:
    import numpy as np

    peak = max((float(np.nanmax(op.memory_bytes, initial=0)) for op in h.operators), default=0)
    for scale, suffix in ((2.0**30, " GiB"), (2.0**20, " MiB"), (2.0**10, " KiB")):
        if peak >= scale:
            return scale, suffix
    return 1.0, " bytes"


def _bytes(size: float) -> str:
    for scale, suffix in ((2.0**30, "GiB"), (2.0**20, "MiB"), (2.0**10, "KiB")):
        if size >= scale:
            return f"{size / scale:,.1f} {suffix}"
    return f"{size:,.0f} bytes"


def _source_name(source: str) -> str:
    """``FileStreamSource[file:/data/in/clicks]`` as ``FileStreamSource[…/clicks]``."""
    head, bracket, rest = source.partition("[")
    if bracket and "/" in rest:
        return f"{head}[…/{rest.rsplit('/', 1)[1]}"
    return source if len(source) <= 48 else "…" + source[-47:]


def _short(seconds: float) -> str:
    value = float(seconds)
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.1f}s"


def _svg(fig: Figure, salt: str) -> str:
    import matplotlib

    out = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": salt}), warnings.catch_warnings():
        # a history of a few seconds is finer than the date locator's table: it falls back to
        # a usable tick interval and says so
        warnings.filterwarnings("ignore", "AutoDateLocator was unable", UserWarning)
        fig.savefig(out, format="svg", metadata={"Date": None})
    text = out.getvalue()
    # inline in HTML: drop the XML prolog, DOCTYPE and the RDF metadata, keep the drawing;
    # and the comments matplotlib writes before each text (its source: TeX for a log axis)
    text = text[text.index("<svg") :]
    text = re.sub(r"\s*<metadata>.*?</metadata>", "", text, count=1, flags=re.DOTALL)
    text = _COMMENT.sub("", text)
    # path data to 0.1 pt (a tenth of a pixel) and one line: about half the bytes
    return _PATH_DATA.sub(_round_path, text)


_PATH_DATA = re.compile(r'(?<= d=")[^"]*')
_COMMENT = re.compile(r"\s*<!--.*?-->", re.DOTALL)
_DECIMALS = re.compile(r"(-?\d+\.\d)\d+")


def _round_path(match: re.Match[str]) -> str:
    return _DECIMALS.sub(r"\1", " ".join(match.group(0).split()))
