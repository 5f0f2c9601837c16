"""One job of bench_preemption.py: a 2-rank DDP job on the Ray cluster at $RAY_ADDRESS, with
`max_failures=0`, written once against Ray Train V2's API and run by unbroken or by Ray.

    python benchmarks/_preemption_job.py <work dir> <unbroken|ray> <iterations>

Each step takes STEP_S; the loop reports every step, attaches a checkpoint every CKPT_EVERY
steps and at the report after it learns of a preemption (`get_preemption_info()`, and, for
unbroken, `should_checkpoint()`, which is how its driver asks). Rank 0 appends one line per
report to <work>/rows.jsonl (iteration, time after the report returned, process, whether it
carried a checkpoint); rank 1 writes its node id to <work>/node-r1 when it starts. The job
writes <work>/survived when fit() returns.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import torch

STEP_S, CKPT_EVERY = 0.2, 10


def loop(config: dict) -> None:
    import ray

    if config["lib"] == "ray":
        from ray import train
        from ray.train import Checkpoint
        from ray.train.torch import prepare_model
    else:
        from unbroken import train
        from unbroken.train import Checkpoint
        from unbroken.train.torch import prepare_model
    ctx = train.get_context()
    rank, work = ctx.get_world_rank(), config["work"]
    if rank == 1:
        with open(os.path.join(work, "node-r1"), "w") as f:
            f.write(ray.get_runtime_context().get_node_id())
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["it"]
    saved_on_notice = False
    for it in range(start + 1, config["iterations"] + 1):
        time.sleep(STEP_S)
        loss = model(torch.randn(8, 64)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        notice = train.get_preemption_info() is not None
        asked = config["lib"] == "unbroken" and ctx.should_checkpoint()
        save = it % CKPT_EVERY == 0 or asked or (notice and not saved_on_notice)
        saved_on_notice = saved_on_notice or (notice and save)
        with tempfile.TemporaryDirectory() as d:
            if save:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "it": it},
                           os.path.join(d, "state.pt"))
            train.report({"it": it, "loss": loss.item()},
                         checkpoint=Checkpoint.from_directory(d) if save and rank == 0 else None)
        if rank == 0:
            with open(os.path.join(work, "rows.jsonl"), "a") as f:
                f.write(json.dumps({"it": it, "t": time.time(), "pid": os.getpid(), "ckpt": save}) + "\n")


def main() -> None:
    work, lib, iterations = sys.argv[1], sys.argv[2], int(sys.argv[3])
    config = {"work": work, "lib": lib, "iterations": iterations}
    storage = os.path.join(work, "storage")
    if lib == "ray":
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer
        scaling = ScalingConfig(num_workers=2)
    else:
        from unbroken.train import FailureConfig, RunConfig, ScalingConfig
        from unbroken.train.torch import TorchTrainer
        scaling = ScalingConfig(num_workers=2, engine="ray")
    TorchTrainer(loop, train_loop_config=config, scaling_config=scaling,
                 run_config=RunConfig(name="run", storage_path=storage,
                                      failure_config=FailureConfig(max_failures=0))).fit()
    open(os.path.join(work, "survived"), "w").close()


if __name__ == "__main__":
    main()
