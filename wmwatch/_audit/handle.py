"""What the caller of an audit holds: :class:`AuditHandle` (``Watch.audit``) and
:class:`SidecarHandle` (``Watch.audit_checkpoint``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wmwatch._audit.auditor import Auditor
    from wmwatch._audit.replay.predicates import OperatorSpec


class AuditHandle:
    """A running audit: ``status()``, ``sync()`` and ``stop()``; a context manager that stops
    the audit on exit."""

    def __init__(self, auditor: Auditor) -> None:
        self._auditor = auditor

    @property
    def query_id(self) -> str:
        """The id of the audited query."""
        return self._auditor.query_id

    @property
    def spec(self) -> OperatorSpec | None:
        """The rule of the first audited input; None on Spark Connect until the query has
        planned a batch."""
        return self._auditor.spec

    def status(self) -> dict[str, Any]:
        """Batches audited, last audited batch, late rows, lag, errors (a fresh dict)."""
        return self._auditor.status()

    def sync(self, timeout: float = 60.0) -> bool:
        """Wait until every batch committed so far is audited and written; True if it was."""
        return self._auditor.sync(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        """Stop auditing (what is committed to the store stays; a later audit resumes)."""
        self._auditor.stop(timeout)

    def __enter__(self) -> AuditHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SidecarHandle(AuditHandle):
    """A running sidecar audit: ``status()``, ``sync()``, ``stop()`` as for the in-job audit,
    and ``finish()``, which ends it once every batch committed so far is audited."""

    def finish(self) -> None:
        """Audit what is committed (and what commits meanwhile), then end on its own."""
        self._auditor.finish()

    @property
    def running(self) -> bool:
        """Whether the audit still runs (False once it finished or was stopped)."""
        return bool(self._auditor.status()["running"])
