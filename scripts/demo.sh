#!/usr/bin/env bash
# The main demo: train, SIGKILL the driver mid-run, restore, check the result matches.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python examples/quickstart.py "$@"
