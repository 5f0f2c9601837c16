"""TrainState's checkpoint cost against a hand-written torch.save / torch.load of the same state.

    python benchmarks/bench_train_state.py [--repeats N] [--quick]

The state: an MLP with AdamW (one step taken, so the optimizer holds its moment tensors), a
StepLR scheduler, a prepared DataLoader's position, an epoch counter and the random generator
states (python, numpy, torch). Two sizes: a small model, where fixed costs show, and a larger
one, where bytes dominate.

- hand-written save: one `torch.save` of {model, optimizer, scheduler, loader position, epoch,
  torch and python RNG states} (numpy's state is left out: its ndarray does not load with
  weights_only=True, so a hand-written loop that wants it must convert it as TrainState does).
- hand-written restore: `torch.load(weights_only=True)` and the load_state_dict calls.
- TrainState: `state.save(directory)` (what `state.report(..., checkpoint=True)` writes before
  train.report copies the files into the run) and `state.load(directory)`.

Both sides run in one process, alternating, into a fresh temporary directory each time (the
page cache absorbs the writes for both alike). Prints a markdown table of medians (min-max).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
import time

import torch

from unbroken.train.torch import TrainState, prepare_data_loader


def build(hidden: int, layers: int) -> TrainState:
    torch.manual_seed(0)
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, hidden)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
    data = torch.utils.data.TensorDataset(torch.randn(1024, 4))
    loader = prepare_data_loader(torch.utils.data.DataLoader(data, batch_size=32, shuffle=True),
                                 move_to_device=False)
    for _, _batch in zip(range(5), loader, strict=False):
        pass
    return TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader, epoch=3)


def hand_save(state: TrainState, directory: str) -> None:
    torch.save({"model": state.model.state_dict(), "optimizer": state.optimizer.state_dict(),
                "scheduler": state.scheduler.state_dict(), "loader": state.loader.state_dict(),
                "epoch": state.epoch, "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()},
               os.path.join(directory, "state.pt"))


def hand_load(state: TrainState, directory: str) -> None:
    saved = torch.load(os.path.join(directory, "state.pt"), weights_only=True)
    state.model.load_state_dict(saved["model"])
    state.optimizer.load_state_dict(saved["optimizer"])
    state.scheduler.load_state_dict(saved["scheduler"])
    state.loader.load_state_dict(saved["loader"])
    state.epoch = saved["epoch"]
    torch.set_rng_state(saved["torch_rng"])
    version, internal, gauss = saved["python_rng"]
    random.setstate((version, tuple(internal), gauss))


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def measure(state: TrainState, repeats: int, root: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"hand_save": [], "state_save": [], "hand_load": [], "state_load": []}
    for _ in range(repeats):
        for kind, save, load in (("hand", hand_save, hand_load), ("state", TrainState.save, TrainState.load)):
            d = tempfile.mkdtemp(dir=root)
            times[f"{kind}_save"].append(timed(save, state, d))
            times[f"{kind}_load"].append(timed(load, state, d))
            shutil.rmtree(d)
    return times


def fmt(values: list[float]) -> str:
    ms = [v * 1000 for v in values]
    return f"{statistics.median(ms):.1f} ms ({min(ms):.1f}–{max(ms):.1f})"


def state_bytes(state: TrainState, root: str) -> int:
    d = tempfile.mkdtemp(dir=root)
    state.save(d)
    size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
    shutil.rmtree(d)
    return size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="small sizes, 5 repeats")
    args = parser.parse_args()
    repeats = max(5, 5 if args.quick else args.repeats)
    sizes = [("small", 256, 2), ("large", 2048, 4)] if not args.quick else [("small", 256, 2),
                                                                              ("large", 1024, 2)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-train-state-") as root:
        for label, hidden, layers in sizes:
            state = build(hidden, layers)
            params = sum(p.numel() for p in state.model.parameters())
            measure(state, 1, root)  # warm-up
            times = measure(state, repeats, root)
            rows.append((label, params, state_bytes(state, root), times))
    print(f"TrainState vs hand-written torch.save/torch.load, medians of {repeats} runs (min–max), "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs\n")
    print("| State | Files | hand-written save | TrainState.save | ratio | hand-written restore "
          "| TrainState.load | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for label, params, size, t in rows:
        save_ratio = statistics.median(t["state_save"]) / statistics.median(t["hand_save"])
        load_ratio = statistics.median(t["state_load"]) / statistics.median(t["hand_load"])
        print(f"| {label}: MLP {params / 1e6:.2f} M params + AdamW | {size / 2**20:.1f} MiB "
              f"| {fmt(t['hand_save'])} | {fmt(t['state_save'])} | {save_ratio:.2f} × "
              f"| {fmt(t['hand_load'])} | {fmt(t['state_load'])} | {load_ratio:.2f} × |")


if __name__ == "__main__":
    main()
