"""A driver on a Spark standalone cluster, with wmwatch attached: what it saw, as JSON.

    python tests/scripts/cluster_run.py <master URL> <folder>

Runs in a process of its own (one SparkContext per process; the test session's is local).
Two queries run on the cluster's executors: an audited windowed count over an out-of-order
file stream (the scenario of ``tests/test_audit_spark.py``), and a stream-stream join whose two
inputs have watermarks but no time condition (state never cleaned). The last stdout line is one
JSON document with what the metrics endpoint, the history, the plan plugin and the audit gave.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _session(master: str) -> Any:
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(master)
        .appName("wmwatch-cluster-test")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.executor.cores", "1")
        .config("spark.executor.memory", "512m")
        .config("spark.cores.max", "1")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.scheduler.mode", "FAIR")
        .config("spark.sql.adaptive.enabled", "false")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _windows(spark: Any, watch: Any, folder: Path) -> dict[str, Any]:
    """The audited windowed count; the audit's balance window by window."""
    from pyspark.sql import functions as F

    from tests.harness.streams import SCHEMA, stream_files, write_events

    (folder / "in").mkdir(parents=True)
    events = (
        spark.readStream.schema(SCHEMA).json(str(folder / "in")).withWatermark("ts", "10 seconds")
    )
    query = (
        events.groupBy(F.window("ts", "10 seconds"))
        .count()
        .writeStream.format("memory")
        .queryName("cluster_windows")
        .outputMode("append")
        .option("checkpointLocation", str(folder / "checkpoint"))
        .start()
    )
    try:
        audit = watch.audit(query, events, poll_interval_seconds=0.2)
        for rows in stream_files():
            write_events(folder / "in", rows)
            query.processAllAvailable()
        synced = audit.sync(180)
        status = audit.status()
        output = [r.asDict(recursive=True) for r in spark.table("cluster_windows").collect()]
        progress = list(query.recentProgress)
    finally:
        query.stop()
    return {
        "synced": synced,
        "status": status,
        "output": output,
        "progress": progress,
        "query_id": str(query.id),
    }


def _join(spark: Any, folder: Path) -> Any:
    from pyspark.sql import functions as F

    from tests.harness.streams import write_events

    def side(name: str, prefix: str) -> Any:
        (folder / name).mkdir(parents=True)
        frame = (
            spark.readStream.schema("k INT, ts TIMESTAMP")
            .json(str(folder / name))
            .withWatermark("ts", "10 seconds")
        )
        return frame.select(F.col("k").alias(f"{prefix}k"), F.col("ts").alias(f"{prefix}ts"))

    joined = side("l", "l").join(side("r", "r"), F.expr("lk = rk"), "inner")
    query = (
        joined.writeStream.format("noop")
        .queryName("cluster_join")
        .option("checkpointLocation", str(folder / "checkpoint"))
        .start()
    )
    for batch in range(4):
        for name in ("l", "r"):
            rows = [
                {"k": batch * 10 + j, "ts": f"2026-01-01T00:{batch:02d}:{j * 5:02d}Z"}
                for j in range(3)
            ]
            write_events(folder / name, rows)
        query.processAllAvailable()
    return query


def main(master: str, folder: Path) -> int:
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    import duckdb

    import wmwatch
    from tests.harness.checks import batch_window_counts, final_watermark_ms
    from tests.harness.net import free_port, scrape
    from wmwatch._inspect.plugin import PlanPlugin

    folder.mkdir(parents=True, exist_ok=True)
    spark = _session(master)
    facts: dict[str, Any] = {"master": spark.sparkContext.master}
    port = free_port()
    db = folder / "h.duckdb"
    watch = wmwatch.attach(spark, db=str(db), metrics_port=port, strict=True)
    plugin = next(p for p in watch.plugins() if isinstance(p, PlanPlugin))
    join = None
    try:
        windows = _windows(spark, watch, folder / "windows")
        # executors registered with the driver, each a JVM of its own (the driver is not one)
        ids = spark.sparkContext._jsc.sc().getExecutorIds()
        facts["executors"] = [str(ids.apply(i)) for i in range(ids.size())]
        join = _join(spark, folder / "join")
        watch.flush()
        plugin.wait_idle()
        summary = plugin.summary()["cluster_join"]
        facts["join_findings"] = sorted(
            (f["kind"], f["side"], f["status"]) for f in summary["findings"]
        )
        facts["join_sources"] = sorted(
            (Path(s["source"].split("file:")[1].rstrip("]")).name, s["watermark_at"])
            for s in summary["sources"]
        )
        samples = scrape(f"http://127.0.0.1:{port}/metrics")
        facts["metrics"] = sorted(
            {
                f"{name}{{{','.join(f'{k}={v}' for k, v in labels if k in ('query', 'side'))}}}"
                for (name, labels), _ in samples.items()
                if dict(labels).get("query") in ("cluster_windows", "cluster_join")
            }
        )
        facts["late_rows_metric"] = samples.get(
            ("wmwatch_late_rows_audited_total", (("query", "cluster_windows"),))
        )
        join_id = str(join.id)
    finally:
        if join is not None:
            join.stop()
        watch.close()
    facts["audit_synced"] = windows["synced"]
    facts["audit_status"] = windows["status"]
    with duckdb.connect(str(db), read_only=True) as con:
        late = con.execute(
            "SELECT batch_id, epoch_ms(event_time_at), epoch_ms(watermark_at), lateness_seconds, "
            "epoch_ms(window_start_at), epoch_ms(window_end_at) FROM late_rows"
        ).fetchall()
        facts["history_batches"] = dict(
            con.execute("SELECT query_name, count(*) FROM batches GROUP BY ALL").fetchall()
        )
        facts["source_watermarks"] = con.execute(
            "SELECT count(DISTINCT source) FROM source_watermarks WHERE query_id = ?", [join_id]
        ).fetchone()[0]
        facts["findings_rows"] = sorted(
            con.execute(
                "SELECT kind, side, status FROM findings WHERE query_id = ?", [join_id]
            ).fetchall()
        )
        facts["marked_batches"] = con.execute(
            "SELECT count(*) FROM audit_batches WHERE query_id = ?", [windows["query_id"]]
        ).fetchone()[0]
    # the balance: for every closed window, emitted + audited == a batch count over all input
    wm_ms = final_watermark_ms(windows["progress"])
    expected = batch_window_counts(spark, folder / "windows", "10 seconds", "10 seconds")
    emitted = {
        (
            int(r["window"]["start"].timestamp() * 1000),
            int(r["window"]["end"].timestamp() * 1000),
        ): r["count"]
        for r in windows["output"]
    }
    audited = Counter((r[4], r[5]) for r in late)
    closed = [w for w in expected if w[1] <= wm_ms]
    facts["late_rows"] = len(late)
    facts["closed_windows"] = len(closed)
    facts["unbalanced_windows"] = [
        [w[0], w[1], emitted.get(w, 0), audited.get(w, 0), expected[w]]
        for w in closed
        if emitted.get(w, 0) + audited.get(w, 0) != expected[w]
    ]
    spark.stop()
    print(json.dumps(facts, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
