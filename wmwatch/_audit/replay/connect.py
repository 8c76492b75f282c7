"""The audit on Spark Connect: what a Connect client can learn about a query, its sources and
its checkpoint, all through the session.

A Connect client has no JVM: the query's plan is its ``explain(True)`` text (the last batch's
plans, whose leaves stand in the order of the query's sources), the checkpoint's root is named in
its stateful operators' ``state info``, each source's position comes from the progress's source
descriptions, and the events DataFrame's source (format, options, paths) is read off the client's
own plan objects (:func:`streaming_relation`; each kind of source reads its own, in
:mod:`wmwatch._audit.replay.sources`). The checkpoint lives where the server sees it, which the
client may not, so :class:`SessionFileSystem` lists it through a file index (no Spark job) and
reads its small files with one bounded Spark job each, caching what never changes.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from typing import Any

from wmwatch._checkpoint.fs import MAX_FILE_BYTES, CheckpointDamaged, check_size, normalise_path
from wmwatch._core.spark_jobs import bounded_job
from wmwatch._errors import AuditError, ConfigError, UnsupportedSourceError
from wmwatch._plantext import explain_text

_ANALYZED = "== Analyzed Logical Plan =="
_OPTIMIZED = "== Optimized Logical Plan =="
_STATE_CHECKPOINT = re.compile(r"state info \[ checkpoint = (\S+?)/state,")
_COMPLETE_MODE = re.compile(r"StateStoreSave\b[^\n]*\bComplete\b")
# a checkpoint's small files that never change once written (offsets and the sources log)
_IMMUTABLE = re.compile(r"/(offsets|sources/\d+)/\d+(\.compact)?$")
# the cache's bounds: a compacted source log lists every file the stream ever read, so one
# entry can be large; such an entry is read again each time rather than kept
_CACHE_ENTRIES = 256
_CACHE_CHARS = 16 * 2**20
_PROGRESS_WAIT_SECONDS = 60.0


class ConnectQuery:
    """A Connect query's facts the audit needs, from its explain text and progress. They exist
    once the query has planned a batch: until then :meth:`planned` is False."""

    def __init__(self, query: Any) -> None:
        self._query = query
        self.text = ""
        self.plan_text = ""

    def planned(self) -> bool:
        """Whether the query has planned a batch; reads its plans the first time it has."""
        if self.plan_text:
            return True
        text = explain_text(self._query)
        if text is None or _ANALYZED not in text:
            return False
        self.text = text
        self.plan_text = text.split(_ANALYZED, 1)[1].split(_OPTIMIZED, 1)[0]
        return True

    def checkpoint_root(self) -> str:
        """The checkpoint root named in the stateful operators' state info."""
        match = _STATE_CHECKPOINT.search(self.text)
        if match is None:
            raise AuditError(
                "the query's plan names no state checkpoint; pass checkpoint=, the query's "
                "checkpointLocation."
            )
        return match.group(1)

    def complete_mode(self) -> bool:
        return bool(_COMPLETE_MODE.search(self.text))

    def source_descriptions(self) -> list[str]:
        """Each source's progress description, in the order of the checkpoint's sources
        (waiting, bounded, for the query's first progress)."""
        deadline = time.monotonic() + _PROGRESS_WAIT_SECONDS
        progress = self._query.lastProgress
        while progress is None and time.monotonic() < deadline and self._query.isActive:
            time.sleep(0.5)
            progress = self._query.lastProgress
        if progress is None:
            return []
        return [str(s.get("description", "")) for s in progress.get("sources", [])]


def _children(node: Any) -> list[Any]:
    from pyspark.sql.connect.plan import LogicalPlan

    return [v for v in vars(node).values() if isinstance(v, LogicalPlan)]


def _walk(node: Any) -> list[Any]:
    nodes = [node]
    for child in _children(node):
        nodes.extend(_walk(child))
    return nodes


def streaming_relation(events: Any) -> Any:
    """The one streaming ``DataSource`` node of a Connect events DataFrame's plan."""
    from pyspark.sql.connect.plan import DataSource

    if not events.isStreaming:
        raise ConfigError(
            "events must be the streaming DataFrame the query reads (spark.readStream...)."
        )
    relations = [n for n in _walk(events._plan) if isinstance(n, DataSource) and n._is_streaming]
    if len(relations) != 1:
        raise UnsupportedSourceError(
            f"events reads {len(relations)} streaming sources; pass one streaming DataFrame per "
            "source (events=[...]), each reading exactly one."
        )
    return relations[0]


def relation_schema_json(events: Any, relation: Any) -> str:
    """The source's own schema, as the server resolves it."""
    from pyspark.sql.connect.dataframe import DataFrame

    return str(DataFrame(relation, events.sparkSession).schema.json())


class TextCache:
    """The most recently used texts, bounded in entries and in total characters. A text over a
    quarter of the total is not kept, so one large file cannot push every other entry out."""

    def __init__(self, *, max_entries: int, max_chars: int) -> None:
        self._max_entries = max_entries
        self._max_chars = max_chars
        self._texts: OrderedDict[str, str] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> str | None:
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
            return text

    def put(self, key: str, text: str) -> None:
        if len(text) > self._max_chars // 4:
            return
        with self._lock:
            old = self._texts.pop(key, None)
            if old is not None:
                self._chars -= len(old)
            self._texts[key] = text
            self._chars += len(text)
            while len(self._texts) > self._max_entries or self._chars > self._max_chars:
                _, dropped = self._texts.popitem(last=False)
                self._chars -= len(dropped)

    @property
    def chars(self) -> int:
        return self._chars

    def __len__(self) -> int:
        return len(self._texts)


class SessionFileSystem:
    """A checkpoint on the filesystem the Spark Connect server sees, read through the session.

    Listing goes through a file index (an analysis request, no Spark job); each small file is
    read by one Spark job, bounded in time. Offsets and source-log files never change once
    written, so their text is kept (the last few hundred, bounded in size).
    """

    def __init__(self, spark: Any, *, timeout_seconds: float) -> None:
        self._spark = spark
        self._timeout = timeout_seconds
        self._cache = TextCache(max_entries=_CACHE_ENTRIES, max_chars=_CACHE_CHARS)

    def _missing(self, exc: Exception) -> bool:
        text = str(exc)
        return "PATH_NOT_FOUND" in text or "does not exist" in text

    def list_names(self, directory: str) -> list[str]:
        try:
            files = self._spark.read.format("binaryFile").load(directory).inputFiles()
        except Exception as exc:
            if self._missing(exc):
                return []
            raise
        base = normalise_path(directory).rstrip("/")
        names = []
        for f in files:
            parent, _, name = normalise_path(str(f)).rpartition("/")
            if parent == base:
                names.append(name)
        return names

    def read_text(self, path: str) -> str | None:
        """The file's text, as the classic reader gives it: None when it is missing, and
        CheckpointDamaged for anything but a regular file within the read bound."""
        cached = self._cache.get(path)
        if cached is not None:
            return cached
        from pyspark.sql import functions as F

        try:
            files = self._spark.read.format("binaryFile").load(path)
            # binaryFile hands a filter on length to its reader, which then never opens a file
            # past the bound, nor an empty one (a FIFO's length reads 0; opening it blocks)
            length = F.col("length")
            within = (length > 0) & (length <= F.lit(MAX_FILE_BYTES).cast("bigint"))
            with bounded_job(
                self._spark,
                description=f"wmwatch audit: read {path}",
                timeout_seconds=self._timeout,
            ):
                read = files.where(within).select("path", "content").collect()
            listed = None
            if not self._is_the_file(read, path):
                # what is there instead (no content read): an empty or too large file, a folder
                with bounded_job(
                    self._spark,
                    description=f"wmwatch audit: stat {path}",
                    timeout_seconds=self._timeout,
                ):
                    listed = files.select("path", "length").collect()
        except Exception as exc:
            if self._missing(exc):
                return None
            raise
        if listed is None:
            text = bytes(read[0]["content"]).decode("utf-8", errors="replace")
        elif self._is_the_file(listed, path):
            check_size(path, int(listed[0]["length"]))
            text = ""  # its length is 0
        else:
            # a folder (its files listed instead) or a path that matched other files
            raise CheckpointDamaged(f"{path} is not a regular file; the checkpoint is damaged.")
        if _IMMUTABLE.search(path):
            self._cache.put(path, text)
        return text

    @staticmethod
    def _is_the_file(rows: list[Any], path: str) -> bool:
        return len(rows) == 1 and normalise_path(str(rows[0]["path"])) == normalise_path(path)

    def mtime_seconds(self, path: str) -> float | None:
        try:
            with bounded_job(
                self._spark,
                description=f"wmwatch audit: stat {path}",
                timeout_seconds=self._timeout,
            ):
                rows = (
                    self._spark.read.format("binaryFile")
                    .load(path)
                    .select("modificationTime")
                    .collect()
                )
        except Exception as exc:
            if self._missing(exc):
                return None
            raise
        return float(rows[0][0].timestamp()) if rows else None
