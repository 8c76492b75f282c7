"""Findings: problems wmwatch has diagnosed, one row each, opened once and then updated.

A finding is identified by query, kind, operator and side (:func:`finding_id`), so seeing the
same problem in every batch updates one record (last seen, occurrences, fresh evidence) instead of
adding rows. The first time a finding opens it is logged once at WARNING; it is written to the
``findings`` table when it opens, when it resolves and at most every ``update_interval_seconds``
in between, through the ``writer`` it is given (the plugin's, which queues
:func:`wmwatch._inspect.tables.write_finding` on the history store).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from wmwatch._text import get_logger

log = get_logger("wmwatch.findings")

JOIN_STATE_UNBOUNDED = "join_state_unbounded"
WATERMARK_STALLED = "watermark_stalled"
WATERMARK_JUMP = "watermark_jump"
WATERMARK_HELD_BACK = "watermark_held_back"

ACTIVE = "active"
RESOLVED = "resolved"


def finding_id(query_id: str, kind: str, operator_id: int | None, side: str | None) -> str:
    """Stable across batches, runs and processes: the same problem always gets the same id."""
    key = f"{query_id}|{kind}|{'' if operator_id is None else operator_id}|{side or ''}"
    return f"{kind}-{hashlib.sha1(key.encode()).hexdigest()[:16]}"


@dataclass(frozen=True, slots=True)
class Finding:
    finding_id: str
    query_id: str
    query_name: str | None
    kind: str
    operator_id: int | None
    side: str | None
    severity: str
    status: str
    message: str
    evidence: Mapping[str, Any]
    fix: str | None
    first_seen_at: datetime
    last_seen_at: datetime
    first_batch_id: int | None
    last_batch_id: int | None
    occurrences: int = 1
    resolved_at: datetime | None = None

    @property
    def active(self) -> bool:
        return self.status == ACTIVE

    def as_row(self) -> dict[str, Any]:
        """Rendering-ready fields (ISO timestamps, evidence as a dict)."""
        return {
            "finding_id": self.finding_id,
            "query_id": self.query_id,
            "query_name": self.query_name,
            "kind": self.kind,
            "operator_id": self.operator_id,
            "side": self.side,
            "severity": self.severity,
            "status": self.status,
            "message": self.message,
            "evidence": dict(self.evidence),
            "fix": self.fix,
            "first_seen_at": self.first_seen_at.isoformat(),
            "last_seen_at": self.last_seen_at.isoformat(),
            "first_batch_id": self.first_batch_id,
            "last_batch_id": self.last_batch_id,
            "occurrences": self.occurrences,
        }


Writer = Callable[["Finding"], None]


@dataclass
class FindingsBook:
    """The open and resolved findings of this process, and their writes to the history.

    ``writer(finding)`` records one finding in the history; None keeps findings in memory only.
    Thread-safe: the worker thread and the plan inspector both report here.
    """

    writer: Writer | None = None
    update_interval_seconds: float = 30.0
    clock: Callable[[], float] = time.monotonic
    _findings: dict[str, Finding] = field(default_factory=dict)
    _written_at: dict[str, float] = field(default_factory=dict)
    _warned: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(
        self,
        *,
        query_id: str,
        query_name: str | None,
        kind: str,
        operator_id: int | None = None,
        side: str | None = None,
        severity: str = "warning",
        message: str,
        evidence: Mapping[str, Any],
        fix: str | None,
        at: datetime,
        batch_id: int | None,
    ) -> tuple[Finding, bool]:
        """Open the finding or update it; returns it and whether it was (re)opened now."""
        fid = finding_id(query_id, kind, operator_id, side)
        with self._lock:
            old = self._findings.get(fid)
            opened = old is None or not old.active
            if old is None:
                finding = Finding(
                    fid, query_id, query_name, kind, operator_id, side, severity, ACTIVE,
                    message, dict(evidence), fix, at, at, batch_id, batch_id,
                )  # fmt: skip
            else:
                finding = replace(
                    old,
                    query_name=query_name or old.query_name,
                    severity=_worse(old.severity, severity) if old.active else severity,
                    status=ACTIVE,
                    message=message,
                    evidence=dict(evidence),
                    fix=fix,
                    last_seen_at=at,
                    last_batch_id=batch_id if batch_id is not None else old.last_batch_id,
                    occurrences=old.occurrences + 1,
                    resolved_at=None,
                )
            self._findings[fid] = finding
            first_time = fid not in self._warned
            self._warned.add(fid)
            due = opened or (old is not None and old.severity != finding.severity) or self._due(fid)
        if first_time:
            log.warning(
                "wmwatch: %s in query %s: %s%s",
                kind,
                query_name or query_id,
                message,
                f" Fix: {fix}" if fix else "",
            )
        if due:
            self._write(finding)
        return finding, opened

    def resolve(
        self, fid: str, *, at: datetime, batch_id: int | None, reason: str
    ) -> Finding | None:
        """Mark an active finding resolved (kept in the table with its history)."""
        with self._lock:
            old = self._findings.get(fid)
            if old is None or not old.active:
                return None
            evidence = dict(old.evidence)
            evidence["resolved_because"] = reason
            finding = replace(
                old,
                status=RESOLVED,
                evidence=evidence,
                last_seen_at=max(at, old.last_seen_at),
                last_batch_id=batch_id if batch_id is not None else old.last_batch_id,
                resolved_at=at,
            )
            self._findings[fid] = finding
        who = old.query_name or old.query_id
        log.info("wmwatch: resolved %s in query %s: %s", old.kind, who, reason)
        self._write(finding)
        return finding

    def get(self, fid: str) -> Finding | None:
        with self._lock:
            return self._findings.get(fid)

    def all(self, *, query_id: str | None = None, active_only: bool = False) -> list[Finding]:
        with self._lock:
            found = [
                f
                for f in self._findings.values()
                if (query_id is None or f.query_id == query_id) and (f.active or not active_only)
            ]
        return sorted(found, key=lambda f: (f.query_id, f.kind, f.operator_id or -1, f.side or ""))

    def forget(self, query_id: str) -> None:
        """Write the latest state of a query's findings, then drop them from memory (a query
        that stopped long enough ago: its findings stay in the history only)."""
        for finding in self.all(query_id=query_id):
            self._write(finding)
        with self._lock:
            for fid in [fid for fid, f in self._findings.items() if f.query_id == query_id]:
                del self._findings[fid]
                self._written_at.pop(fid, None)
                self._warned.discard(fid)

    def flush(self) -> None:
        """Write every finding's latest state (at close, so throttled updates are not lost)."""
        for finding in self.all():
            self._write(finding)

    def _due(self, fid: str) -> bool:
        last = self._written_at.get(fid)
        return last is None or self.clock() - last >= self.update_interval_seconds

    def _write(self, finding: Finding) -> None:
        self._written_at[finding.finding_id] = self.clock()
        if self.writer is None:
            return
        self.writer(finding)


_SEVERITY_ORDER = {"info": 0, "warning": 1, "critical": 2}


def _worse(a: str, b: str) -> str:
    return a if _SEVERITY_ORDER.get(a, 1) >= _SEVERITY_ORDER.get(b, 1) else b
