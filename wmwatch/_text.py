"""Cleaning text where it enters wmwatch: credentials masked, control characters dropped,
invalid UTF-8 replaced, one line kept.

Text from Spark (query names, source descriptions, exception messages, progress JSON) is cleaned
once, when it is parsed; what is stored, exported and reported downstream is already clean.
Control characters (ESC, the C1 controls, DEL) are dropped with it: an ``ESC[2J`` or OSC
sequence in a query name or a path would otherwise drive the terminal that shows it.

What is masked follows the OWASP logging cheat sheet (passwords, keys, tokens, session ids,
connection strings never reach a log): the password of a URL (``scheme://user:secret@host``,
``/`` allowed in the secret), the value of every ``key=value``, ``key: value``, ``"key": "value"``
pair whose key names a secret (quoted values whole, escaped quotes included), ``Bearer`` tokens,
and values behind keys written with ``\\u`` escapes. JSON documents are masked value by value
(:func:`redact_json`) and serialised again, never masked as text.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "***"

# Keys whose value is a secret, as regex fragments (``[_.\-]?`` lets a separator sit between the
# words). No boundary before a key: ``db_password``, ``X-Amz-Signature``, ``fs.s3a.secret.key``
# and ``spark.hadoop.fs.azure.account.key.<acct>.blob.core.windows.net`` all end in one.
_SEP = r"[_.\-]?"
_NAME_PART = r"(?:\.[A-Za-z0-9_\-]+)*"  # an account or container name after an Azure key
SECRET_KEYS = (
    "password",
    "passwd",
    "passphrase",
    "pwd",
    "secret",
    "token",
    f"access{_SEP}key",
    f"secret{_SEP}key",
    f"private{_SEP}key",
    f"session{_SEP}token",
    f"session{_SEP}id",
    f"api{_SEP}key",
    f"account{_SEP}key{_NAME_PART}",
    f"sas{_NAME_PART}",
    "sig",
    "signature",
    "credential",
    "authorization",
)
_KEY = "(?:" + "|".join(SECRET_KEYS) + ")s?"
# A value: double- or single-quoted (escapes inside kept in the mask; an unclosed quote masks
# to the end), or bare up to a delimiter (an HTTP auth scheme before it is masked with it).
_VALUE = (
    r"(?P<dq>\")(?:[^\"\\]|\\.)*(?P<dqc>\"?)"
    r"|(?P<sq>')(?:[^'\\]|\\.)*(?P<sqc>'?)"
    r"|(?P<eq>\\\")(?:[^\\]|\\(?!\"))*(?P<eqc>(?:\\\")?)"
    r"|(?:(?:basic|bearer|digest|negotiate|aws4-hmac-sha256)\s+)?[^\s,;&\]\)}\"']+"
)

# (pattern, replacement template) in the order they run; templates use only named groups so
# that :func:`spark_redact` runs the same rules in the JVM (Java names groups the same way).
_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    # key=value, key: value, "key": "value", key='value' whose key names a secret (first: a
    # bare value may hold "@", where the URL rule would cut it)
    (
        re.compile(
            rf"(?P<key>{_KEY})(?P<kq>(?:\\?[\"'])?)(?P<sep>\s*[=:]\s*)(?:{_VALUE})",
            re.IGNORECASE,
        ),
        r"\g<key>\g<kq>\g<sep>\g<dq>\g<sq>\g<eq>" + REDACTED + r"\g<dqc>\g<sqc>\g<eqc>",
    ),
    # scheme://user:secret@host  ->  scheme://***@host (the secret may hold "/": AWS keys do).
    # Bounded lengths, and a scheme only where a word starts: linear time on hostile text.
    (
        re.compile(
            r"(?<![A-Za-z0-9+.\-])(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]{0,31}://)"
            r"(?P<userinfo>[^/@\s\]\[:]{0,256}:[^@\s]{0,1024}|[^/@\s\]\[]{1,256})@"
        ),
        r"\g<scheme>" + REDACTED + "@",
    ),
    # Authorization: Bearer <token> anywhere (an exception that quotes a header)
    (
        re.compile(r"(?P<scheme>\bbearer\s+)[A-Za-z0-9\-._~+/]+=*", re.IGNORECASE),
        r"\g<scheme>" + REDACTED,
    ),
)

# A whole key (of a JSON object, an option map) that names a secret.
_SECRET_NAME = re.compile(rf"{_KEY}$", re.IGNORECASE)
# A \uXXXX escape that is not half of a surrogate pair: keys spelled with escapes are decoded
# before masking (``pass\u0077ord=x``).
_UNICODE_ESCAPE = re.compile(r"\\u(?![dD][89a-fA-F])([0-9a-fA-F]{4})")

# Stems of every secret key and rule above (a URL's password needs an "@"); a test keeps the
# lists in step.
_SECRET_STEMS = (
    "pass", "pwd", "secret", "token", "key", "session", "sas", "sig", "credential", "auth",
    "bearer",
)  # fmt: skip


def redact(text: str) -> str:
    """Return ``text`` with URL credentials, secret-looking pairs and bearer tokens masked."""
    if not text or not _may_hold_secret(text):
        return text
    return _mask(text)


def is_secret_name(name: str) -> bool:
    """Whether ``name`` (a JSON key, an option's name) names a secret: its value is masked."""
    # the same few dozen keys come in every progress document: short ones are looked up
    return _is_secret_short_name(name) if len(name) <= 100 else _names_secret(name)


@functools.lru_cache(maxsize=4096)
def _is_secret_short_name(name: str) -> bool:
    return _names_secret(name)


def _names_secret(name: str) -> bool:
    return _may_hold_secret(name) and _SECRET_NAME.search(name) is not None


def _may_hold_secret(text: str) -> bool:
    # Skips every regex pass (about 0.2 ms over a progress document) for text that cannot hold
    # a credential. Only ASCII text is ruled out by substring tests: the patterns ignore case,
    # and some non-ASCII letters match ASCII ones (the long s, the Kelvin sign, the dotted and
    # dotless i). A \u escape may spell any key.
    if not text.isascii() or "@" in text or "\\u" in text:
        return True
    lowered = text.lower()
    return any(stem in lowered for stem in _SECRET_STEMS)


def _mask(text: str) -> str:
    masked = _apply_rules(text)
    if "\\u" in masked:
        decoded = _UNICODE_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), masked)
        redecoded = _apply_rules(decoded)
        if redecoded != decoded:
            return redecoded  # a key spelled with escapes: keep the decoded, masked text
    return masked


def _apply_rules(text: str) -> str:
    for pattern, template in _RULES:
        text = pattern.sub(template, text)
    return text


# C0 controls but tab and newline (text keeps its lines: exception messages, tracebacks), DEL and
# the C1 controls (U+009B is a one-character CSI to some terminals).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` without the control characters a terminal acts on (ESC sequences, bells,
    carriage returns); tabs and newlines are kept."""
    return _CONTROL.sub("", text)


def valid_utf8(text: str) -> str:
    """``text`` as valid UTF-8: lone surrogates (legal in Python strings and JSON escapes, not in
    UTF-8) become ``?``, since DuckDB and the exposition format refuse them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def clean(text: str, limit: int | None = None) -> str:
    """``text`` redacted, without control characters, then cut to ``limit`` characters, as
    valid UTF-8: how every piece of free text from outside (Spark, a checkpoint, a path given
    on the command line) is kept and shown. Redacting first: a cut through a credential must
    not leave the part before the cut unmasked."""
    return valid_utf8(printable(redact(text))[:limit])


def redact_json(value: Any, secret: bool = False) -> Any:
    """A decoded JSON ``value`` with every secret masked: the value of each key that names a
    secret (whatever it holds), and every string (keys included) cleaned as :func:`clean`
    cleans it; non-finite numbers (which JSON cannot hold) become null."""
    if isinstance(value, str):
        return REDACTED if secret else clean(value)
    if isinstance(value, Mapping):
        return {
            clean(str(key)): redact_json(item, secret or is_secret_name(str(key)))
            for key, item in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact_json(item, secret) for item in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, int | float):
        return REDACTED if secret else value
    return REDACTED if secret else clean(str(value))


# JSON's short escapes of control characters that clean() drops (tab and newline are kept)
_CONTROL_ESCAPES = ("\\b", "\\f", "\\r")


def clean_json(doc: Any, text: str) -> str | None:
    """``text``, the JSON of the decoded ``doc``, as wmwatch may keep it: valid JSON that
    DuckDB accepts, with every secret masked and every string cleaned (:func:`redact_json`).

    Text that can hold no secret, lone surrogate, control character or non-finite number is
    kept as it is (no serialising); any other is built again from the masked document, never
    masked as text (a mask through an escaped quote broke the document). None when the document
    cannot be serialised at all (nested past Python's recursion limit): the caller keeps the
    rest.
    """
    if (
        not _may_hold_secret(text)  # a "\u" escape (any control character included) too
        and not any(escape in text for escape in _CONTROL_ESCAPES)
        and "NaN" not in text
        and "Infinity" not in text
    ):
        return text
    try:
        return json.dumps(redact_json(doc), ensure_ascii=False, separators=(",", ":"))
    except (RecursionError, ValueError, TypeError):
        return None


# Every secret key holds one of these words (lower case), so a text of printable ASCII (tabs
# and newlines too) with none of them beside a "=" or ":", no "@" and no "bearer" is one that
# no rule changes: :func:`spark_redact` leaves such a text (most file paths) as it is without
# running the rules' regular expressions, which cost the JVM several seconds per million rows.
_KEY_WORDS = (
    "pass",
    "pwd",
    "secret",
    "token",
    "key",
    "session",
    "sas",
    "sig",
    "credential",
    "authorization",
)
_NOT_PLAIN_ASCII = r"[^\t\n\x20-\x7e]"


def may_be_redacted(text: str) -> bool:
    """False only for a text that no rule of :func:`spark_redact` changes (the test that lets
    the JVM skip the rules for it, in Python)."""
    if re.search(_NOT_PLAIN_ASCII, text) or "@" in text:
        return True
    lower = text.lower()
    return "bearer" in lower or (
        ("=" in text or ":" in text) and any(word in lower for word in _KEY_WORDS)
    )


def spark_redact(column: Any) -> Any:
    """A Spark column expression cleaning ``column`` as :func:`clean` does (secrets masked,
    control characters dropped; Spark's strings are valid UTF-8 already), run by the JVM on
    every row (file paths of late rows, for Parquet and DuckDB alike). A text that
    :func:`may_be_redacted` clears is kept without running the rules."""
    from functools import reduce
    from operator import or_

    from pyspark.sql import functions as F

    cleaned = column
    for pattern, template in _RULES:
        flags = "(?iu)" if pattern.flags & re.IGNORECASE else ""
        java = flags + pattern.pattern.replace("(?P<", "(?<")
        cleaned = F.regexp_replace(cleaned, java, re.sub(r"\\g<(\w+)>", r"${\1}", template))
    cleaned = F.regexp_replace(cleaned, _CONTROL.pattern, "")
    lower = F.lower(column)
    key_word = reduce(or_, [lower.contains(word) for word in _KEY_WORDS])
    may_change = (
        column.rlike(_NOT_PLAIN_ASCII)
        | column.contains("@")
        | lower.contains("bearer")
        | ((column.contains("=") | column.contains(":")) & key_word)
    )
    return F.when(may_change, cleaned).otherwise(column)


class RedactingFilter(logging.Filter):
    """Cleans every record a wmwatch logger emits, its traceback included (:func:`clean`:
    secrets masked, control characters dropped): the last boundary before text leaves wmwatch
    (log lines quote exceptions, paths and names)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string must not lose the record
            message = str(record.msg)
        record.msg, record.args = clean(message), None
        if record.exc_info and not record.exc_text:
            record.exc_text = clean(logging.Formatter().formatException(record.exc_info))
        return True


_REDACTING = RedactingFilter()


def get_logger(name: str) -> logging.Logger:
    """The logger ``name`` with wmwatch's redaction on it: every wmwatch module logs through
    one of these (filters of a logger do not apply to its children, so each name gets it)."""
    logger = logging.getLogger(name)
    if _REDACTING not in logger.filters:
        logger.addFilter(_REDACTING)
    return logger


def first_line(text: str | None, limit: int = 300) -> str | None:
    """The first non-empty line of ``text``, at most ``limit`` characters; None if there is none."""
    if not text:
        return None
    stripped = text.strip()
    line = stripped.splitlines()[0] if stripped else ""
    return line[:limit] or None


def error_line(exc: BaseException, limit: int = 500) -> str:
    """One cleaned line (:func:`clean`) that says what went wrong, for logs, metrics and the
    history.

    The whole line is redacted before it is cut, so a credential the cut runs through is still
    masked."""
    text = str(exc)
    return clean(first_line(text, len(text)) or type(exc).__name__, limit)
