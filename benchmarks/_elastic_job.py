"""One job of bench_elastic.py, run in a fresh process (not meant to be run by hand).

    python _elastic_job.py FRAMEWORK WORK_DIR PARAMS_JSON

FRAMEWORK: "unbroken-elastic" (num_workers=(2, 3)), "unbroken-elastic+jit" (the same, the loop's
state in a TrainState with just-in-time checkpoints), "unbroken-fixed" (num_workers=3, which
waits for its third node) or "ray-v2-elastic" (Ray Train V2, num_workers=(2, 3)). All join the
cluster named by RAY_ADDRESS. Rank 0 appends one line per report to WORK/rows.jsonl (time,
iteration, world size, its pid: a new attempt's rows come from a new process); every rank
notes its node in WORK/node-<rank>.json; the loop returns once WORK/stop exists. Prints
"RESULT <json>" at the end.
"""

import json
import os
import sys
import time

import torch
from _tiny_job import fit_timed, note, report, resume

FRAMEWORK, WORK, PARAMS = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if FRAMEWORK == "ray-v2-elastic":
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    from ray import train
    from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer, prepare_model
else:
    from unbroken import train
    from unbroken.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
    from unbroken.train.torch import TorchTrainer, prepare_model


def loop(config: dict) -> None:
    """A tiny DDP job: one report per step of `step_s`, a checkpoint every `every` steps."""
    import ray

    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    note(WORK, f"node-{rank}.json", {"node_id": ray.get_runtime_context().get_node_id(), "world": world})
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start, state = resume(train, model, opt, config.get("jit", False))
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    it = start
    while not os.path.exists(os.path.join(WORK, "stop")):
        it += 1
        time.sleep(config["step_s"])  # the rest of a step's compute
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        asked = ctx.should_checkpoint() if FRAMEWORK != "ray-v2-elastic" else False
        report(train, Checkpoint, state, it, loss.item(), it % config["every"] == 0 or asked, rank)
        if rank == 0:
            with open(os.path.join(WORK, "rows.jsonl"), "a") as f:
                f.write(json.dumps({"t": time.time(), "it": it, "ws": world, "pid": os.getpid()}) + "\n")


def main() -> None:
    elastic = FRAMEWORK != "unbroken-fixed"
    kwargs = {"num_workers": (2, 3) if elastic else 3, "resources_per_worker": {"CPU": 1}}
    if elastic:
        kwargs["elastic_resize_monitor_interval_s"] = PARAMS["monitor_s"]
    if FRAMEWORK != "ray-v2-elastic":
        kwargs["engine"] = "ray"
    fit_timed((TorchTrainer, ScalingConfig, RunConfig, FailureConfig), loop,
              dict(PARAMS, jit=FRAMEWORK.endswith("+jit")), kwargs, WORK)


if __name__ == "__main__":
    main()
