"""The sources the audit reads again, one module per kind behind the
:class:`~wmwatch._audit.replay.sources.base.BatchSource` seam, and their one registry,
:data:`KINDS`.

Adding a kind of source is a module here that ends with its ``KIND``
(:class:`~wmwatch._audit.replay.sources.base.SourceKind`: which streaming relations it reads and
how to read them again) and one line in :data:`KINDS`.
"""

from __future__ import annotations

from typing import Any

from wmwatch._audit.replay import connect
from wmwatch._audit.replay.sources import delta, files, jvm_stream, kafka, python
from wmwatch._audit.replay.sources.base import (
    ConnectFound,
    Found,
    SourceKind,
    UnreplayableSource,
    relation_of,
    relation_position,
)
from wmwatch._errors import UnsupportedSourceError
from wmwatch._text import clean, first_line

# The first kind that matches a relation reads it. Delta comes before files (both are V1
# sources: files takes every other one, reading or refusing it); on Spark Connect, Python data
# sources come last, as a format no other kind claims names one.
KINDS: tuple[SourceKind, ...] = (delta.KIND, files.KIND, kafka.KIND, jvm_stream.KIND, python.KIND)


def source_of(spark: Any, events: Any, query_plan: Any, plan_text: str) -> Found:
    """The source ``events`` reads (classic PySpark), by the first kind that reads it."""
    relation = relation_of(events)
    positions = relation_position(query_plan, relation) if query_plan is not None else []
    for kind in KINDS:
        if kind.matches(spark, relation):
            return kind.found(spark, events, relation, positions, plan_text)
    raise UnsupportedSourceError(
        f"events reads {first_line(str(relation.toString()), 120)}, which cannot be replayed "
        f"batch by batch; the audit reads again file sources "
        f"({', '.join(files.SUPPORTED_FORMATS)}), Kafka, Delta Lake, Python data sources and "
        "the JVM streams a session holds (docs/audit-sources.md)."
    )


def connect_source_of(events: Any) -> ConnectFound:
    """The source a Spark Connect events DataFrame reads, off the client's plan objects; its
    position once the query's progress names its sources."""
    relation = connect.streaming_relation(events)
    for kind in KINDS:
        found, matches = kind.connect_found, kind.connect_matches
        if found is not None and matches is not None and matches(relation):
            return found(events, relation)
    raise UnsupportedSourceError(f"events reads {relation._format!r}, which no source kind reads.")


def unreplayable(events: Any, query_plan: Any, exc: UnsupportedSourceError) -> Found:
    """A source the audit cannot read again (classic PySpark, where its position is known):
    what Spark dropped from it is counted from progress, without the rows."""
    relation = relation_of(events)
    reason = clean(str(exc).split(";", 1)[0])
    return Found(
        relation_position(query_plan, relation),
        lambda index: UnreplayableSource(index, reason),
        f"a source that cannot be read again ({reason})",
    )
