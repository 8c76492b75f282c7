"""wmwatch's own Spark jobs are cancelled at their deadline, on classic PySpark and on Spark
Connect (where ``tests/test_connect_suite.py`` runs this module again)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from wmwatch._core.spark_jobs import JobTimeoutError, bounded_job

pytestmark = pytest.mark.spark


def test_a_job_past_its_deadline_is_cancelled_and_the_session_goes_on(spark: Any) -> None:
    # one task that would sleep for a minute (the id keeps the optimizer from running it)
    slow = spark.range(1).selectExpr(
        "java_method('java.lang.Thread', 'sleep', id + 60000L) AS slept"
    )
    started = time.monotonic()
    with (
        pytest.raises(JobTimeoutError, match="took longer than 1 s and was cancelled"),
        bounded_job(spark, description="wmwatch test job", timeout_seconds=1),
    ):
        slow.collect()
    # the deadline ended it, not the sleep
    assert time.monotonic() - started < 45
    with bounded_job(spark, description="wmwatch test job", timeout_seconds=60):
        assert spark.range(3).count() == 3
