"""A query stopped and restarted on its checkpoint, audited in each run, in one driver.

What a notebook or a retry loop does: the scrape must stay valid Prometheus text (one HELP and
TYPE per family, one sample per series), the audit's counters must continue as one series, the
first run's audit must end with its run, and the second must resume from the checkpoint.
"""

from __future__ import annotations

import shutil
import subprocess
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import wmwatch
from tests.harness.net import free_port
from tests.harness.streams import ts, write_events

pytestmark = pytest.mark.spark

NAME = "rq"


def start(spark: Any, folder: Path) -> tuple[Any, Any]:
    from pyspark.sql import functions as F

    events = (
        spark.readStream.schema("id int, user string, ts timestamp")
        .option("maxFilesPerTrigger", 1)
        .json(str(folder / "in"))
        .withWatermark("ts", "10 seconds")
    )
    query = (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.format("noop")
        .outputMode("append")
        .queryName(NAME)
        .option("checkpointLocation", str(folder / "checkpoint"))
        .start()
    )
    return query, events


def feed(folder: Path, query: Any, rows: list[tuple[int, int]]) -> None:
    for row_id, second in rows:
        write_events(folder / "in", [{"id": row_id, "user": "u", "ts": ts(second)}])
        query.processAllAvailable()


def strict_families(text: str) -> dict[str, Any]:
    """Parse like Prometheus would: a family announced twice, or a series repeated, is an error."""
    helps = Counter(line.split()[2] for line in text.splitlines() if line.startswith("# HELP "))
    repeated = {name: n for name, n in helps.items() if n > 1}
    assert not repeated, f"second HELP line for {repeated}"
    families: dict[str, Any] = {}
    series: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()
    for family in text_string_to_metric_families(text):
        families[family.name] = family
        for sample in family.samples:
            series[(sample.name, tuple(sorted(sample.labels.items())))] += 1
    twice = [key for key, n in series.items() if n > 1]
    assert not twice, f"series exported twice: {twice[:5]}"
    return families


def value(families: dict[str, Any], sample_name: str, **labels: str) -> float | None:
    for family in families.values():
        for sample in family.samples:
            if sample.name == sample_name and sample.labels == labels:
                return float(sample.value)
    return None


def test_restarted_and_reaudited_query_keeps_one_valid_scrape(spark: Any, stream_dir: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is needed (Debian package prometheus); .ci/run installs it")
    port = free_port()
    db = stream_dir / "history.duckdb"
    watch = wmwatch.attach(spark, db=str(db), metrics_port=port, registry=CollectorRegistry())
    try:
        query, events = start(spark, stream_dir)
        first = watch.audit(query, events, poll_interval_seconds=0.2)
        # watermark -> 15 s; then one row whose window [0, 10) has closed
        feed(stream_dir, query, [(1, 1), (2, 25), (3, 3)])
        assert first.sync(60)
        query.stop()
        # the first run's audit ends with its run: it audits what the run committed, then stops
        first_status = first.status()
        assert first_status["late_rows"] == 1, first_status
        _wait(lambda: not first.status()["running"], "the first run's audit to end")

        query, events = start(spark, stream_dir)
        second = watch.audit(query, events, poll_interval_seconds=0.2)
        feed(stream_dir, query, [(4, 40), (5, 12)])  # watermark -> 30 s; ts 12's window closed
        assert second.sync(60)
        assert watch.flush(30)

        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        query.stop()
        watch.close()

    families = strict_families(text)
    assert value(families, "wmwatch_late_rows_audited_total", query=NAME) == 2.0
    assert value(families, "wmwatch_audit_errors_total", query=NAME) == 0.0
    assert value(families, "wmwatch_audit_lag_batches", query=NAME) == 0.0  # the running audit
    checked = subprocess.run(
        [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    # promtool exits 1 for lint advice as well; a parse error is what makes Prometheus drop
    # the whole scrape
    assert "error while linting" not in checked.stderr and "parsing error" not in checked.stderr, (
        checked.stderr
    )

    with duckdb.connect(str(db), read_only=True) as con:
        late = con.execute(
            "SELECT json_extract(row_data, '$.id')::INT, batch_id FROM late_rows ORDER BY 1"
        ).fetchall()
        marks = con.execute("SELECT batch_id FROM audit_batches ORDER BY 1").fetchall()
    assert [row_id for row_id, _ in late] == [3, 5]  # each run's late row, once
    batch_ids = [b for (b,) in marks]
    assert batch_ids == sorted(set(batch_ids))  # resumed from the checkpoint, nothing audited twice


def _wait(condition: Any, what: str, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)
