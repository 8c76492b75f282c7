"""Where a checkpoint's files are read from, and what wmwatch never reads or writes there: the
filesystems (the driver's own, or any Hadoop filesystem through the JVM), each read bounded in
size and refusing what Spark never writes (links, FIFOs); one spelling of a path or URI, to
tell whether a place lies inside a checkpoint; and the errors that cost a batch (its files
purged, damaged, or in a format this wmwatch does not read).
"""

from __future__ import annotations

import errno
import os
import posixpath
import re
import stat
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from wmwatch._errors import AuditError


class CheckpointEntryGone(AuditError):
    """A batch's offsets or source-log entries were purged: that batch can never be audited."""


class CheckpointDamaged(CheckpointEntryGone):
    """A batch's checkpoint file is not what Spark writes (empty, binary, another shape, nested
    past any real offset, numbers out of range, not a regular file, past the read bound): like a
    purged one, that batch can never be audited; it is counted lost with the reason and the
    batches after it go on."""


class CheckpointFormatUnknown(CheckpointDamaged):
    """A batch's checkpoint file is in a log version this wmwatch does not read (``v2`` offsets
    of a query run with source evolution, or a later Spark's): that batch is counted lost with
    the reason, as a damaged one is."""


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
