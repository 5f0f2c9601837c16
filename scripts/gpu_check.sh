#!/usr/bin/env bash
# The CUDA path on a GPU machine, from a clean checkout: the `gpu` tests (tests/test_gpu.py) and
# the GPU rows of benchmarks/bench_checkpoint.py, then one table. About 5 minutes on one H200.
#
#   bash scripts/gpu_check.sh            # PYTHON=... to choose the interpreter
#
# It needs a Python whose torch is a CUDA build: $PYTHON, else .venv's if it sees a GPU, else
# python3. Where none sees a GPU it fails (exit 2) and checks nothing: it never skips silently.
# What it lacks of unbroken's own dependencies it installs with pip when it can; the package
# itself runs from src/. Exit status: 0 when every test that ran passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${GPU_CHECK_OUT:-gpu-check}"
mkdir -p "$OUT_DIR"

sees_gpu() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in .venv/bin/python python3; do
    if command -v "$candidate" >/dev/null && sees_gpu "$candidate"; then PY="$candidate"; break; fi
  done
fi
if [ -z "$PY" ] || ! sees_gpu "$PY"; then
  echo "gpu_check: FAILED: no CUDA GPU seen by ${PY:-.venv/bin/python or python3}" >&2
  [ -z "$PY" ] && PY=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)
  "$PY" -c "import torch; print('  torch', torch.__version__, 'CUDA build:', torch.version.cuda, \
'devices:', torch.cuda.device_count())" >&2 2>/dev/null || echo "  (torch does not import)" >&2
  exit 2
fi
"$PY" -c "import torch; print('gpu_check:', torch.cuda.get_device_name(), '| torch', torch.__version__, \
'| CUDA', torch.version.cuda, '| GPUs:', torch.cuda.device_count())"

missing=$("$PY" - <<'EOF'
import importlib.util
need = {"fsspec": "fsspec", "cloudpickle": "cloudpickle", "pandas": "pandas", "tqdm": "tqdm",
        "pytest": "pytest", "pytest_timeout": "pytest-timeout"}
print(" ".join(pip for mod, pip in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "gpu_check: installing $missing"
  "$PY" -m pip install --quiet $missing || { echo "gpu_check: FAILED: cannot install $missing" >&2; exit 2; }
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" CUBLAS_WORKSPACE_CONFIG=:4096:8

echo "gpu_check: the gpu tests"
"$PY" -m pytest -m gpu tests/test_gpu.py -p no:cacheprovider -q -rA -s --timeout 300 \
  --junitxml "$OUT_DIR/gpu-tests.xml" 2>&1 | tee "$OUT_DIR/gpu-tests.log"
tests_rc=${PIPESTATUS[0]}

echo "gpu_check: benchmarks/bench_checkpoint.py --gpu"
"$PY" benchmarks/bench_checkpoint.py --gpu --repeats "${GPU_CHECK_REPEATS:-3}" 2>&1 | tee "$OUT_DIR/bench.log"
bench_rc=${PIPESTATUS[0]}

"$PY" - "$OUT_DIR" "$tests_rc" "$bench_rc" <<'EOF'
import sys
import xml.etree.ElementTree as ET

out, tests_rc, bench_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
print("\n## gpu_check\n\n| check | result |\n|---|---|")
try:
    for case in ET.parse(f"{out}/gpu-tests.xml").getroot().iter("testcase"):
        verdict = "passed"
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                why = (found.get("message") or "").splitlines()[0][:120] if found.get("message") else ""
                verdict = f"{'FAILED' if tag != 'skipped' else 'skipped'}: {why}"
        print(f"| {case.get('name')} | {verdict} |")
except (OSError, ET.ParseError) as e:
    print(f"| gpu tests | FAILED: no report ({e}) |")
rows = [line for line in open(f"{out}/bench.log") if line.startswith("| ") and "MiB" in line]
print(f"| bench_checkpoint --gpu | {'ran' if bench_rc == 0 and rows else 'FAILED'} (table in bench.log) |")
print()
print("".join(line for line in open(f"{out}/bench.log") if line.startswith("|")))
EOF
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && echo "gpu_check: passed" && exit 0
echo "gpu_check: FAILED (tests exit $tests_rc, bench exit $bench_rc)" >&2
exit 1
