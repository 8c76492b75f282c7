"""The Prometheus alert rules, as data: one source for deploy/ and for the end-to-end test.

Rules live beside the dashboards so both are written against the same metric names. Thresholds
and durations come from a :class:`Profile`: ``PRODUCTION`` renders the committed rule files,
``TEST`` renders a copy with short windows for the test that runs a real Prometheus against a
real query. Every rule also names its ``signal``: the expression without its threshold, which
must return data whenever wmwatch is scraped, so a renamed metric cannot silence an alert.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    """Thresholds and durations; durations are PromQL duration strings."""

    name: str
    job_regex: str = ".*wmwatch.*"
    lag_threshold_seconds: int = 1800
    lag_for: str = "10m"
    stall_window: str = "15m"
    stall_for: str = "5m"
    dropped_window: str = "15m"
    dropped_for: str = "0m"
    unbounded_for: str = "15m"
    state_window: str = "1h"
    state_horizon_seconds: int = 6 * 3600
    state_budget_rows: int = 100_000_000
    state_budget_bytes: int = 8 * 1024**3
    state_for: str = "15m"
    failed_for: str = "0m"
    silent_after_seconds: int = 3600
    silent_for: str = "5m"
    health_window: str = "10m"
    health_for: str = "0m"
    store_down_for: str = "5m"
    store_backlog_writes: int = 10_000
    store_backlog_for: str = "10m"
    audit_lag_batches: int = 50
    audit_lag_for: str = "30m"
    storm_window: str = "1h"
    retention_batches: int = 20
    retention_for: str = "5m"
    lost_window: str = "1h"
    endpoint_down_for: str = "5m"
    # the audit's default watermark_ahead_seconds: rows dated this far ahead move the watermark
    ahead_threshold_seconds: int = 600
    ahead_for: str = "0m"


PRODUCTION = Profile(name="production")
# Short windows for a run of a minute or two, scraped and evaluated every second. The state
# budget is small enough that a join without watermark crosses it in a few batches.
TEST = Profile(
    name="test",
    job_regex="wmwatch.*",
    lag_threshold_seconds=3600,
    lag_for="3s",
    stall_window="20s",
    stall_for="5s",
    dropped_window="10m",
    dropped_for="0s",
    unbounded_for="3s",
    state_window="30s",
    state_horizon_seconds=30,
    state_budget_rows=200,
    state_budget_bytes=1024**4,
    state_for="3s",
    failed_for="0s",
    silent_after_seconds=600,
    silent_for="5s",
    health_window="10m",
    health_for="0s",
    store_down_for="5s",
    store_backlog_writes=10_000,
    store_backlog_for="5s",
    audit_lag_batches=1000,
    audit_lag_for="5s",
    storm_window="10m",
    retention_batches=20,
    retention_for="5s",
    lost_window="10m",
    endpoint_down_for="5s",
    ahead_threshold_seconds=600,
    ahead_for="0s",
)


@dataclass(frozen=True)
class Rule:
    alert: str
    expr: str
    signal: str
    for_: str
    severity: str
    summary: str
    description: str
    runbook: str

    def to_yaml_dict(self) -> dict[str, object]:
        return {
            "alert": self.alert,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity, "component": "wmwatch"},
            "annotations": {
                "summary": self.summary,
                "description": self.description,
                "runbook": self.runbook,
            },
        }


def _state_rule(alert: str, metric: str, budget: float, unit: str, p: Profile) -> Rule:
    per_query = f"sum without (operator, operator_name) ({metric})"
    predicted = (
        f"sum without (operator, operator_name) "
        f"(predict_linear({metric}[{p.state_window}], {p.state_horizon_seconds}))"
    )
    hours = p.state_horizon_seconds / 3600
    return Rule(
        alert=alert,
        expr=f"{per_query} > {0.8 * budget:g} or {predicted} > {budget:g}",
        signal=predicted,
        for_=p.state_for,
        severity="warning",
        summary=f"State {unit} of {{{{ $labels.query }}}} is heading past its budget",
        description=(
            f"State {unit} of query {{{{ $labels.query }}}} is above 80% of the budget of "
            f"{budget:g}, or will pass it within {hours:g}h at the growth of the last "
            f"{p.state_window} (value: {{{{ $value | humanize }}}})."
        ),
        runbook=(
            "Open the query drill-down (State row). Eviction at zero while rows grow means the "
            "state is never cleaned: a join or aggregation without watermark, or a join without "
            "an event-time condition (see WmwatchJoinStateUnbounded). Steady growth with eviction "
            "means more keys than before: check the input, the key cardinality and the watermark "
            "delay; raise the budget only if the growth is expected, and give executors memory "
            "(or RocksDB state store) before it runs out."
        ),
    )


def rules(p: Profile) -> list[Rule]:
    up_query = "and on (job, instance, query) wmwatch_query_up == 1"
    stall_range = (
        f"max_over_time(wmwatch_watermark_seconds[{p.stall_window}]) - "
        f"min_over_time(wmwatch_watermark_seconds[{p.stall_window}])"
    )
    dropped = (
        "sum without (operator, operator_name) "
        f"(increase(wmwatch_rows_dropped_by_watermark_total[{p.dropped_window}]))"
    )
    silent = "time() - wmwatch_last_event_timestamp_seconds"
    events_dropped = (
        f"sum without (kind) (increase(wmwatch_events_dropped_total[{p.health_window}]))"
    )
    # One series per stage, kept apart for the description. The event stages (receive, parse
    # and handle, per event kind) are exported at 0 from the start, so their first error shows in
    # increase(); the others (seed, spark_bus, plugin:<name>, collect:<name>) appear with their
    # first error, which increase() cannot see: for those, the alert fires from the second one.
    listener_errors = f"increase(wmwatch_listener_errors_total[{p.health_window}])"
    return [
        Rule(
            alert="WmwatchWatermarkLagHigh",
            expr=f"wmwatch_watermark_lag_seconds > {p.lag_threshold_seconds} {up_query}",
            signal="wmwatch_watermark_lag_seconds",
            for_=p.lag_for,
            severity="warning",
            summary=(
                "Watermark of {{ $labels.query }} trails the clock by "
                "{{ $value | humanizeDuration }}"
            ),
            description=(
                "Batch time minus watermark of query {{ $labels.query }} has been above "
                f"{p.lag_threshold_seconds}s for {p.lag_for}: windows close and results arrive "
                "late."
            ),
            runbook=(
                "Open the query drill-down. If event time max trails the clock too, the input is "
                "behind (source backlog, upstream delay, or the query is slower than the input: "
                "compare input vs processing rate and batch phases). If event time max is recent "
                "but the watermark is not, the watermark delay is too large or one source holds "
                "the watermark back (per-source watermarks). Replays of old data lag by design."
            ),
        ),
        Rule(
            alert="WmwatchEventTimeAhead",
            expr=f"wmwatch_event_time_ahead_seconds > {p.ahead_threshold_seconds} {up_query}",
            signal="wmwatch_event_time_ahead_seconds",
            for_=p.ahead_for,
            severity="critical",
            summary=(
                "Watermark of {{ $labels.query }} stands on an event time "
                "{{ $value | humanizeDuration }} ahead of the clock"
            ),
            description=(
                "Query {{ $labels.query }} read a row dated more than "
                f"{p.ahead_threshold_seconds}s after its batch's time. Spark's watermark is the "
                "largest event time minus the delay, so it moved ahead with that row, and the "
                "ordinary rows after it are dropped as late."
            ),
            runbook=(
                "Run `wmwatch report --query <query>`: its 'who moved the watermark' section "
                "names the batch, the input and the rows (for Kafka their partition and offset) "
                "dated ahead, and how many rows the jump dropped since (the audit must run on "
                "the query). Fix the producer (a wrong clock, seconds taken for milliseconds). "
                "The watermark never moves back: to stop the drops, restart the query from a "
                "checkpoint taken before that batch or a new one, filtering rows dated ahead of "
                "current_timestamp() in events; then replay the dropped rows (late_rows, or the "
                "input of the batches since) into a backfill."
            ),
        ),
        Rule(
            alert="WmwatchWatermarkStalled",
            expr=(
                f"({stall_range}) == 0 and on (job, instance, query) "
                f"increase(wmwatch_input_rows_total[{p.stall_window}]) > 0"
            ),
            signal=stall_range,
            for_=p.stall_for,
            severity="warning",
            summary="Watermark of {{ $labels.query }} stopped while input keeps arriving",
            description=(
                "Query {{ $labels.query }} read rows in the last "
                f"{p.stall_window} but its watermark did not move."
            ),
            runbook=(
                "All new rows are older than the watermark (a replay or a stuck producer clock), "
                "or one input of a multi-source query is idle and holds the min watermark (see "
                "'Source holding back the watermark'; consider "
                "spark.sql.streaming.multipleWatermarkPolicy=max or a heartbeat). Check "
                "`wmwatch report` for late-row findings."
            ),
        ),
        Rule(
            alert="WmwatchRowsDroppedAsLate",
            expr=f"{dropped} > 0",
            signal=dropped,
            for_=p.dropped_for,
            severity="warning",
            summary="{{ $labels.query }} dropped {{ $value | humanize }} late rows",
            description=(
                "Stateful operators of query {{ $labels.query }} dropped rows behind the watermark "
                f"in the last {p.dropped_window} (for aggregations Spark counts late groups)."
            ),
            runbook=(
                "Those rows are missing from the results. Run the late-row audit "
                "(watch.audit / `wmwatch report`) to see which rows and how late they were; if "
                "lateness is routine, raise the withWatermark delay to cover it, otherwise fix the "
                "producer that sends old events. Dropped rows cannot be recovered by the query: "
                "reprocess them in a batch job if results must be complete."
            ),
        ),
        Rule(
            alert="WmwatchJoinStateUnbounded",
            expr="wmwatch_join_state_unbounded == 1",
            signal="wmwatch_join_state_unbounded",
            for_=p.unbounded_for,
            severity="warning",
            summary="Join state of {{ $labels.query }} ({{ $labels.side }} side) is never cleaned",
            description=(
                "The stream-stream join (operator {{ $labels.operator }}) of query "
                "{{ $labels.query }} has no state cleanup for its {{ $labels.side }} side: its "
                "state grows with every batch until the executors run out of memory."
            ),
            runbook=(
                "Give both inputs a withWatermark and add an event-time condition to the join "
                "(a range such as "
                "`r.ts BETWEEN l.ts - INTERVAL 1 HOUR AND l.ts + INTERVAL 1 HOUR`, "
                "or equality on a window); a one-sided range cleans only one side. Restart the "
                "query from a new checkpoint after the change. `wmwatch report` shows the plan's "
                "cleanup predicates."
            ),
        ),
        _state_rule(
            "WmwatchStateRowsNearBudget", "wmwatch_state_rows", p.state_budget_rows, "rows", p
        ),
        _state_rule(
            "WmwatchStateMemoryNearBudget",
            "wmwatch_state_memory_bytes",
            p.state_budget_bytes,
            "bytes",
            p,
        ),
        Rule(
            alert="WmwatchQueryFailed",
            expr="wmwatch_query_failed == 1",
            signal="wmwatch_query_failed",
            for_=p.failed_for,
            severity="critical",
            summary="Streaming query {{ $labels.query }} failed",
            description="The last run of query {{ $labels.query }} ended with an exception.",
            runbook=(
                "Read the exception with `wmwatch report` or the driver log. Fix the cause and "
                "restart from the same checkpoint; do not delete the checkpoint unless the state "
                "is known to be unusable, as that loses state and exactly-once progress."
            ),
        ),
        Rule(
            alert="WmwatchQueryStoppedReporting",
            expr=f"{silent} > {p.silent_after_seconds} {up_query}",
            signal=silent,
            for_=p.silent_for,
            severity="critical",
            summary=(
                "{{ $labels.query }} reported nothing (no progress, no idle event) for "
                "{{ $value | humanizeDuration }}"
            ),
            description=(
                "Query {{ $labels.query }} is running but no batch completed for more than "
                f"{p.silent_after_seconds}s."
            ),
            runbook=(
                "A batch is stuck (see the Spark UI for the running job: a slow sink, a skewed "
                "task, a lost executor) or the source has had no data for that long (an idle query "
                "reports no batches: raise this threshold for rarely fed queries). A thread dump "
                "of the driver shows where the micro-batch thread waits."
            ),
        ),
        Rule(
            alert="WmwatchEndpointDown",
            expr=f'up{{job=~"{p.job_regex}"}} == 0',
            signal=f'up{{job=~"{p.job_regex}"}}',
            for_=p.endpoint_down_for,
            severity="critical",
            summary="wmwatch endpoint {{ $labels.instance }} cannot be scraped",
            description=(
                "Prometheus could not scrape {{ $labels.instance }} (job {{ $labels.job }}): "
                "none of its queries are monitored."
            ),
            runbook=(
                "The Spark driver is down or restarting, or wmwatch.attach was not called (or its "
                "metrics port is taken: the driver log says so). Check the driver pod and the "
                "Service/PodMonitor port."
            ),
        ),
        Rule(
            alert="WmwatchEventsDropped",
            expr=f"{events_dropped} > 0",
            signal=events_dropped,
            for_=p.health_for,
            severity="warning",
            summary=(
                "wmwatch on {{ $labels.instance }} dropped {{ $value | humanize }} listener events"
            ),
            description=(
                "The event queue was full: progress events were lost, so history, metrics and "
                "the late-row audit have gaps."
            ),
            runbook=(
                "The worker cannot keep up: check 'Event handling time' and 'History store' on the "
                "health dashboard. A slow or locked DuckDB file (another process holding it open "
                "for writing) is the usual cause; raise the queue size only for bursts."
            ),
        ),
        Rule(
            alert="WmwatchListenerErrors",
            expr=f"({listener_errors}) > 0",
            signal=listener_errors,
            for_=p.health_for,
            severity="warning",
            summary="wmwatch on {{ $labels.instance }} fails to handle events",
            description=(
                "Errors while receiving or handling listener events (stage {{ $labels.stage }})."
            ),
            runbook=(
                "The driver log has each error with its stack trace (logger 'wmwatch'). The query "
                "itself is not affected; file a bug with the progress JSON if the parser failed."
            ),
        ),
        Rule(
            alert="WmwatchStoreDown",
            expr="wmwatch_store_up == 0",
            signal="wmwatch_store_up",
            for_=p.store_down_for,
            severity="warning",
            summary="wmwatch history store on {{ $labels.instance }} cannot be written",
            description=(
                "Writes to the DuckDB history fail; they are retried and kept in memory meanwhile."
            ),
            runbook=(
                "Check disk space and permissions of the DuckDB file, and whether another process "
                "holds it open for writing (readers must use `wmwatch report`, which opens it "
                "read-only between flushes)."
            ),
        ),
        Rule(
            alert="WmwatchStoreBacklog",
            expr=f"wmwatch_store_pending_writes > {p.store_backlog_writes}",
            signal="wmwatch_store_pending_writes",
            for_=p.store_backlog_for,
            severity="warning",
            summary="wmwatch history store on {{ $labels.instance }} is falling behind",
            description="{{ $value }} writes are waiting for DuckDB.",
            runbook=(
                "The disk is slow or the file is locked. Once the backlog limit is reached writes "
                "are dropped (wmwatch_store_dropped_writes_total)."
            ),
        ),
        Rule(
            alert="WmwatchAuditLagging",
            expr=f"wmwatch_audit_lag_batches > {p.audit_lag_batches}",
            signal="wmwatch_audit_lag_batches",
            for_=p.audit_lag_for,
            severity="warning",
            summary="Late-row audit of {{ $labels.query }} is {{ $value }} batches behind",
            description="The audit re-reads each batch's input; it is falling behind the query.",
            runbook=(
                "The audit runs in a low-priority scheduler pool and yields to the query. Give the "
                "driver more cores, audit fewer queries, or raise its batch interval; the audit "
                "catches up on its own once the input slows down."
            ),
        ),
        Rule(
            alert="WmwatchAuditNearRetention",
            expr=f"wmwatch_audit_retention_batches_remaining < {p.retention_batches}",
            signal="wmwatch_audit_retention_batches_remaining",
            for_=p.retention_for,
            severity="warning",
            summary=(
                "Late-row audit of {{ $labels.query }} loses batches in {{ $value }} more batches"
            ),
            description=(
                "The audit of {{ $labels.query }} trails the query by nearly "
                "spark.sql.streaming.minBatchesToRetain batches: once the checkpoint purges the "
                "offsets of the oldest batch it has not audited, that batch can never be audited."
            ),
            runbook=(
                "Let the audit catch up: give the driver more cores, audit fewer queries, or raise "
                "the query's trigger interval. To keep more headroom, raise "
                "spark.sql.streaming.minBatchesToRetain on the query's session before it starts "
                "(it costs a few small checkpoint files per batch). Lost batches are logged one "
                "per line and counted in wmwatch_audit_batches_lost_total."
            ),
        ),
        Rule(
            alert="WmwatchAuditBatchesLost",
            expr=f"increase(wmwatch_audit_batches_lost_total[{p.lost_window}]) > 0",
            signal=f"increase(wmwatch_audit_batches_lost_total[{p.lost_window}])",
            for_="0m",
            severity="warning",
            summary="Late-row audit of {{ $labels.query }} lost batches",
            description=(
                f"In the last {p.lost_window}, batches of {{{{ $labels.query }}}} could not be "
                "audited: the checkpoint had purged their offsets or source-log entries, or "
                "Kafka had deleted their records, first."
            ),
            runbook=(
                "The late rows of those batches are unknown; the audit goes on with the batches "
                "that follow. The driver log names each lost batch and the reason. See "
                "WmwatchAuditNearRetention for how to keep the audit within the retention; a batch "
                "job over the lost batches' input files can recover their late rows. For Kafka, "
                "keep records (the topic's retention.ms) longer than the audit's lag."
            ),
        ),
        Rule(
            alert="WmwatchLateRowStorm",
            expr=f"increase(wmwatch_audit_batches_over_cap_total[{p.storm_window}]) > 0",
            signal=f"increase(wmwatch_audit_batches_over_cap_total[{p.storm_window}])",
            for_="0m",
            severity="warning",
            summary="A late-row storm hit {{ $labels.query }}",
            description=(
                f"In the last {p.storm_window}, batches of {{{{ $labels.query }}}} held more late "
                "rows than the audit keeps per batch (max_rows_per_batch)."
            ),
            runbook=(
                "A producer replayed old data, or a future-dated row moved the watermark far ahead "
                "(see WmwatchRowsDroppedAsLate and the watermark_jump finding). `wmwatch report` "
                "shows the storm's batches; the rows over the cap were counted "
                "(wmwatch_late_rows_over_cap_total) and are in Parquet only if the audit has "
                "parquet_path=. Replay the dropped data into a backfill job if it matters."
            ),
        ),
    ]


def rule_file(p: Profile) -> dict[str, object]:
    """The Prometheus rule file (also the `spec` of the Kubernetes PrometheusRule)."""
    return {"groups": [{"name": "wmwatch", "rules": [r.to_yaml_dict() for r in rules(p)]}]}
