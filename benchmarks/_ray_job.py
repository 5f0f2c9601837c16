"""One job of bench_ray.py, run in a fresh process (not meant to be run by hand).

    python _ray_job.py FRAMEWORK TASK WORK_DIR PARAMS_JSON

FRAMEWORK: "local" (unbroken, local engine), "unbroken-ray" (unbroken, Ray engine) or "ray-v1"
(Ray Train V1). The Ray ones join the cluster named by RAY_ADDRESS.
TASK: "startup" (fit() to the first line of the loop, then train.report() in a tight loop),
"kill" (rank 1 SIGKILLs itself mid-run, during a step's compute) or "node" (rank 1 blocks, and
bench_ray.py removes its node): the run restarts from its last checkpoint; rank 0 notes when
the next attempt reports its first row and from which iteration it resumed. With "jit": true
in the params (unbroken only), the loop keeps its state in a TrainState with just-in-time
checkpoints, so the restart resumes from the survivor's checkpoint of the last report.
Prints "RESULT <json>".
"""

import json
import os
import signal
import sys
import threading
import time

import torch
from _tiny_job import note, report, resume

FRAMEWORK, TASK, WORK, PARAMS = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
if FRAMEWORK == "ray-v1":
    os.environ["RAY_TRAIN_V2_ENABLED"] = "0"
    from ray import train
    from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer, prepare_model
else:
    from unbroken import train
    from unbroken.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
    from unbroken.train.torch import TorchTrainer, prepare_model

NUM_WORKERS = 2


def startup_loop(config: dict) -> None:
    first_line = time.time()
    rank = train.get_context().get_world_rank()
    metrics = {"epoch": 0, "loss": 0.5}
    for i in range(config["warmup"]):
        train.report(dict(metrics, epoch=i))
    start = time.perf_counter()
    for i in range(config["reports"]):
        train.report(dict(metrics, epoch=i))
    note(WORK, f"rank{rank}.json", {"first_line": first_line,
                                    "report_ms": (time.perf_counter() - start) / config["reports"] * 1e3})


def recovery_loop(config: dict) -> None:
    """A tiny DDP job reporting every iteration, checkpointing every `every` from rank 0 (every
    rank with `jit`, through TrainState). Rank 1 fails during the compute of step `fail_at`."""
    rank = train.get_context().get_world_rank()
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start, state = resume(train, model, opt, config.get("jit", False))
    restarted = os.path.exists(os.path.join(WORK, "failed"))
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for it in range(start + 1, config["iterations"] + 1):
        if not restarted and it == config["fail_at"] and rank == 1:
            note(WORK, "failed", {"at": time.time(), "iteration": it})
            if TASK == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            import ray

            note(WORK, "lose", {"node_id": ray.get_runtime_context().get_node_id()})
            threading.Event().wait()  # until bench_ray.py removes this node
        time.sleep(config["step_s"])  # the rest of a training step's compute
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if restarted and rank == 0 and it == start + 1:
            note(WORK, "resumed.json", {"first_row": time.time(), "resumed_from": start})
        report(train, Checkpoint, state, it, loss.item(), it % config["every"] == 0, rank)


def main() -> None:
    resources = {"CPU": 1}
    if FRAMEWORK == "ray-v1":
        scaling = ScalingConfig(num_workers=NUM_WORKERS, resources_per_worker=resources,
                                trainer_resources={"CPU": 0})
    else:
        scaling = ScalingConfig(num_workers=NUM_WORKERS, resources_per_worker=resources,
                                engine="ray" if FRAMEWORK == "unbroken-ray" else "local")
    loop = startup_loop if TASK == "startup" else recovery_loop
    trainer = TorchTrainer(loop, train_loop_config=PARAMS, scaling_config=scaling,
                           run_config=RunConfig(name="bench", storage_path=os.path.join(WORK, "storage"),
                                                failure_config=FailureConfig(max_failures=1)))
    t_fit = time.time()
    trainer.fit()
    out = {"fit_s": time.time() - t_fit}
    if TASK == "startup":
        ranks = [json.load(open(os.path.join(WORK, f"rank{r}.json"))) for r in range(NUM_WORKERS)]
        out.update(first_line_s=max(r["first_line"] for r in ranks) - t_fit, report_ms=ranks[0]["report_ms"])
    else:
        failed = json.load(open(os.path.join(WORK, "failed")))
        if TASK == "node":  # the failure is the node's removal, which bench_ray.py timed
            failed["at"] = json.load(open(os.path.join(WORK, "removed")))["at"]
        resumed = json.load(open(os.path.join(WORK, "resumed.json")))
        # Reported before the failure and run again: the step in flight is not counted.
        out.update(recovery_s=resumed["first_row"] - failed["at"],
                   redone=failed["iteration"] - 1 - resumed["resumed_from"])
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
