"""File sources (json, csv, parquet, orc, text, avro): batch N read the files the source's log
took in for N; files stay where they are, so reading them again gives N's rows.

:func:`file_source_of` reads a file source's format, schema, options and paths off the events
DataFrame's plan through the driver's JVM; on Spark Connect, :func:`connect_file_source_of` reads
them off the client's own plan objects and :func:`file_positions` places the source among the
query's by its progress description.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import unquote

from wmwatch._audit.replay.connect import relation_schema_json
from wmwatch._audit.replay.sources.base import (
    SOURCE_FILE_COL,
    ConnectFound,
    Found,
    SourceKind,
    SourceOptions,
    relation_of,
    scala_map,
    scala_seq,
)
from wmwatch._checkpoint.fs import normalise_path
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch._core.sessions import is_connect
from wmwatch._errors import UnsupportedSourceError

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
# a file source's progress description (Spark Connect): FileStreamSource[file:/in]
_FILE_SOURCE = re.compile(r"^FileStreamSource\[(.*)\]$")


# Spark's own switch (DataSource.GLOB_PATHS_KEY, honoured by file sources v1 and v2) that makes
# the reader take each path as one literal file instead of a glob pattern.
_GLOB_PATHS_OPTION = "__globPaths__"
# What Hadoop's glob (GlobPattern) reads as a pattern, and Spark's isGlobPath as a glob.
_GLOB_CHARACTERS = re.compile(r"[\\*?\[\]{},]")


@dataclass(frozen=True, slots=True)
class FileSourceSpec:
    """How to read the production query's file source again, as a batch."""

    format: str
    schema_json: str
    options: SourceOptions
    paths: tuple[str, ...]
    source_index: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "options", SourceOptions.of(self.options))


def _short_format(name: str) -> str:
    short = name.rsplit(".", 1)[-1].lower()
    return _FORMATS_BY_CLASS.get(short, short)


def _no_clean_source(options: SourceOptions) -> None:
    cleaning = [v for v in options.every("cleanSource") if v.strip().lower() != "off"]
    if cleaning:
        raise UnsupportedSourceError(
            f"the file source moves or deletes its files (cleanSource={cleaning[-1]}), so batches "
            "cannot be read again; turn cleanSource off to audit this query."
        )


def _paths(paths: Sequence[str], options: SourceOptions) -> tuple[str, ...]:
    """The folders a file source reads: its load paths, else its ``path`` option."""
    if paths:
        return tuple(paths)
    return (options["path"],) if "path" in options else ()


def is_file_relation(spark: Any, relation: Any) -> bool:
    """Whether a streaming relation (JVM) is a V1 source, which the file kind reads or refuses
    with the reason (the kinds before it in the registry take V1 sources of their own)."""
    return bool(str(relation.nodeName()) == "StreamingRelation")


def file_source_of(spark: Any, events: Any) -> FileSourceSpec:
    """The file source ``events`` reads, from its logical plan (classic PySpark only)."""
    relation = relation_of(events)
    ds = relation.dataSource()
    fmt = str(ds.className())
    short = _short_format(fmt)
    if short not in SUPPORTED_FORMATS:
        raise UnsupportedSourceError(
            f"events reads a {fmt!r} source, which cannot be replayed batch by batch; the audit "
            f"supports file sources ({', '.join(SUPPORTED_FORMATS)})."
        )
    options = SourceOptions(scala_map(spark, ds.options()))
    _no_clean_source(options)
    return FileSourceSpec(
        format=short,
        schema_json=str(relation.schema().json()),
        options=options,
        paths=_paths(scala_seq(spark, ds.paths()), options),
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


def _at(files: FileSourceSpec, positions: list[int], description: str) -> Found:
    return Found(
        positions, lambda index: FileBatchSource(replace(files, source_index=index)), description
    )


def _found(spark: Any, events: Any, relation: Any, positions: list[int], plan_text: str) -> Found:
    files = file_source_of(spark, events)
    return _at(files, positions or source_indexes(plan_text, files), ", ".join(files.paths))


# -- Spark Connect: the client's plan objects ---------------------------------------------------


def is_file_format(relation: Any) -> bool:
    """Whether a Connect client's streaming ``DataSource`` node reads a file format."""
    return _short_format(relation._format or "parquet") in SUPPORTED_FORMATS


def connect_file_source_of(events: Any, relation: Any) -> FileSourceSpec:
    """The file source a Connect events DataFrame reads, from the client's plan objects."""
    options = SourceOptions(relation._options)
    _no_clean_source(options)
    return FileSourceSpec(
        format=_short_format(relation._format or "parquet"),
        schema_json=relation_schema_json(events, relation),
        options=options,
        paths=_paths(relation._paths or (), options),
    )


def file_positions(descriptions: Sequence[str], source: FileSourceSpec) -> list[int]:
    """The positions of the sources whose progress description names ``source``'s paths."""
    wanted = {normalise_path(p) for p in source.paths}
    found = []
    for index, description in enumerate(descriptions):
        match = _FILE_SOURCE.match(description)
        if match and normalise_path(match.group(1)) in wanted:
            found.append(index)
    return found


def _connect_found(events: Any, relation: Any) -> ConnectFound:
    files = connect_file_source_of(events, relation)

    def found(descriptions: Sequence[str]) -> Found:
        positions = file_positions(descriptions, files)
        if not positions and len(descriptions) <= 1:
            positions = [0]
        return _at(files, positions, ", ".join(files.paths))

    return found


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
        options = src.options.without("path", "paths")
        if (
            len(src.paths) == 1
            and not re.search(r"[*?\[{]", src.paths[0])
            and "basePath" not in src.options
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

    def after_read(self, spark: Any, what: Any, error: BaseException | None) -> None:
        return None  # files are immutable: a read that succeeded read the batch's rows


def reader_path(logged: str) -> str:
    """A path from the source log (a URI: ``file:///in%20dir/a%5B1%5D.json``) as Spark's reader
    takes it: decoded, scheme and authority kept, since the reader quotes the path again."""
    return unquote(logged)


def glob_escaped(path: str) -> str:
    """``path`` as a Hadoop glob that matches only itself: each pattern character escaped with
    a backslash, which Hadoop's glob takes literally."""
    return _GLOB_CHARACTERS.sub(r"\\\g<0>", path)


KIND = SourceKind(
    name="files",
    matches=is_file_relation,
    found=_found,
    connect_matches=is_file_format,
    connect_found=_connect_found,
)
