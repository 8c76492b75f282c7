"""The report's section for histories read from a checkpoint (``checkpoint_reads``): which
checkpoint, when, and how far back its offsets, commits and state still reach."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from wmwatch._section import Scope, Section, grouped, named_rows
from wmwatch._time import format_at, from_epoch_seconds

if TYPE_CHECKING:
    import duckdb
    from rich.table import Table


def load_checkpoint_reads(con: duckdb.DuckDBPyConnection, scope: Scope) -> dict[str, Any]:
    """Each query's checkpoint reads, the latest first."""
    rows = named_rows(
        con,
        """
        SELECT query_id, checkpoint, epoch(read_at) AS read_epoch_seconds,
               oldest_offsets_batch, latest_offsets_batch, oldest_commit_batch,
               latest_commit_batch, oldest_state_batch, min_batches_to_retain,
               batches_written, batches_kept, state_batches_counted
        FROM checkpoint_reads
        WHERE query_id IN (SELECT unnest($1::VARCHAR[]))
        ORDER BY query_id, read_at DESC
        """,
        (list(scope.query_ids),),
    )
    return grouped(
        rows,
        lambda r: {
            **{k: v for k, v in r.items() if k not in ("query_id", "read_epoch_seconds")},
            "read_at": from_epoch_seconds(r["read_epoch_seconds"]),
        },
    )


def render_checkpoint_reads(reads: Sequence[Mapping[str, Any]]) -> Table:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="read from the checkpoint", title_justify="left", expand=False)
    table.add_column("checkpoint")
    table.add_column("read at")
    table.add_column("offsets / commits / state reach back to batch")
    table.add_column("batches written / kept / state counted")
    for read in reads:
        table.add_row(
            escape(str(read["checkpoint"])),
            format_at(read["read_at"], zone=False),
            f"{_batch(read['oldest_offsets_batch'])} / {_batch(read['oldest_commit_batch'])} / "
            f"{_batch(read['oldest_state_batch'])}",
            f"{read['batches_written']} / {read['batches_kept']} / {read['state_batches_counted']}",
        )
    table.caption = (
        "Spark keeps spark.sql.streaming.minBatchesToRetain batches "
        f"({reads[0]['min_batches_to_retain']} here); older ones are gone from the checkpoint"
        if reads
        else None
    )
    table.caption_justify = "left"
    return table


def checkpoint_csv(reads: Sequence[Mapping[str, Any]] | None) -> Mapping[str, Any]:
    latest = reads[0] if reads else {}
    return {
        "checkpoint": latest.get("checkpoint") or "",
        "checkpoint_oldest_offsets_batch": latest.get("oldest_offsets_batch"),
        "checkpoint_oldest_state_batch": latest.get("oldest_state_batch"),
    }


def _batch(value: int | None) -> str:
    return "-" if value is None else str(value)


CHECKPOINT_SECTION = Section(
    key="checkpoint",
    title="read from the checkpoint",
    load=load_checkpoint_reads,
    render=render_checkpoint_reads,
    csv_columns=(
        "checkpoint",
        "checkpoint_oldest_offsets_batch",
        "checkpoint_oldest_state_batch",
    ),
    csv_values=checkpoint_csv,
)
