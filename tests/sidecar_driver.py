"""The production application of the sidecar tests: a query over a file stream, in a process of
its own (a different Spark application from the sidecar's).

    python -m tests.sidecar_driver <folder> <shape> files <count> [audit]  # write, run, stop
    python -m tests.sidecar_driver <folder> <shape> run                    # follow until killed

``files`` writes ``count`` small files (:func:`tests.harness.streams.many_files`) to <folder>/in
one at a time, processing each (about one data batch per file, plus the no-data batches Spark
runs), then stops; with ``audit`` the in-job audit writes to <folder>/injob.duckdb. ``run``
processes what arrives until killed. Shapes are the functions of :mod:`tests.sidecar_defs`.
The query writes Parquet to <folder>/out and checkpoints to <folder>/checkpoint; every progress
event is appended to <folder>/progress.jsonl as it comes (Spark's own counts, for the test to
compare). Status lines are JSON on stdout.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from tests.harness.crash import driver_session, record_progress, stop_all
from tests.harness.streams import many_files, write_events


def main(folder: str, shape: str, mode: str, count: str = "0", audit: str = "") -> int:
    os.environ["WMWATCH_SIDECAR_TEST_IN"] = f"{folder}/in"
    import wmwatch
    from tests import sidecar_defs

    spark = driver_session("wmwatch-sidecar-production", master="local[1]")
    events = sidecar_defs.events(spark)
    result = getattr(sidecar_defs, shape)(events)
    record_progress(spark, folder)
    watch = wmwatch.attach(spark, db=f"{folder}/injob.duckdb" if audit else None, metrics_port=None)
    query = (
        result.writeStream.format("parquet")
        .queryName(f"sidecar_{shape}")
        .outputMode("append")
        .option("path", f"{folder}/out")
        .option("checkpointLocation", f"{folder}/checkpoint")
        .start()
    )
    handle = watch.audit(query, events, poll_interval_seconds=0.2) if audit else None
    if mode == "files":
        for rows in many_files(int(count)):
            write_events(Path(folder) / "in", rows)
            query.processAllAvailable()
        ok = handle.sync(300) if handle is not None else True
        ok = watch.flush(30) and ok
        print(json.dumps({"done": ok, "batches": query.lastProgress["batchId"]}), flush=True)
        stop_all(spark, watch, [(query, handle)])
        return 0 if ok else 1
    while True:
        query.processAllAvailable()
        print(json.dumps({"batch": (query.lastProgress or {}).get("batchId")}), flush=True)
        time.sleep(0.2)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:6]))
