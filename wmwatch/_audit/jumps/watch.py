"""Who moved the watermark: batches whose event time runs ahead of the clock or whose watermark
jumps, the rows that did it, and what the jump cost.

Spark's watermark is ``max(event time) - delay``: one row dated hours ahead (a producer with a
wrong clock, seconds taken for milliseconds) moves it hours ahead, and every ordinary row after
it is dropped as late. Per audited batch N (on the audit's own thread, after N is audited):

- *ahead*: N's largest event time (its progress' ``eventTime.max``) is more than
  ``ahead_seconds`` after N's own time (progress ``timestamp``): N holds rows dated in the future.
- *jump*: N's watermark (``offsets/N``) is more than ``jump_seconds`` above N-1's: the batch
  before, N-1, read the rows that moved it (a first watermark, set from the epoch, is no jump).

Either way the batch that moved the watermark (N, or N-1) is an *incident*, kept in
``watermark_jumps``: its watermark before (``offsets/b``, what batch b+1 judged late rows with)
and after (``offsets/b+1``), and the top :data:`TOP_ROWS` rows by event time of its input, read
again by the replay with the same ``columns=`` / ``hash_columns=`` rules as late rows, with
their input and, for Kafka, partition and offset (``watermark_jump_rows``). One bounded Spark
job per incident, under the audit's deadline, whether or not the batch had late rows.

*The cost*: the late rows the audit found in the batches after the incident (up to the next
one) that the watermark before it would have kept: those whose late-row time (the window end
for windowed aggregations, else the event time) is after the watermark before the jump and not
after the one it set. Recounted in SQL over ``late_rows`` for the latest incident after each
audited batch, until the batches' time passes the watermark it set (the clock has caught up
with the row: later drops would happen without the jump too), so it is what the history holds
(rows over ``max_rows_per_batch`` are not in it; with ``sink="parquet"`` the cost stays
unknown).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from wmwatch._errors import ConfigError
from wmwatch._text import clean, error_line, get_logger

if TYPE_CHECKING:
    import duckdb

    from wmwatch._audit.replay.engine import Replayer, ReplayInput
    from wmwatch._checkpoint.reader import CheckpointReader
    from wmwatch._core.plugins import HistoryAccess

log = get_logger("wmwatch.audit")

DEFAULT_AHEAD_SECONDS = 600.0
DEFAULT_JUMP_SECONDS = 3600.0
# rows kept per incident: enough to name the culprit and see whether it is alone
TOP_ROWS = 5
# batches whose progress is kept for the check (the audit trails the query by a few at most)
_KEEP_BATCHES = 1_000
# incidents kept in memory for the cost (older ones keep the cost they had)
_KEEP_INCIDENTS = 20
# a timestamp after every real event time: the late-row frame with it filters nothing
_FAR_FUTURE_MS = 253_402_300_799_000  # 9999-12-31T23:59:59Z


@dataclass(frozen=True, slots=True)
class Thresholds:
    """When a batch is flagged: event time ahead of the batch's time, watermark jump."""

    ahead_seconds: float = DEFAULT_AHEAD_SECONDS
    jump_seconds: float = DEFAULT_JUMP_SECONDS

    def __post_init__(self) -> None:
        for name in ("ahead_seconds", "jump_seconds"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"watermark_{name}={value!r}: pass a positive number of seconds.")


@dataclass(frozen=True, slots=True)
class BatchTimes:
    """What progress said about one batch's times (epoch ms) and inputs."""

    batch_at_ms: int | None
    event_time_max_ms: int | None
    descriptions: tuple[str, ...] = ()


def ahead_seconds(times: BatchTimes | None) -> float | None:
    """How far the batch's largest event time runs ahead of the batch's own time."""
    if times is None or times.batch_at_ms is None or times.event_time_max_ms is None:
        return None
    return (times.event_time_max_ms - times.batch_at_ms) / 1000.0


def jump_seconds(watermark_ms: int | None, previous_ms: int | None) -> float | None:
    """How far the watermark moved from the batch before; None before a first watermark (it
    reads as the epoch until set, and being set is no jump)."""
    if watermark_ms is None or previous_ms is None or previous_ms <= 0:
        return None
    return (watermark_ms - previous_ms) / 1000.0


def flags(ahead: float | None, jump: float | None, thresholds: Thresholds) -> tuple[bool, bool]:
    """(event time too far ahead, watermark jumped too far)."""
    return (
        ahead is not None and ahead > thresholds.ahead_seconds,
        jump is not None and jump > thresholds.jump_seconds,
    )


@dataclass(frozen=True, slots=True)
class TopRow:
    """One of the rows with the largest event times of the batch that moved the watermark."""

    rank: int
    event_time_us: int | None
    source_index: int | None
    source_file: str | None
    row_data: str | None
    kafka_topic: str | None = None
    kafka_partition: int | None = None
    kafka_offset: int | None = None


@dataclass(frozen=True, slots=True)
class Incident:
    """A batch that moved the watermark (``batch_id``) and what is known of it."""

    batch_id: int
    run_id: str | None = None
    batch_at_ms: int | None = None
    event_time_max_ms: int | None = None
    ahead_seconds: float | None = None
    watermark_before_ms: int | None = None
    watermark_after_ms: int | None = None
    jump_seconds: float | None = None
    # the batch whose watermark jumped (batch_id + 1), when the jump was seen
    jump_batch_id: int | None = None
    source_index: int | None = None
    source_description: str | None = None
    rows: tuple[TopRow, ...] = ()
    rows_error: str | None = None

    @property
    def reasons(self) -> str:
        said = [
            name
            for name, on in (("ahead", self.ahead_seconds), ("jump", self.jump_batch_id))
            if on is not None
        ]
        return ",".join(said)


def kafka_position(text: str | None) -> tuple[str | None, int | None, int | None]:
    """(topic, partition, offset) from the position the Kafka source attaches to each row."""
    if not text:
        return None, None, None
    try:
        doc = json.loads(text)
        return str(doc["topic"]), int(doc["partition"]), int(doc["offset"])
    except (ValueError, KeyError, TypeError):
        return None, None, None


def top_rows_of(rows: Sequence[tuple[Any, ...]], limit: int = TOP_ROWS) -> tuple[TopRow, ...]:
    """The ``limit`` rows with the largest event times, from ``(event_time_us, source_index,
    source_file, row_data, position)`` tuples, newest first (ties: input order)."""
    ordered = sorted(
        enumerate(rows), key=lambda ir: (-(ir[1][0] if ir[1][0] is not None else -(2**62)), ir[0])
    )
    out = []
    for rank, (_, row) in enumerate(ordered[:limit], start=1):
        topic, partition, offset = kafka_position(row[4])
        out.append(
            TopRow(
                rank=rank,
                event_time_us=row[0],
                source_index=row[1],
                source_file=row[2],
                row_data=row[3],
                kafka_topic=topic,
                kafka_partition=partition,
                kafka_offset=offset,
            )
        )
    return tuple(out)


class JumpWatch:
    """The incidents of one audited query: flagged on the audit's thread, batch by batch.

    :meth:`note` is called from the progress hook (any thread) and only stores a few numbers;
    :meth:`after_batch` runs on the audit's thread after each audited batch.
    """

    def __init__(
        self,
        *,
        thresholds: Thresholds,
        history: JumpHistory | None,
        label: str,
    ) -> None:
        self.thresholds = thresholds
        self.history = history
        self.label = label
        self._lock = threading.Lock()
        self._times: dict[int, BatchTimes] = {}
        self._incidents: dict[int, Incident] = {}
        self._found = 0

    def start(self) -> None:
        """Take up the incidents an earlier audit of the query recorded (for their cost)."""
        if self.history is None:
            return
        for incident in self.history.recent(_KEEP_INCIDENTS):
            self._incidents[incident.batch_id] = incident

    def note(self, batch_id: int, times: BatchTimes) -> None:
        with self._lock:
            self._times[batch_id] = times
            if len(self._times) > _KEEP_BATCHES:
                for old in sorted(self._times)[: _KEEP_BATCHES // 2]:
                    del self._times[old]

    def incidents(self) -> list[Incident]:
        with self._lock:
            return [self._incidents[b] for b in sorted(self._incidents)]

    def status(self) -> dict[str, Any]:
        with self._lock:
            last = self._incidents[max(self._incidents)] if self._incidents else None
            return {
                "watermark_incidents": self._found,
                "last_watermark_incident_batch": last.batch_id if last else None,
            }

    def after_batch(
        self,
        batch_id: int,
        run_id: str | None,
        checkpoint: CheckpointReader,
        read_top: Callable[[int], tuple[tuple[TopRow, ...], int | None]],
    ) -> None:
        """Flag batch ``batch_id`` (replayed, its marker not yet written) and record what moved
        the watermark. Called before the batch's marker is queued, on the same writer, so a kill
        cannot leave a marked batch without its incident (a re-audit replaces the incident).
        Never raises (the batch is audited either way): an error reading the rows leaves the
        incident without them, with why. The cost follows in :meth:`after_recorded`."""
        try:
            self._check(batch_id, run_id, checkpoint, read_top)
        except Exception as exc:  # noqa: BLE001 - logged; the late-row audit goes on
            log.warning(
                "wmwatch: audit of %s: cannot check batch %d for a watermark jump: %s",
                self.label,
                batch_id,
                error_line(exc),
            )

    def _check(
        self,
        batch_id: int,
        run_id: str | None,
        checkpoint: CheckpointReader,
        read_top: Callable[[int], tuple[tuple[TopRow, ...], int | None]],
    ) -> None:
        with self._lock:
            times = self._times.get(batch_id)
        entry = checkpoint.offsets(batch_id)
        previous = checkpoint.offsets(batch_id - 1) if batch_id > 0 else None
        wm_ms = entry.watermark_ms if entry is not None else None
        prev_ms = previous.watermark_ms if previous is not None else None
        if times is not None and times.batch_at_ms is None and entry is not None:
            times = replace(times, batch_at_ms=entry.timestamp_ms)
        ahead = ahead_seconds(times)
        jump = jump_seconds(wm_ms, prev_ms)
        is_ahead, is_jump = flags(ahead, jump, self.thresholds)
        changed: list[Incident] = []
        if is_ahead and times is not None:
            changed.append(
                self._update(
                    batch_id,
                    checkpoint,
                    read_top,
                    run_id=run_id,
                    batch_at_ms=times.batch_at_ms,
                    event_time_max_ms=times.event_time_max_ms,
                    ahead_seconds=ahead,
                )
            )
        if is_jump and batch_id > 0:
            with self._lock:
                setter = self._times.get(batch_id - 1)
            changed.append(
                self._update(
                    batch_id - 1,
                    checkpoint,
                    read_top,
                    run_id=run_id,
                    jump_seconds=jump,
                    jump_batch_id=batch_id,
                    watermark_after_ms=wm_ms,
                    batch_at_ms=setter.batch_at_ms if setter else None,
                    event_time_max_ms=setter.event_time_max_ms if setter else None,
                    ahead_seconds=ahead_seconds(setter),
                )
            )
        with self._lock:
            # the watermark an ahead-only incident set shows in the next batch's offsets
            pending = self._incidents.get(batch_id - 1)
        if pending is not None and pending.watermark_after_ms is None and wm_ms is not None:
            changed.append(self._merge(replace(pending, watermark_after_ms=wm_ms)))
        if self.history is not None:
            for incident in {i.batch_id: i for i in changed}.values():
                self.history.record(incident)

    def after_recorded(self, batch_id: int, checkpoint: CheckpointReader) -> None:
        """Bring the cost of the latest incident before ``batch_id`` up to date, once the batch's
        late rows are written (the recount reads them). Never raises."""
        if self.history is None:
            return
        try:
            with self._lock:
                before = [b for b in self._incidents if b < batch_id]
                latest = self._incidents[max(before)] if before else None
            if latest is None:
                return
            entry = checkpoint.offsets(batch_id)
            batch_at_ms = entry.timestamp_ms if entry is not None else None
            if still_costing(latest, batch_at_ms):
                self.history.update_cost(batch_id)
        except Exception as exc:  # noqa: BLE001 - logged; the late-row audit goes on
            log.warning(
                "wmwatch: audit of %s: cannot count what the watermark jump before batch %d "
                "cost: %s",
                self.label,
                batch_id,
                error_line(exc),
            )

    def _update(
        self,
        batch_id: int,
        checkpoint: CheckpointReader,
        read_top: Callable[[int], tuple[tuple[TopRow, ...], int | None]],
        **values: Any,
    ) -> Incident:
        with self._lock:
            known = self._incidents.get(batch_id)
        incident = known or Incident(batch_id=batch_id)
        fill = {k: v for k, v in values.items() if v is not None}
        incident = replace(incident, **fill)
        if incident.watermark_before_ms is None:
            entry = checkpoint.offsets(batch_id)
            if entry is not None:
                incident = replace(incident, watermark_before_ms=entry.watermark_ms)
        if known is None:
            incident = self._with_rows(incident, read_top)
            log.warning(
                "wmwatch: audit of %s: batch %d moved the watermark (%s): %s",
                self.label,
                batch_id,
                incident.reasons,
                describe(incident),
            )
        return self._merge(incident)

    def _with_rows(
        self,
        incident: Incident,
        read_top: Callable[[int], tuple[tuple[TopRow, ...], int | None]],
    ) -> Incident:
        try:
            rows, source_index = read_top(incident.batch_id)
        except Exception as exc:  # noqa: BLE001 - the incident is kept, without its rows
            log.warning(
                "wmwatch: audit of %s: cannot read the rows of batch %d that moved the "
                "watermark: %s",
                self.label,
                incident.batch_id,
                error_line(exc),
            )
            return replace(incident, rows_error=clean(f"{type(exc).__name__}: {error_line(exc)}"))
        with self._lock:
            times = self._times.get(incident.batch_id)
        description = None
        if (
            source_index is not None
            and times is not None
            and 0 <= source_index < len(times.descriptions)
        ):
            description = times.descriptions[source_index]
        return replace(
            incident, rows=rows, source_index=source_index, source_description=description
        )

    def _merge(self, incident: Incident) -> Incident:
        with self._lock:
            if incident.batch_id not in self._incidents:
                self._found += 1
            self._incidents[incident.batch_id] = incident
            while len(self._incidents) > _KEEP_INCIDENTS:
                del self._incidents[min(self._incidents)]
        return incident


def still_costing(incident: Incident, batch_at_ms: int | None) -> bool:
    """Whether a batch at ``batch_at_ms`` can still lose rows to the incident: until the clock
    passes the watermark it set. After that, rows that late would be late without the jump
    too, and the count (a recount over the incident's batches) stops growing with the history."""
    after = incident.watermark_after_ms
    return after is None or batch_at_ms is None or batch_at_ms <= after


def describe(incident: Incident) -> str:
    """One line for the log: how far the rows ran ahead and where they came from (never their
    data: row payloads belong in the history, where columns= and hash_columns= apply)."""
    parts = []
    if incident.ahead_seconds is not None:
        parts.append(f"event time {incident.ahead_seconds:,.0f}s ahead of the batch's time")
    if incident.jump_seconds is not None:
        parts.append(f"watermark +{incident.jump_seconds:,.0f}s in batch {incident.jump_batch_id}")
    if incident.source_description:
        parts.append(f"input {incident.source_index} ({incident.source_description})")
    if incident.rows and incident.rows[0].kafka_partition is not None:
        top = incident.rows[0]
        parts.append(f"partition {top.kafka_partition} offset {top.kafka_offset}")
    return "; ".join(parts) or "no detail"


def read_top_rows(
    replayer: Replayer, checkpoint: CheckpointReader, batch_id: int, limit: int = TOP_ROWS
) -> tuple[tuple[TopRow, ...], int | None]:
    """The ``limit`` rows of batch ``batch_id`` with the largest event times, over every input
    that read data in it, protected as late rows are; and the input of the first one.

    One top-``limit`` job per input (Spark keeps ``limit`` rows per task, never the batch),
    under the audit's deadline, in its pool, on the calling (audit) thread.
    """
    from pyspark.sql import functions as F

    from wmwatch._audit.replay.sources.base import SOURCE_POSITION_COL
    from wmwatch._core.spark_jobs import bounded_job

    found: list[tuple[Any, ...]] = []
    with bounded_job(
        replayer.spark,
        description=f"wmwatch audit of {replayer.label}: rows that moved the watermark "
        f"in batch {batch_id}",
        timeout_seconds=replayer.job_timeout_seconds,
        pool=replayer.pool,
    ):
        for item in replayer.inputs:
            what = item.source.batch_input(checkpoint, batch_id)
            if what is None:
                continue
            with replayer.checked([(item, what)]):
                found.extend(_top_of_input(replayer, item, what, limit, F, SOURCE_POSITION_COL))
    rows = top_rows_of(found, limit)
    return rows, rows[0].source_index if rows else None


def _top_of_input(
    replayer: Replayer,
    item: ReplayInput,
    what: Any,
    limit: int,
    F: Any,  # noqa: N803 - pyspark.sql.functions, named as PySpark does
    position_col: str,
) -> list[tuple[Any, ...]]:
    raw = replayer._read(item, what)
    frame = replayer.late_rows_frame(item, raw, _FAR_FUTURE_MS, keep=(position_col,))
    # a sliding window repeats each row once per window it falls in: take enough for ``limit``
    # distinct rows, then drop the repeats (bounded: at most 64 copies of each)
    spec = item.spec
    copies = 1
    if spec.window_us and spec.slide_us:
        copies = min(64, -(-spec.window_us // spec.slide_us))
    top = (
        frame.orderBy(F.col("event_time_us").desc_nulls_last())
        .limit(limit * copies)
        .select("event_time_us", "source_index", "source_file", "row_data", position_col)
        .collect()
    )
    rows = [tuple(r) for r in top]
    return distinct_rows(rows)[:limit] if copies > 1 else rows


def distinct_rows(rows: Sequence[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``rows`` without repeats, in order (a row a sliding window expanded into copies)."""
    return list(dict.fromkeys(rows))


# -- the history --------------------------------------------------------------------------------

_INCIDENT_COLUMNS = (
    "query_id, batch_id, run_id, query_name, batch_at, event_time_max_at, ahead_seconds, "
    "watermark_before_at, watermark_after_at, jump_seconds, jump_batch_id, reasons, "
    "source_index, source_description, rows_error, recorded_at"
)
_MS = "(TIMESTAMPTZ '1970-01-01 00:00:00+00' + to_milliseconds(?::BIGINT))"
_US = "(TIMESTAMPTZ '1970-01-01 00:00:00+00' + to_microseconds(?::BIGINT))"

# Rows the jump made late: late rows of the batches after the incident, before the next one,
# whose late-row time the watermark before the jump would have kept and the one it set not.
COST_SQL = """
UPDATE watermark_jumps AS j SET
    rows_dropped_since = (
        SELECT count(*) FROM late_rows l
        WHERE l.query_id = j.query_id
          AND l.batch_id > j.batch_id
          AND l.batch_id <= $2
          AND l.batch_id < coalesce((
              SELECT min(n.batch_id) FROM watermark_jumps n
              WHERE n.query_id = j.query_id AND n.batch_id > j.batch_id), $2 + 1)
          AND coalesce(l.window_end_at, l.event_time_at) > j.watermark_before_at
          AND (j.watermark_after_at IS NULL
               OR coalesce(l.window_end_at, l.event_time_at) <= j.watermark_after_at)),
    counted_through_batch = $2
WHERE j.query_id = $1
  AND j.batch_id = (SELECT max(batch_id) FROM watermark_jumps
                    WHERE query_id = $1 AND batch_id < $2)
  AND j.watermark_before_at IS NOT NULL
  AND NOT EXISTS (
      SELECT 1 FROM audit_batches a
      WHERE a.query_id = j.query_id AND a.batch_id > j.batch_id AND a.batch_id <= $2
        AND a.sink = 'parquet')
"""


class JumpHistory:
    """One query's ``watermark_jumps`` and ``watermark_jump_rows``, through the watch's store."""

    def __init__(
        self, store: HistoryAccess, *, query_id: str, query_name: str | None, label: str
    ) -> None:
        self._store = store
        self.query_id = query_id
        self.query_name = query_name
        self.label = label

    def record(self, incident: Incident) -> None:
        """Queue the write of one incident and its rows (replacing what was recorded of it)."""
        query_id, query_name = self.query_id, self.query_name

        def write(con: duckdb.DuckDBPyConnection) -> None:
            write_incident(con, query_id, query_name, incident)

        self._store.submit(
            write,
            description=f"audit {self.label}: batch {incident.batch_id} moved the watermark",
            payload_bytes=sum(len(r.row_data or "") for r in incident.rows),
        )

    def update_cost(self, through_batch: int) -> None:
        query_id = self.query_id

        def write(con: duckdb.DuckDBPyConnection) -> None:
            con.execute(COST_SQL, [query_id, through_batch])

        self._store.submit(
            write, description=f"audit {self.label}: rows the watermark jumps dropped"
        )

    def recent(self, count: int) -> list[Incident]:
        query_id = self.query_id

        def read(con: duckdb.DuckDBPyConnection) -> list[Incident]:
            return read_incidents(con, query_id, count)

        return list(self._store.read(read, timeout=30))


def write_incident(
    con: duckdb.DuckDBPyConnection, query_id: str, query_name: str | None, incident: Incident
) -> None:
    """Replace the incident's row and rows (one transaction: the store's writer's)."""
    i = incident
    if i.rows:
        # an incident taken up from the history comes without its rows: those stay
        con.execute(
            "DELETE FROM watermark_jump_rows WHERE query_id = ? AND batch_id = ?",
            [query_id, i.batch_id],
        )
    kept = con.execute(
        "SELECT rows_dropped_since, counted_through_batch FROM watermark_jumps "
        "WHERE query_id = ? AND batch_id = ?",
        [query_id, i.batch_id],
    ).fetchone()
    con.execute(
        f"INSERT OR REPLACE INTO watermark_jumps ({_INCIDENT_COLUMNS}, rows_dropped_since, "
        f"counted_through_batch) VALUES (?, ?, ?, ?, {_MS}, {_MS}, ?, {_MS}, {_MS}, ?, ?, ?, ?, "
        "?, ?, now(), ?, ?)",
        [
            query_id,
            i.batch_id,
            i.run_id,
            query_name,
            i.batch_at_ms,
            i.event_time_max_ms,
            i.ahead_seconds,
            i.watermark_before_ms,
            i.watermark_after_ms,
            i.jump_seconds,
            i.jump_batch_id,
            i.reasons,
            i.source_index,
            i.source_description,
            i.rows_error,
            kept[0] if kept else None,
            kept[1] if kept else None,
        ],
    )
    for row in i.rows:
        con.execute(
            "INSERT INTO watermark_jump_rows (query_id, batch_id, row_rank, event_time_at, "
            "source_index, source_file, kafka_topic, kafka_partition, kafka_offset, row_data) "
            f"VALUES (?, ?, ?, {_US}, ?, ?, ?, ?, ?, ?::JSON)",
            [
                query_id,
                i.batch_id,
                row.rank,
                row.event_time_us,
                row.source_index,
                row.source_file,
                row.kafka_topic,
                row.kafka_partition,
                row.kafka_offset,
                row.row_data,
            ],
        )


def read_incidents(con: duckdb.DuckDBPyConnection, query_id: str, count: int) -> list[Incident]:
    """The query's latest ``count`` incidents, as the watch needs them for their cost."""
    rows = con.execute(
        "SELECT batch_id, run_id, epoch_ms(batch_at), epoch_ms(event_time_max_at), "
        "ahead_seconds, epoch_ms(watermark_before_at), epoch_ms(watermark_after_at), "
        "jump_seconds, jump_batch_id, source_index, source_description, rows_error "
        "FROM watermark_jumps WHERE query_id = ? ORDER BY batch_id DESC LIMIT ?",
        [query_id, count],
    ).fetchall()
    return [
        Incident(
            batch_id=int(r[0]),
            run_id=r[1],
            batch_at_ms=r[2],
            event_time_max_ms=r[3],
            ahead_seconds=r[4],
            watermark_before_ms=r[5],
            watermark_after_ms=r[6],
            jump_seconds=r[7],
            jump_batch_id=r[8],
            source_index=r[9],
            source_description=r[10],
            rows_error=r[11],
        )
        for r in reversed(rows)
    ]
