"""Why ``events`` cannot be replayed as written: the reasons, worded once for the classic
replay (:mod:`wmwatch._audit.replay.events`, which reads the plan's nodes over py4j) and the Spark
Connect one (:mod:`wmwatch._audit.replay.events_connect`, which reads the analysed plan's text).
"""

from __future__ import annotations

import re

from wmwatch._errors import AuditError

# steps whose output depends on earlier batches (state) or on a whole stream
STATEFUL_PREFIXES = (
    "Aggregate",
    "Deduplicate",
    "Distinct",
    "Join",
    "FlatMapGroupsWithState",
    "FlatMapGroupsInPandasWithState",
    "TransformWithState",
    "GlobalLimit",
    "LocalLimit",
    "Limit",
    "Window",
    "CoGroup",
    "FlatMapCoGroups",
    "Intersect",
    "Except",
)

# Spark's non-deterministic functions and those whose value is the time a batch ran, as its
# plan text and SQL print them (the classic check names one by them; Spark Connect finds them so)
NONDETERMINISTIC_CALL = re.compile(
    r"\b(rand|randn|random|randstr|uniform|uuid|shuffle|monotonically_increasing_id|"
    r"spark_partition_id|input_file_name|input_file_block_start|input_file_block_length)\([^)]*\)"
)
BATCH_TIME_CALL = re.compile(
    r"\b(current_timestamp|now|current_date|current_time|localtimestamp)\([^)]*\)"
)

_DETERMINISTIC_HINT = (
    "make that step deterministic or pass prepare=, a function that turns the raw source rows "
    "into events"
)


def stateful_reason(name: str) -> str | None:
    """Why a plan node named ``name`` cannot be replayed over one batch, or None."""
    if name.startswith("Join"):
        # with one streaming read in events, the other side is a table read as it is now
        return (
            "it joins its stream with another DataFrame (Join), which a replay would read as it "
            "is now; pass as events the DataFrame the join reads, or prepare="
        )
    if name.startswith(STATEFUL_PREFIXES):
        return (
            f"it has a stateful step ({name}) before the query's first stateful operator, whose "
            "output depends on earlier batches; pass as events the DataFrame that step reads"
        )
    if name == "Sample":
        return (
            "it samples rows at random (sample()), so a replay would keep other rows; "
            + _DETERMINISTIC_HINT
        )
    return None


def batch_time_reason(expression: str) -> str:
    return (
        f"it uses {expression}, whose value is the time each batch ran, which a replay cannot "
        f"know; {_DETERMINISTIC_HINT}"
    )


def nondeterministic_reason(expression: str) -> str:
    return (
        f"it uses {expression}, which is not deterministic, so a replay would not see the rows "
        f"the query saw; {_DETERMINISTIC_HINT}"
    )


def too_large_reason(limit: int, where: str) -> str:
    return (
        f"its plan has more than {limit:,} expressions to examine ({where}), more than the "
        f"audit checks for non-deterministic ones; {_DETERMINISTIC_HINT}"
    )


def refused(reason: str) -> AuditError:
    """The one-line refusal of ``events`` for ``reason``."""
    return AuditError(f"events cannot be replayed as written: {reason}.")
