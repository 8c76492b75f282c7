"""The test matrix, declared once: which pyspark each environment runs and which tests it runs.

- ``main``: the newest pyspark (the dev extra's pin), every test except the Delta ones.
- ``delta``: pyspark 4.2.0, the newest Delta Lake supports (no Delta release supports 4.3:
  ``delta-spark`` 4.4.1 requires ``pyspark<=4.2.0``), running the Delta tests and a few fast
  smoke tests of the rest, so a break of wmwatch under the older pyspark shows too.

``docs`` builds the documentation site (``mkdocs.yml``) with ``--strict``, into a temporary
folder, so a warning, a broken link or a missing anchor fails.

``.ci/run`` runs ``nox -s docs``, then ``nox -s main`` (with ``nox -s delta-env`` setting up
the Delta environment beside it) and ``nox -s delta``; both test sessions spread their tests
over two processes (pytest-xdist, see ``Env.workers``);
``nox -s delta`` alone sets up ``.venv-delta`` and runs the Delta tests (the jars come from
``.ci/fetch_jars.sh``); ``nox -s delta-env`` only sets it up (``benchmarks/bench_delta.py``
runs itself there). The sessions manage their own virtualenvs (``venv_backend="none"``)
so that ``main`` is the ``.venv`` CI already built.
"""

from __future__ import annotations

import hashlib
import re
import sys
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import nox

ROOT = Path(__file__).parent
nox.options.sessions = ["main", "delta"]


@dataclass(frozen=True)
class Env:
    venv: str
    pyspark: str | None  # None: the dev extra's pin
    extra: tuple[str, ...]
    pytest_args: tuple[str, ...]
    # test processes (pytest-xdist, tests handed out one by one, the longest first:
    # tests/conftest.py): one process uses the other's waits on triggers, JVMs and servers
    workers: int = 0
    # the workers share one Kafka broker and one Spark Connect server, started by the run's
    # controller (tests/conftest.py): for an environment whose tests use them
    shared_servers: bool = False


MATRIX = {
    "main": Env(".venv", None, (), ("-m", "not delta"), workers=2, shared_servers=True),
    # the contributor's loop: every test that starts no JVM and no server (not run by CI alone:
    # main runs these too)
    "quick": Env(
        ".venv",
        None,
        (),
        ("-m", "not (spark or slow or prometheus or kafka or delta or connect or otel)"),
    ),
    "delta": Env(
        ".venv-delta",
        "4.2.0",
        ("delta-spark==4.4.1",),
        (
            "tests/test_audit_delta_spark.py",
            "tests/test_audit_delta_restart_spark.py",
            "tests/test_audit_delta_table_spark.py",
            "tests/test_benchmarks_tiny.py::test_benchmark_runs_tiny[bench_delta]",
            # smoke: the audit, the watch and the checkpoint reader under the older pyspark
            "tests/test_audit_spark.py::test_tumbling_window_conservation[bulk]",
            "tests/test_watch_spark.py",
            "tests/test_checkpoint.py",
        ),
        workers=2,
    ),
}


def dev_requirements(pyspark: str | None) -> list[str]:
    """The dev extra from pyproject.toml, with its pyspark pin replaced by ``pyspark``'s.

    Another pyspark's environment runs tests only, so it leaves out the docs extra's tools.
    """
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    reqs = list(extras["dev"])
    if pyspark is None:
        return reqs
    return [
        f"pyspark[connect]=={pyspark}" if re.match(r"pyspark\b", r) else r
        for r in reqs
        if r not in extras["docs"]
    ]


def _prepare(session: nox.Session, env: Env) -> Path:
    venv = ROOT / env.venv
    bin_dir = venv / "bin"
    # what the last install into a pinned environment installed (its requirements and the
    # project's pyproject.toml): ``nox -s delta`` after ``nox -s delta-env`` (as in CI) or a
    # second run does not run pip again
    stamp = venv / "wmwatch-installed.txt"
    if not (bin_dir / "python").exists():
        stamp.unlink(missing_ok=True)
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
    if env.pyspark is None:
        # the main venv: .ci/run installs it from the dev extra; install it when missing
        if not (bin_dir / "pytest").exists():
            session.run(str(bin_dir / "pip"), "install", "-q", "-e", f"{ROOT}[dev]", external=True)
    else:
        wanted = [str(ROOT), *dev_requirements(env.pyspark), *env.extra]
        project = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
        record = "\n".join([project, *wanted])
        if stamp.is_file() and stamp.read_text() == record:
            return bin_dir
        session.run(str(bin_dir / "pip"), "install", "-q", "-e", *wanted, external=True)
        stamp.write_text(record)
    return bin_dir


def _run(session: nox.Session, name: str) -> None:
    env = MATRIX[name]
    bin_dir = _prepare(session, env)
    # the longest tests first, in the order tests/conftest.py sorts them (not xdist's own)
    spread = (
        ("-n", str(env.workers), "--dist", "loadgroup", "--no-loadscope-reorder")
        if env.workers
        else ()
    )
    # Spark's classes archived once per pyspark and Java, so each JVM of the run starts in a
    # fraction of the time (tests/jvm_archive.py); without it the tests run all the same
    session.run(
        str(bin_dir / "python"), "-m", "tests.jvm_archive", external=True, success_codes=[0, 1]
    )
    session.run(
        str(bin_dir / "pytest"),
        "--durations=40",  # the slowest tests, in every log, to keep CI's time in view
        *spread,
        *env.pytest_args,
        *session.posargs,
        external=True,
        env={
            "SPARK_LOCAL_IP": "127.0.0.1",
            "WMWATCH_TEST_SHARED_SERVERS": "1" if env.shared_servers else "0",
        },
    )


@nox.session(venv_backend="none")
def main(session: nox.Session) -> None:
    """The newest pyspark: every test but the Delta ones."""
    _run(session, "main")


@nox.session(venv_backend="none")
def quick(session: nox.Session) -> None:
    """The tests that start no JVM and no server: the loop while changing code."""
    _run(session, "quick")


@nox.session(venv_backend="none")
def docs(session: nox.Session) -> None:
    """The documentation site, built with --strict: any warning, broken link or anchor fails."""
    bin_dir = ROOT / ".venv" / "bin"
    if not (bin_dir / "mkdocs").exists():
        session.run(sys.executable, "-m", "venv", str(ROOT / ".venv"), external=True)
        session.run(str(bin_dir / "pip"), "install", "-q", "-e", f"{ROOT}[docs]", external=True)
    # built into a folder of its own and thrown away: the check is the build, not the site
    with tempfile.TemporaryDirectory(prefix="wmwatch-site-") as site_dir:
        session.run(
            str(bin_dir / "mkdocs"),
            "build",
            "--strict",
            "--config-file",
            str(ROOT / "mkdocs.yml"),
            "--site-dir",
            site_dir,
            external=True,
            # Material prints a notice about its successor on every build; it is not a warning
            env={"NO_MKDOCS_2_WARNING": "1"},
        )


@nox.session(venv_backend="none")
def delta(session: nox.Session) -> None:
    """pyspark 4.2.0 with Delta Lake: the Delta tests and a smoke of the rest."""
    _run(session, "delta")


@nox.session(name="delta-env", venv_backend="none")
def delta_env(session: nox.Session) -> None:
    """The pyspark 4.2.0 environment with Delta Lake (.venv-delta), made or brought up to date,
    without running tests: what benchmarks/bench_delta.py runs in."""
    _prepare(session, MATRIX["delta"])
