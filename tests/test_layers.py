"""The package's layers, read from the source with `ast`: imports only point down, and no
import cycle closes anywhere, counting imports inside functions (docs/architecture.md).

Only an `if TYPE_CHECKING:` import may close a loop, and only inside one layer (its
subpackages, such as `worker/recovery/`, included).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "unbroken"

# Each layer package and the packages it may import (its own modules aside). Top to bottom:
# cli > tune > train > observe > execution > run | worker > store > state > core; air (Ray AIR's
# module paths, which only refuse) stands on core alone.
MAY_IMPORT: dict[str, set[str]] = {
    "core": set(),
    "air": {"core"},
    "state": {"core"},
    "store": {"core", "state"},
    "run": {"core", "state", "store"},
    "worker": {"core", "state", "store"},
    "execution": {"core", "state", "store", "run", "worker"},
    "observe": {"core", "store", "run"},
    "train": {"core", "state", "store", "run", "worker", "execution", "observe"},
    "tune": {"core", "state", "store", "run", "worker", "execution", "observe", "train"},
    "cli": {"core", "state", "store", "run", "worker", "execution", "observe", "train", "tune"},
}
# The modules outside the layer packages, and the layer each belongs to.
TOP_LEVEL = {"unbroken": "core", "unbroken.errors": "core", "unbroken.__main__": "cli"}
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in (SRC / PACKAGE).rglob("*.py"):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module of ours that an imported name lives in (a package's __init__ for a name in it)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, bool]]:
    """(imported module of ours, whether only for type checking) for every import in `module`,
    wherever it stands: at the top, inside a function, under a condition."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                here = module if path.name == "__init__.py" else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    here = here.rpartition(".")[0]
                base = f"{here}.{base}" if base else here
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _owner(name) if name.split(".")[0] == PACKAGE else None
            if target and target != module:
                out.append((target, id(node) in typing_only))
    return out


GRAPH = {m: _imports(m) for m in MODULES}


def layer(module: str) -> str:
    """The layer package `module` belongs to."""
    if module in TOP_LEVEL:
        return TOP_LEVEL[module]
    return module.split(".")[1]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_declared_layer():
    unknown = sorted(m for m in MODULES if m not in TOP_LEVEL and m.split(".")[1] not in MAY_IMPORT)
    assert not unknown, f"modules outside the declared layers (add them to a layer package): {unknown}"
    assert len(TOP_LEVEL) <= 10


def test_no_import_cycle_counting_imports_inside_functions():
    runtime = {m: {t for t, typing_only in GRAPH[m] if not typing_only} for m in MODULES}
    assert _cycles(runtime) == []


def test_type_checking_imports_close_loops_only_inside_one_layer():
    every = {m: {t for t, _ in GRAPH[m]} for m in MODULES}
    across = [c for c in _cycles(every) if len({layer(m) for m in c}) > 1]
    assert across == []


def test_imports_only_point_down_the_layers():
    upward = sorted(f"{m} imports {t}" for m in MODULES for t, _ in GRAPH[m]
                    if layer(t) != layer(m) and layer(t) not in MAY_IMPORT[layer(m)])
    assert upward == []


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_each_layer_says_what_it_may_import(package):
    doc = ast.get_docstring(ast.parse(MODULES[f"{PACKAGE}.{package}"].read_text()))
    assert doc and "import" in doc, f"{package}/__init__.py needs a docstring saying what it may import"


def test_no_module_over_400_lines():
    sizes = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    long = sorted(f"{m} ({n})" for m, n in sizes.items() if n > MAX_LINES)
    assert long == []


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The checks themselves: a made-up cycle and a made-up upward import are found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
    assert "store" not in MAY_IMPORT["core"] and "execution" not in MAY_IMPORT["worker"]
    assert layer("unbroken.store.commit") == "store" and layer("unbroken.errors") == "core"
    assert ("unbroken.store.storage", False) in GRAPH["unbroken.store.commit"]
    deferred = [t for t, _ in GRAPH["unbroken.store.checkpoint"]]
    assert "unbroken.state.state_file" in deferred, "an import inside a function is counted"


def test_engines_know_nothing_of_storage_or_runs():
    """An engine places ranks and carries messages; storage, commits and run bookkeeping are
    the controller's (and, for the shared-storage probe, the rank's own runner)."""
    engines = [m for m in MODULES if m.startswith(f"{PACKAGE}.execution.engine")]
    assert engines
    leaks = sorted(f"{m} imports {t}" for m in engines for t, _ in GRAPH[m] if layer(t) in ("store", "run"))
    assert leaks == []
