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


# Stems of every secret key that ``_SECRET_PAIR`` masks; a test keeps the two lists in step.
_SECRET_STEMS = ("passw", "pwd", "secret", "token", "key", "sas", "sig", "credential")


def redact(text: str) -> str:
    """Return ``text`` with URL credentials and secret-looking ``key=value`` pairs masked."""
    if not text or not _may_hold_secret(text):
        return text
    return _mask(text)


def _may_hold_secret(text: str) -> bool:
    # Skips both regex passes (about 0.2 ms over a progress document) for text that cannot hold
    # a credential. Only ASCII text is ruled out by substring tests: the patterns ignore case,
    # and some non-ASCII letters match ASCII ones (the long s, the Kelvin sign, the dotted and
    # dotless i).
    if not text.isascii() or "@" in text:
        return True
    lowered = text.lower()
    return any(stem in lowered for stem in _SECRET_STEMS)


def _mask(text: str) -> str:
    text = _URL_USERINFO.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", text)
    return _SECRET_PAIR.sub(lambda m: f"{m.group('key')}{m.group('sep')}{REDACTED}", text)


def valid_utf8(text: str) -> str:
    """``text`` as valid UTF-8: lone surrogates (legal in Python strings and JSON escapes, not in
    UTF-8) become ``?``, since DuckDB and the exposition format refuse them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def clean(text: str, limit: int | None = None) -> str:
    """``text`` redacted, then cut to ``limit`` characters, as valid UTF-8: how every piece of
    free text from Spark is kept. Redacting first: a cut through a credential must not leave
    the part before the cut unmasked."""
    return valid_utf8(redact(text)[:limit])


# A \uD800-\uDFFF escape that is not half of a pair: Python's json accepts it, DuckDB's JSON
# type refuses the whole document.
_LONE_SURROGATE_ESCAPE = re.compile(
    r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})"
    r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}"
)


def clean_json(text: str) -> str:
    """JSON text redacted and valid UTF-8, with every lone surrogate escape (``\\ud800``)
    replaced by ``\\ufffd``, so that DuckDB's JSON type accepts it."""
    text = valid_utf8(redact(text))
    if "\\u" in text:
        text = _LONE_SURROGATE_ESCAPE.sub("\\\\ufffd", text)
    return text


def first_line(text: str | None, limit: int = 300) -> str | None:
    """The first non-empty line of ``text``, at most ``limit`` characters; None if there is none."""
    if not text:
        return None
    stripped = text.strip()
    line = stripped.splitlines()[0] if stripped else ""
    return line[:limit] or None


def error_line(exc: BaseException, limit: int = 500) -> str:
    """One redacted line that says what went wrong, for logs, metrics and the history.

    The whole line is redacted before it is cut, so a credential the cut runs through is still
    masked."""
    text = str(exc)
    return redact(first_line(text, len(text)) or type(exc).__name__)[:limit]
