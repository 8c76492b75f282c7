"""The query's definition as the sidecar command names it: the user's function behind
``module:function`` or ``path/to/file.py:function``, loaded and called, whatever it raises
turned into one line naming the option."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wmwatch._errors import ConfigError
from wmwatch._text import error_line


def load_function(spec: str, option: str) -> Callable[..., Any]:
    """The function ``module:function`` or ``path/to/file.py:function`` names."""
    where, _, attr = spec.rpartition(":")
    if not where or not attr:
        raise ConfigError(
            f"{option} {spec!r} names no function; give module:function or "
            "path/to/file.py:function."
        )
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ConfigError(f"{option} {spec!r}: there is no file {where}.")
            module_name = f"wmwatch_definition_{path.stem}"
            found = importlib.util.spec_from_file_location(module_name, path)
            if found is None or found.loader is None:
                raise ConfigError(f"{option} {spec!r}: {where} cannot be loaded as Python.")
            module = importlib.util.module_from_spec(found)
            sys.modules[module_name] = module
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's module: its error, in one line
        raise ConfigError(
            f"{option} {spec!r}: importing {where} failed ({type(exc).__name__}: "
            f"{error_line(exc)}); put the module on PYTHONPATH or give path/to/file.py:function."
        ) from None
    function = getattr(module, attr, None)
    if not callable(function):
        raise ConfigError(
            f"{option} {spec!r}: {where} has no function {attr!r}; name the function that "
            "builds it."
        )
    return function  # type: ignore[no-any-return]  # a user's function, checked callable above


def call_definition(function: Callable[..., Any], argument: Any, option: str, spec: str) -> Any:
    """``function(argument)``, with whatever it raises as one line naming the option."""
    try:
        return function(argument)
    except Exception as exc:  # noqa: BLE001 - the user's code: its error, in one line
        raise ConfigError(
            f"{option} {spec!r} raised {type(exc).__name__}: {error_line(exc)}; fix the "
            "function (it must build the streaming DataFrame as the production query does)."
        ) from None
