"""The documentation site builds: `mkdocs build --strict` (mkdocs.yml at the root, the API
reference generated from the docstrings by mkdocstrings) into a temporary directory.

Needs the `docs` extra (`pip install -e ".[docs]"`), which the README's test command installs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _size(path: str) -> int:
    return os.path.getsize(os.path.join(ROOT, path))


def test_the_docs_stay_short():
    """A newcomer reads the README in minutes, and each fact is in one place."""
    assert _size("README.md") <= 12_000
    assert _size("docs/architecture.md") <= 25_000
    pages = [os.path.join(d, f) for d, _, files in os.walk(DOCS) for f in files if f.endswith(".md")]
    assert sum(os.path.getsize(p) for p in pages) <= 200_000


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for page in ("index.html", "api/train/index.html", "api/train-torch/index.html", "api/tune/index.html",
                 "api/cli/index.html", "benchmarks/index.html", "architecture/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    reference = (tmp_path / "site" / "api" / "train-torch" / "index.html").read_text()
    assert 'id="unbroken.train.torch.TrainState"' in reference, "the API reference is generated"
