"""wmwatch on a real Spark standalone cluster: a master and a worker started from the pyspark
package, executors in JVMs of their own, the driver in a process of its own.

Everything binds to 127.0.0.1; the cluster is stopped whatever happens, and every wait is
bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import duckdb
import pytest
from typer.testing import CliRunner

from tests.harness.net import free_port
from wmwatch.cli import app

ROOT = Path(__file__).resolve().parent.parent


def _spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def _wait(check: Any, what: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if check():
                return
        assert proc.poll() is None, f"{what}: the process ended with {proc.returncode}"
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.5)


def _listening(port: int) -> bool:
    with socket.create_connection(("127.0.0.1", port), timeout=1):
        return True


def _alive_workers(webui_port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{webui_port}/json/", timeout=3) as response:
        return int(json.load(response).get("aliveworkers", 0))


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group we started (the worker's executors included), then KILL."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A standalone master and one worker (1 core, 1 GiB) on loopback, shared by this module's
    tests (each driver is a process of its own); its master URL."""
    tmp_path = tmp_path_factory.mktemp("cluster")
    home = _spark_home()
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOCAL_DIRS": str(tmp_path / "local"),
        "SPARK_WORKER_DIR": str(tmp_path / "work"),
        "PYSPARK_PYTHON": sys.executable,
        # the master and the worker start like the run's other Spark JVMs (tests/jvm_archive.py)
        "SPARK_DAEMON_JAVA_OPTS": os.environ.get("SPARK_SUBMIT_OPTS", ""),
    }
    port, ui, worker_ui = free_port(), free_port(), free_port()
    klass = "org.apache.spark.deploy"
    started: list[subprocess.Popen[bytes]] = []

    def launch(name: str, *args: str) -> subprocess.Popen[bytes]:
        log = (tmp_path / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            [str(home / "bin" / "spark-class"), *args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        started.append(proc)
        return proc

    try:
        master = launch(
            "master",
            f"{klass}.master.Master",
            "--host", "127.0.0.1", "--port", str(port), "--webui-port", str(ui),
        )  # fmt: skip
        _wait(lambda: _listening(port), "the master to listen", 120, master)
        url = f"spark://127.0.0.1:{port}"
        worker = launch(
            "worker",
            f"{klass}.worker.Worker", url,
            "--host", "127.0.0.1", "--cores", "1", "--memory", "1g",
            "--webui-port", str(worker_ui), "--work-dir", str(tmp_path / "work"),
        )  # fmt: skip
        _wait(lambda: _alive_workers(ui) == 1, "the worker to register", 120, worker)
        yield url
    finally:
        for proc in reversed(started):
            _stop(proc)


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable},
        check=False,
    )


@pytest.mark.spark
@pytest.mark.slow(minutes=2)
def test_everything_works_when_executors_are_not_the_driver(cluster: str, tmp_path: Path) -> None:
    run = _run(
        [sys.executable, str(ROOT / "tests" / "scripts" / "cluster_run.py"), cluster,
         str(tmp_path / "job")],
        timeout=420,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-4000:]
    facts = json.loads(run.stdout.strip().splitlines()[-1])
    assert facts["master"] == cluster
    assert facts["executors"], "no executor registered: the queries ran in the driver"
    # the audit: every batch marked, late rows found, and every closed window balances
    status = facts["audit_status"]
    assert facts["audit_synced"] is True
    assert status["errors"] == 0, status["last_error"]
    assert status["batches_lost"] == 0
    assert facts["marked_batches"] == status["latest_committed_batch"] + 1
    assert facts["late_rows"] > 0 and facts["late_rows"] == status["late_rows"]
    assert facts["late_rows_metric"] == facts["late_rows"]
    assert facts["closed_windows"] >= 8
    assert facts["unbalanced_windows"] == []
    # history and metrics of both queries
    assert facts["history_batches"]["cluster_windows"] >= 8
    assert facts["history_batches"]["cluster_join"] >= 4
    for metric in (
        "wmwatch_watermark_seconds{query=cluster_windows}",
        "wmwatch_batches_total{query=cluster_join}",
        "wmwatch_audit_batches_lost_total{query=cluster_windows}",
        "wmwatch_join_state_unbounded{query=cluster_join,side=left}",
        "wmwatch_join_state_unbounded{query=cluster_join,side=right}",
    ):
        assert metric in facts["metrics"], metric
    # join findings and per-input watermarks, read from the driver's plan of cluster executors
    unbounded = [
        ("join_state_unbounded", "left", "active"),
        ("join_state_unbounded", "right", "active"),
    ]
    assert [tuple(f) for f in facts["join_findings"] if f[0] == "join_state_unbounded"] == unbounded
    assert [tuple(f) for f in facts["findings_rows"] if f[0] == "join_state_unbounded"] == unbounded
    assert [name for name, _ in facts["join_sources"]] == ["l", "r"]
    assert all(watermark for _, watermark in facts["join_sources"])
    assert facts["source_watermarks"] == 2


@pytest.mark.spark
@pytest.mark.slow(minutes=1.5)
def test_demo_runs_on_the_cluster_with_the_audit_balanced(cluster: str, tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    run = _run(
        [sys.executable, "-m", "wmwatch.cli", "demo", "--master", cluster, "--duration", "20",
         "--port", "0", "--workdir", str(workdir)],
        timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    assert f"a SparkSession on {cluster}" in " ".join(run.stdout.split())
    with duckdb.connect(str(workdir / "wmwatch.duckdb"), read_only=True) as con:
        dropped = dict(
            con.execute("SELECT batch_id, rows_dropped_by_watermark FROM batches").fetchall()
        )
        marked = {r[0] for r in con.execute("SELECT batch_id FROM audit_batches").fetchall()}
        late = con.execute(
            "SELECT batch_id, epoch_ms(window_start_at), json_extract_string(row_data, 'user') "
            "FROM late_rows"
        ).fetchall()
    assert late, "the demo's stream produced no late rows"
    assert set(dropped) <= marked, "batches the query ran that the audit did not mark"
    # Spark counts late groups (window, user) per batch; the audit found exactly their rows
    groups = Counter(batch_id for batch_id, _ in {(b, (w, u)) for b, w, u in late})
    for batch_id, count in dropped.items():
        assert groups.get(batch_id, 0) == (count or 0), batch_id
    # the terminal may wrap the summary line
    assert f"wmwatch audited {len(late)} late row(s)" in " ".join(run.stdout.split())


def test_demo_refuses_a_master_that_is_not_a_spark_url() -> None:
    result = CliRunner().invoke(app, ["demo", "--master", "cluster-7"])
    assert result.exit_code == 2
    assert "is not a Spark master URL" in result.output
    assert len(result.output.strip().splitlines()) == 1
