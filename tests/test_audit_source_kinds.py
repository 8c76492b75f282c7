"""The registry of the audit's source kinds: every kind module is registered once, in the order
that lets the first match win (the real reads are tested per kind against real Spark); a module
of sources/ is a kind, the seam (base) or, named with a leading _, a kind's own part."""

from __future__ import annotations

import importlib
import pkgutil

from wmwatch._audit.replay import sources
from wmwatch._audit.replay.sources.base import SourceKind


def test_every_kind_module_is_registered_once() -> None:
    modules = [
        importlib.import_module(f"{sources.__name__}.{m.name}")
        for m in pkgutil.iter_modules(sources.__path__)
        # base is the seam; a module named with a leading _ is one kind's own part
        if m.name != "base" and not m.name.startswith("_")
    ]
    kinds = [m.KIND for m in modules]
    assert all(isinstance(k, SourceKind) for k in kinds)
    assert sorted(k.name for k in kinds) == sorted(k.name for k in sources.KINDS)
    assert len({k.name for k in sources.KINDS}) == len(sources.KINDS)


def test_first_match_wins_in_the_registered_order() -> None:
    names = [k.name for k in sources.KINDS]
    # Delta and files both read V1 relations: files takes every one no kind before it claims
    assert names.index("delta") < names.index("files")
    # on Spark Connect a format no other kind claims names a Python data source
    connect = [k.name for k in sources.KINDS if k.connect_matches is not None]
    assert connect[-1] == "python"
    assert connect == ["files", "kafka", "python"]
