#!/usr/bin/env bash
# The test suite (the default run skips soak tests marked slow; add `-m slow` for those).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests examples benchmarks
exec .venv/bin/python -m pytest -q "$@"
