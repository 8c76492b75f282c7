"""What an audit reports about itself: its counters, kept by the auditor under its lock, and the
``status()`` dict built from them (what the audit plugin's metrics read)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from wmwatch._audit.handled import BatchRange, range_count
from wmwatch._audit.replay.engine import ReplayInput
from wmwatch._audit.replay.sources.base import UnreplayableSource
from wmwatch._audit.sinks import BatchLateRows
from wmwatch._text import clean, error_line

_MAX_REASON_CHARS = 1000


@dataclass
class AuditCounters:
    """What ``status()`` reports; the auditor updates it under its lock."""

    batches_audited: int = 0
    batches_replayed: int = 0
    batches_skipped: int = 0
    late_rows: int = 0
    late_rows_over_cap: int = 0
    batches_over_cap: int = 0
    errors: int = 0
    last_error: str | None = None
    batches_lost: int = 0
    last_lost_batch: int | None = None
    last_lost_reason: str | None = None
    min_batches_to_retain: int | None = None
    retention_batches_remaining: int | None = None
    last_audited_batch: int | None = None
    latest_committed_batch: int | None = None
    oldest_pending_commit_mtime_seconds: float | None = None
    replay_seconds: float = 0.0
    # (operator index, kind, join side) -> late rows found
    by_operator: dict[tuple[int, str, str | None], int] = field(default_factory=dict)
    yield_seconds: float = 0.0
    kept_behind_watermark: int = 0
    # a real-time query's replays wait for a spare task slot
    waiting_for_slot: bool = False
    # rows Spark dropped from inputs the audit cannot read again (its count, no payload)
    rows_without_payload: int = 0

    def add_batch(self, batch_id: int, found: BatchLateRows) -> None:
        """One batch audited, with what it held."""
        self.batches_audited += 1
        self.late_rows += found.total
        self.kept_behind_watermark += found.kept_behind_watermark or 0
        for count in found.by_input:
            if count.payload_missing is not None:
                self.rows_without_payload += count.rows or 0
                continue
            key = (count.operator_index, count.kind, count.side)
            self.by_operator[key] = self.by_operator.get(key, 0) + (count.rows or 0)
        if found.over_cap:
            self.batches_over_cap += 1
            self.late_rows_over_cap += found.over_cap
        if found.replayed:
            self.batches_replayed += 1
        else:
            self.batches_skipped += 1
        self.last_audited_batch = (
            batch_id if self.last_audited_batch is None else max(self.last_audited_batch, batch_id)
        )

    def add_lost(self, ranges: list[BatchRange], reason: str) -> None:
        """Runs of batches that can never be audited."""
        if not ranges:
            return
        self.batches_lost += range_count(ranges)
        last = max(end for _, end in ranges)
        self.last_lost_batch = (
            last if self.last_lost_batch is None else max(self.last_lost_batch, last)
        )
        # the reason quotes checkpoint paths and exceptions: cleaned as it enters the status
        self.last_lost_reason = clean(reason, _MAX_REASON_CHARS)

    def add_error(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = f"{type(exc).__name__}: {error_line(exc)}"


def _inputs(inputs: Sequence[ReplayInput]) -> list[dict[str, Any]]:
    return [
        {
            "source_index": item.source.source_index,
            "operator_index": item.spec.operator_index,
            "kind": item.spec.kind,
            "side": item.spec.side,
            "event_time_column": item.spec.event_time_column,
            "payload_missing": (
                item.source.reason if isinstance(item.source, UnreplayableSource) else None
            ),
        }
        for item in inputs
    ]


def audit_status(
    c: AuditCounters,
    *,
    query_id: str,
    label: str,
    inputs: Sequence[ReplayInput],
    plan_known: bool,
    sink: str,
    running: bool,
    max_rows_per_batch: int,
    now_seconds: float,
    jumps: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The status of one audit (a fresh dict): its query and inputs, its counters and its lag
    behind the query's commits, in batches and in seconds since the oldest pending commit; then
    ``jumps``, the watermark-jump forensics' own keys
    (:meth:`wmwatch._audit.jumps.watch.JumpWatch.status`)."""
    spec = inputs[0].spec if inputs else None
    latest = c.latest_committed_batch
    last = c.last_audited_batch
    lag_batches = 0 if latest is None else max(0, latest - (last if last is not None else -1))
    lag_seconds = (
        0.0
        if c.oldest_pending_commit_mtime_seconds is None
        else max(0.0, now_seconds - c.oldest_pending_commit_mtime_seconds)
    )
    return {
        "query_id": query_id,
        "query": label,
        "operator_kind": spec.kind if spec else None,
        "event_time_column": spec.event_time_column if spec else None,
        "plan_known": plan_known,
        "inputs": _inputs(inputs),
        "late_rows_by_operator": [
            {"operator_index": op, "kind": kind, "side": side, "rows": rows}
            for (op, kind, side), rows in sorted(
                c.by_operator.items(), key=lambda kv: (kv[0][0], kv[0][2] or "")
            )
        ],
        "sink": sink,
        "running": running,
        "batches_audited": c.batches_audited,
        "batches_replayed": c.batches_replayed,
        "batches_skipped": c.batches_skipped,
        "last_audited_batch": last,
        "latest_committed_batch": latest,
        "late_rows": c.late_rows,
        "late_rows_over_cap": c.late_rows_over_cap,
        "batches_over_cap": c.batches_over_cap,
        "max_rows_per_batch": max_rows_per_batch,
        "lag_batches": lag_batches,
        "lag_seconds": lag_seconds,
        "errors": c.errors,
        "last_error": c.last_error,
        "replay_seconds": c.replay_seconds,
        "yield_seconds": c.yield_seconds,
        "batches_lost": c.batches_lost,
        "rows_kept_behind_watermark": c.kept_behind_watermark,
        "rows_without_payload": c.rows_without_payload,
        "waiting_for_task_slot": c.waiting_for_slot,
        "last_lost_batch": c.last_lost_batch,
        "last_lost_reason": c.last_lost_reason,
        "min_batches_to_retain": c.min_batches_to_retain,
        "retention_batches_remaining": c.retention_batches_remaining,
        **(jumps or {}),
    }
