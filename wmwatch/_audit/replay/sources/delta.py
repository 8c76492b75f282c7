"""Reading a batch of a Delta Lake stream again (``spark.readStream.format("delta")``): the files
batch N read, from its two logged offsets and the table's log, read back through Delta's own
reader, only from the table the offsets name (``reservoirId``); a file or commit no longer
there, or another table at the path, is the batch lost with the reason. The rule, from Delta's
source and checked in real runs: docs/audit-sources.md (Delta Lake). Over 500 lines because
Delta's rule for which files a batch read (pure, tested without a JVM) and the reads through
Delta's own classes that apply it change together with each Delta release.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.replay.sources.base import (
    SOURCE_FILE_COL,
    Found,
    SourceKind,
    SourceOptions,
    scala_map,
    scala_seq,
)
from wmwatch._checkpoint.fs import CheckpointDamaged, CheckpointEntryGone
from wmwatch._checkpoint.reader import (
    CheckpointReader,
    checkpoint_long,
    parse_offset_json,
    source_line,
)
from wmwatch._errors import UnsupportedSourceError
from wmwatch._text import first_line

# Delta's offset index that stands before every file of a version (written as -1)
BASE_INDEX = -1
# indexes Delta writes (sourceVersion 3) only while it tracks schema changes in a schema log
_METADATA_INDEXES = (-20, -19)
# the base index as Delta writes it beside those (sourceVersion 3): before every file, as -1
_BASE_INDEX_V3 = -100
# options that change which files a Delta stream reads; others are passed over
_UNSUPPORTED_OPTIONS = ("readChangeFeed", "excludeRegex", "schemaTrackingLocation")
# Delta's option (and session default) that reads the first snapshot bucketed by event time, in
# another order and batching than the file order this module replays
_EVENT_TIME_ORDER = "withEventTimeOrder"
_EVENT_TIME_ORDER_CONF = "spark.databricks.delta.withEventTimeOrder.enabled"
# with it on, Spark skips a data file that is gone instead of failing the read
_IGNORE_MISSING_FILES = "spark.sql.files.ignoreMissingFiles"
# the column that numbers a snapshot's files in the stream's order, while a slice is picked
_RANK_COL = "__wmwatch_rank"
# how Spark and Delta say that a data file the read needed is gone
_FILE_GONE = ("FileNotFoundException", "FILE_NOT_EXIST", "DELTA_FILE_NOT_FOUND")


@dataclass(frozen=True, slots=True, order=True)
class DeltaOffset:
    """One Delta source offset: the last file read is ``(version, index)`` of the table whose
    id is ``table_id``."""

    version: int
    index: int
    initial_snapshot: bool = field(compare=False)
    table_id: str | None = field(default=None, compare=False)


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
    "index":1,"isStartingVersion":false}``; :class:`CheckpointDamaged` for a line of another
    shape or with numbers Delta never writes (the batch cannot be read)."""
    raw = parse_offset_json(text, what)
    if (
        not isinstance(raw, dict)
        or not {"reservoirVersion", "index", "isStartingVersion"} <= raw.keys()
        or not isinstance(raw["isStartingVersion"], bool)
    ):
        raise CheckpointDamaged(
            f"the {what} offset line is not a Delta source offset; the checkpoint is damaged "
            "or does not belong to this query."
        )
    table_id = raw.get("reservoirId")
    index = raw["index"]
    if index not in (*_METADATA_INDEXES, _BASE_INDEX_V3):
        index = checkpoint_long(index, f"the {what} offset's index", minimum=BASE_INDEX)
    offset = DeltaOffset(
        checkpoint_long(raw["reservoirVersion"], f"the {what} offset's reservoirVersion"),
        index,
        raw["isStartingVersion"],
        table_id if isinstance(table_id, str) else None,
    )
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


def snapshot_slice(start: DeltaStart, end: DeltaOffset) -> tuple[int, int | None]:
    """The numbers of the first snapshot's files a batch read: after ``start.index``, and
    ``count`` of them (None: every one after it, when the batch read on past the snapshot)."""
    if end.version == start.version:
        return start.index, max(0, end.index - start.index)
    return start.index, None


def file_gone(error: BaseException, table: str) -> bool:
    """Whether a replay failed because a data file of ``table`` it had to read is gone."""
    text = str(error)
    root = table.rstrip("/").removeprefix("file:").lstrip("/")
    return any(mark in text for mark in _FILE_GONE) and (not root or root in text)


def delta_spec_of(given: Mapping[str, str], paths: list[str], schema_json: str) -> DeltaSourceSpec:
    """The Delta source's table and the options that decide what its batches read."""
    options = SourceOptions.of(given)
    used = [name for name in _UNSUPPORTED_OPTIONS if name in options]
    if used:
        raise UnsupportedSourceError(
            f"the Delta stream uses {', '.join(sorted(used))}, which the audit does not replay; "
            "audit a stream without it."
        )
    if (options.get(_EVENT_TIME_ORDER) or "false").strip().lower() == "true":
        raise UnsupportedSourceError(
            f"the Delta stream reads with {_EVENT_TIME_ORDER}, which batches its first snapshot "
            "by event time, not in the file order the audit replays; audit a stream without it."
        )
    path = paths[0] if paths else options.get("path")
    if not path:
        raise UnsupportedSourceError(
            "the Delta stream reads a catalog table; the audit replays Delta streams read by path "
            "(spark.readStream.format('delta').load(path))."
        )
    starting = options.get("startingVersion")
    starting_version: int | None = None
    if starting is not None:
        if not starting.strip().isdigit():
            raise UnsupportedSourceError(
                f"the Delta stream starts at startingVersion={starting!r}; the audit replays "
                "streams that start at their first snapshot or at a numbered startingVersion."
            )
        starting_version = int(starting)
    # Delta refuses both options together, so at most one is set on a stream that ran
    starting_timestamp = options.get("startingTimestamp")
    skip = (options.get("skipChangeCommits") or "false").strip().lower() == "true"
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
    for key, what in (
        (_EVENT_TIME_ORDER_CONF, "reads first snapshots by event time, not in file order"),
        (_IGNORE_MISSING_FILES, "would skip a vacuumed file silently and audit its batch short"),
    ):
        if str(spark.conf.get(key, "false")).strip().lower() == "true":
            raise UnsupportedSourceError(
                f"the session sets {key}=true, which {what}; the audit replays Delta streams "
                "with it off."
            )
    ds = relation.dataSource()
    return delta_spec_of(
        SourceOptions(scala_map(spark, ds.options())),
        scala_seq(spark, ds.paths()),
        str(relation.schema().json()),
    )


def _found(spark: Any, events: Any, relation: Any, positions: list[int], plan_text: str) -> Found:
    delta = delta_source_of(spark, relation)
    return Found(
        positions, lambda index: DeltaBatchSource(delta, index, spark), f"Delta table {delta.path}"
    )


@dataclass(frozen=True, slots=True)
class DeltaRead:
    """What one batch read from the Delta table, as its offsets say: the files are worked out
    when it is read again."""

    batch_id: int
    before: DeltaOffset | None
    end: DeltaOffset


@dataclass(frozen=True, slots=True)
class DeltaFiles:
    """The files one batch read, as Delta's ``AddFile`` actions in JVM lists: one per version
    they come from (the first snapshot's slice is one), and the newest version, whose schema
    and protocol read them."""

    groups: tuple[tuple[int, Any], ...] = field(repr=False)
    end_version: int
    deletion_vectors: bool

    @property
    def versions(self) -> set[int]:
        return {version for version, _ in self.groups}


@dataclass(frozen=True, slots=True)
class DeltaBatchSource:
    """A Delta stream: batch N read the table's files between ``offsets/N-1`` and ``offsets/N``."""

    spec: DeltaSourceSpec
    index: int
    spark: Any = field(compare=False, repr=False)
    # the snapshots read recently, by version (at most two: the first snapshot, whose slices
    # many batches read, and the newest), so that each batch does not rebuild them
    _snapshots: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)
    # the last file of the snapshot slice read last: (version, index, modificationTime, path),
    # where the next batch's slice starts
    _cursor: list[tuple[int, int, int, str]] = field(
        default_factory=list, compare=False, repr=False
    )

    @property
    def source_index(self) -> int:
        return self.index

    def _log(self) -> Any:
        jvm = self.spark.sparkContext._jvm
        return jvm.org.apache.spark.sql.delta.DeltaLog.forTable(
            self.spark._jsparkSession, self.spec.path
        )

    def batch_input(self, checkpoint: CheckpointReader, batch_id: int) -> DeltaRead | None:
        end_entry = checkpoint.offsets(batch_id)
        if end_entry is None:
            raise CheckpointEntryGone(
                f"offsets/{batch_id} is missing from the checkpoint; it cannot be audited."
            )
        end_text = source_line(end_entry, self.index)
        if end_text is None:
            return None
        before_text = None
        if batch_id > 0:
            before_text = source_line(checkpoint.offsets_before(batch_id), self.index)
        end = parse_delta_offset(end_text, "end")
        before = parse_delta_offset(before_text, "start") if before_text is not None else None
        if before is not None and (before.version, before.index) == (end.version, end.index):
            return None  # the batch read nothing new from this table
        return DeltaRead(batch_id, before, end)

    def files_of(self, what: DeltaRead) -> DeltaFiles | None:
        """The files the batch read, in the stream's order; None when it read none (a batch
        of ``OPTIMIZE``, whose commit adds no data). Checks first that the table is the one
        the stream read."""
        starting_version = self.spec.starting_version
        if what.before is None and self.spec.starting_timestamp is not None:
            starting_version = self._version_at(self.spec.starting_timestamp)
        start = batch_start(what.before, what.end, starting_version)
        log = self._log()
        groups: list[tuple[int, Any]] = []
        first_commit = start.version
        if start.initial_snapshot:
            snapshot = self._snapshot(log, start.version, "its first snapshot")
            self._same_table(snapshot, what)
            adds = self._snapshot_slice(snapshot, start, what.end)
            if adds.size() > 0:
                groups.append((start.version, adds))
            first_commit = start.version + 1
        with_dv = False
        if first_commit <= what.end.version:
            jvm = self.spark.sparkContext._jvm
            committed = in_range(self._commits(log, first_commit, what.end), start, what.end)
            by_version: dict[int, Any] = {}
            for f in committed:
                with_dv = with_dv or f.action.deletionVector() is not None
                by_version.setdefault(f.version, jvm.java.util.ArrayList()).add(f.action)
            groups.extend(sorted(by_version.items()))
        if not groups:
            return None
        end_version = max(version for version, _ in groups)
        if not start.initial_snapshot:
            self._same_table(self._snapshot(log, end_version, "the batch's version"), what)
        return DeltaFiles(tuple(groups), end_version, with_dv)

    def _same_table(self, snapshot: Any, what: DeltaRead) -> None:
        """The table at the path must be the one the stream read (its id, in the offsets)."""
        wanted = what.end.table_id
        found = str(snapshot.metadata().id())
        if wanted is not None and found != wanted:
            raise CheckpointEntryGone(
                f"the Delta table at {self.spec.path} is not the table batch {what.batch_id} "
                f"read (table id {wanted} in the checkpoint, {found} now): it was deleted and "
                "created again at that path, or the audit was given another table's path, so "
                "the batch's files cannot be read again"
            )

    def _snapshot(self, log: Any, version: int, what: str) -> Any:
        """The table's snapshot at ``version``, kept for the next batches that read it."""
        snapshot = self._snapshots.get(version)
        if snapshot is not None:
            return snapshot
        jvm = self.spark.sparkContext._jvm
        try:
            snapshot = log.getSnapshotAt(
                version, jvm.scala.Option.empty(), jvm.scala.Option.empty(), False
            )
        except Exception as exc:
            raise CheckpointEntryGone(
                f"the Delta table {self.spec.path} can no longer be read at version {version} "
                f"({what}; removed by the log's retention, or the table replaced): "
                f"{first_line(str(exc), 160)}"
            ) from exc
        if len(self._snapshots) >= 2:
            self._snapshots.pop(min(self._snapshots))
        self._snapshots[version] = snapshot
        return snapshot

    def _snapshot_slice(self, snapshot: Any, start: DeltaStart, end: DeltaOffset) -> Any:
        """The first snapshot's files a batch read (``DeltaSourceSnapshot`` numbers them sorted
        by ``(modificationTime, path)``), picked by Spark from the snapshot's file list: only
        the batch's files reach the driver, as a JVM list of ``AddFile`` actions.

        After the slice of the batch before, the next one is the files past its last file's
        sort key (a scan keeping the smallest ``count``); otherwise the files are ranked once."""
        from pyspark.sql import DataFrame, Window
        from pyspark.sql import functions as F

        after, count = snapshot_slice(start, end)
        files = snapshot.allFiles()
        frame = DataFrame(files.toDF(), self.spark)
        order = [F.col("modificationTime"), F.col("path")]
        cursor = self._cursor[0] if self._cursor else None
        if after == BASE_INDEX:
            chosen = frame.orderBy(*order)
        elif cursor is not None and cursor[:2] == (start.version, after):
            modified, path = cursor[2], cursor[3]
            past = (F.col("modificationTime") > modified) | (
                (F.col("modificationTime") == modified) & (F.col("path") > path)
            )
            chosen = frame.where(past).orderBy(*order)
        else:
            rank = F.row_number().over(Window.orderBy(*order)) - 1
            chosen = (
                frame.withColumn(_RANK_COL, rank)
                .where(F.col(_RANK_COL) > after)
                .orderBy(_RANK_COL)
                .drop(_RANK_COL)
            )
        if count is not None:
            chosen = chosen.limit(count)
        adds = getattr(chosen._jdf, "as")(files.encoder()).collectAsList()
        taken = int(adds.size())
        self._cursor.clear()
        if taken:
            last = adds.get(taken - 1)
            self._cursor.append(
                (start.version, after + taken, int(last.modificationTime()), str(last.path()))
            )
        return adds

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

    def _commits(self, log: Any, first_commit: int, end: DeltaOffset) -> Iterator[IndexedFile]:
        """The files the stream reads from the commits ``first_commit`` to ``end``'s version,
        numbered as Delta numbers them."""
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

    def read(self, spark: Any, what: Any) -> Any:
        """The batch's rows, read through Delta's own reader over exactly its files."""
        from pyspark.sql import DataFrame
        from pyspark.sql import functions as F
        from pyspark.sql.types import StructType

        # the stream's columns (its schema when it started; a column added since is not read)
        fields = StructType.fromJson(json.loads(self.spec.schema_json)).fields
        batch = self.files_of(what)
        if batch is None:
            return spark.createDataFrame([], StructType(fields)).withColumn(
                SOURCE_FILE_COL, F.lit(None).cast("string")
            )
        jvm = spark.sparkContext._jvm
        log = self._log()
        snapshot = self._snapshot(log, batch.end_version, "the batch's version")
        utils = jvm.org.apache.spark.api.python.PythonUtils
        # files with deletion vectors are read one version per scan, as the stream reads them
        # (one scan cannot hold one file twice with different vectors)
        if batch.deletion_vectors:
            scans = [adds for _, adds in batch.groups]
        else:
            together = jvm.java.util.ArrayList()
            for _, adds in batch.groups:
                together.addAll(adds)
            scans = [together]
        frames = []
        for adds in scans:
            jdf = log.createDataFrame(snapshot, utils.toSeq(adds), False, jvm.scala.Option.empty())
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

    def after_read(self, spark: Any, what: Any, error: BaseException | None) -> None:
        """A replay that failed on a data file that is gone: the batch is lost, not retried."""
        if error is not None and file_gone(error, self.spec.path):
            batch: DeltaRead = what
            raise CheckpointEntryGone(
                f"a data file of the Delta table that batch {batch.batch_id} read is gone "
                "(removed by VACUUM?), so the batch cannot be read again; keep "
                "delta.deletedFileRetentionDuration longer than the audit's lag"
            ) from None


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
