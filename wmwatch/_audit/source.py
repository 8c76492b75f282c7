"""The sources the audit can read again, batch by batch.

Each kind of source is one :class:`BatchSource`: it says what batch N read (from the query's
checkpoint) and reads exactly that again as a batch DataFrame. Files are the kind here
(:class:`FileBatchSource`: files stay where they are, so batch N's files give N's rows); Python
data sources are :mod:`wmwatch._audit.pysource`. :func:`file_source_of` reads a file source's
format, schema, options and paths off the events DataFrame's plan through the driver's JVM.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote

from wmwatch._audit.checkpoint import CheckpointReader, normalise_path
from wmwatch._core.sessions import is_connect
from wmwatch._errors import AuditError, ConfigError, UnsupportedSourceError
from wmwatch._text import first_line

SUPPORTED_FORMATS = ("json", "csv", "parquet", "orc", "text", "avro")
_FORMATS_BY_CLASS = {
    "jsonfileformat": "json",
    "csvfileformat": "csv",
    "parquetfileformat": "parquet",
    "orcfileformat": "orc",
    "textfileformat": "text",
    "avrofileformat": "avro",
}
_STREAMING_RELATION = re.compile(
    r"(StreamingRelation\w*|StreamingExecutionRelation|StreamingDataSourceV2\w*) (\S+?)\[([^\]]*)\]"
)


# Spark's own switch (DataSource.GLOB_PATHS_KEY, honoured by file sources v1 and v2) that makes
# the reader take each path as one literal file instead of a glob pattern.
_GLOB_PATHS_OPTION = "__globPaths__"
# What Hadoop's glob (GlobPattern) reads as a pattern, and Spark's isGlobPath as a glob.
_GLOB_CHARACTERS = re.compile(r"[\\*?\[\]{},]")

# The column that carries each replayed row's file (null for sources without files).
SOURCE_FILE_COL = "__wmwatch_source_file"
# The column that carries each replayed row's position in its source, as JSON (Kafka: topic,
# partition, offset; absent for other sources): what names the rows that moved the watermark.
SOURCE_POSITION_COL = "__wmwatch_source_position"
# Columns the audit attaches to the raw rows: carried through ``events``, never row data.
ATTACHED_COLUMNS = frozenset({SOURCE_FILE_COL, SOURCE_POSITION_COL})


class BatchSource(Protocol):
    """One source of a query, as the audit reads it again."""

    @property
    def source_index(self) -> int:
        """Its position in the query's sources (the checkpoint's ``sources/<i>``)."""
        ...

    def batch_input(self, checkpoint: CheckpointReader, batch_id: int) -> Any | None:
        """What batch ``batch_id`` read from this source; None when it read nothing new."""
        ...

    def read(self, spark: Any, what: Any) -> Any:
        """That data again, as a batch DataFrame of the source's raw rows (with
        :data:`SOURCE_FILE_COL` where the source has files)."""
        ...


@dataclass(frozen=True, slots=True)
class FileSourceSpec:
    """How to read the production query's file source again, as a batch."""

    format: str
    schema_json: str
    options: dict[str, str]
    paths: tuple[str, ...]
    source_index: int = 0


def _jvm_of(spark: Any) -> Any:
    return spark.sparkContext._jvm


def _scala_map(spark: Any, scala_map: Any) -> dict[str, str]:
    converted = _jvm_of(spark).scala.jdk.javaapi.CollectionConverters.asJava(scala_map)
    return {str(k): str(v) for k, v in dict(converted).items()}


def _scala_seq(spark: Any, seq: Any) -> list[str]:
    return [str(x) for x in _jvm_of(spark).scala.jdk.javaapi.CollectionConverters.asJava(seq)]


def _plan_nodes(node: Any) -> Iterable[Any]:
    """Pre-order walk of a JVM logical plan."""
    yield node
    children = node.children()
    for i in range(children.size()):
        yield from _plan_nodes(children.apply(i))


def relation_of(events: Any) -> Any:
    """The one streaming relation (JVM logical-plan node) ``events`` reads (classic PySpark)."""
    jdf = getattr(events, "_jdf", None)
    if jdf is None:
        raise AuditError(
            "events is not a classic PySpark DataFrame (Spark Connect?); the audit needs the "
            "driver JVM to read the source and checkpoint, so run it in the driver process."
        )
    if not events.isStreaming:
        raise ConfigError(
            "events must be the streaming DataFrame the query reads (spark.readStream...)."
        )
    nodes = list(_plan_nodes(jdf.queryExecution().analyzed()))
    relations = [n for n in nodes if n.nodeName().startswith("Streaming")]
    if len(relations) != 1:
        raise UnsupportedSourceError(
            f"events reads {len(relations)} streaming sources; pass one streaming DataFrame per "
            "source (events=[...]), each reading exactly one."
        )
    return relations[0]


def relation_position(query_plan: Any, relation: Any) -> list[int]:
    """Where ``relation`` is among the streaming relations of a query's analysed plan (JVM),
    which is its source index in the checkpoint: matched by its output attributes."""
    wanted = str(relation.output().toString())
    leaves = [
        n
        for n in _plan_nodes(query_plan)
        if n.nodeName().startswith("Streaming") and n.children().size() == 0
    ]
    return [i for i, n in enumerate(leaves) if str(n.output().toString()) == wanted]


def file_source_of(spark: Any, events: Any, *, has_prepare: bool) -> FileSourceSpec:
    """The file source ``events`` reads, from its logical plan (classic PySpark only)."""
    relation = relation_of(events)
    nodes = list(_plan_nodes(events._jdf.queryExecution().analyzed()))
    if relation.nodeName() != "StreamingRelation":
        raise UnsupportedSourceError(
            f"events reads {first_line(str(relation.toString()), 120)}, which cannot be replayed "
            f"batch by batch; the audit supports file sources ({', '.join(SUPPORTED_FORMATS)}) "
            "and Python data sources."
        )
    ds = relation.dataSource()
    fmt = str(ds.className())
    short = fmt.rsplit(".", 1)[-1].lower()
    short = _FORMATS_BY_CLASS.get(short, short)
    if short not in SUPPORTED_FORMATS:
        raise UnsupportedSourceError(
            f"events reads a {fmt!r} source, which cannot be replayed batch by batch; the audit "
            f"supports file sources ({', '.join(SUPPORTED_FORMATS)})."
        )
    options = _scala_map(spark, ds.options())
    clean = options.get("cleanSource", "off").lower()
    if clean != "off":
        raise UnsupportedSourceError(
            f"the file source moves or deletes its files (cleanSource={clean}), so batches cannot "
            "be read again; turn cleanSource off to audit this query."
        )
    paths = tuple(_scala_seq(spark, ds.paths()))
    if not paths and "path" in options:
        paths = (options["path"],)
    if not has_prepare:
        require_prepare(
            n.nodeName()
            for n in nodes
            if n.nodeName() not in ("EventTimeWatermark", "StreamingRelation")
        )
    return FileSourceSpec(
        format=short, schema_json=str(relation.schema().json()), options=options, paths=paths
    )


def require_prepare(transformations: Iterable[str]) -> None:
    """Refuse events that do more to the source than ``withWatermark`` without ``prepare=``."""
    extra = list(dict.fromkeys(transformations))
    if extra:
        raise AuditError(
            f"events transforms the source ({', '.join(extra)}); pass prepare=, a function "
            "that turns the raw source DataFrame into events, so batches can be replayed."
        )


def source_indexes(plan_text: str, source: FileSourceSpec) -> list[int]:
    """The positions in the query's source list (= the checkpoint's ``sources/<i>``) of the
    streaming relations that read ``source``'s paths (several when a query reads one directory
    twice, as a self-join does)."""
    found = _STREAMING_RELATION.findall(plan_text)
    if len(found) <= 1:
        return [0]
    wanted = {normalise_path(p) for p in source.paths}
    return [i for i, (_, _, path) in enumerate(found) if normalise_path(path) in wanted]


@dataclass(frozen=True, slots=True)
class FileBatchSource:
    """A file source: batch N read the files its source log took in for N."""

    spec: FileSourceSpec

    @property
    def source_index(self) -> int:
        return self.spec.source_index

    def batch_input(self, checkpoint: CheckpointReader, batch_id: int) -> list[str] | None:
        files = checkpoint.batch_files(batch_id, self.spec.source_index)
        return [f.path for f in files] or None

    def read(self, spark: Any, what: Any) -> Any:
        from pyspark.sql import functions as F
        from pyspark.sql.types import StructType

        src = self.spec
        reader = spark.read.format(src.format).schema(
            StructType.fromJson(json.loads(src.schema_json))
        )
        options = {k: v for k, v in src.options.items() if k.lower() not in ("path", "paths")}
        if (
            len(src.paths) == 1
            and not re.search(r"[*?\[{]", src.paths[0])
            and "basePath" not in options
        ):
            # Keeps partition columns (dir/key=value/file) when single files are read.
            options["basePath"] = src.paths[0]
        # Exactly the logged files: the reader would expand a name's * ? [..] {a,b} as a glob
        # and read other files or none (given late[1].json it reads late1.json).
        paths = [reader_path(p) for p in what]
        if is_connect(spark):
            # a Spark Connect server ignores the option (seen on 4.3): escape the patterns
            paths = [glob_escaped(p) for p in paths]
        else:
            options[_GLOB_PATHS_OPTION] = "false"
        raw = reader.options(**options).load(paths)
        return raw.withColumn(SOURCE_FILE_COL, F.col("_metadata.file_path"))


def reader_path(logged: str) -> str:
    """A path from the source log (a URI: ``file:///in%20dir/a%5B1%5D.json``) as Spark's reader
    takes it: decoded, scheme and authority kept, since the reader quotes the path again."""
    return unquote(logged)


def glob_escaped(path: str) -> str:
    """``path`` as a Hadoop glob that matches only itself: each pattern character escaped with
    a backslash, which Hadoop's glob takes literally."""
    return _GLOB_CHARACTERS.sub(r"\\\g<0>", path)


@dataclass(frozen=True, slots=True)
class UnreplayableSource:
    """A source that cannot read a batch again (rate, socket, a stream that drops committed
    rows): nothing is replayed; the audit counts what Spark dropped from it instead."""

    index: int
    reason: str

    @property
    def source_index(self) -> int:
        return self.index

    def batch_input(self, checkpoint: CheckpointReader, batch_id: int) -> Any | None:
        return None

    def read(self, spark: Any, what: Any) -> Any:
        raise AuditError(f"source {self.index} cannot be read again: {self.reason}")
