"""Starting Spark for wmwatch's own commands: Delta Lake's jars, and a start that fails in one line.

Delta's jars are fetched by wmwatch, not by Spark's package resolver (``spark.jars.packages``).
That resolver (Ivy) looks in ``~/.m2/repository`` before Maven Central and trusts a pom found
there even when its jar is missing, which is how Maven leaves the versions that lost a conflict:
the JVM then exits before Spark starts. Delta needs two jars and nothing pyspark lacks, so they
are fetched once from Maven Central, checked against the SHA-256 pinned here and handed to
Spark as ``spark.jars``; a jar cache that ``.ci/fetch_jars.sh`` filled is used as it is.

A failed start (no Java, a jar that cannot be fetched, an address Spark cannot bind) becomes a
:class:`~wmwatch._errors.SparkStartError` whose message is one line with what to do; Spark's own
output goes to a log file the message names.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

from wmwatch._errors import SparkStartError
from wmwatch._text import clean, first_line

DELTA_VERSION = "4.4.0"
"""Delta Lake's release for the newest pyspark it runs on (4.2); Maven Central serves its jars."""

# file name -> (path under the repository, SHA-256 of the jar Maven Central serves)
DELTA_JARS: Mapping[str, tuple[str, str]] = {
    f"delta-spark_2.13-{DELTA_VERSION}.jar": (
        f"io/delta/delta-spark_2.13/{DELTA_VERSION}",
        "27d4fd8b1f879535c573ed1c718177d6a27f24d3e626ba02e216369725721ead",
    ),
    f"delta-storage-{DELTA_VERSION}.jar": (
        f"io/delta/delta-storage/{DELTA_VERSION}",
        "c46735481fa8e326b0957be02b4420cbcab4b325bb08009b7f2045a95133f1cc",
    ),
}

MAVEN_CENTRAL = "https://repo1.maven.org/maven2"
_MAX_JAR_BYTES = 64 * 1024 * 1024
_FETCH_TIMEOUT_SECONDS = 30.0


def jar_cache() -> Path:
    """Where wmwatch keeps the jars it fetched (``$WMWATCH_JAR_CACHE``, the tests' cache too)."""
    configured = os.environ.get("WMWATCH_JAR_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "wmwatch" / "jars"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _complete(folder: Path) -> list[Path] | None:
    jars = [folder / name for name in DELTA_JARS]
    for jar, (_, sha256) in zip(jars, DELTA_JARS.values(), strict=True):
        if not jar.is_file() or jar.is_symlink() or _sha256(jar) != sha256:
            return None
    return jars


def delta_jars(cache: Path | None = None, repository: str | None = None) -> list[Path]:
    """Delta Lake's two jars, from the cache or fetched from Maven Central into it.

    ``repository`` (default ``$WMWATCH_MAVEN_REPO``, else Maven Central) can name a mirror; what
    it serves must still match the pinned SHA-256. Raises :class:`SparkStartError`.
    """
    cache = cache if cache is not None else jar_cache()
    # ".ci/fetch_jars.sh" keeps the test set under "delta"; this function under "delta-<version>"
    for folder in (cache / "delta", cache / f"delta-{DELTA_VERSION}"):
        found = _complete(folder)
        if found is not None:
            return found
    base = (repository or os.environ.get("WMWATCH_MAVEN_REPO") or MAVEN_CENTRAL).rstrip("/")
    target = cache / f"delta-{DELTA_VERSION}"
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise SparkStartError(
            f"cannot make the jar cache {target} ({exc.strerror}): set WMWATCH_JAR_CACHE to a "
            "folder you can write"
        ) from None
    for name, (under, sha256) in DELTA_JARS.items():
        jar = target / name
        if jar.is_file() and not jar.is_symlink() and _sha256(jar) == sha256:
            continue
        _fetch(f"{base}/{under}/{name}", jar, sha256)
    return [target / name for name in DELTA_JARS]


def _fetch(url: str, target: Path, sha256: str) -> None:
    """``url`` into ``target`` whole or not at all (a temporary file renamed once it checks)."""
    fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            request = urllib.request.Request(url, headers={"User-Agent": "wmwatch"})
            with urllib.request.urlopen(request, timeout=_FETCH_TIMEOUT_SECONDS) as response:
                size = 0
                while block := response.read(1 << 20):
                    size += len(block)
                    if size > _MAX_JAR_BYTES:
                        raise SparkStartError(f"{url} is larger than a Delta jar can be")
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != sha256:
            raise SparkStartError(
                f"{url} is not the jar Maven Central publishes (its SHA-256 differs): check "
                "WMWATCH_MAVEN_REPO, or remove it to fetch from Maven Central"
            )
        os.chmod(partial, 0o644)
        os.replace(partial, target)
    except (OSError, urllib.error.URLError) as exc:
        reason = getattr(exc, "reason", None) or exc.strerror or exc
        raise SparkStartError(
            f"could not fetch Delta Lake's jar {target.name} from {_origin(url)} ({reason}): "
            "check access to Maven Central, set WMWATCH_MAVEN_REPO to a mirror, or put the "
            f"jars in {target.parent}"
        ) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)


def _origin(url: str) -> str:
    match = re.match(r"^[a-z]+://[^/]+", url)
    return match.group(0) if match else url


def start_session(settings: Mapping[str, str], *, log: Path) -> Any:
    """A classic SparkSession with ``settings``; its JVM's output goes to ``log``.

    Raises :class:`SparkStartError` with one line (what failed, what to do) when Java is missing,
    the JVM exits before it answers, or the driver cannot start.
    """
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway
    from pyspark.sql import SparkSession

    java_home = os.environ.get("JAVA_HOME")
    if java_home and not (Path(java_home) / "bin" / "java").exists():
        raise SparkStartError(
            f"JAVA_HOME is {java_home}, which has no bin/java: point JAVA_HOME at a JDK 17 "
            "or unset it"
        )
    conf = SparkConf(loadDefaults=False)
    for key, value in settings.items():
        conf.set(key, value)
    with log.open("ab") as out:
        try:
            # pyspark declares no types for launch_gateway
            gateway = cast(Any, launch_gateway)(conf, popen_kwargs={"stdout": out, "stderr": out})
        except Exception as exc:  # noqa: BLE001 - any failure here is a start that did not happen
            raise SparkStartError(explain_start_failure(_tail(log), exc, log)) from None
    try:
        context = SparkContext(conf=conf, gateway=gateway)
    except Exception as exc:  # noqa: BLE001
        with contextlib.suppress(Exception):
            gateway.shutdown()
        raise SparkStartError(explain_start_failure(_tail(log), exc, log)) from None
    return SparkSession(context)


def _tail(log: Path, limit: int = 256 * 1024) -> str:
    try:
        with log.open("rb") as handle:
            handle.seek(max(0, log.stat().st_size - limit))
            return handle.read().decode("utf-8", "replace")
    except OSError:
        return ""


# (pattern in Spark's output or the error, what to tell the user); the first match wins
_CAUSES: tuple[tuple[re.Pattern[str], str], ...] = (
    (
        re.compile(r"NOT FOUND\s*\]\s*(\S+)|unresolved dependency:\s*(\S+)"),
        "Spark could not resolve the package {0} (spark.jars.packages): check access to its "
        "repository, or pass the jars with spark.jars",
    ),
    (
        re.compile(r"(Cannot assign requested address|Address already in use)"),
        "Spark could not bind its driver ({0}): set SPARK_LOCAL_IP to an address of this "
        "machine (127.0.0.1 for a local run) or free the port",
    ),
    (
        re.compile(r"UnsupportedClassVersionError|class file version (\d+)"),
        "the java on PATH is too old for Spark: install a JDK 17 and put it on PATH "
        "(or set JAVA_HOME)",
    ),
    (
        re.compile(r"(?:java|JAVA_HOME)[^\n]*(?:not found|No such file|not set)"),
        "Spark could not run java: install a JDK 17 and put it on PATH (or set JAVA_HOME)",
    ),
    (
        re.compile(r"java\.lang\.OutOfMemoryError|Could not reserve enough space"),
        "the JVM could not get its memory: free memory or lower spark.driver.memory",
    ),
)


def explain_start_failure(output: str, error: BaseException, log: Path | None) -> str:
    """One line for a Spark start that failed: the first known cause in Spark's output or the
    error, else the error's first line; with the log's path when there is one."""
    if type(error).__module__.startswith("py4j"):
        # its text is asked of the JVM, which is exiting and may never answer: Spark's output
        # (the log) holds the same stack
        said = type(error).__name__
    else:
        try:
            said = str(error)
        except Exception:  # noqa: BLE001
            said = type(error).__name__
    text = f"{output}\n{said}"
    for pattern, advice in _CAUSES:
        match = pattern.search(text)
        if match:
            detail = next((g for g in match.groups() if g), match.group(0))
            line = advice.format(detail)
            break
    else:
        thrown = re.search(r"^\S*(?:Exception|Error): .*$", output, re.MULTILINE)
        first = thrown.group(0) if thrown else (first_line(said) or type(error).__name__)
        line = f"Spark did not start: {first}"
    if log is not None:
        line += f" (Spark's output: {log})"
    return clean(line, 400)
