"""The package's layering holds: imports only point down the layer order, and no import cycle exists.

Both checks read the source with ``ast`` and count every import, at module level and inside
functions alike (a lazy import that points up is still a dependency on a higher layer). The layer
check counts type-only imports too; the cycle check leaves them out, since they never run. The
layer order is docs/architecture.md's, and so is the order of the parts inside ``engines``.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import rollfleet

ROOT = Path(rollfleet.__file__).parent

# Lowest first. A module may import from its own layer and every layer before it.
LAYERS: list[set[str]] = [
    {"errors", "model", "taskfile", "aio", "stats", "refs", "flags"},
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

# Inside engines, lowest first, by the longest listed prefix of a module's name there: the modules
# at its top (the protocol, and what engines and the gateway share), the weights pieces engines
# use, the engines, the gateway, the trainer's push (it takes a Gateway in this process), then the
# builders and the package itself.
ENGINE_LAYERS: list[set[str]] = [
    {"base", "images", "tool_calls", "continuation", "threaded", "echo", "tiny"},
    {"weights"},
    {"llamacpp", "hf", "served"},
    {"gateway"},
    {"weights.push"},
    {"factory", "__init__"},
]
ENGINE_RANK = {piece: rank for rank, pieces in enumerate(ENGINE_LAYERS) for piece in pieces}


def module_name(path: Path) -> str:
    """``rollfleet.store.ops`` for ``…/rollfleet/store/ops.py``."""
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def part_of(module: str) -> str:
    """The top-level part a module belongs to: ``store`` for ``rollfleet.store.ops``."""
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def engine_piece(module: str) -> str:
    """The ENGINE_LAYERS entry of a module in ``engines``: ``weights`` for
    ``rollfleet.engines.weights.wire``, ``weights.push`` for ``rollfleet.engines.weights.push``,
    ``__init__`` for the package itself (an unlisted module: its first name there)."""
    pieces = module.split(".")[2:]
    for n in range(len(pieces), 0, -1):
        if ".".join(pieces[:n]) in ENGINE_RANK:
            return ".".join(pieces[:n])
    return pieces[0] if pieces else "__init__"


def reexports(module: str, target: str) -> bool:
    """True when ``module`` is a package's ``__init__`` importing one of its own modules."""
    return MODULES[module].name == "__init__.py" and target.startswith(module + ".")


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


def pointing_up(
    modules: Iterable[str],
    piece: Callable[[str], str],
    rank: dict[str, int],
    counts: Callable[[str, str], bool] = lambda module, target: True,
) -> list[str]:
    """``file:line imports target (a is below b)`` for each import of ``modules`` that
    ``counts`` and whose target's piece ranks above the importer's."""
    return [
        f"{MODULES[m].relative_to(ROOT.parent)}:{line} imports {target} "
        f"({piece(m)} is below {piece(target)})"
        for m in modules
        for line, target in imports(m)
        if counts(m, target) and rank[piece(target)] > rank[piece(m)]
    ]


def test_no_module_imports_from_a_layer_above_it() -> None:
    upward = pointing_up(MODULES, part_of, RANK)
    assert not upward, "imports pointing up a layer:\n" + "\n".join(upward)


def test_every_module_of_engines_has_a_place_inside_it() -> None:
    engines = [m for m in MODULES if part_of(m) == "engines"]
    unknown = {engine_piece(m) for m in engines} - ENGINE_RANK.keys()
    assert not unknown, (
        f"give these a place in ENGINE_LAYERS (and in docs/architecture.md's order): {unknown}"
    )


def test_no_module_of_engines_imports_from_a_part_of_it_above_its_own() -> None:
    upward = pointing_up(
        [m for m in MODULES if part_of(m) == "engines"],
        engine_piece,
        ENGINE_RANK,
        lambda module, target: part_of(target) == "engines" and not reexports(module, target),
    )
    assert not upward, "imports pointing up inside engines:\n" + "\n".join(upward)


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
