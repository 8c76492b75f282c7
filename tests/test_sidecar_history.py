"""The sidecar's batch history, without a JVM: a checkpoint written by hand in Spark's formats,
a real history file through the real store, and the sidecar's history writer as the audit loop
calls it (each batch as it is audited; at start, the batches marked without history)."""

from __future__ import annotations

from pathlib import Path

import duckdb

from tests.harness.handmade import QUERY_ID, T0_MS, add_state, make_checkpoint
from wmwatch._audit.sidecar.history import SidecarHistory
from wmwatch._audit.sinks import BatchLateRows
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch._store.writer import HistoryStore

_BATCHES = (
    "SELECT batch_id, run_id, epoch_ms(watermark_at), epoch_ms(late_watermark_at), committed "
    "FROM batches ORDER BY batch_id"
)


def _history(store: HistoryStore, checkpoint: Path) -> SidecarHistory:
    return SidecarHistory(
        store,
        query_id=QUERY_ID,
        label="orders",
        reader=CheckpointReader(str(checkpoint)),
        query_name="orders",
        has_watermark=True,
    )


def _audit(history: SidecarHistory, batch_id: int) -> None:
    history.commit(
        query_name="orders",
        run_id=None,
        batch_id=batch_id,
        late_wm_ms=None if batch_id == 0 else T0_MS + 5_000 * (batch_id - 1),
        found=BatchLateRows.nothing(),
        sink="duckdb",
    )


def _rows(db: Path, sql: str) -> list[tuple[object, ...]]:
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(sql).fetchall()


def test_each_audited_batch_gets_its_history_once_across_restarts(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "checkpoint", batches=6, committed=6)
    add_state(checkpoint, range(1, 8))
    db = tmp_path / "side.duckdb"
    store = HistoryStore(db).start()
    try:
        history = _history(store, checkpoint)
        assert history.last_audited_batch() is None
        for batch_id in range(4):
            _audit(history, batch_id)
        assert store.flush(timeout=30)
    finally:
        store.close(timeout=30)
    expected = [
        (
            n,
            "checkpoint",
            0 if n == 0 else T0_MS + 5_000 * n,  # the epoch before the first watermark
            None if n == 0 else (0 if n == 1 else T0_MS + 5_000 * (n - 1)),
            True,
        )
        for n in range(6)
    ]
    assert _rows(db, _BATCHES) == expected[:4]
    (ops,) = _rows(db, "SELECT count(*) FROM operators WHERE operator_name = 'stateStoreSave'")
    assert ops == (4,)
    # each batch's start offset is the end offset of the one before it
    sources = _rows(db, "SELECT batch_id, start_offset, end_offset FROM sources ORDER BY 1")
    assert sources[1:3] == [
        (1, '{"logOffset": 0}', '{"logOffset": 0}'),
        (2, '{"logOffset": 0}', '{"logOffset": 1}'),
    ]

    # a restart: batch 3's history is lost (as a kill between the two writes would lose it);
    # the restarted sidecar writes it again, audits the rest, and duplicates nothing
    with duckdb.connect(str(db)) as con:
        con.execute("DELETE FROM batches WHERE batch_id = 3")
    store = HistoryStore(db).start()
    try:
        history = _history(store, checkpoint)
        assert history.last_audited_batch() == 3
        assert store.flush(timeout=30)
        caught_up = store.read(lambda con: con.execute(_BATCHES).fetchall(), timeout=30)
        assert caught_up == expected[:4]  # before auditing on
        for batch_id in (4, 5, 3):  # 3 again: a replay a kill interrupted
            _audit(history, batch_id)
        assert store.flush(timeout=30)
    finally:
        store.close(timeout=30)
    assert _rows(db, _BATCHES) == expected
    assert _rows(db, "SELECT count(*), count(DISTINCT batch_id) FROM sources") == [(6, 6)]
    # the report's "read from the checkpoint" row counts every batch the sidecar wrote
    assert _rows(db, "SELECT batches_written, latest_commit_batch FROM checkpoint_reads") == [
        (6, 5)
    ]


def test_a_batch_purged_before_its_history_was_read_is_left_out(tmp_path: Path) -> None:
    checkpoint = make_checkpoint(tmp_path / "checkpoint", batches=3, committed=3)
    (checkpoint / "offsets" / "1").unlink()
    db = tmp_path / "side.duckdb"
    store = HistoryStore(db).start()
    try:
        history = _history(store, checkpoint)
        for batch_id in range(3):
            _audit(history, batch_id)
        assert store.flush(timeout=30)
        assert store.health.last_error is None
    finally:
        store.close(timeout=30)
    assert [row[0] for row in _rows(db, _BATCHES)] == [0, 2]
    assert _rows(db, "SELECT batch_id FROM audit_batches ORDER BY 1") == [(0,), (1,), (2,)]
    assert _rows(db, "SELECT start_offset FROM sources WHERE batch_id = 2") == [(None,)]


def test_checkpoint_history_on_a_sidecar_file_duplicates_nothing_and_counts_stay(
    tmp_path: Path,
) -> None:
    from typer.testing import CliRunner

    from wmwatch.cli import app

    checkpoint = make_checkpoint(tmp_path / "checkpoint", batches=3, committed=3)
    add_state(checkpoint, range(1, 5))
    db = tmp_path / "side.duckdb"
    store = HistoryStore(db).start()
    try:
        history = _history(store, checkpoint)
        _audit(history, 0)
        assert store.flush(timeout=30)
    finally:
        store.close(timeout=30)
    result = CliRunner().invoke(
        app, ["checkpoint-history", str(checkpoint), "--db", str(db), "--no-state"]
    )
    assert result.exit_code == 0, result.output
    assert _rows(db, "SELECT batch_id, run_id FROM batches ORDER BY 1") == [
        (0, "checkpoint"),
        (1, "checkpoint"),
        (2, "checkpoint"),
    ]
    # a state count that checkpoint-history made stays when the sidecar writes the batch again
    with duckdb.connect(str(db)) as con:
        con.execute("UPDATE operators SET rows_total = 7 WHERE batch_id = 1")
    store = HistoryStore(db).start()
    try:
        history = _history(store, checkpoint)
        _audit(history, 1)
        assert store.flush(timeout=30)
    finally:
        store.close(timeout=30)
    assert _rows(db, "SELECT batch_id, rows_total FROM operators ORDER BY 1") == [
        (0, None),
        (1, 7),
        (2, None),
    ]
    assert _rows(db, "SELECT count(*) FROM batches") == [(3,)]
