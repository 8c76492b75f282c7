"""Exposure: who can reach the endpoint, who can read the history, and what secrets leak into them.

* The endpoint binds to 127.0.0.1 unless told otherwise (``metrics_addr`` or
  ``WMWATCH_METRICS_ADDR``): a Prometheus on another host gets nothing until an operator opens it.
* TLS and basic auth, end to end through ``attach`` with a real query.
* The history file and its write-ahead log are readable by their owner only.
* Credentials in source paths, descriptions and query names never reach DuckDB or /metrics.
* A query named with a quoted secret keeps every batch in the history, and no secret reaches
  /metrics, the log, DuckDB or the audit's Parquet.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import socket
import ssl
import stat
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import duckdb
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import wmwatch
from tests.harness.net import free_port, self_signed_cert
from tests.harness.streams import write_events
from tests.scripts.safety_support import NoQueriesSession, progress_event_json


def _non_loopback_ipv4() -> str:
    """This machine's address on its default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.200", 9))
        address = str(probe.getsockname()[0])
    if address.startswith("127."):
        pytest.fail(
            "this machine has no non-loopback IPv4 address to test the bind address against"
        )
    return address


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_endpoint_is_loopback_only_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WMWATCH_METRICS_ADDR", raising=False)
    outside = _non_loopback_ipv4()
    port = free_port()
    with wmwatch.attach(NoQueriesSession(), db=None, metrics_port=port, listener="stock") as watch:
        assert watch.metrics_server is not None
        assert watch.metrics_server.httpd.server_address[0] == "127.0.0.1"
        assert _reachable("127.0.0.1", port)
        assert not _reachable(outside, port)
    print(f"\n[exposure] default bind 127.0.0.1:{port}: not reachable on {outside}")


def test_bind_address_from_the_environment_and_the_argument(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    outside = _non_loopback_ipv4()
    monkeypatch.setenv("WMWATCH_METRICS_ADDR", "0.0.0.0")
    port = free_port()
    with wmwatch.attach(NoQueriesSession(), db=None, metrics_port=port, listener="stock"):
        assert _reachable(outside, port)
    port = free_port()
    # the argument wins over the environment
    with wmwatch.attach(
        NoQueriesSession(), db=None, metrics_port=port, metrics_addr="127.0.0.1", listener="stock"
    ):
        assert not _reachable(outside, port)
        assert _reachable("127.0.0.1", port)


@pytest.mark.spark
def test_tls_and_basic_auth_end_to_end_through_attach(spark: Any, stream_dir: Path) -> None:
    cert, key = self_signed_cert(stream_dir)
    write_events(stream_dir / "in", [{"ts": "2026-01-01T00:00:01Z", "user": "a"}])
    with wmwatch.attach(
        spark,
        db=None,
        metrics_port=free_port(),
        metrics_certfile=str(cert),
        metrics_keyfile=str(key),
        metrics_basic_auth=("prom", "s3cret"),
    ) as watch:
        url = watch.metrics_url
        assert url is not None and url.startswith("https://127.0.0.1:")
        query = (
            spark.readStream.schema("ts timestamp, user string")
            .json(str(stream_dir / "in"))
            .writeStream.format("noop")
            .queryName("tls_auth_query")
            .option("checkpointLocation", str(stream_dir / "checkpoint"))
            .trigger(availableNow=True)
            .start()
        )
        try:
            query.awaitTermination(60)
        finally:
            query.stop()
        deadline = time.monotonic() + 20
        while watch.latest("tls_auth_query") is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert watch.flush(timeout=20)
        context = ssl.create_default_context(cafile=str(cert))

        def get(auth: tuple[str, str] | None, tls: bool = True) -> bytes:
            request = urllib.request.Request(url if tls else url.replace("https://", "http://"))
            if auth is not None:
                token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
                request.add_header("Authorization", f"Basic {token}")
            with urllib.request.urlopen(
                request, timeout=5, context=context if tls else None
            ) as response:
                body: bytes = response.read()
            return body

        text = get(("prom", "s3cret")).decode()
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert (
            samples[("wmwatch_last_batch_id", (("query", "tls_auth_query"),))]
            == query.lastProgress["batchId"]
        )
        for auth in (None, ("prom", "wrong"), ("other", "s3cret")):
            with pytest.raises(urllib.error.HTTPError) as info:
                get(auth)
            assert info.value.code == 401
        with pytest.raises(OSError):
            get(("prom", "s3cret"), tls=False)  # plain HTTP gets nothing
        with pytest.raises(
            urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"
        ):  # an untrusting client
            urllib.request.urlopen(url, timeout=5, context=ssl.create_default_context())


def test_history_file_and_its_write_ahead_log_are_private(tmp_path: Path) -> None:
    os.umask(0o022)  # the usual umask: DuckDB alone would create 0644 files
    db = tmp_path / "history.duckdb"
    modes: set[tuple[str, int]] = set()
    stop = threading.Event()

    def watch_modes() -> None:
        while not stop.is_set():
            for name in os.listdir(tmp_path):
                with contextlib.suppress(FileNotFoundError):
                    modes.add((name, stat.S_IMODE((tmp_path / name).stat().st_mode)))

    spy = threading.Thread(target=watch_modes)
    spy.start()
    try:
        with wmwatch.attach(
            NoQueriesSession(), db=str(db), metrics_port=None, listener="stock"
        ) as watch:
            watch.store.flush_interval_seconds = 0.01
            for batch in range(3000):
                watch._events.offer("progress", progress_event_json("q", batch))
                if batch % 500 == 0:
                    assert watch.flush(timeout=30)
    finally:
        stop.set()
        spy.join()
    seen = {name for name, _ in modes}
    assert "history.duckdb" in seen and "history.duckdb.wal" in seen, seen
    wider = {
        (name, oct(mode)) for name, mode in modes if name.startswith("history") and mode & 0o077
    }
    assert not wider, f"history files readable by others: {wider}"


SECRET_VALUES = ("hunter2", "tok3nvalue", "SIGVALUE123", "AKIAFAKEKEY", "wJalrFAKESECRET")


@pytest.mark.spark
def test_credentials_in_paths_and_names_are_never_stored_or_exported(
    spark: Any, tmp_path: Path
) -> None:
    # A real local path a careless job could have: secrets in folder names.
    folder = tmp_path / "password=hunter2" / "token=tok3nvalue"
    folder.mkdir(parents=True)
    write_events(folder, [{"ts": "2026-01-01T00:00:01Z", "user": "a"}])
    db = tmp_path / "history.duckdb"
    port = free_port()
    with wmwatch.attach(spark, db=str(db), metrics_port=port) as watch:
        query = (
            spark.readStream.schema("ts timestamp, user string")
            .json(str(folder))
            .withWatermark("ts", "10 seconds")
            .groupBy("user")
            .count()
            .writeStream.outputMode("update")
            .format("noop")
            .queryName("orders sig=SIGVALUE123 s3a://AKIAFAKEKEY:wJalrFAKESECRET@bucket/x")
            .option("checkpointLocation", str(tmp_path / "cp"))
            .trigger(availableNow=True)
            .start()
        )
        try:
            query.awaitTermination(60)
        finally:
            query.stop()
        progress_text = str(query.lastProgress)
        assert "hunter2" in progress_text  # Spark itself reports the path: wmwatch must not
        deadline = time.monotonic() + 20
        while watch.health.copy().received.get("terminated", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert watch.flush(timeout=30)
        assert watch.metrics_url is not None
        with urllib.request.urlopen(watch.metrics_url, timeout=5) as response:
            metrics_text = response.read().decode()
    assert "password=***" in metrics_text  # the source label is there, redacted
    for secret in SECRET_VALUES:
        assert secret not in metrics_text, secret

    leaks: list[str] = []
    with duckdb.connect(str(db), read_only=True) as con:
        columns = con.execute(
            "SELECT table_name, column_name FROM information_schema.columns "
            "WHERE table_schema = 'main' AND data_type IN ('VARCHAR', 'JSON')"
        ).fetchall()
        scanned = 0
        for table, column in columns:
            for (value,) in con.execute(
                f'SELECT "{column}"::VARCHAR FROM "{table}" WHERE "{column}" IS NOT NULL'
            ).fetchall():
                scanned += 1
                leaks += [
                    f"{table}.{column}: {secret}" for secret in SECRET_VALUES if secret in value
                ]
        described = con.execute(
            "SELECT count(*) FROM sources WHERE description LIKE '%password=***%'"
        ).fetchone()
    assert not leaks, leaks
    assert described is not None and described[0] >= 1
    assert db.read_bytes().find(b"hunter2") == -1  # not even in freed pages of the file
    print(
        f"\n[exposure] scanned {scanned} text values in {len(columns)} columns and /metrics: "
        "no secret"
    )


# A name Spark reports as is, with a quoted secret that ends in an escaped quote: masked as
# text inside the progress JSON, it used to break the document and lose every batch's row.
QUOTED_SECRET_NAME = 'orders password="hunter2\\"x"'
LATE_SECRETS = ("hunter2", "tok3nvalue", "SIGVALUE123")


@pytest.mark.spark
def test_a_query_named_with_a_quoted_secret_keeps_every_batch_and_no_secret(
    spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from pyspark.sql import functions as F

    folder = tmp_path / "token=tok3nvalue" / "in"  # in every late row's source_file
    folder.mkdir(parents=True)
    late_path = tmp_path / "late" / "sig=SIGVALUE123"  # in audit_batches' Parquet location
    db = tmp_path / "history.duckdb"
    registry = CollectorRegistry()
    files = [
        [{"ts": "2026-01-01T00:00:01Z", "user": "a"}, {"ts": "2026-01-01T00:00:25Z", "user": "b"}],
        # behind the watermark (15 s): window [0, 10) is closed, Spark drops all three rows
        [{"ts": f"2026-01-01T00:00:0{s}Z", "user": "late"} for s in (3, 5, 7)]
        + [{"ts": "2026-01-01T00:00:40Z", "user": "c"}],
    ]
    caplog.set_level(logging.INFO, logger="wmwatch")
    with wmwatch.attach(spark, db=str(db), metrics_port=free_port(), registry=registry) as watch:
        events = (
            spark.readStream.schema("ts timestamp, user string")
            .json(str(folder))
            .withWatermark("ts", "10 seconds")
        )
        query = (
            events.groupBy(F.window("ts", "10 seconds"))
            .count()
            .writeStream.outputMode("update")
            .format("noop")
            .queryName(QUOTED_SECRET_NAME)
            .option("checkpointLocation", str(tmp_path / "cp"))
            .start()
        )
        try:
            # one row kept in DuckDB, every late row written to Parquet by Spark
            audit = watch.audit(query, events, parquet_path=str(late_path), max_rows_per_batch=1)
            for rows in files:
                write_events(folder, rows)
                query.processAllAvailable()
            assert audit.sync(120), audit.status()
            status = audit.status()
            audit.stop()
        finally:
            query.stop()
        assert query.name == QUOTED_SECRET_NAME  # Spark keeps the secret: wmwatch must not
        deadline = time.monotonic() + 20
        while watch.health.copy().received.get("terminated", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert watch.flush(timeout=30)
        assert watch.metrics_url is not None
        with urllib.request.urlopen(watch.metrics_url, timeout=5) as response:
            metrics_text = response.read().decode()
        json_missing = registry.get_sample_value("wmwatch_store_progress_json_missing_total")
    assert status["late_rows"] == 3, status
    assert json_missing == 0  # the masked documents are whole: nothing left out
    masked_name = 'orders password="***"'
    labels = {
        sample.labels.get("query")
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
    }
    assert masked_name in labels  # the query is there, under its masked name
    scraped = generate_latest(registry).decode()
    for secret in LATE_SECRETS:
        assert secret not in metrics_text and secret not in scraped, secret
        assert secret not in caplog.text, secret

    with duckdb.connect(str(db), read_only=True) as con:
        recorded = [
            int(b)
            for (b,) in con.execute(
                "SELECT batch_id FROM batches WHERE query_id = ? ORDER BY batch_id",
                [str(query.id)],
            ).fetchall()
        ]
        names = con.execute(
            "SELECT DISTINCT query_name FROM batches UNION SELECT DISTINCT query_name FROM "
            "late_rows UNION SELECT DISTINCT query_name FROM queries"
        ).fetchall()
        documents = con.execute("SELECT progress_json::VARCHAR FROM batches").fetchall()
        late_files = con.execute("SELECT DISTINCT source_file FROM late_rows").fetchall()
        locations = con.execute(
            "SELECT overflow_location FROM audit_batches WHERE overflow_location IS NOT NULL"
        ).fetchall()
        leaks = _secrets_in_text_columns(con, LATE_SECRETS)
    # every batch Spark committed, none skipped (idle progress repeats the next batch's id)
    commits = (tmp_path / "cp" / "commits").iterdir()
    committed = sorted(int(p.name) for p in commits if p.name.isdigit())
    assert recorded == committed and len(recorded) >= 2, (recorded, committed)
    assert names == [(masked_name,)]
    assert all(json.loads(d)["name"] == masked_name for (d,) in documents)
    assert late_files and all("/token=***" in f for (f,) in late_files), late_files
    assert locations and all("/sig=***" in loc for (loc,) in locations), locations
    assert not leaks, leaks
    history_bytes = db.read_bytes()
    for secret in LATE_SECRETS:
        assert history_bytes.find(secret.encode()) == -1, secret  # not even in freed pages

    # Spark wrote the Parquet (under the real path): its name and file columns are masked too
    with duckdb.connect() as con:
        parquet = con.execute(
            "SELECT DISTINCT query_name, source_file FROM read_parquet(?)",
            [f"{late_path}/**/*.parquet"],
        ).fetchall()
    assert parquet and all(n == masked_name and "/token=***" in f for n, f in parquet), parquet
    print(
        f"\n[exposure] quoted secret in the name: {len(recorded)} batches recorded, "
        f"{status['late_rows']} late rows audited, no secret in /metrics, logs, DuckDB or Parquet"
    )


def _secrets_in_text_columns(con: Any, secrets: tuple[str, ...]) -> list[str]:
    """``table.column: secret`` for every secret in any text value of the history file."""
    leaks: list[str] = []
    columns = con.execute(
        "SELECT table_name, column_name FROM information_schema.columns "
        "WHERE table_schema = 'main' AND data_type IN ('VARCHAR', 'JSON')"
    ).fetchall()
    for table, column in columns:
        for (value,) in con.execute(
            f'SELECT "{column}"::VARCHAR FROM "{table}" WHERE "{column}" IS NOT NULL'
        ).fetchall():
            leaks += [f"{table}.{column}: {s}" for s in secrets if s in value]
    return leaks
