"""Reading a streaming query's checkpoint: offsets, commits and the file source's log.

The audit replays committed batches, so it needs three facts per batch N that only the
checkpoint records exactly: that N committed (``commits/N``), the watermark the late-row filter
of N used (``batchWatermarkMs`` of ``offsets/N-1``), and which files N read. The last one is
indirect: a file source numbers its own log (``sources/<i>/<K>``) and ``offsets/N`` holds that
source's ``{"logOffset": K}``; no-data batches repeat the previous K, so batch N read the log
entries ``(K(N-1), K(N)]``. Every tenth source-log entry is compacted into ``<K>.compact``, which
holds all entries up to K, each tagged with its own ``batchId`` (the log number).

Parsing is pure (text in, values out); :class:`CheckpointReader` adds file access through a small
filesystem interface, local by default, Hadoop's through the JVM for other schemes.
"""

from __future__ import annotations

import errno
import json
import os
import posixpath
import re
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from wmwatch._errors import AuditError

_LOG_VERSION = "v1"
# Spark keeps this many batches of offsets and commits (older ones are purged); its default.
MIN_BATCHES_TO_RETAIN_KEY = "spark.sql.streaming.minBatchesToRetain"
DEFAULT_MIN_BATCHES_TO_RETAIN = 100
_BATCH_FILE = re.compile(r"^(\d+)$")
_COMPACT_FILE = re.compile(r"^(\d+)\.compact$")


class CheckpointEntryGone(AuditError):
    """A batch's offsets or source-log entries were purged: that batch can never be audited."""


class CheckpointDamaged(CheckpointEntryGone):
    """A batch's checkpoint file is not what Spark writes (another shape, not a regular file,
    past the read bound): like a purged one, that batch can never be audited; it is counted lost
    with the reason and the batches after it go on."""


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


def _log_lines(text: str, what: str) -> list[str]:
    lines = text.split("\n")
    if not lines or lines[0].strip() != _LOG_VERSION:
        raise AuditError(
            f"{what} starts with {describe_text(lines[0])}, not {_LOG_VERSION!r}: this checkpoint "
            "was written by a Spark version the audit does not know; audit with a matching wmwatch."
        )
    return lines[1:]


_VERSION_LINE = re.compile(r"v\d{1,4}")


def describe_text(text: str) -> str:
    """What a line of a checkpoint file is, for an error, without quoting it (a log version,
    which says which Spark wrote it, excepted): a checkpoint file may be a link to any file,
    and its first bytes must not reach a log or a terminal."""
    line = text.strip()
    if not line or _VERSION_LINE.fullmatch(line):
        return repr(line)
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        return f"{len(line.encode('utf-8', 'replace')):,} bytes of text that is not JSON"
    if isinstance(doc, dict):
        return "a JSON object"
    return "a JSON array" if isinstance(doc, list) else "a JSON value"


def parse_offsets(batch_id: int, text: str) -> OffsetsEntry:
    """Parse ``offsets/N``: a version line, a metadata JSON line, one line per source."""
    lines = _log_lines(text, f"offsets/{batch_id}")
    if not lines or not lines[0].strip():
        raise CheckpointDamaged(
            f"offsets/{batch_id} has no metadata line; the checkpoint is damaged."
        )
    try:
        meta = json.loads(lines[0])
    except ValueError as exc:
        raise CheckpointDamaged(
            f"offsets/{batch_id} metadata is not JSON ({exc}); the checkpoint is damaged."
        ) from exc
    body = lines[1:]
    while body and not body[-1].strip():
        body.pop()
    # A source without an offset yet is written as "-".
    sources = tuple(None if line.strip() in ("", "-") else line.strip() for line in body)
    try:
        return OffsetsEntry(
            batch_id=batch_id,
            watermark_ms=int(meta.get("batchWatermarkMs", 0) or 0),
            timestamp_ms=int(meta["batchTimestampMs"]) if "batchTimestampMs" in meta else None,
            conf={str(k): str(v) for k, v in (meta.get("conf") or {}).items()},
            source_offsets=sources,
        )
    except (AttributeError, TypeError, ValueError, OverflowError) as exc:
        # valid JSON of another shape (a list, a string watermark, conf not an object)
        raise CheckpointDamaged(
            f"offsets/{batch_id} metadata is not what Spark writes ({type(exc).__name__}); the "
            "checkpoint is damaged."
        ) from exc


def parse_log_offset(offset_json: str | None) -> int | None:
    """The ``logOffset`` of a file source's offset line; None for "no offset yet".

    Raises AuditError for offsets of other sources (Kafka, rate, ...), which cannot be replayed.
    """
    if offset_json is None:
        return None
    try:
        doc = json.loads(offset_json)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and "logOffset" in doc:
        return int(doc["logOffset"])
    if isinstance(doc, int):  # very old file sources wrote a bare number
        return doc
    raise AuditError(
        f"source offset {describe_text(offset_json)} is not a file source's logOffset; only file "
        "sources (json, csv, parquet, orc, text) can be audited."
    )


def parse_source_log(text: str, what: str = "source log") -> list[SourceFile]:
    """Parse one source-log file (plain or ``.compact``)."""
    files: list[SourceFile] = []
    for line in _log_lines(text, what):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            files.append(
                SourceFile(
                    path=str(doc["path"]),
                    timestamp_ms=(
                        int(doc["timestamp"]) if doc.get("timestamp") is not None else None
                    ),
                    log_id=int(doc["batchId"]),
                )
            )
        except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as exc:
            raise CheckpointDamaged(
                f"{what} has a line that is not a file entry ({type(exc).__name__}); the "
                "checkpoint is damaged."
            ) from exc
    return files


def normalise_path(path: str) -> str:
    """One spelling for a file's URI, so ``file:///a`` (source log) equals ``file:/a`` (_metadata).

    Local files become plain absolute paths; other URIs keep their scheme and authority.
    """
    text = unquote(path)
    if text.startswith("file:"):
        rest = text[len("file:") :]
        if rest.startswith("//"):
            # file://host/path is not local to us; file:///path has an empty authority.
            rest = rest[2:]
            if not rest.startswith("/"):
                return "file://" + rest
        return "/" + rest.lstrip("/")
    return text


def files_for_log_range(
    list_names: Callable[[], Iterable[str]],
    read_text: Callable[[str], str | None],
    first_log_id: int,
    last_log_id: int,
) -> list[SourceFile]:
    """Entries with ``first_log_id <= log_id <= last_log_id`` from a source-log directory.

    A log number is read from its own file when it still exists, otherwise from the first
    ``.compact`` file at or after it (compaction keeps every earlier entry).
    """
    if last_log_id < first_log_id:
        return []
    names = list(list_names())
    plain = {int(m.group(1)) for n in names if (m := _BATCH_FILE.match(n))}
    compacts = sorted(int(m.group(1)) for n in names if (m := _COMPACT_FILE.match(n)))
    result: list[SourceFile] = []
    compact_cache: dict[int, list[SourceFile]] = {}
    for log_id in range(first_log_id, last_log_id + 1):
        if log_id in plain:
            text = read_text(str(log_id))
            if text is not None:
                result.extend(f for f in parse_source_log(text, f"sources log {log_id}"))
                continue
        target = next((c for c in compacts if c >= log_id), None)
        if target is None:
            raise CheckpointEntryGone(
                f"the file source's log has no entry for log number {log_id}; the checkpoint "
                "was cleaned up or damaged, so that batch cannot be audited."
            )
        if target not in compact_cache:
            text = read_text(f"{target}.compact")
            if text is None:
                raise AuditError(f"source log {target}.compact vanished while being read; retry.")
            compact_cache[target] = parse_source_log(text, f"sources log {target}.compact")
        result.extend(f for f in compact_cache[target] if f.log_id == log_id)
    return result


class FileSystem(Protocol):
    def list_names(self, directory: str) -> list[str]: ...

    def read_text(self, path: str) -> str | None: ...

    def mtime_seconds(self, path: str) -> float | None: ...


# The largest checkpoint file read. Offsets and commits are a few kB; a file source's compacted
# log lists every file the stream ever took in (about 150 bytes each), so this bounds what a
# read holds in memory at about 1.5 million files.
MAX_FILE_BYTES = 256 * 1024 * 1024


def check_size(path: str, size: int) -> None:
    """CheckpointDamaged when a checkpoint file of ``size`` bytes is past the read bound."""
    if size > MAX_FILE_BYTES:
        raise CheckpointDamaged(
            f"{path} is {size:,} bytes, more than the {MAX_FILE_BYTES:,} wmwatch reads of one "
            "checkpoint file: the checkpoint is damaged, or its file source's log has grown past "
            "what the audit reads (the batch is not audited)."
        )


class LocalFileSystem:
    """The driver's own filesystem (local disks, NFS and other mounts)."""

    def list_names(self, directory: str) -> list[str]:
        try:
            return os.listdir(directory)
        except FileNotFoundError:
            return []

    def read_text(self, path: str) -> str | None:
        try:
            # non-blocking: a FIFO planted in a checkpoint must not hang the reader; no links:
            # Spark writes none, and one planted there would have its target read and quoted
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            raise CheckpointDamaged(
                f"{path} is not a regular file; the checkpoint is damaged (a symbolic link, "
                "which Spark never writes there)."
            ) from None
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise CheckpointDamaged(f"{path} is not a regular file; the checkpoint is damaged.")
            check_size(path, info.st_size)
            data = handle.read(MAX_FILE_BYTES + 1)
        check_size(path, len(data))
        return data.decode("utf-8", errors="replace")

    def mtime_seconds(self, path: str) -> float | None:
        try:
            return os.path.getmtime(path)
        except FileNotFoundError:
            return None


class HadoopFileSystem:
    """Any Hadoop filesystem (hdfs, s3a, abfss, gs) reached through the driver's JVM."""

    def __init__(self, spark: Any, root: str) -> None:
        jvm = spark.sparkContext._jvm
        self._jvm = jvm
        conf = spark.sparkContext._jsc.hadoopConfiguration()
        self._fs = jvm.org.apache.hadoop.fs.Path(root).getFileSystem(conf)

    def _path(self, path: str) -> Any:
        return self._jvm.org.apache.hadoop.fs.Path(path)

    def list_names(self, directory: str) -> list[str]:
        path = self._path(directory)
        if not self._fs.exists(path):
            return []
        return [status.getPath().getName() for status in self._fs.listStatus(path)]

    def read_text(self, path: str) -> str | None:
        p = self._path(path)
        if not self._fs.exists(p):
            return None
        status = self._fs.getFileStatus(p)
        if not status.isFile():
            raise CheckpointDamaged(f"{path} is not a file; the checkpoint is damaged.")
        check_size(path, int(status.getLen()))
        stream = self._fs.open(p)
        try:
            return str(self._jvm.org.apache.commons.io.IOUtils.toString(stream, "UTF-8"))
        finally:
            stream.close()

    def mtime_seconds(self, path: str) -> float | None:
        p = self._path(path)
        if not self._fs.exists(p):
            return None
        return float(self._fs.getFileStatus(p).getModificationTime()) / 1000.0


def local_root(root: str) -> str | None:
    """The local directory of a checkpoint root, or None when it lives elsewhere."""
    if root.startswith("file:"):
        path = normalise_path(root)
        return path if path.startswith("/") else None
    if re.match(r"^[a-zA-Z][\w+.-]+:", root):
        return None
    return os.path.abspath(root)


def qualified(location: str | os.PathLike[str]) -> tuple[str, str, str, str]:
    """``(scheme, user, host, path)``: one spelling of a file or folder, however it is given.

    A local path or ``file:`` URI is resolved as the filesystem sees it (``..``, links, trailing
    and doubled slashes): ``("file", "", "", "/real/path")``. Any other URI keeps its scheme, its
    user (an Azure container) and host in lower case, its port and any password left out, and
    its normalised path.
    """
    text = os.fspath(location)
    local = local_root(text)
    if local is not None:
        return "file", "", "", os.path.realpath(local)
    try:
        parts = urlsplit(text)
        user, host = (parts.username or "").lower(), (parts.hostname or "").lower()
    except ValueError:  # an unbalanced "[" in the authority: nothing to compare but the text
        return "", "", "", text
    path = posixpath.normpath("/" + unquote(parts.path).lstrip("/"))
    return parts.scheme.lower(), user, host, "/" + path.lstrip("/")


def inside_checkpoint(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """True when ``path`` is the checkpoint ``root`` or lies in it, both spelled as
    :func:`qualified` spells them: a place wmwatch must never write to. A URI without a host
    (``hdfs:///a``: the default filesystem's) or without a user may be any one's, so it counts
    as the same: when in doubt, the place is refused."""
    scheme, user, host, place = qualified(path)
    root_scheme, root_user, root_host, base = qualified(root)
    if scheme != root_scheme:
        return False
    for mine, theirs in ((user, root_user), (host, root_host)):
        if mine and theirs and mine != theirs:
            return False
    return place == base or place.startswith(base.rstrip("/") + "/")


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

    def offsets(self, batch_id: int) -> OffsetsEntry | None:
        text = self.fs.read_text(self._join("offsets", str(batch_id)))
        return None if text is None else parse_offsets(batch_id, text)

    def late_watermark_ms(self, batch_id: int) -> int | None:
        """The watermark batch ``batch_id``'s late-row filter used; None for batch 0 (no filter).

        Spark plans batch N with the offsets metadata of N-1 (also after a restart), so this is
        exact; a purged ``offsets/N-1`` makes the batch unauditable.
        """
        if batch_id == 0:
            return None
        previous = self.offsets(batch_id - 1)
        if previous is None:
            raise CheckpointEntryGone(
                f"offsets/{batch_id - 1} is gone from the checkpoint, so the watermark batch "
                f"{batch_id} used is unknown; raise spark.sql.streaming.minBatchesToRetain or "
                "keep the audit closer to the query."
            )
        return previous.watermark_ms

    def latest_offsets(self) -> OffsetsEntry | None:
        """The newest ``offsets/N`` (the batch the query runs or last ran); None if none."""
        for batch_id in reversed(self.offset_batches()):
            entry = self.offsets(batch_id)
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
        end = parse_log_offset(_source_offset(current, source_index))
        if end is None:
            return []
        start = -1
        if batch_id > 0:
            previous = self.offsets(batch_id - 1)
            if previous is None:
                raise CheckpointEntryGone(
                    f"offsets/{batch_id - 1} is gone from the checkpoint, so the files of batch "
                    f"{batch_id} are unknown; raise spark.sql.streaming.minBatchesToRetain."
                )
            prev = parse_log_offset(_source_offset(previous, source_index))
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


def _source_offset(entry: OffsetsEntry, source_index: int) -> str | None:
    if source_index >= len(entry.source_offsets):
        return None
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
    if end_entry is None or index >= len(end_entry.source_offsets):
        raise AuditError(
            f"offsets/{batch_id} has no line for source {index}; the checkpoint does not "
            "belong to this query."
        )
    end = end_entry.source_offsets[index]
    if end is None:
        return None
    before = checkpoint.offsets(batch_id - 1) if batch_id > 0 else None
    if batch_id > 0 and before is None:
        raise CheckpointEntryGone(
            f"offsets/{batch_id - 1} is gone (spark.sql.streaming.minBatchesToRetain), so "
            f"where batch {batch_id} started reading is unknown"
        )
    start = before.source_offsets[index] if before is not None else None
    if start is None:  # the source had no offset yet: the batch read from its start
        start = initial()
    if parse_offset_json(start, "start") == parse_offset_json(end, "end"):
        return None  # the batch read nothing new from this source
    return start, end


def parse_offset_json(text: str, what: str) -> Any:
    """A logged offset line as JSON; a one-line error for a damaged line."""
    try:
        return json.loads(text)
    except ValueError as exc:
        raise AuditError(
            f"the {what} offset ({describe_text(text)}) in the checkpoint is not JSON; the "
            "checkpoint is damaged or not this source's."
        ) from exc
