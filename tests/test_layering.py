"""The parts import downward only (docs/DESIGN.md, "Layering": server / bench → runtime → engine → cache
→ mem, storage, model → parallel primitives): read from the source, every import of one hicache part by
another goes to a lower layer, so no part imports the one above it and there is no cycle between parts.
And no module grows past the size of one concept."""

from __future__ import annotations

import ast
import pathlib

import hicache

PACKAGE = pathlib.Path(hicache.__file__).parent

# Lowest first. Parts on one layer do not import each other.
LAYERS: tuple[frozenset[str], ...] = tuple(
    frozenset(layer.split())
    for layer in (
        "errors",
        "parallel",  # collectives, placement, consensus: imports no other part
        "mem storage",
        "model",  # reads the KV layout from mem
        "config debug",  # debug: the consensus checker and fault injection, below what they instrument
        "cache",
        "engine",
        "spec",  # speculative decoding: a way of computing the scheduler's steps, built on the engine's runner
        "disagg",  # prefill-decode roles over the engine, transports
        "runtime",
        "web",  # the HTTP plumbing the server and the router share
        "server bench router",
        "demo __init__",
        "cli",
        "__main__",
    )
)

# Imports still pointing up, each removed by a change in flight (not a licence for new ones).
PENDING: dict[tuple[str, str], str] = {}


def part_of(path: pathlib.Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def imported_parts(path: pathlib.Path) -> set[str]:
    parts = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        for name in names:
            dotted = name.split(".")
            if dotted[0] == "hicache":
                parts.add(dotted[1] if len(dotted) > 1 else "__init__")
    return parts


def layer_of(part: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if part in layer)


def test_every_part_has_a_layer():
    parts = {part_of(p) for p in PACKAGE.rglob("*.py")}
    placed = set().union(*LAYERS)
    assert parts <= placed, f"parts without a layer: {sorted(parts - placed)}"


def test_parts_import_only_lower_layers():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        part = part_of(path)
        for target in imported_parts(path) - {part}:
            if layer_of(target) >= layer_of(part) and (part, target) not in PENDING:
                upward.append(f"{path.relative_to(PACKAGE.parent)}: {part} imports {target}")
    assert upward == []


MAX_MODULE_LINES = 400  # one concept a module: past this, a module holds two


def test_no_module_is_over_the_line_limit():
    long = {
        str(path.relative_to(PACKAGE.parent)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}
