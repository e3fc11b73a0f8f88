"""The parts import downward only (docs/DESIGN.md, "Layering": server / bench → engine → scheduler → cache
→ mem, storage, model → parallel primitives): read from the source, every import of one hicache part by
another goes to a lower layer, so no part imports the one above it and there is no cycle between parts.
And no module grows past the size of one concept."""

from __future__ import annotations

import ast
import pathlib
import re

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
        "events",  # KV events: what the cache stores and drops, published, and indexed by a subscriber
        "scheduler",
        "spec",  # speculative decoding: a way of computing the scheduler's steps, built on its model runner
        "disagg",  # prefill-decode roles of the scheduler, transports
        "engine",  # Engine, the runtimes under it, what builds a rank
        "web",  # the HTTP plumbing the server and the router share
        "server bench router",
        "sim",  # the capacity simulator: the scheduler and cache in virtual time, bench's workloads and report
        "demo __init__",
        "cli",
        "cli_reference",  # docs/FLAGS.md, rendered from the parser cli builds
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


# ---- the cache API is the only door into the cache ------------------------------------------------

CACHE = PACKAGE / "cache"


def cache_api() -> set[str]:
    """The names hicache/cache/__init__.py declares public (its `__all__`), read from the source."""
    tree = ast.parse((CACHE / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def outside_cache() -> list[pathlib.Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if CACHE not in p.parents]


def test_outside_the_cache_only_its_api_is_imported():
    api, wrong = cache_api(), []
    assert api, "hicache/cache/__init__.py declares no __all__"
    for path in outside_cache():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(PACKAGE.parent)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith("hicache.cache."):
                    wrong.append(f"{where}: imports the cache's module {node.module}")
                elif node.module == "hicache.cache":
                    wrong += [f"{where}: {a.name} is not cache API" for a in node.names if a.name not in api]
            elif isinstance(node, ast.Import):
                wrong += [f"{where}: imports {a.name}" for a in node.names if a.name.startswith("hicache.cache.")]
    assert wrong == []


# A call into the cache, by the names callers hold it under: a handle (`kv`), the cache, a tier.
CACHE_CALL = re.compile(r"\b(cache|kv|handle|host|storage_tier|device_tier)\.\w+")


def test_no_type_ignore_on_a_cache_call():
    ignored = [
        f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
        for path in outside_cache()
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if "# type: ignore" in line and CACHE_CALL.search(line.split("#")[0])
    ]
    assert ignored == []


# ---- no import cycle between modules ------------------------------------------------------------


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_at_load(path: pathlib.Path, modules: set[str]) -> set[str]:
    """The hicache modules `path` imports when it is loaded (its top-level statements; an import inside
    a function runs later and cannot take part in a cycle of loading)."""
    out = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in modules:
                out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in modules}
    return out


def test_no_import_cycle():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    # A package's __init__ importing its own modules is no cycle (Python loads it first, then them).
    graph = {m: imports_at_load(p, set(paths)) - {m} for m, p in paths.items()}
    cycles = [sorted(c) for c in strongly_connected(graph) if len(c) > 1]
    assert cycles == []


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components of `graph` (iterative: the package is deeper than Python's recursion is safe)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next((e for e in edges if e in graph), None)
            if nxt is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(component)
            elif nxt not in index:
                index[nxt] = low[nxt] = len(index)
                stack.append(nxt)
                on_stack.add(nxt)
                work.append((nxt, iter(sorted(graph[nxt]))))
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
    return components
