"""Query book and collector without a JVM: counters, retries, gaps, forgetting stopped queries."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from wmwatch._core.health import Health
from wmwatch._core.plugins import WatchPlugin
from wmwatch._core.state import QueryBook
from wmwatch._events import parse_started, parse_terminated
from wmwatch._metrics.collector import WatchCollector
from wmwatch._progress import parse_progress


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def progress(
    batch: int,
    *,
    run: str = "r1",
    rows: int = 10,
    dropped: int = 1,
    wm: str = "2026-01-01T00:00:10.000Z",
) -> Any:
    return parse_progress(
        {
            "id": "q1",
            "runId": run,
            "name": "orders",
            "batchId": batch,
            "timestamp": "2026-01-01T00:01:00.000Z",
            "numInputRows": rows,
            "eventTime": {"watermark": wm, "max": "2026-01-01T00:00:30.000Z"},
            "stateOperators": [
                {
                    "operatorName": "stateStoreSave",
                    "numRowsTotal": 5,
                    "numRowsDroppedByWatermark": dropped,
                    "numRowsRemoved": 2,
                }
            ],
        }
    )


def make(clock: Clock) -> tuple[QueryBook, CollectorRegistry]:
    book = QueryBook(forget_after_seconds=60, monotonic=clock)
    registry = CollectorRegistry()
    registry.register(WatchCollector(book, Health(), queue_size=lambda: 0, queue_capacity=10))
    return book, registry


def test_counters_accumulate_and_a_retried_batch_is_not_counted_twice() -> None:
    book, registry = make(Clock())
    book.on_started(parse_started({"id": "q1", "runId": "r1", "name": "orders"}))
    for batch in (0, 1, 1, 2):
        book.on_progress(progress(batch))
    labels = {"query": "orders", "operator": "0", "operator_name": "stateStoreSave"}
    assert registry.get_sample_value("wmwatch_rows_dropped_by_watermark_total", labels) == 3
    assert registry.get_sample_value("wmwatch_state_rows_removed_total", labels) == 6
    assert registry.get_sample_value("wmwatch_input_rows_total", {"query": "orders"}) == 30
    assert registry.get_sample_value("wmwatch_batches_total", {"query": "orders"}) == 3


def test_late_watermark_is_the_previous_batch_watermark() -> None:
    book, _ = make(Clock())
    assert book.on_progress(progress(0, wm="1970-01-01T00:00:00.000Z")) is None
    book.on_progress(progress(1, wm="2026-01-01T00:00:10.000Z"))
    late = book.on_progress(progress(2, wm="2026-01-01T00:00:20.000Z"))
    assert late is not None and late.isoformat() == "2026-01-01T00:00:10+00:00"


def test_missing_progress_events_are_counted() -> None:
    book, registry = make(Clock())
    book.on_progress(progress(0))
    book.on_progress(progress(4))
    assert (
        registry.get_sample_value("wmwatch_progress_events_missed_total", {"query": "orders"}) == 3
    )
    book.on_progress(progress(5, run="r2"))  # a new run may start anywhere: not a gap
    assert (
        registry.get_sample_value("wmwatch_progress_events_missed_total", {"query": "orders"}) == 3
    )


def test_stopped_queries_are_kept_for_a_while_then_forgotten() -> None:
    clock = Clock()
    book, registry = make(clock)
    book.on_started(parse_started({"id": "q1", "runId": "r1", "name": "orders"}))
    book.on_progress(progress(0))
    book.on_terminated(parse_terminated({"id": "q1", "runId": "r1", "exception": "java.lang.OOM"}))
    assert registry.get_sample_value("wmwatch_query_up", {"query": "orders"}) == 0
    assert registry.get_sample_value("wmwatch_query_failed", {"query": "orders"}) == 1
    clock.now += 61
    assert registry.get_sample_value("wmwatch_query_up", {"query": "orders"}) is None
    assert "orders" not in generate_latest(registry).decode()


def test_restart_clears_failure_and_continues_counters() -> None:
    book, registry = make(Clock())
    book.on_progress(progress(0))
    book.on_terminated(parse_terminated({"id": "q1", "runId": "r1", "exception": "boom"}))
    book.on_started(parse_started({"id": "q1", "runId": "r2", "name": "orders"}))
    book.on_progress(progress(1, run="r2"))
    assert registry.get_sample_value("wmwatch_query_failed", {"query": "orders"}) == 0
    assert registry.get_sample_value("wmwatch_input_rows_total", {"query": "orders"}) == 20


def test_hostile_query_names_do_not_break_the_exposition() -> None:
    book, registry = make(Clock())
    name = 'evil"\n} wmwatch_fake 1\\' + "x" * 1000
    book.on_progress(parse_progress({"id": "q9", "runId": "r", "batchId": 0, "name": name}))
    text = generate_latest(registry).decode()
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert "wmwatch_fake" not in families
    (sample,) = families["wmwatch_query_up"].samples
    assert sample.labels["query"].startswith('evil"\n} wmwatch_fake')
    assert len(sample.labels["query"]) == 200


def test_names_that_are_not_valid_utf8_still_give_a_valid_exposition() -> None:
    # Lone surrogates are legal in JSON escapes and Python strings, not in UTF-8; the parse
    # makes query, operator and source names valid, so the whole scrape still encodes.
    book, registry = make(Clock())
    doc = (
        '{"id": "q8", "runId": "r", "batchId": 0, "name": "bad\\ud800name",'
        ' "stateOperators": [{"operatorName": "op\\udfff", "numRowsTotal": 1}],'
        ' "sources": [{"description": "src\\ud800", "numInputRows": 1}]}'
    )
    book.on_progress(parse_progress(doc))
    text = generate_latest(registry).decode("utf-8")
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(text)}
    (sample,) = families["wmwatch_query_up"].samples
    assert sample.labels["query"].startswith("bad") and sample.labels["query"].endswith("name")


def test_a_plugin_label_that_is_not_valid_utf8_does_not_break_the_scrape() -> None:
    class Plugin(WatchPlugin):
        name = "odd"

        def collect(self) -> list[Metric]:
            family = GaugeMetricFamily("wmwatch_test_odd", "A plugin gauge.", labels=["what"])
            family.add_metric(["odd\ud800"], 1)
            return [family]

    registry = CollectorRegistry()
    registry.register(
        WatchCollector(
            QueryBook(),
            Health(),
            queue_size=lambda: 0,
            queue_capacity=10,
            plugins=lambda: [Plugin()],
        )
    )
    text = generate_latest(registry).decode("utf-8")
    assert 'wmwatch_test_odd{what="odd' in text


def test_event_time_ahead_stays_on_the_largest_event_time_seen() -> None:
    """One row 6 h ahead: the gauge reads 6 h minus the time since, through the ordinary
    batches after it and a restart (the watermark stays moved as long), not the last batch's."""

    def at(batch: int, run: str, batch_at: str, max_at: str | None) -> Any:
        times = {"watermark": "2026-01-01T00:00:00.000Z", **({"max": max_at} if max_at else {})}
        doc: dict[str, Any] = {
            "id": "q1", "runId": run, "name": "orders", "batchId": batch, "timestamp": batch_at,
            "numInputRows": 1 if max_at else 0, "eventTime": times,
        }  # fmt: skip
        return parse_progress(doc)

    book, registry = make(Clock())
    label = {"query": "orders"}
    book.on_progress(at(0, "r1", "2026-01-01T00:01:00.000Z", "2026-01-01T00:00:30.000Z"))
    assert registry.get_sample_value("wmwatch_event_time_ahead_seconds", label) == -30
    book.on_progress(at(1, "r1", "2026-01-01T00:02:00.000Z", "2026-01-01T06:02:00.000Z"))
    assert registry.get_sample_value("wmwatch_event_time_ahead_seconds", label) == 6 * 3600
    book.on_progress(at(2, "r1", "2026-01-01T00:03:00.000Z", "2026-01-01T00:02:50.000Z"))
    book.on_progress(at(3, "r1", "2026-01-01T00:04:00.000Z", None))  # no-data batch
    book.on_started(parse_started({"id": "q1", "runId": "r2", "name": "orders"}))
    book.on_progress(at(4, "r2", "2026-01-01T00:05:00.000Z", "2026-01-01T00:04:50.000Z"))
    assert registry.get_sample_value("wmwatch_event_time_ahead_seconds", label) == 6 * 3600 - 180
