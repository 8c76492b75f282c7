"""What an audit saw of its sources' identities that the checkpoint does not record (a Kafka
topic's id): per source and name, the identity and the first batch planned after it was seen,
kept in memory or in the history (:meth:`wmwatch._audit.sinks.AuditHistory.identity_book`), so a
source replaced under the same name is told apart from the one its batches read.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class SeenIdentity:
    """What the audit saw of a source that the checkpoint does not identify (a Kafka topic):
    its identity (the broker's topic id) and the first batch planned after it was seen.

    Batches from ``since_batch`` on read this identity, as far as the audit can show (the id
    was the same before they were planned and after they were read); earlier ones were planned
    before the audit looked. ``replaced``: the audit saw another identity under the same name
    first, so those earlier batches may have read either.
    """

    identity: str
    since_batch: int
    replaced: bool = False


class IdentityBook(Protocol):
    """Where an audit keeps what it saw of its sources' identities, per source and name (the
    history's ``audit_source_identities``, or memory for an audit without one)."""

    def seen(self, source_index: int, name: str) -> SeenIdentity | None: ...

    def record(self, source_index: int, name: str, seen: SeenIdentity) -> None: ...


class MemoryIdentityBook:
    """An :class:`IdentityBook` held in memory (seeded from a history when there is one); one
    entry per source name, so it is as small as the set of topics the query reads."""

    def __init__(self, seeded: Mapping[tuple[int, str], SeenIdentity] | None = None) -> None:
        self._lock = threading.Lock()
        self._seen = dict(seeded or {})

    def seen(self, source_index: int, name: str) -> SeenIdentity | None:
        with self._lock:
            return self._seen.get((source_index, name))

    def record(self, source_index: int, name: str, seen: SeenIdentity) -> None:
        with self._lock:
            self._seen[(source_index, name)] = seen
