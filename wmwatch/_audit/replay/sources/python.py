"""Reading a batch of a Python streaming data source (``pyspark.sql.datasource``) again: a batch
data source that wraps the user's stream reader with the batch's two logged offsets, so that
executors read the rows, never the driver. The contract it relies on: docs/audit-sources.md
(Python data sources).
"""

from __future__ import annotations

import hashlib
import json
import pickle
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.replay.connect import relation_schema_json
from wmwatch._audit.replay.sources.base import ConnectFound, Found, SourceKind, SourceOptions
from wmwatch._audit.replay.sources.files import SUPPORTED_FORMATS
from wmwatch._checkpoint.reader import CheckpointReader, logged_offsets, parse_offset_json
from wmwatch._errors import UnsupportedSourceError

_START = "wmwatch.replay.start"
_END = "wmwatch.replay.end"
_REGISTERED: set[tuple[int, str]] = set()
_REGISTER_LOCK = threading.Lock()


def is_python_source(relation: Any) -> bool:
    """Whether a streaming relation of a logical plan reads a Python data source."""
    try:
        return bool(
            str(relation.nodeName()) == "StreamingRelationV2"
            and str(relation.table().getClass().getName()).endswith(".PythonTable")
        )
    except Exception:  # noqa: BLE001 - any py4j failure: not this kind of relation
        return False


@dataclass(frozen=True, slots=True)
class PythonSourceSpec:
    """What reading a Python data source again needs: its name, options, schema and class."""

    name: str
    options: SourceOptions
    schema_json: str
    data_source: type = field(compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", SourceOptions.of(self.options))


def python_source_of(spark: Any, relation: Any) -> PythonSourceSpec:
    """The Python data source ``relation`` reads, with the class the session registered."""
    if not is_python_source(relation):
        raise UnsupportedSourceError(
            "events does not read a Python data source; pass the DataFrame of "
            "spark.readStream.format(<registered name>).load()."
        )
    name = str(relation.table().name())
    try:
        manager = spark._jsparkSession.sessionState().dataSourceManager()
        command = manager.lookupDataSource(name).dataSourceCls().command()
        # pickled by pyspark's cloudpickle, whose output plain pickle reads back
        data_source = pickle.loads(bytes(command.unsafeArray()))
    except Exception as exc:
        raise UnsupportedSourceError(
            f"cannot find the Python data source {name!r} in this session's registry "
            f"({type(exc).__name__}); register it with spark.dataSource.register(...) in the "
            "session that runs the audit."
        ) from exc
    return PythonSourceSpec(
        name=name,
        options=SourceOptions(dict(relation.extraOptions().asCaseSensitiveMap())),
        schema_json=str(relation.schema().json()),
        data_source=data_source,
    )


def initial_offset(spec: PythonSourceSpec) -> str:
    """The start offset of the first batch (no ``offsets/N-1``), as Spark logs it: the reader's
    ``initialOffset()`` through ``json.dumps``."""
    from pyspark.sql.datasource import CaseInsensitiveDict
    from pyspark.sql.types import StructType

    schema = StructType.fromJson(json.loads(spec.schema_json))
    replay = _replay_class(spec, _replay_name(spec))
    # as Spark hands a data source its options: looked up in any case
    reader, _ = replay.stream_reader(CaseInsensitiveDict(spec.options), schema)  # type: ignore[attr-defined]  # class built at run time
    return json.dumps(reader.initialOffset())


def _replay_name(spec: PythonSourceSpec) -> str:
    digest = hashlib.sha256(
        f"{spec.name}\0{spec.schema_json}\0{id(spec.data_source)}".encode()
    ).hexdigest()[:16]
    return f"wmwatch_replay_{digest}"


def _replay_class(spec: PythonSourceSpec, name: str) -> type:
    """A batch data source that reads the user's stream reader between two given offsets.

    Spark pickles it (cloudpickle) to Python workers. Everything it uses is defined here, so
    classes and functions travel by value and executors need pyspark and the user's data source
    only, not wmwatch.
    """
    from pyspark.sql.datasource import (
        CaseInsensitiveDict,
        DataSource,
        DataSourceReader,
        InputPartition,
    )
    from pyspark.sql.types import StructType

    user_class = spec.data_source
    schema_json = spec.schema_json
    start_key, end_key = _START, _END

    def open_stream(options: Mapping[str, str], schema: Any) -> tuple[Any, bool]:
        """The user's stream reader and whether it is a simple one."""
        source = user_class(options)
        try:
            return source.streamReader(schema), False
        except NotImplementedError:
            return source.simpleStreamReader(schema), True

    class ReplayReader(DataSourceReader):
        def __init__(self, options: dict[str, str], schema: Any) -> None:
            # the user's reader gets its options as Spark gives them: looked up in any case
            own = CaseInsensitiveDict(
                {k: v for k, v in options.items() if k.lower() not in (start_key, end_key)}
            )
            self.start = json.loads(options[start_key])
            self.end = json.loads(options[end_key])
            self.stream, self.simple = open_stream(own, schema)

        def partitions(self) -> Any:
            if self.simple:
                return [InputPartition(0)]
            return self.stream.partitions(self.start, self.end)

        def read(self, partition: Any) -> Iterator[Any]:
            if self.simple:
                yield from self.stream.readBetweenOffsets(self.start, self.end)
            else:
                yield from self.stream.read(partition)

    class Replay(DataSource):
        stream_reader = staticmethod(open_stream)

        @classmethod
        def name(cls) -> str:
            return name

        def schema(self) -> Any:
            return StructType.fromJson(json.loads(schema_json))

        def reader(self, schema: Any) -> Any:
            return ReplayReader(dict(self.options), schema)

    return Replay


def read_batch(spark: Any, spec: PythonSourceSpec, start_json: str, end_json: str) -> Any:
    """A batch DataFrame of exactly the rows the source gives between two logged offsets."""
    parse_offset_json(start_json, "start")
    parse_offset_json(end_json, "end")
    name = _replay_name(spec)
    key = (id(spark), name)
    with _REGISTER_LOCK:
        if key not in _REGISTERED:
            spark.dataSource.register(_replay_class(spec, name))
            _REGISTERED.add(key)
    return (
        spark.read.format(name)
        .options(**spec.options)
        .option(_START, start_json)
        .option(_END, end_json)
        .load()
    )


@dataclass(frozen=True, slots=True)
class PythonBatchSource:
    """A Python data source: batch N read from ``offsets/N-1``'s line to ``offsets/N``'s."""

    spec: PythonSourceSpec
    index: int

    @property
    def source_index(self) -> int:
        return self.index

    def batch_input(self, checkpoint: CheckpointReader, batch_id: int) -> tuple[str, str] | None:
        return logged_offsets(checkpoint, batch_id, self.index, lambda: initial_offset(self.spec))

    def read(self, spark: Any, what: Any) -> Any:
        start, end = what
        return read_batch(spark, self.spec, start, end)

    def after_read(self, spark: Any, what: Any, error: BaseException | None) -> None:
        return None  # the data source contract: the same offsets give the same rows


def _at(spec: PythonSourceSpec, positions: list[int]) -> Found:
    return Found(positions, lambda index: PythonBatchSource(spec, index), f"source {spec.name!r}")


def _found(spark: Any, events: Any, relation: Any, positions: list[int], plan_text: str) -> Found:
    return _at(python_source_of(spark, relation), positions)


# -- Spark Connect: the client's plan objects ---------------------------------------------------


def _data_source_classes() -> list[Any]:
    from pyspark.sql.datasource import DataSource

    found: list[Any] = []
    pending = list(DataSource.__subclasses__())
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


def connect_python_source_of(events: Any, relation: Any) -> PythonSourceSpec:
    """The Python data source a Connect events DataFrame reads. The server's registry is out
    of a client's reach, but the class the client registered is defined in this process."""
    name = str(relation._format)
    matches = []
    for cls in _data_source_classes():
        try:
            if cls.name() == name:
                matches.append(cls)
        except Exception:  # noqa: BLE001 - a class whose name() needs more than the class
            continue
    if len(matches) != 1:
        raise UnsupportedSourceError(
            f"events reads {name!r}, which is neither a file source "
            f"({', '.join(SUPPORTED_FORMATS)}) nor a Python data source defined in this process "
            f"({len(matches)} classes named so); on Spark Connect the audit replays those only."
        )
    return PythonSourceSpec(
        name=name,
        options=SourceOptions(relation._options),
        schema_json=relation_schema_json(events, relation),
        data_source=matches[0],
    )


def _connect_found(events: Any, relation: Any) -> ConnectFound:
    spec = connect_python_source_of(events, relation)

    def found(descriptions: Sequence[str]) -> Found:
        positions = [i for i, d in enumerate(descriptions) if not d.startswith("FileStreamSource[")]
        return _at(spec, positions or [0])

    return found


def _any_format(relation: Any) -> bool:
    """On Spark Connect, a format no kind before this one claims names a Python data source
    (or none the audit reads: :func:`connect_python_source_of` then says so)."""
    return True


KIND = SourceKind(
    name="python",
    matches=lambda spark, relation: is_python_source(relation),
    found=_found,
    connect_matches=_any_format,
    connect_found=_connect_found,
)
