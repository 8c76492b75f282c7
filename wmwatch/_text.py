"""Cleaning text where it enters wmwatch: credentials masked, invalid UTF-8 replaced, one line kept.

Text from Spark (query names, source descriptions, exception messages, progress JSON) is cleaned
once, when it is parsed; what is stored, exported and reported downstream is already clean."""

from __future__ import annotations

import re

# scheme://user:secret@host  ->  scheme://***@host
_URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^/@\s\]\[]+)@")
# key=value pairs whose key names a secret (query strings, option maps, JDBC URLs)
_SECRET_PAIR = re.compile(
    r"(?P<key>(?:password|passwd|pwd|secret|token|access[_.\-]?key|secret[_.\-]?key|"
    r"session[_.\-]?token|api[_.\-]?key|sas|sig|credential)s?)"
    r"(?P<sep>\s*[=:]\s*)(?P<value>[^\s,;&\]\)}\"']+)",
    re.IGNORECASE,
)

REDACTED = "***"


def redact(text: str) -> str:
    """Return ``text`` with URL credentials and secret-looking ``key=value`` pairs masked."""
    if not text:
        return text
    text = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    return _SECRET_PAIR.sub(lambda m: f"{m.group('key')}{m.group('sep')}{REDACTED}", text)


def valid_utf8(text: str) -> str:
    """``text`` as valid UTF-8: lone surrogates (legal in Python strings and JSON escapes, not in
    UTF-8) become U+FFFD, since DuckDB and the exposition format refuse them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def first_line(text: str | None, limit: int = 300) -> str | None:
    """The first non-empty line of ``text``, at most ``limit`` characters; None if there is none."""
    if not text:
        return None
    stripped = text.strip()
    line = stripped.splitlines()[0] if stripped else ""
    return line[:limit] or None


def error_line(exc: BaseException, limit: int = 500) -> str:
    """One redacted line that says what went wrong, for logs, metrics and the history."""
    return redact(first_line(str(exc), limit) or type(exc).__name__)[:limit]
