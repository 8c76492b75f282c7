"""Reading a streaming query's checkpoint: offsets, commits and the file source's log.

The audit replays committed batches, so it needs three facts per batch N that only the
checkpoint records exactly: that N committed (``commits/N``), the watermark the late-row filter
of N used (``batchWatermarkMs`` of ``offsets/N-1``), and which files N read. The last one is
indirect: a file source numbers its own log (``sources/<i>/<K>``) and ``offsets/N`` holds that
source's ``{"logOffset": K}``; no-data batches repeat the previous K, so batch N read the log
entries ``(K(N-1), K(N)]``. Every tenth source-log entry is compacted into ``<K>.compact``, which
holds all entries up to K, each tagged with its own ``batchId`` (the log number).

Parsing is pure (text in, values out); :class:`CheckpointReader` adds file access through the
filesystems of :mod:`wmwatch._checkpoint.fs`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from wmwatch._checkpoint.fs import (
    CheckpointDamaged,
    CheckpointEntryGone,
    CheckpointFormatUnknown,
    FileSystem,
    LocalFileSystem,
    local_root,
)
from wmwatch._errors import AuditError

_LOG_VERSION = "v1"
# Spark keeps this many batches of offsets and commits (older ones are purged); its default.
MIN_BATCHES_TO_RETAIN_KEY = "spark.sql.streaming.minBatchesToRetain"
DEFAULT_MIN_BATCHES_TO_RETAIN = 100
_BATCH_FILE = re.compile(r"^(\d+)$")
_COMPACT_FILE = re.compile(r"^(\d+)\.compact$")


@dataclass(frozen=True, slots=True)
class OffsetsEntry:
    """One ``offsets/N`` file."""

    batch_id: int
    watermark_ms: int
    timestamp_ms: int | None
    conf: dict[str, str]
    source_offsets: tuple[str | None, ...]


@dataclass(frozen=True, slots=True)
class SourceFile:
    """One line of a file source's log: a file and the log number that took it in."""

    path: str
    timestamp_ms: int | None
    log_id: int


# The largest number Spark writes in a checkpoint (a Java long); anything past it is damage.
_MAX_LONG = 2**63 - 1
_VERSION_LINE = re.compile(r"^v\d{1,6}$")


def _log_lines(text: str, what: str) -> list[str]:
    """The lines after a log file's version line; :class:`CheckpointDamaged` for a file that is
    empty or does not start with ``v1`` (its content is never echoed: it may be anything)."""
    lines = text.split("\n")
    first = lines[0].strip()
    if first == _LOG_VERSION:
        return lines[1:]
    if not text.strip():
        raise CheckpointDamaged(
            f"{what} is empty (cut off while being written?); the checkpoint is damaged."
        )
    if _VERSION_LINE.match(first):
        raise CheckpointFormatUnknown(
            f"{what} is in log format {first!r}, not {_LOG_VERSION!r}, which this wmwatch does "
            "not read (a newer Spark, or a query run with source evolution); upgrade wmwatch."
        )
    raise CheckpointDamaged(
        f"{what} does not start with a log version line ({_LOG_VERSION!r}): it is not what Spark "
        "writes; the checkpoint is damaged."
    )


def checkpoint_json(text: str, what: str) -> Any:
    """One JSON value of a checkpoint file; :class:`CheckpointDamaged` for text that is not
    JSON or nests deeper than Python parses (Spark's own values nest a few levels)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        reason = "nested too deep" if isinstance(exc, RecursionError) else "not JSON"
        raise CheckpointDamaged(f"{what} is {reason}; the checkpoint is damaged.") from None


def checkpoint_long(value: Any, what: str, *, minimum: int = 0) -> int:
    """A number Spark writes as a Java long (a batch, log or Kafka offset, a time in ms):
    an integer from ``minimum`` to 2^63-1, else :class:`CheckpointDamaged`."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= _MAX_LONG:
        shown = value if isinstance(value, int) else type(value).__name__
        raise CheckpointDamaged(
            f"{what} is {shown}, not a number from {minimum} to 2^63-1 as Spark writes; the "
            "checkpoint is damaged."
        )
    return value


def parse_offsets(batch_id: int, text: str) -> OffsetsEntry:
    """Parse ``offsets/N``: a version line, a metadata JSON line, one line per source."""
    what = f"offsets/{batch_id}"
    lines = _log_lines(text, what)
    if not lines or not lines[0].strip():
        raise CheckpointDamaged(f"{what} has no metadata line; the checkpoint is damaged.")
    meta = checkpoint_json(lines[0], f"{what} metadata")
    if not isinstance(meta, dict):
        raise CheckpointDamaged(
            f"{what} metadata is a JSON {type(meta).__name__}, not the object Spark writes; the "
            "checkpoint is damaged."
        )
    body = lines[1:]
    while body and not body[-1].strip():
        body.pop()
    # A source without an offset yet is written as "-".
    sources = tuple(None if line.strip() in ("", "-") else line.strip() for line in body)
    conf = meta.get("conf") or {}
    if not isinstance(conf, dict) or not all(isinstance(v, str) for v in conf.values()):
        raise CheckpointDamaged(
            f"{what} metadata's conf is not the object of strings Spark writes; the checkpoint "
            "is damaged."
        )
    timestamp = meta.get("batchTimestampMs")
    return OffsetsEntry(
        batch_id=batch_id,
        watermark_ms=checkpoint_long(
            meta.get("batchWatermarkMs", 0) or 0, f"{what} batchWatermarkMs"
        ),
        timestamp_ms=(
            None if timestamp is None else checkpoint_long(timestamp, f"{what} batchTimestampMs")
        ),
        conf=dict(conf),
        source_offsets=sources,
    )


def parse_log_offset(offset_json: str | None, what: str = "source offset") -> int | None:
    """The ``logOffset`` of a file source's offset line; None for "no offset yet".

    :class:`CheckpointDamaged` for a line that is not a file source's offset, or whose number
    is out of range (-1, before the first file, up to 2^63-1): the batch cannot be read.
    """
    if offset_json is None:
        return None
    doc = checkpoint_json(offset_json, what)
    if isinstance(doc, dict) and "logOffset" in doc:
        return checkpoint_long(doc["logOffset"], f"{what} logOffset", minimum=-1)
    if isinstance(doc, int) and not isinstance(doc, bool):  # old file sources: a bare number
        return checkpoint_long(doc, what, minimum=-1)
    raise CheckpointDamaged(
        f'{what} is not a file source\'s offset ({{"logOffset": N}}); the checkpoint is damaged '
        "or does not belong to this query."
    )


def parse_source_log(text: str, what: str = "source log") -> list[SourceFile]:
    """Parse one source-log file (plain or ``.compact``)."""
    files: list[SourceFile] = []
    for line in _log_lines(text, what):
        if not line.strip():
            continue
        doc = checkpoint_json(line, f"a line of {what}")
        try:
            timestamp = doc.get("timestamp")
            if not isinstance(doc["path"], str):
                raise TypeError("path")
            files.append(
                SourceFile(
                    path=doc["path"],
                    timestamp_ms=None if timestamp is None else int(timestamp),
                    log_id=checkpoint_long(doc["batchId"], f"a line of {what}: batchId"),
                )
            )
        except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CheckpointDamaged(
                f"{what} has a line that is not a file entry ({type(exc).__name__}); the "
                "checkpoint is damaged."
            ) from exc
    return files


def files_for_log_range(
    list_names: Callable[[], Iterable[str]],
    read_text: Callable[[str], str | None],
    first_log_id: int,
    last_log_id: int,
) -> list[SourceFile]:
    """Entries with ``first_log_id <= log_id <= last_log_id`` from a source-log directory.

    A log number is read from its own file when it still exists, otherwise from a ``.compact``
    file at or after it (compaction keeps every earlier entry). The work is bounded by what the
    directory holds, never by the numbers asked for (a damaged offset may name any range).
    """
    if last_log_id < first_log_id:
        return []
    if first_log_id < 0:
        raise CheckpointDamaged(
            f"a batch starts reading the file source's log at {first_log_id}, below its first "
            "entry; the checkpoint is damaged."
        )
    wanted = last_log_id - first_log_id + 1
    names = list(list_names())
    plain = sorted(
        log_id
        for n in names
        if (m := _BATCH_FILE.match(n))
        and first_log_id <= (log_id := int(m.group(1))) <= last_log_id
    )
    compacts = sorted(int(m.group(1)) for n in names if (m := _COMPACT_FILE.match(n)))
    by_log: dict[int, list[SourceFile]] = {}
    for log_id in plain:
        text = read_text(str(log_id))
        if text is not None:  # else compacted and removed since the listing
            by_log[log_id] = parse_source_log(text, f"sources log {log_id}")
    if len(by_log) < wanted:
        # the numbers without a file of their own all lie at or below the highest such
        # number, which one compact file at or after it holds (else the newest compact file
        # holds those it reaches, and the first number missing is named below)
        highest = last_log_id
        while highest in by_log:
            highest -= 1
        target = next((c for c in compacts if c >= highest), compacts[-1] if compacts else None)
        if target is not None and target >= first_log_id:
            text = read_text(f"{target}.compact")
            if text is None:
                raise AuditError(f"source log {target}.compact vanished while being read; retry.")
            compacted: dict[int, list[SourceFile]] = {}
            for entry in parse_source_log(text, f"sources log {target}.compact"):
                if first_log_id <= entry.log_id <= last_log_id and entry.log_id not in by_log:
                    compacted.setdefault(entry.log_id, []).append(entry)
            by_log.update(compacted)
    if len(by_log) < wanted:
        missing = _first_missing(sorted(by_log), first_log_id)
        raise CheckpointEntryGone(
            f"the file source's log has no entry for log number {missing}; the checkpoint "
            "was cleaned up or damaged, so that batch cannot be audited."
        )
    return [entry for log_id in sorted(by_log) for entry in by_log[log_id]]


def _first_missing(present: Sequence[int], first: int) -> int:
    """The smallest number from ``first`` on that ``present`` (sorted, each at least ``first``)
    lacks."""
    expected = first
    for log_id in present:
        if log_id != expected:
            return expected
        expected += 1
    return expected


class CheckpointReader:
    """Reads one query's checkpoint; every method re-reads the files (they change under us)."""

    def __init__(self, root: str, fs: FileSystem | None = None) -> None:
        local = local_root(root)
        if fs is None:
            if local is None:
                raise AuditError(
                    f"checkpoint {root!r} is not on a local filesystem; pass the SparkSession "
                    "so it can be read through Hadoop."
                )
            fs = LocalFileSystem()
        self.root = (
            local if local is not None and isinstance(fs, LocalFileSystem) else root.rstrip("/")
        )
        self.fs = fs

    def _join(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def _batch_ids(self, sub: str) -> list[int]:
        ids = []
        for name in self.fs.list_names(self._join(sub)):
            m = _BATCH_FILE.match(name)
            if m:
                ids.append(int(m.group(1)))
        return sorted(ids)

    def committed_batches(self) -> list[int]:
        return self._batch_ids("commits")

    def offset_batches(self) -> list[int]:
        return self._batch_ids("offsets")

    def is_committed(self, batch_id: int) -> bool:
        return self.fs.read_text(self._join("commits", str(batch_id))) is not None

    def commit_mtime_seconds(self, batch_id: int) -> float | None:
        return self.fs.mtime_seconds(self._join("commits", str(batch_id)))

    def watermark_after_ms(self, batch_id: int) -> int | None:
        """The watermark batch ``batch_id`` left for the next one (``nextBatchWatermarkMs`` of
        ``commits/N``); None when the commit is gone, :class:`CheckpointDamaged` when it is not
        what Spark writes."""
        what = f"commits/{batch_id}"
        text = self.fs.read_text(self._join("commits", str(batch_id)))
        if text is None:
            return None
        lines = text.split("\n")
        # every commit log version (v2 adds state ids, v3 source names) keeps the watermark
        if not _VERSION_LINE.match(lines[0].strip()) or len(lines) < 2:
            raise CheckpointDamaged(f"{what} is not what Spark writes; it is damaged.")
        doc = checkpoint_json(lines[1], what)
        if not isinstance(doc, dict):
            raise CheckpointDamaged(f"{what} is not the object Spark writes; it is damaged.")
        return checkpoint_long(doc.get("nextBatchWatermarkMs", 0), f"{what} nextBatchWatermarkMs")

    def offsets(self, batch_id: int) -> OffsetsEntry | None:
        """``offsets/N``; None when the file is gone, :class:`CheckpointDamaged` when it is not
        what Spark writes."""
        text = self.fs.read_text(self._join("offsets", str(batch_id)))
        return None if text is None else parse_offsets(batch_id, text)

    def offsets_before(self, batch_id: int) -> OffsetsEntry:
        """``offsets/N-1``, where batch ``batch_id`` started (its watermark and start offsets);
        :class:`CheckpointEntryGone` naming the batch when that file is gone or damaged."""
        what = f"offsets/{batch_id - 1}, where batch {batch_id} starts,"
        try:
            previous = self.offsets(batch_id - 1)
        except CheckpointDamaged as exc:
            raise type(exc)(f"{what} cannot be read: {exc}") from None
        if previous is None:
            raise CheckpointEntryGone(
                f"{what} is gone from the checkpoint (purged), so the batch's watermark and "
                "input are unknown; raise spark.sql.streaming.minBatchesToRetain or keep the "
                "audit closer to the query."
            )
        return previous

    def late_watermark_ms(self, batch_id: int) -> int | None:
        """The watermark batch ``batch_id``'s late-row filter used; None for batch 0 (no filter).

        Spark plans batch N with the offsets metadata of N-1 (also after a restart), so this is
        exact; a purged or damaged ``offsets/N-1`` makes the batch unauditable.
        """
        if batch_id == 0:
            return None
        return self.offsets_before(batch_id).watermark_ms

    def latest_offsets(self) -> OffsetsEntry | None:
        """The newest readable ``offsets/N`` (the batch the query runs or last ran); None if
        none. A damaged newest file is passed over: it costs its own batch when the audit
        reaches it, never what the checkpoint's other files say."""
        for batch_id in reversed(self.offset_batches()):
            try:
                entry = self.offsets(batch_id)
            except CheckpointDamaged:
                continue
            if entry is not None:
                return entry
        return None

    def batch_files(self, batch_id: int, source_index: int = 0) -> list[SourceFile]:
        """The files batch ``batch_id`` read from source ``source_index`` (empty: no new data)."""
        current = self.offsets(batch_id)
        if current is None:
            raise CheckpointEntryGone(
                f"offsets/{batch_id} is missing from the checkpoint; it cannot be audited."
            )
        end = parse_log_offset(
            source_line(current, source_index), f"offsets/{batch_id} source {source_index}"
        )
        if end is None:
            return []
        start = -1
        if batch_id > 0:
            previous = self.offsets_before(batch_id)
            prev = parse_log_offset(
                source_line(previous, source_index),
                f"offsets/{batch_id - 1} source {source_index}",
            )
            start = -1 if prev is None else prev
        directory = self._join("sources", str(source_index))
        return files_for_log_range(
            lambda: self.fs.list_names(directory),
            lambda name: self.fs.read_text(f"{directory}/{name}"),
            start + 1,
            end,
        )


def min_batches_to_retain(offsets_conf: dict[str, str], session_value: str | None) -> int:
    """How many batches of offsets and commits the query's checkpoint keeps.

    The offset log's ``conf`` wins (it is what the query runs with); otherwise the value of the
    session that runs the query; otherwise Spark's default. Unusable values fall back too.
    """
    for text in (offsets_conf.get(MIN_BATCHES_TO_RETAIN_KEY), session_value):
        if text is None:
            continue
        try:
            value = int(str(text).strip())
        except ValueError:
            continue
        if value > 0:
            return value
    return DEFAULT_MIN_BATCHES_TO_RETAIN


def batches_until_purge(oldest_pending: int, latest_offset_batch: int, retain: int) -> int:
    """Batches the query can still plan before the checkpoint drops what ``oldest_pending`` needs.

    When Spark writes ``offsets/C`` it purges offsets and commits below ``C - retain``; auditing
    batch P needs ``offsets/P-1``, which goes when the query plans batch ``P - 1 + retain + 1``.
    Negative when it is gone already.
    """
    return oldest_pending - 1 + retain - latest_offset_batch


def source_line(entry: OffsetsEntry, source_index: int) -> str | None:
    """Source ``source_index``'s offset line in ``entry`` (None: no offset yet, ``-``);
    :class:`CheckpointDamaged` when the file has no line for it (Spark writes one per source)."""
    if source_index >= len(entry.source_offsets):
        raise CheckpointDamaged(
            f"offsets/{entry.batch_id} has {len(entry.source_offsets)} source line(s), none for "
            f"source {source_index}; the checkpoint is damaged or does not belong to this query."
        )
    return entry.source_offsets[source_index]


def files_of(entries: Sequence[SourceFile]) -> list[str]:
    """Paths to hand to ``spark.read``, in the order Spark took them."""
    return [entry.path for entry in entries]


def logged_offsets(
    checkpoint: CheckpointReader, batch_id: int, index: int, initial: Callable[[], str]
) -> tuple[str, str] | None:
    """The offsets source ``index`` logged around batch ``batch_id``: where the batch started
    (``offsets/N-1``'s line, or ``initial()`` for a source that had none yet) and where it
    ended (``offsets/N``'s); None when the batch read nothing new from it. Sources that log
    their own offsets (Python data sources, JVM streams) are read again from exactly these."""
    end_entry = checkpoint.offsets(batch_id)
    if end_entry is None:
        raise CheckpointEntryGone(
            f"offsets/{batch_id} is missing from the checkpoint; it cannot be audited."
        )
    end = source_line(end_entry, index)
    if end is None:
        return None
    before = checkpoint.offsets_before(batch_id) if batch_id > 0 else None
    start = source_line(before, index) if before is not None else None
    if start is None:  # the source had no offset yet: the batch read from its start
        start = initial()
    if parse_offset_json(start, "start") == parse_offset_json(end, "end"):
        return None  # the batch read nothing new from this source
    return start, end


def parse_offset_json(text: str, what: str) -> Any:
    """A logged offset line as JSON; :class:`CheckpointDamaged` for a damaged line."""
    return checkpoint_json(text, f"the {what} offset line")
