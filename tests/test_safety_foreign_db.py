"""A DuckDB file of another application is never adopted as a history: whatever schema its
tables live in, the store and every command that writes a history refuse it in one line and
leave it byte for byte as it was (no wmwatch table added, no log or lock left beside it)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import duckdb
import pytest
from typer.testing import CliRunner

from tests.harness.cli import one_line
from wmwatch._errors import StoreError
from wmwatch._store.writer import HistoryStore
from wmwatch.cli import app

# each: the statements that make another application's database
FOREIGN = {
    "tables in main": ["CREATE TABLE orders (id INTEGER, amount DECIMAL(10, 2))"],
    "tables in another schema": [
        "CREATE SCHEMA app",
        "CREATE TABLE app.orders (id INTEGER, amount DECIMAL(10, 2))",
        "INSERT INTO app.orders VALUES (1, 9.99)",
    ],
    "a view in another schema": [
        "CREATE SCHEMA reporting",
        "CREATE VIEW reporting.totals AS SELECT 42 AS total",
    ],
    "an empty schema": ["CREATE SCHEMA staging"],
}


def _foreign(path: Path, statements: list[str]) -> str:
    with duckdb.connect(str(path)) as con:
        for statement in statements:
            con.execute(statement)
    path.chmod(0o600)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def _checkpoint(root: Path) -> Path:
    """A checkpoint of one committed batch of a file stream."""
    (root / "offsets").mkdir(parents=True)
    (root / "commits").mkdir()
    (root / "metadata").write_text(json.dumps({"id": "8108f535-4e0a-404f-807f-886cb667e31c"}))
    meta = {"batchWatermarkMs": 0, "batchTimestampMs": 1_700_000_000_000, "conf": {}}
    (root / "offsets" / "0").write_text(f'v1\n{json.dumps(meta)}\n{{"logOffset":0}}')
    (root / "commits" / "0").write_text('v1\n{"nextBatchWatermarkMs":0}')
    return root


@pytest.mark.parametrize("kind", sorted(FOREIGN))
def test_another_applications_database_is_refused_and_left_untouched(
    tmp_path: Path, kind: str
) -> None:
    db = tmp_path / "data" / "their.duckdb"
    db.parent.mkdir()
    digest = _foreign(db, FOREIGN[kind])
    files = _siblings(db)

    with pytest.raises(StoreError, match="DuckDB database of another application") as refused:
        HistoryStore(db)
    assert "\n" not in str(refused.value) and "pass another --db" in str(refused.value)
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
    assert _siblings(db) == files

    # the command that builds a history from a checkpoint refuses it the same way
    checkpoint = _checkpoint(tmp_path / "checkpoint")
    result = CliRunner().invoke(
        app, ["checkpoint-history", str(checkpoint), "--db", str(db), "--no-state"]
    )
    assert result.exit_code == 1, result.output
    assert "DuckDB database of another application" in one_line(result.stderr)
    assert hashlib.sha256(db.read_bytes()).hexdigest() == digest
    assert _siblings(db) == files
    with duckdb.connect(str(db), read_only=True) as con:
        tables = con.execute("SELECT table_name FROM information_schema.tables").fetchall()
    assert ("wmwatch_schema",) not in tables


def test_an_empty_database_file_still_becomes_a_history(tmp_path: Path) -> None:
    """What is refused is another application's content, not a DuckDB file as such: one that
    holds nothing yet is made a history."""
    db = tmp_path / "empty.duckdb"
    duckdb.connect(str(db)).close()
    db.chmod(0o600)
    HistoryStore(db).close()
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("SELECT count(*) FROM wmwatch_schema").fetchone() != (0,)
