"""Which file source a query reads, read off its logical plan through the driver's JVM.

The audit can replay a batch only when the query reads one file source whose files stay where
they are: :func:`file_source_of` says how to read that source again as a batch, or why it cannot.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from wmwatch._audit.checkpoint import normalise_path
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


def file_source_of(spark: Any, events: Any, *, has_prepare: bool) -> FileSourceSpec:
    """The file source ``events`` reads, from its logical plan (classic PySpark only)."""
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
    plan = jdf.queryExecution().analyzed()
    nodes = list(_plan_nodes(plan))
    relations = [n for n in nodes if n.nodeName().startswith("Streaming")]
    if len(relations) != 1:
        raise UnsupportedSourceError(
            f"events reads {len(relations)} streaming sources; the audit replays exactly one file "
            f"source ({', '.join(SUPPORTED_FORMATS)}): pass the DataFrame of that source."
        )
    relation = relations[0]
    if relation.nodeName() != "StreamingRelation":
        raise UnsupportedSourceError(
            f"events reads {first_line(str(relation.toString()), 120)}, which cannot be replayed "
            f"batch by batch; the audit supports file sources ({', '.join(SUPPORTED_FORMATS)})."
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
        extra = [
            n.nodeName()
            for n in nodes
            if n.nodeName() not in ("EventTimeWatermark", "StreamingRelation")
        ]
        if extra:
            raise AuditError(
                f"events transforms the source ({', '.join(dict.fromkeys(extra))}); pass "
                "prepare=, a function that turns the raw source DataFrame into events, so "
                "batches can be replayed."
            )
    return FileSourceSpec(
        format=short, schema_json=str(relation.schema().json()), options=options, paths=paths
    )


def source_index(plan_text: str, source: FileSourceSpec) -> int:
    """Position of the source in the query's source list (= the checkpoint's sources/<i>)."""
    found = _STREAMING_RELATION.findall(plan_text)
    if len(found) <= 1:
        return 0
    wanted = {normalise_path(p) for p in source.paths}
    matches = [i for i, (_, _, path) in enumerate(found) if normalise_path(path) in wanted]
    if len(matches) != 1:
        raise UnsupportedSourceError(
            "the query reads several sources and the audited file source cannot be matched to one "
            "of them by path; audit a query that reads one file source."
        )
    return matches[0]
