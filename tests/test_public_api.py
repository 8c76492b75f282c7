"""The public surface: a small, sorted ``__all__`` and one exception family."""

from __future__ import annotations

import wmwatch


def test_all_is_sorted_and_complete() -> None:
    assert wmwatch.__all__ == sorted(wmwatch.__all__)
    public = {name for name in dir(wmwatch) if not name.startswith("_")} | {"__version__"}
    assert set(wmwatch.__all__) <= public
    for name in wmwatch.__all__:
        assert getattr(wmwatch, name) is not None


def test_every_error_is_a_wmwatch_error() -> None:
    errors = {
        name
        for name in wmwatch.__all__
        if isinstance(getattr(wmwatch, name), type)
        and issubclass(getattr(wmwatch, name), Exception)
    }
    # the family drawn in wmwatch/_errors.py, every member exported
    assert errors == {
        "AuditError",
        "ConfigError",
        "MetricsServerError",
        "ProgressParseError",
        "StoreError",
        "UnknownQueryError",
        "UnsupportedSourceError",
        "WmwatchError",
    }
    for name in errors:
        assert issubclass(getattr(wmwatch, name), wmwatch.WmwatchError)


def test_errors_keep_the_builtin_bases_callers_catch() -> None:
    # a report for an unknown query is a LookupError, a bad option or document a ValueError
    assert issubclass(wmwatch.UnknownQueryError, LookupError)
    assert issubclass(wmwatch.ConfigError, ValueError)
    assert issubclass(wmwatch.ProgressParseError, ValueError)
    assert issubclass(wmwatch.UnsupportedSourceError, wmwatch.AuditError)
    error = wmwatch.UnknownQueryError("no query 'nope' in the history (known: orders)")
    assert isinstance(error, wmwatch.WmwatchError) and "nope" in str(error)
