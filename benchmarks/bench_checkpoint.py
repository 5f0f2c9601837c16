"""A sharded (FSDP2) checkpoint's cost against raw torch.save of the same shards and the disk.

    python benchmarks/bench_checkpoint.py [--repeats N] [--sizes 200,1000] [--storage DIR]
    python benchmarks/bench_checkpoint.py --gpu [--sizes 1000,4000]

A real 2-worker TorchTrainer run (gloo, CPU) per size: an MLP of Linear(width) layers sharded
with `fully_shard`, AdamW after one step (so the state is the weights and two moments: about
3x the parameters). With `--gpu`, one worker on one GPU (NCCL) and the model not sharded, so
that TrainState writes it with torch.save after copying it to host memory: the GPU rows, with
the device-to-host copy rate (pinned, as the async save's snapshot copies; pageable, as
`.cpu()` does). Each repeat measures, in a rotating order, with every rank at once:

- disk: each rank writes as many bytes as its shards hold, from memory, in 8 MiB writes, then
  fsyncs: the physical limit, measured the same way as the others;
- raw torch.save: each rank `torch.save`s its local shards (model and optimizer state, plain
  tensors) into the run's directory and fsyncs the file;
- sync save: `TrainState.report(..., checkpoint=True)`. "blocked" is until it returns, which
  is how long training waits: DCP writes each rank's shards straight into the checkpoint's
  staging directory, and the report flushes and sums them and sends their list. "committed"
  is until the driver's reply, which a loop takes at its next report: the driver has written
  the marker last and renamed the directory into place (retention off, so that deleting old
  checkpoints is not timed);
- async save: `TrainState(checkpoint_upload_mode=ASYNC).report(..., checkpoint=True)`. "blocked" is until it
  returns (the snapshot: the shards copied in memory); then training steps run while the
  files are written in the background, and "slowdown" is what those steps took beyond the
  same steps without a save in flight (measured just before); "stall" is blocked + slowdown,
  what training lost to the save (target: <= 25% of the sync save's blocked time on CPU,
  <= 10% on a GPU);
  "committed" is until `get_all_reported_checkpoints()` returns, i.e. the driver committed it.

A measurement is the slowest rank's time. Dirty pages are flushed (os.sync) before each one.
Prints a markdown table of medians (min-max) and the ratios to raw torch.save (target: sync
save <= 1.3x): of the medians, and the median of each repeat's own ratio (raw and sync save
run back to back, so that load from other work that drifts slowly cancels out).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch

from unbroken import train
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer, TrainState
from unbroken.worker import session as _session

MiB = 1 << 20
# width, layers: about 200 MB and 1 GB of model + AdamW state; on a GPU, about 1 and 4 GB.
SIZES = {200: (2048, 4), 1000: (4096, 5)}
GPU_SIZES = {1000: (9216, 1), 4000: (9216, 4)}


def _fsync_write(path: str, chunks: Any) -> None:
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def local_shards(state: TrainState) -> dict[str, Any]:
    """This rank's shards of the model and optimizer state, as plain tensors."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    def local(value: Any) -> Any:
        if isinstance(value, DTensor):
            return value.to_local()
        if isinstance(value, dict):
            return {k: local(v) for k, v in value.items()}
        return value

    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    return {"model": local(model_sd), "optimizer": local(optim_sd)}


def tensor_bytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    return 0


def _pageable(value: Any) -> Any:
    """`value` with its tensors copied to host memory the plain way (`.cpu()`)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _pageable(v) for k, v in value.items()}
    return value


def bench_loop(config: dict) -> None:
    from torch.distributed.fsdp import fully_shard

    from unbroken.state.state_file import snapshot
    from unbroken.train.torch import get_device

    ctx = train.get_context()
    rank = ctx.get_world_rank()
    device = get_device()
    torch.manual_seed(0)
    width, layers = config["width"], config["layers"]
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    if device.type == "cpu":
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batch = torch.randn(8, width, device=device)
    model(batch).pow(2).mean().backward()
    opt.step()
    state = TrainState(model=model, optimizer=opt)
    background = TrainState(model=model, optimizer=opt, checkpoint_upload_mode="ASYNC")
    shards = local_shards(state)
    nbytes = tensor_bytes(shards)
    scratch = os.path.join(config["scratch"], f"rank{rank}")
    os.makedirs(scratch, exist_ok=True)
    block = os.urandom(8 * MiB)

    def disk() -> None:
        full, rest = divmod(nbytes, len(block))
        _fsync_write(os.path.join(scratch, "disk.bin"), [block] * full + [block[:rest]])

    def raw() -> None:
        path = os.path.join(scratch, "raw.pt")
        with open(path, "wb") as f:
            torch.save(shards, f)
            f.flush()
            os.fsync(f.fileno())

    def sync_save() -> dict[str, float]:
        start = time.perf_counter()
        state.report({"it": 0}, checkpoint=True)
        blocked = time.perf_counter() - start
        train.get_context().should_checkpoint()  # the driver's reply: the checkpoint committed
        return {"sync save, blocked": blocked}

    def step(more: bool) -> bool:
        """One training step; True while any rank says `more` (every rank steps alike: FSDP's
        collectives need it)."""
        opt.zero_grad()
        model(batch).pow(2).mean().backward()
        opt.step()
        flag = torch.tensor([int(more)], device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def timed_steps(n: int) -> float:
        """The median time of a training step with no save in flight."""
        times = []
        for _ in range(n):
            start = time.perf_counter()
            step(True)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def async_save() -> dict[str, float]:
        saver = _session.current("bench").saver
        base = timed_steps(3)
        start = time.perf_counter()
        background.report({"it": 0}, checkpoint=True)
        blocked = time.perf_counter() - start
        slowdown, more = 0.0, True
        while more:
            t = time.perf_counter()
            more = step(saver.writing)
            slowdown += time.perf_counter() - t - base
        train.get_all_reported_checkpoints()  # waits for the driver's commit
        committed = time.perf_counter() - start
        return {"async save, blocked": blocked, "async save, slowdown": max(slowdown, 0.0),
                "async save, committed": committed}

    def to_host() -> dict[str, float]:
        torch.cuda.synchronize()
        start = time.perf_counter()
        snapshot(shards)
        pinned = time.perf_counter() - start
        start = time.perf_counter()
        _pageable(shards)
        return {"to host, pinned": pinned, "to host, pageable": time.perf_counter() - start}

    methods = {"disk": disk, "raw torch.save": raw, "sync save, committed": sync_save,
               "async save": async_save}
    if device.type == "cuda":
        methods["to host"] = to_host
    times: dict[str, list[float]] = collections.defaultdict(list)
    names = list(methods)
    for repeat in range(config["repeats"]):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            if rank == 0:
                os.sync()
            torch.distributed.barrier()
            start = time.perf_counter()
            parts = methods[name]() or {}
            measured = {name: time.perf_counter() - start, **parts}
            every: list[Any] = [None] * ctx.get_world_size()
            torch.distributed.all_gather_object(every, measured)
            for key in measured:
                times[key].append(max(m[key] for m in every))
            for leftover in os.listdir(scratch):
                os.remove(os.path.join(scratch, leftover))
    totals = [None] * ctx.get_world_size()
    torch.distributed.all_gather_object(totals, nbytes)
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump({"bytes": sum(totals), "times": times}, f)


def run_size(size_mb: int, repeats: int, storage: str, gpu: bool = False) -> dict[str, Any]:
    width, layers = (GPU_SIZES if gpu else SIZES)[size_mb]
    out = os.path.join(storage, f"times-{size_mb}.json")
    scratch = os.path.join(storage, f"scratch-{size_mb}")
    TorchTrainer(bench_loop, train_loop_config={"width": width, "layers": layers, "repeats": repeats,
                                                "out": out, "scratch": scratch},
                 scaling_config=ScalingConfig(num_workers=1, use_gpu=True) if gpu else
                 ScalingConfig(num_workers=2),
                 run_config=RunConfig(name=f"bench-{size_mb}", storage_path=storage, verbose=0)).fit()
    with open(out) as f:
        return json.load(f)


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default=None,
                        help="comma-separated MB: 200 and/or 1000 (default both); "
                             "with --gpu, 1000 and/or 4000")
    parser.add_argument("--gpu", action="store_true", help="one worker on one GPU (fails without one)")
    parser.add_argument("--storage", default=None, help="where the runs write (default: a temp dir)")
    args = parser.parse_args()
    if args.gpu and not torch.cuda.is_available():
        raise SystemExit("bench_checkpoint --gpu: torch sees no CUDA GPU")
    sizes = args.sizes or ("1000,4000" if args.gpu else "200,1000")
    storage = args.storage or tempfile.mkdtemp(prefix="bench-checkpoint-")
    where = (f"1 rank on {torch.cuda.get_device_name()} (NCCL), model not sharded" if args.gpu else
             "2 ranks, FSDP2 on CPU (gloo)")
    print(f"torch {torch.__version__}, {where}, {os.cpu_count()} CPUs, {args.repeats} repeats, "
          f"medians (min-max){'' if args.gpu else '; no GPU'}")
    print()
    gpu_head, gpu_rule = ((" device-to-host: pinned | device-to-host: pageable |", "---|---|")
                          if args.gpu else ("", ""))
    print("| state | disk write + fsync | raw torch.save + fsync | sync save: blocked | "
          "sync save: committed | blocked / raw | committed / raw | paired: blocked / raw | "
          "async: blocked | async: step slowdown | async: stall / sync blocked | async: committed |"
          + gpu_head)
    print("|---|---|---|---|---|---|---|---|---|---|---|---|" + gpu_rule)
    try:
        for size in (int(s) for s in sizes.split(",")):
            got = run_size(size, args.repeats, storage, args.gpu)
            t = got["times"]
            raw, blocked, committed = (t[k] for k in ("raw torch.save", "sync save, blocked",
                                                      "sync save, committed"))
            med = statistics.median
            a_blocked, slowdown = t["async save, blocked"], t["async save, slowdown"]
            stall = [(b + s) / sb for b, s, sb in zip(a_blocked, slowdown, blocked, strict=True)]
            rates = "".join(f" {got['bytes'] / med(t[k]) / 1e9:.1f} GB/s |"
                            for k in ("to host, pinned", "to host, pageable") if k in t)
            print(f"| {got['bytes'] / MiB:.0f} MiB | {cell(t['disk'])} | {cell(raw)} | {cell(blocked)} | "
                  f"{cell(committed)} | {med(blocked) / med(raw):.2f}x | {med(committed) / med(raw):.2f}x | "
                  f"{med(b / r for b, r in zip(blocked, raw, strict=True)):.2f}x | {cell(a_blocked)} | "
                  f"{cell(slowdown)} | {med(stall):.0%} | {cell(t['async save, committed'])} |{rates}",
                  flush=True)
    finally:
        if args.storage is None:
            shutil.rmtree(storage, ignore_errors=True)


if __name__ == "__main__":
    main()
