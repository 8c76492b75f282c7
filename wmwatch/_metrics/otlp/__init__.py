"""OTLP export: every wmwatch metric, read from the same collector as /metrics, pushed to an
OpenTelemetry Collector over HTTP or gRPC; optionally one span per micro-batch.

``names`` holds the one mapping between Prometheus and OpenTelemetry names (it imports nothing of
OpenTelemetry); ``convert`` turns collected families into OTLP data, ``spans`` makes a batch's
spans, ``exporter`` owns the thread that sends them. Only ``exporter`` and what it imports load
the OpenTelemetry SDK, and only a watch made with ``otlp_endpoint`` imports it.
"""
