"""Per-operator and per-source watermarks, and the watermark findings drawn from them.

Progress shows one global watermark. Spark keeps more: each ``withWatermark`` node's own value
(``max event time - delay``, in the query's WatermarkTracker) from which the multiple-watermark
policy (``min`` by default) picks the global one, and each stateful operator's late-row and
eviction watermarks. This module holds the pure logic over those values:
:func:`holding_back` names the input the global watermark waits for (an idle input included),
and :class:`WatermarkMonitor` turns a query's progress into ``watermark_stalled`` (rows flow,
the watermark does not move) and ``watermark_jump`` (one batch moves it far ahead; the rows
dropped afterwards are attributed to the jump) verdicts. No JVM here: ``_plan`` reads Spark.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

from wmwatch._progress import ProgressSnapshot
from wmwatch._time import EPOCH

MIN_POLICY = "min"
MAX_POLICY = "max"


@dataclass(frozen=True, slots=True)
class SourceWatermark:
    """One ``withWatermark`` input: its own watermark and the max event time behind it."""

    node_id: str
    source: str  # the stream(s) under the node, as progress describes them
    source_indexes: tuple[int, ...]
    event_time_column: str | None
    delay_seconds: float | None
    watermark_at: datetime | None  # None: no rows seen by this node in this run yet
    idle_batches: int = 0  # consecutive batches in which its sources read nothing
    holding_back: bool = False

    @property
    def event_time_max_at(self) -> datetime | None:
        if self.watermark_at is None or self.delay_seconds is None:
            return None
        from datetime import timedelta

        return self.watermark_at + timedelta(seconds=self.delay_seconds)


@dataclass(frozen=True, slots=True)
class OperatorWatermark:
    """A stateful operator's two watermarks (input for late rows, and for eviction/output)."""

    operator_id: int
    operator_name: str
    late_at: datetime | None
    eviction_at: datetime | None


def holding_back(sources: Sequence[SourceWatermark], policy: str) -> list[SourceWatermark]:
    """Mark the input(s) the global watermark waits for.

    Under the ``min`` policy with several inputs, that is the input whose own watermark is the
    lowest while another is ahead of it. Under ``max`` nothing holds the watermark back (a slow
    input's rows are dropped instead). An input with no rows yet in this run is not counted.
    """
    known = [s for s in sources if s.watermark_at is not None]
    marked = []
    lowest = min((s.watermark_at for s in known), default=None)  # type: ignore[type-var]
    highest = max((s.watermark_at for s in known), default=None)  # type: ignore[type-var]
    for s in sources:
        back = (
            policy.lower() == MIN_POLICY
            and len(known) >= 2
            and s.watermark_at is not None
            and lowest is not None
            and highest is not None
            and s.watermark_at == lowest
            and highest > lowest
        )
        marked.append(replace(s, holding_back=back))
    return marked


def policy_from_conf(conf: dict[str, str] | None) -> str:
    """The multiple-watermark policy in force (Spark's default is ``min``)."""
    value = (conf or {}).get("spark.sql.streaming.multipleWatermarkPolicy", MIN_POLICY)
    return value.strip().lower() or MIN_POLICY


@dataclass(frozen=True, slots=True)
class Verdict:
    """Something the monitor wants opened, updated or resolved as a finding."""

    kind: str
    action: str  # open | resolve
    message: str
    evidence: dict[str, object]
    fix: str | None = None
    severity: str = "warning"


@dataclass
class WatermarkMonitor:
    """Watches one query's global watermark batch by batch.

    Stalled: ``stall_batches`` batches in a row took input but left the watermark where it was.
    Jump: one batch moved it by at least ``jump_min_seconds`` and by ``jump_factor`` times the
    usual advance; every row dropped by watermark afterwards is attributed to the jump until the
    event times catch up with the new watermark (or ``attribute_batches`` batches passed).
    """

    stall_batches: int = 5
    jump_min_seconds: float = 3600.0
    jump_factor: float = 10.0
    attribute_batches: int = 200
    _last: ProgressSnapshot | None = None
    _deltas: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    _stall_since: ProgressSnapshot | None = None
    _stall_batches: int = 0
    _stall_rows: int = 0
    _stall_event_time_max_at: datetime | None = None
    _stalled_open: bool = False
    _jump: dict[str, object] | None = None
    _jump_watermark_at: datetime | None = None
    _jump_batches_left: int = 0

    def observe(self, snap: ProgressSnapshot, *, holding: Sequence[SourceWatermark] = ()) -> list[Verdict]:
        verdicts: list[Verdict] = []
        last, self._last = self._last, snap
        if snap.watermark_at is None:
            return verdicts  # the query has no watermark
        verdicts.extend(self._attribute(snap))
        if last is None or last.watermark_at is None:
            return verdicts
        moved = snap.watermark_at != last.watermark_at
        verdicts.extend(self._stall(snap, last, moved, holding))
        if moved and last.watermark_at != EPOCH and snap.watermark_at > last.watermark_at:
            delta = (snap.watermark_at - last.watermark_at).total_seconds()
            verdicts.extend(self._maybe_jump(snap, last, delta))
            self._deltas.append(delta)
        return verdicts

    # -- stalled ---------------------------------------------------------------------------

    def _stall(
        self,
        snap: ProgressSnapshot,
        last: ProgressSnapshot,
        moved: bool,
        holding: Sequence[SourceWatermark],
    ) -> list[Verdict]:
        if moved:
            self._stall_since, self._stall_batches, self._stall_rows = None, 0, 0
            self._stall_event_time_max_at = None
            if self._stalled_open:
                self._stalled_open = False
                return [
                    Verdict(
                        "watermark_stalled",
                        "resolve",
                        f"the watermark moved again in batch {snap.batch_id}",
                        {"batch_id": snap.batch_id},
                    )
                ]
            return []
        if not snap.input_rows:
            return []
        if self._stall_since is None:
            self._stall_since = last
        self._stall_batches += 1
        self._stall_rows += snap.input_rows
        if snap.event_time_max_at is not None and (
            self._stall_event_time_max_at is None or snap.event_time_max_at > self._stall_event_time_max_at
        ):
            self._stall_event_time_max_at = snap.event_time_max_at
        if self._stall_batches < self.stall_batches:
            return []
        self._stalled_open = True
        since = self._stall_since
        stalled_seconds = (
            (snap.timestamp_at - since.timestamp_at).total_seconds()
            if snap.timestamp_at and since.timestamp_at
            else None
        )
        back = [s for s in holding if s.holding_back]
        evidence: dict[str, object] = {
            "watermark_at": _iso(snap.watermark_at),
            "since_batch_id": since.batch_id,
            "batches": self._stall_batches,
            "input_rows": self._stall_rows,
            "stalled_seconds": stalled_seconds,
            "event_time_max_at": _iso(self._stall_event_time_max_at),
        }
        if back:
            evidence["holding_back"] = [s.source for s in back]
            evidence["holding_back_idle_batches"] = {s.source: s.idle_batches for s in back}
            who = ", ".join(
                f"{s.source} ({'idle for ' + str(s.idle_batches) + ' batches' if s.idle_batches else 'behind'})"
                for s in back
            )
            message = (
                f"the watermark has stayed at {_iso(snap.watermark_at)} for {self._stall_batches} "
                f"batches while {self._stall_rows} rows arrived; it is held back by {who}"
            )
            fix = (
                "an input that stops receiving data holds the global watermark under the default "
                "multipleWatermarkPolicy=min: feed it (or a heartbeat row), drop it from the query, "
                "or set spark.sql.streaming.multipleWatermarkPolicy=max if dropping its late rows "
                "is acceptable"
            )
        else:
            message = (
                f"the watermark has stayed at {_iso(snap.watermark_at)} for {self._stall_batches} "
                f"batches while {self._stall_rows} rows arrived (max event time seen "
                f"{_iso(self._stall_event_time_max_at)}): their event times do not move it forward"
            )
            fix = (
                "check that the withWatermark column carries event time that advances "
                "(not a constant, a parse failure or replayed old data)"
            )
        return [Verdict("watermark_stalled", "open", message, evidence, fix)]

    # -- jump ------------------------------------------------------------------------------

    def _maybe_jump(self, snap: ProgressSnapshot, last: ProgressSnapshot, delta: float) -> list[Verdict]:
        typical = statistics.median(self._deltas) if self._deltas else None
        if delta < self.jump_min_seconds:
            return []
        if typical is not None and delta < self.jump_factor * typical:
            return []
        ahead = (
            (snap.watermark_at - snap.timestamp_at).total_seconds()
            if snap.watermark_at and snap.timestamp_at
            else None
        )
        self._jump_watermark_at = snap.watermark_at
        self._jump_batches_left = self.attribute_batches
        self._jump = {
            "batch_id": snap.batch_id,
            "watermark_before_at": _iso(last.watermark_at),
            "watermark_after_at": _iso(snap.watermark_at),
            "jump_seconds": delta,
            "typical_advance_seconds": typical,
            "ahead_of_batch_time_seconds": ahead,
            # the row that moved it arrived in the previous data batch (watermarks trail a batch)
            "caused_by_event_time_max_at": _iso(last.event_time_max_at or snap.event_time_max_at),
            "caused_by_batch_id": last.batch_id if last.event_time_max_at else snap.batch_id,
            "dropped_after_jump": 0,
            "batches_with_drops": [],
        }
        return [self._jump_verdict("open")]

    def _attribute(self, snap: ProgressSnapshot) -> list[Verdict]:
        if self._jump is None or self._jump_watermark_at is None:
            return []
        if snap.batch_id == self._jump["batch_id"]:
            return []
        dropped = snap.rows_dropped_by_watermark
        if dropped:
            self._jump["dropped_after_jump"] = int(self._jump["dropped_after_jump"]) + dropped  # type: ignore[call-overload]
            batches = self._jump["batches_with_drops"]
            assert isinstance(batches, list)
            if len(batches) < 50:
                batches.append(snap.batch_id)
        self._jump_batches_left -= 1
        caught_up = (
            snap.event_time_max_at is not None and snap.event_time_max_at >= self._jump_watermark_at
        )
        if caught_up or self._jump_batches_left <= 0:
            verdict = self._jump_verdict("resolve")
            self._jump = None
            self._jump_watermark_at = None
            return [verdict]
        return [self._jump_verdict("open")] if dropped else []

    def _jump_verdict(self, action: str) -> Verdict:
        jump = dict(self._jump or {})
        message = (
            f"the watermark jumped {float(jump['jump_seconds']) / 3600:.1f} h ahead in batch "  # type: ignore[arg-type]
            f"{jump['batch_id']} (to {jump['watermark_after_at']}), moved by a row with event time "
            f"{jump['caused_by_event_time_max_at']}; {jump['dropped_after_jump']} rows dropped "
            "as late since then are attributed to it"
        )
        fix = (
            "filter or quarantine future-dated rows before withWatermark (e.g. keep only rows "
            "with ts <= current_timestamp() + INTERVAL 5 MINUTES); rows already dropped can be "
            "recovered with the late-row audit"
        )
        return Verdict("watermark_jump", action, message, jump, fix, severity="critical")


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


# -- report section (rendering-ready summaries from the history file) ----------------------------


def load_watermarks(con: Any, query_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per query: the latest recorded per-operator and per-source watermarks, and the policy.

    Returns ``{query_id: {"batch_id", "policy", "operators": [...], "sources": [...],
    "holding_back": [...]}}`` only for queries with rows; datetimes stay datetimes.
    """
    ids = list(query_ids)
    if not ids or not _has_table(con, "operator_watermarks"):
        return {}
    out: dict[str, dict[str, Any]] = {}
    operators = con.execute(
        """
        SELECT query_id, batch_id, operator_id, operator_name, late_watermark_at, eviction_watermark_at
        FROM operator_watermarks o
        WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
          AND batch_id = (SELECT max(batch_id) FROM operator_watermarks m WHERE m.query_id = o.query_id)
        ORDER BY query_id, operator_id
        """,
        (ids,),
    ).fetchall()
    for query_id, batch_id, op_id, op_name, late, eviction in operators:
        entry = out.setdefault(query_id, _empty_entry())
        entry["operators_batch_id"] = batch_id
        entry["operators"].append(
            {
                "operator_id": op_id,
                "operator_name": op_name,
                "late_watermark_at": _utc(late),
                "eviction_watermark_at": _utc(eviction),
            }
        )
    sources = con.execute(
        """
        SELECT query_id, batch_id, source, event_time_column, delay_seconds, watermark_at,
               event_time_max_at, idle_batches, holding_back, policy
        FROM source_watermarks s
        WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
          AND batch_id = (SELECT max(batch_id) FROM source_watermarks m WHERE m.query_id = s.query_id)
        ORDER BY query_id, source
        """,
        (ids,),
    ).fetchall()
    for query_id, batch_id, source, column, delay, wm, max_at, idle, back, policy in sources:
        entry = out.setdefault(query_id, _empty_entry())
        entry["sources_batch_id"] = batch_id
        entry["policy"] = policy
        entry["sources"].append(
            {
                "source": source,
                "event_time_column": column,
                "delay_seconds": delay,
                "watermark_at": _utc(wm),
                "event_time_max_at": _utc(max_at),
                "idle_batches": idle,
                "holding_back": bool(back),
            }
        )
        if back:
            entry["holding_back"].append(source)
    return out


def render_watermarks(data: Mapping[str, Any]) -> Any:
    """A rich table: each stateful operator's two watermarks, each input's own watermark."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="watermarks per operator and input", title_justify="left", expand=False)
    table.add_column("where")
    table.add_column("watermark (late rows / own)")
    table.add_column("eviction / max event time")
    table.add_column("note")
    for op in data.get("operators", []):
        table.add_row(
            escape(f"operator {op['operator_id']} {op['operator_name'] or ''}".strip()),
            _fmt(op["late_watermark_at"]),
            _fmt(op["eviction_watermark_at"]),
            "",
        )
    for src in data.get("sources", []):
        note = []
        if src["holding_back"]:
            note.append("[red]holding the watermark back[/]")
        if src["idle_batches"]:
            note.append(f"idle {src['idle_batches']} batches")
        table.add_row(
            escape(f"input {src['source']} ({src['event_time_column']}, delay {src['delay_seconds']:g} s)"),
            _fmt(src["watermark_at"]),
            _fmt(src["event_time_max_at"]),
            ", ".join(note),
        )
    if data.get("policy"):
        table.caption = f"multipleWatermarkPolicy = {data['policy']}"
    return table


def watermarks_csv(data: Mapping[str, Any] | None) -> dict[str, Any]:
    data = data or {}
    return {
        "watermark_policy": data.get("policy") or "",
        "watermark_holding_back": ";".join(data.get("holding_back", [])),
        "stateful_operators": len(data.get("operators", [])),
    }


def _empty_entry() -> dict[str, Any]:
    return {"policy": None, "operators": [], "sources": [], "holding_back": []}


def _has_table(con: Any, name: str) -> bool:
    found = con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = ?", [name]
    ).fetchone()
    return bool(found and found[0])


def _utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.astimezone(UTC) if value.tzinfo else value.replace(tzinfo=UTC)


def _fmt(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value is not None else "-"
