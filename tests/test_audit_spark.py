"""The late-row audit against real Spark: conservation, batch by batch, for every supported
operator.

Each test runs a production query over an out-of-order file stream and checks, window by window
(or row by row for deduplication), that what the query emitted plus what the audit recorded is
exactly the input. The same input is run twice with different batching (one file per batch with
the no-data batches Spark inserts, and several files per batch with availableNow): different
rows are late in the two runs, and both must balance.
"""

from __future__ import annotations

import json
import stat
from collections import Counter
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry
from typer.testing import CliRunner

import wmwatch
from tests.harness.audited import late_rows, run_audited
from tests.harness.checks import (
    assert_moved_by_no_data_batch,
    assert_windows_balance,
    batch_window_counts,
    check_dedupe,
    check_windows,
    dropped_by_watermark,
    final_watermark_ms,
)
from tests.harness.streams import DELAY, SCHEMA, stream_files, write_events
from wmwatch._checkpoint.fs import HadoopFileSystem
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch._errors import AuditError
from wmwatch.cli import app

pytestmark = pytest.mark.spark


@pytest.mark.parametrize("batching", ["each", "bulk"])
def test_tumbling_window_conservation(spark: Any, stream_dir: Path, batching: str) -> None:
    from pyspark.sql import functions as F

    result = run_audited(
        spark,
        stream_dir,
        lambda e: e.groupBy(F.window("ts", "10 seconds")).count(),
        batching=batching,
        name=f"tumble_{batching}",
    )
    check_windows(result, spark, stream_dir, "10 seconds", "10 seconds")
    if batching == "each":
        assert_moved_by_no_data_batch(result["checkpoint"])
        late_ids = {int(r[8].split('"id":')[1].split(",")[0]) for r in result["late"]}
        assert {
            5,
            7,
            9,
        } <= late_ids  # two late rows in one window; a window ending on the watermark
        assert 6 not in late_ids  # behind the watermark, window still open
        on_watermark = [r for r in result["late"] if r[5] == r[2]]
        assert on_watermark
        # progress said most batches could hold no late row: those cost no Spark job
        assert result["status"]["batches_skipped"] > result["status"]["batches_replayed"] > 0


@pytest.mark.parametrize("batching", ["each", "bulk"])
def test_sliding_window_conservation(spark: Any, stream_dir: Path, batching: str) -> None:
    from pyspark.sql import functions as F

    result = run_audited(
        spark,
        stream_dir,
        lambda e: e.groupBy(F.window("ts", "10 seconds", "5 seconds")).count(),
        batching=batching,
        name=f"slide_{batching}",
    )
    check_windows(result, spark, stream_dir, "10 seconds", "5 seconds")
    if batching == "each":
        # ts 10 with watermark 15: late for [5,15), counted in [10,20)
        windows_of_6 = [(r[4], r[5]) for r in result["late"] if '"id":6,' in r[8]]
        assert len(windows_of_6) == 1


@pytest.mark.parametrize("batching", ["each", "bulk"])
def test_drop_duplicates_with_event_time_conservation(
    spark: Any, stream_dir: Path, batching: str
) -> None:
    result = run_audited(
        spark,
        stream_dir,
        lambda e: e.dropDuplicates(["user", "ts"]),
        batching=batching,
        name=f"dedupe_{batching}",
    )
    check_dedupe(result, lambda r: (r["user"], r["ts"]), "dedupe")
    if batching == "each":
        late = {r[8] for r in result["late"]}
        assert any('"id":11' in r for r in late)  # ts exactly on the watermark is dropped


@pytest.mark.parametrize("batching", ["each", "bulk"])
def test_drop_duplicates_within_watermark_conservation(
    spark: Any, stream_dir: Path, batching: str
) -> None:
    result = run_audited(
        spark,
        stream_dir,
        lambda e: e.dropDuplicatesWithinWatermark(["user"]),
        batching=batching,
        name=f"dwm_{batching}",
    )
    check_dedupe(result, lambda r: r["user"], "dedupe_within_watermark")


def test_parquet_sink_balances_and_is_idempotent(spark: Any, stream_dir: Path) -> None:
    from pyspark.sql import functions as F

    result = run_audited(
        spark,
        stream_dir,
        lambda e: e.groupBy(F.window("ts", "10 seconds")).count(),
        batching="each",
        name="tumble_parquet",
        sink="parquet",
    )
    assert not result["late"]  # nothing in DuckDB: the rows are in Parquet
    locations = [m[3] for m in result["marks"] if m[3]]
    assert locations and all(m[2] == "parquet" for m in result["marks"])
    with duckdb.connect() as con:
        late = con.execute(
            "SELECT batch_id, event_time_us // 1000, watermark_us // 1000, lateness_seconds, "
            "window_start_us // 1000, window_end_us // 1000, operator_kind, source_file, row_data "
            f"FROM read_parquet({[loc + '/*.parquet' for loc in locations]!r})"
        ).fetchall()
    per_batch = Counter(r[0] for r in late)
    for batch_id, marked, _, _location in result["marks"]:
        assert per_batch.get(batch_id, 0) == marked
    # late rows are row payloads: owner-only whatever the umask (Spark writes 0644/0755)
    for loc in locations:
        folder = Path(loc)
        assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700
        for path in [folder, *folder.rglob("*")]:
            assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600)
    # and the report, whose connection may read only these files, reads every one of them
    report = CliRunner().invoke(
        app, ["report", "--db", str(stream_dir / "history.duckdb"), "--format", "json"]
    )
    assert report.exit_code == 0, report.output
    (query,) = json.loads(report.stdout)["queries"]
    assert query["late_rows"]["late_rows"] == len(late)
    result["late"] = late
    result["marks"] = [(b, n, "parquet", loc) for b, n, _, loc in result["marks"]]
    result["status"]["late_rows"] = len(late)
    check_windows(result, spark, stream_dir, "10 seconds", "10 seconds")


def test_restart_resumes_without_loss_or_duplicates(spark: Any, stream_dir: Path) -> None:
    from pyspark.sql import functions as F

    files = stream_files()
    events = spark.readStream.schema(SCHEMA).json(str(stream_dir / "in")).withWatermark("ts", DELAY)
    db = stream_dir / "history.duckdb"
    query = (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.format("memory")
        .queryName("restarted")
        .outputMode("append")
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        with wmwatch.attach(
            spark, db=str(db), metrics_port=None, registry=CollectorRegistry()
        ) as watch:
            handle = watch.audit(query, events)
            for f in files[:4]:
                write_events(stream_dir / "in", f)
                query.processAllAvailable()
            assert handle.sync(60)
            first = handle.status()
            handle.stop()
        with duckdb.connect(str(db)) as con:
            # a crash after the rows of the last audited batch were written but before more
            # batches were audited looks like this: drop the newest marker
            last = con.execute("SELECT max(batch_id) FROM audit_batches").fetchone()[0]
            con.execute("DELETE FROM audit_batches WHERE batch_id = ?", [last])
        for f in files[4:]:
            write_events(stream_dir / "in", f)
            query.processAllAvailable()
        with wmwatch.attach(
            spark, db=str(db), metrics_port=None, registry=CollectorRegistry()
        ) as watch:
            handle = watch.audit(query, events)
            assert handle.sync(60)
            second = handle.status()
            handle.stop()
        output = [r.asDict(recursive=True) for r in spark.table("restarted").collect()]
        wm_ms = final_watermark_ms(list(query.recentProgress))
    finally:
        query.stop()
    assert first["batches_audited"] > 0 and second["batches_audited"] > 0
    late = late_rows(db)
    with duckdb.connect(str(db), read_only=True) as con:
        marks = dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())
    assert len(late) == len(set(late))
    assert sorted(marks) == CheckpointReader(str(stream_dir / "checkpoint")).committed_batches()
    assert Counter(r[0] for r in late) == Counter({b: n for b, n in marks.items() if n})
    expected = batch_window_counts(spark, stream_dir, "10 seconds", "10 seconds")
    assert_windows_balance(expected, output, late, wm_ms)
    # the same checkpoint read through Hadoop's FileSystem (how s3a/hdfs/abfss roots are read)
    root = f"file:{stream_dir / 'checkpoint'}"
    local = CheckpointReader(str(stream_dir / "checkpoint"))
    remote = CheckpointReader(root, HadoopFileSystem(spark, root))
    assert remote.committed_batches() == local.committed_batches()
    for batch_id in local.committed_batches():
        assert remote.batch_files(batch_id) == local.batch_files(batch_id)
        assert remote.late_watermark_ms(batch_id) == local.late_watermark_ms(batch_id)


def test_prepare_replays_transformed_events_and_limits_columns(
    spark: Any, stream_dir: Path
) -> None:
    from pyspark.sql import functions as F

    def prepare(raw: Any) -> Any:
        return raw.where(F.col("user") != "flush_never").withColumn("user", F.upper("user"))

    raw = spark.readStream.schema(SCHEMA).json(str(stream_dir / "in"))
    events = prepare(raw).withWatermark("ts", DELAY)
    query = (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.format("memory")
        .queryName("prepared")
        .outputMode("append")
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    db = stream_dir / "history.duckdb"
    try:
        with wmwatch.attach(
            spark, db=str(db), metrics_port=None, registry=CollectorRegistry()
        ) as watch:
            handle = watch.audit(
                query,
                events,
                prepare=lambda df: prepare(df).withWatermark("ts", DELAY),
                columns=["id", "user"],
                hash_columns=["user"],
            )
            for f in stream_files()[:3]:
                write_events(stream_dir / "in", f)
                query.processAllAvailable()
            assert handle.sync(60)
            handle.stop()
    finally:
        query.stop()
    import hashlib
    import json

    with duckdb.connect(str(db), read_only=True) as con:
        data = [
            json.loads(r[0])
            for r in con.execute("SELECT row_data::VARCHAR FROM late_rows").fetchall()
        ]
    assert data
    for row in data:
        assert set(row) == {"id", "user"}
    assert {r["id"] for r in data} == {5, 7, 9, 10, 14}
    assert {r["user"] for r in data} == {
        hashlib.sha256(u.encode()).hexdigest() for u in ("LATE", "EDGE", "X", "A")
    }


def test_a_source_that_cannot_be_read_again_is_counted_without_payload(
    spark: Any, stream_dir: Path
) -> None:
    """A rate source cannot read a batch again: the audit still runs, counts what Spark dropped
    from it batch by batch (Spark's own count), and says why the rows themselves are missing."""
    import time

    from pyspark.sql import functions as F

    rate = spark.readStream.format("rate").option("rowsPerSecond", 40).load()
    # every fifth row is 30 s behind the others: late once the watermark has moved
    late = F.when(F.col("value") % 5 == 0, F.expr("INTERVAL 30 SECONDS")).otherwise(
        F.expr("INTERVAL 0 SECONDS")
    )
    events = rate.select("value", (F.col("timestamp") - late).alias("ts")).withWatermark(
        "ts", "2 seconds"
    )
    db = stream_dir / "h.duckdb"
    registry = CollectorRegistry()
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=registry)
    query = (
        events.groupBy(F.window("ts", "2 seconds"))
        .count()
        .writeStream.format("noop")
        .queryName("rate_counts")
        .outputMode("append")
        .trigger(processingTime="1 second")
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        audit = watch.audit(query, events, poll_interval_seconds=0.2)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not dropped_by_watermark(query.recentProgress):
            time.sleep(0.5)
    finally:
        query.stop()
    try:
        assert audit.sync(60), audit.status()
        status = audit.status()
        watch.flush(20)
    finally:
        watch.close()
    dropped = dropped_by_watermark(query.recentProgress)
    assert dropped > 0, "the scenario dropped nothing"
    (only,) = status["inputs"]
    assert "cannot be replayed batch by batch" in only["payload_missing"]
    assert status["rows_without_payload"] == dropped
    assert status["late_rows"] == 0 and status["errors"] == 0
    with duckdb.connect(str(db), read_only=True) as con:
        (rows,) = con.execute("SELECT count(*) FROM late_rows").fetchone() or (None,)
    assert rows == 0
    result = CliRunner().invoke(app, ["report", "--db", str(db), "--format", "json"])
    assert result.exit_code == 0, result.output
    (reported,) = json.loads(result.stdout)["queries"]
    (missing,) = reported["late_rows"]["without_payload"]
    assert missing["rows_dropped"] == dropped and missing["batches_uncounted"] == 0
    assert "cannot be replayed" in missing["reason"]
    text = CliRunner().invoke(app, ["report", "--db", str(db)], terminal_width=250)
    assert "without payload" in text.stdout and "not read again" in text.stdout


def test_a_file_source_that_archives_its_files_is_not_replayed_in_any_spelling(
    spark: Any, stream_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Spark's options are case-insensitive: ``.option("cleansource", "archive")`` moves each
    file away once its batch commits, as ``cleanSource`` does. The audit reads the option as
    Spark does: it says in one line that the source's files cannot be read again and counts
    what Spark dropped from progress, with no replay of the moved files and no error."""
    archive = stream_dir / "archive"

    def archived(reader: Any, folder: str) -> Any:
        return (
            reader.schema(SCHEMA)
            .option("cleansource", "archive")
            .option("sourcearchivedir", str(archive))
            .json(folder)
            .withWatermark("ts", DELAY)
        )

    def count(events: Any) -> Any:
        from pyspark.sql import functions as F

        return events.groupBy(F.window("ts", "10 seconds")).count()

    with caplog.at_level("WARNING", logger="wmwatch.audit"):
        result = run_audited(
            spark, stream_dir, count, batching="each", name="archived", read=archived
        )
    status = result["status"]
    (only,) = status["inputs"]
    assert "moves or deletes its files (cleanSource=archive)" in only["payload_missing"]
    (line,) = [r.getMessage() for r in caplog.records if "cannot be read again" in r.getMessage()]
    assert "cleanSource=archive" in line and "\n" not in line
    assert status["errors"] == 0 and status["late_rows"] == 0
    assert status["rows_without_payload"] == dropped_by_watermark(result["progress"]) > 0
    assert list(archive.rglob("*.json")), "Spark archived no file: the scenario lost its point"


def test_query_without_late_drops_is_refused(spark: Any, stream_dir: Path) -> None:
    events = spark.readStream.schema(SCHEMA).json(str(stream_dir / "in")).withWatermark("ts", DELAY)
    query = (
        events.dropDuplicates(["user"])
        .writeStream.format("noop")
        .outputMode("append")
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        with (
            wmwatch.attach(
                spark,
                db=str(stream_dir / "h.duckdb"),
                metrics_port=None,
                registry=CollectorRegistry(),
            ) as watch,
            pytest.raises(AuditError, match="without the event-time column"),
        ):
            watch.audit(query, events)
    finally:
        query.stop()


def test_update_mode_window_conservation(spark: Any, stream_dir: Path) -> None:
    """Update mode emits every changed window; its last count + audited rows = all input."""
    from pyspark.sql import functions as F

    updates: list[tuple[int, int, int]] = []

    def sink(frame: Any, batch_id: int) -> None:
        updates.extend(
            (batch_id, int(r["window"]["start"].timestamp() * 1000), r["count"])
            for r in frame.collect()
        )

    events = spark.readStream.schema(SCHEMA).json(str(stream_dir / "in")).withWatermark("ts", DELAY)
    db = stream_dir / "h.duckdb"
    query = (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.outputMode("update")
        .foreachBatch(sink)
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        with wmwatch.attach(
            spark, db=str(db), metrics_port=None, registry=CollectorRegistry()
        ) as watch:
            handle = watch.audit(query, events)
            for f in stream_files():
                write_events(stream_dir / "in", f)
                query.processAllAvailable()
            assert handle.sync(60)
            handle.stop()
    finally:
        query.stop()
    last_count = {start: count for _, start, count in sorted(updates)}
    with duckdb.connect(str(db), read_only=True) as con:
        audited = Counter(
            r[0] for r in con.execute("SELECT epoch_ms(window_start_at) FROM late_rows").fetchall()
        )
    assert audited
    for (start, _), total in batch_window_counts(
        spark, stream_dir, "10 seconds", "10 seconds"
    ).items():
        assert last_count.get(start, 0) + audited.get(start, 0) == total, start
