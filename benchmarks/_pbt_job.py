"""One population-based-training sweep for bench_pbt.py, by unbroken or by Ray Tune:

    python benchmarks/_pbt_job.py <unbroken|unbroken-reuse|ray|ray-reuse> <fifo|pbt> <storage> <name>
                                  <work dir> [restore]

(`-reuse`: with `TuneConfig(reuse_actors=True)`.)

The trainable is the same for both: a small linear model trained with SGD, checkpointed at
every report; each iteration it runs appends one line (trial, step, seconds of compute) to
<work dir>/executed.log, so the benchmark counts the iterations that ran, re-runs included.
Prints "RESULT <json>": each trial's final lr and score, in trial order.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

TRIALS = 8
ITERATIONS = 12
INTERVAL = 3          # perturbation_interval, in iterations
STEPS = 40            # SGD steps per iteration
LRS = [0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064]
CONCURRENT = 2
PBT = {"time_attr": "training_iteration", "perturbation_interval": INTERVAL, "quantile_fraction": 0.25,
       "hyperparam_mutations": {"lr": LRS}, "synch": os.environ.get("PBT_SYNCH", "1") == "1"}


def trainable(config: dict) -> None:
    """Both libraries' trainable: the library's report and checkpoint calls are chosen by
    config["framework"], a constant of the param_space."""
    import torch

    if config["framework"] == "ray":
        from ray import tune as lib
        from ray.tune import Checkpoint
    else:
        from unbroken import tune as lib
        from unbroken.tune import Checkpoint
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    y = x @ torch.linspace(-1, 1, 16).unsqueeze(1) + 0.1 * torch.randn(256, 1)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    start = 0
    checkpoint = lib.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["step"]
    for group in opt.param_groups:
        group["lr"] = config["lr"]  # an exploit's new lr replaces the donor's
    name = f"lr={config['lr']}"
    for step in range(start + 1, ITERATIONS + 1):
        t0 = time.perf_counter()
        for _ in range(STEPS):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        spent = time.perf_counter() - t0
        with open(os.path.join(config["work"], "executed.log"), "a") as f:
            f.write(f"{name} {step} {spent:.6f}\n")
        with tempfile.TemporaryDirectory() as d:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step},
                       os.path.join(d, "state.pt"))
            lib.report({"score": -loss.item(), "step": step}, checkpoint=Checkpoint.from_directory(d))


def space(lib, framework: str, work: str) -> dict:
    return {"lr": lib.grid_search(LRS), "framework": framework, "work": work}


def run_unbroken(kind: str, storage: str, name: str, work: str, restore: bool,
                 reuse: bool = False) -> list:
    from unbroken import tune
    from unbroken.train import RunConfig
    from unbroken.tune.schedulers import PopulationBasedTraining

    scheduler = None
    if kind == "pbt":
        scheduler = PopulationBasedTraining(**PBT)
    config = tune.TuneConfig(metric="score", mode="max", scheduler=scheduler, seed=0,
                             max_concurrent_trials=CONCURRENT, reuse_actors=reuse)
    if restore:
        grid = tune.Tuner.restore(os.path.join(storage, name), trainable).fit()
    else:
        grid = tune.Tuner(trainable, param_space=space(tune, "unbroken", work), tune_config=config,
                          run_config=RunConfig(name=name, storage_path=storage, verbose=0)).fit()
    return [(r.config["lr"], r.metrics["score"]) for r in grid]


def run_ray(kind: str, storage: str, name: str, work: str, restore: bool, reuse: bool = False) -> list:
    import ray
    from ray import tune
    from ray.tune.schedulers import FIFOScheduler, PopulationBasedTraining

    ray.init(num_cpus=CONCURRENT, include_dashboard=False, log_to_driver=False)
    scheduler = FIFOScheduler()
    if kind == "pbt":
        scheduler = PopulationBasedTraining(**PBT)
    fn = tune.with_resources(trainable, {"cpu": 1})
    if restore:
        tuner = tune.Tuner.restore(os.path.join(storage, name), fn, resume_unfinished=True)
    else:
        tuner = tune.Tuner(fn, param_space=space(tune, "ray", work),
                           tune_config=tune.TuneConfig(metric="score", mode="max", scheduler=scheduler,
                                                       max_concurrent_trials=CONCURRENT, reuse_actors=reuse),
                           run_config=tune.RunConfig(name=name, storage_path=storage, verbose=0))
    grid = tuner.fit()
    results = sorted(grid, key=lambda r: r.path)
    return [(r.config["lr"], r.metrics["score"]) for r in results]


def main(argv: list[str]) -> None:
    framework, kind, storage, name, work = argv[:5]
    restore = len(argv) > 5 and argv[5] == "restore"
    if framework.startswith("ray"):
        result = run_ray(kind, storage, name, work, restore, reuse=framework == "ray-reuse")
    else:
        result = run_unbroken(kind, storage, name, work, restore, reuse=framework == "unbroken-reuse")
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
