"""The cost per training step of what makes a run recoverable in place: unbroken against
torchft, side by side with plain DDP.

    python benchmarks/bench_torchft.py [--repeats N] [--steps N]

The same 2-rank job each time (gloo on CPU, a 256-256-10 MLP, AdamW, batches of 32, the
loss read every step), one rank per process:

- plain: torch.distributed DDP, nothing else;
- unbroken: `TorchTrainer` with `prepare_model`, a `TrainState` and the default
  `FailureConfig(recovery="in_place")` (the state is tracked for just-in-time saves, its
  step streams seeded from the run), `state.report(...)` every step (no checkpoint), the
  loop in `TrainState.for_each_batch`;
- unbroken-checkpoint: the same with `recovery="checkpoint"` (nothing tracked: a failure
  restarts from the latest checkpoint), so that the default's own cost shows;
- torchft (when `import torchft` works): 2 replica groups of 1 process with an in-process
  Lighthouse, `Manager`, torchft's `DistributedDataParallel` and `Optimizer` wrapper
  (a quorum started at each `zero_grad`, a commit vote at each `step`), as its examples do.

Each rank times its steps after a warm-up; the table gives the median over the repeats of
rank 0's mean step time, and what each adds to plain DDP.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

WARMUP, BATCH = 30, 32


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 256, generator=g), torch.randint(0, 10, (BATCH,), generator=g)


class Clock:
    """Rank 0's mean step time after the warm-up, written to `out` at the end."""

    def __init__(self, steps: int, out: str | None) -> None:
        self.steps, self.out, self.count, self.t0 = steps, out, 0, 0.0

    def tick(self) -> None:
        self.count += 1
        if self.count == WARMUP:
            self.t0 = time.perf_counter()
        if self.count == self.steps and self.out is not None:
            with open(self.out, "w") as f:
                json.dump({"step_ms": (time.perf_counter() - self.t0) / (self.steps - WARMUP) * 1e3}, f)


def plain_rank(rank: int, port: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    module, opt = build()
    model = torch.nn.parallel.DistributedDataParallel(module)
    clock = Clock(steps, out if rank == 0 else None)
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
        clock.tick()
    dist.destroy_process_group()


def unbroken_loop(config: dict) -> None:
    from unbroken import train
    from unbroken.train.torch import TrainState, prepare_data_loader, prepare_model

    rank = train.get_context().get_world_rank()
    module, opt = build()
    model = prepare_model(module)
    loader = prepare_data_loader(torch.utils.data.DataLoader(range(2 * config["steps"]), batch_size=1,
                                                             shuffle=False))
    state = TrainState(model=model, optimizer=opt, loader=loader, step=0)  # tracked: recovery="in_place"
    state.restore()
    clock = Clock(config["steps"], config["out"] if rank == 0 else None)

    def step(_index: torch.Tensor) -> None:
        x, y = batch(rank, state.step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        state.step += 1
        state.report({"loss": loss.item()})
        clock.tick()

    state.for_each_batch(loader, step)


def run_unbroken(steps: int, out: str, work: str, recovery: str = "in_place") -> None:
    from unbroken.train import FailureConfig, RunConfig, ScalingConfig
    from unbroken.train.torch import TorchTrainer

    TorchTrainer(unbroken_loop, train_loop_config={"steps": steps, "out": out},
                 scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(name="run", storage_path=work, verbose=0,
                                      failure_config=FailureConfig(recovery=recovery))).fit()


def torchft_replica(replica: int, lighthouse: str, steps: int, out: str) -> None:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(1)
    module, inner = build()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=2,
                      load_state_dict=lambda sd: (module.load_state_dict(sd["model"]),
                                                  inner.load_state_dict(sd["optim"])),
                      state_dict=lambda: {"model": module.state_dict(), "optim": inner.state_dict()},
                      replica_id=f"r{replica}", rank=0, world_size=1, store_addr="127.0.0.1",
                      store_port=store.port, lighthouse_addr=lighthouse, timeout=timedelta(seconds=10))
    model = DistributedDataParallel(manager, module)
    opt = Optimizer(manager, inner)
    clock = Clock(steps, out if replica == 0 else None)
    for step in range(steps):
        x, y = batch(replica, step)
        opt.zero_grad()  # starts the quorum
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()  # steps only when the replicas vote to commit
        loss.item()
        clock.tick()
    manager.shutdown()


def run_torchft(steps: int, out: str) -> None:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2)
    try:
        procs = [subprocess.Popen([sys.executable, "-W", "ignore", __file__, "torchft-replica", str(r),
                                   lighthouse.address(), str(steps), out]) for r in (0, 1)]
        for p in procs:
            if p.wait() != 0:
                raise RuntimeError(f"a torchft replica exited with {p.returncode}")
    finally:
        lighthouse.shutdown()


def run_plain(steps: int, out: str) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(plain_rank, args=(port, steps, out), nprocs=2)


def measure(setup: str, steps: int) -> float:
    """Rank 0's mean step time (ms) in one fresh process running `setup`."""
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-torchft-") as work:
        out = os.path.join(work, "out.json")
        proc = subprocess.run([sys.executable, "-W", "ignore", __file__, setup, str(steps), out, work],
                              capture_output=True, text=True)
        if not os.path.exists(out):  # gloo sometimes aborts a rank at exit, after the timing is written
            raise RuntimeError(f"{setup} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return json.load(open(out))["step_ms"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args(argv)
    try:
        import torchft  # noqa: F401
        setups = ["plain", "unbroken", "unbroken-checkpoint", "torchft"]
    except ImportError:
        setups = ["plain", "unbroken", "unbroken-checkpoint"]
    times: dict[str, list[float]] = {s: [] for s in setups}
    for repeat in range(args.repeats):
        for setup in setups:
            times[setup].append(measure(setup, args.steps))
            print(f"[bench] {setup}: {times[setup][-1]:.2f} ms/step", file=sys.stderr, flush=True)
        print(f"[bench] repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
    plain = statistics.median(times["plain"])
    print(f"## Step cost of recoverability — 2 ranks, {args.steps} steps, {args.repeats} repeats, "
          f"{os.cpu_count()} CPUs\n")
    print("| Setup | Step (median, min–max) | Added to plain DDP |")
    print("|---|---|---|")
    for setup in setups:
        median = statistics.median(times[setup])
        print(f"| {setup} | {median:.2f} ms ({min(times[setup]):.2f}–{max(times[setup]):.2f}) | "
              f"{median - plain:+.2f} ms |")
    # Paired within each repeat (the two run one after the other), the median of the differences.
    added = statistics.median(d - c for d, c in zip(times["unbroken"], times["unbroken-checkpoint"],
                                                            strict=True))
    bare = statistics.median(times["unbroken-checkpoint"])
    print(f"\nThe default recovery (in place) against recovery=\"checkpoint\", paired by repeat: "
          f"{added:+.3f} ms a step, {100 * added / bare:+.1f}% (target: within 3%).")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in ("plain", "unbroken", "unbroken-checkpoint", "torchft"):
        setup, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        {"plain": lambda: run_plain(steps, out), "unbroken": lambda: run_unbroken(steps, out, sys.argv[4]),
         "unbroken-checkpoint": lambda: run_unbroken(steps, out, sys.argv[4], "checkpoint"),
         "torchft": lambda: run_torchft(steps, out)}[setup]()
    elif len(sys.argv) > 1 and sys.argv[1] == "torchft-replica":
        torchft_replica(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        sys.exit(main())
