"""The sidecar's session against the production query's: what the checkpoint records, and what
it does not.

Spark records a query's settings that shape its state in each ``offsets/N`` (``conf``: the state
store and its formats, the shuffle partitions, the watermark policy, ...) and sets them again on
a restart. The sidecar runs no stateful operator, so a difference there changes none of its rows:
it is said once, as a warning. What decides the rows a replay gives is not recorded: the session
time zone (``from_json``, ``to_timestamp``, a cast of a string to a timestamp, without a zone),
ANSI mode, the datetime parser policy. Those are checked by their effect instead. A batch that
moved the watermark left the largest event time its watermark node read, less the delay, in
``commits/N`` (``nextBatchWatermarkMs``), exactly; the sidecar reads such a batch again through
the definition's own optimized plan up to that node (filters the optimizer moves below it
included, as Spark runs them), in its own session, and refuses to start when the rows' largest
event time gives another watermark, before it stores any row.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from wmwatch._audit.replay.engine import ReplayInput
from wmwatch._audit.replay.events import EventsAsWritten, as_the_watermark_reads
from wmwatch._audit.replay.sources.base import UnreplayableSource, relation_position
from wmwatch._checkpoint.fs import CheckpointEntryGone
from wmwatch._checkpoint.reader import CheckpointReader, OffsetsEntry
from wmwatch._core.spark_jobs import bounded_job
from wmwatch._errors import AuditError
from wmwatch._text import error_line, get_logger
from wmwatch._time import format_at, from_epoch_ms

log = get_logger("wmwatch.audit")

# Spark's conf key whose "false" makes a batch judge late rows with its own watermark.
ALLOW_MULTIPLE_KEY = "spark.sql.streaming.statefulOperator.allowMultiple"
# settings the checkpoint does not record that change what a replay reads
UNRECORDED = ("spark.sql.session.timeZone", "spark.sql.ansi.enabled")
# batches read again at most to find one whose watermark can be checked
_MAX_TRIES = 3
# commits looked at at most, newest first, for a batch that moved the watermark
_MAX_COMMITS_SCANNED = 200


def check_recorded_conf(reader: CheckpointReader, spark: Any) -> None:
    """Refuse what the in-job audit refuses, read from the production query's own settings
    (the checkpoint's offsets conf) where it records them, else the sidecar's session; say
    which recorded settings the sidecar's session holds otherwise."""
    latest = reader.latest_offsets()
    recorded = latest.conf if latest is not None else {}
    allow = recorded.get(ALLOW_MULTIPLE_KEY) or spark.conf.get(ALLOW_MULTIPLE_KEY, "true")
    if str(allow).lower() == "false":
        raise AuditError(
            f"{ALLOW_MULTIPLE_KEY}=false changes which watermark drops late rows and is not "
            "supported by the audit; leave it at its default (true)."
        )
    differing = conf_differences(recorded, lambda key: spark.conf.get(key, None))
    if differing:
        log.warning(
            "wmwatch: the sidecar's session differs from the settings the production query "
            "recorded in its checkpoint (%s): they shape state, which the sidecar does not "
            "run; the rows it replays do not depend on them",
            "; ".join(differing),
        )


def conf_differences(recorded: dict[str, str], session: Any) -> list[str]:
    """``key (production A, sidecar B)`` for each recorded setting the session holds otherwise
    (a key the session does not know is left out: Spark then takes its default)."""
    found = []
    for key, value in sorted(recorded.items()):
        mine = session(key)
        if mine is not None and str(mine) != value:
            found.append(f"{key} (production {value}, sidecar {mine})")
    return found


def check_event_times(
    spark: Any,
    reader: CheckpointReader,
    inputs: Sequence[ReplayInput],
    *,
    query: Any,
    query_plan: Any,
    timeout_seconds: float,
) -> bool:
    """Whether a batch that moved the watermark, read again in this session through the
    query's own plan up to its watermark node, gives the watermark the production query
    recorded after it; :class:`AuditError` (the sidecar does not start) when it gives another,
    False with a warning when no batch could be checked."""
    found = as_the_watermark_reads(spark, query)
    if found is None:
        return _unchecked("the query has no single watermark over one stream")
    reads, leaf = found
    positions = relation_position(query_plan, leaf)
    item = next((i for i in inputs if i.source.source_index in positions), None)
    if item is None or isinstance(item.source, UnreplayableSource):
        return _unchecked("its watermarked source cannot be read again")
    tries = 0
    for batch_id, after_ms in _moved_the_watermark(reader):
        if tries >= _MAX_TRIES:
            break
        try:
            what = item.source.batch_input(reader, batch_id)
            if what is None:
                continue
            tries += 1
            with bounded_job(
                spark,
                description=f"wmwatch sidecar: event times of batch {batch_id}",
                timeout_seconds=timeout_seconds,
            ):
                largest_ms, delay_ms = largest_event_time_ms(reads, item.source.read(spark, what))
        except (CheckpointEntryGone, AuditError):
            continue  # its input is gone, or cannot be read now: an older batch may do
        except Exception as exc:  # noqa: BLE001 - the check is extra: a failure leaves it undone
            return _unchecked(f"reading batch {batch_id} again failed ({error_line(exc, 200)})")
        if largest_ms is None:
            continue
        if largest_ms - delay_ms != after_ms:
            raise AuditError(_mismatch(spark, batch_id, largest_ms, delay_ms, after_ms))
        log.info(
            "wmwatch: sidecar: batch %d, read again in this session, gives the watermark the "
            "production query recorded after it (%s): event times are read as it read them",
            batch_id,
            format_at(from_epoch_ms(after_ms)),
        )
        return True
    return _unchecked("no batch the checkpoint still holds moved the watermark yet")


def largest_event_time_ms(reads: EventsAsWritten, raw: Any) -> tuple[int | None, int]:
    """The largest event time (ms, as Spark's watermark takes it: microseconds divided by 1000)
    among the rows the query's watermark node reads in a batch's raw rows, and the node's delay
    (ms)."""
    from pyspark.sql import functions as F

    found = reads.watermark_input(raw)
    if found is None:  # as_the_watermark_reads ends at the node: it is there
        raise AuditError("the query's plan lost its watermark node")
    frame, column, delay_ms = found
    (largest,) = frame.select(F.expr(f"max(unix_micros(`{column}`)) div 1000")).first() or (None,)
    return (None if largest is None else int(largest)), delay_ms


def _moved_the_watermark(reader: CheckpointReader) -> Any:
    """``(batch id, watermark after it)`` of the committed batches that moved the watermark,
    newest first (a damaged or purged file passes its batch over)."""
    for batch_id in list(reversed(reader.committed_batches()))[:_MAX_COMMITS_SCANNED]:
        try:
            entry: OffsetsEntry | None = reader.offsets(batch_id)
            after_ms = reader.watermark_after_ms(batch_id)
        except CheckpointEntryGone:
            continue
        if entry is not None and after_ms is not None and after_ms > entry.watermark_ms:
            yield batch_id, after_ms


def _mismatch(spark: Any, batch_id: int, largest_ms: int, delay_ms: int, after_ms: int) -> str:
    settings = ", ".join(f"{key}={spark.conf.get(key, None)}" for key in UNRECORDED)
    return (
        f"batch {batch_id}'s rows, read again in this session through the definition, reach "
        f"event time {format_at(from_epoch_ms(largest_ms))}, which with the "
        f"{delay_ms / 1000:g} s delay gives the watermark "
        f"{format_at(from_epoch_ms(largest_ms - delay_ms))}, but the production query's "
        f"watermark after that batch was {format_at(from_epoch_ms(after_ms))} "
        f"(commits/{batch_id}): this session reads the rows' times otherwise than the "
        "production query did, and would store other late rows. The checkpoint does not record "
        f"the settings that decide it (here {settings}): start the sidecar with the production "
        "query's values (--conf KEY=VALUE), and give it the production query's definition."
    )


def _unchecked(why: str) -> bool:
    log.warning(
        "wmwatch: sidecar: cannot check that this session reads event times as the production "
        "query did (%s); its session time zone and ANSI mode must be the production query's "
        "(docs/sidecar-audit.md)",
        why,
    )
    return False
