"""History from a checkpoint alone, against real Spark: a windowed count over a file stream with
late rows runs for 50 batches with wmwatch attached (the listener's history), then stops; the
history `wmwatch checkpoint-history` builds from its checkpoint must agree batch by batch."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import duckdb
import pytest
from typer.testing import CliRunner

import wmwatch
from tests.harness.streams import write_events
from wmwatch._checkpoint.fs import HadoopFileSystem
from wmwatch._checkpoint.history import read_checkpoint
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch.cli import app

pytestmark = pytest.mark.spark

BATCHES = 50


def ts(second: int) -> str:
    minute, sec = divmod(second, 60)
    return f"2026-01-01T00:{minute:02d}:{sec:02d}Z"


def run_watched(spark: Any, folder: Path, db: Path) -> str:
    """Run the query with wmwatch attached until it has run ``BATCHES`` batches; its id."""
    from pyspark.sql import functions as F

    (folder / "in").mkdir(parents=True, exist_ok=True)
    events = (
        spark.readStream.schema("id int, ts timestamp")
        .json(str(folder / "in"))
        .withWatermark("ts", "10 seconds")
    )
    counts = events.groupBy(F.window("ts", "10 seconds")).count()
    with wmwatch.attach(spark, db=str(db), metrics_port=None) as watch:
        query = (
            counts.writeStream.outputMode("append")
            .format("memory")
            .queryName("ckhist_counts")
            .option("checkpointLocation", str(folder / "checkpoint"))
            .start()
        )
        try:
            step = 0
            deadline = time.monotonic() + 240
            while (query.lastProgress or {}).get("batchId", -1) < BATCHES - 1:
                assert time.monotonic() < deadline, "the query did not reach 50 batches"
                # each file is a data batch, then the no-data batch that moves the watermark;
                # one row in three is 30 s behind (late, its window closed)
                rows = [{"id": step, "ts": ts(8 * step)}]
                if step % 3 == 2:
                    rows.append({"id": 1000 + step, "ts": ts(max(0, 8 * step - 30))})
                write_events(folder / "in", rows)
                query.processAllAvailable()
                step += 1
            query_id = str(query.id)
        finally:
            query.stop()
        assert watch.flush(timeout=30)
    return query_id


def table(db: Path, sql: str) -> list[tuple[Any, ...]]:
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(sql).fetchall()


def by_batch(db: Path, sql: str) -> dict[Any, tuple[Any, ...]]:
    return {row[0]: row[1:] for row in table(db, sql)}


@pytest.mark.slow(minutes=1.5)
def test_history_from_checkpoint_agrees_with_the_listener(spark: Any, stream_dir: Path) -> None:
    listener_db = stream_dir / "listener.duckdb"
    checkpoint_db = stream_dir / "checkpoint.duckdb"
    query_id = run_watched(spark, stream_dir, listener_db)
    checkpoint = stream_dir / "checkpoint"
    # The stopped query's state stores stay loaded in this JVM, and their maintenance would go
    # on writing snapshots into the checkpoint: unload them, so any change is the command's.
    spark.sparkContext._jvm.org.apache.spark.sql.execution.streaming.state.StateStore.stop()
    before = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*"))

    runner = CliRunner()
    result = runner.invoke(app, ["checkpoint-history", str(checkpoint), "--db", str(checkpoint_db)])
    assert result.exit_code == 0, result.output
    assert f"batches of query {query_id} to {checkpoint_db}" in result.output

    listener = by_batch(
        listener_db,
        "SELECT batch_id, epoch_ms(watermark_at), epoch_ms(late_watermark_at), "
        "epoch_ms(batch_at), state_rows_total FROM batches ORDER BY batch_id",
    )
    rebuilt = by_batch(
        checkpoint_db,
        "SELECT batch_id, epoch_ms(watermark_at), epoch_ms(late_watermark_at), "
        "epoch_ms(batch_at), state_rows_total, committed, run_id, query_id FROM batches "
        "ORDER BY batch_id",
    )
    assert len(listener) >= BATCHES
    committed = {b for b, row in rebuilt.items() if row[4]}
    assert committed == set(listener)
    # a batch planned but cut off by stop() has offsets and no commit
    assert all(b > max(listener) for b, row in rebuilt.items() if not row[4])
    for batch_id, (watermark, late, batch_at, state_rows) in listener.items():
        got = rebuilt[batch_id]
        assert got[0] == watermark, batch_id
        assert got[1] == late, batch_id
        assert got[3] == state_rows, batch_id
        # trigger start (progress) versus the batch's planning time (offsets): milliseconds apart
        assert abs(got[2] - batch_at) < 5_000, batch_id
        assert got[5:] == ("checkpoint", query_id)
    # the late rows were late: the watermark moved over them, and state was emptied behind it
    assert len({row[0] for row in listener.values()}) > 10

    op_sql = (
        "SELECT batch_id || '/' || operator_id, operator_name, rows_total FROM operators "
        "ORDER BY batch_id, operator_id"
    )
    listener_ops = by_batch(listener_db, op_sql)
    rebuilt_ops = by_batch(checkpoint_db, op_sql)
    assert listener_ops == {key: rebuilt_ops[key] for key in listener_ops}
    assert {name for name, _ in listener_ops.values()} == {"stateStoreSave"}

    src_sql = "SELECT batch_id, end_offset FROM sources WHERE source_index = 0"
    listener_ends = {b: json.loads(e) for b, (e,) in by_batch(listener_db, src_sql).items()}
    rebuilt_ends = {b: json.loads(e) for b, (e,) in by_batch(checkpoint_db, src_sql).items()}
    assert listener_ends == {b: rebuilt_ends[b] for b in listener_ends}

    (reads,) = table(
        checkpoint_db,
        "SELECT oldest_offsets_batch, latest_offsets_batch, oldest_commit_batch, "
        "oldest_state_batch, batches_written, state_batches_counted FROM checkpoint_reads",
    )
    assert reads[0] == 0 and reads[2] == 0 and reads[3] == 0
    assert reads[1] == max(rebuilt) and reads[4] == len(rebuilt)
    assert reads[5] == len(committed)

    # the same checkpoint read through Hadoop's FileSystem (how hdfs/s3a/abfss roots are read)
    root = f"file:{checkpoint}"
    through_hadoop = read_checkpoint(CheckpointReader(root, HadoopFileSystem(spark, root)))
    local = read_checkpoint(CheckpointReader(str(checkpoint)))
    assert replace(through_hadoop, checkpoint=local.checkpoint) == local

    # the checkpoint was only read
    assert sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*")) == before

    # the report reads it, in the terminal and as HTML
    report = runner.invoke(app, ["report", "--db", str(checkpoint_db)])
    assert report.exit_code == 0, report.output
    assert query_id in report.output
    page = stream_dir / "report.html"
    html = runner.invoke(
        app, ["report", "--db", str(checkpoint_db), "--format", "html", "-o", str(page)]
    )
    assert html.exit_code == 0, html.output
    assert query_id in page.read_text()

    # again, without counting state: nothing duplicated, the earlier counts kept
    snapshot_sql = "SELECT * EXCLUDE (recorded_at) FROM batches ORDER BY batch_id"
    first = table(checkpoint_db, snapshot_sql)
    first_ops = table(checkpoint_db, "SELECT * FROM operators ORDER BY batch_id")
    again = runner.invoke(
        app, ["checkpoint-history", str(checkpoint), "--db", str(checkpoint_db), "--no-state"]
    )
    assert again.exit_code == 0, again.output
    assert table(checkpoint_db, snapshot_sql) == first
    assert table(checkpoint_db, "SELECT * FROM operators ORDER BY batch_id") == first_ops

    # into the listener's own history: the listener's batches stay exactly as recorded
    recorded = table(listener_db, snapshot_sql)
    into = runner.invoke(
        app,
        ["checkpoint-history", str(checkpoint), "--db", str(listener_db), "--state-batches", "3"],
    )
    assert into.exit_code == 0, into.output
    assert f"kept {len(listener)} batches a listener recorded" in into.output
    after = table(listener_db, snapshot_sql)
    assert [row for row in after if row[2] != "checkpoint"] == recorded
    assert {row[1] for row in after if row[2] == "checkpoint"} == set(rebuilt) - set(listener)


ROCKSDB = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"


@pytest.mark.slow(minutes=1.5)
def test_join_and_dedupe_state_on_rocksdb_with_state_format_2(spark: Any, stream_dir: Path) -> None:
    """The production settings: RocksDB, state checkpoint format 2 (per-batch state ids in the
    commit log), a stream-stream join (four stores, counted as both sides' rows) under a
    deduplication: every operator's state rows per batch equal the listener's."""
    from pyspark.sql import functions as F

    settings = {
        "spark.sql.streaming.stateStore.providerClass": ROCKSDB,
        "spark.sql.streaming.stateStore.checkpointFormatVersion": "2",
    }
    previous = {key: spark.conf.get(key, None) for key in settings}
    for key, value in settings.items():
        spark.conf.set(key, value)
    listener_db = stream_dir / "listener.duckdb"
    try:
        for side in ("l", "r"):
            (stream_dir / side).mkdir()
        left = (
            spark.readStream.schema("k int, lts timestamp")
            .json(str(stream_dir / "l"))
            .withWatermark("lts", "10 seconds")
        )
        right = (
            spark.readStream.schema("rk int, rts timestamp")
            .json(str(stream_dir / "r"))
            .withWatermark("rts", "10 seconds")
        )
        joined = left.join(
            right,
            F.expr("k = rk AND rts BETWEEN lts - interval 5 seconds AND lts + interval 5 seconds"),
        )
        deduped = joined.select("k", "lts").dropDuplicates(["k", "lts"])
        with wmwatch.attach(spark, db=str(listener_db), metrics_port=None) as watch:
            query = (
                deduped.writeStream.format("memory")
                .queryName("ckhist_join")
                .outputMode("append")
                .option("checkpointLocation", str(stream_dir / "checkpoint"))
                .start()
            )
            try:
                for i in range(6):
                    write_events(
                        stream_dir / "l",
                        [{"k": i, "lts": ts(7 * i)}, {"k": i + 1, "lts": ts(7 * i)}],
                    )
                    write_events(stream_dir / "r", [{"rk": i, "rts": ts(7 * i + 1)}])
                    query.processAllAvailable()
            finally:
                query.stop()
            assert watch.flush(timeout=30)
    finally:
        for key, value in previous.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
    checkpoint_db = stream_dir / "checkpoint.duckdb"
    result = CliRunner().invoke(
        app, ["checkpoint-history", str(stream_dir / "checkpoint"), "--db", str(checkpoint_db)]
    )
    assert result.exit_code == 0, result.output
    assert "warning" not in result.output
    op_sql = (
        "SELECT batch_id || '/' || operator_id, operator_name, rows_total FROM operators "
        "ORDER BY batch_id, operator_id"
    )
    listener_ops = by_batch(listener_db, op_sql)
    rebuilt_ops = by_batch(checkpoint_db, op_sql)
    assert len(listener_ops) >= 20
    assert {name for name, _ in listener_ops.values()} == {"dedupe", "symmetricHashJoin"}
    assert listener_ops == {key: rebuilt_ops[key] for key in listener_ops}
    # the join's state grew and was cleaned behind the watermark
    assert len({rows for name, rows in listener_ops.values() if name == "symmetricHashJoin"}) > 2
