"""The `unbroken` command line: list, show, verify, resume and plot runs; supervise a script.

    unbroken ls [STORAGE] [--metric NAME] [--json]
    unbroken show PATH [--json]
    unbroken verify PATH [--json]
    unbroken resume PATH [--max-failures N]
    unbroken plot PATH [-o FILE] [--metric NAME ... | --goodput]
    unbroken run [--max-restarts N] [--backoff-s S] -- CMD ...

`ls`, `show`, `verify` and `plot` only read the run directory. Exit codes: 0 all is well,
1 a problem was found (a torn or corrupted checkpoint, an unreadable run, a resume that
failed or was refused), 2 bad usage (wrong arguments, a path that is not a run, an unknown
metric), 130 interrupted. Errors print one line and a hint; `--traceback` shows the rest.
`run` (see `cli.supervisor`) exits with its command's code instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from typing import Any

from unbroken import __version__
from unbroken.cli import goodput_view, inspection, run_view, supervisor, sweep_view
from unbroken.cli.cells import metric as _metric
from unbroken.cli.cells import or_dash as _or_dash
from unbroken.cli.cells import size as _size
from unbroken.cli.tables import table as _table
from unbroken.cli.tables import when as _when
from unbroken.errors import (
    LeaseHeldError,
    RunNotFoundError,
    TrainingFailedError,
    TrainingInterruptedError,
    UnbrokenError,
    UnknownMetricError,
)
from unbroken.observe.progress import ensure_log_output, is_terminal
from unbroken.store import history, sweep_manifest
from unbroken.store import manifest as mf
from unbroken.store.storage import Storage

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_BROKEN_PIPE = 0, 1, 2, 130, 141
_USAGE_ERRORS = (RunNotFoundError, UnknownMetricError)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the process exit code."""
    args = _parser().parse_args(argv)
    ensure_log_output()  # `unbroken resume` and the rest show unbroken's INFO lines on stderr
    try:
        return args.handler(args)
    except KeyboardInterrupt:
        print("unbroken: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `unbroken ls | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Exception as error:
        if args.traceback:
            raise
        _print_error(error)
        return EXIT_USAGE if isinstance(error, _USAGE_ERRORS) else EXIT_PROBLEM


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="unbroken", description="See, verify, resume and plot unbroken training runs.",
        epilog="Exit codes: 0 ok, 1 problem found, 2 bad usage.")
    parser.add_argument("--version", action="version", version=f"unbroken {__version__}")
    parser.add_argument("--traceback", action="store_true", help="show the full traceback of an error")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ls = commands.add_parser("ls", help="list the runs in a storage path",
                             description="List the runs in STORAGE with their status, attempts, "
                                         "iteration, last metric and latest checkpoint.")
    ls.add_argument("storage", nargs="?", metavar="STORAGE",
                    help="storage path or URL (default: $UNBROKEN_STORAGE or ~/unbroken_results)")
    ls.add_argument("--metric", help="the metric to show (default: the first one each run reports)")
    ls.add_argument("--json", action="store_true", help="print JSON for scripts")
    ls.set_defaults(handler=cmd_ls)

    show = commands.add_parser("show", help="show one run: attempts, time spent, checkpoints, config, "
                                              "last metrics")
    show.add_argument("path", metavar="PATH", help="the run directory, <storage_path>/<name>")
    show.add_argument("--json", action="store_true", help="print JSON for scripts")
    show.add_argument("--mtbf", type=_seconds, metavar="SECONDS",
                      help="the mean time between failures to advise a checkpoint interval for "
                           "(default: the run's own failure rate, or an hour before its first failure)")
    show.set_defaults(handler=cmd_show)

    verify = commands.add_parser("verify", help="check every checkpoint's files against its marker",
                                 description="Hash every file of every checkpoint and compare it with "
                                             "the checkpoint's commit marker. Exit 1 if any checkpoint "
                                             "is torn or corrupted.")
    verify.add_argument("path", metavar="PATH", help="the run directory")
    verify.add_argument("--json", action="store_true", help="print JSON for scripts")
    verify.set_defaults(handler=cmd_verify)

    resume = commands.add_parser("resume", help="continue a run from its latest committed checkpoint",
                                 description="Restore the run's trainer and fit() it to the end. The "
                                             "training code must be importable (run this where the "
                                             "original script ran, or set PYTHONPATH) or saved with "
                                             "the run (functions defined in the script itself are).")
    resume.add_argument("path", metavar="PATH", help="the run directory")
    resume.add_argument("--max-failures", type=_max_failures, metavar="N",
                        help="worker-group restarts allowed in this resume (-1: unlimited); "
                             "replaces the run's FailureConfig.max_failures")
    resume.set_defaults(handler=cmd_resume)

    plot = commands.add_parser("plot", help="draw metric curves to a PNG, attempt boundaries marked",
                               description="Draw metrics against training_iteration. Rows of abandoned "
                                           "attempts are drawn faded; dotted lines mark where later "
                                           "attempts resumed.")
    plot.add_argument("path", metavar="PATH", help="the run directory")
    plot.add_argument("-o", "--output", metavar="FILE", help="the PNG to write (default: ./<name>.png)")
    what = plot.add_mutually_exclusive_group()
    what.add_argument("--metric", action="append", metavar="NAME",
                      help="a metric to draw (repeat for several; default: every measured metric)")
    what.add_argument("--goodput", action="store_true",
                      help="draw where the run's time went instead: productive, checkpoint, recovery, "
                           "redone and waiting as bands, attempts and failures marked")
    plot.set_defaults(handler=cmd_plot)

    run = commands.add_parser(
        "run", help="run a training script, and start it again when its driver dies",
        usage="unbroken run [-h] [--max-restarts N] [--backoff-s S] -- CMD ...",
        description="Run CMD as a child process. When it dies by a signal or exits non-zero and the "
                    "run or sweep it opened is not finished, start it again (it resumes the run by "
                    "name). SIGTERM/SIGINT are passed on to it, and end the supervision. Exits with "
                    "CMD's code (128+s for a signal s).")
    run.add_argument("--max-restarts", type=_count, default=supervisor.DEFAULT_MAX_RESTARTS, metavar="N",
                     help=f"restarts allowed (default: {supervisor.DEFAULT_MAX_RESTARTS})")
    run.add_argument("--backoff-s", type=_backoff, default=supervisor.DEFAULT_BACKOFF_S, metavar="S",
                     help=f"seconds before the first restart, doubled for each next one up to "
                          f"{supervisor.MAX_BACKOFF_S:g} (default: {supervisor.DEFAULT_BACKOFF_S:g})")
    run.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD", help="the command to run")
    run.set_defaults(handler=cmd_run, usage=run.format_usage())
    return parser


def _max_failures(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -2
    if value < -1:
        raise argparse.ArgumentTypeError(f"expected an integer >= -1, got {text!r}")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _backoff(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


# -- commands -----------------------------------------------------------------------------
def cmd_ls(args: argparse.Namespace) -> int:
    from unbroken.core.config import RunConfig

    root = args.storage or RunConfig().resolved_storage_path()
    runs = inspection.list_runs(root)
    if args.json:
        _print_json([r.to_json() for r in runs])
    elif not runs:
        print(f"no runs in {root}", file=sys.stderr)
    else:
        rows = [[r.name, r.status, len(r.attempts) if r.attempts else "-", _or_dash(r.iteration),
                 _sweep_counts(r.trials) if r.kind == "sweep" else _metric(r.last_metrics, args.metric),
                 goodput_view.cell(r.time), r.latest_checkpoint or "-", _when(r.updated_at)]
                for r in runs]
        print(_table(["NAME", "STATUS", "ATTEMPTS", "ITER", "LAST METRIC", "GOODPUT", "LATEST CHECKPOINT",
                      "UPDATED"], rows))
        for r in runs:
            if r.problem:
                print(f"{r.name}: {r.problem}", file=sys.stderr)
    return EXIT_PROBLEM if any(r.problem for r in runs) else EXIT_OK


def _sweep_counts(counts: dict[str, int] | None) -> str:
    """'sweep: 6 TERMINATED, 1 ERROR, 1 PENDING' for a sweep's row in `ls`."""
    return "sweep: " + ", ".join(f"{n} {status}" for status, n in (counts or {}).items() if n)


def cmd_show(args: argparse.Namespace) -> int:
    if sweep_manifest.is_sweep_dir(Storage.from_url(args.path)):
        summary = sweep_view.sweep_summary(args.path)
        _print_json(summary) if args.json else sweep_view.print_sweep(summary)
        return EXIT_OK
    s = inspection.summarize(args.path, mtbf_s=args.mtbf)
    _print_json(s.to_json()) if args.json else run_view.print_run(s)
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    bar = None

    def progress(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc="hashing", file=sys.stderr, leave=False)
        bar.update(done - bar.n)

    report = inspection.verify_run(args.path, progress=progress if is_terminal(sys.stderr) else None)
    if bar is not None:
        bar.close()
    if args.json:
        _print_json(report.to_json())
        return EXIT_OK if report.ok else EXIT_PROBLEM
    rows = []
    for c in report.checkpoints:
        if c.state == inspection.COMMITTED:
            detail = f"{c.files} file{'s' if c.files != 1 else ''}, {_size(c.bytes)}"
        elif c.state == inspection.UNCOMMITTED:
            detail = "never committed; the next resume deletes it"
        elif c.state == inspection.QUARANTINED:
            detail = "set aside by an earlier resume; kept, never used"
        else:
            detail = "; ".join(c.problems)
        rows.append([c.name, "ok" if c.state == inspection.COMMITTED else c.state, detail])
    if rows:
        print(_table(None, rows))
    checked = [c for c in report.checkpoints if c.is_checkpoint]
    counts = ", ".join(f"{sum(c.state == st for c in checked)} {st}" for st in (inspection.TORN,
                                                                                inspection.CORRUPTED)
                       if any(c.state == st for c in checked))
    print(f"{len(checked) - len(report.bad)} of {len(checked)} checkpoints verified"
          + (f"; {counts}" if counts else ""))
    if not report.ok:
        where = (f"starts from {report.resume_point}, the newest checkpoint that verifies"
                 if report.resume_point else "finds no checkpoint that verifies and starts over")
        print(f"hint: a resume {where}; a torn or corrupted checkpoint it meets is set aside as "
              "<name>.corrupt-N", file=sys.stderr)
    return EXIT_OK if report.ok else EXIT_PROBLEM


def cmd_resume(args: argparse.Namespace) -> int:
    storage = Storage.from_url(args.path)
    manifest = mf.load(storage)
    url, name = storage.url(), inspection.run_name(storage)
    if manifest.status == mf.FINISHED:
        last = history.last_row(storage) or {}
        print(f"run {name} already finished at iteration "
              f"{_or_dash(last.get('training_iteration'))}; nothing to resume")
        return EXIT_OK
    _refuse_if_driven(storage, url)
    trainer = _restore_trainer(url, _resume_overrides(storage, manifest, args.max_failures))
    status = inspection.summarize(url, brief=True)
    start = f"from {status.latest_checkpoint}" if status.latest_checkpoint else "from the beginning"
    print(f"resuming run {name} ({status.status}, {len(manifest.attempts)} attempt"
          f"{'s' if len(manifest.attempts) != 1 else ''} so far) {start}", flush=True)
    return _fit_to_end(trainer, storage, name)


def _refuse_if_driven(storage: Storage, url: str) -> None:
    """Raise LeaseHeldError while another live process drives the run (a dead one's lease is
    taken over by the restore itself)."""
    from unbroken.store.lease import live_holder

    holder = live_holder(storage)
    if holder is not None:
        raise LeaseHeldError(f"run {url!r} is being driven by another process (pid {holder.get('pid')} on "
                             f"{holder.get('host')}). Hint: wait for it to finish or stop it; a run whose "
                             "driver died is taken over automatically")


def _resume_overrides(storage: Storage, manifest: mf.RunManifest,
                      max_failures: int | None) -> dict[str, Any]:
    """Trainer arguments that replace the saved ones: with --max-failures, the run's saved
    RunConfig with only FailureConfig.max_failures changed."""
    if max_failures is None:
        return {}
    from unbroken.core.config import FailureConfig, RunConfig
    from unbroken.run.restore import load_saved_arg

    saved = load_saved_arg(storage, manifest, "run_config") or RunConfig()
    failure = dataclasses.replace(saved.failure_config or FailureConfig(), max_failures=max_failures)
    return {"run_config": dataclasses.replace(saved, failure_config=failure)}


def _restore_trainer(url: str, overrides: dict[str, Any]) -> Any:
    """The run's trainer, restored with the current directory importable (as `python script.py`
    would have it: modules next to the script import); an ImportError gets a hint."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from unbroken.train.trainer import BaseTrainer

    try:
        return BaseTrainer.restore(url, **overrides)
    except ImportError as e:
        raise ImportError(f"the run's code cannot be imported ({e}). Hint: run `unbroken resume` from the "
                          "directory your training script ran in, or add its directory to PYTHONPATH") from e


def _fit_to_end(trainer: Any, storage: Storage, name: str) -> int:
    """fit() the restored trainer and report how it ended; the exit code."""
    url = storage.url()
    try:
        result = trainer.fit()
    except TrainingInterruptedError as e:
        print(f"unbroken: {str(e).splitlines()[0]}", file=sys.stderr)
        print(f"hint: continue with: unbroken resume {url}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except TrainingFailedError as e:
        print(f"unbroken: error: {str(e).splitlines()[0]}", file=sys.stderr)
        print(f"hint: the traceback is in {storage.url('error.txt')}; the run and its checkpoints are kept. "
              f"After fixing the cause: unbroken resume {url}", file=sys.stderr)
        return EXIT_PROBLEM
    attempts = len(mf.load(storage).attempts)
    print(f"run {name} {result.status} at iteration "
          f"{_or_dash((result.metrics or {}).get('training_iteration'))} after {attempts} attempts; "
          f"last {_metric(result.metrics, None)}")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print(f"{args.usage.rstrip()}\nunbroken run: error: no command given. Hint: "
              "unbroken run -- python train.py", file=sys.stderr)
        return EXIT_USAGE
    return supervisor.supervise(command, args.max_restarts, args.backoff_s)


def cmd_plot(args: argparse.Namespace) -> int:
    from unbroken.cli.plotting import plot_goodput, plot_run

    path = os.path.abspath(os.path.expanduser(args.path)) if "://" not in args.path else args.path
    name = path.rstrip('/').rsplit('/', 1)[-1]
    if args.goodput:
        out = args.output or f"{name}-goodput.png"
        plot_goodput(path, out)
        print(f"wrote {out}: where the run's time went")
        return EXIT_OK
    out = args.output or f"{name}.png"
    drawn = plot_run(path, out, args.metric)
    print(f"wrote {out}: {', '.join(drawn)} against training_iteration")
    return EXIT_OK


# -- formatting ---------------------------------------------------------------------------
def _print_error(error: BaseException) -> None:
    message = str(error).strip() or type(error).__name__
    if not isinstance(error, (UnbrokenError, ImportError, ValueError, TypeError, OSError)):
        message = f"{type(error).__name__}: {message}"
    text, _, hint = message.partition("Hint:")
    print(f"unbroken: error: {text.strip()}", file=sys.stderr)
    if hint:
        print(f"hint: {hint.strip()}", file=sys.stderr)
    elif not isinstance(error, UnbrokenError):
        print("hint: run `unbroken --traceback ...` to see where it happened", file=sys.stderr)


def _print_json(obj: Any) -> None:
    print(json.dumps(_json_safe(obj), indent=2, sort_keys=True, default=str))


def _json_safe(obj: Any) -> Any:
    """Strict JSON: non-finite floats become strings ("nan", "inf")."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return repr(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj
