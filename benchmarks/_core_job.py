"""One benchmark job, run in a fresh process by bench_core.py (not meant to be run by hand).

    python _core_job.py FRAMEWORK TASK WORK_DIR PARAMS_JSON

FRAMEWORK: "unbroken", "ray" (Ray Train, same API) or "plain" (torch.distributed by hand).
TASK: "startup" (fit() to the first line of the loop, then train.report() in a tight loop)
or "train" (a small MLP regression job, DDP, a checkpoint every epoch).
The driver imports torch and the framework at its top, as a training script does. It prints
one line "RESULT <json>" on success; ranks hand their numbers back through files in WORK_DIR.
"""

import json
import os
import sys
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

FRAMEWORK = sys.argv[1] if len(sys.argv) > 1 else "unbroken"
if FRAMEWORK == "unbroken":
    from unbroken import train
    from unbroken.train import Checkpoint, RunConfig, ScalingConfig
    from unbroken.train.torch import TorchTrainer, prepare_data_loader, prepare_model
elif FRAMEWORK == "ray":
    from ray import train
    from ray.train import Checkpoint, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer, prepare_data_loader, prepare_model
else:
    import torch.distributed as dist
    import torch.multiprocessing as tmp
    from torch.nn.parallel import DistributedDataParallel

NUM_WORKERS = 2


# -- the job, identical for every framework --------------------------------------------------
def make_dataset(p: dict) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(p["samples"], p["in_dim"], generator=g)
    w = torch.randn(p["in_dim"], 1, generator=g)
    y = torch.sin(x @ w) + 0.1 * torch.randn(p["samples"], 1, generator=g)
    return TensorDataset(x, y)


def make_model(p: dict) -> nn.Module:
    torch.manual_seed(0)
    h = p["hidden"]
    return nn.Sequential(nn.Linear(p["in_dim"], h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                         nn.Linear(h, 1))


def checkpoint_state(model: nn.Module, opt: torch.optim.Optimizer, epoch: int) -> dict:
    return {"model": model.module.state_dict() if hasattr(model, "module") else model.state_dict(),
            "optimizer": opt.state_dict(), "epoch": epoch}


def write_rank_result(work_dir: str, rank: int, data: dict) -> None:
    path = os.path.join(work_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def read_rank_results(work_dir: str) -> list[dict]:
    out = []
    for rank in range(NUM_WORKERS):
        with open(os.path.join(work_dir, f"rank{rank}.json")) as f:
            out.append(json.load(f))
    return out


def epoch_steps(model, loader, opt, loss_fn, timing: dict) -> float:
    total, n = 0.0, 0
    for x, y in loader:
        if timing.get("first") is None:
            timing["first"], timing["first_wall"] = time.perf_counter(), time.time()
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        total += loss.item()
        n += 1
    return total / max(n, 1)


# -- unbroken / Ray Train loops ---------------------------------------------------------------
def startup_loop(config: dict) -> None:
    t_first_line = time.time()
    rank = train.get_context().get_world_rank()
    metrics = {"epoch": 0, "loss": 0.5, "accuracy": 0.9}
    for i in range(config["warmup"]):
        metrics["epoch"] = i
        train.report(metrics)
    start = time.perf_counter()
    for i in range(config["reports"]):
        metrics["epoch"] = i
        train.report(metrics)
    elapsed = time.perf_counter() - start
    write_rank_result(config["work_dir"], rank, {"first_line": t_first_line,
                                                 "report_ms": elapsed / max(config["reports"], 1) * 1e3})


def train_loop(config: dict) -> None:
    rank = train.get_context().get_world_rank()
    ds = make_dataset(config)
    model = prepare_model(make_model(config))
    loader = prepare_data_loader(DataLoader(ds, batch_size=config["batch_size"], shuffle=True))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    timing: dict = {}
    loss = float("nan")
    for epoch in range(config["epochs"]):
        loss = epoch_steps(model, loader, opt, loss_fn, timing)
        metrics = {"epoch": epoch, "loss": loss}
        if rank == 0:
            with tempfile.TemporaryDirectory() as d:
                torch.save(checkpoint_state(model, opt, epoch), os.path.join(d, "checkpoint.pt"))
                train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            train.report(metrics)
    write_rank_result(config["work_dir"], rank, {"in_loop_s": time.perf_counter() - timing["first"],
                                                 "first_step": timing["first_wall"], "loss": loss})


def run_framework(task: str, work_dir: str, params: dict) -> dict:
    config = dict(params, work_dir=work_dir)
    loop = startup_loop if task == "startup" else train_loop
    trainer = TorchTrainer(loop, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=NUM_WORKERS),
                           run_config=RunConfig(name="bench", storage_path=os.path.join(work_dir, "storage")))
    t_fit = time.time()
    result = trainer.fit()
    fit_s = time.time() - t_fit
    if getattr(result, "error", None) is not None:
        raise RuntimeError(f"fit() returned an error: {result.error!r}")
    ranks = read_rank_results(work_dir)
    out: dict = {"fit_s": fit_s}
    if task == "startup":
        out["first_line_s"] = max(r["first_line"] for r in ranks) - t_fit
        out["first_line_rank0_s"] = ranks[0]["first_line"] - t_fit
        out["report_ms"] = ranks[0]["report_ms"]
    else:
        out.update(train_numbers(ranks, t_fit))
    return out


def train_numbers(ranks: list[dict], t_launch: float) -> dict:
    """Rank 0's in-loop time; launch (fit() or the fork) to the first step of the slowest rank."""
    return {"in_loop_s": ranks[0]["in_loop_s"], "loss": ranks[0]["loss"],
            "to_first_step_s": max(r["first_step"] for r in ranks) - t_launch}


# -- plain torch.distributed --------------------------------------------------------------------
def plain_worker(rank: int, port: int, work_dir: str, params: dict) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // NUM_WORKERS))  # as unbroken sets it
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=NUM_WORKERS)
    ds = make_dataset(params)
    model = DistributedDataParallel(make_model(params))
    sampler = DistributedSampler(ds, num_replicas=NUM_WORKERS, rank=rank, shuffle=True)
    loader = DataLoader(ds, batch_size=params["batch_size"], sampler=sampler)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()
    timing: dict = {}
    loss = float("nan")
    for epoch in range(params["epochs"]):
        sampler.set_epoch(epoch)
        loss = epoch_steps(model, loader, opt, loss_fn, timing)
        if rank == 0:
            d = os.path.join(work_dir, "storage", f"checkpoint_{epoch:06d}")
            os.makedirs(d)
            torch.save(checkpoint_state(model, opt, epoch), os.path.join(d, "checkpoint.pt"))
    write_rank_result(work_dir, rank, {"in_loop_s": time.perf_counter() - timing["first"],
                                       "first_step": timing["first_wall"], "loss": loss})
    dist.destroy_process_group()


def run_plain(work_dir: str, params: dict) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t_fit = time.time()
    # fork, like unbroken's local engine: the workers start with torch already imported.
    tmp.start_processes(plain_worker, args=(port, work_dir, params), nprocs=NUM_WORKERS,
                        start_method="fork")
    fit_s = time.time() - t_fit
    return dict(train_numbers(read_rank_results(work_dir), t_fit), fit_s=fit_s)


def main() -> None:
    imported = time.time()  # the parent subtracts its launch time: interpreter start + imports
    _, framework, task, work_dir, params = sys.argv
    params = json.loads(params)
    if framework == "plain":
        out = run_plain(work_dir, params)
    else:
        out = run_framework(task, work_dir, params)
        if framework == "ray":
            import ray

            ray.shutdown()
    out["imported_at"] = imported
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
