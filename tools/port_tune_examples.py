"""Port Ray Tune's own examples and documentation snippets to unbroken by changing their
imports only, run each, and print a markdown table of what ran.

    python tools/port_tune_examples.py RAY_SOURCE OUT_DIR [--timeout 120] [--only NAME ...]

RAY_SOURCE is a Ray git directory (bare, or a snapshot without a work tree; read at
`--rev`, HEAD by default) or a checkout. The selection is `python/ray/tune/examples/*.py`
(top level) and `doc/source/tune/doc_code/*.py`: the files that need only Ray Tune and Ray
Train, torch, numpy, optuna and scikit-learn run; the others are listed with why they are
out of scope.

The port is mechanical, as a user would do it:

- `from ray import tune` / `train` / `air` (any of them, in any order) -> `from unbroken import ...`;
- `import ray.tune as tune` -> `import unbroken.tune as tune` (likewise `ray.train`, `ray.air`);
- `from ray.tune.X import Y` -> `from unbroken.tune.X import Y` (likewise `ray.train`, `ray.air`);
- `from ray.tune.examples.X import Y` -> `from X import Y`: the sibling example, ported
  alongside;
- a statement `ray.init(...)` or `ray.shutdown()` -> `pass`.

Nothing else is changed: `import ray` and other `ray.` calls stay. An example with a
`--smoke-test` flag is run with it, as Ray's CI runs it. Each example runs alone in
`OUT_DIR/<name>/` with `HOME` there too (so `~/ray_results` and the default storage path
land under OUT_DIR), one at a time. A run that outlives `--timeout` gets SIGTERM, then
SIGKILL, and so does every process it left behind (found by an environment marker).
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

EXAMPLES = "python/ray/tune/examples"
DOC_CODE = "doc/source/tune/doc_code"

# Files of the selection that are not run, and why.
OUT_OF_SCOPE: dict[str, str] = {
    f"{EXAMPLES}/__init__.py": "not an example",
    f"{EXAMPLES}/utils.py": "a helper module (tensorflow)",
    f"{EXAMPLES}/ax_example.py": "needs ax-platform (AxSearch)",
    f"{EXAMPLES}/bayesopt_example.py": "needs bayesian-optimization (BayesOptSearch)",
    f"{EXAMPLES}/bohb_example.py": "needs hpbandster and ConfigSpace (TuneBOHB, HyperBandForBOHB)",
    f"{EXAMPLES}/hyperopt_conditional_search_space_example.py": "needs hyperopt (HyperOptSearch)",
    f"{EXAMPLES}/nevergrad_example.py": "needs nevergrad (NevergradSearch)",
    f"{EXAMPLES}/cifar10_pytorch.py": "needs torchvision and a CIFAR-10 download",
    f"{EXAMPLES}/mnist_pytorch.py": "needs torchvision and an MNIST download",
    f"{EXAMPLES}/mnist_pytorch_trainable.py": "needs torchvision and an MNIST download; "
                                              "ray.init(address=...)",
    f"{EXAMPLES}/pbt_convnet_example.py": "needs torchvision and an MNIST download",
    f"{EXAMPLES}/pbt_convnet_function_example.py": "needs torchvision and an MNIST download",
    f"{EXAMPLES}/mnist_ptl_mini.py": "needs torchvision, datasets, torchmetrics and a download",
    f"{EXAMPLES}/mlflow_example.py": "needs mlflow (ray.air.integrations.mlflow)",
    f"{EXAMPLES}/mlflow_ptl.py": "needs mlflow, torchvision, datasets",
    f"{EXAMPLES}/lightgbm_example.py": "needs lightgbm (ray.tune.integration.lightgbm)",
    f"{EXAMPLES}/xgboost_example.py": "needs xgboost (ray.tune.integration.xgboost)",
    f"{EXAMPLES}/xgboost_dynamic_resources_example.py": "needs xgboost; ResourceChangingScheduler "
                                                        "and placement groups (Ray cluster)",
    f"{EXAMPLES}/pb2_ppo_example.py": "needs RLlib and gymnasium",
    f"{EXAMPLES}/pbt_ppo_example.py": "needs RLlib and gymnasium",
    f"{EXAMPLES}/pbt_memnn_example.py": "needs tensorflow",
    f"{EXAMPLES}/pbt_tune_cifar10_with_keras.py": "needs tensorflow",
    f"{EXAMPLES}/tf_mnist_example.py": "needs tensorflow",
    f"{EXAMPLES}/tune_mnist_keras.py": "needs tensorflow",
    f"{DOC_CODE}/keras_hyperopt.py": "needs tensorflow and hyperopt",
    f"{DOC_CODE}/pytorch_optuna.py": "needs torchvision and an MNIST download",
}

_NAMES = r"(?:tune|train|air)"
_FROM_RAY_IMPORT = re.compile(r"^(\s*)from ray import (.+)$")
_IMPORT_AS = re.compile(rf"^(\s*)import ray\.({_NAMES}(?:\.[\w.]+)?)(\s+as\s+\w+)?\s*$")
_FROM_EXAMPLES = re.compile(r"^(\s*)from ray\.tune\.examples\.([\w.]+) import ")
_FROM_RAY_SUB = re.compile(rf"^(\s*)from ray\.({_NAMES})(\.[\w.]+)? import ")


@dataclass
class Outcome:
    name: str
    result: str        # "ran", "failed", "timed out"
    detail: str        # the first line of the error, where it failed
    seconds: float


def is_git_dir(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


class Source:
    """The files of a Ray git directory (at a revision) or of a checkout."""

    def __init__(self, path: Path, rev: str) -> None:
        self.path, self.rev = path, rev
        self.git = is_git_dir(path)

    def describe(self) -> str:
        if self.git:
            commit = subprocess.run(["git", f"--git-dir={self.path}", "rev-parse", self.rev],
                                    capture_output=True, text=True, check=True).stdout.strip()
            return f"git {self.rev} = {commit}"
        return f"checkout {self.path.name}"

    def list_py(self, folder: str) -> list[str]:
        if self.git:
            out = subprocess.run(["git", f"--git-dir={self.path}", "ls-tree", "--name-only",
                                  f"{self.rev}:{folder}"], capture_output=True, text=True)
            names = out.stdout.split() if out.returncode == 0 else []
        else:
            where = self.path / folder
            names = [p.name for p in where.iterdir() if p.is_file()] if where.is_dir() else []
        return sorted(f"{folder}/{n}" for n in names if n.endswith(".py"))

    def read(self, rel: str) -> str:
        if self.git:
            return subprocess.run(["git", f"--git-dir={self.path}", "show", f"{self.rev}:{rel}"],
                                  capture_output=True, text=True, check=True).stdout
        return (self.path / rel).read_text()


def _port_from_ray(match: re.Match[str]) -> str:
    indent, names = match.group(1), match.group(2)
    parts = [p.strip() for p in names.strip("() ").split(",") if p.strip()]
    if parts and all(re.fullmatch(rf"{_NAMES}(\s+as\s+\w+)?", p) for p in parts):
        return f"{indent}from unbroken import {names}"
    return match.group(0)       # `from ray import something_else`: not a Tune or Train name


def _ray_lifecycle_lines(text: str) -> list[tuple[int, int]]:
    """(first line, last line), 1-based, of each statement that is only `ray.init(...)` or
    `ray.shutdown(...)`."""
    spans = []
    for node in ast.walk(ast.parse(text)):
        if (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Attribute)
                and isinstance(node.value.func.value, ast.Name) and node.value.func.value.id == "ray"
                and node.value.func.attr in ("init", "shutdown")):
            spans.append((node.lineno, node.end_lineno or node.lineno))
    return spans


def port(text: str) -> str:
    """The example with its imports changed to unbroken's and `ray.init`/`ray.shutdown`
    statements replaced by `pass`; every other line as it was."""
    lines = text.splitlines()
    for first, last in _ray_lifecycle_lines(text):
        indent = re.match(r"\s*", lines[first - 1]).group(0)
        lines[first - 1] = f"{indent}pass"
        for i in range(first, last):
            lines[i] = ""        # keep the line numbers of the rest
    out = []
    for line in lines:
        line = _FROM_RAY_IMPORT.sub(_port_from_ray, line)
        line = _IMPORT_AS.sub(lambda m: f"{m.group(1)}import unbroken.{m.group(2)}{m.group(3) or ''}",
                              line)
        line = _FROM_EXAMPLES.sub(lambda m: f"{m.group(1)}from {m.group(2)} import ", line)
        line = _FROM_RAY_SUB.sub(
            lambda m: f"{m.group(1)}from unbroken.{m.group(2)}{m.group(3) or ''} import ", line)
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def snippet_at(text: str, lineno: int) -> str | None:
    """The documentation snippet (`# __name_start__` ... `# __name_end__`) holding a line."""
    current = None
    for i, line in enumerate(text.splitlines(), start=1):
        start = re.match(r"\s*# __(\w+?)_(start|begin)__", line)
        end = re.match(r"\s*# __(\w+?)_end__", line)
        if start:
            current = start.group(1)
        elif end and current == end.group(1):
            if i > lineno:
                return current
            current = None
        if i == lineno:
            return current
    return None


_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)|[\w.]+Error)\b.*")


def first_error_line(output: str) -> str:
    """The first line of the exception that ended the script (the first unindented line
    after the last traceback's frames), else the last error-like line, else the last line."""
    lines = [ln.rstrip() for ln in output.splitlines() if ln.strip()]
    last_tb = max((i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent")),
                  default=-1)
    if last_tb >= 0:
        for ln in lines[last_tb + 1:]:
            if not ln[0].isspace():
                return ln[:300]
    errors = [ln for ln in lines if _ERROR_LINE.match(ln)]
    return (errors or lines or ["(no output)"])[-1][:300]


def failing_line(output: str, script: str) -> int | None:
    """The line of the script (not of a library) where the last traceback left it."""
    hits = re.findall(rf'File "[^"]*{re.escape(script)}", line (\d+)', output)
    return int(hits[-1]) if hits else None


def _pids_with_marker(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _stop_leftovers(marker: str) -> None:
    """SIGTERM, then SIGKILL, each process (by its id) that carries this run's marker."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = _pids_with_marker(marker)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        if not pids:
            return
        time.sleep(5)


def run_one(rel: str, text: str, out_dir: Path, python: str, timeout: float) -> Outcome:
    name = Path(rel).stem
    kind = "doc" if rel.startswith(DOC_CODE) else "ex"
    where = out_dir / f"{kind}_{name}"
    shutil.rmtree(where, ignore_errors=True)
    (where / "home").mkdir(parents=True)
    script = f"{name}.py"
    ported = port(text)
    (where / script).write_text(ported)
    args = [python, script] + (["--smoke-test"] if "--smoke-test" in text else [])
    marker = f"PORT_TUNE_EXAMPLE_RUN={uuid.uuid4().hex}"
    key, value = marker.split("=", 1)
    env = dict(os.environ, HOME=str(where / "home"), PYTHONUNBUFFERED="1", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join([str(out_dir / "siblings"), os.environ.get("PYTHONPATH", "")]),
               **{key: value})
    start = time.monotonic()
    with open(where / "output.txt", "w") as log:
        proc = subprocess.Popen(args, cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except OSError:
                pass
            try:
                rc = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    seconds = time.monotonic() - start
    _stop_leftovers(marker)
    output = (where / "output.txt").read_text(errors="replace")
    label = f"{'doc_code' if kind == 'doc' else 'examples'}/{script}"
    if timed_out:
        return Outcome(label, "timed out", f"after {timeout:.0f} s", seconds)
    if rc == 0:
        return Outcome(label, "ran", "", seconds)
    detail = first_error_line(output)
    line = failing_line(output, script)
    if line is not None:
        snippet = snippet_at(ported, line)
        detail += f" (line {line}" + (f", snippet {snippet})" if snippet else ")")
    return Outcome(label, "failed", detail, seconds)


def table(outcomes: list[Outcome]) -> str:
    rows = ["| example | result | first error line |", "|---|---|---|"]
    for o in outcomes:
        detail = o.detail.replace("|", "\\|")
        rows.append(f"| {o.name} | {o.result} ({o.seconds:.0f} s) | {detail} |")
    ran = sum(o.result == "ran" for o in outcomes)
    rows.append("")
    rows.append(f"{ran} of {len(outcomes)} run.")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ray_source", type=Path, help="a Ray git directory or checkout")
    parser.add_argument("out_dir", type=Path, help="where the ported examples are written and run")
    parser.add_argument("--rev", default="HEAD", help="the revision of a git directory")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per example")
    parser.add_argument("--python", default=sys.executable, help="the interpreter that has unbroken")
    parser.add_argument("--only", nargs="*", default=None, help="run only these (file stems)")
    parser.add_argument("--port-only", action="store_true", help="write the ported files, run nothing")
    args = parser.parse_args(argv)

    source = Source(args.ray_source.expanduser().resolve(), args.rev)
    out_dir = args.out_dir.expanduser().resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    files = source.list_py(EXAMPLES) + source.list_py(DOC_CODE)
    if not files:
        parser.error(f"no {EXAMPLES}/*.py nor {DOC_CODE}/*.py in {args.ray_source}")

    # Examples import each other (`from ray.tune.examples.pbt_function import ...`): every
    # ported example is also importable by its own name.
    siblings = out_dir / "siblings"
    shutil.rmtree(siblings, ignore_errors=True)
    siblings.mkdir()
    for rel in source.list_py(EXAMPLES):
        (siblings / Path(rel).name).write_text(port(source.read(rel)))

    selected = [rel for rel in files if rel not in OUT_OF_SCOPE]
    if args.only:
        selected = [rel for rel in selected if Path(rel).stem in args.only]
    print(f"source: {source.describe()}\n")
    print("Out of scope:\n")
    for rel in files:
        if rel in OUT_OF_SCOPE:
            print(f"- {rel}: {OUT_OF_SCOPE[rel]}")
    print()
    if args.port_only:
        for rel in selected:
            kind = "doc" if rel.startswith(DOC_CODE) else "ex"
            target = out_dir / f"{kind}_{Path(rel).stem}"
            target.mkdir(parents=True, exist_ok=True)
            (target / Path(rel).name).write_text(port(source.read(rel)))
        print("\n".join(selected))
        return 0
    outcomes = []
    for rel in selected:
        outcome = run_one(rel, source.read(rel), out_dir, args.python, args.timeout)
        print(f"{outcome.name}: {outcome.result} {outcome.detail}", file=sys.stderr, flush=True)
        outcomes.append(outcome)
    print(table(outcomes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
