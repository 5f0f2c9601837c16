"""A driver that races another one for the same run or sweep (tests/test_driver_race.py).

Run as `python -c "import race_loops; race_loops.main()" MODE ROOT`, with $RACE_TAG naming
this driver. It prints READY, then for each line `go NAME` on stdin it opens the run (or
sweep) NAME under ROOT the way MODE says and prints one line:

    OUTCOME trained        this driver trained it (the result carries its tag)
    OUTCOME stored         fit() returned a result another driver had stored
    OUTCOME refused <msg>  LeaseHeldError
    OUTCOME failed <msg>   TrainingFailedError (MODE prepare: the run is left to resume)
    OUTCOME error <msg>    anything else

MODE: inspect (prints what is stored instead: see `stored`), prepare (a new run that fails
at iteration 3), fresh (a new name), rerun (the same trainer again, which auto-resumes the
named run), restore (Trainer.restore), sweep (a new 2-trial sweep).
Torch-free, so that a driver starts in a fraction of a second.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from unbroken import train, tune
from unbroken.errors import LeaseHeldError, TrainingFailedError
from unbroken.store import commit
from unbroken.store.history import read_rows
from unbroken.store.storage import Storage
from unbroken.train import Checkpoint, DataParallelTrainer, RunConfig, ScalingConfig

ITERATIONS = 4


def race_loop(config: dict) -> None:
    """Reports ITERATIONS rows tagged with the driver's $RACE_TAG; rank 0 saves a checkpoint
    (its iteration and the tag) with each. With $RACE_CRASH set it raises at iteration 3."""
    tag = os.environ["RACE_TAG"]
    rank = train.get_context().get_world_rank()
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            start = json.load(open(os.path.join(d, "state.json")))["it"]
    for it in range(start + 1, ITERATIONS + 1):
        if os.environ.get("RACE_CRASH") and it == 3:
            raise RuntimeError("stopped at iteration 3, to be resumed")
        time.sleep(0.1)  # the work of a step: long enough that a racing driver meets a live lease
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                with open(os.path.join(d, "state.json"), "w") as f:
                    json.dump({"it": it, "tag": tag}, f)
            train.report({"it": it, "tag": tag, "x": config.get("x", 0)},
                         checkpoint=Checkpoint.from_directory(d) if rank == 0 else None)


def _trainer(root: str, name: str) -> DataParallelTrainer:
    return DataParallelTrainer(race_loop, train_loop_config={}, scaling_config=ScalingConfig(num_workers=2),
                               run_config=RunConfig(name=name, storage_path=root, verbose=0))


def _race(mode: str, root: str, name: str) -> str:
    tag = os.environ["RACE_TAG"]
    if mode == "sweep":
        grid = tune.Tuner(race_loop, param_space={"x": tune.grid_search([1, 2])},
                          run_config=RunConfig(name=name, storage_path=root, verbose=0)).fit()
        tags = {result.metrics.get("tag") for result in grid}
        return "trained" if tags == {tag} else f"stored {sorted(map(str, tags))}"
    if mode == "restore":
        result = DataParallelTrainer.restore(f"{root}/{name}").fit()
    else:
        result = _trainer(root, name).fit()
    return "trained" if result.metrics["tag"] == tag else "stored"


def stored(root: str, name: str) -> dict[str, dict]:
    """For the run NAME (or each trial of the sweep NAME): its number of attempts, its rows as
    [attempt, iteration, tag], and its committed checkpoints' tags."""
    top = Storage.from_url(f"{root}/{name}")
    runs = {"": top} if top.exists(".unbroken/run.json") else {
        entry: top.child(entry) for entry in top.listdir() if top.exists(f"{entry}/.unbroken/run.json")}
    out = {}
    for key, run in sorted(runs.items()):
        manifest = json.loads(run.read_bytes(".unbroken/run.json"))
        tags = [json.loads(run.read_bytes(f"{ck}/state.json"))["tag"] for ck in commit.scan(run)[0]
                if run.exists(f"{ck}/{commit.MARKER}")]
        out[key] = {"attempts": len(manifest["attempts"]), "checkpoint_tags": tags,
                    "rows": [[r.get("attempt"), r.get("it"), r.get("tag")] for r in read_rows(run)]}
    return out


def main() -> None:
    mode, root = sys.argv[1:3]
    if mode == "prepare":
        os.environ["RACE_CRASH"] = "1"
    print("READY", flush=True)
    for line in sys.stdin:
        name = line.split()[1]
        if mode == "inspect":
            print("STORED " + json.dumps(stored(root, name)), flush=True)
            continue
        try:
            outcome = _race("fresh" if mode == "prepare" else mode, root, name)
        except LeaseHeldError as e:
            outcome = f"refused {e}"
        except TrainingFailedError as e:
            outcome = f"failed {e}"
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            outcome = f"error {type(e).__name__}: {e}"
        print("OUTCOME " + outcome.replace("\n", " "), flush=True)
