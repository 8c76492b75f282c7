"""One span per micro-batch, its phases (the progress' ``durationMs``) as child spans.

The batch span starts at the batch's trigger time (the progress ``timestamp``) and lasts its
``triggerExecution``. Spark reports how long each phase took, not when it started: the children
are laid end to end in the order Spark runs them (offsets, the offset log, planning, the batch,
the commit), so their lengths are Spark's and their positions a reconstruction.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider

from wmwatch._progress import ProgressSnapshot
from wmwatch._time import to_epoch_seconds

# The order MicroBatchExecution runs its timed phases in; phases Spark adds later go after these.
PHASE_ORDER = (
    "latestOffset",
    "getOffset",
    "walCommit",
    "getBatch",
    "setOffsetRange",
    "queryPlanning",
    "addBatch",
    "commitOffsets",
)
BATCH_SPAN = "spark.streaming.batch"
TOTAL_PHASE = "triggerExecution"


class _Handover(SpanProcessor):
    """Hands each ended span to ``take`` (the exporter's bounded buffer)."""

    def __init__(self, take: Callable[[ReadableSpan], None]) -> None:
        self._take = take

    def on_end(self, span: ReadableSpan) -> None:
        self._take(span)


class BatchSpans:
    """Makes a batch's spans with the SDK's tracer (never the global one) and hands them over."""

    def __init__(self, resource: Resource, take: Callable[[ReadableSpan], None]) -> None:
        # no exit hook: the watch's close ends the provider
        self._provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        self._provider.add_span_processor(_Handover(take))
        self._tracer = self._provider.get_tracer("wmwatch")

    def record(self, snapshot: ProgressSnapshot) -> int:
        """Make the spans of one batch; returns how many (0 when the progress has no time)."""
        started = to_epoch_seconds(snapshot.timestamp_at)
        if started is None:
            return 0
        phases = dict(snapshot.durations_seconds)
        total = phases.pop(TOTAL_PHASE, None)
        if total is None:
            total = snapshot.batch_duration_seconds or sum(phases.values())
        start_ns = _ns(started)
        attributes: dict[str, str | int | float] = {
            "spark.streaming.query.name": snapshot.label,
            "spark.streaming.query.id": snapshot.query_id,
            "spark.streaming.query.run_id": snapshot.run_id,
            "spark.streaming.batch.id": snapshot.batch_id,
            "spark.streaming.batch.input.rows": snapshot.input_rows or 0,
        }
        if snapshot.has_watermark and snapshot.watermark_at is not None:
            attributes["spark.streaming.watermark"] = snapshot.watermark_at.timestamp()
        batch = self._tracer.start_span(
            BATCH_SPAN, start_time=start_ns, attributes=attributes, record_exception=False
        )
        context = trace.set_span_in_context(batch)
        offset_ns = start_ns
        count = 1
        for phase in ordered_phases(phases):
            length_ns = _ns(phases[phase])
            child = self._tracer.start_span(
                phase,
                context=context,
                start_time=offset_ns,
                attributes={"spark.streaming.batch.phase": phase},
            )
            offset_ns += length_ns
            child.end(end_time=offset_ns)
            count += 1
        batch.end(end_time=start_ns + _ns(total))
        return count

    def close(self) -> None:
        self._provider.shutdown()


def _ns(seconds: float) -> int:
    # progress times are whole milliseconds: rounded there, float seconds give them back exactly
    return round(seconds * 1000) * 1_000_000


def ordered_phases(phases: Sequence[str] | dict[str, float]) -> list[str]:
    """The phases in the order Spark runs them; unknown ones after, by name."""
    known = [p for p in PHASE_ORDER if p in phases]
    return known + sorted(p for p in phases if p not in PHASE_ORDER)
