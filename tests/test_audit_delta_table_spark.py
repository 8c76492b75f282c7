"""Which Delta table the audit reads, and what reading a batch of it costs: a table replaced at
its path is never replayed as the stream's, streams the audit cannot replay in their order are
refused with the reason, and a batch inside a large first snapshot brings only its own files to
the driver. Real Spark 4.2 and real Delta 4.4 (``nox -s delta``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import duckdb
import pytest

import wmwatch
from tests.harness.audited import sidecar_status
from tests.harness.checks import dropped_by_watermark, offsets_moved, py4j_calls
from tests.harness.delta import append
from tests.harness.streams import DELAY, stream_files
from wmwatch._audit.replay.sources.base import SOURCE_FILE_COL as _FILE
from wmwatch._checkpoint.reader import CheckpointReader

pytestmark = [pytest.mark.spark, pytest.mark.delta]


def test_sidecar_of_a_delta_table_replaced_at_its_path_counts_its_batches_lost(
    delta_spark: Any, tmp_path: Path
) -> None:
    """A stopped query's Delta table is deleted and written again at the same path, with other
    rows and more versions than before: the sidecar finds another table id than the one in the
    checkpoint's offsets, counts every batch it had to read lost with the reason, and stores no
    row of the new table."""
    spark = delta_spark
    table, checkpoint = tmp_path / "table", tmp_path / "checkpoint"
    files = stream_files()

    def events() -> Any:
        return spark.readStream.format("delta").load(str(table)).withWatermark("ts", DELAY)

    append(spark, table, files[0])
    query = (
        events()
        .dropDuplicates(["user", "ts"])
        .writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    try:
        query.processAllAvailable()
        for rows in files[1:]:
            append(spark, table, rows)
            query.processAllAvailable()
        progress = list(query.recentProgress)
    finally:
        query.stop()
    assert dropped_by_watermark(progress) > 0, "the query dropped no row"
    # another application replaces the table: this JVM's cached log of the path goes with it
    shutil.rmtree(table)
    spark.sparkContext._jvm.org.apache.spark.sql.delta.DeltaLog.clearCache()
    ghosts = [{"id": 9000 + i, "user": "ghost", "ts": "2026-01-01T00:00:01Z"} for i in range(3)]
    for _ in range(len(files) + 1):
        append(spark, table, ghosts)

    frame = events()
    db = tmp_path / "side.duckdb"
    status = sidecar_status(
        spark, db, checkpoint, frame, frame.dropDuplicates(["user", "ts"]), name="delta_replaced"
    )
    reader = CheckpointReader(str(checkpoint))
    expected = {
        b
        for b in reader.committed_batches()
        if b > 0 and offsets_moved(reader, b) and reader.late_watermark_ms(b) is not None
    }
    assert expected, "no batch the sidecar had to read"
    with duckdb.connect(str(db), read_only=True) as con:
        late = con.execute("SELECT count(*) FROM late_rows").fetchone()
        marked = {b for (b,) in con.execute("SELECT batch_id FROM audit_batches").fetchall()}
    assert late is not None and late[0] == 0
    assert set(reader.committed_batches()) - marked == expected
    assert status["batches_lost"] == len(expected) and status["errors"] == 0, status
    assert "table id" in status["last_lost_reason"], status["last_lost_reason"]


def test_delta_streams_read_out_of_file_order_or_past_missing_files_are_refused(
    delta_spark: Any, tmp_path: Path
) -> None:
    """``withEventTimeOrder`` reads the first snapshot in event-time buckets, and a session with
    ``spark.sql.files.ignoreMissingFiles`` would skip a vacuumed file silently: the audit
    refuses to replay either, says why, and counts the input from Spark's progress instead."""
    spark = delta_spark
    table = tmp_path / "table"
    append(spark, table, stream_files()[0])
    cases = {
        "withEventTimeOrder": ({"withEventTimeOrder": "true"}, None),
        "spark.sql.files.ignoreMissingFiles": ({}, "spark.sql.files.ignoreMissingFiles"),
    }
    with wmwatch.attach(spark, db=str(tmp_path / "history.duckdb"), metrics_port=None) as watch:
        for named, (options, conf) in cases.items():
            events = (
                spark.readStream.format("delta")
                .options(**options)
                .load(str(table))
                .withWatermark("ts", DELAY)
            )
            query = (
                events.dropDuplicates(["user", "ts"])
                .writeStream.format("noop")
                .trigger(availableNow=True)
                .option("checkpointLocation", str(tmp_path / f"checkpoint-{len(named)}"))
                .start()
            )
            try:
                if conf is not None:
                    spark.conf.set(conf, "true")
                try:
                    handle = watch.audit(query, events)
                finally:
                    if conf is not None:
                        spark.conf.unset(conf)
                (only,) = handle.status()["inputs"]
                handle.stop()
            finally:
                query.stop()
            assert only["payload_missing"] and named in only["payload_missing"], only


FILES = 60


def test_a_first_snapshot_batch_brings_only_its_own_files_to_the_driver(
    delta_spark: Any, tmp_path: Path
) -> None:
    """A table of 60 files read by two streams, 10 and 20 files a batch: each batch's files are
    exactly the stream's (sorted by modification time and path, as Delta numbers its first
    snapshot), read again in any order; and the driver's work for a batch (its py4j round trips)
    is the same for a 20-file batch as for a 10-file one, and at the snapshot's end as at its
    start: nothing is listed into the driver or called per file."""
    from pyspark.sql import DataFrame

    from wmwatch._audit.replay.sources.delta import DeltaBatchSource, delta_spec_of

    spark = delta_spark
    table = tmp_path / "table"
    spark.range(0, FILES, 1, FILES).selectExpr(  # one file a row
        "CAST(id AS INT) AS id", "'u' AS user", "TIMESTAMP '2026-01-01 00:00:00' AS ts"
    ).write.format("delta").save(str(table))
    jvm = spark.sparkContext._jvm
    log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, str(table))
    snapshot = log.getSnapshotAt(0, jvm.scala.Option.empty(), jvm.scala.Option.empty(), False)
    listed = DataFrame(snapshot.allFiles().toDF(), spark).select("modificationTime", "path")
    order = [r["path"] for r in sorted(listed.collect(), key=lambda r: tuple(r))]
    assert len(order) == FILES

    def stream(per_batch: int) -> tuple[Any, CheckpointReader, list[int]]:
        """The stream through the snapshot, ``per_batch`` files a batch; its source as the audit
        reads it, its checkpoint, and its batches inside the snapshot."""
        events = spark.readStream.format("delta").option("maxFilesPerTrigger", per_batch)
        events = events.load(str(table))
        checkpoint = tmp_path / f"checkpoint-{per_batch}"
        query = (
            events.writeStream.format("noop")
            .trigger(availableNow=True)
            .option("checkpointLocation", str(checkpoint))
            .start()
        )
        try:
            assert query.awaitTermination(600)
        finally:
            query.stop()
        reader = CheckpointReader(str(checkpoint))
        inside = [b for b in reader.committed_batches() if offset(reader, b)["isStartingVersion"]]
        assert len(inside) >= FILES // per_batch - 1, inside
        spec = delta_spec_of({}, [str(table)], events.schema.json())
        return DeltaBatchSource(spec, 0, spark), reader, inside

    def offset(reader: CheckpointReader, batch_id: int) -> dict[str, Any]:
        entry = reader.offsets(batch_id)
        assert entry is not None and entry.source_offsets[0] is not None
        return dict(json.loads(entry.source_offsets[0]))

    def calls_to_read(source: Any, reader: CheckpointReader, batch_id: int, files: int) -> int:
        """py4j round trips of the audit's read of the batch; its files checked against the
        stream's (their numbers in the snapshot's order, from its offsets)."""
        what = source.batch_input(reader, batch_id)
        assert what is not None
        with py4j_calls(spark) as count:
            frame = source.read(spark, what)
        after = offset(reader, batch_id - 1)["index"] if batch_id > 0 else -1
        wanted = order[after + 1 : offset(reader, batch_id)["index"] + 1]
        assert len(wanted) == files and frame.count() == files  # one row a file
        assert sorted(r[_FILE] for r in frame.select(_FILE).collect()) == sorted(
            f"file:{table}/{name}" for name in wanted
        ), batch_id
        return count[0]

    small, small_reader, small_batches = stream(10)
    large, large_reader, large_batches = stream(20)
    # each source builds its snapshot once, whatever it reads after
    assert small.files_of(small.batch_input(small_reader, small_batches[2])) is not None
    assert large.files_of(large.batch_input(large_reader, large_batches[1])) is not None
    # the first batch; the next (past the last file of the one before); ones whose batch
    # before was not the last read (their files ranked), late and early in the snapshot
    first = [calls_to_read(small, small_reader, small_batches[0], 10)]
    past = [calls_to_read(small, small_reader, small_batches[1], 10)]
    ranked = [calls_to_read(small, small_reader, small_batches[b], 10) for b in (4, 2)]
    first.append(calls_to_read(large, large_reader, large_batches[0], 20))
    past.append(calls_to_read(large, large_reader, large_batches[1], 20))
    ranked.append(calls_to_read(large, large_reader, large_batches[1], 20))
    assert len(set(first)) == len(set(past)) == len(set(ranked)) == 1, (first, past, ranked)
