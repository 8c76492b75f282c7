"""A Spark driver for the audit crash test: run a windowed query with the audit, print status.

    python -m tests.audit_crash_driver <folder> run [shape]     # loop until killed
    python -m tests.audit_crash_driver <folder> finish [shape]  # process what is there, sync

Shapes: ``window`` (the default) counts <folder>/in per 10 s window; ``join`` joins <folder>/l
with <folder>/r on a key and a time range; ``kinds`` runs six queries over <folder>/in (a
session window, an aggregation keyed by the event time, applyInPandasWithState with an
event-time timeout, transformWithStateInPandas in event-time mode, a deduplication over a
Python data source reading the same files, a union of two sources into a deduplication).
One query writes Parquet to <folder>/out and checkpoints to
<folder>/checkpoint; several use <folder>/out-<name> and <folder>/checkpoint-<name>. All audit
into <folder>/history.duckdb.
Status lines are JSON on stdout, one per loop (:func:`tests.harness.crash.serve`).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from tests.harness.crash import FAIR, driver_session, serve


def main(folder: str, mode: str, shape: str = "window") -> int:
    from pyspark.sql import functions as F

    import wmwatch

    spark = driver_session(
        "wmwatch-crash-driver",
        conf={
            **FAIR,
            "spark.sql.streaming.stateStore.providerClass": (
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
            ),
        },
    )

    def read_events() -> Any:
        return (
            spark.readStream.schema("id int, user string, ts timestamp")
            .json(f"{folder}/in")
            .withWatermark("ts", "10 seconds")
        )

    # name -> (result, events, output mode); each has its own checkpoint and output folder
    queries: dict[str, tuple[Any, Any, str]] = {}
    if shape == "join":
        left = (
            spark.readStream.schema("lid int, lk string, lt timestamp")
            .json(f"{folder}/l")
            .withWatermark("lt", "10 seconds")
        )
        right = (
            spark.readStream.schema("rid int, rk string, rt timestamp")
            .json(f"{folder}/r")
            .withWatermark("rt", "10 seconds")
        )
        condition = "lk = rk AND lt BETWEEN rt - INTERVAL 5 SECONDS AND rt + INTERVAL 5 SECONDS"
        queries["join"] = (left.join(right, F.expr(condition)), [left, right], "append")
    elif shape == "kinds":
        session = read_events()
        queries["session"] = (
            session.groupBy("user", F.session_window("ts", "5 seconds")).count(),
            session,
            "append",
        )
        keyed = read_events()
        queries["aggregate"] = (keyed.groupBy("user", "ts").count(), keyed, "append")
        state = read_events()
        queries["state"] = (
            state.groupBy("user").applyInPandasWithState(
                seen_rows, "id int", "n int", "append", "EventTimeTimeout"
            ),
            state,
            "append",
        )
        tws = read_events()
        queries["tws"] = (
            tws.groupBy("user").transformWithStateInPandas(
                statefulProcessor=seen_processor(),
                outputStructType="id int",
                outputMode="Append",
                timeMode="EventTime",
            ),
            tws,
            "append",
        )
        spark.dataSource.register(_lines_source())
        lines = (
            spark.readStream.format("wmwatch_test_lines")
            .option("path", f"{folder}/in")
            .load()
            .withWatermark("ts", "10 seconds")
        )
        queries["pysource"] = (lines.dropDuplicates(["id", "ts"]), lines, "append")
        # one directory read by two sources: each is replayed from its own source log
        first, second = read_events(), read_events()
        queries["union"] = (
            first.unionByName(second).dropDuplicates(["id", "ts"]),
            [first, second],
            "append",
        )
    else:
        source = read_events()
        queries["window"] = (source.groupBy(F.window("ts", "10 seconds")).count(), source, "append")
    watch = wmwatch.attach(spark, db=f"{folder}/history.duckdb", metrics_port=None)
    running = []
    for name, (result, events, mode_) in queries.items():
        # the window and join shapes keep their first layout (one query, plain folder names)
        suffix = "" if len(queries) == 1 else f"-{name}"
        query = (
            result.writeStream.format("parquet")
            .queryName(name)
            .outputMode(mode_)
            .option("path", f"{folder}/out{suffix}")
            .option("checkpointLocation", f"{folder}/checkpoint{suffix}")
            .start()
        )
        running.append((query, watch.audit(query, events, poll_interval_seconds=0.2)))
        if len(queries) > 1:
            _first_batch_done(query)

    def status() -> dict[str, Any]:
        each = [handle.status() for _, handle in running]
        first = dict(each[0])
        first["batches_audited"] = min(int(s["batches_audited"]) for s in each)
        first["per_query"] = {s["query"]: s["batches_audited"] for s in each}
        return first

    return serve(spark, watch, running, mode, status)


def _first_batch_done(query: Any, bound_seconds: float = 60.0) -> None:
    """Wait (bounded) for a query's first batch before the next starts. A query's first batch
    starts its Python workers (a state function's, a data source's), and Spark gives a worker
    it starts for ``transformWithStateInPandas`` 10 seconds to connect back (not configurable):
    six queries starting their workers at once on a loaded 2-core machine missed it."""
    deadline = time.monotonic() + bound_seconds
    while query.isActive and not query.recentProgress and time.monotonic() < deadline:
        time.sleep(0.2)


def _lines_source() -> type:
    """A Python data source over the JSON lines of a folder's files, in file-name order; its
    offset is the number of lines, so it reads the same rows after a restart."""
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition

    class Span(InputPartition):
        def __init__(self, start: int, end: int) -> None:
            self.start, self.end = start, end

    class LinesReader(DataSourceStreamReader):
        def __init__(self, path: str) -> None:
            self.path = path

        def _lines(self) -> list[str]:
            import os

            names = sorted(n for n in os.listdir(self.path) if n.endswith(".json"))
            out: list[str] = []
            for name in names:
                with open(os.path.join(self.path, name)) as handle:
                    out.extend(line for line in handle.read().splitlines() if line.strip())
            return out

        def initialOffset(self) -> dict[str, int]:  # noqa: N802
            return {"rows": 0}

        def latestOffset(self) -> dict[str, int]:  # noqa: N802
            return {"rows": len(self._lines())}

        def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[Any]:
            return [Span(start["rows"], end["rows"])]

        def read(self, partition: Any) -> Any:
            from datetime import datetime

            for line in self._lines()[partition.start : partition.end]:
                row = json.loads(line)
                at = datetime.fromisoformat(row["ts"].replace("Z", "+00:00"))
                yield row["id"], row["user"], at

    class LinesSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return "wmwatch_test_lines"

        def schema(self) -> str:
            return "id int, user string, ts timestamp"

        def streamReader(self, schema: Any) -> Any:  # noqa: N802
            return LinesReader(self.options["path"])

    return LinesSource


def seen_processor() -> Any:
    """A StatefulProcessor that emits the id of every row it is given (the rows
    transformWithState did not drop)."""
    from pyspark.sql.streaming import StatefulProcessor

    class Seen(StatefulProcessor):
        def init(self, handle: Any) -> None:
            self.handle = handle

        def handleInputRows(self, key: Any, rows: Any, timerValues: Any) -> Any:  # noqa: N802, N803
            import pandas as pd

            for frame in rows:
                yield pd.DataFrame({"id": frame["id"].astype("int32")})

        def close(self) -> None:
            pass

    return Seen()


def seen_rows(key: Any, frames: Any, state: Any) -> Any:
    """Emit the id of every row the state function is given (the rows it did not drop)."""
    import pandas as pd

    for frame in frames:
        yield pd.DataFrame({"id": frame["id"].astype("int32")})
    if state.hasTimedOut:
        state.remove()
    else:
        state.update((1,))
        state.setTimeoutTimestamp(state.getCurrentWatermarkMs() + 60_000)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
