"""The package's layering holds: imports only point down the layer order, and no import cycle exists.

Both checks read the source with ``ast`` and count every import, at module level and inside
functions alike (a lazy import that points up is still a dependency on a higher layer). The layer
check counts type-only imports too; the cycle check leaves them out, since they never run. The
layer order is docs/architecture.md's.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import rollfleet

ROOT = Path(rollfleet.__file__).parent

# Lowest first. A module may import from its own layer and every layer before it.
LAYERS: list[set[str]] = [
    {"errors", "model", "taskfile", "aio", "stats", "refs"},
    {"web"},
    {"store"},
    {"server", "client"},
    {"engines", "pool", "cluster"},
    {"envs"},
    {"runner"},
    {"agents", "testing", "examples", "chaos"},
    {"coordinator", "train"},
    {"compose"},
    {"run"},
    {"cli", "__init__", "__main__"},
]
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path) -> str:
    """``rollfleet.store.ops`` for ``…/rollfleet/store/ops.py``."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def part_of(module: str) -> str:
    """The top-level part a module belongs to: ``store`` for ``rollfleet.store.ops``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def type_only(tree: ast.Module) -> set[int]:
    """The ids of import nodes under ``if TYPE_CHECKING:`` (they never run)."""
    return {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }


def imports(module: str, *, typing_too: bool = True) -> Iterator[tuple[int, str]]:
    """Every ``rollfleet`` module ``module`` imports, with the line, wherever the import stands.

    ``typing_too=False`` leaves out imports under ``if TYPE_CHECKING:``, which never run.
    """
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skip = set() if typing_too else type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            if target == "rollfleet" or target.startswith("rollfleet."):
                yield node.lineno, target


def test_every_part_of_the_package_has_a_layer() -> None:
    unknown = {part_of(m) for m in MODULES} - RANK.keys()
    assert not unknown, (
        f"give these a place in LAYERS (and in docs/architecture.md's layer order): {unknown}"
    )


def test_no_module_imports_from_a_layer_above_it() -> None:
    upward = [
        f"{MODULES[m].relative_to(ROOT.parent)}:{line} imports {target} "
        f"({part_of(m)} is below {part_of(target)})"
        for m in MODULES
        for line, target in imports(m)
        if RANK[part_of(target)] > RANK[part_of(m)]
    ]
    assert not upward, "imports pointing up a layer:\n" + "\n".join(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle in ``graph`` as a closed path, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_no_import_cycle() -> None:
    graph = {
        m: {t for _, t in imports(m, typing_too=False) if t in MODULES and t != m} for m in MODULES
    }
    # a package's __init__ re-exporting its own modules is not a cycle of design
    for m in graph:
        graph[m] = {
            t for t in graph[m] if not (MODULES[t].name == "__init__.py" and m.startswith(t + "."))
        }
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
