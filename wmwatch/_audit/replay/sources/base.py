"""The seam between the audit and its sources: what every kind of source gives, and the plan
helpers the kinds share.

A source the audit can read again is a :class:`BatchSource`: it says what batch N read (from the
query's checkpoint), reads exactly that again as a batch DataFrame, and, once the replay's jobs
ended, says whether what they read was still the batch's. A source whose identity the checkpoint
does not record (a Kafka topic's id) keeps what the audit saw of it in an identity book
(:mod:`wmwatch._audit.identities`), handed over through :class:`RemembersIdentities`. A kind
of source is a :class:`SourceKind`: whether a streaming relation of the query's plan is of that
kind, and how to build its :class:`BatchSource` (:class:`Found`). The kinds are registered, in
order, in :data:`wmwatch._audit.replay.sources.KINDS`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from wmwatch._audit.identities import IdentityBook
from wmwatch._checkpoint.reader import CheckpointReader
from wmwatch._errors import AuditError, ConfigError, UnsupportedSourceError

# The column that carries each replayed row's file (null for sources without files).
SOURCE_FILE_COL = "__wmwatch_source_file"
# The column that carries each replayed row's position in its source, as JSON (Kafka: topic,
# partition, offset; absent for other sources): what names the rows that moved the watermark.
SOURCE_POSITION_COL = "__wmwatch_source_position"
# Columns the audit attaches to the raw rows: carried through ``events``, never row data.
ATTACHED_COLUMNS = frozenset({SOURCE_FILE_COL, SOURCE_POSITION_COL})


class SourceOptions(Mapping[str, str]):
    """A source's options as Spark reads them: a key matches in any case (``cleansource`` is
    ``cleanSource``, as in Spark's ``CaseInsensitiveMap``), the last value given winning;
    iterated with the keys as the query gave them, which Spark's readers take back as they are.
    Every look-up of a query's source option goes through this. Values are never shown (a
    Kafka source's hold credentials)."""

    __slots__ = ("_folded", "_given")

    def __init__(self, given: Mapping[Any, Any] | None = None) -> None:
        self._given = {str(k): str(v) for k, v in (given or {}).items()}
        self._folded: dict[str, list[str]] = {}
        for key, value in self._given.items():
            self._folded.setdefault(key.lower(), []).append(value)

    def __getitem__(self, key: str) -> str:
        return self._folded[key.lower()][-1]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self._folded

    def __iter__(self) -> Iterator[str]:
        return iter(self._given)

    def __len__(self) -> int:
        return len(self._given)

    def __repr__(self) -> str:
        return f"SourceOptions(keys={sorted(self._given)})"

    @classmethod
    def of(cls, given: Mapping[Any, Any] | None) -> SourceOptions:
        """``given`` as source options (itself when it already is)."""
        return given if isinstance(given, SourceOptions) else cls(given)

    def without(self, *names: str) -> dict[str, str]:
        """The options with the keys as given, less ``names`` in any case (options a batch
        read must not be handed)."""
        dropped = {name.lower() for name in names}
        return {k: v for k, v in self._given.items() if k.lower() not in dropped}

    def every(self, key: str) -> tuple[str, ...]:
        """Every value given under ``key`` in any case: a Spark Connect client's plan can hold
        ``cleanSource`` and ``cleansource`` both, and which one the server then takes is not
        defined, so a refusal looks at each."""
        return tuple(self._folded.get(key.lower(), ()))


class BatchSource(Protocol):
    """One source of a query, as the audit reads it again."""

    @property
    def source_index(self) -> int:
        """Its position in the query's sources (the checkpoint's ``sources/<i>``)."""
        ...

    def batch_input(self, checkpoint: CheckpointReader, batch_id: int) -> Any | None:
        """What batch ``batch_id`` read from this source; None when it read nothing new."""
        ...

    def read(self, spark: Any, what: Any) -> Any:
        """That data again, as a batch DataFrame of the source's raw rows (with
        :data:`SOURCE_FILE_COL` where the source has files)."""
        ...

    def after_read(self, spark: Any, what: Any, error: BaseException | None) -> None:
        """Called once the replay's jobs over ``what`` ended, with what they raised (None when
        they succeeded). Raises
        :class:`~wmwatch._checkpoint.fs.CheckpointEntryGone` when the data read was not, or
        can no longer be shown to be, the batch's (records deleted or a topic replaced during
        the read, a file gone): the batch is then counted lost, not retried."""
        ...


@runtime_checkable
class RemembersIdentities(Protocol):
    """A source that checks an identity its checkpoint does not record against what the audit
    saw first: the audit hands it its identity book when it starts."""

    def remember_with(self, book: IdentityBook) -> None: ...


def remember_identities(batch_sources: Iterable[object], book: IdentityBook) -> None:
    """Hand ``book`` to each of ``batch_sources`` that checks an identity with it."""
    for source in batch_sources:
        if isinstance(source, RemembersIdentities):
            source.remember_with(book)


@dataclass(frozen=True, slots=True)
class Found:
    """The source an events DataFrame reads, as the audit will read it again: the positions
    among the query's sources it may stand at (several when a query reads it twice), how to
    read it at one of them, and a name for messages."""

    positions: list[int]
    at: Callable[[int], BatchSource]
    description: str


# Spark Connect: a source read off the client's plan when the audit starts; its position is
# known once the query has reported progress (its sources' descriptions, in source order).
ConnectFound = Callable[[Sequence[str]], Found]


@dataclass(frozen=True, slots=True)
class SourceKind:
    """One kind of source the audit reads again, registered once in
    :data:`wmwatch._audit.replay.sources.KINDS`.

    ``matches(spark, relation)``: whether a streaming relation of a classic query's plan (JVM)
    reads this kind. ``found(spark, events, relation, positions, plan_text)``: the source as
    the audit reads it, given where the relation stands among the query's sources (matched by
    its output attributes; empty when that match failed). On Spark Connect (where a kind is
    read there): ``connect_matches(relation)`` over the client's streaming ``DataSource`` plan
    node and ``connect_found(events, relation)``.
    """

    name: str
    matches: Callable[[Any, Any], bool]
    found: Callable[[Any, Any, Any, list[int], str], Found]
    connect_matches: Callable[[Any], bool] | None = None
    connect_found: Callable[[Any, Any], ConnectFound] | None = None


@dataclass(frozen=True, slots=True)
class UnreplayableSource:
    """A source that cannot read a batch again (rate, socket, a stream that drops committed
    rows): nothing is replayed; the audit counts what Spark dropped from it instead."""

    index: int
    reason: str

    @property
    def source_index(self) -> int:
        return self.index

    def batch_input(self, checkpoint: CheckpointReader, batch_id: int) -> Any | None:
        return None

    def read(self, spark: Any, what: Any) -> Any:
        raise AuditError(f"source {self.index} cannot be read again: {self.reason}")

    def after_read(self, spark: Any, what: Any, error: BaseException | None) -> None:
        return None


def _jvm_of(spark: Any) -> Any:
    return spark.sparkContext._jvm


def scala_map(spark: Any, value: Any) -> dict[str, str]:
    converted = _jvm_of(spark).scala.jdk.javaapi.CollectionConverters.asJava(value)
    return {str(k): str(v) for k, v in dict(converted).items()}


def scala_seq(spark: Any, seq: Any) -> list[str]:
    return [str(x) for x in _jvm_of(spark).scala.jdk.javaapi.CollectionConverters.asJava(seq)]


def plan_nodes(node: Any) -> Iterable[Any]:
    """Pre-order walk of a JVM logical plan."""
    yield node
    children = node.children()
    for i in range(children.size()):
        yield from plan_nodes(children.apply(i))


def relation_of(events: Any) -> Any:
    """The one streaming relation (JVM logical-plan node) ``events`` reads (classic PySpark)."""
    jdf = getattr(events, "_jdf", None)
    if jdf is None:
        raise AuditError(
            "events is not a classic PySpark DataFrame (Spark Connect?); the audit needs the "
            "driver JVM to read the source and checkpoint, so run it in the driver process."
        )
    if not events.isStreaming:
        raise ConfigError(
            "events must be the streaming DataFrame the query reads (spark.readStream...)."
        )
    nodes = list(plan_nodes(jdf.queryExecution().analyzed()))
    relations = [n for n in nodes if n.nodeName().startswith("Streaming")]
    if len(relations) != 1:
        raise UnsupportedSourceError(
            f"events reads {len(relations)} streaming sources; pass one streaming DataFrame per "
            "source (events=[...]), each reading exactly one."
        )
    return relations[0]


def relation_position(query_plan: Any, relation: Any) -> list[int]:
    """Where ``relation`` is among the streaming relations of a query's analysed plan (JVM),
    which is its source index in the checkpoint: matched by its output attributes."""
    wanted = str(relation.output().toString())
    leaves = [
        n
        for n in plan_nodes(query_plan)
        if n.nodeName().startswith("Streaming") and n.children().size() == 0
    ]
    return [i for i, n in enumerate(leaves) if str(n.output().toString()) == wanted]
