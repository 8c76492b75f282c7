"""The contract between the watch's worker thread and the features that ride on it.

A plugin is told about every event after the core state and history have been updated. All
``on_*`` methods run on the single worker thread, one event at a time: they must return within a
few milliseconds (hand anything slower to a thread of their own) and must not raise (the worker
counts and logs what they raise, and goes on). ``collect`` runs on the HTTP server's thread at
scrape time and must only read.

A plugin that needs the watch it rides on is given a :class:`WatchContext`: the few things it may
use, typed, so that a plugin never reaches into ``Watch`` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias, TypeVar

from prometheus_client.core import Metric

from wmwatch._events import QueryIdle, QueryStarted, QueryTerminated
from wmwatch._progress import ProgressSnapshot

if TYPE_CHECKING:  # duckdb loads only with a history store: ``wmwatch --help`` stays instant
    import duckdb

    from wmwatch._store.writer import StoreHealth


class WatchPlugin:
    """Base class with no-op hooks; override what you need."""

    name = "plugin"

    def on_query_started(self, event: QueryStarted) -> None:
        """A query run started (also sent for queries already running at attach)."""

    def on_progress(self, snapshot: ProgressSnapshot) -> None:
        """A batch (or a no-data batch) completed."""

    def on_query_idle(self, event: QueryIdle) -> None:
        """The query had nothing to do for a while."""

    def on_query_terminated(self, event: QueryTerminated) -> None:
        """A query run stopped, with or without an exception."""

    def collect(self) -> Iterable[Metric]:
        """Metric families for the scrape; called from the HTTP thread."""
        return ()

    def close(self) -> None:
        """Flush and stop; called once from ``Watch.close``."""


T = TypeVar("T")
Write: TypeAlias = Callable[["duckdb.DuckDBPyConnection"], None]


class HistoryAccess(Protocol):
    """What a plugin may do with the history database: queue a write, read on the writer's
    connection, or wait until what it queued is in the file (``flush``: True once it is, False
    when ``timeout`` passes first, with the reason in ``health.last_error``). All of it runs on
    the store's one writer thread, so a plugin never opens the file. A write that carries much
    data (rows) says about how many bytes in ``payload_bytes``: pending writes are bounded in
    bytes as well as in count while the file is unavailable."""

    def submit(self, write: Write, *, description: str, payload_bytes: int = 0) -> None: ...

    def read(self, fn: Callable[[duckdb.DuckDBPyConnection], T], timeout: float = 10.0) -> T: ...

    def flush(self, timeout: float = 10.0) -> bool: ...

    @property
    def health(self) -> StoreHealth: ...


class WatchContext(Protocol):
    """What a plugin may use of the watch it rides on."""

    @property
    def spark(self) -> Any:
        """The watched ``SparkSession`` (classic or Connect)."""

    @property
    def store(self) -> HistoryAccess | None:
        """The history database, or None when the watch keeps no history."""

    def get_query(self, query_id: str) -> Any:
        """The running ``StreamingQuery`` with this id, or None."""

    def plugins(self) -> list[WatchPlugin]: ...

    def add_plugin(self, plugin: WatchPlugin) -> None: ...
