"""What wmwatch keeps does not grow without bound: stopped queries are forgotten by the plan
plugin, history has a default retention, and writes pending for an unavailable history file are
bounded in bytes.

Real components throughout: a real SparkSession and streaming queries for the plan plugin, real
DuckDB files for retention and the writer, the file made unavailable for real (replaced by a
folder) and the drops read from wmwatch's own metrics.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry

import wmwatch
from tests.harness.handmade import progress
from tests.harness.streams import write_events
from tests.scripts.safety_support import NoQueriesSession
from wmwatch._audit.sinks import AuditHistory, BatchLateRows
from wmwatch._inspect.plugin import PlanPlugin
from wmwatch._store.writer import HistoryStore


def _wait_for(check: Callable[[], bool], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ----------------------------------------------------------------- the plan plugin forgets


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.seconds = 1000.0

    def __call__(self) -> float:
        return self.seconds


def _plan_series(plugin: PlanPlugin, names: set[str]) -> dict[str, set[str]]:
    """The plugin's series per query name (the scrape also forgets what is due)."""
    out: dict[str, set[str]] = {name: set() for name in names}
    for family in plugin.collect():
        for sample in family.samples:
            query = sample.labels.get("query")
            if query in out:
                out[query].add(sample.name)
    return out


@pytest.mark.spark
def test_plan_plugin_forgets_stopped_queries_their_series_and_findings(
    spark: Any, stream_dir: Path
) -> None:
    clock = Clock()
    watch = wmwatch.attach(
        spark,
        db=str(stream_dir / "h.duckdb"),
        metrics_port=None,
        registry=CollectorRegistry(),
        inspect_plans=False,
    )
    plugin = PlanPlugin(
        watch,
        forget_after_seconds=30.0,
        monotonic=clock,
        side_count_every_batches=None,
        min_read_interval_seconds=0.0,
    )
    watch.add_plugin(plugin)
    schema = "k INT, ts TIMESTAMP"
    folders = {name: stream_dir / name for name in ("d0", "d1", "l", "r")}
    for folder in folders.values():
        folder.mkdir()

    def dedupe(name: str) -> Any:
        return (
            spark.readStream.schema(schema)
            .json(str(folders[name[-2:]]))
            .withWatermark("ts", "10 seconds")
            .dropDuplicates(["k", "ts"])
            .writeStream.format("noop")
            .queryName(name)
            .option("checkpointLocation", str(stream_dir / f"cp_{name}"))
            .start()
        )

    def join(name: str) -> Any:
        # no watermark: its state is never cleaned, a finding the plan reports at once
        left = spark.readStream.schema(schema).json(str(folders["l"]))
        right = spark.readStream.schema(schema).json(str(folders["r"])).withColumnRenamed("ts", "t")
        return (
            left.join(right, "k")
            .writeStream.format("noop")
            .queryName(name)
            .option("checkpointLocation", str(stream_dir / f"cp_{name}"))
            .start()
        )

    def run_batches(query: Any, folder_names: list[str], first: int) -> None:
        for minute in range(first, first + 2):
            for name in folder_names:
                write_events(
                    folders[name], [{"k": minute, "ts": f"2026-01-01T00:{minute:02d}:00Z"}]
                )
            query.processAllAvailable()

    names = {"churn_d0", "churn_d1", "churn_join"}
    queries = {"churn_d0": dedupe("churn_d0"), "churn_d1": dedupe("churn_d1")}
    queries["churn_join"] = join("churn_join")
    try:
        run_batches(queries["churn_d0"], ["d0"], 0)
        run_batches(queries["churn_d1"], ["d1"], 0)
        run_batches(queries["churn_join"], ["l", "r"], 0)
        join_id = str(queries["churn_join"].id)

        def every_query_has_series() -> bool:
            watch.flush()
            plugin.wait_idle()
            series = _plan_series(plugin, names)
            return (
                all(
                    "wmwatch_operator_watermark_seconds" in series[n]
                    for n in ("churn_d0", "churn_d1")
                )
                and "wmwatch_findings_active" in series["churn_join"]
            )

        _wait_for(every_query_has_series, 60, "the plan series of the three queries")
        assert plugin.findings.all(query_id=join_id, active_only=True)
        for query in queries.values():
            query.stop()
        _wait_for(lambda: plugin.remembered()["stopped"] == 3, 30, "three terminations heard")

        # stopped, not yet forgotten: the last state is still scraped (so a failure can alert)
        clock.seconds += 10
        assert all(_plan_series(plugin, names).values())

        # churn_d0 starts again on its checkpoint (same id, a new run): it is running, so it
        # stays when the other two are forgotten
        queries["churn_d0"] = dedupe("churn_d0")
        run_batches(queries["churn_d0"], ["d0"], 2)
        watch.flush()
        plugin.wait_idle()
        _wait_for(lambda: plugin.remembered()["stopped"] == 2, 30, "the restart heard")
        clock.seconds += 25  # 35 s since the stop
        series = _plan_series(plugin, names)
        assert series["churn_d0"], "a running query was forgotten"
        assert series["churn_d1"] == set() and series["churn_join"] == set()
        assert plugin.findings.all(query_id=join_id) == []
        assert set(plugin.summary()) == {"churn_d0"}

        queries["churn_d0"].stop()
        _wait_for(lambda: plugin.remembered()["stopped"] == 1, 30, "the second stop heard")
        clock.seconds += 31
        assert _plan_series(plugin, names) == {name: set() for name in names}
        assert plugin.remembered() == {
            "queries": 0,
            "stopped": 0,
            "connect_facts": 0,
            "previous_watermark": 0,
            "handles": 0,
            "reads": 0,
            "findings": 0,
        }
        # forgotten in memory only: the finding's last state is in the history
        assert watch.flush(timeout=30)
        recorded = watch.store.read(
            lambda con: con.execute(
                "SELECT kind, status FROM findings WHERE query_id = ?", [join_id]
            ).fetchall()
        )
        assert ("join_state_unbounded", "active") in recorded
    finally:
        for query in queries.values():
            query.stop()
        watch.close()


def test_attach_hands_forget_after_seconds_to_the_plan_plugin() -> None:
    with wmwatch.attach(
        NoQueriesSession(), db=None, metrics_port=None, listener="stock", forget_after_seconds=42
    ) as watch:
        (plugin,) = [p for p in watch.plugins() if isinstance(p, PlanPlugin)]
        assert plugin.forget_after_seconds == 42


# ------------------------------------------------------------------- retention by default


def _seed_history(path: Path, *, old: datetime, recent: datetime) -> None:
    """Batch 0 and its audit, watermark and staged rows are ``old``; batch 1's are ``recent``."""
    with HistoryStore(path) as history:  # the store itself keeps everything unless told
        history.record_progress(progress(0, at=old))
        history.record_progress(progress(1, at=recent))

        def rows(con: duckdb.DuckDBPyConnection) -> None:
            for batch_id, at in ((0, old), (1, recent)):
                con.execute(
                    "INSERT INTO late_rows (query_id, batch_id, audited_at) VALUES ('q-1', ?, ?)",
                    [batch_id, at],
                )
                con.execute(
                    "INSERT INTO audit_batches (query_id, batch_id, late_rows, sink, audited_at) "
                    "VALUES ('q-1', ?, 1, 'duckdb', ?)",
                    [batch_id, at],
                )
                con.execute(
                    "INSERT INTO operator_watermarks (query_id, batch_id, operator_id, "
                    "recorded_at) VALUES ('q-1', ?, 0, ?)",
                    [batch_id, at],
                )
                con.execute(
                    "INSERT INTO source_watermarks (query_id, batch_id, node_id, recorded_at) "
                    "VALUES ('q-1', ?, 'n', ?)",
                    [batch_id, at],
                )
                # rows an interrupted replay staged, for an audit that never resumed
                con.execute(
                    "INSERT INTO late_rows_pending (query_id, batch_id, attempt) "
                    "VALUES ('q-1', ?, 'a')",
                    [batch_id],
                )

        history.submit(rows, description="audit and watermark rows")


_TABLES = (
    "batches",
    "operators",
    "sources",
    "late_rows",
    "audit_batches",
    "late_rows_pending",
    "operator_watermarks",
    "source_watermarks",
)


def _batch_ids(watch: Any) -> dict[str, list[int]]:
    def read(con: duckdb.DuckDBPyConnection) -> dict[str, list[int]]:
        return {
            table: [
                r[0] for r in con.execute(f"SELECT batch_id FROM {table} ORDER BY 1").fetchall()
            ]
            for table in _TABLES
        }

    # a read runs after the writer's cycle, whose first retention pass comes at start
    return dict(watch.store.read(read, timeout=30))


@pytest.mark.parametrize(
    ("options", "kept", "said"),
    [
        ({}, [1], "keeps 30 days (retention_days=30; None keeps everything)"),
        ({"retention_days": None}, [0, 1], "keeps everything (retention_days=None)"),
        ({"retention_days": math.inf}, [0, 1], "keeps everything (retention_days=None)"),
    ],
    ids=["default", "none", "inf"],
)
def test_history_keeps_30_days_by_default_and_everything_when_asked(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    options: dict[str, Any],
    kept: list[int],
    said: str,
) -> None:
    now = datetime.now(UTC)
    path = tmp_path / "history.duckdb"
    _seed_history(path, old=now - timedelta(days=31), recent=now - timedelta(days=29))
    with caplog.at_level(logging.INFO, logger="wmwatch"):
        watch = wmwatch.attach(
            NoQueriesSession(), db=str(path), metrics_port=None, listener="stock", **options
        )
        try:
            assert _batch_ids(watch) == {table: kept for table in _TABLES}
        finally:
            watch.close()
    lines = [r.getMessage() for r in caplog.records if "retention_days" in r.getMessage()]
    assert lines == [f"wmwatch: history in {path} {said}"]
    with duckdb.connect(str(path), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM queries").fetchone() == (1,)  # runs stay


@pytest.mark.parametrize("days", [0, -1, math.nan])
def test_a_retention_that_is_not_a_positive_number_is_refused_in_one_line(
    tmp_path: Path, days: float
) -> None:
    with pytest.raises(
        wmwatch.ConfigError, match=r"^retention_days=.*or None to keep all history$"
    ):
        wmwatch.attach(
            NoQueriesSession(),
            db=str(tmp_path / "h.duckdb"),
            metrics_port=None,
            listener="stock",
            retention_days=days,
        )
    assert not (tmp_path / "h.duckdb").exists()


# -------------------------------------------------------------- pending writes, in bytes


_PAD_BYTES = 20_000
_ROWS_PER_BATCH = 10
_BATCHES = 60


def _late_row(batch_id: int, index: int) -> tuple[Any, ...]:
    data = f'{{"batch": {batch_id}, "row": {index}, "pad": "{"x" * _PAD_BYTES}"}}'
    return (0, None, None, "/in/storm.json", data, "window", 0, None, 0, None)


def test_a_late_row_storm_while_history_is_unavailable_is_bounded_in_bytes(
    tmp_path: Path,
) -> None:
    db = tmp_path / "history.duckdb"
    bound_bytes = 2 * 1024 * 1024
    watch = wmwatch.attach(NoQueriesSession(), db=str(db), metrics_port=None, listener="stock")
    try:
        store = watch.store
        assert store is not None
        store.max_pending_bytes = bound_bytes
        store.flush_interval_seconds = 0.05
        store.lock_wait_seconds = 0.05
        store.max_cpu_share = None  # retry at once rather than paced
        assert watch.flush(timeout=30)
        written_before = store.health.written_total
        history = AuditHistory(store, query_id="q-storm", label="storm")

        # the history file becomes unavailable: replaced by a folder (the writer may reopen,
        # and so recreate, the file between the unlink and the mkdir: then again)
        for _ in range(50):
            db.unlink(missing_ok=True)
            Path(f"{db}.wal").unlink(missing_ok=True)
            try:
                db.mkdir()
                break
            except FileExistsError:
                time.sleep(0.01)
        assert db.is_dir(), "the history file kept coming back"
        history.drop_interrupted_replays()  # a first write finds it so
        _wait_for(lambda: not store.health.up, 30, "the store to go down")

        peak_bytes = 0
        for batch_id in range(_BATCHES):
            rows = [_late_row(batch_id, i) for i in range(_ROWS_PER_BATCH)]
            history.commit(
                query_name="storm",
                run_id="r",
                batch_id=batch_id,
                late_wm_ms=1_767_225_600_000,
                found=BatchLateRows(total=len(rows), rows=rows),
                sink="duckdb",
            )
            peak_bytes = max(peak_bytes, store.health.pending_bytes)
        down = store.health
        registry = watch.registry
        assert not down.up
        # the writer's own accounting stays under the bound, and it is not an undercount: the
        # row text alone of what is kept is under it too
        assert 0 < peak_bytes <= bound_bytes
        assert down.pending_writes * _ROWS_PER_BATCH * _PAD_BYTES <= bound_bytes
        assert down.dropped_total > 0
        assert registry.get_sample_value("wmwatch_store_pending_bytes") == down.pending_bytes
        assert registry.get_sample_value("wmwatch_store_dropped_writes_total") == down.dropped_total

        # available again: everything kept is written, the newest batches of the storm
        shutil.rmtree(db)
        assert watch.flush(timeout=60)
        _wait_for(lambda: store.health.up, 30, "the store up again")  # marked after the writes
        up = store.health
        assert up.pending_writes == 0 and up.pending_bytes == 0
        assert up.dropped_total == down.dropped_total
        submitted = _BATCHES + 1  # and the first write
        assert up.written_total - written_before + up.dropped_total == submitted

        def read(con: duckdb.DuckDBPyConnection) -> tuple[list[Any], list[Any]]:
            markers = con.execute(
                "SELECT batch_id, late_rows FROM audit_batches ORDER BY 1"
            ).fetchall()
            rows = con.execute(
                "SELECT batch_id, count(*), count(DISTINCT row_data->>'row'), "
                "min(length(row_data->>'pad')) FROM late_rows GROUP BY 1 ORDER BY 1"
            ).fetchall()
            return markers, rows

        markers, rows = store.read(read)
        kept = [batch_id for batch_id, _ in markers]
        assert kept == list(range(_BATCHES - len(kept), _BATCHES)), "the oldest go first"
        assert len(kept) >= 5
        assert all(late == _ROWS_PER_BATCH for _, late in markers)
        assert rows == [(b, _ROWS_PER_BATCH, _ROWS_PER_BATCH, _PAD_BYTES) for b in kept]
    finally:
        if db.is_dir():
            shutil.rmtree(db)
        watch.close()


def test_a_healthy_writer_writes_half_the_byte_bound_at_once_rather_than_drop(
    tmp_path: Path,
) -> None:
    """Timed flushes may be paced to 30 s apart; bytes piling up meanwhile are written at half
    the bound, so a writer that can write never drops."""
    path = tmp_path / "history.duckdb"
    with HistoryStore(path, flush_interval_seconds=120, max_pending_bytes=2 * 1024 * 1024) as store:
        history = AuditHistory(store, query_id="q-big", label="big")

        def commit(batch_id: int) -> None:
            rows = [_late_row(batch_id, i) for i in range(_ROWS_PER_BATCH)]
            history.commit(
                query_name="big",
                run_id="r",
                batch_id=batch_id,
                late_wm_ms=None,
                found=BatchLateRows(total=len(rows), rows=rows),
                sink="duckdb",
            )

        for batch_id in range(4):  # about 800 kB: waits for the timed flush
            commit(batch_id)
        time.sleep(0.5)
        assert store.health.pending_writes == 4
        for batch_id in range(4, 6):  # past 1 MiB: written now, with no flush asked for
            commit(batch_id)
        _wait_for(lambda: store.health.pending_writes == 0, 30, "the backlog to be written")
        assert store.health.dropped_total == 0
        written = store.read(
            lambda con: con.execute("SELECT count(*) FROM audit_batches").fetchone()
        )
        assert written == (6,)
