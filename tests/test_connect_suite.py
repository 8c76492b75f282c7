"""The audit's exactness tests and the per-input watermark test, again on Spark Connect.

A process is either a Spark Connect client or classic PySpark (pyspark's functions follow the
mode of the process), so these run in a pytest of their own with ``WMWATCH_TEST_SPARK=connect``:
its ``spark`` fixture connects over loopback to the run's real Spark Connect server process
(``sbin/start-connect-server.sh``, the ``connect_url`` fixture) and its ``kafka`` fixture uses
the run's broker. The same data and the same
balance checks then run through the server: the audit reads the checkpoint through the session,
takes the plan from the query's explain text and its sources' positions from progress, and
fetches late rows over gRPC; the watch follows each input's watermark from progress alone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests.conftest import CONNECT_URL_VARIABLE, KAFKA_VARIABLE

pytestmark = [pytest.mark.spark, pytest.mark.slow(minutes=10)]

ROOT = Path(__file__).parents[1]
CONNECT_TESTS = (
    # windows: the audit starts after the first batch (bulk); before it (each) for windows with
    # the events-as-written scenario below, for the other operators here
    "tests/test_audit_spark.py::test_tumbling_window_conservation[bulk]",
    "tests/test_audit_spark.py::test_sliding_window_conservation[bulk]",
    "tests/test_audit_spark.py::test_drop_duplicates_with_event_time_conservation[each]",
    "tests/test_audit_spark.py::test_drop_duplicates_within_watermark_conservation[bulk]",
    # several inputs: each matched to its source through progress
    "tests/test_audit_join_spark.py::test_join_sides_balance[inner-bulk]",
    "tests/test_audit_join_spark.py::test_join_sides_balance[leftOuter-each]",
    "tests/test_audit_join_spark.py::test_union_of_two_sources_balances[each-min]",
    # hostile names: a Connect server ignores __globPaths__, so the paths are escaped instead;
    # join keys hashed under a key, as in the classic run
    "tests/test_audit_file_names_spark.py::test_glob_characters_in_file_names_keep_the_audit_exact",
    "tests/test_audit_privacy_spark.py::test_join_keys_follow_columns_and_hash_columns_with_a_hash_key",
    # a Python data source: its class is found in the client, its reader runs on the server
    "tests/test_audit_pysource.py::test_audit_of_a_python_source_balances[23]",
    "tests/test_watermarks_spark.py::test_idle_input_named_as_holding_the_watermark_back",
    # what only a Connect client does: the stock listener, plan facts from explain text
    "tests/test_connect.py::test_spark_connect_queries_are_watched_with_the_stock_listener",
    "tests/test_connect.py::test_connect_join_classified_from_plan_text",
    # the audit's jobs are interrupted by the server at their deadline
    "tests/test_spark_jobs.py::test_a_job_past_its_deadline_is_cancelled_and_the_session_goes_on",
    # events as written: the client's own plan rewritten over each batch's read
    "tests/test_audit_events_spark.py::test_window_count_over_parsed_text_is_audited_as_written[each]",
    "tests/test_audit_events_spark.py::test_drop_duplicates_over_parsed_text_is_audited_as_written",
    "tests/test_audit_events_spark.py::test_a_non_deterministic_filter_is_refused_and_prepare_overrides",
    "tests/test_audit_events_spark.py::test_what_cannot_be_replayed_is_named",
    # a Python UDF marked non-deterministic: the client's plan says so, the server's text not
    "tests/test_audit_events_spark.py::test_a_python_udf_marked_non_deterministic_is_refused",
    # Kafka: options off the client's plan, the source's position from its progress
    # description, deleted records found by Spark's reader (KAFKA_DATA_LOSS); the larger
    # batches (fewer of them: the smaller ones run in the classic session). A stream-stream join
    # over Kafka runs in the classic session only: on Connect, a join's inputs are matched to
    # their sources by the file joins above, and a Kafka source's position by these two
    "tests/test_audit_kafka_spark.py::test_kafka_windowed_count_is_exact[large-15]",
    "tests/test_audit_kafka_spark.py::test_kafka_drop_duplicates_is_exact[large-15]",
    "tests/test_audit_kafka_spark.py::test_kafka_records_deleted_before_the_audit_are_counted_lost",
    # the checkpoint read through the session: the classic reader's bounds
    "tests/test_safety_connect_reads.py::test_connect_checkpoint_reads_take_regular_files_within_the_bound_only",
)


def test_exactness_tests_pass_on_a_spark_connect_server(
    tmp_path: Path, connect_url: str, kafka: str
) -> None:
    junit = tmp_path / "connect.xml"
    # the run's own server and broker: the pytest below starts neither again
    env = {
        **os.environ,
        "WMWATCH_TEST_SPARK": "connect",
        CONNECT_URL_VARIABLE: connect_url,
        KAFKA_VARIABLE: kafka,
    }
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            f"--basetemp={tmp_path / 'tmp'}",
            *CONNECT_TESTS,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert junit.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    outcomes: dict[str, str] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        failed = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcomes[name] = failed[0] if failed else "passed"
    assert outcomes == dict.fromkeys(CONNECT_TESTS, "passed"), run.stdout[-6000:]
    assert run.returncode == 0, run.stdout[-3000:]
