"""The crash-driver base: a production driver in a process of its own, SIGKILLed mid-stream and
started again on the same checkpoint and history.

The driver side (``tests/*_driver.py`` build their queries on it): :func:`driver_session` (a
small local session), :func:`record_progress` (every progress event appended to
``<folder>/progress.jsonl`` as it comes: Spark's own counts, across both runs) and
:func:`serve` (``run``: process and print the audit's status until killed; ``finish``: process
what is there, wait for the audit, print ``{"done": ...}`` and exit).

The test side: :func:`start_driver`, its JSON lines (:func:`status_lines`,
:func:`wait_for_status`), :func:`sigkill`, :func:`ensure_stopped`, :func:`finish`, and what the
driver recorded (:func:`recorded_progress`, :func:`wait_for_progress`,
:func:`spark_dropped_by_batch`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from wmwatch._checkpoint.reader import CheckpointReader

ROOT = Path(__file__).resolve().parents[2]
# every guard below is against a hang only: a driver on a busy machine is slow, never this slow
WAIT_SECONDS = 240

# -- the driver's side ----------------------------------------------------------------------------

# One core's worth of everything: the test's own session runs beside it
_DRIVER_CONF = {
    "spark.sql.shuffle.partitions": "1",
    "spark.default.parallelism": "1",
    "spark.ui.enabled": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.driver.memory": "512m",
    "spark.sql.adaptive.enabled": "false",
}
# audit pools can yield to the production query's jobs
FAIR = {"spark.scheduler.mode": "FAIR"}


def driver_session(
    app_name: str, *, master: str = "local[2]", conf: Mapping[str, str] | None = None
) -> Any:
    """The driver's SparkSession: :data:`_DRIVER_CONF` and ``conf``."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in {**_DRIVER_CONF, **(conf or {})}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def record_progress(spark: Any, folder: str) -> None:
    """Append each progress event to ``<folder>/progress.jsonl`` and flush it at once."""
    from pyspark.sql.streaming import StreamingQueryListener

    path = f"{folder}/progress.jsonl"

    class Recorder(StreamingQueryListener):
        def onQueryStarted(self, event: Any) -> None:  # noqa: N802 - Spark's callback name
            pass

        def onQueryProgress(self, event: Any) -> None:  # noqa: N802 - Spark's callback name
            with open(path, "a") as handle:
                handle.write(event.progress.json.replace("\n", " ") + "\n")

        def onQueryIdle(self, event: Any) -> None:  # noqa: N802 - Spark's callback name
            pass

        def onQueryTerminated(self, event: Any) -> None:  # noqa: N802 - Spark's callback name
            pass

    spark.streams.addListener(Recorder())


def serve(
    spark: Any,
    watch: Any,
    running: Sequence[tuple[Any, Any]],
    mode: str,
    status: Callable[[], dict[str, Any]] | None = None,
) -> int:
    """Drive the audited ``(query, audit handle)`` pairs: ``finish`` processes what is there,
    waits for every audit, prints ``{"done": ok, **status}`` and stops everything (exit code
    0 if all was audited); ``run`` processes and prints ``status()`` (default: the first
    audit's) until the process is killed."""
    status = status or running[0][1].status
    if mode == "finish":
        for query, _ in running:
            query.processAllAvailable()
        ok = all(handle.sync(120) for _, handle in running) and watch.flush(30)
        print(json.dumps({"done": ok, **status()}), flush=True)
        stop_all(spark, watch, running)
        return 0 if ok else 1
    while True:
        for query, _ in running:
            query.processAllAvailable()
        watch.flush(10)  # progress on disk before a kill, so the test can compare counts
        print(json.dumps(status()), flush=True)
        time.sleep(0.2)


def stop_all(spark: Any, watch: Any, running: Sequence[tuple[Any, Any | None]]) -> None:
    """Stop each audit (None: not audited) and its query, then the watch and the session."""
    for query, handle in running:
        if handle is not None:
            handle.stop()
        query.stop()
    watch.close()
    spark.stop()


# -- the test's side ------------------------------------------------------------------------------


def start_driver(module: str, *args: str) -> subprocess.Popen[str]:
    """``python -m module args`` from the repository root, its stdout piped (its lines); its
    stderr kept in a file beside the driver's folder (its first argument), so that a driver
    that ends early says why."""
    folder = Path(args[0]) if args and Path(args[0]).is_dir() else None
    stderr: Any = subprocess.DEVNULL
    if folder is not None:
        stderr = tempfile.NamedTemporaryFile(  # noqa: SIM115 - the process writes it; closed below
            "w", dir=folder, prefix=f"{module.rsplit('.', 1)[-1]}-", suffix=".stderr", delete=False
        )
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        if folder is not None:
            stderr.close()  # the child has its own copy
    if folder is not None:
        _STDERR_FILES[proc.pid] = Path(stderr.name)
    return proc


# each driver's stderr file, by its pid
_STDERR_FILES: dict[int, Path] = {}


class StatusLines(queue.Queue[dict[str, Any] | None]):
    """A driver's JSON lines as they come; None once its output ends, and ``why`` then says
    how the process ended (its exit status and the end of its stderr)."""

    why = "the driver's output ended"


def status_lines(proc: subprocess.Popen[str]) -> StatusLines:
    """A process's JSON lines as they come; None once its output ends."""
    lines = StatusLines()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("{"):
                lines.put(json.loads(line))
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(30)
        lines.why = f"exit status {proc.returncode}{_stderr_tail(proc)}"
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _stderr_tail(proc: subprocess.Popen[str]) -> str:
    path = _STDERR_FILES.get(proc.pid)
    if path is None or not path.is_file():
        return ""
    tail = [line for line in path.read_text(errors="replace").splitlines() if line.strip()][-8:]
    return "; its stderr ends:\n" + "\n".join(tail)


def wait_for_status(
    lines: queue.Queue[dict[str, Any] | None],
    wanted: Callable[[dict[str, Any]], bool],
    timeout: float = WAIT_SECONDS,
) -> dict[str, Any]:
    """The first line that satisfies ``wanted`` (the timeout only guards against a hang)."""
    while True:
        status = lines.get(timeout=timeout)
        why = getattr(lines, "why", "")
        assert status is not None, f"the process ended before reporting the wanted status: {why}"
        if wanted(status):
            return status


def sigkill(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the driver (whatever it is doing) and check that it was that which ended it."""
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL


def ensure_stopped(proc: subprocess.Popen[str]) -> None:
    """Kill the driver if it still runs (after a failure), and reap it."""
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)


def finish(module: str, *args: str, timeout: float = WAIT_SECONDS) -> dict[str, Any]:
    """Start the driver in ``finish`` mode (``args`` say so); its final status once all is
    audited, after it exited cleanly."""
    proc = start_driver(module, *args)
    finished = wait_for_status(status_lines(proc), lambda status: "done" in status, timeout)
    assert proc.wait(WAIT_SECONDS) == 0
    assert finished["done"] is True
    return finished


def recorded_progress(folder: Path) -> dict[int, dict[str, Any]]:
    """The progress events the driver recorded, by batch (both runs; a batch runs once)."""
    path = folder / "progress.jsonl"
    if not path.exists():
        return {}
    lines = path.read_text().splitlines()
    # a line cut off by the kill is not an event
    events = [json.loads(line) for line in lines if line.endswith("}")]
    return {e["batchId"]: e for e in events if e["numInputRows"] or e["stateOperators"]}


def wait_for_progress(
    folder: Path, proc: subprocess.Popen[str], reached: Callable[[Any], bool], what: str
) -> int:
    """Wait until the progress of a batch whose first source's end offset is ``reached`` was
    recorded; its id."""
    deadline = time.monotonic() + WAIT_SECONDS
    while True:
        assert proc.poll() is None, f"the driver stopped before reading the new {what}"
        for batch_id, event in sorted(recorded_progress(folder).items(), reverse=True):
            end = event["sources"][0]["endOffset"]  # an object for Kafka and Delta, text for some
            if reached(json.loads(end) if isinstance(end, str) else end):
                return batch_id
        assert time.monotonic() < deadline, f"no batch read the new {what}"
        time.sleep(0.05)


def spark_dropped_by_batch(folder: Path, reader: CheckpointReader) -> dict[int, int]:
    """Spark's own count of rows dropped by the watermark, per committed batch, across both runs.

    Progress reaches a listener after ``commits/N`` is written, so a SIGKILL can fall between
    them: the batch then has no recorded progress. Only a batch that read no input can be in that
    gap here (the kill waits for the progress of the last batch that read data; what follows is
    a no-data batch that moves the watermark), and a batch that read no input dropped none. That
    is checked from the checkpoint, never assumed.
    """
    progress = recorded_progress(folder)
    dropped = {
        batch: sum(op.get("numRowsDroppedByWatermark", 0) for op in event["stateOperators"])
        for batch, event in progress.items()
    }
    for batch in reader.committed_batches():
        if batch in dropped:
            continue
        entry, before = reader.offsets(batch), reader.offsets(batch - 1)
        assert entry is not None and before is not None, f"batch {batch}: offsets missing"
        assert entry.source_offsets == before.source_offsets, (
            f"committed batch {batch} read input but its progress was never recorded"
        )
        dropped[batch] = 0
    return dropped
