"""Benchmark: ``wmwatch report`` over a history of 100,000 batches (target: under 1 s).

Builds a synthetic but realistic history file with DuckDB SQL (4 queries, one stateful operator
and one file source per batch, a progress JSON of Spark's size per batch, audited late rows and
findings), then times the report in-process through the CLI (CliRunner, each format) and once as
a subprocess (``python -m wmwatch.cli``: interpreter start-up and imports included).

    python benchmarks/bench_report.py [--batches 100000] [--runs 5] [--keep path.duckdb]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import duckdb
from _machine import print_machine

from wmwatch._store.writer import HistoryStore

TARGET_SECONDS = 1.0

# A progress document shaped like Spark 4.3's for a windowed aggregation over files.
_PROGRESS_SQL = """
'{"id":"' || q.query_id || '","runId":"' || q.run_id || '","name":"' || q.name ||
'","timestamp":"' || strftime(b.batch_at, '%Y-%m-%dT%H:%M:%S.%g') || 'Z","batchId":' || b.i ||
',"batchDuration":' || (200 + b.i % 300) || ',"numInputRows":' || b.input_rows ||
',"inputRowsPerSecond":' || round(b.input_rows / 2.0, 1) ||
',"processedRowsPerSecond":' || round(b.input_rows / 0.4, 1) ||
',"durationMs":{"addBatch":' || (150 + b.i % 250) || ',"commitOffsets":12,"getBatch":3,' ||
'"latestOffset":9,"queryPlanning":21,"triggerExecution":' || (200 + b.i % 300) ||
',"walCommit":14},' ||
'"eventTime":{"avg":"' ||
strftime(b.watermark_at + INTERVAL 40 SECOND, '%Y-%m-%dT%H:%M:%S.%g') ||
'Z","max":"' || strftime(b.watermark_at + INTERVAL 60 SECOND, '%Y-%m-%dT%H:%M:%S.%g') ||
'Z","min":"' || strftime(b.watermark_at - INTERVAL 5 SECOND, '%Y-%m-%dT%H:%M:%S.%g') ||
'Z","watermark":"' || strftime(b.watermark_at, '%Y-%m-%dT%H:%M:%S.%g') || 'Z"},' ||
'"stateOperators":[{"operatorName":"stateStoreSave","numRowsTotal":' || b.state_rows ||
',"numRowsUpdated":' || (b.input_rows % 50) ||
',"allUpdatesTimeMs":4,"numRowsRemoved":' || (b.i % 7) ||
',"allRemovalsTimeMs":1,"commitTimeMs":38,"memoryUsedBytes":' || b.state_bytes ||
',"numRowsDroppedByWatermark":' || b.dropped ||
',"numShufflePartitions":2,"numStateStoreInstances":2,' ||
'"customMetrics":{"loadedMapCacheHitCount":' || (b.i * 2) || ',"loadedMapCacheMissCount":0,' ||
'"stateOnCurrentVersionSizeBytes":' || (b.state_bytes / 2)::BIGINT || '}}],' ||
'"sources":[{"description":"FileStreamSource[file:/data/events/' || q.name ||
']","startOffset":{"logOffset":' ||
b.i || '},"endOffset":{"logOffset":' || (b.i + 1) || '},"latestOffset":null,"numInputRows":' ||
b.input_rows || ',"inputRowsPerSecond":' || round(b.input_rows / 2.0, 1) ||
',"processedRowsPerSecond":' || round(b.input_rows / 0.4, 1) || '}],' ||
'"sink":{"description":"FileSink[file:/data/out/' || q.name || ']","numOutputRows":-1}}'
"""


def build_history(path: Path, *, batches: int, queries: int = 4) -> None:
    """Write a migrated history with ``batches`` batches spread over ``queries`` queries."""
    HistoryStore(path).close()  # creates and migrates the schema the way wmwatch does
    per_query = batches // queries
    con = duckdb.connect(str(path))
    try:
        con.execute("SET TimeZone = 'UTC'")
        con.execute(
            f"""
            CREATE TEMP TABLE q AS
            SELECT 'q' || lpad(n::VARCHAR, 3, '0') || '-5d2c-4f0e-9a55-0c3f2b1e7a' || n AS query_id,
                   'run-' || n AS run_id, 'events_per_window_' || n AS name, n
            FROM range({queries}) t(n)
            """
        )
        con.execute(
            f"""
            CREATE TEMP TABLE b AS
            SELECT q.query_id, i,
                   TIMESTAMPTZ '2026-01-01 00:00:00+00' + to_seconds(i * 2.0) AS batch_at,
                   TIMESTAMPTZ '2026-01-01 00:00:00+00'
                       + to_seconds(i * 2.0 - 600 - (i % 37)) AS watermark_at,
                   (100 + hash(i, q.n) % 900)::BIGINT AS input_rows,
                   (1000 + i // 10 + hash(q.n, i) % 50)::BIGINT AS state_rows,
                   (1000000 + i * 10 + hash(i) % 4096)::BIGINT AS state_bytes,
                   (CASE WHEN hash(i, q.n, 7) % 20 = 0 THEN 1 + hash(i) % 5 ELSE 0 END)::BIGINT
                       AS dropped
            FROM q, range({per_query}) r(i)
            """
        )
        con.execute("BEGIN")
        con.execute(
            f"""
            INSERT INTO batches
            SELECT b.query_id, b.i, q.run_id, q.name, b.batch_at, b.watermark_at,
                   b.watermark_at - INTERVAL 2 SECOND,
                   b.watermark_at + INTERVAL 60 SECOND, b.watermark_at - INTERVAL 5 SECOND,
                   b.watermark_at + INTERVAL 40 SECOND,
                   epoch(b.batch_at) - epoch(b.watermark_at), 60.0,
                   b.input_rows, b.input_rows / 2.0, b.input_rows / 0.4, (200 + b.i % 300) / 1000.0,
                   '{{"addBatch": 0.2, "getBatch": 0.003, "walCommit": 0.014}}',
                   b.dropped, b.state_rows, b.state_bytes, NULL,
                   {_PROGRESS_SQL}, b.batch_at + INTERVAL 1 SECOND
            FROM b JOIN q USING (query_id)
            """
        )
        con.execute(
            """
            INSERT INTO operators
            SELECT query_id, i, 0, 'stateStoreSave', state_rows, input_rows % 50, i % 7, dropped,
                   state_bytes, 2, 2, '{"loadedMapCacheHitCount": 2}'
            FROM b
            """
        )
        con.execute(
            """
            INSERT INTO sources
            SELECT b.query_id, b.i, 0, 'FileStreamSource[file:/data/events/' || q.name || ']',
                   '{"logOffset":' || b.i || '}', '{"logOffset":' || (b.i + 1) || '}',
                   b.input_rows, b.input_rows / 2.0, b.input_rows / 0.4
            FROM b JOIN q USING (query_id)
            """
        )
        con.execute(
            """
            INSERT INTO queries
            SELECT query_id, run_id, name, CASE WHEN n = 1 THEN 'failed' ELSE 'active' END,
                   TIMESTAMPTZ '2026-01-01 00:00:00+00', NULL,
                   CASE WHEN n = 1 THEN 'java.lang.IllegalStateException: boom' END,
                   NULL, NULL, NULL
            FROM q
            """
        )
        # Late rows: one per dropped group, a few seconds to minutes behind the watermark.
        con.execute(
            """
            INSERT INTO late_rows
            SELECT b.query_id, q.name, q.run_id, b.i,
                   b.watermark_at - to_seconds(1 + hash(b.i, 3) % 300),
                   b.watermark_at - INTERVAL 2 SECOND,
                   epoch(b.watermark_at)
                       - epoch(b.watermark_at - to_seconds(1 + hash(b.i, 3) % 300)),
                   time_bucket(
                       INTERVAL 1 MINUTE, b.watermark_at - to_seconds(1 + hash(b.i, 3) % 300)
                   ),
                   time_bucket(
                       INTERVAL 1 MINUTE, b.watermark_at - to_seconds(1 + hash(b.i, 3) % 300)
                   ) + INTERVAL 1 MINUTE,
                   'window', 'file:///data/events/part-' || (b.i % 13) || '.json',
                   '{"user": "u1"}', b.batch_at + INTERVAL 3 SECOND
            FROM b JOIN q USING (query_id), range(b.dropped) t(k)
            WHERE b.dropped > 0
            """
        )
        con.execute(
            """
            INSERT INTO audit_batches (query_id, batch_id, run_id, late_watermark_at, late_rows,
                                       sink, location, audited_at)
            SELECT query_id, batch_id, any_value(run_id), any_value(watermark_at), count(*),
                   'duckdb', NULL, max(audited_at)
            FROM late_rows GROUP BY query_id, batch_id
            """
        )
        con.execute(
            """
            INSERT INTO findings
            SELECT 'join_state_unbounded:' || query_id || ':0:left', query_id, name, 0, 'left',
                   'join_state_unbounded', 'critical', 'active',
                   'left state grows every batch and is never cleaned', '{}',
                   'add a watermark and a time-range condition on both sides',
                   TIMESTAMPTZ '2026-01-01 00:10:00+00', TIMESTAMPTZ '2026-01-01 02:00:00+00',
                   10, 900, 80
            FROM q WHERE n = 2
            """
        )
        con.execute("COMMIT")
        con.execute("CHECKPOINT")
    finally:
        con.close()


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
    args = parser.parse_args()

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
        return 0 if all(worst < TARGET_SECONDS for _, _, worst in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
