"""One watch per SparkSession: which session ``attach`` was given, and the watch it already has.

Running ``attach`` again on a session (a notebook cell run twice) must not add a second listener
that doubles every event, nor fight the first watch for its port and history file. The registry
maps a session to its live watch; ``attach`` returns that watch, and ``Watch.close`` frees the
session for a new one.

A session is known by what identifies it on its own side: for classic PySpark the JVM
``SparkSession`` object (its identity hash, checked with ``equals`` on a hit, plus the
application id), so a second Python wrapper of the same JVM session is the same session and
``spark.newSession()`` is another; for Spark Connect the server's ``session_id``; for a stand-in
object without either, the object itself.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Generic, TypeVar

W = TypeVar("W")


def is_connect(obj: Any) -> bool:
    """Whether a session or DataFrame is Spark Connect's (a client without a JVM)."""
    return type(obj).__module__.startswith("pyspark.sql.connect")


def session_key(spark: Any) -> Hashable:
    """What identifies ``spark`` while it lives (see the module docstring)."""
    jsession = getattr(spark, "_jsparkSession", None)
    if jsession is not None:
        try:
            identity = int(spark._jvm.java.lang.System.identityHashCode(jsession))
            return ("classic", str(spark.sparkContext.applicationId), identity)
        except Exception:  # noqa: BLE001 - a stopped or unusual session: fall back to the object
            return ("object", id(spark))
    session_id = getattr(spark, "session_id", None)
    if isinstance(session_id, str) and session_id:
        return ("connect", session_id)
    return ("object", id(spark))


def same_session(a: Any, b: Any) -> bool:
    """Whether two session objects with one key are the same session (guards hash collisions)."""
    if a is b:
        return True
    ja, jb = getattr(a, "_jsparkSession", None), getattr(b, "_jsparkSession", None)
    if ja is None or jb is None:
        return True  # Connect ids and object ids are unique on their own
    try:
        return bool(ja.equals(jb))
    except Exception:  # noqa: BLE001
        return False


class SessionRegistry(Generic[W]):
    """Live watches by session.

    ``attach`` calls :meth:`get_or_create`; ``Watch.close`` calls :meth:`discard`.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        # Serialises creation, so two threads attaching to one session make one watch; held
        # while a watch starts (a second or two), never by close.
        self._creating = threading.Lock()
        self._live: dict[Hashable, tuple[W, Any, Mapping[str, Any]]] = {}

    def get_or_create(
        self, spark: Any, options: Mapping[str, Any], create: Callable[[], W]
    ) -> tuple[W, Mapping[str, Any] | None]:
        """The session's live watch and the options it was made with, or a new watch and None."""
        key = session_key(spark)
        with self._creating:
            with self._guard:
                entry = self._live.get(key)
            if entry is not None and same_session(entry[1], spark):
                return entry[0], entry[2]
            watch = create()
            with self._guard:
                self._live[key] = (watch, spark, dict(options))
            return watch, None

    def discard(self, watch: W) -> None:
        with self._guard:
            for key in [k for k, entry in self._live.items() if entry[0] is watch]:
                del self._live[key]


def differing_options(live: Mapping[str, Any], requested: Mapping[str, Any]) -> list[str]:
    """Names of the options whose requested value differs from the live watch's, in order."""
    return [name for name, value in requested.items() if live.get(name) != value]
