"""Run a watched stream-stream join on a local Spark Connect server; print the plan plugin's view.

Spark Connect starts its own server JVM, so this runs in a subprocess of the test. The client has
no py4j handle on the plan: the join check must come from the ``explain`` text.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

from connect_session import local_connect_session  # noqa: E402 - beside this script


def main(work: Path) -> None:
    from pyspark.sql import functions as F

    import wmwatch
    from wmwatch._inspect.plugin import PlanPlugin

    spark = local_connect_session()
    for side in ("l", "r"):
        (work / side).mkdir()
    watch = wmwatch.attach(spark, db=str(work / "h.duckdb"), metrics_port=None)
    plugin = next(p for p in watch.plugins() if isinstance(p, PlanPlugin))

    def side(name: str, prefix: str) -> object:
        frame = spark.readStream.schema("k INT, ts TIMESTAMP").json(str(work / name))
        frame = frame.withWatermark("ts", "10 seconds")
        return frame.select(F.col("k").alias(f"{prefix}k"), F.col("ts").alias(f"{prefix}ts"))

    left, right = side("l", "l"), side("r", "r")
    one_sided = left.join(right, F.expr("lk = rk AND rts >= lts"), "inner")  # type: ignore[attr-defined]
    query = (
        one_sided.writeStream.format("noop")
        .queryName("connect_join")
        .option("checkpointLocation", str(work / "ck"))
        .start()
    )
    for batch in range(3):
        for name in ("l", "r"):
            rows = [
                {"k": batch * 10 + j, "ts": f"2026-01-01T00:{batch:02d}:{j * 5:02d}Z"}
                for j in range(3)
            ]
            (work / name / f"{batch}.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
        query.processAllAvailable()
    last = query.lastProgress
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        snap = watch.latest("connect_join")
        if snap is not None and snap.batch_id >= last["batchId"]:
            break
        time.sleep(0.1)
    watch.flush(timeout=20)
    plugin.wait_idle(timeout=20)
    summary = plugin.summary().get("connect_join", {})
    result = {
        "joins": summary.get("joins"),
        "operators": summary.get("operators"),
        "findings": sorted((f["kind"], f["side"]) for f in summary.get("findings", [])),
        "via": [f["evidence"].get("via") for f in summary.get("findings", [])],
    }
    query.stop()
    watch.close()
    spark.stop()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
