"""The public surface: a small, sorted ``__all__`` and one exception family."""

from __future__ import annotations

import inspect

import pytest

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


@pytest.mark.parametrize("method", ["audit", "audit_checkpoint"])
def test_audit_options_are_typed_keywords_each_documented(method: str) -> None:
    function = getattr(wmwatch.Watch, method)
    signature = inspect.signature(function)
    parameters = [p for p in signature.parameters.values() if p.name != "self"]
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in parameters)
    assert all(p.annotation is not inspect.Parameter.empty for p in parameters)
    options = [p for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(options) >= 17
    doc = inspect.getdoc(function) or ""
    for parameter in parameters:
        assert f":param {parameter.name}:" in doc or f"``{parameter.name}``" in doc, parameter
    handle = wmwatch.AuditHandle if method == "audit" else wmwatch.SidecarHandle
    assert signature.return_annotation in (handle.__name__, handle)


def test_the_audit_handles_are_exported_with_their_methods() -> None:
    assert issubclass(wmwatch.SidecarHandle, wmwatch.AuditHandle)
    for name in ("status", "sync", "stop", "query_id", "spec", "__enter__", "__exit__"):
        assert hasattr(wmwatch.AuditHandle, name)
    assert callable(wmwatch.SidecarHandle.finish)
    for handle in (wmwatch.AuditHandle, wmwatch.SidecarHandle):
        assert handle.__module__.startswith("wmwatch.") and handle.__doc__
