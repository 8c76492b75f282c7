"""Findings: stable ids, opened once and updated, logged once, written idempotently to DuckDB."""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime, timedelta
from pathlib import Path

import duckdb
import pytest

from wmwatch._inspect.findings import ACTIVE, RESOLVED, Finding, FindingsBook, finding_id
from wmwatch._inspect.tables import write_finding
from wmwatch._store.writer import HistoryStore

T0 = datetime(2026, 1, 1, tzinfo=UTC)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def observe(
    book: FindingsBook, batch: int, *, rows: int = 10, side: str = "right"
) -> tuple[object, bool]:
    return book.observe(
        query_id="q1",
        query_name="joins",
        kind="join_state_unbounded",
        operator_id=0,
        side=side,
        message="state grows",
        evidence={"state_rows": rows},
        fix="add a time-range condition",
        at=T0 + timedelta(seconds=batch),
        batch_id=batch,
    )


def test_finding_id_is_stable_and_distinct() -> None:
    a = finding_id("q1", "join_state_unbounded", 0, "left")
    assert a == finding_id("q1", "join_state_unbounded", 0, "left")
    assert a != finding_id("q1", "join_state_unbounded", 0, "right")
    assert a != finding_id("q2", "join_state_unbounded", 0, "left")
    assert a.startswith("join_state_unbounded-")


def test_opened_once_updated_then_resolved_and_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    book = FindingsBook()
    with caplog.at_level(logging.WARNING, logger="wmwatch.findings"):
        _first, opened = observe(book, 1)
        _second, opened_again = observe(book, 2, rows=20)
    assert opened and not opened_again
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "join_state_unbounded" in warnings[0].getMessage()
    (only,) = book.all()
    assert only.occurrences == 2 and only.evidence == {"state_rows": 20}
    assert only.first_batch_id == 1 and only.last_batch_id == 2 and only.status == ACTIVE
    resolved = book.resolve(
        only.finding_id, at=T0 + timedelta(seconds=3), batch_id=3, reason="fixed"
    )
    assert resolved is not None and resolved.status == RESOLVED
    assert book.resolve(only.finding_id, at=T0, batch_id=3, reason="again") is None
    assert book.all(active_only=True) == []
    _, reopened = observe(book, 4)
    assert reopened and book.all(active_only=True)[0].first_batch_id == 1


def test_writes_are_throttled_and_idempotent(tmp_path: Path) -> None:
    store = HistoryStore(tmp_path / "h.duckdb").start()
    clock = Clock()
    writes: list[str] = []

    def writer(finding: Finding) -> None:
        writes.append(finding.kind)
        store.submit(lambda con: write_finding(con, finding), description=finding.kind)

    book = FindingsBook(writer=writer, update_interval_seconds=30.0, clock=clock)
    for batch in range(5):
        observe(book, batch, rows=batch)
    assert len(writes) == 1  # opened; the updates wait for the interval
    clock.now = 31.0
    observe(book, 5, rows=5)
    assert len(writes) == 2
    # a second process (fresh book) seeing the same problem later keeps the first sighting
    other = FindingsBook(writer=writer)
    observe(other, 9, rows=9)
    assert store.flush(timeout=10)
    store.close()
    con = duckdb.connect(str(tmp_path / "h.duckdb"), read_only=True)
    try:
        rows = con.execute(
            "SELECT finding_id, status, first_batch_id, last_batch_id, occurrences, evidence, "
            "first_seen_at, fix FROM findings"
        ).fetchall()
    finally:
        con.close()
    assert len(rows) == 1
    fid, status, first_batch, last_batch, occurrences, evidence, first_seen, fix = rows[0]
    assert fid == finding_id("q1", "join_state_unbounded", 0, "right")
    assert (status, first_batch, last_batch, occurrences) == ("active", 0, 9, 6)
    assert json.loads(evidence) == {"state_rows": 9}
    assert first_seen == T0
    assert fix == "add a time-range condition"
