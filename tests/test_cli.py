"""The real ``wmwatch`` CLI (typer CliRunner, and a subprocess for start-up cost)."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from tests.harness.cli import one_line
from tests.harness.handmade import REPO, progress
from wmwatch._store.schema import LATEST_VERSION
from wmwatch._store.writer import HistoryStore
from wmwatch.cli import app

runner = CliRunner()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "history.duckdb"
    with HistoryStore(path) as store:
        for batch_id in range(4):
            store.record_progress(progress(batch_id, dropped=1))
        store.record_progress(progress(0, query_id="q-2", name="orders"))
    return path


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_table_report_for_people(db: Path) -> None:
    code, out, err = invoke("report", "--db", str(db))
    assert code == 0, err
    assert "clicks" in out and "orders" in out
    assert "watermark lag" in out and "p50 1m 0s" in out
    assert "dropped by watermark" in out and "late groups" in out
    assert "\x1b[" not in out  # no colour codes when stdout is not a terminal


def test_json_and_csv_for_scripts(db: Path) -> None:
    code, out, _ = invoke("report", "--db", str(db), "--format", "json", "--query", "clicks")
    assert code == 0
    doc = json.loads(out)
    assert [q["query"] for q in doc["queries"]] == ["clicks"]
    assert doc["queries"][0]["rows_dropped_by_watermark"] == 4
    code, out, _ = invoke("report", "--db", str(db), "-f", "csv", "--since", "2026-01-01T00:00:20Z")
    assert code == 0
    rows = {r["query"]: r for r in csv.DictReader(io.StringIO(out))}
    assert rows["clicks"]["batches"] == "2" and rows["orders"]["batches"] == "0"
    assert "\x1b[" not in out


def test_unknown_query_lists_the_known_ones(db: Path) -> None:
    code, out, err = invoke("report", "--db", str(db), "--query", "nope")
    assert code == 1 and out == ""
    assert one_line(err) == (
        "wmwatch report: no query named or with id 'nope' in the history; known: clicks, orders"
    )


@pytest.mark.parametrize("since", ["yesterday", "5x", "2026-02-30"])
def test_bad_since_is_a_usage_error(db: Path, since: str) -> None:
    code, out, err = invoke("report", "--db", str(db), "--since", since)
    assert code == 2 and out == ""
    assert "is neither a duration (15m, 2h, 7d) nor an ISO timestamp" in one_line(err)


def test_bad_format_is_a_usage_error(db: Path) -> None:
    code, _, err = invoke("report", "--db", str(db), "--format", "xml")
    assert code == 2
    assert one_line(err) == "wmwatch report: --format 'xml' is not one of table, json, csv, html"


def test_missing_db(tmp_path: Path) -> None:
    code, _, err = invoke("report", "--db", str(tmp_path / "none.duckdb"))
    assert code == 1
    assert "no wmwatch history at" in one_line(err)
    assert not (tmp_path / "none.duckdb").exists()


def test_corrupt_db(tmp_path: Path) -> None:
    path = tmp_path / "broken.duckdb"
    path.write_bytes(b"\x00garbage" * 1000)
    code, _, err = invoke("report", "--db", str(path))
    assert code == 1
    assert "is not a wmwatch/DuckDB database or is damaged: move it aside" in one_line(err)


def test_db_from_a_newer_wmwatch(db: Path) -> None:
    con = duckdb.connect(str(db))
    con.execute("INSERT INTO wmwatch_schema (version) VALUES (?)", (LATEST_VERSION + 7,))
    con.close()
    code, _, err = invoke("report", "--db", str(db))
    assert code == 1
    assert "written by a newer wmwatch" in one_line(err) and "upgrade wmwatch" in err


def test_empty_history_says_so(tmp_path: Path) -> None:
    path = tmp_path / "empty.duckdb"
    HistoryStore(path).close()
    code, out, _ = invoke("report", "--db", str(path))
    assert code == 0 and "no queries recorded yet" in out
    code, out, _ = invoke("report", "--db", str(path), "--format", "json")
    assert code == 0 and json.loads(out)["queries"] == []


def test_help_is_instant_and_imports_nothing_heavy() -> None:
    code = (
        "import sys; from typer.testing import CliRunner; from wmwatch.cli import app; "
        "assert CliRunner().invoke(app, ['--help']).exit_code == 0; "
        "print(sorted(m for m in ('duckdb', 'pyspark', 'grafana_foundation_sdk') "
        "if m in sys.modules))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        check=True,
    )
    assert done.stdout.strip() == "[]"
    code_, out, _ = invoke("--help")
    assert code_ == 0 and "report" in out
    code_, out, _ = invoke("report", "--help")
    assert code_ == 0 and "--since" in out and "--format" in out and "--query" in out
