"""What exact resume costs for each kind of loader: steps per second with and without TrainState,
the size of the saved loader state, and the time from a resume to the first batch.

    python benchmarks/bench_data.py [--repeats N] [--rows N] [--quick] [--ray]

One process plays rank 0 of 2 (each loader splits the rows as it would among 2 ranks). Each
step is a tiny model's forward, backward and optimizer step, so that what the loader adds shows
rather than drowns: a real model's step makes the same overhead a smaller share.

- plain: the user's loader in a plain PyTorch loop, no unbroken.
- TrainState: the same loader handed to `TrainState(loader=...)`, which counts the batches the
  loop takes (unbroken.state.stream_loader); the report path reads nothing of the loader until
  a checkpoint is saved.
- state: the bytes of the loader's part of a checkpoint (the counts in train_state.pt and this
  rank's `loader_rank0.pt`), saved half way through a pass.
- first batch, fresh: building the loader and taking the first batch of a pass (what any
  start costs); resumed: building it, `TrainState.load` of the half-way checkpoint, and the
  first batch after it, by seeking with the library's state, or by replaying the pass to
  that point where the library's state is not exact (`how`).

With `--ray` (on a local Ray instance of 2 CPUs), Ray Data too: `plain` is the dataset read
once in batches of 64 by one consumer (what a share of Ray's `streaming_split` costs at least),
`TrainState` is rank 0's `RayDataShard` (`train.get_dataset_shard`), which reads every row in
global batches of 64 x 2 and keeps its half, and a resume skips the consumed rows by reading
them (Ray Data cannot seek to a row).

A last line measures a Hugging Face pass carried to another number of ranks: rank 0 of 2
trains half of a pass of `to_iterable_dataset(8 shards)`, and rank 0 of 4 takes the rest
(unbroken.state.stream_carry), against the same rank's fresh pass: the first batch, and the
whole (shorter) rest of the pass.

Prints a markdown table of medians (min-max) over the repeats.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from unbroken.state.state_file import STATE_FILE, loader_file
from unbroken.state.stream_loader import StreamLoader
from unbroken.train.torch import ResumableDataLoader, TrainState, prepare_data_loader

BATCH = 64


def write_rows(directory: str, rows: int, shards: int = 8) -> list[str]:
    g = torch.Generator().manual_seed(0)
    paths = []
    per = rows // shards
    for s in range(shards):
        path = os.path.join(directory, f"shard-{s}.jsonl")
        with open(path, "w") as f:
            for r in range(per):
                f.write(json.dumps({"id": s * per + r, "x": torch.randn(16, generator=g).tolist()}) + "\n")
        paths.append(path)
    return paths


class Rows(torch.utils.data.Dataset):
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"id": i, "x": self.x[i]}


class Stream(torch.utils.data.IterableDataset):
    """A stateful stream of its own (rank 0 of 2): its position is an offset it can seek to."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x[0::2]
        self.offset = 0

    def __iter__(self):
        while self.offset < len(self.x):
            self.offset += 1
            yield {"id": self.offset - 1, "x": self.x[self.offset - 1]}
        self.offset = 0

    def state_dict(self) -> dict:
        return {"offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.offset = state["offset"]


def kinds(files: list[str], x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """name -> a function that builds the loader as a user would (rank 0 of 2)."""
    from datasets import Dataset, load_dataset
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader

    def torchdata_map(workers: int) -> Callable[[], Any]:
        def build() -> Any:
            data = Rows(x)
            sampler = torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0, seed=1)
            return StatefulDataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=workers)
        return build

    def hf_shards() -> Any:
        data = Dataset.from_dict({"id": list(range(len(x))), "x": x.tolist()})
        data = data.to_iterable_dataset(num_shards=8)
        return torch.utils.data.DataLoader(split_dataset_by_node(data, 0, 2).with_format("torch"),
                                           batch_size=BATCH)

    def hf_stream() -> Any:
        data = load_dataset("json", data_files=files, split="train", streaming=True)
        data = split_dataset_by_node(data.shuffle(seed=3, buffer_size=256), 0, 2).with_format("torch")
        return StatefulDataLoader(data, batch_size=BATCH, num_workers=2)

    def prepared() -> Any:
        return prepare_data_loader(torch.utils.data.DataLoader(Rows(x), batch_size=BATCH, shuffle=True),
                                   move_to_device=False)

    return {"StatefulDataLoader, map-style + DistributedSampler": torchdata_map(0),
            "StatefulDataLoader(num_workers=2), map-style": torchdata_map(2),
            "DataLoader, HF to_iterable_dataset(8 shards)": hf_shards,
            "StatefulDataLoader(num_workers=2), HF streaming + shuffle buffer": hf_stream,
            "DataLoader, stateful IterableDataset": lambda: torch.utils.data.DataLoader(Stream(x), BATCH),
            "prepare_data_loader, map-style (for comparison)": prepared}


def train_pass(loader: Any, model: torch.nn.Module, opt: torch.optim.Optimizer,
               limit: int | None = None) -> int:
    steps = 0
    for batch in loader:
        loss = model(batch["x"].float()).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        steps += 1
        if steps == limit:
            break
    return steps


def measure(build: Callable[[], Any], repeats: int) -> dict[str, Any]:
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out: dict[str, list[float]] = {"plain": [], "state": [], "fresh": [], "resumed": []}
    size, how = 0, ""
    train_pass(build(), model, opt)  # warm up: imports, caches, the first pass's allocations
    for repeat in range(repeats):
        for name in ("plain", "state") if repeat % 2 == 0 else ("state", "plain"):
            loader = build()
            if name == "state":
                TrainState(loader=loader)
            t0 = time.perf_counter()
            steps = train_pass(loader, model, opt)
            out[name].append(steps / (time.perf_counter() - t0))
        half = steps // 2
        loader = build()
        state = TrainState(loader=loader)
        train_pass(loader, model, opt, limit=half)
        directory = tempfile.mkdtemp(prefix="bench-data-")
        try:
            state.save(directory)
            saved = torch.load(os.path.join(directory, STATE_FILE), weights_only=True)
            seek_file = os.path.join(directory, loader_file(0))
            counts = io.BytesIO()
            torch.save(saved["state_dicts"]["loader"], counts)
            size = counts.getbuffer().nbytes
            size += os.path.getsize(seek_file) if os.path.exists(seek_file) else 0
            seeks = os.path.exists(seek_file) or isinstance(loader, ResumableDataLoader)
            how = "seek" if seeks else "replay"
            t0 = time.perf_counter()
            next(iter(build()))
            out["fresh"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            again = build()
            resumed = TrainState(loader=again)
            resumed.load(directory)
            next(iter(again))
            out["resumed"].append(time.perf_counter() - t0)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    return {**{k: (statistics.median(v), min(v), max(v)) for k, v in out.items()}, "size": size, "how": how}


def measure_carry(x: torch.Tensor, repeats: int) -> dict[str, tuple[float, float, float]]:
    """A pass half trained on by 2 ranks, carried to 4: seconds to the first batch and to the
    end of the pass, for the carried pass and for a fresh one of rank 0 of 4."""
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node

    data = Dataset.from_dict({"id": list(range(len(x))), "x": x.tolist()}).to_iterable_dataset(num_shards=8)

    def build(world: int) -> Any:
        return torch.utils.data.DataLoader(split_dataset_by_node(data, 0, world).with_format("torch"),
                                           batch_size=BATCH)

    half = build(2)
    taken = StreamLoader.of(half, 2)
    train_pass(half, torch.nn.Linear(16, 1), torch.optim.SGD(torch.nn.Linear(16, 1).parameters()),
               limit=len(x) // BATCH // 4)
    counts = taken.state_dict()
    out: dict[str, list[float]] = {f"{name} {part}": [] for part in ("first", "pass")
                                   for name in ("fresh", "carried")}
    for _ in range(repeats):
        for name in ("fresh", "carried"):
            loader = build(4)
            if name == "carried":
                StreamLoader.of(loader, 4).load_state_dict(counts)
            t0 = time.perf_counter()
            batches = iter(loader)
            next(batches)
            out[f"{name} first"].append(time.perf_counter() - t0)
            sum(1 for _ in batches)
            out[f"{name} pass"].append(time.perf_counter() - t0)
    return {k: (statistics.median(v), min(v), max(v)) for k, v in out.items()}


def measure_ray_data(files: list[str], repeats: int) -> dict[str, Any]:
    """The Ray Data row: one consumer's plain pass against rank 0's RayDataShard of 2."""
    import ray

    from unbroken.worker.ray_data_shard import RayDataShard

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        ray.data.DataContext.get_current().enable_progress_bars = False
        dataset = ray.data.read_json(files).materialize()  # reading files is the same on both sides
        model = torch.nn.Linear(16, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step(batch: dict) -> None:
            loss = model(torch.as_tensor(np.stack(batch["x"]), dtype=torch.float32)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

        out: dict[str, list[float]] = {"plain": [], "state": [], "fresh": [], "resumed": []}
        steps = 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            steps = sum(1 for batch in dataset.iter_batches(batch_size=BATCH) if step(batch) is None)
            out["plain"].append(steps / (time.perf_counter() - t0))
            shard = RayDataShard(dataset, 0, 2)
            t0 = time.perf_counter()
            taken = sum(1 for batch in shard.iter_batches(batch_size=BATCH) if step(batch) is None)
            out["state"].append(taken / (time.perf_counter() - t0))
            shard = RayDataShard(dataset, 0, 2)
            batches = shard.iter_batches(batch_size=BATCH)
            for _, batch in zip(range(taken // 2), batches, strict=False):
                step(batch)
            batches.close()
            saved = shard.state_dict()
            t0 = time.perf_counter()
            next(iter(RayDataShard(dataset, 0, 2).iter_batches(batch_size=BATCH)))
            out["fresh"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            again = RayDataShard(dataset, 0, 2)
            again.load_state_dict(saved)
            next(iter(again.iter_batches(batch_size=BATCH)))
            out["resumed"].append(time.perf_counter() - t0)
        counts = io.BytesIO()
        torch.save(saved, counts)
        return {**{k: (statistics.median(v), min(v), max(v)) for k, v in out.items()},
                "size": counts.getbuffer().nbytes, "how": "skip by reading"}
    finally:
        ray.shutdown()


def counting_cost(batches: int = 200_000, repeats: int = 5) -> tuple[float, float]:
    """(µs a batch of a bare DataLoader over a stateful stream, µs a batch more with TrainState):
    what counting the batches the loop takes costs, with no data and no step to hide it."""
    def bare() -> Any:
        return torch.utils.data.DataLoader(Stream(torch.zeros(2 * batches, 1)), batch_size=None)

    plain, counted = [], []
    for _ in range(repeats):
        for times, adopt in ((plain, False), (counted, True)):
            loader = bare()
            if adopt:
                TrainState(loader=loader)
            t0 = time.perf_counter()
            for _batch in loader:
                pass
            times.append((time.perf_counter() - t0) / batches * 1e6)
    return statistics.median(plain), statistics.median(counted) - statistics.median(plain)


def row(name: str, r: dict[str, Any]) -> str:
    plain, state = r["plain"][0], r["state"][0]
    return (f"| {name} | {plain:,.0f} ({r['plain'][1]:,.0f}-{r['plain'][2]:,.0f}) "
            f"| {state:,.0f} ({r['state'][1]:,.0f}-{r['state'][2]:,.0f}) "
            f"| {100 * (plain - state) / plain:+.1f}% | {r['size']:,} B | {r['how']} "
            f"| {1e3 * r['fresh'][0]:.0f} ms | {1e3 * r['resumed'][0]:.0f} ms |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=40_000)
    parser.add_argument("--quick", action="store_true", help="2 repeats of 4,000 rows")
    parser.add_argument("--ray", action="store_true", help="Ray Data too, on a local Ray instance")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.rows = 2, 4_000
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="bench-data-") as d:
        os.environ.setdefault("HF_HOME", os.path.join(d, "hf"))
        files = write_rows(d, args.rows)
        x = torch.randn(args.rows, 16, generator=torch.Generator().manual_seed(0))
        print(f"{args.rows} rows, batches of {BATCH}, rank 0 of 2, medians of {args.repeats} (min-max); "
              f"torch {torch.__version__}, {sys.platform}\n")
        print("| loader | steps/s plain | steps/s TrainState | overhead | state | resume | "
              "first batch, fresh | first batch, resumed half way |")
        print("|---|---|---|---|---|---|---|---|")
        for name, build in kinds(files, x).items():
            print(row(name, measure(build, args.repeats)), flush=True)
        if args.ray:
            print(row("Ray Data: get_dataset_shard (rank 0 of 2) vs one plain reader",
                      measure_ray_data(files, args.repeats)), flush=True)
        carry = measure_carry(x, args.repeats)
        print("\nHF to_iterable_dataset(8 shards), a pass half trained on by 2 ranks, its rest on 4 "
              "(rank 0 of 4), against a fresh pass of rank 0 of 4: "
              + ", ".join(f"{k} {1e3 * v[0]:.0f} ms ({1e3 * v[1]:.0f}-{1e3 * v[2]:.0f})"
                          for k, v in carry.items()) + ".")
        base, extra = counting_cost(repeats=args.repeats)
        print(f"\nCounting the batches the loop takes: {extra:+.2f} µs a batch (a bare DataLoader over a "
              f"stateful stream, no collate, no step: {base:.2f} µs a batch).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
