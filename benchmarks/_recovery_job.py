"""One job of bench_recovery.py: a 2-rank DDP job whose model and optimizer state is
`size_mib` MiB, with just-in-time checkpoints; rank 1 SIGKILLs itself right after report
`kill_after` of the first attempt (each step of the first attempt takes at least STEP_S, so
that the forkserver has imported torch by then, as in a run that has trained for a while).

    python benchmarks/_recovery_job.py <work dir> <size MiB> <mode> <kill_after> <iterations>

<mode>: restart, in-place, or in-loop

(in place with the loop in `TrainState.for_each_batch`: the survivor stays inside it).

Rank 0 appends one line per report to <work>/rows.jsonl (iteration, attempt, time, pid);
each rank writes <work>/pid-r<rank>-a<attempt>; rank 1 notes the time of its kill in
<work>/killed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
from _tiny_job import note

from unbroken import train
from unbroken.train import FailureConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer, TrainState, prepare_data_loader, prepare_model

STEP_S = 0.75


def loop(config: dict) -> None:
    rank = train.get_context().get_world_rank()
    work = config["work"]
    # SGD with momentum: the state is the parameters and one buffer as large: 2 x 4 bytes each.
    width = 1024
    rows = max(1, config["size_mib"] * 2**20 // (2 * 4 * width))
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(width, rows, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    # One pass of one batch (an index) per iteration: what TrainState.for_each_batch goes through.
    loader = prepare_data_loader(torch.utils.data.DataLoader(range(2 * config["iterations"]), batch_size=1,
                                                             shuffle=False))
    state = TrainState(model=model, optimizer=opt, loader=loader, iteration=0, jit_checkpoint=True,
                       step_seed=0)
    state.restore()
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))

    def step(_batch: torch.Tensor) -> None:
        attempt = train.get_context().get_attempt()  # the loop may stay into the next attempt
        note(work, f"pid-r{rank}-a{attempt}", {"pid": os.getpid()})
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.iteration += 1
        state.report({"loss": loss.item()})
        if rank == 0:
            row = {"it": state.iteration, "attempt": attempt, "t": time.time(), "pid": os.getpid()}
            with open(os.path.join(work, "rows.jsonl"), "a") as f:
                f.write(json.dumps(row) + "\n")
        if rank == 1 and attempt == 1 and state.iteration == config["kill_after"]:
            note(work, "killed", {"t": time.time()})
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt == 1:
            time.sleep(STEP_S)  # a slower model: the restart is warm by the time of the kill

    if config["mode"] == "in-loop":
        state.for_each_batch(loader, step)
    else:
        for batch in loader:
            step(batch)


def main() -> None:
    work, size, mode, kill_after, iterations = sys.argv[1:6]
    failures = FailureConfig(max_failures=1, recovery="checkpoint" if mode == "restart" else "in_place")
    TorchTrainer(loop, train_loop_config={"work": work, "size_mib": int(size), "kill_after": int(kill_after),
                                          "iterations": int(iterations), "mode": mode},
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name="run", storage_path=os.path.join(work, "storage"), verbose=0,
                                      failure_config=failures)).fit()


if __name__ == "__main__":
    main()
