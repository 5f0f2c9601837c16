"""The docs stay true to the code: every module path and every `unbroken.*` name that
README.md and docs/ mention exists, and docs/architecture.md's layer table is the one
tests/test_layers.py enforces.

Stored `module:Class` names (storage-format.md) may name a module by the path it had before
the package was split into layers; those are checked against `core/stable_names.py`.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from test_layers import MAY_IMPORT, MODULES, TOP_LEVEL
from unbroken.core import stable_names

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
REPO_DIRS = ("src", "tests", "tools", "benchmarks", "examples", "scripts", "docs")
# Files the docs tell the reader to create: the reader's own, not the repository's.
USER_FILES = {"train_linear.py", "train.py"}

FENCE = re.compile(r"^\s*```.*?^\s*```", re.S | re.M)
SPAN = re.compile(r"`([^`\n]+)`")
PY_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b")
DIR_PATH = re.compile(r"(?<![\w./<-])((?:[\w-]+/)+)(?![\w.<])")
DOTTED = re.compile(r"(?<![\w.])(unbroken(?:\.[A-Za-z_]\w*)+)(?::([A-Za-z_][\w.]*))?")


def _prose(page: Path) -> str:
    """The page without its fenced blocks (examples of output, shell sessions, code)."""
    return FENCE.sub("", page.read_text())


@cache
def _py_basenames() -> frozenset[str]:
    return frozenset(p.name for d in REPO_DIRS for p in (ROOT / d).rglob("*.py"))


def _path_exists(path: str) -> bool:
    path = path.removeprefix("src/unbroken/").removeprefix("unbroken/")
    if "/" not in path.rstrip("/") and path.endswith(".py"):
        return path in _py_basenames() or path in USER_FILES
    return any((base / path).exists() for base in (ROOT, SRC, SRC / "unbroken"))


def _is_source_dir(path: str) -> bool:
    """A directory token that names a folder of the repository or of the package (not a run
    directory's `checkpoint_000005/` or `.unbroken/pickled/`)."""
    first = path.split("/")[0]
    return first in REPO_DIRS or first in MAY_IMPORT or first == "unbroken"


@cache
def _top_level_names(module: str) -> frozenset[str]:
    tree = ast.parse(MODULES[module].read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):  # optional imports
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    names.update((a.asname or a.name).split(".")[0] for a in sub.names)
    return frozenset(names)


def _dotted_problem(name: str, stored_attr: str | None) -> str | None:
    """Why `name` (and, for a stored `module:Class` name, the part after the colon) does not
    exist, or None."""
    if stored_attr is not None:
        module = stable_names.current_module(name) if name in stable_names._MOVED else name
        if module not in MODULES:
            return "no such module (nor a stable stored name)"
        if stored_attr.split(".")[0] not in _top_level_names(module):
            return f"{module} has no {stored_attr.split('.')[0]}"
        return None
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in MODULES:
            rest = parts[cut:]
            if rest and rest[0] not in _top_level_names(module) and f"{module}.{rest[0]}" not in MODULES:
                return f"{module} has no {rest[0]}"
            return None
    return "no such module"


def test_every_module_path_the_docs_name_exists():
    missing = []
    for page in PAGES:
        for span in SPAN.findall(_prose(page)):
            for path in PY_PATH.findall(span):
                if not _path_exists(path):
                    missing.append(f"{page.relative_to(ROOT)}: `{path}`")
            for path in DIR_PATH.findall(span):
                if _is_source_dir(path) and not _path_exists(path):
                    missing.append(f"{page.relative_to(ROOT)}: `{path}`")
    assert missing == []


def test_every_unbroken_name_the_docs_mention_exists():
    wrong = []
    for page in PAGES:
        for name, stored in sorted(set(DOTTED.findall(page.read_text()))):
            problem = _dotted_problem(name, stored or None)
            if problem:
                wrong.append(f"{page.relative_to(ROOT)}: {name}{':' + stored if stored else ''}: {problem}")
    assert wrong == []


def _layer_table() -> dict[str, tuple[str, set[str]]]:
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Layers"):]
    section = section[:section.index("\n## ", 4)]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or cells[0] in ("Layer", "") or set(cells[0]) <= {"-"}:
            continue
        may = set() if "nothing" in cells[2] else {c.strip() for c in cells[2].split(",")}
        rows[cells[0]] = (cells[1].strip("`"), may)
    return rows


def test_the_architecture_layer_table_is_the_one_the_layers_test_enforces():
    table = _layer_table()
    assert set(table) == set(MAY_IMPORT), "the table's layers are test_layers.MAY_IMPORT's"
    for layer, (folder, may) in table.items():
        assert folder == f"{layer}/", f"{layer}: folder {folder}"
        assert may == MAY_IMPORT[layer], f"{layer}: the table says it may import {sorted(may)}"
        assert (SRC / "unbroken" / layer / "__init__.py").is_file()


def test_the_architecture_page_names_the_modules_outside_the_layers():
    text = ARCHITECTURE.read_text()
    for module, layer in TOP_LEVEL.items():
        file = "__init__.py" if module == "unbroken" else module.removeprefix("unbroken.") + ".py"
        assert f"`{file}`" in text, f"architecture.md does not name {file} ({layer} layer)"
    outside = {p.name for p in (SRC / "unbroken").glob("*.py")}
    named = {"__init__.py" if m == "unbroken" else m.removeprefix("unbroken.") + ".py" for m in TOP_LEVEL}
    assert outside == named


def test_the_checks_see_a_wrong_name_and_a_wrong_path():
    assert _dotted_problem("unbroken.train.torch.TrainState", None) is None
    assert _dotted_problem("unbroken.train.torch.NoSuchThing", None)
    assert _dotted_problem("unbroken.nosuchmodule", None)
    assert _dotted_problem("unbroken.config", "RunConfig") is None  # a stable stored name
    assert _dotted_problem("unbroken.config", "NoSuchClass")
    assert _path_exists("execution/controller.py") and _path_exists("src/unbroken/store/commit.py")
    assert not _path_exists("execution/no_such_module.py")
    assert _path_exists("tune/schedulers/") and not _path_exists("tune/no_such_package/")
