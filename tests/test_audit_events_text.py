"""What Spark Connect's ``events`` as written refuses, read off plan text and the client's UDF
flags, without a server; the real Connect run is in tests/test_audit_events_spark.py (through
tests/test_connect_suite.py)."""

from __future__ import annotations

import pytest

from wmwatch._audit.replay.events_connect import python_udf_calls, refusal


@pytest.mark.parametrize(
    ("line", "names"),
    [
        ("Project [<lambda>(cast(id#27L as int))#28 AS y#29]", ["<lambda>"]),
        ("Filter (jitter(value#0)#12 > 3)", ["jitter"]),
        ("Project [f(a#1, g(b#2))#40L AS z#5, upper(v#1) AS u#3]", ["f"]),
        ("Project [id#0, to_timestamp(ts#1, None, TimestampType, Some(UTC), true) AS ts#2]", []),
        ("Aggregate [count(1) AS count#5L]", []),
    ],
)
def test_python_udf_calls_are_the_calls_followed_by_a_result_id(
    line: str, names: list[str]
) -> None:
    assert python_udf_calls(line) == names


_PLAN = """Project [value#0, jitter(value#0)#4 AS v#5]
+- StreamingRelationV2 text, [value#0]
"""


def test_a_udf_is_refused_unless_the_clients_plan_says_it_is_deterministic() -> None:
    marked = refusal(_PLAN, {"jitter": False})
    assert marked is not None and "jitter(), a Python UDF marked non-deterministic" in marked
    assert refusal(_PLAN, {"jitter": True}) is None
    by_name = refusal(_PLAN, {})
    assert by_name is not None and "jitter by a registered name" in by_name
    assert "prepare=" in by_name
