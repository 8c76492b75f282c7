"""The audit as a sidecar, against real Spark: the production query runs in another application
(``tests/sidecar_driver.py``, a process of its own), the sidecar reads its checkpoint.

- Of a stopped query: the sidecar (the real CLI, in this test session) finds exactly the rows
  the in-job audit of the same run found, and leaves every checkpoint file byte for byte as it
  was, with no streaming query of its own.
- Of a running query: the sidecar (the real CLI, a process of its own) keeps up; SIGKILLing the
  production driver and then the sidecar, and restarting each, loses and duplicates nothing:
  every committed batch is marked once and each batch's late rows equal Spark's own count.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import duckdb
import pytest
from typer.testing import CliRunner

import wmwatch
from tests import sidecar_defs
from tests.harness.cli import sidecar
from tests.harness.crash import (
    finish,
    recorded_progress,
    spark_dropped_by_batch,
    start_driver,
    status_lines,
    wait_for_status,
)
from tests.harness.handmade import fake_checkpoint
from tests.harness.streams import many_files, write_events
from tests.sidecar_defs import IN_VARIABLE
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch._errors import AuditError, ConfigError
from wmwatch.cli import app

pytestmark = pytest.mark.spark

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()
# 2026-01-01T00:00:00Z, where the tests' event times start
_T0_MS = 1_767_225_600_000
_LATE = (
    "SELECT batch_id, epoch_ms(event_time_at), epoch_ms(watermark_at), "
    "epoch_ms(window_start_at), epoch_ms(window_end_at), operator_kind, operator_index, "
    "source_index, source_file, row_data::VARCHAR FROM late_rows ORDER BY ALL"
)


def _driver(folder: Path, shape: str, *args: str) -> subprocess.Popen[str]:
    return start_driver("tests.sidecar_driver", str(folder), shape, *args)


def _sidecar(folder: Path, shape: str) -> subprocess.Popen[str]:
    """The real CLI in a process (an application) of its own, following the query; its
    stderr goes to <folder>/sidecar.log."""
    with (folder / "sidecar.log").open("a") as log:
        return _sidecar_process(folder, shape, log)


def _sidecar_process(folder: Path, shape: str, log: Any) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "wmwatch.cli",
            "sidecar",
            "--checkpoint",
            str(folder / "checkpoint"),
            "--events",
            "tests.sidecar_defs:events",
            "--query",
            f"tests.sidecar_defs:{shape}",
            "--db",
            str(folder / "side.duckdb"),
            "--name",
            f"sidecar_{shape}",
            "--master",
            "local[1]",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.driver.memory=512m",
            "--conf",
            "spark.sql.shuffle.partitions=1",
            "--poll",
            "0.2",
            "--json",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
        env={
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": str(ROOT),
            IN_VARIABLE: str(folder / "in"),
        },
    )


def _wait_for(
    lines: queue.Queue[dict[str, Any] | None], wanted: Callable[[dict[str, Any]], bool]
) -> dict[str, Any]:
    return wait_for_status(lines, wanted, timeout=300)  # guards against a hang only


def _hashes(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (names included) and its SHA-256."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _streams_started(spark: Any) -> tuple[list[str], Any]:
    """A listener on ``spark`` that records every streaming query started in it, and the
    listener (to remove)."""
    from pyspark.sql.streaming import StreamingQueryListener

    started: list[str] = []

    class Started(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:  # noqa: N802
            started.append(str(event.id))

        def onQueryProgress(self, event: Any) -> None:  # noqa: N802
            pass

        def onQueryIdle(self, event: Any) -> None:  # noqa: N802
            pass

        def onQueryTerminated(self, event: Any) -> None:  # noqa: N802
            pass

    listener = Started()
    spark.streams.addListener(listener)
    return started, listener


@pytest.mark.slow(minutes=4)
def test_sidecar_of_a_stopped_query_finds_what_the_in_job_audit_found(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "in").mkdir()
    production = _driver(tmp_path, "window", "files", "35", "audit")
    done = _wait_for(status_lines(production), lambda s: "done" in s)
    assert production.wait(120) == 0 and done["done"] is True
    checkpoint = tmp_path / "checkpoint"
    before = _hashes(checkpoint)
    committed = CheckpointReader(str(checkpoint)).committed_batches()
    assert len(committed) >= 35

    started, listener = _streams_started(spark)
    monkeypatch.setenv(IN_VARIABLE, str(tmp_path / "in"))
    command = [
        "sidecar",
        "--checkpoint",
        str(checkpoint),
        "--events",
        "tests.sidecar_defs:events",
        "--query",
        "tests.sidecar_defs:window",
        "--db",
        str(tmp_path / "side.duckdb"),
        "--name",
        "orders",
        "--once",
        "--json",
    ]
    result = runner.invoke(app, command)
    assert result.exit_code == 0, result.stderr
    final = json.loads(result.stdout.splitlines()[-1])
    assert final["final"] and final["last_audited_batch"] == committed[-1]
    assert final["batches_audited"] == len(committed)
    # run again: it resumes after the batches its history marks, so it audits none twice
    again = runner.invoke(app, command)
    spark.streams.removeListener(listener)
    assert again.exit_code == 0, again.stderr
    final = json.loads(again.stdout.splitlines()[-1])
    assert final["batches_audited"] == 0 and final["last_audited_batch"] == committed[-1]
    # nothing of the sidecar ran as a streaming query, and not one checkpoint file changed
    assert started == []
    assert _hashes(checkpoint) == before

    with duckdb.connect(str(tmp_path / "injob.duckdb"), read_only=True) as con:
        injob = con.execute(_LATE).fetchall()
        injob_marks = con.execute(
            "SELECT batch_id, late_rows FROM audit_batches ORDER BY 1"
        ).fetchall()
    with duckdb.connect(str(tmp_path / "side.duckdb"), read_only=True) as con:
        side = con.execute(_LATE).fetchall()
        side_marks = con.execute(
            "SELECT batch_id, late_rows FROM audit_batches ORDER BY 1"
        ).fetchall()
    assert len(injob) >= 20, "the scenario produced too few late rows"
    assert side == injob  # same batches, rows, watermarks, windows, files, row data
    assert side_marks == injob_marks
    assert [b for b, _ in side_marks] == committed

    # the report reads the sidecar's history like the in-job audit's
    report = runner.invoke(
        app, ["report", "--db", str(tmp_path / "side.duckdb"), "--format", "json"]
    )
    assert report.exit_code == 0, report.stderr
    (query,) = json.loads(report.stdout)["queries"]
    assert query["query"] == "orders" and query["status"] == "unknown"
    assert query["late_rows"]["late_rows"] == len(injob)
    assert query["late_rows"]["audited_batches"] == len(committed)
    # ... and its batch history, read from the checkpoint as each batch was audited, agrees
    # with the in-job run's listener batch by batch (ids, watermarks, the late-row filter's)
    batches = (
        "SELECT batch_id, epoch_ms(watermark_at), epoch_ms(late_watermark_at), "
        "(SELECT list(operator_name ORDER BY operator_id) FROM operators o "
        "WHERE o.query_id = b.query_id AND o.batch_id = b.batch_id) "
        "FROM batches b ORDER BY batch_id"
    )
    with duckdb.connect(str(tmp_path / "injob.duckdb"), read_only=True) as con:
        listener = con.execute(batches).fetchall()
    with duckdb.connect(str(tmp_path / "side.duckdb"), read_only=True) as con:
        side_batches = con.execute(batches).fetchall()
        runs = con.execute("SELECT DISTINCT run_id FROM batches").fetchall()
    assert [row[0] for row in side_batches] == committed  # each batch once, after two runs
    assert runs == [("checkpoint",)]
    assert len(listener) >= 50 and {row[0] for row in listener} <= set(committed)
    assert [row for row in side_batches if row[0] in {r[0] for r in listener}] == listener
    assert len({row[1] for row in listener}) > 10  # the watermark moved
    assert query["batches"] == len(committed)
    assert query["first_batch_id"] == committed[0] and query["last_batch_id"] == committed[-1]
    assert query["watermark_at"] is not None
    with duckdb.connect(str(tmp_path / "injob.duckdb"), read_only=True) as con:
        (last_watermark_ms,) = con.execute(
            "SELECT epoch_ms(watermark_at) FROM batches ORDER BY batch_id DESC LIMIT 1"
        ).fetchone() or (None,)
    assert side_batches[-1][1] == last_watermark_ms
    shown = runner.invoke(app, ["report", "--db", str(tmp_path / "side.duckdb")])
    assert shown.exit_code == 0, shown.stderr
    assert "none in this period" not in shown.stdout and "watermark" in shown.stdout
    page = tmp_path / "side.html"
    html = runner.invoke(
        app, ["report", "--db", str(tmp_path / "side.duckdb"), "--format", "html", "-o", str(page)]
    )
    assert html.exit_code == 0, html.stderr
    assert "none in this period" not in page.read_text()


@pytest.mark.slow(minutes=3.5)
def test_sidecar_keeps_up_with_a_running_query_through_sigkills(spark: Any, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    files = many_files(24)
    checkpoint = tmp_path / "checkpoint"

    def write(index: int) -> Path:
        return write_events(tmp_path / "in", files[index])

    def committed_reading(written: Path, proc: subprocess.Popen[str]) -> int:
        deadline = time.monotonic() + 300  # guards against a hang only
        while True:
            assert proc.poll() is None, "the production driver stopped"
            reader = CheckpointReader(str(checkpoint))
            for batch_id in reversed(reader.committed_batches()):
                if any(Path(f.path).name == written.name for f in reader.batch_files(batch_id)):
                    return batch_id
            assert time.monotonic() < deadline, f"no committed batch read {written.name}"
            time.sleep(0.05)

    def progress_recorded(batch_id: int) -> None:
        """Wait until the driver recorded Spark's progress of ``batch_id``: a kill after it can
        cut off only the progress of batches that read no input (checked at the end)."""
        deadline = time.monotonic() + 120  # guards against a hang only
        while batch_id not in recorded_progress(tmp_path):
            assert time.monotonic() < deadline, f"no progress recorded for batch {batch_id}"
            time.sleep(0.05)

    def audited(lines: queue.Queue[dict[str, Any] | None], batch_id: int) -> None:
        _wait_for(lines, lambda s: (s["last_audited_batch"] or -1) >= batch_id)

    for index in range(4):
        write(index)
    first = _driver(tmp_path, "dedupe", "run")
    committed_reading(write(4), first)  # the query exists (its checkpoint does)
    side = _sidecar(tmp_path, "dedupe")
    second = side2 = None
    try:
        side_lines = status_lines(side)
        batch = committed_reading(write(5), first)
        audited(side_lines, batch)  # the sidecar keeps up with the running query
        # SIGKILL the production driver right after a commit, then restart it
        progress_recorded(committed_reading(write(6), first))
        first.send_signal(signal.SIGKILL)
        assert first.wait(30) == -signal.SIGKILL
        for index in range(7, 10):
            write(index)
        second = _driver(tmp_path, "dedupe", "run")
        batch = committed_reading(write(10), second)
        audited(side_lines, batch)
        # SIGKILL the sidecar right after the production query committed a batch it reads
        for index in range(11, 14):
            write(index)
        committed_reading(write(14), second)
        side.send_signal(signal.SIGKILL)
        assert side.wait(30) == -signal.SIGKILL
        for index in range(15, 20):
            write(index)
        side2 = _sidecar(tmp_path, "dedupe")
        side2_lines = status_lines(side2)
        for index in range(20, 24):
            last = committed_reading(write(index), second)
        audited(side2_lines, last)
        # the production query is done with the input: stop it, let the sidecar catch up
        progress_recorded(last)
        second.send_signal(signal.SIGKILL)
        second.wait(30)
        end = CheckpointReader(str(checkpoint)).committed_batches()[-1]
        audited(side2_lines, end)
        side2.send_signal(signal.SIGTERM)  # a clean stop
        final = _wait_for(side2_lines, lambda s: s.get("final") is True)
        assert side2.wait(60) == 0
        assert final["errors"] == 0
    finally:
        for proc in (first, second, side, side2):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(30)

    reader = CheckpointReader(str(checkpoint))
    committed = reader.committed_batches()
    with duckdb.connect(str(tmp_path / "side.duckdb"), read_only=True) as con:
        marks = dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())
        late = con.execute("SELECT batch_id, row_data::VARCHAR FROM late_rows").fetchall()
    assert sorted(marks) == committed  # every committed batch marked, once (its key)
    ids = [json.loads(data)["id"] for _, data in late]
    assert len(ids) == len(set(ids)) > 5, "a late row twice, or too few late rows"
    per_batch = Counter(b for b, _ in late)
    assert per_batch == Counter({b: n for b, n in marks.items() if n})
    # Spark's own count, batch by batch, across both production runs
    dropped = spark_dropped_by_batch(tmp_path, reader)
    assert {b: per_batch.get(b, 0) for b in committed} == {b: dropped[b] for b in committed}


@pytest.mark.parametrize(
    ("function", "says"),
    [
        ("raises", "raised RuntimeError: no such table: orders; fix the function"),
        ("batch", "is a batch DataFrame; it must be the streaming DataFrame"),
    ],
)
def test_events_that_raise_or_are_not_streaming_are_one_line(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, function: str, says: str
) -> None:
    (tmp_path / "in").mkdir()
    monkeypatch.setenv(IN_VARIABLE, str(tmp_path / "in"))
    checkpoint = fake_checkpoint(tmp_path / "checkpoint")
    code, err = sidecar(
        "--checkpoint",
        str(checkpoint),
        "--events",
        f"tests.sidecar_defs:{function}",
        "--query",
        "tests.sidecar_defs:window",
        "--db",
        str(tmp_path / "side.duckdb"),
    )
    assert code == 2
    assert err.count("\n") == 1 and says in err, err


def test_a_definition_that_is_not_the_checkpoints_query_is_refused(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint of a query with one source, given a definition that reads two, or one
    that reads another folder; and output modes the audit does not take."""
    (tmp_path / "in").mkdir()
    write_events(tmp_path / "in", many_files(1)[0])
    monkeypatch.setenv(IN_VARIABLE, str(tmp_path / "in"))
    events = sidecar_defs.events(spark)
    query = (
        events.dropDuplicates(["user", "ts"])
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    other = sidecar_defs.events(spark)
    both = events.unionByName(other).dropDuplicates(["user", "ts"])
    with wmwatch.attach(spark, db=str(tmp_path / "side.duckdb"), metrics_port=None) as watch:
        with pytest.raises(AuditError, match=r"reads 1 source\(s\) but .* reads 2"):
            watch.audit_checkpoint(tmp_path / "checkpoint", [events, other], both)
        (tmp_path / "elsewhere").mkdir()
        monkeypatch.setenv(IN_VARIABLE, str(tmp_path / "elsewhere"))
        wrong = sidecar_defs.events(spark)  # one source, as the checkpoint's, but not its folder
        with pytest.raises(AuditError, match=r"read .*/in/part-\d+\.json, which is not under"):
            watch.audit_checkpoint(tmp_path / "checkpoint", wrong, sidecar_defs.dedupe(wrong))
        with pytest.raises(AuditError, match="complete output mode"):
            watch.audit_checkpoint(tmp_path / "checkpoint", events, output_mode="complete")
        with pytest.raises(ConfigError, match="give the query's DataFrame"):
            watch.audit_checkpoint(tmp_path / "checkpoint", events)
        with pytest.raises(ConfigError, match="output_mode='sorted'"):
            watch.audit_checkpoint(tmp_path / "checkpoint", events, output_mode="sorted")


def test_batches_purged_before_the_sidecar_reached_them_are_lost_with_the_reason(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The production query keeps 2 batches of offsets and commits; the sidecar starts after it
    stopped: every batch it can no longer read is counted lost, with the reason, and every
    other one audited."""
    (tmp_path / "in").mkdir()
    monkeypatch.setenv(IN_VARIABLE, str(tmp_path / "in"))
    production = spark.newSession()  # another session: its own retention setting
    production.conf.set("spark.sql.streaming.minBatchesToRetain", "2")
    query = (
        sidecar_defs.dedupe(sidecar_defs.events(production))
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        for rows in many_files(5):
            write_events(tmp_path / "in", rows)
            query.processAllAvailable()
    finally:
        query.stop()
    committed = CheckpointReader(str(tmp_path / "checkpoint")).committed_batches()
    assert committed[0] >= 2, "Spark purged no batch: the scenario lost its point"
    events = sidecar_defs.events(spark)
    with wmwatch.attach(spark, db=str(tmp_path / "side.duckdb"), metrics_port=None) as watch:
        handle = watch.audit_checkpoint(
            tmp_path / "checkpoint", events, sidecar_defs.dedupe(events), poll_interval_seconds=0.2
        )
        assert handle.sync(120), handle.status()
        status = handle.status()
        handle.stop()
    with duckdb.connect(str(tmp_path / "side.duckdb"), read_only=True) as con:
        rows = con.execute("SELECT batch_id FROM audit_batches ORDER BY 1").fetchall()
    marked = [b for (b,) in rows]
    # every batch id from 0 on is either audited (marked) or lost, never both, never neither
    assert status["batches_lost"] >= committed[0]
    assert status["batches_lost"] + len(marked) == committed[-1] + 1
    assert marked == list(range(committed[-1] + 1 - len(marked), committed[-1] + 1))
    assert "minBatchesToRetain" in status["last_lost_reason"]


def test_what_spark_dropped_from_an_unreadable_source_is_unknown_never_zero(
    spark: Any, tmp_path: Path
) -> None:
    """A rate source cannot read a batch again, and the sidecar has no progress: the rows Spark
    dropped from it are stored as unknown (NULL) in each batch's marker and reported so, never
    as 0; the metrics are exported as for the in-job audit."""
    from prometheus_client import CollectorRegistry
    from pyspark.sql import functions as F

    from tests.harness.checks import dropped_by_watermark

    def rate_events() -> Any:
        rate = spark.readStream.format("rate").option("rowsPerSecond", 40).load()
        late = F.when(F.col("value") % 5 == 0, F.expr("INTERVAL 30 SECONDS")).otherwise(
            F.expr("INTERVAL 0 SECONDS")
        )
        return rate.select("value", (F.col("timestamp") - late).alias("ts")).withWatermark(
            "ts", "2 seconds"
        )

    def counts(events: Any) -> Any:
        return events.groupBy(F.window("ts", "2 seconds")).count()

    query = (
        counts(rate_events())
        .writeStream.format("noop")
        .outputMode("append")
        .trigger(processingTime="1 second")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .start()
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not dropped_by_watermark(query.recentProgress):
            time.sleep(0.5)
    finally:
        query.stop()
    assert dropped_by_watermark(query.recentProgress) > 0, "the scenario dropped nothing"
    db = tmp_path / "side.duckdb"
    registry = CollectorRegistry()
    events = rate_events()
    with wmwatch.attach(spark, db=str(db), metrics_port=None, registry=registry) as watch:
        handle = watch.audit_checkpoint(
            tmp_path / "checkpoint",
            events,
            counts(events),
            name="rates",
            poll_interval_seconds=0.2,
        )
        assert handle.sync(60), handle.status()
        status = handle.status()
        late_total, lost_total = (
            registry.get_sample_value(name, {"query": "rates"})
            for name in ("wmwatch_late_rows_audited_total", "wmwatch_audit_batches_lost_total")
        )
        handle.stop()
    (only,) = status["inputs"]
    assert "cannot be replayed batch by batch" in only["payload_missing"]
    assert late_total == 0 and lost_total == 0 and status["errors"] == 0
    with duckdb.connect(str(db), read_only=True) as con:
        inputs = [
            json.loads(text)
            for (text,) in con.execute(
                "SELECT late_rows_by_input::VARCHAR FROM audit_batches "
                "WHERE late_rows_by_input IS NOT NULL"
            ).fetchall()
        ]
    assert inputs, "no batch marker lists the unreadable input"
    assert all(entry["rows"] is None for marker in inputs for entry in marker)
    result = runner.invoke(app, ["report", "--db", str(db), "--format", "json"])
    assert result.exit_code == 0, result.stderr
    (reported,) = json.loads(result.stdout)["queries"]
    (missing,) = reported["late_rows"]["without_payload"]
    assert missing["rows_dropped"] is None and missing["batches_uncounted"] >= 1


@pytest.mark.kafka
@pytest.mark.slow(minutes=3)
def test_sidecar_of_a_kafka_query_finds_what_spark_dropped(
    spark: Any, kafka: str, tmp_path: Path
) -> None:
    """A query over Kafka (the real broker) run to the end in another application with the
    in-job audit; the sidecar, a process of its own with the connector's jars, finds the same
    late records, per batch what Spark dropped, and the same batches and watermarks."""
    from tests.harness.kafka import PARTITIONS, new_topic, produce, records
    from tests.kafka_broker import connector_jars
    from tests.sidecar_defs import KAFKA_VARIABLE, TOPIC_VARIABLE

    topic = new_topic(kafka)
    produced = records(seed=83)
    produce(kafka, topic, produced)
    done = finish(
        "tests.audit_kafka_crash_driver",
        *(str(tmp_path), "finish", kafka, topic, "dedupe"),
        timeout=300,
    )
    assert done["errors"] == 0, done
    reader = CheckpointReader(str(tmp_path / "checkpoint"))
    committed = reader.committed_batches()
    before = _hashes(tmp_path / "checkpoint")

    side = subprocess.run(
        [
            sys.executable,
            "-m",
            "wmwatch.cli",
            "sidecar",
            "--checkpoint",
            str(tmp_path / "checkpoint"),
            "--events",
            "tests.sidecar_defs:kafka_events",
            "--query",
            "tests.sidecar_defs:dedupe",
            "--db",
            str(tmp_path / "side.duckdb"),
            "--name",
            "kafka_dedupe",
            "--master",
            "local[1]",
            "--conf",
            f"spark.jars={','.join(connector_jars())}",
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.driver.memory=512m",
            "--conf",
            "spark.sql.shuffle.partitions=1",
            "--conf",
            "spark.sql.session.timeZone=UTC",
            "--once",
            "--timeout",
            "240",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,  # guards against a hang only
        env={
            **os.environ,
            "PYTHONPATH": str(ROOT),
            KAFKA_VARIABLE: kafka,
            TOPIC_VARIABLE: topic,
        },
    )
    assert side.returncode == 0, side.stderr[-2000:]
    final = json.loads(side.stdout.splitlines()[-1])
    assert final["last_audited_batch"] == committed[-1] and final["errors"] == 0, final
    assert _hashes(tmp_path / "checkpoint") == before

    with duckdb.connect(str(tmp_path / "history.duckdb"), read_only=True) as con:
        injob = con.execute(_LATE).fetchall()
        listener = con.execute(
            "SELECT batch_id, epoch_ms(watermark_at), epoch_ms(late_watermark_at) FROM batches "
            "ORDER BY batch_id"
        ).fetchall()
    with duckdb.connect(str(tmp_path / "side.duckdb"), read_only=True) as con:
        found = con.execute(_LATE).fetchall()
        marks = dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())
        side_batches = con.execute(
            "SELECT batch_id, epoch_ms(watermark_at), epoch_ms(late_watermark_at) FROM batches "
            "ORDER BY batch_id"
        ).fetchall()
    assert found == injob  # the same records, batches, watermarks, partitions and offsets
    assert sorted(marks) == committed
    late_ids = [json.loads(row[-1])["id"] for row in found]
    partition_of = {row["id"]: p for p, row in produced}
    assert len({partition_of[i] for i in late_ids}) >= min(2, PARTITIONS)
    # per batch, what Spark itself dropped (the deduplication counts input rows)
    dropped = spark_dropped_by_batch(tmp_path, reader)
    per_batch = Counter(row[0] for row in found)
    assert sum(dropped.values()) == len(found) > 0
    for batch, count in dropped.items():
        assert per_batch.get(batch, 0) == count == marks[batch], batch
    # the batch history from the checkpoint agrees with the in-job listener's
    assert [row[0] for row in side_batches] == committed
    assert [row for row in side_batches if row[0] in {r[0] for r in listener}] == listener
    assert len(listener) >= 5


def _run_to_the_end(result: Any, checkpoint: Path) -> Counter[int]:
    """Run ``result`` over all its input (``availableNow``) into ``checkpoint``, as a
    production query that then stopped; Spark's own count of the rows each batch dropped."""
    query = (
        result.writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(300)
    dropped: Counter[int] = Counter()
    for progress in query.recentProgress:
        for op in progress["stateOperators"]:
            dropped[progress["batchId"]] += op["numRowsDroppedByWatermark"]
    return dropped


def test_damaged_offsets_cost_their_batches_and_the_sidecar_audits_every_other_one(
    spark: Any, tmp_path: Path
) -> None:
    """The damage seen on a copy of a stopped query's checkpoint (``offsets/28`` emptied, the
    newest offsets file overwritten by bytes that are not JSON, which kept the sidecar from
    starting), on a shorter run: a middle offsets file emptied and the newest one overwritten.
    The sidecar starts, counts the emptied batch, the one after it (which starts where the
    emptied one ended, so neither its watermark nor its files are known) and the newest batch
    lost with the reason, retries nothing, and finds in every other batch exactly the rows
    Spark dropped; ``checkpoint-history`` writes every other batch, one warning line per
    damaged file."""
    (tmp_path / "in").mkdir()
    for rows in many_files(16):
        write_events(tmp_path / "in", rows)

    def one_file_a_batch(session: Any) -> Any:
        return (
            session.readStream.schema(sidecar_defs.SCHEMA)
            .option("maxFilesPerTrigger", 1)
            .json(str(tmp_path / "in"))
            .withWatermark("ts", "10 seconds")
        )

    checkpoint = tmp_path / "checkpoint"
    dropped = _run_to_the_end(sidecar_defs.dedupe(one_file_a_batch(spark)), checkpoint)
    reader = CheckpointReader(str(checkpoint))
    committed = reader.committed_batches()
    newest = reader.offset_batches()[-1]
    assert committed == list(range(newest + 1)) and newest >= 15
    middle = newest // 2
    (checkpoint / "offsets" / str(middle)).write_bytes(b"")
    (checkpoint / "offsets" / str(newest)).write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00 not json")
    lost = {middle, middle + 1, newest}
    assert sum(dropped[b] for b in committed if b not in lost) >= 5, "too few late rows"

    events = one_file_a_batch(spark)
    with wmwatch.attach(spark, db=str(tmp_path / "side.duckdb"), metrics_port=None) as watch:
        side = watch.audit_checkpoint(
            checkpoint, events, sidecar_defs.dedupe(events), poll_interval_seconds=0.2
        )
        assert side.sync(300), side.status()
        status = side.status()
        side.stop()
    assert status["errors"] == 0, status["last_error"]  # nothing retried
    assert status["batches_lost"] == len(lost) and status["last_lost_batch"] == newest
    assert (
        f"offsets/{newest} does not start with a log version line" in (status["last_lost_reason"])
    )
    assert status["batches_audited"] == len(committed) - len(lost)
    with duckdb.connect(str(tmp_path / "side.duckdb"), read_only=True) as con:
        marks = dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())
        late = Counter(b for (b,) in con.execute("SELECT batch_id FROM late_rows").fetchall())
    assert sorted(marks) == [b for b in committed if b not in lost]
    assert {b: late.get(b, 0) for b in marks} == {b: dropped[b] for b in marks} == marks

    db = tmp_path / "history.duckdb"
    result = runner.invoke(
        app, ["checkpoint-history", str(checkpoint), "--db", str(db), "--no-state"]
    )
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if "warning:" in line]
    assert len(warnings) == 2, result.output
    assert f"offsets/{middle} is empty" in warnings[0]
    assert f"offsets/{newest} does not start" in warnings[1]
    with duckdb.connect(str(db), read_only=True) as con:
        written = [b for (b,) in con.execute("SELECT batch_id FROM batches ORDER BY 1").fetchall()]
    assert written == [b for b in committed if b not in (middle, newest)]


def test_a_sidecar_whose_session_reads_times_otherwise_is_refused(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The production query parses zone-less times (``to_timestamp``) in its session's zone,
    UTC, which the checkpoint does not record. A sidecar session in Asia/Tokyo would read every
    row 9 hours earlier, all of them behind the watermark: it is refused before it stores a
    row, naming the setting. In UTC the same definition starts and finds, batch by batch,
    exactly the rows Spark dropped. The query drops each file's newest row (a bot's) before its
    watermark: Spark's optimizer moves that filter below the watermark, and the check reads
    the rows as Spark ran them, so it does not refuse the right session."""
    from pyspark.sql import functions as F

    (tmp_path / "in").mkdir()
    for index, rows in enumerate(many_files(10)):
        zoneless = [{**r, "ts": r["ts"].replace("T", " ").rstrip("Z")} for r in rows]
        late_on = datetime(2026, 1, 1) + timedelta(seconds=620 + 4 * index)
        bot = {"id": 1000 + index, "user": "bot", "ts": f"{late_on:%Y-%m-%d %H:%M:%S}"}
        write_events(tmp_path / "in", [*zoneless, bot])

    def events_of(session: Any) -> Any:
        return (
            session.readStream.schema("id int, user string, ts string")
            .option("maxFilesPerTrigger", 1)
            .json(str(tmp_path / "in"))
            .select("id", "user", F.to_timestamp("ts").alias("ts"))
            .withWatermark("ts", "10 seconds")
        )

    def query_of(events: Any) -> Any:
        return sidecar_defs.dedupe(events.where(F.col("user") != "bot"))

    checkpoint = tmp_path / "checkpoint"
    dropped = _run_to_the_end(query_of(events_of(spark)), checkpoint)
    assert sum(dropped.values()) >= 3, "the scenario dropped too few rows"
    latest = CheckpointReader(str(checkpoint)).latest_offsets()
    assert latest is not None and latest.watermark_ms < _T0_MS + 600_000, "bots moved it"

    tokyo = spark.newSession()
    tokyo.conf.set("spark.sql.session.timeZone", "Asia/Tokyo")
    # the difference decides which rows are late: read in Tokyo, every row is behind the
    # first watermark the production query set; read in UTC, few are
    first_ms = min(
        e.watermark_ms
        for b in CheckpointReader(str(checkpoint)).offset_batches()
        if (e := CheckpointReader(str(checkpoint)).offsets(b)) and e.watermark_ms > 0
    )

    def behind(session: Any) -> int:
        times = session.read.schema("ts string").json(str(tmp_path / "in"))
        stamps = times.select(F.unix_millis(F.to_timestamp("ts")).alias("ms"))
        return int(stamps.where(F.col("ms") <= first_ms).count())

    assert behind(tokyo) == 50 > behind(spark)

    events = events_of(tokyo)
    with (
        wmwatch.attach(tokyo, db=str(tmp_path / "tokyo.duckdb"), metrics_port=None) as watch,
        pytest.raises(AuditError) as refused,
    ):
        watch.audit_checkpoint(checkpoint, events, query_of(events))
    message = str(refused.value)
    assert "reads the rows' times otherwise than the production query" in message, message
    assert "spark.sql.session.timeZone=Asia/Tokyo" in message and "\n" not in message
    with duckdb.connect(str(tmp_path / "tokyo.duckdb"), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM audit_batches").fetchone() == (0,)

    events = events_of(spark)
    with (
        wmwatch.attach(spark, db=str(tmp_path / "utc.duckdb"), metrics_port=None) as watch,
        caplog.at_level("INFO", logger="wmwatch.audit"),
    ):
        side = watch.audit_checkpoint(
            checkpoint, events, query_of(events), poll_interval_seconds=0.2
        )
        assert side.sync(300), side.status()
        side.stop()
    checked = [r.getMessage() for r in caplog.records if "read as it read them" in r.getMessage()]
    assert len(checked) == 1, [r.getMessage() for r in caplog.records]
    with duckdb.connect(str(tmp_path / "utc.duckdb"), read_only=True) as con:
        marks = dict(con.execute("SELECT batch_id, late_rows FROM audit_batches").fetchall())
    assert sorted(marks) == CheckpointReader(str(checkpoint)).committed_batches()
    assert marks == {b: dropped[b] for b in marks}
