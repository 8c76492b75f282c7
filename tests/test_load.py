"""Load and long-run: wmwatch keeps up, stays bounded and records every batch exactly once.

Three scenarios. Each asserts behaviour only (nothing lost, nothing recorded twice, the queue
bounded by its capacity, overflow counted, memory flat), never how fast the machine is: speed is
measured by ``benchmarks/bench_load.py`` and ``benchmarks/bench_report.py``. The figures a run
happens to reach are printed (run with ``-s`` or ``-rA`` to see them):

* 20 concurrent streaming queries in the shared local[2] session, with idle queries and a burst
  of restarts and terminations, watched end to end (py4j listener, worker, store, HTTP endpoint).
* The worker without Spark: several threads offer a thousand realistic progress events a second,
  then a burst larger than the queue while the worker is held: every event is handled once or
  counted as dropped.
* A long history: 12,000 batches through the real Watch and HistoryStore, for the db size per
  1,000 batches, the effect of ``retention_days`` and a ``wmwatch report`` over all of it.
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
from tests.harness.net import free_port
from tests.harness.streams import write_events
from tests.scripts.safety_support import NoQueriesSession, progress_event_json, rss_bytes
from wmwatch._core.plugins import WatchPlugin
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
@pytest.mark.slow(minutes=3.5)
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
        frame = (
            spark.readStream.format("rate")
            .option("rowsPerSecond", 20)
            .option("numPartitions", 1)
            .load()
        )
        return (
            frame.withColumn("bucket", F.col("value") % 7)
            .writeStream.format("noop")
            .queryName(f"load_rate_{index:02d}")
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
            frame.writeStream.format("noop")
            .queryName(f"load_idle_{index:02d}")
            .trigger(processingTime="100 milliseconds")
            .option("checkpointLocation", str(tmp_path / "cp" / f"files{index}"))
            .start()
        )

    samples: list[dict[str, float]] = []
    # keep every progress of the run (default: the last 100) to compare with the history
    previous_recent = spark.conf.get("spark.sql.streaming.numRecentProgressUpdates")
    spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", "100000")
    try:
        _run_twenty(
            spark,
            tmp_path,
            db,
            port,
            queries,
            stopped,
            samples,
            run_seconds,
            start_rate,
            start_files,
        )
    finally:
        spark.conf.set("spark.sql.streaming.numRecentProgressUpdates", previous_recent)


def _run_twenty(
    spark: Any,
    tmp_path: Path,
    db: Path,
    port: int,
    queries: list[Any],
    stopped: list[Any],
    samples: list[dict[str, float]],
    run_seconds: float,
    start_rate: Any,
    start_files: Any,
) -> None:
    with wmwatch.attach(spark, db=str(db), metrics_port=port) as watch:
        assert watch.metrics_url is not None
        try:
            started_at = time.monotonic()
            for index in range(16):
                queries.append(start_rate(index))
            for index in range(4):
                queries.append(start_files(index))
            start_seconds = time.monotonic() - started_at
            events_before = sum(watch.health.copy().processed.values())
            begin = time.monotonic()
            restarted = False
            while time.monotonic() - begin < run_seconds:
                time.sleep(1.0)
                scraped = _scrape(watch.metrics_url)
                gc.collect()
                samples.append(
                    {
                        "t": time.monotonic() - begin,
                        "queue": scraped[("wmwatch_event_queue_size", ())],
                        "rss": float(rss_bytes()),
                        "pending": scraped[("wmwatch_store_pending_writes", ())],
                    }
                )
                if not restarted and time.monotonic() - begin > run_seconds / 2:
                    # a burst of terminations and starts in the middle of the run
                    restarted = True
                    for query in queries[:4]:
                        query.stop()
                        stopped.append(query)
                    queries = queries[4:] + [start_rate(16 + i) for i in range(4)]
            elapsed = time.monotonic() - begin
            events_during = sum(watch.health.copy().processed.values()) - events_before
        finally:
            for query in queries:
                query.stop()
        all_queries = stopped + queries
        # Spark's bus delivers asynchronously: the last progress comes before the termination
        deadline = time.monotonic() + 300  # generous: a wait, not a speed bound
        while watch.health.copy().received.get("terminated", 0) < len(all_queries):
            assert time.monotonic() < deadline, "not every termination reached wmwatch"
            time.sleep(0.1)
        assert watch.flush(timeout=300)
        health = watch.health.copy()

        # the endpoint shows every query's last batch and that it stopped
        # Spark 4.3 also puts idle updates in recentProgress (the next batch id, no addBatch): they
        # are posted as onQueryIdle, not as progress, and no batch ran; keep the executed batches
        recent = {
            str(q.id): [p for p in q.recentProgress if "addBatch" in p["durationMs"]]
            for q in all_queries
        }
        final_scrape = _scrape(watch.metrics_url)
        capacity = final_scrape[("wmwatch_event_queue_capacity", ())]
        for query in all_queries:
            label = (("query", query.name),)
            last_executed = recent[str(query.id)][-1]["batchId"]
            assert final_scrape[("wmwatch_last_batch_id", label)] == last_executed, query.name
            assert final_scrape[("wmwatch_query_up", label)] == 0
        names = {str(q.id): q.name for q in all_queries}

    assert health.dropped == {}
    assert health.errors == {}
    assert health.received["terminated"] >= 24
    assert health.received.get("idle", 0) >= 4

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
            ended_ms = (
                datetime.fromisoformat(p["timestamp"].replace("Z", "+00:00")).timestamp() * 1000
            )
            freshness.append((row[2] - ended_ms - p["batchDuration"]) / 1000.0)
    assert _db_rows(db, "SELECT count(*) - count(DISTINCT (query_id, batch_id)) FROM batches") == [
        (0,)
    ]

    queue_max = max(s["queue"] for s in samples)
    warm = [s["rss"] for s in samples if s["t"] > 15]
    rss_start = statistics.median(warm[:5])
    rss_end = statistics.median(warm[-5:])
    freshness.sort()
    p50 = freshness[len(freshness) // 2]
    p99 = freshness[int(len(freshness) * 0.99) - 1]
    print(
        f"\n[load/spark] 20 queries (16 rate + 4 idle file, 4 stopped and 4 started mid-run), "
        f"start of 20 took {start_seconds:.1f} s; {elapsed:.0f} s run: "
        f"{events_during} events handled "
        f"({events_during / elapsed:.1f} events/s, {total_batches} batches in DuckDB); "
        f"queue max {queue_max:.0f}; store pending max {max(s['pending'] for s in samples):.0f}; "
        f"driver RSS after warm-up {rss_start / 1e6:.1f} MB -> end {rss_end / 1e6:.1f} MB; "
        f"batch end -> recorded on the worker p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms"
    )
    assert queue_max <= capacity
    assert rss_end - rss_start < 40e6


# ----------------------------------------------------------------------------- worker only


def _feeder(
    watch: Any, queries: list[str], start_batch: int, count: int, rate: float, offered: list[int]
) -> None:
    """Offer ``count`` progress events per query at ``rate`` events/s (0: as fast as possible)."""
    payloads = [
        progress_event_json(q, b, name=q)
        for b in range(start_batch, start_batch + count)
        for q in queries
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
def test_worker_handles_a_steady_feed_from_many_threads_exactly_once(tmp_path: Path) -> None:
    """20 queries at 50 batches/s each from 4 threads: every event handled and recorded once."""
    db = tmp_path / "worker.duckdb"
    threads_n, per_thread_queries = 4, 5
    rate, seconds = 1000.0, 15.0
    per_query = int(rate * seconds / (threads_n * per_thread_queries))
    # Room for the whole feed: however slow the machine, nothing may be dropped here (overflow
    # has a test of its own below).
    capacity = int(rate * seconds) + 1000
    with wmwatch.attach(
        NoQueriesSession(),
        db=str(db),
        metrics_port=free_port(),
        listener="stock",
        queue_capacity=capacity,
        retention_days=None,  # the synthetic batches are dated 2026-01-01: keep them all
    ) as watch:
        assert watch.metrics_url is not None
        names = [[f"w{t}_q{i}" for i in range(per_thread_queries)] for t in range(threads_n)]
        for group in names:
            for name in group:
                watch._events.offer("started", {"id": name, "runId": "run-1", "name": name})

        offered: list[int] = []
        queue_sizes: list[int] = []
        rss: list[tuple[float, int]] = []
        feeders = [
            threading.Thread(
                target=_feeder, args=(watch, group, 0, per_query, rate / threads_n, offered)
            )
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
        assert watch.flush(timeout=600)
        drained_seconds = time.perf_counter() - begin
        health = watch.health.copy()
        assert health.dropped == {}
        assert health.errors == {}
        assert (
            health.received["progress"]
            == sum(offered)
            == per_query * threads_n * per_thread_queries
        )
        assert health.processed["progress"] == sum(offered)
        scraped = _scrape(watch.metrics_url)
        for group in names:
            for name in group:
                assert scraped[("wmwatch_last_batch_id", (("query", name),))] == per_query - 1
                assert scraped[("wmwatch_batches_total", (("query", name),))] == per_query
        assert scraped[("wmwatch_event_queue_size", ())] == 0
        assert max(queue_sizes) <= capacity

        # Bursts of idle and terminated events on top (stopped queries are kept, then forgotten).
        for group in names:
            for name in group:
                for _ in range(50):
                    watch._events.offer("idle", {"id": name, "runId": "run-1", "timestamp": None})
                watch._events.offer("terminated", {"id": name, "runId": "run-1", "exception": None})
        assert watch.flush(timeout=600)
        after = watch.health.copy()
        assert after.errors == {}
        assert after.dropped == {}
        assert after.processed == after.received
        scraped = _scrape(watch.metrics_url)
        assert scraped[("wmwatch_query_up", (("query", "w0_q0"),))] == 0

    recorded = _db_rows(
        db,
        "SELECT count(*), count(DISTINCT (query_id, batch_id)) FROM batches "
        "WHERE query_id LIKE 'w%'",
    )
    assert recorded == [(sum(offered), sum(offered))]
    warm = [v for t, v in rss if t > 3.0] or [v for _, v in rss]
    print(
        f"\n[load/worker] steady {sum(offered)} events at {rate:.0f}/s "
        f"from {threads_n} threads: all handled and recorded once, "
        f"drained {drained_seconds - steady_seconds:.2f} s after the last offer, "
        f"queue max {max(queue_sizes)}, "
        f"RSS after warm-up {statistics.median(warm[:5]) / 1e6:.1f} -> "
        f"{statistics.median(warm[-5:]) / 1e6:.1f} MB "
        f"(events/s this machine sustains: benchmarks/bench_load.py)"
    )


class HoldFirstProgress(WatchPlugin):
    """Holds the worker in its first progress event until released: the queue behind it fills."""

    name = "hold"

    def __init__(self) -> None:
        self.holding = threading.Event()
        self.release = threading.Event()

    def on_progress(self, snapshot: Any) -> None:
        if not self.holding.is_set():
            self.holding.set()
            self.release.wait(timeout=300)


@pytest.mark.slow
def test_a_full_queue_drops_and_counts_and_never_blocks_the_listener(tmp_path: Path) -> None:
    """Three threads offer 6,000 events while the worker is stuck: the queue fills to its capacity
    and no further, the offers never wait, every event is handled once or counted as dropped."""
    db = tmp_path / "overflow.duckdb"
    capacity = 100
    holder = HoldFirstProgress()
    with wmwatch.attach(
        NoQueriesSession(),
        db=str(db),
        metrics_port=None,
        listener="stock",
        queue_capacity=capacity,
        plugins=[holder],
        retention_days=None,  # the synthetic batches are dated 2026-01-01: keep them all
        inspect_plans=False,
    ) as watch:
        watch._events.offer("progress", progress_event_json("first", 0, name="first"))
        assert holder.holding.wait(timeout=60)

        offered: list[int] = []
        groups = [[f"s{t}_q{i}" for i in range(5)] for t in range(3)]
        burst = [
            threading.Thread(target=_feeder, args=(watch, group, 0, 400, 0.0, offered))
            for group in groups
        ]
        max_queue = 0
        for thread in burst:
            thread.start()
        while any(t.is_alive() for t in burst):
            max_queue = max(max_queue, watch._events.size())
            time.sleep(0.001)
        for thread in burst:
            thread.join(timeout=300)
        # the listener side never waited on the stuck worker: every offer returned
        assert sum(offered) == 3 * 5 * 400
        assert watch._events.size() == capacity and max_queue <= capacity
        held = watch.health.copy()
        assert held.received["progress"] == 1 + sum(offered)
        assert held.dropped["progress"] == sum(offered) - capacity

        holder.release.set()
        assert watch.flush(timeout=600)
        health = watch.health.copy()
        dropped_metric = watch.registry.get_sample_value(
            "wmwatch_events_dropped_total", {"kind": "progress"}
        )
    processed = health.processed["progress"]
    dropped = health.dropped["progress"]
    assert processed == 1 + capacity
    assert processed + dropped == health.received["progress"]
    assert dropped_metric == dropped
    assert health.errors == {}
    recorded = _db_rows(db, "SELECT count(*), count(DISTINCT (query_id, batch_id)) FROM batches")
    assert recorded == [(processed, processed)]


@pytest.mark.slow
def test_python_memory_is_flat_after_warm_up(tmp_path: Path) -> None:
    """tracemalloc over 20,000 events for 20 queries: what the worker keeps does not grow."""
    db = tmp_path / "mem.duckdb"
    with wmwatch.attach(
        NoQueriesSession(), db=str(db), metrics_port=free_port(), listener="stock"
    ) as watch:
        assert watch.metrics_url is not None
        queries = [f"m_q{i}" for i in range(20)]

        def feed(first: int, count: int) -> None:
            for b in range(first, first + count):
                for q in queries:
                    watch._events.offer("progress", progress_event_json(q, b, name=q))
                if b % 50 == 0:
                    assert watch.flush(timeout=300)
            assert watch.flush(timeout=300)
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
    print(
        f"\n[load/memory] Python heap traced after 10,000 events: {warm / 1e6:.2f} MB, "
        "after 20,000: "
        f"{end / 1e6:.2f} MB (growth {(end - warm) / 1e3:.0f} kB for 10,000 more events)"
    )
    # a leak of even 100 bytes per event would show as 1 MB here
    assert end - warm < 500e3


# ----------------------------------------------------------------------------- long history


def _feed_history(
    watch: Any,
    batches_per_query: int,
    queries: list[str],
    first_at: datetime,
    step: timedelta,
    *,
    retention_each_flush: bool = False,
) -> None:
    for b in range(batches_per_query):
        for q in queries:
            watch._events.offer(
                "progress", progress_event_json(q, b, name=q, at=first_at + b * step)
            )
        if b % 250 == 249:
            assert watch.flush(timeout=300)
            if retention_each_flush:
                # as if the job ran for the 30 days: a retention pass in the writer's next cycle,
                # after every 1,000 batches however fast they came
                watch.store._next_retention_at = 0.0
    assert watch.flush(timeout=300)


def _report(db: Path, *args: str) -> tuple[float, str]:
    """Run ``wmwatch report`` through the real CLI; its time is printed, never asserted."""
    begin = time.perf_counter()
    result = CliRunner().invoke(app, ["report", "--db", str(db), *args])
    seconds = time.perf_counter() - begin
    assert result.exit_code == 0, result.output
    return seconds, result.output


@pytest.mark.slow
def test_ten_thousand_batches_stay_compact_and_report_covers_them_all(tmp_path: Path) -> None:
    queries = [f"long_{i}" for i in range(4)]
    per_query = 3000  # 12,000 batches
    now = datetime.now(UTC)
    first_at = now - timedelta(days=30)
    step = timedelta(days=30) / per_query  # 30 days of history, oldest first

    full = tmp_path / "full.duckdb"
    begin = time.perf_counter()
    with wmwatch.attach(
        NoQueriesSession(), db=str(full), metrics_port=None, listener="stock", retention_days=None
    ) as watch:
        _feed_history(watch, per_query, queries, first_at, step)
    feed_seconds = time.perf_counter() - begin
    total = per_query * len(queries)
    assert _db_rows(full, "SELECT count(*), count(DISTINCT (query_id, batch_id)) FROM batches") == [
        (total, total)
    ]
    full_bytes = full.stat().st_size
    report_seconds, text = _report(full, "--format", "json")
    summaries = {q["query"]: q for q in json.loads(text)["queries"]}
    assert sorted(summaries) == queries
    for name in queries:
        assert summaries[name]["batches"] == per_query
        assert summaries[name]["last_batch_id"] == per_query - 1
    table_seconds, table = _report(full)
    assert all(name in table for name in queries)

    # The same feed with retention_days=3: only the last 3 days stay, and the file stays small.
    kept = tmp_path / "kept.duckdb"
    with wmwatch.attach(
        NoQueriesSession(), db=str(kept), metrics_port=None, listener="stock", retention_days=3
    ) as watch:
        _feed_history(watch, per_query, queries, first_at, step, retention_each_flush=True)
        # one last pass: a read runs after the writes and the retention of the writer's next cycle
        watch.store._next_retention_at = 0.0
        oldest_kept = watch.store.read(
            lambda con: con.execute("SELECT min(batch_at), count(*) FROM batches").fetchone(),
            timeout=300,
        )
    kept_bytes = kept.stat().st_size
    print(
        f"\n[long run] {total} batches through Watch+HistoryStore in {feed_seconds:.1f} s "
        f"({total / feed_seconds:.0f} batches/s); db {full_bytes / 1e6:.1f} MB = "
        f"{full_bytes / total * 1000 / 1e3:.0f} kB per 1,000 batches; wmwatch report (in-process) "
        f"json {report_seconds * 1000:.0f} ms, table {table_seconds * 1000:.0f} ms; with "
        f"retention_days=3: {oldest_kept[1]} batches kept, file {kept_bytes / 1e6:.1f} MB"
    )
    assert oldest_kept[0] >= now - timedelta(days=3, minutes=5)
    assert oldest_kept[1] <= total * 3 / 30 + len(queries) * 2
    assert kept_bytes < full_bytes / 2
