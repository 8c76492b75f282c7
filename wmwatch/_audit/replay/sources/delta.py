"""Reading a batch of a Delta Lake stream again (``spark.readStream.format("delta")``): the files
batch N read, from its two logged offsets and the table's log, read back through Delta's own
reader; a file or commit no longer there is the batch lost with the reason. The rule, from
Delta's source and checked in real runs: docs/audit-sources.md (Delta Lake).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.replay.sources.base import (
    SOURCE_FILE_COL,
    Found,
    SourceKind,
    scala_map,
    scala_seq,
)
from wmwatch._checkpoint.reader import CheckpointEntryGone, CheckpointReader, parse_offset_json
from wmwatch._errors import AuditError, UnsupportedSourceError
from wmwatch._text import first_line

# Delta's offset index that stands before every file of a version (written as -1)
BASE_INDEX = -1
# indexes Delta writes (sourceVersion 3) only while it tracks schema changes in a schema log
_METADATA_INDEXES = (-20, -19)
# options (lower case) that change which files a Delta stream reads; others are passed over
_UNSUPPORTED_OPTIONS = ("readchangefeed", "excluderegex", "schematrackinglocation")


@dataclass(frozen=True, slots=True, order=True)
class DeltaOffset:
    """One Delta source offset: the last file read is ``(version, index)``."""

    version: int
    index: int
    initial_snapshot: bool = field(compare=False)


@dataclass(frozen=True, slots=True)
class DeltaStart:
    """Where a batch starts reading: after ``(version, index)``, within the snapshot of
    ``version`` first when ``initial_snapshot``."""

    version: int
    index: int
    initial_snapshot: bool


@dataclass(frozen=True, slots=True)
class IndexedFile:
    """A file in the order the stream reads the table (``path`` as the log writes it)."""

    version: int
    index: int
    path: str
    action: Any = field(compare=False, repr=False)  # Delta's AddFile (JVM)


@dataclass(frozen=True, slots=True)
class DeltaSourceSpec:
    """How to read the production query's Delta source again."""

    path: str
    schema_json: str
    starting_version: int | None
    skip_change_commits: bool
    # the startingTimestamp option as written; resolved to a version against the table's log
    starting_timestamp: str | None = None


def parse_delta_offset(text: str, what: str) -> DeltaOffset:
    """A Delta source offset line, e.g. ``{"sourceVersion":1,...,"reservoirVersion":2,
    "index":1,"isStartingVersion":false}``."""
    raw = parse_offset_json(text, what)
    try:
        offset = DeltaOffset(
            int(raw["reservoirVersion"]), int(raw["index"]), bool(raw["isStartingVersion"])
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise AuditError(
            f"the {what} offset {first_line(text, 120)!r} is not a Delta source offset; the "
            "checkpoint does not belong to this query."
        ) from exc
    if offset.index in _METADATA_INDEXES:
        raise UnsupportedSourceError(
            "the Delta stream tracks schema changes (schemaTrackingLocation); batches around a "
            "schema change cannot be replayed by the audit."
        )
    return offset


def batch_start(
    before: DeltaOffset | None, end: DeltaOffset, starting_version: int | None
) -> DeltaStart:
    """Where a batch ending at ``end`` started reading (``DeltaSource.extractStartingState``):
    after the previous batch's offset, else at ``startingVersion``, else in the first snapshot."""
    if before is not None:
        return DeltaStart(before.version, before.index, before.initial_snapshot)
    if starting_version is not None:
        return DeltaStart(starting_version, BASE_INDEX, False)
    if end.initial_snapshot:
        return DeltaStart(end.version, BASE_INDEX, True)
    # the batch read the whole snapshot and went on into the next version(s): its snapshot is
    # the version before its end's
    return DeltaStart(end.version - 1, BASE_INDEX, True)


def commit_files(version: int, actions: Iterable[Any], skip_change_commits: bool) -> list[Any]:
    """The AddFile actions of one commit that the stream reads, in commit order: those with
    ``dataChange``, none when ``skipChangeCommits`` is on and the commit removes data."""
    adds: list[Any] = []
    removes_data = False
    for action in actions:
        kind = str(action.getClass().getSimpleName())
        if kind == "AddFile" and bool(action.dataChange()):
            adds.append(action)
        elif kind == "RemoveFile" and bool(action.dataChange()):
            removes_data = True
    if removes_data and skip_change_commits:
        return []
    return adds


def in_range(
    files: Iterable[IndexedFile], start: DeltaStart, end: DeltaOffset
) -> list[IndexedFile]:
    """The files after ``start`` up to and including ``end`` (``DeltaSource.getFileChanges``)."""
    return [
        f
        for f in files
        if (f.version > start.version or f.index > start.index)
        and (f.version < end.version or (f.version == end.version and f.index <= end.index))
    ]


def _indexed(version: int, actions: Iterable[Any]) -> Iterator[IndexedFile]:
    for index, action in enumerate(actions):
        yield IndexedFile(version, index, str(action.path()), action)


def _option(options: dict[str, str], name: str) -> str | None:
    for key, value in options.items():
        if key.lower() == name.lower():
            return value
    return None


def delta_spec_of(options: dict[str, str], paths: list[str], schema_json: str) -> DeltaSourceSpec:
    """The Delta source's table and the options that decide what its batches read."""
    used = [k for k in options if k.lower() in _UNSUPPORTED_OPTIONS]
    if used:
        raise UnsupportedSourceError(
            f"the Delta stream uses {', '.join(sorted(used))}, which the audit does not replay; "
            "audit a stream without it."
        )
    path = paths[0] if paths else _option(options, "path")
    if not path:
        raise UnsupportedSourceError(
            "the Delta stream reads a catalog table; the audit replays Delta streams read by path "
            "(spark.readStream.format('delta').load(path))."
        )
    starting = _option(options, "startingVersion")
    starting_version: int | None = None
    if starting is not None:
        if not starting.strip().isdigit():
            raise UnsupportedSourceError(
                f"the Delta stream starts at startingVersion={starting!r}; the audit replays "
                "streams that start at their first snapshot or at a numbered startingVersion."
            )
        starting_version = int(starting)
    # Delta refuses both options together, so at most one is set on a stream that ran
    starting_timestamp = _option(options, "startingTimestamp")
    skip = (_option(options, "skipChangeCommits") or "false").strip().lower() == "true"
    return DeltaSourceSpec(path, schema_json, starting_version, skip, starting_timestamp)


def is_delta_source(relation: Any) -> bool:
    """Whether a streaming relation (JVM logical-plan node) reads a Delta table."""
    try:
        if str(relation.nodeName()) != "StreamingRelation":
            return False
        name = str(relation.dataSource().className()).lower()
    except Exception:  # noqa: BLE001 - not a V1 streaming relation
        return False
    return name == "delta" or name.endswith("deltadatasource")


def delta_source_of(spark: Any, relation: Any) -> DeltaSourceSpec:
    """The Delta source a streaming relation reads, from its logical plan (classic PySpark
    only)."""
    ds = relation.dataSource()
    return delta_spec_of(
        scala_map(spark, ds.options()),
        scala_seq(spark, ds.paths()),
        str(relation.schema().json()),
    )


def _found(spark: Any, events: Any, relation: Any, positions: list[int], plan_text: str) -> Found:
    delta = delta_source_of(spark, relation)
    return Found(
        positions, lambda index: DeltaBatchSource(delta, index, spark), f"Delta table {delta.path}"
    )


@dataclass(frozen=True, slots=True)
class DeltaBatch:
    """What one batch read from the Delta table: its files and the table version whose schema
    and protocol read them."""

    files: tuple[IndexedFile, ...]
    end_version: int


@dataclass(frozen=True, slots=True)
class DeltaBatchSource:
    """A Delta stream: batch N read the table's files between ``offsets/N-1`` and ``offsets/N``."""

    spec: DeltaSourceSpec
    index: int
    spark: Any = field(compare=False, repr=False)

    @property
    def source_index(self) -> int:
        return self.index

    def _log(self) -> Any:
        jvm = self.spark.sparkContext._jvm
        return jvm.org.apache.spark.sql.delta.DeltaLog.forTable(
            self.spark._jsparkSession, self.spec.path
        )

    def batch_input(self, checkpoint: CheckpointReader, batch_id: int) -> DeltaBatch | None:
        end_entry = checkpoint.offsets(batch_id)
        if end_entry is None or self.index >= len(end_entry.source_offsets):
            raise AuditError(
                f"offsets/{batch_id} has no line for source {self.index}; the checkpoint does "
                "not belong to this query."
            )
        end_text = end_entry.source_offsets[self.index]
        if end_text is None:
            return None
        before_text = None
        if batch_id > 0:
            before_entry = checkpoint.offsets(batch_id - 1)
            if before_entry is None:
                raise CheckpointEntryGone(
                    f"offsets/{batch_id - 1} is gone (spark.sql.streaming.minBatchesToRetain), "
                    f"so where batch {batch_id} started reading is unknown"
                )
            before_text = before_entry.source_offsets[self.index]
        end = parse_delta_offset(end_text, "end")
        before = parse_delta_offset(before_text, "start") if before_text is not None else None
        if before is not None and (before.version, before.index) == (end.version, end.index):
            return None  # the batch read nothing new from this table
        starting_version = self.spec.starting_version
        if before is None and self.spec.starting_timestamp is not None:
            starting_version = self._version_at(self.spec.starting_timestamp)
        start = batch_start(before, end, starting_version)
        files = in_range(self._sequence(start, end), start, end)
        self._check_present(batch_id, files)
        # the end can stand before a version not yet committed (index -1): read the files at
        # the newest version they come from
        return DeltaBatch(tuple(files), max(f.version for f in files)) if files else None

    def _version_at(self, timestamp: str) -> int:
        """The version a stream started with ``startingTimestamp=timestamp`` reads from, by
        Delta's own code (``DeltaSource.getStartingVersion``): the timestamp parsed in the
        session's time zone, then the first commit at or after it (commit times are the log
        files' modification times, or in-commit timestamps when the table has them)."""
        jvm = self.spark.sparkContext._jvm
        session = self.spark._jsparkSession
        option = jvm.scala.Option
        try:
            # the string literal Delta builds from the option (Literal(startingTimestamp))
            literal = jvm.org.apache.spark.sql.catalyst.expressions.Literal(
                jvm.org.apache.spark.unsafe.types.UTF8String.fromString(timestamp),
                jvm.org.apache.spark.sql.types.DataTypes.StringType,
            )
            spec = jvm.org.apache.spark.sql.delta.DeltaTimeTravelSpec(
                option.apply(literal), option.empty(), option.apply("deltaSource"), True
            )
            instant = spec.getTimestamp(session.sessionState().conf())
            # canExceedLatest: a timestamp after the last commit starts past it (nothing to
            # read yet) rather than failing, as the stream allows with
            # spark.databricks.delta.changeDataFeed.timestampOutOfRange.enabled
            version = (
                jvm.org.apache.spark.sql.delta.sources.DeltaSource.getStartingVersionFromTimestamp(
                    session, self._log(), option.empty(), instant, True
                )
            )
        except Exception as exc:
            raise CheckpointEntryGone(
                f"the Delta stream's startingTimestamp={timestamp!r} cannot be resolved to a "
                f"version of {self.spec.path} again: {first_line(str(exc), 160)}"
            ) from exc
        return int(version)

    def _sequence(self, start: DeltaStart, end: DeltaOffset) -> Iterator[IndexedFile]:
        """The files the stream reads from ``start``'s version to ``end``'s, numbered as
        Delta numbers them."""
        log = self._log()
        first_commit = start.version
        if start.initial_snapshot:
            yield from _indexed(start.version, self._snapshot_files(log, start.version))
            first_commit = start.version + 1
        if first_commit > end.version:
            return
        jvm = self.spark.sparkContext._jvm
        try:
            changes = log.getChanges(first_commit, jvm.scala.Option.empty(), True)
            expected = first_commit
            while changes.hasNext():
                pair = changes.next()
                version = int(pair._1())
                if version > end.version:
                    break
                if version != expected:
                    raise CheckpointEntryGone(
                        f"the Delta log of {self.spec.path} has no commit {expected} "
                        "(removed by the log's retention, delta.logRetentionDuration), so the "
                        "files the batch read are unknown"
                    )
                expected += 1
                actions = jvm.scala.jdk.javaapi.CollectionConverters.asJava(pair._2())
                yield from _indexed(
                    version, commit_files(version, actions, self.spec.skip_change_commits)
                )
        except CheckpointEntryGone:
            raise
        except Exception as exc:
            if "FileNotFound" in str(exc) or "DELTA_VERSIONS_NOT_CONTIGUOUS" in str(exc):
                raise CheckpointEntryGone(
                    f"the Delta log of {self.spec.path} no longer holds the commits from "
                    f"{first_commit} (log retention): {first_line(str(exc), 160)}"
                ) from exc
            raise

    def _snapshot_files(self, log: Any, version: int) -> list[Any]:
        """The snapshot's files at ``version`` in the order the stream numbers them."""
        jvm = self.spark.sparkContext._jvm
        try:
            snapshot = log.getSnapshotAt(
                version, jvm.scala.Option.empty(), jvm.scala.Option.empty(), False
            )
        except Exception as exc:
            raise CheckpointEntryGone(
                f"the Delta table {self.spec.path} can no longer be read at version {version} "
                f"(its first snapshot): {first_line(str(exc), 160)}"
            ) from exc
        files = list(snapshot.allFiles().collectAsList())
        # DeltaSourceSnapshot numbers the snapshot's files sorted by (modificationTime, path)
        return sorted(files, key=lambda f: (int(f.modificationTime()), str(f.path())))

    def _check_present(self, batch_id: int, files: list[IndexedFile]) -> None:
        """Every file of the batch must still exist: VACUUM removes files the table no longer
        references, and a batch without one of its files would be counted short."""
        if not files:
            return
        jvm = self.spark.sparkContext._jvm
        root = jvm.org.apache.hadoop.fs.Path(self.spec.path)
        fs = root.getFileSystem(self.spark._jsc.hadoopConfiguration())
        for f in files:
            # as Delta resolves an action's path: a URI, relative to the table unless absolute
            relative = jvm.org.apache.hadoop.fs.Path(jvm.java.net.URI(f.path))
            target = (
                relative if relative.isAbsolute() else jvm.org.apache.hadoop.fs.Path(root, relative)
            )
            if not fs.exists(target):
                raise CheckpointEntryGone(
                    f"the Delta table's file {f.path} that batch {batch_id} read (version "
                    f"{f.version}) is gone (removed by VACUUM?), so the batch cannot be read "
                    "again; keep delta.deletedFileRetentionDuration longer than the audit's lag"
                )

    def read(self, spark: Any, what: Any) -> Any:
        """The batch's rows, read through Delta's own reader over exactly its files."""
        from pyspark.sql import DataFrame
        from pyspark.sql import functions as F
        from pyspark.sql.types import StructType

        batch: DeltaBatch = what
        jvm = spark.sparkContext._jvm
        log = self._log()
        snapshot = log.getSnapshotAt(
            batch.end_version, jvm.scala.Option.empty(), jvm.scala.Option.empty(), False
        )
        utils = jvm.org.apache.spark.api.python.PythonUtils
        # files with deletion vectors are read one version per scan, as the stream reads them
        # (one scan cannot hold one file twice with different vectors)
        with_dv = any(f.action.deletionVector() is not None for f in batch.files)
        groups: dict[int, list[IndexedFile]] = {}
        for f in batch.files:
            groups.setdefault(f.version if with_dv else 0, []).append(f)
        # the stream's columns (its schema when it started; a column added since is not read)
        fields = StructType.fromJson(json.loads(self.spec.schema_json)).fields
        frames = []
        for group in groups.values():
            actions = jvm.java.util.ArrayList()
            for f in group:
                actions.add(f.action)
            jdf = log.createDataFrame(
                snapshot, utils.toSeq(actions), False, jvm.scala.Option.empty()
            )
            frame = DataFrame(jdf, spark)
            frames.append(
                frame.select(
                    *stream_columns(fields, set(frame.columns)),
                    F.col("_metadata.file_path").alias(SOURCE_FILE_COL),
                )
            )
        result = frames[0]
        for frame in frames[1:]:
            result = result.unionByName(frame)
        return result


def stream_columns(fields: Iterable[Any], present: set[str]) -> list[Any]:
    """The stream's columns over a batch read at its own table version: a column the table
    gained after the batch (a restart after a schema change reads the new schema) is null in
    it, as Delta reads an older file under a wider schema."""
    from pyspark.sql import functions as F

    return [
        F.col(f"`{f.name}`") if f.name in present else F.lit(None).cast(f.dataType).alias(f.name)
        for f in fields
    ]


# Delta on Spark Connect is not read: its log and files are reached through the driver's JVM
KIND = SourceKind(
    name="delta",
    matches=lambda spark, relation: is_delta_source(relation),
    found=_found,
)
