"""Turning a query's inspection state into findings: joins that keep state forever, and the
watermark monitor's verdicts.

Called under the plan plugin's lock with the query's :class:`QueryState`; each function opens,
updates or resolves findings in the :class:`FindingsBook` and touches nothing else.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from wmwatch._inspect.findings import JOIN_STATE_UNBOUNDED, WATERMARK_JUMP, FindingsBook, finding_id
from wmwatch._inspect.joins import SIDES
from wmwatch._inspect.state import QueryState
from wmwatch._inspect.watermarks import Verdict

_SECONDS_PER_DAY = 86400


def judge_joins(
    q: QueryState,
    findings: FindingsBook,
    *,
    state_budget_bytes: int | None,
    behaviour_batches: int,
    batch_id: int,
    at: datetime,
) -> None:
    """One finding per uncleaned side of each join the plan judged; joins without a plan are
    judged by their numbers (:func:`_judge_by_behaviour`)."""
    _judge_by_behaviour(q, findings, state_budget_bytes, behaviour_batches, batch_id, at)
    for op_id, check in q.checks.items():
        growth = q.growth.get(op_id)
        for side in SIDES:
            fid = finding_id(q.query_id, JOIN_STATE_UNBOUNDED, op_id, side)
            if side not in check.unbounded_sides:
                reason = "the plan now cleans this side"
                findings.resolve(fid, at=at, batch_id=batch_id, reason=reason)
                continue
            plan = check.plan
            evidence: dict[str, Any] = {
                "case": check.case,
                "join_type": plan.join_type,
                "state_cleanup": {s: plan.cleanup(s) for s in SIDES},
                "predicates": {"left": plan.left_predicate, "right": plan.right_predicate},
                "watermark": {s: plan.has_watermark(s) for s in SIDES},
                "condition": plan.condition,
                "via": q.facts.via if q.facts else None,
            }
            if growth is not None:
                evidence["growth"] = growth.evidence()
                split = growth.rows_per_second / len(check.unbounded_sides)
                evidence["side_rows_per_second"] = split
                evidence["side_rate_source"] = "operator total split over uncleaned sides"
                remaining = growth.seconds_to_budget(state_budget_bytes)
                if remaining is not None:
                    evidence["state_budget_bytes"] = state_budget_bytes
                    evidence["seconds_to_budget"] = round(remaining, 1)
            counted = q.side_rows.get(op_id)
            if counted:
                evidence["side_state_rows"] = counted[-1][1][side]
                measured = q.side_rate(op_id, side)
                if measured is not None:
                    evidence["side_rows_per_second"] = measured
                    evidence["side_rate_source"] = "statestore reader, per side"
            severity = "warning"
            if growth is not None and growth.growing:
                remaining = growth.seconds_to_budget(state_budget_bytes)
                if remaining is not None and remaining < _SECONDS_PER_DAY:
                    severity = "critical"
            findings.observe(
                query_id=q.query_id,
                query_name=q.name,
                kind=JOIN_STATE_UNBOUNDED,
                operator_id=op_id,
                side=side,
                severity=severity,
                message=check.message,
                evidence=evidence,
                fix=check.fixes.get(side),
                at=at,
                batch_id=batch_id,
            )


def _judge_by_behaviour(
    q: QueryState,
    findings: FindingsBook,
    state_budget_bytes: int | None,
    behaviour_batches: int,
    batch_id: int,
    at: datetime,
) -> None:
    """Joins the plan has not judged (no plan access): judge them by their numbers alone.

    Stricter than with a plan, since a bounded join also grows until its first eviction:
    ``behaviour_batches`` data batches in which state never shrank, the watermark moved (or
    there is none) and not one row was removed.
    """
    for op_id, growth in q.growth.items():
        fid = finding_id(q.query_id, JOIN_STATE_UNBOUNDED, op_id, None)
        if op_id in q.checks:
            findings.resolve(fid, at=at, batch_id=batch_id, reason="the plan now judges this join")
            continue
        if not (
            growth.growing and growth.rows_removed == 0 and growth.batches >= behaviour_batches
        ):
            continue
        evidence: dict[str, Any] = {
            "case": "unknown_plan",
            "via": "progress",
            "growth": growth.evidence(),
        }
        remaining = growth.seconds_to_budget(state_budget_bytes)
        if remaining is not None:
            evidence["state_budget_bytes"] = state_budget_bytes
            evidence["seconds_to_budget"] = round(remaining, 1)
        findings.observe(
            query_id=q.query_id,
            query_name=q.name,
            kind=JOIN_STATE_UNBOUNDED,
            operator_id=op_id,
            side=None,
            message=(
                f"join operator {op_id}: state grew in each of the last {growth.batches} batches "
                f"to {growth.rows_total} rows while the watermark advanced and nothing was removed"
            ),
            evidence=evidence,
            fix=(
                "give both inputs withWatermark and the join a time-range condition such as "
                "r.ts BETWEEN l.ts - INTERVAL 10 MINUTES AND l.ts + INTERVAL 10 MINUTES"
            ),
            at=at,
            batch_id=batch_id,
        )


def apply_verdict(
    q: QueryState, findings: FindingsBook, verdict: Verdict, *, batch_id: int, at: datetime
) -> None:
    """Open, update or resolve the finding a :class:`WatermarkMonitor` verdict is about."""
    if verdict.action == "resolve":
        fid = finding_id(q.query_id, verdict.kind, None, None)
        if verdict.kind == WATERMARK_JUMP:
            # keep the final attribution in the row before closing it
            findings.observe(
                query_id=q.query_id, query_name=q.name, kind=verdict.kind,
                severity=verdict.severity, message=verdict.message, evidence=verdict.evidence,
                fix=verdict.fix, at=at, batch_id=batch_id,
            )  # fmt: skip
        findings.resolve(fid, at=at, batch_id=batch_id, reason=verdict.message)
        return
    evidence = dict(verdict.evidence)
    if verdict.kind == WATERMARK_JUMP:
        movers = q.jumped_sources()
        if movers:
            evidence["moved_by_source"] = movers
    findings.observe(
        query_id=q.query_id,
        query_name=q.name,
        kind=verdict.kind,
        severity=verdict.severity,
        message=verdict.message,
        evidence=evidence,
        fix=verdict.fix,
        at=at,
        batch_id=batch_id,
    )
