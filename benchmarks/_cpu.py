"""CPU seconds per thread, of this Python process and of the Spark driver JVM (Linux /proc).

Wall-clock throughput on a shared machine moves with the neighbours; the CPU a thread used does
much less. A benchmark takes a :class:`CpuSnapshot` before and after a run and prints where the
difference went, grouped by what the thread does (wmwatch's worker, history writer, plan plugin,
metrics server, py4j callbacks; the JVM's listener bus, py4j gateway threads, the query's own
thread, tasks, GC, JIT), so a regression names its thread. Nothing here is read when /proc is
missing: every function then returns empty figures rather than failing the benchmark.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

_TICK_SECONDS = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_JSTACK_THREAD = re.compile(r'^"(?P<name>[^"]*)".*?\bnid=(?P<nid>0x[0-9a-f]+)', re.MULTILINE)


def _task_seconds(pid: int | str) -> dict[int, tuple[str, float]]:
    """{tid: (comm, user+system CPU seconds)} of every live thread of ``pid``."""
    out: dict[int, tuple[str, float]] = {}
    root = Path(f"/proc/{pid}/task")
    try:
        tids = os.listdir(root)
    except OSError:
        return out
    for tid in tids:
        try:
            text = (root / tid / "stat").read_text()
        except OSError:
            continue  # ended meanwhile
        # comm may hold spaces and parentheses: it ends at the last ')'
        comm = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        out[int(tid)] = (comm, (int(fields[11]) + int(fields[12])) * _TICK_SECONDS)
    return out


def _process_seconds(pid: int | str) -> float:
    """User+system CPU seconds of the whole process, threads that have ended included."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) * _TICK_SECONDS


def python_thread_group(thread: threading.Thread) -> str:
    """What a Python thread of a wmwatch process does, from its name or its target's owner."""
    name = thread.name
    if thread is threading.main_thread():
        return "main (benchmark driver)"
    if name.startswith("wmwatch-"):
        return name
    target = getattr(thread, "_target", None)
    owner = type(getattr(target, "__self__", None)).__name__
    if owner in ("ClientServerConnection", "CallbackConnection"):
        return "py4j callback (listener)"
    if owner in ("PythonServer", "CallbackServer", "FinalizerWorker"):
        return "py4j callback server"
    return f"other python ({name})"


def jvm_thread_group(name: str) -> str:
    """What a Spark driver JVM thread does, from its (full or 15-character) name."""
    rules = (
        ("stream execution thread", "query: stream execution thread"),
        ("Executor task launch", "query: task threads"),
        ("spark-listener-group-streams", "listener bus: streams queue"),
        ("spark-listener-group", "listener bus: other queues"),
        ("spark-listener-", "listener bus: queues"),
        ("GC Thread", "jvm: GC"),
        ("G1 ", "jvm: GC"),
        ("C1 CompilerThre", "jvm: JIT"),
        ("C2 CompilerThre", "jvm: JIT"),
        ("Thread-", "py4j gateway / unnamed"),
        ("py4j", "py4j gateway / unnamed"),
    )
    for prefix, group in rules:
        if name.startswith(prefix):
            return group
    return "jvm: other"


def jvm_thread_names(pid: int) -> dict[int, str]:
    """{native tid: full Java thread name} from ``jcmd <pid> Thread.print``; {} without jcmd.

    Linux keeps only 15 characters of a thread's name, too few to tell Spark's listener-bus
    queues apart; the thread dump has the whole name and the native id.
    """
    try:
        out = subprocess.run(
            ["jcmd", str(pid), "Thread.print"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return {int(m.group("nid"), 16): m.group("name") for m in _JSTACK_THREAD.finditer(out)}


@dataclass
class CpuSnapshot:
    """Per-thread CPU seconds of this process and (optionally) the driver JVM at one moment.

    Python threads are named when the snapshot is taken (the thread objects are alive then);
    JVM threads keep their 15-character ``comm`` until :meth:`CpuUse.between` is given the
    full names from a thread dump.
    """

    python_threads: dict[int, tuple[str, float]]
    python_total: float
    jvm_threads: dict[int, tuple[str, float]] = field(default_factory=dict)
    jvm_total: float = 0.0

    @classmethod
    def take(cls, jvm_pid: int | None = None) -> CpuSnapshot:
        groups = {t.native_id: python_thread_group(t) for t in threading.enumerate() if t.native_id}
        python = {
            tid: (groups.get(tid, f"native ({comm})"), seconds)
            for tid, (comm, seconds) in _task_seconds("self").items()
        }
        snap = cls(python, _process_seconds("self"))
        if jvm_pid is not None:
            snap.jvm_threads = _task_seconds(jvm_pid)
            snap.jvm_total = _process_seconds(jvm_pid)
        return snap


def _delta(
    before: dict[int, tuple[str, float]],
    after: dict[int, tuple[str, float]],
    total: float,
    group: Callable[[int, str], str],
) -> dict[str, float]:
    groups: dict[str, float] = {}
    for tid, (label, seconds) in after.items():
        used = seconds - before.get(tid, (label, 0.0))[1]
        key = group(tid, label)
        groups[key] = groups.get(key, 0.0) + used
    ended = total - sum(groups.values())
    if ended > 0.005:
        groups["threads that ended during the run"] = ended
    return groups


@dataclass
class CpuUse:
    """CPU seconds used between two snapshots, by thread group."""

    python: dict[str, float]
    python_total: float
    jvm: dict[str, float]
    jvm_total: float

    @classmethod
    def between(
        cls, before: CpuSnapshot, after: CpuSnapshot, jvm_names: dict[int, str] | None = None
    ) -> CpuUse:
        names = jvm_names or {}
        python_total = after.python_total - before.python_total
        jvm_total = after.jvm_total - before.jvm_total
        return cls(
            _delta(before.python_threads, after.python_threads, python_total, lambda _, g: g),
            python_total,
            _delta(
                before.jvm_threads,
                after.jvm_threads,
                jvm_total,
                lambda tid, comm: jvm_thread_group(names.get(tid, comm)),
            )
            if after.jvm_threads
            else {},
            jvm_total,
        )


def mean_use(uses: Iterable[CpuUse]) -> CpuUse:
    """The mean of several runs' CPU use, group by group."""
    runs = list(uses)
    if not runs:
        return CpuUse({}, 0.0, {}, 0.0)

    def mean(maps: list[dict[str, float]]) -> dict[str, float]:
        keys = {k for m in maps for k in m}
        return {k: sum(m.get(k, 0.0) for m in maps) / len(maps) for k in keys}

    return CpuUse(
        mean([u.python for u in runs]),
        sum(u.python_total for u in runs) / len(runs),
        mean([u.jvm for u in runs]),
        sum(u.jvm_total for u in runs) / len(runs),
    )
