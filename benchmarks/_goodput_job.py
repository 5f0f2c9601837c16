"""One job of bench_goodput.py, run in a fresh process (not meant to be run by hand).

    python _goodput_job.py FRAMEWORK WORK_DIR PARAMS_JSON

FRAMEWORK: "local" (unbroken, local engine), "unbroken-ray" (Ray engine), either with "+jit"
(the loop's state in a TrainState with just-in-time checkpoints), "ray-v1" or
"ray-v2" (Ray Train). The Ray ones join the cluster named by RAY_ADDRESS. A tiny DDP job of
`iterations` steps of `step_s`, a checkpoint every `every`, restarted after every failure
(max_failures=-1). Each rank notes its pid (and node) in WORK/rank<r>.json at the start of
each attempt, for the benchmark's failure trace; rank 0 appends one line per report to
WORK/rows.jsonl. Prints "RESULT <json>" with the wall time of fit().
"""

import json
import os
import sys
import time

import torch
from _tiny_job import fit_timed, note, report, resume

FRAMEWORK, WORK, PARAMS = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
RAY_TRAIN = FRAMEWORK.startswith("ray-")
if RAY_TRAIN:
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1" if FRAMEWORK == "ray-v2" else "0"
    # V2's controller takes each worker's report when it polls it, every 2 s by default, and
    # a worker holds one report at a time: a 40 ms step would wait up to 2 s at each report.
    # Tuned as a V2 user with frequent reports would (the variable reaches its controller).
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.05")
    from ray import train
    from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer, prepare_model
else:
    from unbroken import train
    from unbroken.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
    from unbroken.train.torch import TorchTrainer, prepare_model


def loop(config: dict) -> None:
    rank = train.get_context().get_world_rank()
    node = None
    if not FRAMEWORK.startswith("local"):
        import ray

        node = ray.get_runtime_context().get_node_id()
    note(WORK, f"rank{rank}.json", {"pid": os.getpid(), "node_id": node})
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start, state = resume(train, model, opt, config["jit"])
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for it in range(start + 1, config["iterations"] + 1):
        time.sleep(config["step_s"])  # the rest of a training step's compute
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        report(train, Checkpoint, state, it, loss.item(), it % config["every"] == 0, rank)
        if rank == 0:
            with open(os.path.join(WORK, "rows.jsonl"), "a") as f:
                f.write(json.dumps({"t": time.time(), "it": it}) + "\n")


def main() -> None:
    kwargs = {"num_workers": 2, "resources_per_worker": {"CPU": 1}}
    if FRAMEWORK == "ray-v1":
        kwargs["trainer_resources"] = {"CPU": 0}
    elif not RAY_TRAIN:
        kwargs["engine"] = "local" if FRAMEWORK.startswith("local") else "ray"
    fit_timed((TorchTrainer, ScalingConfig, RunConfig, FailureConfig), loop,
              dict(PARAMS, jit=FRAMEWORK.endswith("+jit")), kwargs, WORK)


if __name__ == "__main__":
    main()
