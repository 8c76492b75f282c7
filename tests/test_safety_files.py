"""Files a careless user or an attacker hands wmwatch: the demo's folder, a history file altered
with DuckDB, text from data shown as markup, and links planted next to the history. Each test
drives the real CLI or the real store over real files."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from tests.harness.cli import one_line
from tests.harness.handmade import ROWS, US, T, late, progress
from wmwatch._audit.sinks import BatchLateRows, _batch_writer
from wmwatch._cli.demo_job import MARKER, claim_workdir
from wmwatch._errors import ConfigError, StoreError
from wmwatch._events import parse_terminated
from wmwatch._report.build import build_report
from wmwatch._report.render import report_dict
from wmwatch._store.writer import HistoryStore, open_readonly
from wmwatch.cli import app

SECRET = "TOP-SECRET-4f1c9a"


def cli(*args: str) -> Any:
    # wide enough that no value wraps in the terminal report
    return CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})


# -- the demo's folder ----------------------------------------------------------------------------


def test_demo_refuses_a_folder_it_did_not_make_and_deletes_nothing(tmp_path: Path) -> None:
    mine = tmp_path / "my-project"
    mine.mkdir()
    (mine / "notes.txt").write_text("years of work")
    started = time.monotonic()
    result = cli("demo", "--workdir", str(mine), "--duration", "5", "--port", "0")
    assert result.exit_code == 2
    line = one_line(result.stderr)
    assert MARKER in line and "new or empty folder" in line
    assert (mine / "notes.txt").read_text() == "years of work"
    # refused before Spark: nothing of the demo's was made, and no session was started
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert time.monotonic() - started < 5


def test_demo_reuses_its_own_folder_and_clears_only_what_it_made(tmp_path: Path) -> None:
    folder = claim_workdir(tmp_path / "demo")
    assert (folder / MARKER).is_file()
    # an earlier run's leftovers, a file the user put there since, and a link to elsewhere
    (folder / "in").mkdir()
    (folder / "in" / "part-000000.json").write_text("{}")
    (folder / "checkpoint" / "offsets").mkdir(parents=True)
    (folder / "wmwatch.duckdb").write_text("old history")
    (folder / "report.html").write_text("<html>")
    (folder / "keep-me.txt").write_text("the user's")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "data.json").write_text("not the demo's")
    (folder / "checkpoint" / "offsets" / "link").symlink_to(elsewhere)

    assert claim_workdir(folder) == folder
    assert sorted(p.name for p in folder.iterdir()) == [MARKER, "keep-me.txt"]
    assert (elsewhere / "data.json").read_text() == "not the demo's"
    # an empty folder is taken, and marked
    empty = tmp_path / "empty"
    empty.mkdir()
    claim_workdir(empty)
    assert (empty / MARKER).is_file()
    # a file, or a folder of someone else's, is not
    with pytest.raises(ConfigError, match="not a folder"):
        claim_workdir(elsewhere / "data.json")
    with pytest.raises(ConfigError, match=r"no \.wmwatch-demo marker"):
        claim_workdir(elsewhere)


# -- a hostile history file -----------------------------------------------------------------------


def _audited_history(tmp_path: Path) -> tuple[Path, Path]:
    """A history written by the real store: batches, and an audited batch kept in Parquet where
    the audit writes it (<parquet_path>/<query id>/batch-<n>)."""
    db = tmp_path / "history.duckdb"
    folder = tmp_path / "late" / "q-1" / "batch-000000000005"
    folder.mkdir(parents=True)
    pq.write_table(
        pa.table(
            {
                "query_id": ["q-1"],
                "batch_id": pa.array([5], pa.int64()),
                "event_time_us": pa.array([(T + 21) * US], pa.int64()),
                "watermark_us": pa.array([(T + 40) * US], pa.int64()),
                "lateness_seconds": [19.0],
                "source_file": ["/in/from-parquet.json"],
            }
        ),
        folder / "part-0.parquet",
    )
    with HistoryStore(db) as store:
        for batch_id in range(6):
            store.record_progress(progress(batch_id))
        for batch_id, found, sink in (
            (4, BatchLateRows(total=3, rows=list(ROWS)), "duckdb"),
            (5, BatchLateRows.all_in_parquet(1, str(folder)), "parquet"),
        ):
            store.submit(
                _batch_writer(
                    query_id="q-1",
                    query_name="clicks",
                    run_id="run-1",
                    batch_id=batch_id,
                    late_wm_ms=(T + 40) * 1000,
                    found=found,
                    sink=sink,
                ),
                description=f"audit batch {batch_id}",
            )
    return db, folder


def _alter(db: Path, *statements: str) -> None:
    con = duckdb.connect(str(db))
    try:
        for statement in statements:
            con.execute(statement)
    finally:
        con.close()


def test_an_unaltered_history_reads_its_parquet_rows_through_the_sealed_connection(
    tmp_path: Path,
) -> None:
    db, folder = _audited_history(tmp_path)
    result = cli("report", "--db", str(db), "--format", "json")
    assert result.exit_code == 0, result.output
    (query,) = json.loads(result.stdout)["queries"]
    assert query["late_rows"]["late_rows"] == 4
    sources = {s["source_file"] for s in query["late_rows"]["top_sources"]}
    assert "/in/from-parquet.json" in sources
    # a connection not told which files it may read reaches none, the audit's included
    (tmp_path / "other.txt").write_text("other")
    for sql in (
        f"SELECT * FROM read_parquet('{folder / 'part-0.parquet'}')",
        f"SELECT * FROM read_text('{tmp_path / 'other.txt'}')",
    ):
        with open_readonly(db) as con, pytest.raises(duckdb.Error, match="disabled by config"):
            con.execute(sql).fetchall()


def test_parquet_written_after_the_report_opened_the_file_is_left_for_the_next_report(
    tmp_path: Path,
) -> None:
    """A running audit may add a batch between the report's look at the file and its read:
    the batch's files were not made readable, so it is skipped rather than failing the report."""
    db, _ = _audited_history(tmp_path)
    with open_readonly(db, readable_files=lambda con: []) as con:
        doc = report_dict(build_report(con, db=str(db)))
    (query,) = doc["queries"]
    assert query["late_rows"]["late_rows_kept"] == 3  # the DuckDB rows; batch 5's Parquet later


@pytest.mark.parametrize(
    "attack",
    [
        "view_over_a_secret_file",
        "macro_over_a_secret_file",
        "parquet_location_of_the_root",
        "parquet_location_of_a_home_folder",
        "parquet_folder_linked_elsewhere",
    ],
)
def test_a_hostile_history_is_refused_in_one_line_and_leaks_nothing(
    tmp_path: Path, attack: str
) -> None:
    db, _ = _audited_history(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    # a Parquet file with the secret where a glob of the disk (or of a folder) would find it
    pq.write_table(pa.table({"query_id": ["q-1"], "source_file": [SECRET]}), tmp_path / "s.parquet")
    read_secret = f"(SELECT content FROM read_text('{secret}'))"
    statements = {
        "view_over_a_secret_file": [
            "CREATE TABLE queries_real AS SELECT * FROM queries",
            "DROP TABLE queries",
            f"CREATE VIEW queries AS SELECT * REPLACE ({read_secret} AS query_name) "
            "FROM queries_real",
        ],
        "macro_over_a_secret_file": [f"CREATE MACRO coalesce_name(x) AS {read_secret}"],
        "parquet_location_of_the_root": [
            "UPDATE audit_batches SET location = '/' WHERE batch_id = 5"
        ],
        "parquet_location_of_a_home_folder": [
            f"UPDATE audit_batches SET location = 'file://{tmp_path}' WHERE batch_id = 5"
        ],
        "parquet_folder_linked_elsewhere": [],
    }[attack]
    linked = tmp_path / "evil" / "q-1" / "batch-000000000005"
    linked.parent.mkdir(parents=True)
    linked.symlink_to(tmp_path)  # audit-shaped, but a link to the folder with the secret
    statements = statements or [
        f"UPDATE audit_batches SET location = '{linked}' WHERE batch_id = 5"
    ]
    _alter(db, *statements)
    result = cli("report", "--db", str(db), "--format", "json")
    assert result.exit_code == 1, result.output
    assert SECRET not in result.output
    line = one_line(result.stderr)
    assert "the file was altered" in line and "pass a history file written by wmwatch" in line


# -- markup in data -------------------------------------------------------------------------------

HOSTILE = "[bold]x[/bold] [/x] <script>alert(1)</script> $a$"
MATH = r"agg $\frac$ $x_1$"


def _markup_history(tmp_path: Path) -> Path:
    db = tmp_path / "history.duckdb"
    with HistoryStore(db) as store:
        for batch_id in range(6):
            snap = progress(batch_id, name=HOSTILE)
            op = dataclasses.replace(snap.operators[0], name=MATH)
            store.record_progress(dataclasses.replace(snap, operators=(op,)))
        hostile_row = late(T + 3, T, T + 10, f"/in/{HOSTILE}.json", '{"id":1}')
        joined = (*hostile_row[:6], 0, "left", 0, f"key {HOSTILE}")
        store.submit(
            _batch_writer(
                query_id="q-1",
                query_name=HOSTILE,
                run_id="run-1",
                batch_id=4,
                late_wm_ms=(T + 40) * 1000,
                found=BatchLateRows(total=2, rows=[hostile_row, joined]),
                sink="duckdb",
            ),
            description="audit batch 4",
        )
        store.record_query_terminated(
            parse_terminated(
                {
                    "id": "q-1",
                    "runId": "run-1",
                    "exception": f"boom {HOSTILE}",
                    "errorClassOnException": "[red]E[/red]",
                }
            )
        )
    return db


def test_text_from_data_renders_literally_in_the_terminal(tmp_path: Path) -> None:
    db = _markup_history(tmp_path)
    result = cli("report", "--db", str(db))
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert HOSTILE in text  # the query name, as the panel title
    assert f"boom {HOSTILE}" in text  # the exception
    assert "([red]E[/red])" in text  # the error class
    assert f"/in/{HOSTILE}.json" in text  # a source file
    assert f"key {HOSTILE}" in text  # a join key


def test_text_from_data_renders_literally_in_html_and_charts(tmp_path: Path) -> None:
    db = _markup_history(tmp_path)
    target = tmp_path / "report.html"
    result = cli("report", "--db", str(db), "--format", "html", "-o", str(target))
    assert result.exit_code == 0, result.output
    page = target.read_text()
    assert "<script>alert" not in page
    assert "[bold]x[/bold] [/x] &lt;script&gt;alert(1)&lt;/script&gt; $a$" in page
    assert "boom [bold]x[/bold]" in page
    # the operator's name in the chart legend is text, not mathtext (which fails on "$\frac$")
    assert "operator 0 agg $\\frac$ $x_1$" in page


# -- predictable paths and permissions ------------------------------------------------------------


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    victim.chmod(0o644)
    return victim


def _unchanged(victim: Path) -> bool:
    return victim.read_text() == "precious" and stat.S_IMODE(victim.stat().st_mode) == 0o644


@pytest.mark.parametrize("side", [".lock", ".wal"])
def test_a_link_planted_next_to_the_history_is_not_followed(tmp_path: Path, side: str) -> None:
    db = tmp_path / "history.duckdb"
    with HistoryStore(db) as store:
        store.record_progress(progress(0))
    victim = _victim(tmp_path)
    Path(f"{db}{side}").symlink_to(victim)
    with pytest.raises(StoreError, match=r"is a symbolic link, which wmwatch does not follow"):
        HistoryStore(db)
    assert _unchanged(victim)
    result = cli("report", "--db", str(db), "--format", "json")
    assert result.exit_code == 1 and "symbolic link" in one_line(result.stderr)
    assert _unchanged(victim)
    assert Path(f"{db}{side}").is_symlink()  # the link itself is left for its owner to look at


def test_a_history_file_others_may_write_is_refused_and_new_ones_are_owner_only(
    tmp_path: Path,
) -> None:
    db = tmp_path / "history.duckdb"
    with HistoryStore(db) as store:
        store.record_progress(progress(0))
    assert stat.S_IMODE(db.stat().st_mode) == 0o600
    db.chmod(0o664)
    with pytest.raises(StoreError, match=r"writable by others \(mode 0664\).*chmod 600"):
        HistoryStore(db)
    db.chmod(0o600)
    HistoryStore(db).close()


@pytest.mark.parametrize("suffix", ["", ".wal", ".lock"])
def test_report_output_never_overwrites_the_history(tmp_path: Path, suffix: str) -> None:
    db = tmp_path / "history.duckdb"
    with HistoryStore(db) as store:
        store.record_progress(progress(0))
    before = db.read_bytes()
    # the same file by another name, through a link to the folder
    alias = tmp_path / "alias"
    alias.symlink_to(tmp_path)
    for target in (f"{db}{suffix}", f"{alias / db.name}{suffix}"):
        result = cli("report", "--db", str(db), "-o", target)
        assert result.exit_code == 2
        assert "is the history file" in one_line(result.stderr)
    assert db.read_bytes() == before
    assert not Path(f"{db}{suffix}").exists() or suffix == ""


def test_report_output_goes_through_a_fresh_private_file(tmp_path: Path) -> None:
    db = tmp_path / "history.duckdb"
    with HistoryStore(db) as store:
        store.record_progress(progress(0))
    victim = _victim(tmp_path)
    target = tmp_path / "out.json"
    # the partial name an earlier version used, and the target itself, planted as links
    (tmp_path / ".out.json.partial").symlink_to(victim)
    result = cli("report", "--db", str(db), "--format", "json", "-o", str(target))
    assert result.exit_code == 0, result.output
    assert _unchanged(victim)
    assert json.loads(target.read_text())["queries"][0]["query"] == "clicks"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    link = tmp_path / "linked.json"
    link.symlink_to(victim)
    result = cli("report", "--db", str(db), "--format", "json", "-o", str(link))
    assert result.exit_code == 0, result.output
    assert _unchanged(victim) and not link.is_symlink()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial") and not p.is_symlink()]


def test_private_tree_makes_the_audit_folder_owner_only_and_leaves_links_alone(
    tmp_path: Path,
) -> None:
    from wmwatch._audit.replay.engine import private_folder, private_tree

    victim = _victim(tmp_path)
    query_folder = tmp_path / "late" / "q-1"
    private_folder(str(query_folder))
    assert stat.S_IMODE(query_folder.stat().st_mode) == 0o700
    batch = query_folder / "batch-000000000001"
    batch.mkdir(mode=0o755)
    (batch / "part-0.parquet").write_text("rows")
    (batch / "part-0.parquet").chmod(0o644)
    (batch / "link").symlink_to(victim)
    private_tree(f"file://{batch}")
    assert stat.S_IMODE(batch.stat().st_mode) == 0o700
    assert stat.S_IMODE((batch / "part-0.parquet").stat().st_mode) == 0o600
    assert _unchanged(victim)
    private_tree("s3a://bucket/late/q-1/batch-000000000001")  # another file system: untouched
    assert os.path.exists(batch)
