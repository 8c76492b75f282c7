"""The machine a benchmark ran on, printed at the top of every benchmark's output.

Absolute figures differ several-fold between machines; ratios measured side by side in one run
travel. Every benchmark prints this line so a figure always says where it came from.
"""

from __future__ import annotations

import os
import platform
import re
import subprocess


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return re.sub(r"\s+", " ", line.split(":", 1)[1]).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _java_version() -> str:
    try:
        out = subprocess.run(
            ["java", "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return "no java"
    match = re.search(r'version "([^"]+)"', out.stderr or out.stdout)
    return f"Java {match.group(1)}" if match else "java (version unknown)"


def _memory_gib() -> str:
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 1024 / 1024:.0f} GiB"
    except OSError:
        pass
    return "? GiB"


def describe() -> str:
    """One line: cores, CPU model, memory, Python, Java, OS."""
    return (
        f"{os.cpu_count()} cores, {_cpu_model()}, {_memory_gib()}, "
        f"Python {platform.python_version()}, {_java_version()}, "
        f"{platform.system()} {platform.release()}"
    )


def print_machine() -> str:
    """Print and return the machine line (call first thing in a benchmark's main)."""
    line = describe()
    print(f"machine: {line}", flush=True)
    return line


if __name__ == "__main__":
    print_machine()
