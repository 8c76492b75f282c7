"""Lifecycle events (started, idle, terminated) as typed, immutable records.

Progress events become :class:`wmwatch._progress.ProgressSnapshot`; the other three kinds are
parsed here from the JSON Spark gives them (``event.json()`` on the JVM side) or from a mapping.
Like a snapshot, an event holds only clean text (redacted, bounded, valid UTF-8).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from wmwatch._errors import ProgressParseError
from wmwatch._progress import clean_name
from wmwatch._text import clean, valid_utf8
from wmwatch._time import parse_timestamp

# An exception with its stack trace, as Spark reports it; the report prints its first line.
_MAX_EXCEPTION_CHARS = 20_000


@dataclass(frozen=True, slots=True)
class QueryStarted:
    query_id: str
    run_id: str
    name: str | None
    started_at: datetime | None

    @property
    def label(self) -> str:
        return self.name or self.query_id


@dataclass(frozen=True, slots=True)
class QueryIdle:
    query_id: str
    run_id: str
    idle_at: datetime | None


@dataclass(frozen=True, slots=True)
class QueryTerminated:
    query_id: str
    run_id: str
    exception: str | None
    error_class: str | None
    terminated_at: datetime | None

    @property
    def failed(self) -> bool:
        return self.exception is not None


def _load(raw: str | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(raw, Mapping):
        return raw
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        raise ProgressParseError("event is not valid JSON") from None
    if not isinstance(doc, Mapping):
        raise ProgressParseError("event is not a JSON object")
    return doc


def _ids(doc: Mapping[str, Any]) -> tuple[str, str]:
    query_id, run_id = doc.get("id"), doc.get("runId")
    if not isinstance(query_id, str) or not isinstance(run_id, str) or not query_id or not run_id:
        raise ProgressParseError("event lacks id or runId")
    return valid_utf8(query_id), valid_utf8(run_id)


def parse_started(raw: str | Mapping[str, Any]) -> QueryStarted:
    doc = _load(raw)
    query_id, run_id = _ids(doc)
    name = doc.get("name")
    return QueryStarted(
        query_id=query_id,
        run_id=run_id,
        name=clean_name(name) if isinstance(name, str) else None,
        started_at=parse_timestamp(doc.get("timestamp")),
    )


def parse_idle(raw: str | Mapping[str, Any]) -> QueryIdle:
    doc = _load(raw)
    query_id, run_id = _ids(doc)
    return QueryIdle(
        query_id=query_id, run_id=run_id, idle_at=parse_timestamp(doc.get("timestamp"))
    )


def parse_terminated(raw: str | Mapping[str, Any]) -> QueryTerminated:
    doc = _load(raw)
    query_id, run_id = _ids(doc)
    exception = doc.get("exception")
    error_class = doc.get("errorClassOnException")
    return QueryTerminated(
        query_id=query_id,
        run_id=run_id,
        exception=(
            clean(exception, _MAX_EXCEPTION_CHARS)
            if isinstance(exception, str) and exception
            else None
        ),
        error_class=clean_name(error_class) if isinstance(error_class, str) else None,
        terminated_at=parse_timestamp(doc.get("timestamp")),
    )
