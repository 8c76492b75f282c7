"""History from a checkpoint alone, read: a query's batches, sources and stateful operators,
from its checkpoint folder (written to the history tables by :mod:`wmwatch._checkpoint.tables`).
Where each field comes from: docs/checkpoint-history.md.

Parsing here is pure (text in, values out); the files come through
:class:`~wmwatch._checkpoint.reader.CheckpointReader`, the state counts through
:mod:`wmwatch._checkpoint.state`. Nothing here writes into the checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from wmwatch._checkpoint.fs import CheckpointDamaged, CheckpointFormatUnknown, FileSystem
from wmwatch._checkpoint.reader import (
    CheckpointReader,
    OffsetsEntry,
    checkpoint_json,
    min_batches_to_retain,
)
from wmwatch._errors import ConfigError

_LOG_VERSION = "v1"
_STATE_FILE = re.compile(r"^(\d+)(?:_[0-9A-Za-z-]+)?\.(delta|snapshot|zip|changelog)$")
_FULL_STATE_KINDS = frozenset({"snapshot", "zip"})
_JOIN_OPERATOR = "symmetricHashJoin"
# a query id as Spark writes it (java.util.UUID.toString)
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
# Operators whose state sits in column families that the plain statestore read does not cover.
_UNCOUNTED_OPERATORS = frozenset({"transformWithStateExec", "transformWithStateInPandasExec"})


class CheckpointHistoryError(ConfigError):
    """The folder is not a readable streaming checkpoint (the message says what to do)."""


@dataclass(frozen=True, slots=True)
class StateOperator:
    """One stateful operator, from ``state/<id>/_metadata/metadata``."""

    operator_id: int
    name: str
    store_names: tuple[str, ...]
    partitions: int

    @property
    def is_join(self) -> bool:
        return self.name == _JOIN_OPERATOR

    @property
    def countable(self) -> bool:
        """Whether Spark's ``statestore`` reader, as used here, sees all of its state rows."""
        return self.name not in _UNCOUNTED_OPERATORS


@dataclass(frozen=True, slots=True)
class CheckpointBatch:
    """One ``offsets/N`` with what else the checkpoint says about batch N."""

    offsets: OffsetsEntry
    committed: bool
    # the source lines of offsets/N-1 (None: that file is gone or N is the first batch)
    previous_offsets: tuple[str | None, ...] | None

    @property
    def batch_id(self) -> int:
        return self.offsets.batch_id


@dataclass(frozen=True, slots=True)
class Retention:
    """How far back the checkpoint still reaches, as batch ids (None: nothing there)."""

    oldest_offsets_batch: int | None
    latest_offsets_batch: int | None
    oldest_commit_batch: int | None
    latest_commit_batch: int | None
    # the oldest batch whose state every operator can still load (state version - 1)
    oldest_state_batch: int | None
    min_batches_to_retain: int


@dataclass(frozen=True, slots=True)
class CheckpointHistory:
    """Everything read from one checkpoint, ready to write."""

    checkpoint: str
    query_id: str
    batches: tuple[CheckpointBatch, ...]
    operators: tuple[StateOperator, ...]
    retention: Retention
    # state rows per (batch id, operator id); a missing key: not counted
    state_rows: Mapping[tuple[int, int], int] = field(default_factory=dict)
    # what was left out, one line each
    warnings: tuple[str, ...] = ()
    # the state checkpoint format: 2 keeps per-batch state ids in the commit log, which
    # Spark's state reader needs to be told of (it is not in the offsets' conf)
    state_format_version: int = 1
    # whether the query has a watermark (its batches before the first one report the epoch);
    # None: the batches read say (a read of only some of them may not: see read_batches)
    has_watermark: bool | None = None


# -- parsing (pure) -------------------------------------------------------------------------------


def parse_query_id(text: str | None, root: str) -> str:
    """The query id in the checkpoint's ``metadata`` file."""
    if text is None:
        raise CheckpointHistoryError(
            f"{root} has no 'metadata' file, so it is not a streaming query's checkpoint: pass "
            "the folder given as checkpointLocation"
        )
    try:
        doc = checkpoint_json(text.strip().splitlines()[0] if text.strip() else "", "metadata")
    except CheckpointDamaged:
        doc = None
    if not isinstance(doc, dict) or not isinstance(doc.get("id"), str) or not doc["id"]:
        raise CheckpointHistoryError(
            f"{root}/metadata holds no query id; the checkpoint is damaged: restore the file "
            "from a copy of the checkpoint"
        )
    # Spark writes a UUID; anything else (".." or "../x" included) would be a path wherever the
    # id names a folder (the audit's Parquet), so it is refused, and not echoed
    if not _UUID.fullmatch(doc["id"]):
        raise CheckpointHistoryError(
            f"{root}/metadata holds a query id that is not a UUID, which Spark always writes: "
            "the checkpoint is damaged or not a streaming query's; restore the file from a copy "
            "of the checkpoint"
        )
    return str(doc["id"])


def parse_operator_metadata(text: str, what: str) -> StateOperator:
    """``state/<id>/_metadata/metadata`` (operator metadata v1, which Spark writes for every
    stateful operator but transformWithState's)."""
    lines = [line for line in text.split("\n") if line.strip()]
    if len(lines) < 2 or lines[0].strip() != _LOG_VERSION:
        version = lines[0].strip()[:20] if lines else ""
        raise CheckpointHistoryError(
            f"{what} is in format {version!r}, which this wmwatch cannot read: its operator is "
            "left out; upgrade wmwatch to read it"
        )
    try:
        doc = checkpoint_json(lines[1], what)
        info = doc["operatorInfo"]
        stores = doc["stateStoreInfo"]
        return StateOperator(
            operator_id=int(info["operatorId"]),
            name=str(info["operatorName"]),
            store_names=tuple(str(store["storeName"]) for store in stores),
            partitions=max((int(store["numPartitions"]) for store in stores), default=0),
        )
    except (CheckpointDamaged, ValueError, KeyError, TypeError, OverflowError) as exc:
        raise CheckpointHistoryError(
            f"{what} is damaged ({type(exc).__name__}): its operator is left out; restore the "
            "file from a copy of the checkpoint to read it"
        ) from None


def parse_commit(text: str | None) -> bool:
    """Whether ``commits/N`` marks the batch committed: present, with a known version line."""
    if text is None:
        return False
    first = text.split("\n", 1)[0].strip()
    # v1 (and later formats Spark adds) all start with a version line; an empty file is a
    # commit cut off while being written, which Spark itself does not count
    return bool(re.fullmatch(r"v\d+", first))


def state_format_version(commit_text: str | None) -> int:
    """The state checkpoint format a commit was written with: 2 when it names each store's
    state ids (``stateUniqueIds``, commit log v2), else 1."""
    if commit_text is None:
        return 1
    lines = commit_text.split("\n")
    try:
        doc = checkpoint_json(lines[1], "a commit") if len(lines) > 1 else {}
    except CheckpointDamaged:
        return 1
    return 2 if isinstance(doc, dict) and doc.get("stateUniqueIds") else 1


def oldest_loadable_version(names: Iterable[str]) -> int | None:
    """The oldest state version that one store's files can still rebuild.

    A version loads from a full copy (``N.snapshot``, RocksDB's ``N.zip``) plus the changes after
    it, or from the changes alone when they reach back to version 1 (nothing was cleaned up).
    """
    full: list[int] = []
    changes: list[int] = []
    for name in names:
        match = _STATE_FILE.match(name)
        if match is None:
            continue
        version = int(match.group(1))
        (full if match.group(2) in _FULL_STATE_KINDS else changes).append(version)
    candidates = list(full)
    if 1 in changes:
        candidates.append(1)
    return min(candidates) if candidates else None


def oldest_state_batch(versions: Iterable[int | None]) -> int | None:
    """The oldest batch whose state every store can load: the newest of the stores' oldest
    versions, minus one (batch N commits version N+1). None when a store has none."""
    found = list(versions)
    if not found or any(version is None for version in found):
        return None
    return max(v for v in found if v is not None) - 1


def retention_of(
    offsets: Sequence[int],
    commits: Sequence[int],
    oldest_state: int | None,
    conf: Mapping[str, str],
) -> Retention:
    return Retention(
        oldest_offsets_batch=min(offsets) if offsets else None,
        latest_offsets_batch=max(offsets) if offsets else None,
        oldest_commit_batch=min(commits) if commits else None,
        latest_commit_batch=max(commits) if commits else None,
        oldest_state_batch=oldest_state,
        min_batches_to_retain=min_batches_to_retain(dict(conf), None),
    )


def batches_to_count(history: CheckpointHistory, last: int | None) -> list[int]:
    """The batches whose state size is read: committed, with state still loadable, and only the
    ``last`` newest of them when given."""
    oldest = history.retention.oldest_state_batch
    if oldest is None or not any(op.countable for op in history.operators):
        return []
    ids = [b.batch_id for b in history.batches if b.committed and b.batch_id >= oldest]
    if last is None:
        return ids
    return ids[len(ids) - last :] if last > 0 else []


# -- reading (through the audit's reader) ---------------------------------------------------------


def read_checkpoint(reader: CheckpointReader) -> CheckpointHistory:
    """Read everything but the state sizes; raises :class:`CheckpointHistoryError`.

    An operator whose metadata cannot be read is left out, with a line in ``warnings``: the
    batches are worth having without it."""
    root = reader.root
    fs = reader.fs
    top = set(fs.list_names(root))
    if "offsets" not in top:
        raise CheckpointHistoryError(
            f"{root} has no offsets folder, so it is not a streaming query's checkpoint (or it "
            "never ran a batch): pass the folder given as checkpointLocation"
        )
    query_id = parse_query_id(fs.read_text(f"{root}/metadata"), root)
    offset_ids = reader.offset_batches()
    if not offset_ids:
        raise CheckpointHistoryError(
            f"{root}/offsets holds no batch: the query never planned one, so there is no "
            "history to read"
        )
    commit_ids = set(reader.committed_batches())
    entries, damaged = _read_offsets(reader, offset_ids)
    if not entries:
        if damaged:
            raise CheckpointHistoryError(_damaged(root, damaged[-1], len(damaged)))
        raise CheckpointHistoryError(
            f"{root}/offsets emptied while being read: the query purged it; run again"
        )
    batches = tuple(
        CheckpointBatch(
            offsets=entry,
            committed=batch_id in commit_ids
            and parse_commit(fs.read_text(f"{root}/commits/{batch_id}")),
            previous_offsets=(
                entries[batch_id - 1].source_offsets if batch_id - 1 in entries else None
            ),
        )
        for batch_id, entry in sorted(entries.items())
    )
    operators, warnings = read_operators(reader) if "state" in top else ((), ())
    oldest_state = _oldest_state_batch_on_disk(fs, root, operators)
    return CheckpointHistory(
        checkpoint=root,
        query_id=query_id,
        batches=batches,
        operators=operators,
        retention=retention_of(
            list(entries), sorted(commit_ids), oldest_state, batches[-1].offsets.conf
        ),
        warnings=(*(_left_out(exc) for exc in damaged), *warnings),
        state_format_version=state_format_version(
            fs.read_text(f"{root}/commits/{max(commit_ids)}") if commit_ids else None
        ),
    )


def read_batches(
    reader: CheckpointReader,
    query_id: str,
    batch_ids: Sequence[int],
    *,
    operators: tuple[StateOperator, ...] = (),
    has_watermark: bool | None = None,
    previous: OffsetsEntry | None = None,
    retention: Retention | None = None,
) -> CheckpointHistory:
    """Read only ``batch_ids`` (committed batches), for a reader that follows a running query
    and must not read its whole checkpoint again on every new commit.

    ``previous`` is the offsets entry of the batch before the first one when the caller still
    has it (so it is not read again). A batch whose offsets are gone (purged since) is left
    out. The retention comes from listing the logs and state folders, unless the caller passes
    one it listed a moment ago (a follower lists them at most every few seconds).
    """
    fs = reader.fs
    root = reader.root
    entries: dict[int, OffsetsEntry] = {}
    if previous is not None:
        entries[previous.batch_id] = previous
    wanted = sorted(set(batch_ids))
    # each batch's start offsets are the end offsets of the batch before it
    needed = sorted(({b - 1 for b in wanted if b > 0} | set(wanted)) - set(entries))
    found, damaged = _read_offsets(reader, needed)
    entries.update(found)
    batches = tuple(
        CheckpointBatch(
            offsets=entries[batch_id],
            committed=True,
            previous_offsets=(
                entries[batch_id - 1].source_offsets if batch_id - 1 in entries else None
            ),
        )
        for batch_id in wanted
        if batch_id in entries
    )
    if retention is None:
        retention = retention_of(
            reader.offset_batches(),
            reader.committed_batches(),
            _oldest_state_batch_on_disk(fs, root, operators),
            batches[-1].offsets.conf if batches else {},
        )
    return CheckpointHistory(
        checkpoint=root,
        query_id=query_id,
        batches=batches,
        operators=operators,
        retention=retention,
        warnings=tuple(_left_out(exc) for exc in damaged),
        has_watermark=has_watermark,
    )


def _oldest_state_batch_on_disk(
    fs: FileSystem, root: str, operators: Sequence[StateOperator]
) -> int | None:
    """The oldest batch whose state every operator's stores can still load; None without any."""
    if not operators:
        return None
    return oldest_state_batch(
        oldest_loadable_version(fs.list_names(store_folder(root, op, name)))
        for op in operators
        for name in op.store_names
    )


def read_operators(reader: CheckpointReader) -> tuple[tuple[StateOperator, ...], tuple[str, ...]]:
    """Each ``state/<id>`` folder's operator, by id, and a line per operator left out."""
    root = reader.root
    operators = []
    warnings = []
    for name in sorted(reader.fs.list_names(f"{root}/state"), key=_numeric_first):
        if not name.isdigit():
            continue
        path = f"{root}/state/{name}/_metadata/metadata"
        text = reader.fs.read_text(path)
        if text is None:
            warnings.append(
                f"state/{name} has no operator metadata (_metadata/metadata): its operator is "
                "left out (a Spark older than 3.5 wrote it, or the file is gone)"
            )
            continue
        try:
            operators.append(parse_operator_metadata(text, f"state/{name}/_metadata/metadata"))
        except CheckpointHistoryError as exc:
            warnings.append(str(exc))
    return tuple(operators), tuple(warnings)


def store_folder(root: str, operator: StateOperator, store_name: str) -> str:
    """Partition 0's folder of one store (every partition keeps the same versions)."""
    base = f"{root}/state/{operator.operator_id}/0"
    return base if store_name == "default" else f"{base}/{store_name}"


def _numeric_first(name: str) -> tuple[int, str]:
    return (int(name), name) if name.isdigit() else (1 << 62, name)


def _read_offsets(
    reader: CheckpointReader, batch_ids: Iterable[int]
) -> tuple[dict[int, OffsetsEntry], list[CheckpointDamaged]]:
    """The offsets of ``batch_ids`` that can be read, and why each other one cannot: a damaged
    file costs its own batch, never the others (a file purged since the listing is just gone)."""
    entries: dict[int, OffsetsEntry] = {}
    damaged: list[CheckpointDamaged] = []
    for batch_id in batch_ids:
        try:
            entry = reader.offsets(batch_id)
        except CheckpointDamaged as exc:
            damaged.append(exc)
            continue
        if entry is not None:
            entries[batch_id] = entry
    return entries, damaged


def _left_out(exc: CheckpointDamaged) -> str:
    """The warning line of a batch left out for a damaged offsets file."""
    return f"{str(exc).rstrip('.')}: that batch is left out (and the next one's start offsets)"


def _damaged(root: str, exc: CheckpointDamaged, count: int) -> str:
    """The one line when no offsets file of the checkpoint can be read."""
    text = str(exc).rstrip(".")
    if isinstance(exc, CheckpointFormatUnknown):
        return (
            f"{text.split(',', 1)[0]} in {root} (and every other offsets file is unreadable): "
            "the checkpoint is in a format this wmwatch does not know; upgrade wmwatch"
        )
    return (
        f"no offsets file of {root} can be read ({count} damaged; the newest: {text}): "
        "restore them from a copy of the checkpoint"
    )
