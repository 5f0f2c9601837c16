"""The Python code blocks of README.md and docs/*.md run as written.

Each block carries a marker on the line above its opening fence:

- `<!-- doc-test: run -->`: a script of its own, run as `python <file>.py`;
- `<!-- doc-test: continues -->`: appended to the script of the block before it;
- `<!-- doc-test: then -->`: a script of its own, run after the one before it, sharing its
  home directory (and so `~/unbroken_results`, `~/runs`);
- `<!-- doc-test: skip: <why> -->`: not run, and the marker says why.

The scripts of one page run in order, in a fresh home directory and working directory,
so `~/...` paths and relative files land there. A block that stops working fails here.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from conftest import driver_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
MARKER = re.compile(r"<!-- doc-test: (run|continues|then|skip: (?P<why>.+?)) -->")
FENCE = re.compile(r"^\s*```python\s*$")


@dataclass
class Block:
    page: str
    line: int
    kind: str  # run, continues, then, skip; "" when the marker is missing
    code: str
    why: str = ""


@dataclass
class Script:
    line: int
    code: str
    blocks: list[int] = field(default_factory=list)


def blocks(page: str) -> list[Block]:
    lines = open(os.path.join(ROOT, page)).read().splitlines()
    found = []
    i = 0
    while i < len(lines):
        if FENCE.match(lines[i]):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            marker = MARKER.fullmatch(lines[i - 1].strip()) if i > 0 else None
            kind = "" if marker is None else marker.group(1).split(":")[0]
            indent = len(lines[i]) - len(lines[i].lstrip())
            code = "\n".join(line[indent:] for line in lines[i + 1:end]) + "\n"
            found.append(Block(page, i + 1, kind, code,
                               (marker.group("why") or "") if marker else ""))
            i = end
        i += 1
    return found


def scripts(page: str) -> list[Script]:
    out: list[Script] = []
    for block in blocks(page):
        if block.kind in ("run", "then"):
            out.append(Script(block.line, block.code, [block.line]))
        elif block.kind == "continues":
            out[-1].code += "\n" + block.code
            out[-1].blocks.append(block.line)
    return out


def test_every_python_block_says_whether_it_runs():
    problems = []
    for page in PAGES:
        ran = False
        for block in blocks(page):
            where = f"{block.page}:{block.line}"
            if not block.kind:
                problems.append(f"{where}: no <!-- doc-test: ... --> marker above the block")
            elif block.kind == "skip" and len(block.why) < 15:
                problems.append(f"{where}: a skipped block must say why")
            elif block.kind in ("continues", "then") and not ran:
                problems.append(f"{where}: '{block.kind}' needs a block that runs before it")
            ran = ran or block.kind == "run"
    assert problems == []


@pytest.mark.parametrize("page", [p for p in PAGES if scripts(p)])
def test_the_blocks_of_a_page_run_as_written(page, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    for script in scripts(page):
        path = tmp_path / f"block_{script.line}.py"
        path.write_text(script.code)
        env = driver_env(HOME=str(home), MLFLOW_DISABLE_TELEMETRY="true")
        proc = subprocess.run([sys.executable, str(path)], cwd=home, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, (f"{page}, the block(s) at line(s) {script.blocks} failed:\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
