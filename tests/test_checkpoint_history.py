"""History from a checkpoint, without a JVM: the parsing pieces, the command on checkpoints
written by hand in Spark's formats (as the Spark test's query writes them), and its one-line
errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import pytest
from typer.testing import CliRunner

from tests.harness.handmade import (
    AGGREGATE_METADATA,
    JOIN_METADATA,
    QUERY_ID,
    T0_MS,
    add_state,
    make_checkpoint,
)
from wmwatch._checkpoint.history import (
    CheckpointHistoryError,
    batches_to_count,
    oldest_loadable_version,
    oldest_state_batch,
    parse_commit,
    parse_operator_metadata,
    parse_query_id,
    read_checkpoint,
    state_format_version,
)
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch.cli import app


def rows(db: Path, sql: str) -> list[tuple[Any, ...]]:
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(sql).fetchall()


def run(*args: str) -> Any:
    return CliRunner().invoke(app, ["checkpoint-history", *args])


# -- parsing ----------------------------------------------------------------------------------


def test_oldest_loadable_state_version() -> None:
    # nothing cleaned up: the changes reach back to version 1
    assert oldest_loadable_version([f"{v}.delta" for v in range(1, 51)]) == 1
    # cleaned up: the oldest full copy, whatever changes are left before it
    assert oldest_loadable_version(["35.delta", "40.snapshot", "41.delta", "50.snapshot"]) == 40
    # RocksDB, with checkpoint format v2's unique ids in the names
    assert oldest_loadable_version(["12_3f9a-b1.zip", "13_77c2-aa.changelog", "SSTs"]) == 12
    assert oldest_loadable_version(["1.changelog", "2.changelog", "_metadata"]) == 1
    # changes without their start and without a full copy: nothing loads
    assert oldest_loadable_version(["7.delta", "8.delta", ".7.delta.crc"]) is None
    assert oldest_loadable_version([]) is None


def test_oldest_state_batch_is_the_newest_store_floor_minus_one() -> None:
    # batch N commits state version N + 1; every store must load the version
    assert oldest_state_batch([3, 5, 1]) == 4
    assert oldest_state_batch([1]) == 0
    assert oldest_state_batch([3, None]) is None
    assert oldest_state_batch([]) is None


def test_operator_metadata() -> None:
    op = parse_operator_metadata(AGGREGATE_METADATA, "state/0/_metadata/metadata")
    assert (op.operator_id, op.name, op.store_names, op.partitions) == (
        0,
        "stateStoreSave",
        ("default",),
        2,
    )
    assert not op.is_join and op.countable
    join = parse_operator_metadata(JOIN_METADATA, "state/1/_metadata/metadata")
    assert join.is_join and join.partitions == 4 and len(join.store_names) == 4
    with pytest.raises(CheckpointHistoryError, match=r"format 'v2'.*upgrade wmwatch"):
        parse_operator_metadata('v2\n{"operatorInfo":{}}', "m")
    with pytest.raises(CheckpointHistoryError, match="m is damaged"):
        parse_operator_metadata('v1\n{"operatorInfo":{}}', "m")


def test_state_format_version_from_the_commit_log() -> None:
    # format 2 names each store's state ids per batch (RocksDB); the reader must be told
    ids = {"0": [["2f71984b-607c-444c-b1f8-19692e7d47fc"], ["53591614-c821-419a"]]}
    v2 = "v2\n" + json.dumps({"nextBatchWatermarkMs": 0, "stateUniqueIds": ids})
    assert state_format_version(v2) == 2
    assert state_format_version('v1\n{"nextBatchWatermarkMs":0}') == 1
    assert state_format_version("v2\n{broken") == 1
    assert state_format_version(None) == 1


def test_which_batches_get_their_state_counted(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ck", batches=8)  # 0-6 committed
    add_state(checkpoint, range(1, 9))
    history = read_checkpoint(CheckpointReader(str(checkpoint)))
    assert batches_to_count(history, None) == [0, 1, 2, 3, 4, 5, 6]
    assert batches_to_count(history, 3) == [4, 5, 6]
    assert batches_to_count(history, 0) == []
    assert batches_to_count(history, 50) == [0, 1, 2, 3, 4, 5, 6]
    # state cleaned below version 5: batches from 4 on still load
    for partition in ("0", "1"):
        folder = checkpoint / "state" / "0" / partition
        for version in range(1, 5):
            (folder / f"{version}.delta").unlink()
        (folder / "5.snapshot").write_bytes(b"")
    history = read_checkpoint(CheckpointReader(str(checkpoint)))
    assert batches_to_count(history, None) == [4, 5, 6]


def test_commit_and_query_id() -> None:
    assert parse_commit('v1\n{"nextBatchWatermarkMs":0}')
    assert not parse_commit(None)
    assert not parse_commit("")  # cut off while being written
    assert parse_query_id(json.dumps({"id": QUERY_ID}), "/c") == QUERY_ID
    with pytest.raises(CheckpointHistoryError, match="no 'metadata' file"):
        parse_query_id(None, "/c")
    with pytest.raises(CheckpointHistoryError, match="holds no query id"):
        parse_query_id("{}", "/c")


# -- the command, on checkpoints written by hand ------------------------------------------------


def test_history_of_a_checkpoint(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ck", batches=4)
    db = tmp_path / "h.duckdb"
    result = run(str(checkpoint), "--db", str(db), "--name", "counts")
    assert result.exit_code == 0, result.output
    assert f"wrote 4 batches of query counts ({QUERY_ID})" in result.output
    got = rows(
        db,
        "SELECT batch_id, epoch_ms(watermark_at), epoch_ms(late_watermark_at), "
        "epoch_ms(batch_at), committed, query_name, watermark_lag_seconds FROM batches "
        "ORDER BY batch_id",
    )
    assert got == [
        # the epoch until the query has a watermark, as Spark reports it
        (0, 0, None, T0_MS + 60_000, True, "counts", None),
        (1, T0_MS + 5_000, 0, T0_MS + 61_000, True, "counts", 56.0),
        (2, T0_MS + 10_000, T0_MS + 5_000, T0_MS + 62_000, True, "counts", 52.0),
        (3, T0_MS + 15_000, T0_MS + 10_000, T0_MS + 63_000, False, "counts", 48.0),
    ]
    # batch N read from where N-1 ended
    assert rows(db, "SELECT batch_id, start_offset, end_offset FROM sources ORDER BY 1") == [
        (0, None, '{"logOffset": 0}'),
        (1, '{"logOffset": 0}', '{"logOffset": 0}'),
        (2, '{"logOffset": 0}', '{"logOffset": 1}'),
        (3, '{"logOffset": 1}', '{"logOffset": 1}'),
    ]
    assert rows(
        db,
        "SELECT query_id, checkpoint, oldest_offsets_batch, latest_offsets_batch, "
        "oldest_commit_batch, latest_commit_batch, oldest_state_batch, min_batches_to_retain "
        "FROM checkpoint_reads",
    ) == [(QUERY_ID, str(checkpoint), 0, 3, 0, 2, None, 100)]
    report = CliRunner().invoke(app, ["report", "--db", str(db)])
    assert report.exit_code == 0, report.output
    assert "counts" in report.output
    # the report's section says which checkpoint and how far back it reaches
    assert "read from the checkpoint" in report.output
    assert "0 / 0 / -" in report.output and "4 / 0 / 0" in report.output
    csv = CliRunner().invoke(app, ["report", "--db", str(db), "--format", "csv"])
    assert csv.exit_code == 0, csv.output
    header, row = csv.output.strip().splitlines()
    values = dict(zip(header.split(","), row.split(","), strict=True))
    assert values["checkpoint"] == str(checkpoint)
    assert values["checkpoint_oldest_offsets_batch"] == "0"
    assert values["checkpoint_oldest_state_batch"] == ""


def test_running_it_again_duplicates_nothing(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ck", batches=6)
    db = tmp_path / "h.duckdb"
    assert run(str(checkpoint), "--db", str(db)).exit_code == 0
    first = rows(db, "SELECT * EXCLUDE (recorded_at) FROM batches ORDER BY batch_id")
    assert run(str(checkpoint), "--db", str(db)).exit_code == 0
    assert rows(db, "SELECT * EXCLUDE (recorded_at) FROM batches ORDER BY batch_id") == first
    assert rows(db, "SELECT count(*) FROM sources") == [(6,)]
    assert rows(db, "SELECT count(*) FROM checkpoint_reads") == [(1,)]


def test_retention_reaches_back_as_far_as_the_files(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ck", batches=8)
    # Spark purged offsets and commits below 3, and the state versions below 5
    for n in range(3):
        (checkpoint / "offsets" / str(n)).unlink()
        (checkpoint / "commits" / str(n)).unlink()
    add_state(checkpoint, range(5, 9))
    for partition in ("0", "1"):
        (checkpoint / "state" / "0" / partition / "5.snapshot").write_bytes(b"")
    db = tmp_path / "h.duckdb"
    result = run(str(checkpoint), "--db", str(db), "--no-state")
    assert result.exit_code == 0, result.output
    assert "offsets reach back to batch 3, commits to 3, state to 4" in result.output
    # the batch after the purge has no start offset: offsets/2 is gone
    assert rows(db, "SELECT min(batch_id), count(*) FROM batches") == [(3, 5)]
    assert rows(db, "SELECT start_offset FROM sources WHERE batch_id = 3") == [(None,)]
    # its operator is there; its state was not counted
    assert rows(
        db,
        "SELECT DISTINCT operator_id, operator_name, rows_total, shuffle_partitions FROM operators",
    ) == [(0, "stateStoreSave", None, 2)]


# -- bad input: one line that says what to do, no traceback, nothing written --------------------


def one_line_error(result: Any, *fragments: str) -> None:
    assert result.exit_code != 0
    assert isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("wmwatch checkpoint-history: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_a_path_that_is_not_a_folder(tmp_path: Path) -> None:
    one_line_error(
        run(str(tmp_path / "nope"), "--db", str(tmp_path / "h.duckdb")),
        "is not a folder",
        "checkpointLocation",
    )
    assert not (tmp_path / "h.duckdb").exists()


def test_a_folder_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "part-0.json").write_text("{}")
    one_line_error(
        run(str(tmp_path / "data"), "--db", str(tmp_path / "h.duckdb")),
        "no offsets folder",
        "pass the folder given as checkpointLocation",
    )
    assert not (tmp_path / "h.duckdb").exists()


def test_missing_metadata_and_empty_offsets(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ck")
    (checkpoint / "metadata").unlink()
    one_line_error(run(str(checkpoint), "--db", str(tmp_path / "h.duckdb")), "no 'metadata' file")
    empty = tmp_path / "empty"
    (empty / "offsets").mkdir(parents=True)
    (empty / "metadata").write_text(json.dumps({"id": QUERY_ID}))
    one_line_error(run(str(empty), "--db", str(tmp_path / "h.duckdb")), "holds no batch")


def test_an_offset_log_in_an_unknown_version_everywhere(tmp_path: Path) -> None:
    """Every offsets file in a log version this wmwatch does not read (a query run with source
    evolution writes v2): one line, nothing written."""
    checkpoint = make_checkpoint(tmp_path / "ck")
    for path in (checkpoint / "offsets").glob("[0-9]*"):
        path.write_text(path.read_text().replace("v1", "v2", 1))
    one_line_error(
        run(str(checkpoint), "--db", str(tmp_path / "h.duckdb")),
        "offsets/3 is in log format 'v2'",
        "upgrade wmwatch",
    )
    assert not (tmp_path / "h.duckdb").exists()


def test_every_offsets_file_damaged(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ck")
    for path in (checkpoint / "offsets").glob("[0-9]*"):
        path.write_bytes(b"")
    one_line_error(
        run(str(checkpoint), "--db", str(tmp_path / "h.duckdb")),
        "no offsets file of",
        "4 damaged",
        "restore them from a copy of the checkpoint",
    )
    assert not (tmp_path / "h.duckdb").exists()


_DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (b"", "offsets/1 is empty"),
        (b"\x00\x9f\x13\xff binary", "offsets/1 does not start with a log version line"),
        (b'v2\n{"batchWatermarkMs":0}\nclicks:{"logOffset":0}', "offsets/1 is in log format 'v2'"),
        (b'v1\n{"batchWatermarkMs": 12', "offsets/1 metadata is not JSON"),
        (f"v1\n{_DEEP}".encode(), "offsets/1 metadata is nested too deep"),
        (b'v1\n{"batchWatermarkMs": "soon"}', "offsets/1 batchWatermarkMs is str"),
    ],
)
def test_a_damaged_offsets_file_costs_its_batch_only(
    tmp_path: Path, damage: bytes, says: str
) -> None:
    """offsets/1 damaged, as in each way it can be: its batch is left out with one warning
    line, batch 2 has no start offset (it started where 1 ended), every other batch is
    written as from an undamaged checkpoint."""
    checkpoint = make_checkpoint(tmp_path / "ck", batches=5)
    (checkpoint / "offsets" / "1").write_bytes(damage)
    db = tmp_path / "h.duckdb"
    result = run(str(checkpoint), "--db", str(db))
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.output.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and says in warnings[0], result.output
    assert "that batch is left out" in warnings[0] and "binary" not in warnings[0]
    assert rows(db, "SELECT batch_id FROM batches ORDER BY 1") == [(0,), (2,), (3,), (4,)]
    assert rows(db, "SELECT batch_id, start_offset, end_offset FROM sources ORDER BY 1") == [
        (0, None, '{"logOffset": 0}'),
        (2, None, '{"logOffset": 1}'),
        (3, '{"logOffset": 1}', '{"logOffset": 1}'),
        (4, '{"logOffset": 1}', '{"logOffset": 2}'),
    ]
    assert rows(db, "SELECT latest_offsets_batch FROM checkpoint_reads") == [(4,)]


def test_an_unreadable_operator_is_left_out_with_a_warning(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ck")
    add_state(checkpoint, range(1, 5))
    (checkpoint / "state" / "0" / "_metadata" / "metadata").write_text("v7\n{}")
    db = tmp_path / "h.duckdb"
    result = run(str(checkpoint), "--db", str(db))
    assert result.exit_code == 0, result.output
    assert "warning: state/0/_metadata/metadata is in format 'v7'" in result.output
    assert rows(db, "SELECT count(*) FROM batches") == [(4,)]
    assert rows(db, "SELECT count(*) FROM operators") == [(0,)]


def test_the_history_is_never_written_into_the_checkpoint(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ck")
    before = sorted(p.name for p in checkpoint.rglob("*"))
    one_line_error(
        run(str(checkpoint), "--db", str(checkpoint / "h.duckdb")),
        "inside the checkpoint",
        "pass a file elsewhere",
    )
    assert sorted(p.name for p in checkpoint.rglob("*")) == before


def test_a_database_of_another_application(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "ck")
    other = tmp_path / "other.duckdb"
    with duckdb.connect(str(other)) as con:
        con.execute("CREATE TABLE accounts (id INTEGER)")
    one_line_error(run(str(checkpoint), "--db", str(other)), "another application")
    assert rows(other, "SELECT table_name FROM information_schema.tables") == [("accounts",)]
