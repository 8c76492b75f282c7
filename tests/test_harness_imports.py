"""A test module is never a library: what tests share lives in ``tests/harness/``, and no file of
the tests or the benchmarks imports a test module (read from the files' own imports)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported_test_modules(source: str) -> list[str]:
    """The test modules (``tests.test_*``) that ``source`` imports, however it names them."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            # ``from tests import test_x`` names the module as an attribute of the package
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        parts = [name.split(".") for name in names]
        found.extend(
            dict.fromkeys(
                ".".join(p[:2])
                for p in parts
                if p[0] == "tests" and p[1:2] and p[1].startswith("test_")
            )
        )
    return found


def test_the_check_sees_each_way_of_importing_a_test_module() -> None:
    assert imported_test_modules("from tests.test_store import progress") == ["tests.test_store"]
    assert imported_test_modules("from tests import test_store") == ["tests.test_store"]
    assert imported_test_modules("def f():\n    import tests.test_store\n") == ["tests.test_store"]
    assert imported_test_modules("from tests.harness.streams import ts") == []


def test_no_test_module_imports_another() -> None:
    files = sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")])
    assert len(files) > 50
    imports = {
        str(path.relative_to(ROOT)): imported_test_modules(path.read_text()) for path in files
    }
    assert {path: found for path, found in imports.items() if found} == {}
