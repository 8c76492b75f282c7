"""What the audit's read of one Delta batch costs inside a large first snapshot.

    python benchmarks/bench_delta.py [--files 200000] [--per-batch 1000] [--compare]

A Delta table of ``--files`` data files in one commit (a real table: one small Parquet file,
linked ``--files`` times, and a commit whose ``add`` actions name them), read by a stream with
``maxFilesPerTrigger=--per-batch`` through its whole first snapshot (availableNow, noop sink).
Then the audit's source reads batches again, one at a time, at the start, the middle and the end
of the snapshot (what the replay does: the batch's files worked out, its rows read and counted).
Per batch: seconds, py4j round trips, and the driver's JVM heap and Python RSS after it.

``--compare`` also works out the same batches' files the way the audit did before (the whole
snapshot listed into the driver and sorted there, then an ``exists`` call per file), side by
side in the same run, for the first batch and the last: the ratio is what the change saves.

Delta runs on pyspark 4.2 (no Delta release supports 4.3): run from another pyspark, this script
runs itself again in ``.venv-delta`` (made by ``nox -s delta-env`` when missing). Takes about
half an hour on 2 cores at the default size; ``--tiny`` (2,000 files, 100 per batch) a minute.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the tests' py4j counter, from the repository's root
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from tests.harness.checks import py4j_calls  # noqa: E402 - after the path above


def in_delta_env() -> None:
    """Run again under pyspark 4.2 unless this is it."""
    if importlib.metadata.version("pyspark").startswith("4.2."):
        return
    python = ROOT / ".venv-delta" / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "nox", "-s", "delta-env"], cwd=ROOT, check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "benchmarks")])}
    os.execve(str(python), [str(python), __file__, *sys.argv[1:]], env)


def start_spark() -> Any:
    from pyspark.sql import SparkSession

    cache = Path(os.environ.get("WMWATCH_JAR_CACHE", Path.home() / ".cache/wmwatch/jars"))
    jars = sorted(glob.glob(str(cache / "delta" / "*.jar")))
    if not jars:
        raise SystemExit(f"no Delta jars in {cache / 'delta'}: run bash .ci/fetch_jars.sh first")
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("wmwatch-bench-delta")
        .config("spark.jars", ",".join(jars))
        .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        .config(
            "spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog"
        )
        .config("spark.databricks.delta.snapshotPartitions", "2")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def write_table(spark: Any, table: Path, files: int) -> None:
    """``files`` data files of one row each (hard links of one Parquet file) and the commit
    that adds them, with modification times one millisecond apart."""
    seed = table.parent / "seed"
    spark.range(1).selectExpr(
        "CAST(id AS INT) AS id", "'u' AS user", "TIMESTAMP '2026-01-01 00:00:00' AS ts"
    ).coalesce(1).write.parquet(str(seed))
    (source,) = seed.glob("part-*.parquet")
    size = source.stat().st_size
    (table / "_delta_log").mkdir(parents=True)
    schema = {
        "type": "struct",
        "fields": [
            {"name": "id", "type": "integer", "nullable": True, "metadata": {}},
            {"name": "user", "type": "string", "nullable": True, "metadata": {}},
            {"name": "ts", "type": "timestamp", "nullable": True, "metadata": {}},
        ],
    }
    started_ms = int(time.time() * 1000) - files
    actions = [
        {"protocol": {"minReaderVersion": 1, "minWriterVersion": 2}},
        {
            "metaData": {
                "id": str(uuid.uuid4()),
                "format": {"provider": "parquet", "options": {}},
                "schemaString": json.dumps(schema),
                "partitionColumns": [],
                "configuration": {},
                "createdTime": started_ms,
            }
        },
    ]
    with (table / "_delta_log" / f"{0:020d}.json").open("w") as log:
        for action in actions:
            log.write(json.dumps(action) + "\n")
        for i in range(files):
            name = f"part-{i:06d}-{uuid.uuid4()}-c000.snappy.parquet"
            os.link(source, table / name)
            add = {
                "path": name,
                "partitionValues": {},
                "size": size,
                "modificationTime": started_ms + i,
                "dataChange": True,
                "stats": json.dumps({"numRecords": 1}),
            }
            log.write(json.dumps({"add": add}) + "\n")
    shutil.rmtree(seed)


def run_stream(spark: Any, table: Path, checkpoint: Path, per_batch: int) -> Any:
    """The stream through the whole first snapshot; its events DataFrame."""
    events = (
        spark.readStream.format("delta").option("maxFilesPerTrigger", per_batch).load(str(table))
    )
    query = (
        events.writeStream.format("noop")
        .trigger(availableNow=True)
        .option("checkpointLocation", str(checkpoint))
        .start()
    )
    query.awaitTermination()
    return events


def heap_mib(spark: Any) -> float:
    """The driver JVM's heap in use after a full GC."""
    jvm = spark.sparkContext._jvm
    jvm.java.lang.System.gc()
    runtime = jvm.java.lang.Runtime.getRuntime()
    return (runtime.totalMemory() - runtime.freeMemory()) / 2**20


def rss_mib() -> float:
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def audit_batch(
    spark: Any, source: Any, reader: Any, batch_id: int, per_batch: int
) -> dict[str, Any]:
    """The audit's read of one batch: its files worked out (timed and counted alone), then the
    whole read (files, rows read and counted)."""
    what = source.batch_input(reader, batch_id)
    started = time.perf_counter()
    with py4j_calls(spark) as calls:
        source.files_of(what)
    files_seconds = time.perf_counter() - started
    started = time.perf_counter()
    rows = source.read(spark, what).count()
    seconds = time.perf_counter() - started
    if rows != per_batch:
        raise RuntimeError(f"batch {batch_id} read {rows} rows again, not {per_batch}")
    return {
        "files_seconds": files_seconds,
        "seconds": seconds,
        "py4j": calls[0],
        "heap": heap_mib(spark),
        "rss": rss_mib(),
    }


def in_snapshot(reader: Any, batch_id: int) -> bool:
    entry = reader.offsets(batch_id)
    return entry is not None and bool(json.loads(entry.source_offsets[0])["isStartingVersion"])


def listed_in_driver(spark: Any, table: Path, reader: Any, batch_id: int) -> dict[str, Any]:
    """The batch's files worked out as the audit did before: every file of the snapshot into
    the driver, sorted there, then an exists call per file of the batch."""
    jvm = spark.sparkContext._jvm
    end = json.loads(reader.offsets(batch_id).source_offsets[0])
    after = json.loads(reader.offsets(batch_id - 1).source_offsets[0])["index"] if batch_id else -1
    started = time.perf_counter()
    with py4j_calls(spark) as calls:
        log = jvm.org.apache.spark.sql.delta.DeltaLog.forTable(spark._jsparkSession, str(table))
        none = jvm.scala.Option.empty()
        snapshot = log.getSnapshotAt(end["reservoirVersion"], none, none, False)
        files = list(snapshot.allFiles().collectAsList())
        files.sort(key=lambda f: (int(f.modificationTime()), str(f.path())))
        chosen = files[after + 1 : end["index"] + 1]
        root = jvm.org.apache.hadoop.fs.Path(str(table))
        fs = root.getFileSystem(spark._jsc.hadoopConfiguration())
        for f in chosen:
            if not fs.exists(jvm.org.apache.hadoop.fs.Path(root, f.path())):
                raise RuntimeError(f"{f.path()} is missing")
    seconds = time.perf_counter() - started
    del files, chosen
    return {"files_seconds": seconds, "py4j": calls[0], "heap": heap_mib(spark), "rss": rss_mib()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=200_000)
    parser.add_argument("--per-batch", type=int, default=1000)
    parser.add_argument("--compare", action="store_true", help="also the old way, side by side")
    parser.add_argument("--tiny", action="store_true", help="2,000 files, 100 a batch (CI)")
    args = parser.parse_args()
    if args.tiny:
        args.files, args.per_batch, args.compare = 2000, 100, True
    in_delta_env()

    from _machine import print_machine

    from wmwatch._audit.replay.sources.delta import DeltaBatchSource, delta_spec_of
    from wmwatch._checkpoint.reader import CheckpointReader

    print_machine()
    spark = start_spark()
    work = Path(tempfile.mkdtemp(prefix="wmwatch-bench-delta-"))
    try:
        table, checkpoint = work / "table", work / "checkpoint"
        started = time.perf_counter()
        write_table(spark, table, args.files)
        events = run_stream(spark, table, checkpoint, args.per_batch)
        reader = CheckpointReader(str(checkpoint))
        batches = [b for b in reader.committed_batches() if in_snapshot(reader, b)]
        print(
            f"table of {args.files:,} files, {len(batches)} batches of {args.per_batch:,} inside "
            f"its first snapshot, streamed in {time.perf_counter() - started:.0f} s",
            flush=True,
        )
        spec = delta_spec_of({}, [str(table)], events.schema.json())
        source = DeltaBatchSource(spec, 0, spark)
        middle = len(batches) // 2
        positions = {
            "start": batches[1:4],
            "middle": batches[middle : middle + 3],
            "end": batches[-3:],
        }
        # in order, as the audit reads them: each batch after the one before
        for where, chosen in positions.items():
            for batch_id in chosen:
                figures = audit_batch(spark, source, reader, batch_id, args.per_batch)
                print(
                    f"audit read, {where} of the snapshot, batch {batch_id}: files worked out in "
                    f"{figures['files_seconds']:.2f} s ({figures['py4j']} py4j calls), read in "
                    f"{figures['seconds']:.2f} s; driver heap {figures['heap']:.0f} MiB, Python "
                    f"RSS {figures['rss']:.0f} MiB; load avg {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
        if args.compare:
            for where, batch_id in (("start", batches[1]), ("end", batches[-1])):
                fresh = DeltaBatchSource(spec, 0, spark)
                new = audit_batch(spark, fresh, reader, batch_id, args.per_batch)
                old = listed_in_driver(spark, table, reader, batch_id)
                print(
                    f"side by side, {where} of the snapshot, batch {batch_id}, files worked out: "
                    f"listed into the driver {old['files_seconds']:.1f} s ({old['py4j']:,} py4j "
                    f"calls), picked by Spark {new['files_seconds']:.2f} s ({new['py4j']} py4j "
                    f"calls): {old['files_seconds'] / new['files_seconds']:.1f}x; driver heap "
                    f"after {old['heap']:.0f} vs {new['heap']:.0f} MiB, Python RSS "
                    f"{old['rss']:.0f} vs {new['rss']:.0f} MiB; load avg "
                    f"{os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
