"""Replaying batches of Python streaming data sources (``pyspark.sql.datasource``) from the
offsets in the checkpoint, against real Spark: the piece on its own (every batch read again
equals what the query's batch saw, for a partitioned and a simple reader), then the audit of a
query that reads one, balanced against Spark's count."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql.datasource import (
    DataSource,
    DataSourceStreamReader,
    InputPartition,
    SimpleDataSourceStreamReader,
)

from tests.harness.audited import audited_run
from tests.harness.checks import dropped_by_watermark
from wmwatch._audit.replay.sources.base import relation_of
from wmwatch._audit.replay.sources.python import (
    PythonBatchSource,
    is_python_source,
    python_source_of,
    read_batch,
)
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch._errors import AuditError, UnsupportedSourceError

pytestmark = pytest.mark.spark

BASE_SECOND = 1_767_225_600  # 2026-01-01T00:00:00Z


def epoch(i: int) -> int:
    """Row i's time: 2 s a row; every 7th row is 80 s behind (late once the watermark moved)."""
    return BASE_SECOND + 2 * i - (80 if i % 7 == 6 else 0)


class Span(InputPartition):
    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end


class CountingReader(DataSourceStreamReader):
    """Offsets are row counts; each new offset adds ``step`` rows, up to ``limit``."""

    def __init__(self, options: dict[str, str]) -> None:
        self.step = int(options.get("step", "10"))
        self.limit = int(options.get("limit", "60"))
        self.position = 0

    def initialOffset(self) -> dict[str, int]:  # noqa: N802
        return {"rows": 0}

    def latestOffset(self) -> dict[str, int]:  # noqa: N802
        self.position = min(self.position + self.step, self.limit)
        return {"rows": self.position}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[Span]:
        middle = (start["rows"] + end["rows"]) // 2
        return [Span(start["rows"], middle), Span(middle, end["rows"])]

    def read(self, partition: Span) -> Iterator[tuple[int, int]]:
        for i in range(partition.start, partition.end):
            yield i, epoch(i)


class CountingSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "wmwatch_test_counting"

    def schema(self) -> str:
        return "id int, epoch long"

    def streamReader(self, schema: Any) -> CountingReader:  # noqa: N802
        return CountingReader(self.options)


class SimpleCountingReader(SimpleDataSourceStreamReader):
    def __init__(self, options: dict[str, str]) -> None:
        self.step = int(options.get("step", "10"))
        self.limit = int(options.get("limit", "60"))

    def initialOffset(self) -> dict[str, int]:  # noqa: N802
        return {"rows": 0}

    def read(self, start: dict[str, int]) -> tuple[Iterator[tuple[int, int]], dict[str, int]]:
        end = min(start["rows"] + self.step, self.limit)
        return self.readBetweenOffsets(start, {"rows": end}), {"rows": end}

    def readBetweenOffsets(  # noqa: N802
        self, start: dict[str, int], end: dict[str, int]
    ) -> Iterator[tuple[int, int]]:
        return iter([(i, epoch(i)) for i in range(start["rows"], end["rows"])])


class SimpleCountingSource(DataSource):
    @classmethod
    def name(cls) -> str:
        return "wmwatch_test_simple_counting"

    def schema(self) -> str:
        return "id int, epoch long"

    def simpleStreamReader(self, schema: Any) -> SimpleCountingReader:  # noqa: N802
        return SimpleCountingReader(self.options)


@pytest.mark.parametrize("source", [CountingSource, SimpleCountingSource])
def test_each_batch_read_again_is_the_batch_the_query_saw(
    spark: Any, stream_dir: Path, source: type
) -> None:
    spark.dataSource.register(source)
    seen: dict[int, list[tuple[int, int]]] = {}

    def capture(frame: Any, batch_id: int) -> None:
        seen[batch_id] = [(r["id"], r["epoch"]) for r in frame.collect()]

    events = spark.readStream.format(source.name()).option("step", "7").load()
    query = (
        events.writeStream.foreachBatch(capture)
        .option("checkpointLocation", str(stream_dir / "checkpoint"))
        .start()
    )
    try:
        query.processAllAvailable()
    finally:
        query.stop()
    relation = relation_of(events)
    assert is_python_source(relation)
    spec = python_source_of(spark, relation)
    assert spec.data_source.name() == source.name() and spec.options["step"] == "7"
    replay = PythonBatchSource(spec, 0)
    checkpoint = CheckpointReader(str(stream_dir / "checkpoint"))
    committed = checkpoint.committed_batches()
    assert len(committed) >= 8  # 60 rows, 7 a batch
    for batch_id in committed:
        what = replay.batch_input(checkpoint, batch_id)
        rows = [] if what is None else replay.read(spark, what).collect()
        assert Counter((r["id"], r["epoch"]) for r in rows) == Counter(seen.get(batch_id, []))
    assert sum(len(v) for v in seen.values()) == 60


def test_python_source_errors_say_what_to_do(spark: Any, stream_dir: Path) -> None:
    files = spark.readStream.schema("id int").json(str(stream_dir / "in"))
    assert not is_python_source(relation_of(files))
    with pytest.raises(UnsupportedSourceError, match="Python data source"):
        python_source_of(spark, relation_of(files))
    spark.dataSource.register(CountingSource)
    counting = spark.readStream.format(CountingSource.name()).load()
    spec = python_source_of(spark, relation_of(counting))
    with pytest.raises(AuditError, match="not JSON"):
        read_batch(spark, spec, "{rows: 1", '{"rows": 5}')


@pytest.mark.parametrize("step", [10, 23])
def test_audit_of_a_python_source_balances(spark: Any, stream_dir: Path, step: int) -> None:
    """Run twice with different batching (rows per batch)."""
    from pyspark.sql import functions as F

    spark.dataSource.register(CountingSource)
    events = (
        spark.readStream.format(CountingSource.name())
        .option("step", str(step))
        .option("limit", "80")
        .load()
        .withColumn("ts", F.timestamp_seconds("epoch"))
        .withWatermark("ts", "10 seconds")
    )

    def prepare(raw: Any) -> Any:
        return raw.withColumn("ts", F.timestamp_seconds("epoch"))

    result = audited_run(
        spark,
        stream_dir,
        events.dropDuplicates(["id", "ts"]),
        events,
        name=f"pysource_dedupe_{step}",
        feed=lambda query: query.processAllAvailable(),
        prepare=prepare,
    )
    output = {r["id"] for r in result["output"]}
    late = [(r[8], r[7]) for r in result["late"]]
    ids = [json.loads(data)["id"] for data, _ in late]
    assert ids and len(ids) == len(set(ids))
    assert all(source is None for _, source in late)
    assert not set(ids) & output
    assert sorted(set(ids) | output) == list(range(80))
    assert len(ids) == dropped_by_watermark(result["progress"])


_NO_WMWATCH = """
import importlib.abc, json, pickle, sys

class NoWmwatch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "wmwatch" or name.startswith("wmwatch."):
            raise ImportError("wmwatch is not installed on this executor")
        return None

sys.meta_path.insert(0, NoWmwatch())
from pyspark.sql.datasource import CaseInsensitiveDict

replay = pickle.loads(sys.stdin.buffer.read())
# as Spark's Python worker makes a data source: options in a CaseInsensitiveDict, lower-cased
reader = replay(CaseInsensitiveDict(json.loads(sys.argv[1]))).reader(None)
print(json.dumps([list(row) for p in reader.partitions() for row in reader.read(p)]))
"""


@pytest.mark.parametrize("source", [CountingSource, SimpleCountingSource])
def test_replay_wrapper_runs_on_executors_without_wmwatch(source: type) -> None:
    """What Spark ships to Python workers unpickles and reads without wmwatch installed there."""
    from wmwatch._audit.replay.sources.python import PythonSourceSpec, initial_offset

    spec = PythonSourceSpec(source.name(), {"step": "7"}, '{"type":"struct","fields":[]}', source)
    start = initial_offset(spec)
    assert json.loads(start) == {"rows": 0}
    rows = _read_on_an_executor(spec, {"step": "7"}, start, '{"rows": 9}')
    assert rows == [(i, epoch(i)) for i in range(9)]


def _read_on_an_executor(
    spec: Any, options: dict[str, str], start: str, end: str
) -> list[tuple[int, ...]]:
    """The rows the replay's data source reads between two offsets in a Python process without
    wmwatch, given ``options`` as the query gave them (Spark's worker lower-cases them)."""
    import subprocess
    import sys

    from pyspark import cloudpickle

    from wmwatch._audit.replay.sources.python import _replay_class

    this_module = sys.modules[__name__]
    # the user's classes travel by value too, as they do from a notebook
    cloudpickle.register_pickle_by_value(this_module)
    try:
        shipped = cloudpickle.dumps(_replay_class(spec, "wmwatch_replay_test"))
    finally:
        cloudpickle.unregister_pickle_by_value(this_module)
    given = {**options, "wmwatch.replay.start": start, "wmwatch.replay.end": end}
    done = subprocess.run(
        [sys.executable, "-c", _NO_WMWATCH, json.dumps(given)],
        input=shipped,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return sorted(tuple(r) for r in json.loads(done.stdout))


class ShiftedReader(SimpleCountingReader):
    """Rows from ``startAt`` on, each ``shiftSeconds`` later than :func:`epoch`: options with
    capitals in their names, which Spark hands a data source lower-cased, in a dictionary that
    finds them in any case."""

    def __init__(self, options: dict[str, str]) -> None:
        super().__init__(options)
        self.shift = int(options.get("shiftSeconds", "0"))
        self.first = int(options.get("startAt", "0"))

    def initialOffset(self) -> dict[str, int]:  # noqa: N802
        return {"rows": self.first}

    def readBetweenOffsets(  # noqa: N802
        self, start: dict[str, int], end: dict[str, int]
    ) -> Iterator[tuple[int, int]]:
        return iter([(i, epoch(i) + self.shift) for i in range(start["rows"], end["rows"])])


class ShiftedSource(SimpleCountingSource):
    @classmethod
    def name(cls) -> str:
        return "wmwatch_test_shifted"

    def simpleStreamReader(self, schema: Any) -> ShiftedReader:  # noqa: N802
        return ShiftedReader(self.options)


def test_the_replay_hands_the_users_reader_its_options_as_spark_does() -> None:
    """The query wrote ``.option("SHIFTSECONDS", "100").option("startat", "3")``; its reader
    looks them up as ``shiftSeconds`` and ``startAt``. The first batch starts where the query's
    did, and each batch's rows are read again with the query's shift."""
    from wmwatch._audit.replay.sources.python import PythonSourceSpec, initial_offset

    options = {"SHIFTSECONDS": "100", "startat": "3"}
    spec = PythonSourceSpec(
        ShiftedSource.name(), options, '{"type":"struct","fields":[]}', ShiftedSource
    )
    start = initial_offset(spec)
    assert json.loads(start) == {"rows": 3}
    rows = _read_on_an_executor(spec, options, start, '{"rows": 8}')
    assert rows == [(i, epoch(i) + 100) for i in range(3, 8)]
