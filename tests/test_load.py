"""Load and long-run: wmwatch keeps up, stays bounded and records every batch exactly once.

Three scenarios, each printing its figures (run with ``-s`` or ``-rA`` to see them):

* 20 concurrent streaming queries in the shared local[2] session, with idle queries and a burst
  of restarts and terminations, watched end to end (py4j listener, worker, store, HTTP endpoint).
* The worker without Spark: several threads offer thousands of realistic progress events per
  second, to find the sustained events/s and check that memory and the queue stay bounded.
* A long history: 12,000 batches through the real Watch and HistoryStore, for the db size per
  1,000 batches, the effect of ``retention_days`` and the time of ``wmwatch report``.
"""

from __future__ import annotations

import gc
import json
import statistics
import threading
import time
import tracemalloc
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

import wmwatch
from tests.helpers import free_port, write_events
from tests.scripts.safety_support import NoQueriesSession, progress_event_json, rss_bytes
from wmwatch.cli import app


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _db_rows(db: Path, sql: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(sql, params or []).fetchall()


# ----------------------------------------------------------------------------- Spark load


@pytest.mark.spark
@pytest.mark.slow
def test_twenty_concurrent_queries_with_idle_and_terminations(spark: Any, tmp_path: Path) -> None:
    """20 queries in one session: bounded queue, flat memory, every batch once, fresh metrics."""
    from pyspark.sql import functions as F

    run_seconds = 180.0  # "several minutes"
    db = tmp_path / "load.duckdb"
    port = free_port()
    queries: list[Any] = []
    stopped: list[Any] = []

    def start_rate(index: int) -> Any:
        # the cheapest real micro-batch: a rate source into the noop sink
        frame = spark.readStream.format("rate").option("rowsPerSecond", 20).option("numPartitions", 1).load()
        return (
            frame.withColumn("bucket", F.col("value") % 7)
            .writeStream.format("noop").queryName(f"load_rate_{index:02d}")
            .trigger(processingTime="100 milliseconds")
            .option("checkpointLocation", str(tmp_path / "cp" / f"rate{index}"))
            .start()
        )

    def start_files(index: int) -> Any:
        # file queries that get one file and then go idle: onQueryIdle every second
        folder = tmp_path / f"in{index}"
        folder.mkdir()
        write_events(folder, [{"ts": "2026-01-01T00:00:01Z", "user": "a"}])
        frame = spark.readStream.schema("ts timestamp, user string").json(str(folder))
        return (
            frame.writeStream.format("noop").queryName(f"load_idle_{index:02d}")
            .trigger(processingTime="100 milliseconds")
            .option("checkpointLocation", str(tmp_path / "cp" / f"files{index}"))
            .start()
        )

    samples: list[dict[str, float]] = []
    # keep every progress of the run (default: the last 100) to compare with the history
    previous_recent = spark.conf.get("spark.sql.streaming.numRecentProgressUpdates")
    spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", "100000")
    try:
        _run_twenty(spark, tmp_path, db, port, queries, stopped, samples, run_seconds, start_rate, start_files)
    finally:
        spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", previous_recent)


def _run_twenty(spark: Any, tmp_path: Path, db: Path, port: int, queries: list[Any], stopped: list[Any],
                samples: list[dict[str, float]], run_seconds: float, start_rate: Any, start_files: Any) -> None:
    with wmwatch.attach(spark, db=str(db), metrics_port=port) as watch:
        assert watch.metrics_url is not None
        try:
            started_at = time.monotonic()
            for index in range(16):
                queries.append(start_rate(index))
            for index in range(4):
                queries.append(start_files(index))
            start_seconds = time.monotonic() - started_at
            events_before = sum(watch.health.copy()["processed"].values())  # type: ignore[attr-defined]
            begin = time.monotonic()
            restarted = False
            while time.monotonic() - begin < run_seconds:
                time.sleep(1.0)
                scraped = _scrape(watch.metrics_url)
                gc.collect()
                samples.append({
                    "t": time.monotonic() - begin,
                    "queue": scraped[("wmwatch_event_queue_size", ())],
                    "rss": float(rss_bytes()),
                    "pending": scraped[("wmwatch_store_pending_writes", ())],
                })
                if not restarted and time.monotonic() - begin > run_seconds / 2:
                    # a burst of terminations and starts in the middle of the run
                    restarted = True
                    for query in queries[:4]:
                        query.stop()
                        stopped.append(query)
                    queries = queries[4:] + [start_rate(16 + i) for i in range(4)]
            elapsed = time.monotonic() - begin
            events_during = sum(watch.health.copy()["processed"].values()) - events_before  # type: ignore[attr-defined]
        finally:
            for query in queries:
                query.stop()
        all_queries = stopped + queries
        # Spark's bus delivers asynchronously: the last progress comes before the termination
        deadline = time.monotonic() + 30
        while watch.health.copy()["received"].get("terminated", 0) < len(all_queries):  # type: ignore[attr-defined]
            assert time.monotonic() < deadline, "not every termination reached wmwatch"
            time.sleep(0.1)
        assert watch.flush(timeout=60)
        health = watch.health.copy()

        # the endpoint shows every query's last batch and that it stopped
        # Spark 4.3 also puts idle updates in recentProgress (the next batch id, no addBatch): they
        # are posted as onQueryIdle, not as progress, and no batch ran; keep the executed batches
        recent = {
            str(q.id): [p for p in q.recentProgress if "addBatch" in p["durationMs"]] for q in all_queries
        }
        final_scrape = _scrape(watch.metrics_url)
        for query in all_queries:
            label = (("query", query.name),)
            last_executed = recent[str(query.id)][-1]["batchId"]
            assert final_scrape[("wmwatch_last_batch_id", label)] == last_executed, query.name
            assert final_scrape[("wmwatch_query_up", label)] == 0
        names = {str(q.id): q.name for q in all_queries}

    assert health["dropped"] == {}
    assert health["errors"] == {}
    assert health["received"]["terminated"] >= 24  # type: ignore[index]
    assert health["received"].get("idle", 0) >= 4  # type: ignore[attr-defined]

    # every batch recorded exactly once, with Spark's own numbers
    total_batches = 0
    freshness: list[float] = []
    for query_id, progress in recent.items():
        assert progress, names[query_id]
        rows = _db_rows(
            db,
            "SELECT batch_id, input_rows, epoch_ms(recorded_at) FROM batches WHERE query_id = ? "
            "ORDER BY batch_id",
            [query_id],
        )
        ids = [r[0] for r in rows]
        assert ids == list(range(len(ids))), f"{names[query_id]}: gaps or duplicates"
        total_batches += len(ids)
        by_id = {r[0]: r for r in rows}
        for p in progress:
            row = by_id[p["batchId"]]
            assert row[1] == p["numInputRows"]
            ended_ms = datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp() * 1000
            freshness.append((row[2] - ended_ms - p["batchDuration"]) / 1000.0)
    assert _db_rows(db, "SELECT count(*) - count(DISTINCT (query_id, batch_id)) FROM batches") == [(0,)]

    queue_max = max(s["queue"] for s in samples)
    warm = [s["rss"] for s in samples if s["t"] > 15]
    rss_start = statistics.median(warm[:5])
    rss_end = statistics.median(warm[-5:])
    freshness.sort()
    p50 = freshness[len(freshness) // 2]
    p99 = freshness[int(len(freshness) * 0.99) - 1]
    print(
        f"\n[load/spark] 20 queries (16 rate + 4 idle file, 4 stopped and 4 started mid-run), "
        f"start of 20 took {start_seconds:.1f} s; {elapsed:.0f} s run: {events_during} events handled "
        f"({events_during / elapsed:.1f} events/s, {total_batches} batches in DuckDB); "
        f"queue max {queue_max:.0f}; store pending max {max(s['pending'] for s in samples):.0f}; "
        f"driver RSS after warm-up {rss_start / 1e6:.1f} MB -> end {rss_end / 1e6:.1f} MB; "
        f"batch end -> recorded on the worker p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms"
    )
    assert queue_max < 100
    assert rss_end - rss_start < 40e6
    assert p99 < 2.0  # 20 queries on 2 cores; one query at several batches/s: p99 42 ms (bench_core)


# ----------------------------------------------------------------------------- worker only


def _feeder(watch: Any, queries: list[str], start_batch: int, count: int, rate: float,
            offered: list[int]) -> None:
    """Offer ``count`` progress events per query at ``rate`` events/s (0: as fast as possible)."""
    payloads = [
        progress_event_json(q, b, name=q) for b in range(start_batch, start_batch + count) for q in queries
    ]
    begin = time.perf_counter()
    for index, payload in enumerate(payloads):
        if rate:
            due = begin + index / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        watch._events.offer("progress", payload)
    offered.append(len(payloads))


@pytest.mark.slow
def test_worker_sustains_thousands_of_events_per_second(tmp_path: Path) -> None:
    db = tmp_path / "worker.duckdb"
    with wmwatch.attach(NoQueriesSession(), db=str(db), metrics_port=free_port(), listener="stock") as watch:
        assert watch.metrics_url is not None
        threads_n, per_thread_queries = 4, 5
        names = [[f"w{t}_q{i}" for i in range(per_thread_queries)] for t in range(threads_n)]
        for group in names:
            for name in group:
                watch._events.offer("started", {"id": name, "runId": "run-1", "name": name})

        # Phase 1: a steady 1,000 events/s for 15 s (20 queries at 50 batches/s each).
        rate, seconds = 1000.0, 15.0
        per_query = int(rate * seconds / (threads_n * per_thread_queries))
        offered: list[int] = []
        queue_sizes: list[int] = []
        rss: list[tuple[float, int]] = []
        feeders = [
            threading.Thread(target=_feeder, args=(watch, group, 0, per_query, rate / threads_n, offered))
            for group in names
        ]
        begin = time.perf_counter()
        for thread in feeders:
            thread.start()
        while any(t.is_alive() for t in feeders):
            time.sleep(0.1)
            queue_sizes.append(watch._events.size())
            rss.append((time.perf_counter() - begin, rss_bytes()))
        steady_seconds = time.perf_counter() - begin
        assert watch.flush(timeout=60)
        drained_seconds = time.perf_counter() - begin
        health = watch.health.copy()
        assert health["dropped"] == {}
        assert health["processed"]["progress"] == sum(offered)  # type: ignore[index]
        scraped = _scrape(watch.metrics_url)
        assert scraped[("wmwatch_last_batch_id", (("query", "w0_q0"),))] == per_query - 1
        assert scraped[("wmwatch_event_queue_size", ())] == 0

        # Bursts of idle and terminated events on top (stopped queries are kept, then forgotten).
        for group in names:
            for name in group:
                for _ in range(50):
                    watch._events.offer("idle", {"id": name, "runId": "run-1", "timestamp": None})
                watch._events.offer("terminated", {"id": name, "runId": "run-1", "exception": None})
        assert watch.flush(timeout=30)
        assert watch.health.copy()["errors"] == {}

        # Phase 2: saturate: three threads offer as fast as they can, 30,000 events.
        before = watch.health.copy()
        offered2: list[int] = []
        burst = [threading.Thread(target=_feeder, args=(watch, [f"s{t}_q{i}" for i in range(5)], 0, 2000, 0.0,
                                                        offered2)) for t in range(3)]
        begin = time.perf_counter()
        for thread in burst:
            thread.start()
        max_queue = 0
        while any(t.is_alive() for t in burst) or watch._events.size():
            max_queue = max(max_queue, watch._events.size())
            time.sleep(0.01)
        assert watch.flush(timeout=120)
        burst_seconds = time.perf_counter() - begin
        after = watch.health.copy()
        handled = after["processed"]["progress"] - before["processed"]["progress"]  # type: ignore[index]
        dropped = after["dropped"].get("progress", 0) - before["dropped"].get("progress", 0)  # type: ignore[attr-defined]
        capacity = watch._events.capacity
    # nothing lost silently: every event offered was handled or counted as dropped
    assert handled + dropped == sum(offered2)
    assert max_queue <= capacity

    recorded = _db_rows(db, "SELECT count(*), count(DISTINCT (query_id, batch_id)) FROM batches WHERE query_id LIKE 'w%'")
    assert recorded == [(sum(offered), sum(offered))]
    warm = [v for t, v in rss if t > 3.0]
    growth = statistics.median(warm[-5:]) - statistics.median(warm[:5])
    print(
        f"\n[load/worker] steady {sum(offered)} events at {rate:.0f}/s from {threads_n} threads: "
        f"all handled and recorded once, drained {drained_seconds - steady_seconds:.2f} s after the "
        f"last offer, queue max {max(queue_sizes)}, RSS {statistics.median(warm[:5]) / 1e6:.1f} -> "
        f"{statistics.median(warm[-5:]) / 1e6:.1f} MB; saturated: {handled} handled in "
        f"{burst_seconds:.1f} s = {handled / burst_seconds:.0f} events/s sustained by the worker "
        f"(with DuckDB writes), {dropped} dropped and counted, queue max {max_queue}/{capacity}"
    )
    assert max(queue_sizes) < 500
    assert growth < 20e6


@pytest.mark.slow
def test_python_memory_is_flat_after_warm_up(tmp_path: Path) -> None:
    """tracemalloc over 20,000 events for 20 queries: what the worker keeps does not grow."""
    db = tmp_path / "mem.duckdb"
    with wmwatch.attach(NoQueriesSession(), db=str(db), metrics_port=free_port(), listener="stock") as watch:
        assert watch.metrics_url is not None
        queries = [f"m_q{i}" for i in range(20)]

        def feed(first: int, count: int) -> None:
            for b in range(first, first + count):
                for q in queries:
                    watch._events.offer("progress", progress_event_json(q, b, name=q))
                if b % 50 == 0:
                    assert watch.flush(timeout=30)
            assert watch.flush(timeout=30)
            _scrape(str(watch.metrics_url))  # scrapes are part of the steady state

        feed(0, 300)  # warm-up: 6,000 events
        gc.collect()
        tracemalloc.start()
        try:
            feed(300, 200)
            gc.collect()
            warm, _ = tracemalloc.get_traced_memory()
            feed(500, 500)
            gc.collect()
            end, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    print(f"\n[load/memory] Python heap traced after 10,000 events: {warm / 1e6:.2f} MB, after 20,000: "
          f"{end / 1e6:.2f} MB (growth {(end - warm) / 1e3:.0f} kB for 10,000 more events)")
    # a leak of even 100 bytes per event would show as 1 MB here
    assert end - warm < 500e3


# ----------------------------------------------------------------------------- long history


def _feed_history(watch: Any, batches_per_query: int, queries: list[str], first_at: datetime,
                  step: timedelta) -> None:
    for b in range(batches_per_query):
        for q in queries:
            watch._events.offer("progress", progress_event_json(q, b, name=q, at=first_at + b * step))
        if b % 250 == 249:
            assert watch.flush(timeout=60)
    assert watch.flush(timeout=60)


def _time_report(db: Path, *args: str) -> tuple[float, str]:
    runner = CliRunner()
    best = float("inf")
    output = ""
    for _ in range(3):
        begin = time.perf_counter()
        result = runner.invoke(app, ["report", "--db", str(db), *args])
        best = min(best, time.perf_counter() - begin)
        assert result.exit_code == 0, result.output
        output = result.output
    return best, output


@pytest.mark.slow
def test_ten_thousand_batches_stay_compact_and_report_stays_fast(tmp_path: Path) -> None:
    queries = [f"long_{i}" for i in range(4)]
    per_query = 3000  # 12,000 batches
    now = datetime.now(UTC)
    first_at = now - timedelta(days=30)
    step = timedelta(days=30) / per_query  # 30 days of history, oldest first

    full = tmp_path / "full.duckdb"
    begin = time.perf_counter()
    with wmwatch.attach(NoQueriesSession(), db=str(full), metrics_port=None, listener="stock") as watch:
        _feed_history(watch, per_query, queries, first_at, step)
    feed_seconds = time.perf_counter() - begin
    total = per_query * len(queries)
    assert _db_rows(full, "SELECT count(*), count(DISTINCT (query_id, batch_id)) FROM batches") == [(total, total)]
    full_bytes = full.stat().st_size
    report_seconds, text = _time_report(full, "--format", "json")
    summaries = json.loads(text)
    assert summaries  # a report, not an empty document
    table_seconds, _ = _time_report(full)

    # The same feed with retention_days=3: only the last 3 days stay, and the file stays small.
    kept = tmp_path / "kept.duckdb"
    with wmwatch.attach(NoQueriesSession(), db=str(kept), metrics_port=None, listener="stock",
                        retention_days=3) as watch:
        watch.store.retention_interval_seconds = 0.2  # as if the job ran for the 30 days
        _feed_history(watch, per_query, queries, first_at, step)
        time.sleep(0.5)
        assert watch.flush(timeout=30)
        watch.store._next_retention_at = 0.0  # one last pass before closing
        watch.store.flush_interval_seconds = 0.05
        time.sleep(0.5)
    oldest_kept = _db_rows(kept, "SELECT min(batch_at), count(*) FROM batches")[0]
    kept_bytes = kept.stat().st_size
    print(
        f"\n[long run] {total} batches through Watch+HistoryStore in {feed_seconds:.1f} s "
        f"({total / feed_seconds:.0f} batches/s); db {full_bytes / 1e6:.1f} MB = "
        f"{full_bytes / total * 1000 / 1e3:.0f} kB per 1,000 batches; wmwatch report (in-process, best "
        f"of 3) json {report_seconds * 1000:.0f} ms, table {table_seconds * 1000:.0f} ms; with "
        f"retention_days=3: {oldest_kept[1]} batches kept, file {kept_bytes / 1e6:.1f} MB"
    )
    assert report_seconds < 1.0 and table_seconds < 1.0
    assert oldest_kept[0] >= now - timedelta(days=3, minutes=5)
    assert oldest_kept[1] <= total * 3 / 30 + len(queries) * 2
    assert kept_bytes < full_bytes / 2
