"""Hand-written `promtool test rules` cases for the production rules.

The input series, evaluation times, expected labels and the expected *rendered* summary and
description are written here by hand; only the runbook text (static, no template) is copied
from the rule, because promtool compares every annotation. ``generate`` renders these into
deploy/prometheus/tests/wmwatch.rules.test.yml, which CI runs with the real promtool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dashboards import alerts

T = 'job="wmwatch",instance="d:9108"'
TARGET = {"job": "wmwatch", "instance": "d:9108"}


@dataclass(frozen=True)
class Firing:
    labels: dict[str, str]
    summary: str
    description: str


@dataclass(frozen=True)
class Case:
    name: str
    alert: str
    series: dict[str, str]
    quiet_at: list[str]
    fires_at: str
    firing: list[Firing] = field(default_factory=list)


def _q(query: str, **extra: str) -> str:
    labels = "".join(f',{name}="{value}"' for name, value in extra.items())
    return "{" + T + f',query="{query}"' + labels + "}"


CASES = [
    Case(
        name="watermark lag",
        alert="WmwatchWatermarkLagHigh",
        series={
            "wmwatch_watermark_lag_seconds" + _q("slow"): "2000x30",
            "wmwatch_query_up" + _q("slow"): "1x30",
            "wmwatch_watermark_lag_seconds" + _q("fine"): "600x30",
            "wmwatch_query_up" + _q("fine"): "1x30",
            # a stopped query keeps its last lag for a while: no alert for it
            "wmwatch_watermark_lag_seconds" + _q("stopped"): "5000x30",
            "wmwatch_query_up" + _q("stopped"): "0x30",
        },
        quiet_at=["5m"],
        fires_at="15m",
        firing=[
            Firing(
                {**TARGET, "query": "slow", "severity": "warning"},
                "Watermark of slow trails the clock by 33m 20s",
                "Batch time minus watermark of query slow has been above 1800s for 10m: windows "
                "close and results arrive late.",
            )
        ],
    ),
    Case(
        name="event time ahead of the clock",
        alert="WmwatchEventTimeAhead",
        series={
            # a row dated 6 hours ahead arrives in the fourth minute
            "wmwatch_event_time_ahead_seconds" + _q("poisoned"): "-30 -30 -30 21600x10",
            "wmwatch_query_up" + _q("poisoned"): "1x13",
            # ordinary rows a little behind the clock, and a little ahead (clock skew)
            "wmwatch_event_time_ahead_seconds" + _q("ontime"): "-30x13",
            "wmwatch_query_up" + _q("ontime"): "1x13",
            "wmwatch_event_time_ahead_seconds" + _q("skewed"): "120x13",
            "wmwatch_query_up" + _q("skewed"): "1x13",
            # a stopped query keeps its last value for a while: no alert for it
            "wmwatch_event_time_ahead_seconds" + _q("stopped"): "21600x13",
            "wmwatch_query_up" + _q("stopped"): "0x13",
        },
        quiet_at=["2m"],
        fires_at="5m",
        firing=[
            Firing(
                {**TARGET, "query": "poisoned", "severity": "critical"},
                "Watermark of poisoned stands on an event time 6h 0m 0s ahead of the clock",
                "Query poisoned read a row dated more than 600s after its batch's time. Spark's "
                "watermark is the largest event time minus the delay, so it moved ahead with "
                "that row, and the ordinary rows after it are dropped as late.",
            )
        ],
    ),
    Case(
        name="watermark stalled while input flows",
        alert="WmwatchWatermarkStalled",
        series={
            "wmwatch_watermark_seconds" + _q("stuck"): "1000x40",
            "wmwatch_input_rows_total" + _q("stuck"): "0+10x40",
            "wmwatch_watermark_seconds" + _q("moving"): "1000+60x40",
            "wmwatch_input_rows_total" + _q("moving"): "0+10x40",
            # no input, no watermark movement: idle, not stalled
            "wmwatch_watermark_seconds" + _q("idle"): "1000x40",
            "wmwatch_input_rows_total" + _q("idle"): "500x40",
        },
        quiet_at=["3m"],
        fires_at="25m",
        firing=[
            Firing(
                {**TARGET, "query": "stuck", "severity": "warning"},
                "Watermark of stuck stopped while input keeps arriving",
                "Query stuck read rows in the last 15m but its watermark did not move.",
            )
        ],
    ),
    Case(
        name="rows dropped as late",
        alert="WmwatchRowsDroppedAsLate",
        series={
            "wmwatch_rows_dropped_by_watermark_total"
            + _q("late", operator="0", operator_name="stateStoreSave"): "0 0 0 0 0 6 6 6 6 6 6",
            "wmwatch_rows_dropped_by_watermark_total"
            + _q("ontime", operator="0", operator_name="stateStoreSave"): "0x10",
        },
        quiet_at=["3m"],
        fires_at="7m",
        firing=[
            Firing(
                {**TARGET, "query": "late", "severity": "warning"},
                "late dropped 6 late rows",
                "Stateful operators of query late dropped rows behind the watermark in the last "
                "15m (for aggregations Spark counts late groups).",
            )
        ],
    ),
    Case(
        name="join state unbounded",
        alert="WmwatchJoinStateUnbounded",
        series={
            "wmwatch_join_state_unbounded" + _q("j", operator="0", side="left"): "1x30",
            "wmwatch_join_state_unbounded" + _q("j", operator="0", side="right"): "0x30",
        },
        quiet_at=["10m"],
        fires_at="20m",
        firing=[
            Firing(
                {**TARGET, "query": "j", "operator": "0", "side": "left", "severity": "warning"},
                "Join state of j (left side) is never cleaned",
                "The stream-stream join (operator 0) of query j has no state cleanup for its left "
                "side: its state grows with every batch until the executors run out of memory.",
            )
        ],
    ),
    Case(
        name="state rows heading past budget",
        alert="WmwatchStateRowsNearBudget",
        series={
            # +400k rows a minute: 1.44e8 more within 6h, over the 1e8 budget
            "wmwatch_state_rows"
            + _q("growing", operator="0", operator_name="symmetricHashJoin"): "0+400000x90",
            "wmwatch_state_rows"
            + _q("steady", operator="0", operator_name="stateStoreSave"): "5000x90",
            # above 80% of the budget without growth also warns
            "wmwatch_state_rows"
            + _q("big", operator="0", operator_name="stateStoreSave"): "50000000x90",
            "wmwatch_state_rows"
            + _q("big", operator="1", operator_name="stateStoreSave"): "40000000x90",
        },
        quiet_at=["5m"],
        fires_at="80m",
        firing=[
            Firing(
                {**TARGET, "query": "big", "severity": "warning"},
                "State rows of big is heading past its budget",
                "State rows of query big is above 80% of the budget of 1e+08, or will pass it "
                "within 6h at the growth of the last 1h (value: 90M).",
            ),
            Firing(
                {**TARGET, "query": "growing", "severity": "warning"},
                "State rows of growing is heading past its budget",
                "State rows of query growing is above 80% of the budget of 1e+08, or will pass it "
                "within 6h at the growth of the last 1h (value: 176M).",
            ),
        ],
    ),
    Case(
        name="state memory near budget",
        alert="WmwatchStateMemoryNearBudget",
        series={
            "wmwatch_state_memory_bytes"
            + _q("fat", operator="0", operator_name="stateStoreSave"): "7500000000x40",
            "wmwatch_state_memory_bytes"
            + _q("thin", operator="0", operator_name="stateStoreSave"): "1000000000x40",
        },
        quiet_at=["10m"],
        fires_at="30m",
        firing=[
            Firing(
                {**TARGET, "query": "fat", "severity": "warning"},
                "State bytes of fat is heading past its budget",
                "State bytes of query fat is above 80% of the budget of 8.58993e+09, or will pass "
                "it within 6h at the growth of the last 1h (value: 7.5G).",
            )
        ],
    ),
    Case(
        name="query failed",
        alert="WmwatchQueryFailed",
        series={
            "wmwatch_query_failed" + _q("broken"): "0 0 0 1 1 1",
            "wmwatch_query_failed" + _q("healthy"): "0x5",
        },
        quiet_at=["2m"],
        fires_at="4m",
        firing=[
            Firing(
                {**TARGET, "query": "broken", "severity": "critical"},
                "Streaming query broken failed",
                "The last run of query broken ended with an exception.",
            )
        ],
    ),
    Case(
        name="query stopped reporting",
        alert="WmwatchQueryStoppedReporting",
        series={
            # last progress at t=0, query still up
            "wmwatch_last_event_timestamp_seconds" + _q("hung"): "0x80",
            "wmwatch_query_up" + _q("hung"): "1x80",
            # progress every minute
            "wmwatch_last_event_timestamp_seconds" + _q("busy"): "0+60x80",
            "wmwatch_query_up" + _q("busy"): "1x80",
            # stopped on purpose: silence is expected
            "wmwatch_last_event_timestamp_seconds" + _q("done"): "0x80",
            "wmwatch_query_up" + _q("done"): "0x80",
        },
        quiet_at=["30m"],
        fires_at="70m",
        firing=[
            Firing(
                {**TARGET, "query": "hung", "severity": "critical"},
                "hung reported nothing (no progress, no idle event) for 1h 10m 0s",
                "Query hung is running but no batch completed for more than 3600s.",
            )
        ],
    ),
    Case(
        name="endpoint down",
        alert="WmwatchEndpointDown",
        series={
            'up{job="wmwatch",instance="d:9108"}': "1 1 0 0 0 0 0 0 0 0",
            'up{job="node",instance="n:9100"}': "0x9",
        },
        quiet_at=["3m"],
        fires_at="8m",
        firing=[
            Firing(
                {"job": "wmwatch", "instance": "d:9108", "severity": "critical"},
                "wmwatch endpoint d:9108 cannot be scraped",
                "Prometheus could not scrape d:9108 (job wmwatch): none of its queries are "
                "monitored.",
            )
        ],
    ),
    Case(
        name="events dropped",
        alert="WmwatchEventsDropped",
        series={
            'wmwatch_events_dropped_total{job="wmwatch",instance="d:9108",kind="progress"}': (
                "0 0 0 4 4 4 4"
            ),
            'wmwatch_events_dropped_total{job="wmwatch",instance="d:9108",kind="idle"}': "0x6",
            'wmwatch_events_dropped_total{job="wmwatch",instance="e:9108",kind="progress"}': "0x6",
        },
        quiet_at=["2m"],
        fires_at="5m",
        firing=[
            Firing(
                {"job": "wmwatch", "instance": "d:9108", "severity": "warning"},
                "wmwatch on d:9108 dropped 4 listener events",
                "The event queue was full: progress events were lost, so history, metrics and the "
                "late-row audit have gaps.",
            )
        ],
    ),
    Case(
        name="listener errors",
        alert="WmwatchListenerErrors",
        series={
            'wmwatch_listener_errors_total{job="wmwatch",instance="d:9108",'
            'stage="parse:progress"}': "0 0 0 2 2 2",
            'wmwatch_listener_errors_total{job="wmwatch",instance="d:9108",'
            'stage="handle:progress"}': "0x5",
            'wmwatch_listener_errors_total{job="wmwatch",instance="e:9108",'
            'stage="parse:progress"}': "0x5",
        },
        quiet_at=["1m"],
        fires_at="4m",
        firing=[
            Firing(
                {
                    "job": "wmwatch",
                    "instance": "d:9108",
                    "stage": "parse:progress",
                    "severity": "warning",
                },
                "wmwatch on d:9108 fails to handle events",
                "Errors while receiving or handling listener events (stage parse:progress).",
            )
        ],
    ),
    Case(
        name="store down",
        alert="WmwatchStoreDown",
        series={
            'wmwatch_store_up{job="wmwatch",instance="d:9108"}': "1 1 0 0 0 0 0 0 0 0",
            'wmwatch_store_up{job="wmwatch",instance="e:9108"}': "1x9",
        },
        quiet_at=["4m"],
        fires_at="9m",
        firing=[
            Firing(
                {"job": "wmwatch", "instance": "d:9108", "severity": "warning"},
                "wmwatch history store on d:9108 cannot be written",
                "Writes to the DuckDB history fail; they are retried and kept in memory meanwhile.",
            )
        ],
    ),
    Case(
        name="store backlog",
        alert="WmwatchStoreBacklog",
        series={
            'wmwatch_store_pending_writes{job="wmwatch",instance="d:9108"}': "0+1000x30",
            'wmwatch_store_pending_writes{job="wmwatch",instance="e:9108"}': "3x20",
        },
        quiet_at=["12m"],
        fires_at="25m",
        firing=[
            Firing(
                {"job": "wmwatch", "instance": "d:9108", "severity": "warning"},
                "wmwatch history store on d:9108 is falling behind",
                "25000 writes are waiting for DuckDB.",
            )
        ],
    ),
    Case(
        name="audit lagging",
        alert="WmwatchAuditLagging",
        series={
            "wmwatch_audit_lag_batches" + _q("audited"): "80x40",
            "wmwatch_audit_lag_batches" + _q("keeping_up"): "2x40",
        },
        quiet_at=["20m"],
        fires_at="35m",
        firing=[
            Firing(
                {**TARGET, "query": "audited", "severity": "warning"},
                "Late-row audit of audited is 80 batches behind",
                "The audit re-reads each batch's input; it is falling behind the query.",
            )
        ],
    ),
    Case(
        name="audit near retention",
        alert="WmwatchAuditNearRetention",
        series={
            # counts down while the audit falls behind, then recovers
            "wmwatch_audit_retention_batches_remaining" + _q("behind"): "100-10x9 5x10 50x10",
            "wmwatch_audit_retention_batches_remaining" + _q("keeping_up"): "99x30",
        },
        quiet_at=["5m", "25m"],
        fires_at="17m",
        firing=[
            Firing(
                {**TARGET, "query": "behind", "severity": "warning"},
                "Late-row audit of behind loses batches in 5 more batches",
                "The audit of behind trails the query by nearly "
                "spark.sql.streaming.minBatchesToRetain batches: once the checkpoint purges the "
                "offsets of the oldest batch it has not audited, that batch can never be audited.",
            )
        ],
    ),
    Case(
        name="audit lost batches",
        alert="WmwatchAuditBatchesLost",
        series={
            "wmwatch_audit_batches_lost_total" + _q("purged"): "0x30 7x60",
            "wmwatch_audit_batches_lost_total" + _q("calm"): "0x90",
        },
        quiet_at=["20m", "95m"],
        fires_at="35m",
        firing=[
            Firing(
                {**TARGET, "query": "purged", "severity": "warning"},
                "Late-row audit of purged lost batches",
                "In the last 1h, batches of purged could not be audited: the checkpoint had "
                "purged their offsets or source-log entries, or Kafka had deleted their records, "
                "first.",
            )
        ],
    ),
    Case(
        name="late-row storm",
        alert="WmwatchLateRowStorm",
        series={
            # one batch over the cap at minute 30; the other query never has one
            "wmwatch_audit_batches_over_cap_total" + _q("replayed"): "0x30 1x60",
            "wmwatch_audit_batches_over_cap_total" + _q("calm"): "0x90",
        },
        quiet_at=["20m", "95m"],
        fires_at="35m",
        firing=[
            Firing(
                {**TARGET, "query": "replayed", "severity": "warning"},
                "A late-row storm hit replayed",
                "In the last 1h, batches of replayed held more late rows than the audit keeps "
                "per batch (max_rows_per_batch).",
            )
        ],
    ),
]


def unit_tests(rules_path: str) -> dict[str, object]:
    """The promtool unit-test document for ``CASES`` against the production rules."""
    runbooks = {rule.alert: rule.runbook for rule in alerts.rules(alerts.PRODUCTION)}
    missing = set(runbooks) - {case.alert for case in CASES}
    if missing:
        raise ValueError(f"alerts without a promtool test case: {sorted(missing)}")
    tests = []
    for case in CASES:
        checks: list[dict[str, object]] = [
            {"eval_time": at, "alertname": case.alert, "exp_alerts": []} for at in case.quiet_at
        ]
        checks.append(
            {
                "eval_time": case.fires_at,
                "alertname": case.alert,
                "exp_alerts": [
                    {
                        "exp_labels": {**f.labels, "component": "wmwatch"},
                        "exp_annotations": {
                            "summary": f.summary,
                            "description": f.description,
                            "runbook": runbooks[case.alert],
                        },
                    }
                    for f in case.firing
                ],
            }
        )
        tests.append(
            {
                "name": case.name,
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
                "alert_rule_test": checks,
            }
        )
    return {"rule_files": [rules_path], "evaluation_interval": "1m", "tests": tests}
