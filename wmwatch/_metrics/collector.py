"""The Prometheus collector: turns the query book and wmwatch's health into metric families.

Nothing is computed ahead of a scrape: ``collect`` reads copies of the current state, so the
values are as fresh as the last event the worker handled. Label ``query`` is the query's name,
or its id when it has none; batch and run ids are never labels.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from wmwatch._core.health import HANDLING_BUCKETS_SECONDS, Health
from wmwatch._core.plugins import WatchPlugin
from wmwatch._core.state import QueryBook, QueryState
from wmwatch._text import get_logger, valid_utf8
from wmwatch._time import to_epoch_seconds

if TYPE_CHECKING:  # duckdb loads only with a history store
    from wmwatch._metrics.connections import Connections
    from wmwatch._store.writer import StoreHealth

log = get_logger("wmwatch")

Q = ["query"]
# exported at 0 from the start so rate() and alerts have a series before the first error
_KNOWN_ERROR_STAGES = tuple(
    f"{stage}:{kind}"
    for stage in ("receive", "parse", "handle")
    for kind in ("started", "progress", "idle", "terminated")
)
OP = ["query", "operator", "operator_name"]


def _gauge(name: str, doc: str, labels: Sequence[str] = Q, unit: str = "") -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels), unit=unit)


def _counter(name: str, doc: str, labels: Sequence[str] = Q) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))


class WatchCollector(Collector):
    """Collects every wmwatch metric; register one per watch."""

    def __init__(
        self,
        book: QueryBook,
        health: Health,
        *,
        queue_size: Callable[[], int],
        queue_capacity: int,
        store_health: Callable[[], StoreHealth] | None = None,
        plugins: Callable[[], Iterable[WatchPlugin]] = tuple,
        endpoint_connections: Callable[[], Connections | None] = lambda: None,
    ) -> None:
        self._book = book
        self._endpoint_connections = endpoint_connections
        self._health = health
        self._queue_size = queue_size
        self._queue_capacity = queue_capacity
        self._store_health = store_health
        self._plugins = plugins

    def describe(self) -> list[Metric]:
        # Returning nothing keeps registration from calling collect() eagerly.
        return []

    def collect(self) -> Iterator[Metric]:
        # One family per name and one sample per label set, whatever the plugins yield: the
        # exposition format rejects the whole scrape on a second HELP line or a repeated series.
        families: dict[str, Metric] = {}
        seen: dict[str, set[tuple[str, tuple[tuple[str, str], ...]]]] = {}
        for family in self._collect():
            first = families.setdefault(family.name, family)
            keys = seen.setdefault(family.name, set())
            merged = []
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key in keys:
                    self._health.error("collect:duplicate")
                    continue
                keys.add(key)
                merged.append(sample)
            if first is family:
                family.samples[:] = merged
            else:
                first.samples.extend(merged)
        yield from families.values()

    def _collect(self) -> Iterator[Metric]:
        yield from self._query_metrics(self._book.snapshot())
        yield from self._health_metrics()
        for plugin in list(self._plugins()):
            try:
                # a plugin's labels come from its own sources, not from the parsed events
                yield from [_utf8_labels(family) for family in plugin.collect()]
            except Exception:  # a broken plugin must not break the scrape
                self._health.error(f"collect:{plugin.name}")
                log.exception("wmwatch: plugin %s failed to collect metrics", plugin.name)

    def _query_metrics(self, states: list[QueryState]) -> Iterator[Metric]:
        info = _gauge(
            "wmwatch_query_info",
            "Watched query (value 1), with its id and trigger (processing_time, real_time, "
            "available_now, once, continuous, unknown).",
            ["query", "query_id", "trigger"],
        )
        up = _gauge("wmwatch_query_up", "1 while the query runs, 0 after it stopped.")
        failed = _gauge(
            "wmwatch_query_failed", "1 if the query's last run ended with an exception."
        )
        watermark = _gauge("wmwatch_watermark_seconds", "Event-time watermark (Unix seconds).")
        ev_max = _gauge(
            "wmwatch_event_time_max_seconds", "Max event time in the last batch (Unix seconds)."
        )
        ev_min = _gauge(
            "wmwatch_event_time_min_seconds", "Min event time in the last batch (Unix seconds)."
        )
        ev_avg = _gauge(
            "wmwatch_event_time_avg_seconds", "Avg event time in the last batch (Unix seconds)."
        )
        lag = _gauge("wmwatch_watermark_lag_seconds", "Batch time minus watermark.")
        delay = _gauge("wmwatch_event_time_delay_seconds", "Max event time minus watermark.")
        ahead = _gauge(
            "wmwatch_event_time_ahead_seconds",
            "Largest event time seen minus the last batch's time: above 0, the watermark stands "
            "on rows dated ahead of the clock.",
        )
        spread = _gauge(
            "wmwatch_event_time_spread_seconds", "Max minus min event time in the last batch."
        )
        input_total = _counter("wmwatch_input_rows", "Input rows read, over all batches seen.")
        batch_rows = _gauge("wmwatch_batch_input_rows", "Input rows of the last batch.")
        in_rate = _gauge("wmwatch_input_rows_per_second", "Input rate of the last batch.")
        proc_rate = _gauge(
            "wmwatch_processed_rows_per_second", "Processing rate of the last batch."
        )
        duration = _gauge("wmwatch_batch_duration_seconds", "Wall time of the last batch.")
        phases = _gauge(
            "wmwatch_batch_phase_duration_seconds",
            "Time of each phase of the last batch (addBatch, getBatch, queryPlanning, ...).",
            ["query", "phase"],
        )
        batches = _counter("wmwatch_batches", "Batches seen (no-data batches included).")
        missed = _counter(
            "wmwatch_progress_events_missed",
            "Batches whose progress event never reached wmwatch (Spark's listener bus dropped it).",
        )
        batch_id = _gauge("wmwatch_last_batch_id", "Id of the last batch seen.")
        last_progress = _gauge(
            "wmwatch_last_progress_timestamp_seconds",
            "When the last progress arrived (Unix seconds).",
        )
        last_event = _gauge(
            "wmwatch_last_event_timestamp_seconds",
            "When the query last reported anything, progress or idle (Unix seconds).",
        )
        dropped = _counter(
            "wmwatch_rows_dropped_by_watermark",
            "Rows dropped by watermark per stateful operator (late groups, for aggregations).",
            OP,
        )
        state_rows = _gauge("wmwatch_state_rows", "Rows in the operator's state store.", OP)
        state_updated = _gauge(
            "wmwatch_state_rows_updated", "State rows updated in the last batch.", OP
        )
        state_removed = _counter("wmwatch_state_rows_removed", "State rows removed (evicted).", OP)
        state_mem = _gauge(
            "wmwatch_state_memory_bytes", "Memory used by the operator's state store.", OP
        )
        src_rows = _counter(
            "wmwatch_source_input_rows",
            "Input rows per source.",
            ["query", "source", "description"],
        )
        kafka = ["query", "source", "topic", "partition"]
        kafka_offset = _gauge(
            "wmwatch_kafka_partition_end_offset",
            "Offset a Kafka input's last batch read up to, per topic partition.",
            kafka,
        )
        kafka_behind = _gauge(
            "wmwatch_kafka_partition_offsets_behind_latest",
            "Records of a Kafka topic partition the query has not read yet (the latest offset "
            "Spark saw minus the last batch's end).",
            kafka,
        )

        for state in states:
            q = state.label
            info.add_metric([q, state.query_id, state.trigger.mode], 1)
            up.add_metric([q], 1 if state.status == "active" else 0)
            failed.add_metric([q], 1 if state.status == "failed" else 0)
            batches.add_metric([q], state.batches_total)
            missed.add_metric([q], state.missed_batches_total)
            input_total.add_metric([q], state.input_rows_total)
            if state.last_progress_wall_seconds is not None:
                last_progress.add_metric([q], state.last_progress_wall_seconds)
            heard = [
                t for t in (state.last_progress_wall_seconds, state.last_idle_wall_seconds) if t
            ]
            if heard:
                last_event.add_metric([q], max(heard))
            for (op_id, op_name), value in state.dropped_total.items():
                dropped.add_metric([q, str(op_id), op_name], value)
            for (op_id, op_name), value in state.removed_total.items():
                state_removed.add_metric([q, str(op_id), op_name], value)
            snap = state.latest
            if snap is None:
                continue
            batch_id.add_metric([q], snap.batch_id)
            watermark_at = snap.watermark_at if snap.has_watermark else None
            if watermark_at is not None:
                watermark.add_metric([q], watermark_at.timestamp())
            # event-time stats stay at the last batch that had data, so no-data batches
            # do not make the series flicker
            data = state.latest_with_data
            delay_seconds = None
            if data is not None and watermark_at is not None and data.event_time_max_at is not None:
                delay_seconds = (data.event_time_max_at - watermark_at).total_seconds()
            values: tuple[tuple[GaugeMetricFamily, float | int | None], ...] = (
                (ev_max, to_epoch_seconds(data.event_time_max_at) if data else None),
                (ev_min, to_epoch_seconds(data.event_time_min_at) if data else None),
                (ev_avg, to_epoch_seconds(data.event_time_avg_at) if data else None),
                (lag, snap.watermark_lag_seconds),
                (delay, delay_seconds),
                (ahead, state.event_time_ahead_seconds),
                (spread, data.event_time_spread_seconds if data else None),
                (batch_rows, snap.input_rows),
                (in_rate, snap.input_rows_per_second),
                (proc_rate, snap.processed_rows_per_second),
                (duration, snap.batch_duration_seconds),
            )
            for family, reading in values:
                if reading is not None:
                    family.add_metric([q], float(reading))
            for phase, seconds in sorted(snap.durations_seconds.items()):
                phases.add_metric([q, phase], seconds)
            for op in snap.operators:
                labels = [q, str(op.operator_id), op.name]
                if op.rows_total is not None:
                    state_rows.add_metric(labels, op.rows_total)
                if op.rows_updated is not None:
                    state_updated.add_metric(labels, op.rows_updated)
                if op.memory_used_bytes is not None:
                    state_mem.add_metric(labels, op.memory_used_bytes)
            for source in snap.sources:
                src_rows.add_metric(
                    [q, str(source.index), source.description[:200]],
                    state.source_rows_total.get(source.index, 0),
                )
                for part in source.kafka_partitions:
                    labels = [q, str(source.index), part.topic, str(part.partition)]
                    kafka_offset.add_metric(labels, part.end_offset)
                    if part.offsets_behind_latest is not None:
                        kafka_behind.add_metric(labels, part.offsets_behind_latest)
        yield from (
            info, up, failed, watermark, ev_max, ev_min, ev_avg, lag, delay, ahead, spread,
            input_total,
            batch_rows, in_rate, proc_rate, duration, phases, batches, missed, batch_id,
            last_progress, last_event, dropped, state_rows, state_updated, state_removed,
            state_mem, src_rows, kafka_offset, kafka_behind,
        )  # fmt: skip

    def _health_metrics(self) -> Iterator[Metric]:
        h = self._health.copy()
        received = _counter(
            "wmwatch_events_received", "Listener events received, by kind.", ["kind"]
        )
        dropped = _counter(
            "wmwatch_events_dropped",
            "Events dropped because the queue was full, by kind.",
            ["kind"],
        )
        processed = _counter(
            "wmwatch_events_processed", "Events handled by the worker, by kind.", ["kind"]
        )
        errors = _counter(
            "wmwatch_listener_errors",
            "Errors while receiving or handling events, by stage.",
            ["stage"],
        )
        for kind in ("started", "progress", "idle", "terminated"):
            received.add_metric([kind], h.received.get(kind, 0))
            dropped.add_metric([kind], h.dropped.get(kind, 0))
            processed.add_metric([kind], h.processed.get(kind, 0))
        stages = dict.fromkeys(_KNOWN_ERROR_STAGES, 0)
        stages.update(h.errors)
        for stage, value in sorted(stages.items()):
            errors.add_metric([stage], value)
        yield from (received, dropped, processed, errors)

        queue_size = _gauge("wmwatch_event_queue_size", "Events waiting for the worker.", [])
        queue_size.add_metric([], self._queue_size())
        yield queue_size
        queue_cap = _gauge("wmwatch_event_queue_capacity", "Capacity of the event queue.", [])
        queue_cap.add_metric([], self._queue_capacity)
        yield queue_cap

        buckets: list[tuple[str, float]] = [
            (str(bound), count)
            for bound, count in zip(HANDLING_BUCKETS_SECONDS, h.handling_buckets, strict=True)
        ]
        buckets.append(("+Inf", h.handling_count))
        handling = HistogramMetricFamily(
            "wmwatch_event_handling_seconds", "Worker time per event.", labels=[]
        )
        handling.add_metric([], buckets, sum_value=h.handling_sum_seconds)
        yield handling

        mode = GaugeMetricFamily(
            "wmwatch_listener_mode",
            "How events are received (py4j proxy or stock listener).",
            labels=["mode"],
        )
        mode.add_metric([h.listener_mode], 1)
        yield mode
        server = _gauge(
            "wmwatch_metrics_server_up", "1 when the HTTP endpoint is being served.", []
        )
        server.add_metric([], 1 if h.metrics_server_up else 0)
        yield server
        connections = self._endpoint_connections()
        if connections is not None:
            closed = _counter(
                "wmwatch_metrics_connections_closed",
                "Connections the endpoint closed: no place free (refused), to make room for a "
                "newer one (evicted), too slow (timed_out).",
                ["reason"],
            )
            for reason, total in connections.closed_totals().items():
                closed.add_metric([reason], total)
            yield closed
        if h.spark_listener_bus_readable:
            bus_dropped = _counter(
                "wmwatch_spark_listener_events_dropped",
                "Events Spark's listener bus dropped from its 'streams' queue "
                "(seen by no listener).",
                [],
            )
            bus_dropped.add_metric([], h.spark_listener_bus_dropped)
            yield bus_dropped

        if self._store_health is not None:
            store = self._store_health()
            store_up = _gauge("wmwatch_store_up", "1 when the last write to DuckDB succeeded.", [])
            store_up.add_metric([], 1 if store.up else 0)
            pending = _gauge("wmwatch_store_pending_writes", "Writes waiting for DuckDB.", [])
            pending.add_metric([], store.pending_writes)
            pending_bytes = _gauge(
                "wmwatch_store_pending_bytes",
                "Estimated memory held by the writes waiting for DuckDB.",
                [],
            )
            pending_bytes.add_metric([], store.pending_bytes)
            written = _counter("wmwatch_store_writes", "Writes committed to DuckDB.", [])
            written.add_metric([], store.written_total)
            store_errors = _counter(
                "wmwatch_store_errors", "Failed attempts to write to DuckDB.", []
            )
            store_errors.add_metric([], store.errors_total)
            store_dropped = _counter(
                "wmwatch_store_dropped_writes",
                "Writes given up because too many (or too many bytes) were pending.",
                [],
            )
            store_dropped.add_metric([], store.dropped_total)
            json_missing = _counter(
                "wmwatch_store_progress_json_missing",
                "Batches recorded without their progress JSON (it could not be kept safely).",
                [],
            )
            json_missing.add_metric([], store.progress_json_missing_total)
            yield from (
                store_up,
                pending,
                pending_bytes,
                written,
                store_errors,
                store_dropped,
                json_missing,
            )


def _utf8_labels(family: Metric) -> Metric:
    """Replace lone surrogates in a plugin's label values (valid in Python str, not in UTF-8).

    prometheus-client encodes the whole exposition at once, so one such label value would turn
    every scrape into an HTTP 500.
    """
    for index, sample in enumerate(family.samples):
        if any(valid_utf8(value) is not value for value in sample.labels.values()):
            labels = {key: valid_utf8(value) for key, value in sample.labels.items()}
            family.samples[index] = sample._replace(labels=labels)
    return family
