#!/usr/bin/env bash
# Create .venv (once) with torch (CPU), unbroken in editable mode, the test tools, the docs tools (mkdocs)
# and scikit-learn (the pb2 extra, which PB2's tests need).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
# torch is pinned so that a CPU build is used where one is provided locally.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install --quiet "torch==2.13.0"
.venv/bin/python -m pip install --quiet -e ".[torch,test,docs,pb2]"
