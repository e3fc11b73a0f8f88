"""The cache sits below the engine (DESIGN.md: server / bench -> runtime -> engine -> cache -> mem,
storage, model -> dist primitives): no module of hicache/cache imports a part above it."""

from __future__ import annotations

import ast
import pathlib

import pytest

CACHE = pathlib.Path(__file__).resolve().parents[2] / "hicache" / "cache"
ABOVE = ("hicache.engine", "hicache.runtime", "hicache.server", "hicache.bench", "hicache.demo", "hicache.cli")


def imports(path: pathlib.Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", sorted(CACHE.glob("*.py")), ids=lambda p: p.name)
def test_cache_imports_nothing_above_it(path):
    above = [name for name in imports(path) if name.startswith(ABOVE)]
    assert above == [], f"{path.name} imports {above}"
