"""End to end: a real Prometheus scrapes wmwatch while real streaming queries run, then every
dashboard expression and every alert rule is evaluated through Prometheus's HTTP API.

Two queries run side by side: ``e2e_windows`` (windowed count with a watermark, fed rows that
arrive after their window closed, audited; stopped and restarted on its checkpoint halfway, and
audited again) and ``e2e_join_nowm`` (stream-stream join without watermark, whose state only
grows). The rules are the generated ones with the short TEST profile, so alerts fire within
seconds. The test asserts:
- every scrape Prometheus took parsed (the target stayed up across the restart);
- every panel expression returns data (range queries over the run for time series, instant
  queries for stat panels), with Grafana's variables substituted as Grafana would;
- every alert rule's signal (its expression without the threshold) returns data;
- exactly the alerts this situation calls for are firing, and no others.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from dashboards import alerts, generate
from tests.harness.metrics import expressions, load, panels
from tests.harness.net import free_port
from tests.harness.streams import write_events
from tests.prom_servers import Prometheus, prometheus

pytestmark = [pytest.mark.spark, pytest.mark.prometheus]

WINDOWS = "e2e_windows"
JOIN = "e2e_join_nowm"
T0 = datetime(2026, 1, 1, tzinfo=UTC)
ROUNDS = 8
JOIN_ROWS_PER_SIDE = 40
RATE_INTERVAL = "10s"

# (alert, query, side): what must fire for this run, and nothing else
EXPECTED_FIRING = {
    # event times are in January 2026, so the watermark trails the clock by months
    ("WmwatchWatermarkLagHigh", WINDOWS, None),
    # rounds from the fourth on carry rows for windows the watermark already closed
    ("WmwatchRowsDroppedAsLate", WINDOWS, None),
    ("WmwatchJoinStateUnbounded", JOIN, "left"),
    ("WmwatchJoinStateUnbounded", JOIN, "right"),
    # 2 x 40 new keys a round, never evicted, against the test budget of 200 rows
    ("WmwatchStateRowsNearBudget", JOIN, None),
}


def iso(at: datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S.000Z")


def window_rows(round_index: int) -> list[dict[str, Any]]:
    base = T0 + timedelta(seconds=20 * round_index)
    rows = [{"ts": iso(base + timedelta(seconds=s)), "k": f"k{s}"} for s in (0, 3, 5)]
    if round_index >= 3:
        # its window [base - 100s, base - 90s) ended before even the watermark of two rounds ago
        # (max - 10s), whichever batch's watermark Spark filters late rows with
        rows.append({"ts": iso(base - timedelta(seconds=100)), "k": "late"})
    return rows


def join_rows(round_index: int) -> list[dict[str, Any]]:
    return [
        {"k": round_index * 1000 + j, "ts": iso(T0 + timedelta(seconds=round_index * 20 + j % 20))}
        for j in range(JOIN_ROWS_PER_SIDE)
    ]


def start_windowed(spark: Any, folder: Path) -> tuple[Any, Any]:
    from pyspark.sql import functions as F

    events = (
        spark.readStream.schema("ts TIMESTAMP, k STRING")
        .option("maxFilesPerTrigger", 1)
        .json(str(folder / "w"))
        .withWatermark("ts", "10 seconds")
    )
    windowed = (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.format("noop")  # restartable on its checkpoint, unlike the memory sink
        .queryName(WINDOWS)
        .outputMode("append")
        .option("checkpointLocation", str(folder / "cp_w"))
        .trigger(processingTime="300 milliseconds")
        .start()
    )
    return windowed, events


def start_queries(spark: Any, folder: Path) -> tuple[Any, Any, Any]:
    from pyspark.sql import functions as F

    for sub in ("w", "l", "r"):
        (folder / sub).mkdir()
    windowed, events = start_windowed(spark, folder)

    def side(name: str) -> Any:
        frame = spark.readStream.schema("k INT, ts TIMESTAMP").json(str(folder / name))
        return frame.select(F.col("k").alias(f"{name}k"), F.col("ts").alias(f"{name}ts"))

    joined = (
        side("l")
        .join(side("r"), F.expr("lk = rk"), "inner")
        .writeStream.format("noop")
        .queryName(JOIN)
        .option("checkpointLocation", str(folder / "cp_j"))
        .trigger(processingTime="300 milliseconds")
        .start()
    )
    return windowed, joined, events


def grafana_expr(expr: str, range_seconds: int) -> str:
    """Substitute Grafana's variables as Grafana would for "All" over both test queries."""
    return (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$__range", f"{range_seconds}s")
        .replace("$query", f"{WINDOWS}|{JOIN}")
    )


def firing(prom: Prometheus) -> set[tuple[str, str | None, str | None]]:
    """Firing alerts about this test's queries, or about wmwatch itself (no query label); a query
    another test left running on the shared session is not this test's business."""
    return {
        (a["labels"]["alertname"], a["labels"].get("query"), a["labels"].get("side"))
        for a in prom.alerts()
        if a["state"] == "firing" and a["labels"].get("query") in (None, WINDOWS, JOIN)
    }


def wait_until(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.5)


def test_every_panel_and_alert_works_against_a_real_prometheus(
    spark: Any, stream_dir: Path, tmp_path: Path
) -> None:
    import wmwatch

    rules_path = tmp_path / "wmwatch.test.rules.yml"
    rules_path.write_text(generate.rules_yaml(alerts.TEST))
    port = free_port()
    watch = wmwatch.attach(
        spark, db=str(stream_dir / "history.duckdb"), metrics_port=port,
        registry=CollectorRegistry(),
        strict=True,
    )  # fmt: skip
    windowed = joined = audit = None
    try:
        with prometheus(tmp_path, [f"127.0.0.1:{port}"], [rules_path]) as prom:
            started_at = time.time()
            windowed, joined, events = start_queries(spark, stream_dir)
            audit = watch.audit(windowed, events)
            for round_index in range(ROUNDS):
                if round_index == ROUNDS // 2:
                    # a restart on the same checkpoint, audited again: the scrape must stay
                    # one family per metric and the audit's counters one series
                    windowed.processAllAvailable()
                    assert audit.sync(60)
                    windowed.stop()
                    windowed, events = start_windowed(spark, stream_dir)
                    audit = watch.audit(windowed, events)
                write_events(stream_dir / "w", window_rows(round_index))
                write_events(stream_dir / "l", join_rows(round_index))
                write_events(stream_dir / "r", join_rows(round_index))
                time.sleep(1.5)
            windowed.processAllAvailable()
            joined.processAllAvailable()
            assert audit.sync(60)

            wait_until(
                lambda: {(a, q, s) for a, q, s in EXPECTED_FIRING} <= firing(prom),
                timeout=60,
                what=(
                    f"alerts {sorted(EXPECTED_FIRING, key=str)}; "
                    f"firing: {sorted(firing(prom), key=str)}"
                ),
            )
            # the ones that must stay quiet had the whole run to fire (for: up to 5s)
            unexpected = firing(prom) - EXPECTED_FIRING
            assert not unexpected, f"alerts firing that should not: {sorted(unexpected, key=str)}"

            end = time.time()
            range_seconds = int(end - started_at) + 1
            empty: list[str] = []
            evaluated = 0
            for uid in sorted(generate.DASHBOARDS):
                board = load(uid)
                for panel in panels(board):
                    for target in panel["targets"]:
                        expr = grafana_expr(target["expr"], range_seconds)
                        if target.get("instant"):
                            result = prom.query(expr)
                        else:
                            result = prom.query_range(expr, started_at, end, 1.0)
                        evaluated += 1
                        if not result:
                            empty.append(f"{uid} / {panel['title']}: {expr}")
            assert evaluated == sum(len(expressions(load(uid))) for uid in generate.DASHBOARDS)
            for rule in alerts.rules(alerts.TEST):
                evaluated += 1
                if not prom.query(rule.signal):
                    empty.append(f"rule {rule.alert}: {rule.signal}")
            assert not empty, "expressions without data:\n" + "\n".join(empty)

            targets = prom.targets()
            assert [t["health"] for t in targets] == ["up"], json.dumps(targets)[:2000]
            # every scrape of the run parsed, the ones after the restart included
            worst = prom.query(f"min_over_time(up[{range_seconds}s])")
            assert [float(r["value"][1]) for r in worst] == [1.0], worst
    finally:
        if audit is not None:
            audit.stop()
        for query in (windowed, joined):
            if query is not None:
                query.stop()
        watch.close()
