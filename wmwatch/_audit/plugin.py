"""The watch's one audit plugin: per-query counters that continue across runs, and the
audit's metric families.

The plugin hook on the watch's worker thread only records "batch N finished, min event time X"
and wakes the audit's own thread (:mod:`wmwatch._audit.auditor`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from wmwatch._audit.auditor import Auditor
from wmwatch._audit.jumps.rules import BatchTimes
from wmwatch._core.plugins import WatchContext, WatchPlugin
from wmwatch._events import QueryTerminated
from wmwatch._progress import ProgressSnapshot
from wmwatch._time import to_epoch_ms


@dataclass
class _QueryTotals:
    """Counters of a query's audits that ended, so its counters continue across runs."""

    late_rows: int = 0
    late_rows_over_cap: int = 0
    batches_over_cap: int = 0
    errors: int = 0
    # (operator index, kind, join side) -> late rows
    by_operator: dict[tuple[str, str, str], int] = field(default_factory=dict)
    batches_lost: int = 0
    kept_behind_watermark: int = 0

    def add(self, status: dict[str, Any]) -> None:
        for item in status["late_rows_by_operator"]:
            key = (str(item["operator_index"]), str(item["kind"]), item["side"] or "")
            self.by_operator[key] = self.by_operator.get(key, 0) + int(item["rows"])
        self.late_rows += int(status["late_rows"])
        self.late_rows_over_cap += int(status["late_rows_over_cap"])
        self.batches_over_cap += int(status["batches_over_cap"])
        self.errors += int(status["errors"])
        self.batches_lost += int(status["batches_lost"])
        self.kept_behind_watermark += int(status["rows_kept_behind_watermark"])


class AuditPlugin(WatchPlugin):
    """Every audit of one watch: wake-ups from progress, and one set of metric families.

    A query has at most one running audit. When its run stops, the audit finishes the batches
    that run committed and ends; auditing the restarted query starts a new audit that resumes
    from the checkpoint. Counters are per query label and continue across those audits, so a
    restart neither resets them nor exports the same series twice.
    """

    name = "audit"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, Auditor] = {}
        self._ended: dict[str, _QueryTotals] = {}

    def add(self, auditor: Auditor) -> None:
        """Register a started audit, ending the query's previous one first."""
        with self._lock:
            previous = self._running.get(auditor.query_id)
        if previous is not None:
            previous.stop(30.0)
        with self._lock:
            self._running[auditor.query_id] = auditor
        auditor.on_stop = lambda: self._ended_audit(auditor)

    def _ended_audit(self, auditor: Auditor) -> None:
        status = auditor.status()
        with self._lock:
            if self._running.get(auditor.query_id) is auditor:
                del self._running[auditor.query_id]
            self._ended.setdefault(auditor.label, _QueryTotals()).add(status)

    def running(self) -> list[Auditor]:
        with self._lock:
            return list(self._running.values())

    def on_progress(self, snapshot: ProgressSnapshot) -> None:
        with self._lock:
            auditor = self._running.get(snapshot.query_id)
        if auditor is not None:
            auditor.note_progress(
                snapshot.batch_id,
                to_epoch_ms(snapshot.event_time_min_at),
                snapshot.run_id,
                has_rows=bool(snapshot.input_rows),
                # None when Spark did not count: an operator did not run in the batch
                dropped_by_operator={
                    op.operator_id: op.rows_dropped_by_watermark or 0 for op in snapshot.operators
                }
                if all(op.ran for op in snapshot.operators)
                else None,
            )
            if auditor.jumps is not None and snapshot.input_rows:
                auditor.jumps.note(snapshot.batch_id, batch_times(snapshot))

    def on_query_terminated(self, event: QueryTerminated) -> None:
        with self._lock:
            auditor = self._running.get(event.query_id)
        # the end of an earlier run of the query does not end the audit of the current one
        if auditor is not None and auditor.run_id in (None, event.run_id):
            auditor.finish()

    def collect(self) -> Iterable[Metric]:
        late = CounterMetricFamily(
            "wmwatch_late_rows_audited",
            "Input rows the audit found dropped as late.",
            labels=["query"],
        )
        by_operator = CounterMetricFamily(
            "wmwatch_late_rows_audited_by_operator",
            "Input rows the audit found dropped as late, per stateful operator (its index in the "
            "progress' stateOperators, its kind) and join side (empty for other operators).",
            labels=["query", "operator", "kind", "side"],
        )
        over_cap = CounterMetricFamily(
            "wmwatch_late_rows_over_cap",
            "Late rows found in batches over max_rows_per_batch and not kept in DuckDB.",
            labels=["query"],
        )
        storms = CounterMetricFamily(
            "wmwatch_audit_batches_over_cap",
            "Audited batches with more late rows than max_rows_per_batch.",
            labels=["query"],
        )
        lag_b = GaugeMetricFamily(
            "wmwatch_audit_lag_batches", "Committed batches not yet audited.", labels=["query"]
        )
        lag_s = GaugeMetricFamily(
            "wmwatch_audit_lag_seconds",
            "Age of the oldest committed batch not yet audited.",
            labels=["query"],
        )
        errors = CounterMetricFamily(
            "wmwatch_audit_errors", "Audit attempts that failed (retried).", labels=["query"]
        )
        lost = CounterMetricFamily(
            "wmwatch_audit_batches_lost",
            "Committed batches the audit could not audit: their offsets or source-log entries "
            "were purged from the checkpoint, or their Kafka records deleted, first.",
            labels=["query"],
        )
        kept_behind = CounterMetricFamily(
            "wmwatch_rows_kept_behind_watermark",
            "Rows a batch kept (aggregated, emitted) although the watermark it reported had "
            "passed them: it judged late rows with the batch before's (real-time queries).",
            labels=["query"],
        )
        retention = GaugeMetricFamily(
            "wmwatch_audit_retention_batches_remaining",
            "Batches the query can run before its checkpoint purges offsets the audit still "
            "needs (spark.sql.streaming.minBatchesToRetain); 0: the next batch loses one.",
            labels=["query"],
        )
        with self._lock:
            running = list(self._running.values())
            totals = {
                label: replace(t, by_operator=dict(t.by_operator))
                for label, t in self._ended.items()
            }
        lags: dict[str, tuple[float, float]] = {}
        remaining: dict[str, float] = {}
        counting = {a.label for a in running if a.count_kept_behind}
        for auditor in running:
            status = auditor.status()
            totals.setdefault(auditor.label, _QueryTotals()).add(status)
            lags[auditor.label] = (float(status["lag_batches"]), float(status["lag_seconds"]))
            if status["retention_batches_remaining"] is not None:
                remaining[auditor.label] = float(status["retention_batches_remaining"])
        for label, t in sorted(totals.items()):
            late.add_metric([label], float(t.late_rows))
            for (operator, kind, side), rows in sorted(t.by_operator.items()):
                by_operator.add_metric([label, operator, kind, side], float(rows))
            over_cap.add_metric([label], float(t.late_rows_over_cap))
            storms.add_metric([label], float(t.batches_over_cap))
            errors.add_metric([label], float(t.errors))
            lost.add_metric([label], float(t.batches_lost))
            if t.kept_behind_watermark or label in counting:
                kept_behind.add_metric([label], float(t.kept_behind_watermark))
        for label, (batches, seconds) in sorted(lags.items()):
            lag_b.add_metric([label], batches)
            lag_s.add_metric([label], seconds)
        for label, batches in sorted(remaining.items()):
            retention.add_metric([label], batches)
        return [
            late,
            by_operator,
            over_cap,
            storms,
            lag_b,
            lag_s,
            errors,
            lost,
            kept_behind,
            retention,
        ]

    def close(self) -> None:
        for auditor in self.running():
            auditor.stop(10.0)


def batch_times(snapshot: ProgressSnapshot) -> BatchTimes:
    """What the watermark check needs of a batch's progress."""
    return BatchTimes(
        batch_at_ms=to_epoch_ms(snapshot.timestamp_at),
        event_time_max_ms=to_epoch_ms(snapshot.event_time_max_at),
        descriptions=tuple(source.description for source in snapshot.sources),
    )


_PLUGIN_LOCK = threading.Lock()


def audit_plugin(watch: WatchContext) -> AuditPlugin:
    """The watch's one audit plugin, added on first use."""
    with _PLUGIN_LOCK:
        for plugin in watch.plugins():
            if isinstance(plugin, AuditPlugin):
                return plugin
        plugin = AuditPlugin()
        watch.add_plugin(plugin)
        return plugin
