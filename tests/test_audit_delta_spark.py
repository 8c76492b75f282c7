"""The late-row audit of Delta Lake streams, against real Spark 4.2 and real Delta 4.4.

Each test writes the out-of-order stream of ``tests/test_audit_spark.py`` into a Delta table, a
commit per input file, runs a production query over ``spark.readStream.format("delta")`` with
the audit on, and checks that what the query emitted plus what the audit recorded is exactly the
input. Batches are cut three ways: a commit per batch (the first batch the table's snapshot),
the snapshot of a finished table cut by ``maxFilesPerTrigger``, and the log from
``startingVersion=0`` cut by ``maxFilesPerTrigger`` inside commits. An ``OPTIMIZE`` between
batches, a table vacuumed under the audit, a delete skipped by ``skipChangeCommits`` and a stream
from a ``startingTimestamp`` are the awkward cases. These tests run in the pyspark 4.2
environment (``nox -s delta``).
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry

import wmwatch
from tests.harness.audited import audited_run, stored
from tests.harness.checks import (
    assert_marks_complete,
    assert_windows_balance,
    check_dedupe,
    dropped_by_watermark,
    final_watermark_ms,
    tumbling_counts,
)
from tests.harness.delta import append
from tests.harness.streams import DELAY, SCHEMA, all_rows, stream_files
from tests.kafka_broker import jar_cache
from wmwatch._checkpoint.reader import CheckpointReader

pytestmark = [pytest.mark.spark, pytest.mark.delta]


def run_delta(
    spark: Any,
    folder: Path,
    build: Callable[[Any], Any],
    *,
    batching: str,
    name: str,
    between: Callable[[int, Path], None] | None = None,
    shape: Callable[[Any], Any] = lambda df: df,
) -> dict[str, Any]:
    """Run ``build(events)`` over a Delta stream of the test input with the audit on.

    ``each``: the table starts with the first file, then a commit per file, a batch per commit
    (``between(i, table)`` runs after commit i); ``snapshot``: every commit (two files each)
    before the query starts, batches of 3 files of the snapshot; ``log``: the same table read
    from ``startingVersion=0``, 3 files per batch, cutting commits. ``shape`` is what the user's
    ``events`` does to the stream before ``withWatermark`` (audited with no ``prepare=``).
    """
    table = folder / "table"
    files = stream_files()
    reader = spark.readStream.format("delta")
    if batching == "each":
        append(spark, table, files[0])
    else:
        for f in files:
            append(spark, table, f, files=2)
        reader = reader.option("maxFilesPerTrigger", 3)
        if batching == "log":
            reader = reader.option("startingVersion", 0)
    events = shape(reader.load(str(table))).withWatermark("ts", DELAY)

    def feed(query: Any) -> None:
        if batching != "each":
            query.awaitTermination(120)
            return
        query.processAllAvailable()
        for i, f in enumerate(files[1:], start=1):
            append(spark, table, f)
            query.processAllAvailable()
            if between is not None:
                between(i, table)
                query.processAllAvailable()

    result = audited_run(
        spark,
        folder,
        build(events),
        events,
        name=name,
        feed=feed,
        available_now=batching != "each",
    )
    return {**result, "files": files}


def delta_offsets(checkpoint: CheckpointReader) -> list[dict[str, Any]]:
    offsets = []
    for batch_id in checkpoint.committed_batches():
        entry = checkpoint.offsets(batch_id)
        assert entry is not None and entry.source_offsets[0] is not None
        offsets.append(json.loads(entry.source_offsets[0]))
    return offsets


def optimize_after_third(i: int, table: Path) -> None:
    if i == 3:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        assert active is not None
        active.sql(f"OPTIMIZE delta.`{table}`").collect()


@pytest.mark.parametrize("batching", ["each", "snapshot", "log"])
def test_window_count_over_delta_conserves_rows(
    delta_spark: Any, stream_dir: Path, batching: str
) -> None:
    from pyspark.sql import functions as F

    result = run_delta(
        delta_spark,
        stream_dir,
        lambda e: e.groupBy(F.window("ts", "10 seconds")).count(),
        batching=batching,
        name=f"delta_tumble_{batching}",
        between=optimize_after_third,
    )
    wm_ms = final_watermark_ms(result["progress"])
    expected = tumbling_counts([r["ts"] for r in all_rows(result["files"])])
    assert_windows_balance(expected, result["output"], result["late"], wm_ms)
    # Spark counts late groups per batch (after merging partial aggregates), not rows
    assert len({(r[0], r[4]) for r in result["late"]}) == dropped_by_watermark(result["progress"])
    assert result["status"]["late_rows"] == len(result["late"])
    assert result["status"]["batches_lost"] == 0
    assert_marks_complete(result)
    for row in result["late"]:
        assert row[7] and row[7].endswith(".parquet")  # the Delta data file it came from
    offsets = delta_offsets(result["checkpoint"])
    if batching == "each":
        # the first batch read the whole snapshot of version 0, so it ends before version 1;
        # OPTIMIZE (dataChange=false) made a batch that read nothing
        assert (offsets[0]["reservoirVersion"], offsets[0]["index"]) == (1, -1)
        assert offsets[0]["isStartingVersion"] is False
        optimize_version = 4  # commits 0-3, then OPTIMIZE
        empty = [
            p
            for p in result["progress"]
            if p["numInputRows"] == 0
            and json.loads(p["sources"][0]["endOffset"])["reservoirVersion"] == optimize_version + 1
            and json.loads(p["sources"][0]["startOffset"])["reservoirVersion"] == optimize_version
        ]
        assert empty, "OPTIMIZE ran no batch of its own"
    else:
        # batches cut inside the snapshot, or inside commits of the log
        assert any(o["index"] not in (-1,) for o in offsets)
        assert any(o["isStartingVersion"] for o in offsets) == (batching == "snapshot")


@pytest.mark.parametrize("batching", ["log"])
def test_drop_duplicates_over_delta_conserves_rows(
    delta_spark: Any, stream_dir: Path, batching: str
) -> None:
    result = run_delta(
        delta_spark,
        stream_dir,
        lambda e: e.dropDuplicates(["user", "ts"]),
        batching=batching,
        name=f"delta_dedupe_{batching}",
    )
    check_dedupe(result, lambda r: (r["user"], r["ts"]), "dedupe")
    assert result["status"]["batches_lost"] == 0


def kept_by_filter(row: dict[str, Any]) -> bool:
    """The filter of the events below, in Python: the ground truth is the rows it keeps."""
    return int(row["id"]) % 3 != 0


@pytest.mark.parametrize(("kind", "batching"), [("dedupe", "each"), ("window", "log")])
def test_events_as_written_over_delta_are_replayed_exactly(
    delta_spark: Any, stream_dir: Path, kind: str, batching: str
) -> None:
    """``events`` that derive a column and filter rows before ``withWatermark`` are audited with
    no ``prepare=``: the audit replays the user's own plan over each batch's Delta files."""
    from pyspark.sql import functions as F

    def shape(df: Any) -> Any:
        return df.withColumn("user", F.upper("user")).filter(F.col("id") % 3 != 0)

    build = (
        (lambda e: e.dropDuplicates(["user", "ts"]))
        if kind == "dedupe"
        else (lambda e: e.groupBy(F.window("ts", "10 seconds")).count())
    )
    result = run_delta(
        delta_spark, stream_dir, build, batching=batching, name=f"delta_as_written_{kind}",
        shape=shape,
    )  # fmt: skip
    result["files"] = [[r for r in f if kept_by_filter(r)] for f in result["files"]]
    assert result["status"]["batches_lost"] == 0 and result["status"]["errors"] == 0
    if kind == "dedupe":
        check_dedupe(result, lambda r: (r["user"].upper(), r["ts"]), "dedupe")
        audited = [json.loads(r[8]) for r in result["late"]]
        # the replay ran the user's withColumn and filter, not the raw table
        assert all(a["user"].isupper() and kept_by_filter(a) for a in audited)
    else:
        wm_ms = final_watermark_ms(result["progress"])
        expected = tumbling_counts([r["ts"] for r in all_rows(result["files"])])
        emitted = {
            (int(w["start"].timestamp() * 1000), int(w["end"].timestamp() * 1000)): r["count"]
            for r in result["output"]
            for w in [r["window"]]
        }
        audited = Counter((r[4], r[5]) for r in result["late"])
        closed = [w for w in expected if w[1] <= wm_ms]
        assert len(closed) >= 4 and audited
        for window in closed:  # the filter's rows only: emitted + audited == what it kept
            assert emitted.get(window, 0) + audited.get(window, 0) == expected[window], window
        late_groups = {(r[0], r[4]) for r in result["late"]}
        assert len(late_groups) == dropped_by_watermark(result["progress"]) > 0
        assert all(kept_by_filter(json.loads(r[8])) for r in result["late"])
    assert_marks_complete(result)


def test_vacuumed_batch_is_lost_with_its_reason_and_later_ones_audited(
    delta_spark: Any, stream_dir: Path
) -> None:
    """A batch whose files VACUUM removed before the audit reached it is counted lost, with
    the reason; the batches after it are audited exactly."""
    spark = delta_spark
    table = stream_dir / "table"
    files = stream_files()
    append(spark, table, files[0])
    events = (
        spark.readStream.format("delta")
        .option("skipChangeCommits", "true")  # the delete below must not stop the stream
        .load(str(table))
        .withWatermark("ts", DELAY)
    )
    name = "delta_vacuum"
    db = stream_dir / "history.duckdb"
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=CollectorRegistry())
    query = (
        events.dropDuplicates(["user", "ts"])
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        handle = watch.audit(query, events)
        query.processAllAvailable()
        append(spark, table, files[1])
        query.processAllAvailable()
        assert handle.sync(120), handle.status()
        handle.stop()  # the audit falls behind from here
        append(spark, table, files[2])  # late rows, in a batch the audit has not reached
        query.processAllAvailable()
        vacuumed_batch = query.lastProgress["batchId"]
        ids = ",".join(str(r["id"]) for r in files[2])
        spark.sql(f"DELETE FROM delta.`{table}` WHERE id IN ({ids})").collect()
        query.processAllAvailable()
        spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
        # LITE: the files come from the log's removes, no listing of the table (quicker)
        spark.sql(f"VACUUM delta.`{table}` LITE RETAIN 0 HOURS").collect()
        handle = watch.audit(query, events)
        # the watermark is at 25 s: the second of these rows is late
        for row in (
            {"id": 500, "user": "z", "ts": "2026-01-01T00:01:00Z"},
            {"id": 501, "user": "z", "ts": "2026-01-01T00:00:01Z"},
        ):
            append(spark, table, [row])
            query.processAllAvailable()
        assert handle.sync(120), handle.status()
        status = handle.status()
        progress = list(query.recentProgress)
        handle.stop()
    finally:
        query.stop()
        watch.close()
    assert status["batches_lost"] == 1
    assert status["last_lost_batch"] == vacuumed_batch
    assert "VACUUM" in status["last_lost_reason"]
    found = stored(db)
    marked = {b for b, *_ in found["marks"]}
    assert vacuumed_batch not in marked
    # every later batch that dropped rows: the audit found exactly Spark's count
    after = [p for p in progress if p["batchId"] > vacuumed_batch]
    dropped = dropped_by_watermark(after)
    assert dropped > 0, "the scenario dropped no rows after the vacuum"
    assert sum(1 for r in found["late"] if r[0] > vacuumed_batch) == dropped


def test_rows_deleted_by_deletion_vectors_are_not_replayed(
    delta_spark: Any, stream_dir: Path
) -> None:
    """A file the stream reads with a deletion vector gives only the rows the vector keeps:
    the audit replays those, never the deleted ones."""
    spark = delta_spark
    table = stream_dir / "table"
    spark.sql(
        f"CREATE TABLE delta.`{table}` (id int, user string, ts timestamp) USING delta "
        "TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')"
    ).collect()
    # a batch each: the first sets the watermark, which the third's late filter uses
    append(spark, table, [{"id": 1, "user": "a", "ts": "2026-01-01T00:00:40Z"}])
    append(spark, table, [{"id": 2, "user": "a", "ts": "2026-01-01T00:00:41Z"}])
    late = [{"id": i, "user": "b", "ts": f"2026-01-01T00:00:0{i - 9}Z"} for i in range(10, 16)]
    append(spark, table, [*late, {"id": 20, "user": "c", "ts": "2026-01-01T00:00:50Z"}])
    spark.sql(f"DELETE FROM delta.`{table}` WHERE id IN (11, 13)").collect()
    commits = sorted((table / "_delta_log").glob("*.json"))
    assert '"deletionVector":{' in commits[-1].read_text(), "DELETE wrote no deletion vector"
    events = (
        spark.readStream.format("delta")
        .option("maxFilesPerTrigger", 1)
        .load(str(table))
        .withWatermark("ts", DELAY)
    )
    db = stream_dir / "history.duckdb"
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=CollectorRegistry())
    query = (
        events.dropDuplicates(["user", "ts"])
        .writeStream.format("memory")
        .queryName("delta_dv")
        .trigger(availableNow=True)
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        handle = watch.audit(query, events)
        query.awaitTermination(120)
        assert handle.sync(120), handle.status()
        progress = list(query.recentProgress)
        handle.stop()
    finally:
        query.stop()
        watch.close()
    audited = sorted(json.loads(r[8])["id"] for r in stored(db)["late"])
    assert audited == [10, 12, 14, 15]
    assert len(audited) == dropped_by_watermark(progress)


def test_stream_stream_join_of_two_delta_tables_balances(
    delta_spark: Any, stream_dir: Path
) -> None:
    """The join scenario of ``tests/test_audit_join_spark.py`` over two Delta tables, a commit
    per side per batch: late rows on both sides, on the watermark, an idle side."""
    from tests.harness.checks import check_join, side_ids
    from tests.harness.joins import PAIRS, range_join
    from tests.harness.streams import ts as join_ts

    spark = delta_spark
    tables = {side: stream_dir / side for side in ("left", "right")}
    for side, columns in (
        ("left", "lid int, lk string, lt timestamp"),
        ("right", "rid int, rk string, rt timestamp"),
    ):
        spark.sql(f"CREATE TABLE delta.`{tables[side]}` ({columns}) USING delta").collect()

    def commit(side: str, rows: list[tuple[int, str, int]]) -> None:
        data = [
            (i, k, datetime.fromisoformat(join_ts(s).replace("Z", "+00:00"))) for i, k, s in rows
        ]
        schema = (
            "lid int, lk string, lt timestamp"
            if side == "left"
            else ("rid int, rk string, rt timestamp")
        )
        spark.createDataFrame(data, schema).coalesce(1).write.format("delta").mode("append").save(
            str(tables[side])
        )

    left = spark.readStream.format("delta").load(str(tables["left"])).withWatermark("lt", DELAY)
    right = spark.readStream.format("delta").load(str(tables["right"])).withWatermark("rt", DELAY)

    def feed(query: Any) -> None:
        for lrows, rrows in PAIRS:
            commit("left", lrows)
            if rrows:
                commit("right", rrows)
            query.processAllAvailable()

    result = audited_run(
        spark,
        stream_dir,
        range_join("inner")(left, right),
        [right, left],
        name="delta_join",
        feed=feed,
    )
    result["late"] = result["late_join"]
    check_join(result, sides=("left", "right"))
    # the same rows as the file-source scenario: 5, 10 and 16 exactly on the watermark
    assert sorted(side_ids(result, "left")) == [4, 5, 9, 10, 12]
    assert sorted(side_ids(result, "right")) == [104, 111, 113]


@pytest.mark.slow
def test_demo_reads_its_events_from_a_delta_table_with_the_audit_balanced(
    delta_spark: Any, tmp_path: Path
) -> None:
    """``wmwatch demo --format delta``: a bronze query lands the events in a Delta table, the
    windowed count reads it as a stream, and the audit finds exactly the groups Spark dropped."""
    import subprocess
    import sys

    workdir = tmp_path / "demo"
    # a Java developer's ~/.m2 as Maven leaves it: a pom without its jar for a version that lost
    # a conflict (Spark's package resolver took the pom and the JVM never started); the demo
    # must not consult it, nor an Ivy cache
    home = tmp_path / "home"
    partial = home / ".m2/repository/org/slf4j/slf4j-api/2.0.13"
    partial.mkdir(parents=True)
    (partial / "slf4j-api-2.0.13.pom").write_text(
        "<project><modelVersion>4.0.0</modelVersion><groupId>org.slf4j</groupId>"
        "<artifactId>slf4j-api</artifactId><version>2.0.13</version></project>"
    )
    env = dict(os.environ)
    env.update(
        HOME=str(home),
        JAVA_TOOL_OPTIONS=f"-Duser.home={home}",  # Java takes its home from the passwd entry
        WMWATCH_JAR_CACHE=str(jar_cache()),  # the jars .ci/fetch_jars.sh fetched
    )
    run = subprocess.run(
        [sys.executable, "-m", "wmwatch.cli", "demo", "--format", "delta", "--duration", "25",
         "--port", "0", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=300, check=False,
        cwd=Path(__file__).parent.parent, env=env,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    assert not (home / ".ivy2.5.2").exists(), "the demo went through Spark's package resolver"
    assert (workdir / "bronze" / "_delta_log").is_dir()
    with duckdb.connect(str(workdir / "wmwatch.duckdb"), read_only=True) as con:
        dropped = dict(
            con.execute(
                "SELECT batch_id, rows_dropped_by_watermark FROM batches "
                "WHERE query_name = 'demo_revenue_per_user'"
            ).fetchall()
        )
        marked = {r[0] for r in con.execute("SELECT batch_id FROM audit_batches").fetchall()}
        late = con.execute(
            "SELECT batch_id, epoch_ms(window_start_at), json_extract_string(row_data, 'user') "
            "FROM late_rows"
        ).fetchall()
    assert late, "the demo's stream produced no late rows"
    assert set(dropped) <= marked, "batches the query ran that the audit did not mark"
    # Spark counts late groups (window, user) per batch; the audit found exactly their rows
    groups = Counter(batch_id for batch_id, _ in {(b, (w, u)) for b, w, u in late})
    for batch_id, count in dropped.items():
        assert groups.get(batch_id, 0) == (count or 0), batch_id


def test_column_added_mid_stream_stops_the_stream_and_the_restart_is_audited_exactly(
    delta_spark: Any, stream_dir: Path
) -> None:
    """A commit that adds a column (``mergeSchema`` on append) stops Delta's stream (Delta
    4.4 fails it on any schema change, additive too, and asks for a restart); the restarted
    query reads the new schema. The audit, behind when the stream stopped, counts every late row
    of both runs exactly as Spark dropped it, never a false one: the restarted audit replays the
    batches read before the change without the new column (null, as Delta reads older files)
    and those after it with it."""
    spark = delta_spark
    table = stream_dir / "table"
    files = stream_files()
    append(spark, table, files[0])
    db = stream_dir / "history.duckdb"
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=CollectorRegistry())
    checkpoint = str(stream_dir / "checkpoint")

    def start(name: str) -> tuple[Any, Any]:
        events = spark.readStream.format("delta").load(str(table)).withWatermark("ts", DELAY)
        query = (
            events.dropDuplicates(["user", "ts"])
            .writeStream.format("parquet")  # the memory sink cannot restart
            .queryName(name)
            .option("path", str(stream_dir / "out"))
            .option("checkpointLocation", checkpoint)
            .start()
        )
        return query, watch.audit(query, events)

    def widened(rows: list[dict[str, Any]]) -> None:
        data = [
            (r["id"], r["user"], datetime.fromisoformat(r["ts"].replace("Z", "+00:00")), "app")
            for r in rows
        ]
        frame = spark.createDataFrame(data, f"{SCHEMA}, origin string").coalesce(1)
        frame.write.format("delta").mode("append").option("mergeSchema", "true").save(str(table))

    progress: list[dict[str, Any]] = []
    try:
        query, handle = start("delta_schema_1")
        query.processAllAvailable()
        append(spark, table, files[1])
        query.processAllAvailable()
        assert handle.sync(120), handle.status()
        handle.stop()  # the audit falls behind: the restart audits the batches before the change
        append(spark, table, files[2])
        query.processAllAvailable()
        widened(files[3])
        failure = None
        try:
            query.processAllAvailable()
        except Exception as exc:  # noqa: BLE001 - what Delta does is the finding
            failure = str(exc)
        progress += list(query.recentProgress)
        first = handle.status()
        handle.stop()
        query.stop()
        query, handle = start("delta_schema_2")
        query.processAllAvailable()
        for f in files[4:]:
            widened(f)
            query.processAllAvailable()
        assert handle.sync(120), handle.status()
        second = handle.status()
        progress += list(query.recentProgress)
        handle.stop()
    finally:
        for q in spark.streams.active:
            q.stop()
        watch.close()
    found = stored(db)
    # Delta 4.4 stops the stream at the additive change and asks for a restart
    assert failure is not None and "DELTA_SCHEMA_CHANGED_WITH_VERSION" in failure
    for status in (first, second):
        assert status["errors"] == 0 and status["batches_lost"] == 0, status
    late = [(r[0], json.loads(r[8])) for r in found["late"]]
    ids = [row["id"] for _, row in late]
    assert len(ids) == len(set(ids)), "a late row audited twice"
    # Spark's count batch by batch across both runs
    per_batch = Counter(b for b, _ in late)
    dropped = {p["batchId"]: dropped_by_watermark([p]) for p in progress}
    assert sum(dropped.values()) == len(late) > 0
    for batch, count in dropped.items():
        assert per_batch.get(batch, 0) == count, batch
    # the restart audited batches read before the change (no origin) and after it (with it)
    restarted = [row for b, row in late if b > first["last_audited_batch"]]
    assert any("origin" not in row for row in restarted)
    assert any(row.get("origin") == "app" for row in restarted)
    assert_marks_complete({**found, "checkpoint": CheckpointReader(checkpoint)})


def commit_time_ms(table: Path, version: int) -> int:
    """A commit's time as Delta reads it: its in-commit timestamp when the table writes them,
    else its log file's modification time (in ms, as Hadoop reports it)."""
    log = table / "_delta_log" / f"{version:020d}.json"
    for line in log.read_text().splitlines():
        info = json.loads(line).get("commitInfo")
        if info is not None and "inCommitTimestamp" in info:
            return int(info["inCommitTimestamp"])
    return log.stat().st_mtime_ns // 1_000_000


def iso_ms(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.mark.parametrize("at", ["between", "on"])
def test_stream_from_a_starting_timestamp_is_audited_from_the_version_delta_starts_at(
    delta_spark: Any, stream_dir: Path, at: str
) -> None:
    """``startingTimestamp`` between two commits' times starts the stream at the later commit
    (``on`` a commit's time: at that commit); the audit replays its first batch from exactly
    that version, and with its late rows equals Spark's count of dropped rows."""
    from wmwatch._audit.replay.sources.delta import DeltaBatchSource, delta_spec_of

    spark = delta_spark
    table = stream_dir / "table"
    # commits 0 and 1 are before the start: their rows would be late if the audit read them
    append(spark, table, [{"id": 1, "user": "a", "ts": "2026-01-01T00:00:01Z"}])
    append(spark, table, [{"id": 2, "user": "a", "ts": "2026-01-01T00:00:02Z"}])
    time.sleep(0.05)  # commit 2's time is strictly after commit 1's
    append(spark, table, [{"id": 3, "user": "a", "ts": "2026-01-01T00:00:40Z"}])
    late = [{"id": i, "user": "b", "ts": f"2026-01-01T00:00:0{i - 9}Z"} for i in range(10, 16)]
    append(spark, table, [*late, {"id": 20, "user": "c", "ts": "2026-01-01T00:00:50Z"}], files=2)
    before, start = commit_time_ms(table, 1), commit_time_ms(table, 2)
    assert start > before + 1
    starting = iso_ms((before + start) // 2 if at == "between" else start)
    events = (
        spark.readStream.format("delta")
        .option("startingTimestamp", starting)
        .option("maxFilesPerTrigger", 1)
        .load(str(table))
        .withWatermark("ts", DELAY)
    )
    db = stream_dir / "history.duckdb"
    watch = wmwatch.attach(spark, db=str(db), metrics_port=None, registry=CollectorRegistry())
    query = (
        events.dropDuplicates(["user", "ts"])
        .writeStream.format("memory")
        .queryName(f"delta_start_ts_{at}")
        .trigger(availableNow=True)
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        handle = watch.audit(query, events)
        query.awaitTermination(120)
        assert handle.sync(120), handle.status()
        progress = list(query.recentProgress)
        output = {r["id"] for r in spark.table(f"delta_start_ts_{at}").collect()}
        handle.stop()
    finally:
        query.stop()
        watch.close()
    found = stored(db)
    audited = sorted(json.loads(r[8])["id"] for r in found["late"])
    assert audited and len(audited) == dropped_by_watermark(progress)
    # every row from commit 2 on is either emitted or audited late; none before it is either
    assert sorted([*output, *audited]) == [3, *range(10, 16), 20]
    checkpoint = CheckpointReader(str(stream_dir / "checkpoint"))
    assert_marks_complete({**found, "checkpoint": checkpoint})
    # the replay of the first batch reads commit 2 (not a snapshot, not commits 0 and 1)
    spec = delta_spec_of({"startingTimestamp": starting}, [str(table)], events.schema.json())
    source = DeltaBatchSource(spec, 0, spark)
    first = source.batch_input(checkpoint, 0)
    files = source.files_of(first) if first is not None else None
    assert files is not None and files.versions == {2}


def test_demo_fetches_deltas_two_jars_checks_them_and_then_uses_its_cache(tmp_path: Path) -> None:
    """``wmwatch demo --format delta`` fetches Delta's jars itself (never Spark's package
    resolver): from a Maven repository on loopback laid out as Maven Central, serving the jars
    Maven Central serves; checked against the pinned SHA-256; a second start asks nothing."""
    import http.server
    import shutil
    import threading
    from functools import partial

    from wmwatch._cli.spark_start import DELTA_JARS, delta_jars

    repository = tmp_path / "maven2"
    for name, (folder, _) in DELTA_JARS.items():
        (repository / folder).mkdir(parents=True)
        shutil.copy(jar_cache() / "delta" / name, repository / folder / name)
    asked: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
            asked.append(self.path)

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), partial(Handler, directory=str(repository))
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        cache = tmp_path / "cache"
        jars = delta_jars(cache=cache, repository=url)
        assert [j.name for j in jars] == list(DELTA_JARS)
        assert all(j.read_bytes() == (jar_cache() / "delta" / j.name).read_bytes() for j in jars)
        assert len(asked) == 2
        assert delta_jars(cache=cache, repository=url) == jars
        assert len(asked) == 2, "a second start fetched again"
    finally:
        server.shutdown()
        server.server_close()
