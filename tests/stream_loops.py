"""Training functions over streaming and per-rank data (torchdata's StatefulDataLoader, Hugging
Face `datasets`, a stateful IterableDataset of our own), over shard files a test writes.

Every kind reads the same rows ({"id", "x", "y"}); what differs is how each rank gets its share
and what keeps its position. Importable, so that trainers save the functions by reference."""

from __future__ import annotations

import json
import os
import threading

import torch

from loops import _die, seed_everything
from unbroken import train
from unbroken.train.torch import TrainState, prepare_data_loader, prepare_model

SHARDS, ROWS = 4, 16  # 64 rows: with 2 ranks and batches of 4, 8 steps an epoch

# kind -> how its position is resumed from a rank's own checkpoint file
KINDS = {
    "torchdata-map": "seek",  # StatefulDataLoader over a map-style dataset + DistributedSampler
    "torchdata-map-workers": "seek",  # the same, with 2 DataLoader worker processes prefetching
    "torchdata-hf-buffer": "replay",  # StatefulDataLoader(num_workers=2) over HF streaming, shuffle buffer
    "hf-shards": "seek",  # DataLoader over Dataset.to_iterable_dataset(num_shards=4), split by node
    "hf-stream": "seek",  # DataLoader over load_dataset("json", streaming=True), split by node
    "custom": "seek",  # DataLoader over a stateful IterableDataset of our own
}


def write_shards(directory: str, shards: int = SHARDS, rows: int = ROWS) -> list[str]:
    """`shards` JSON-lines files of `rows` rows each: {"id", "x" (8 floats), "y"}."""
    g = torch.Generator().manual_seed(99)
    paths = []
    for s in range(shards):
        path = os.path.join(directory, f"shard-{s:02d}.jsonl")
        with open(path, "w") as f:
            for r in range(rows):
                x = torch.randn(8, generator=g)
                f.write(json.dumps({"id": s * rows + r, "x": x.tolist(),
                                    "y": float(x @ torch.linspace(-1, 1, 8))}) + "\n")
        paths.append(path)
    return paths


def _files(config: dict) -> list[str]:
    return sorted(os.path.join(config["data_dir"], n) for n in os.listdir(config["data_dir"])
                  if n.endswith(".jsonl"))


def _rows(config: dict) -> list[dict]:
    return [json.loads(line) for path in _files(config) for line in open(path)]


class Rows(torch.utils.data.Dataset):
    """The rows as a map-style dataset of tensors."""

    def __init__(self, rows: list[dict]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        row = self.rows[i]
        return {"id": torch.tensor(row["id"]), "x": torch.tensor(row["x"]), "y": torch.tensor(row["y"])}


class ShardStream(torch.utils.data.IterableDataset):
    """A stateful stream of its own: this rank's rows in a seeded order per epoch, with its
    position (epoch, rows yielded) in state_dict()."""

    def __init__(self, rows: list[dict], rank: int, world: int, seed: int = 11) -> None:
        self.rows = rows[rank::world]
        self.seed = seed
        self.epoch = 0
        self.offset = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.rows), generator=g)
        while self.offset < len(order):
            row = self.rows[int(order[self.offset])]
            self.offset += 1
            yield {"id": torch.tensor(row["id"]), "x": torch.tensor(row["x"]), "y": torch.tensor(row["y"])}
        self.offset = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.offset = state["epoch"], state["offset"]


def make_loader(kind: str, config: dict, rank: int, world: int):
    """(loader, set_epoch) of `kind` for this rank, as a user would write it."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    batch = config.get("batch_size", 4)
    if kind in ("torchdata-map", "torchdata-map-workers"):
        data = Rows(_rows(config))
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,
                                                      seed=5)
        workers = 2 if kind == "torchdata-map-workers" else 0
        loader = StatefulDataLoader(data, batch_size=batch, sampler=sampler, num_workers=workers)
        return loader, sampler.set_epoch
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the data is local files; nothing to download
    os.environ.setdefault("HF_HOME", os.path.join(config["data_dir"], "hf"))
    import datasets
    from datasets.distributed import split_dataset_by_node

    if kind == "custom":
        data = ShardStream(_rows(config), rank, world)
        return torch.utils.data.DataLoader(data, batch_size=batch), data.set_epoch
    if kind == "torchdata-hf-buffer":
        data = datasets.load_dataset("json", data_files=_files(config), split="train", streaming=True)
        data = split_dataset_by_node(data.shuffle(seed=3, buffer_size=8), rank=rank, world_size=world)
        data = data.with_format("torch")
        return StatefulDataLoader(data, batch_size=batch, num_workers=2), data.set_epoch
    if kind == "hf-stream":
        data = datasets.load_dataset("json", data_files=_files(config), split="train", streaming=True)
        data = split_dataset_by_node(data, rank=rank, world_size=world).with_format("torch")
        return torch.utils.data.DataLoader(data, batch_size=batch), data.set_epoch
    if kind == "hf-shards":
        data = datasets.Dataset.from_list(_rows(config))
        data = data.to_iterable_dataset(num_shards=config.get("shards", 4))
        data = split_dataset_by_node(data, rank=rank, world_size=world).with_format("torch")
        return torch.utils.data.DataLoader(data, batch_size=batch), data.set_epoch
    raise ValueError(kind)


def _model_and_optimizer(rank: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    seed_everything(100 + rank)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                              torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def _train(config: dict, state: TrainState, epoch: int, batch: dict) -> None:
    """One step of the stream loops on `batch` ({"id", "x", "y"}): the optimizer step, the faults
    of `config` due at it, and the report of every rank's loss and sample ids. `hang_at`:
    [step, attempt] at which rank 1, on Ray, writes its node's id to `hang_marker` and blocks;
    `signal_at`: [step, attempt] after whose report rank 0 writes the step to `signal_marker`."""
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    loss = torch.nn.functional.mse_loss(state.model(batch["x"].float()), batch["y"].float().unsqueeze(1))
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    state.step += 1
    for at, attempt, kill_rank, mode in config.get("kill_at", []):
        if (at, attempt, kill_rank) == (state.step, ctx.get_attempt(), rank):
            _die(mode, at)
    if config.get("hang_at") == [state.step, ctx.get_attempt()] and rank == 1:  # its node is removed
        import ray

        with open(config["hang_marker"], "w") as f:
            f.write(ray.get_runtime_context().get_node_id())
        threading.Event().wait()
    every = [None] * world
    torch.distributed.all_gather_object(every, [loss.item(), batch["id"].tolist()])
    state.report({"step": state.step, "epoch": epoch, "losses": [e[0] for e in every],
                  "ids": [e[1] for e in every]},
                 checkpoint=state.step % config.get("ckpt_every", 3) == 0)
    for at, attempt, kill_rank, mode in config.get("die_after_report", []):
        if (at, attempt, kill_rank) == (state.step, ctx.get_attempt(), rank):
            threading.Event().wait() if mode == "hang" else _die(mode, at)
    if config.get("echo") and rank == 0:
        print(f"STEP {state.step}", flush=True)
    if config.get("signal_at") == [state.step, ctx.get_attempt()] and rank == 0:  # and goes on
        with open(config["signal_marker"], "w") as f:
            f.write(str(state.step))


def stream_loop(config: dict) -> None:
    """A DDP job with dropout and AdamW over a streaming loader of `config["kind"]`, its state a
    TrainState checkpointed every `ckpt_every` steps; each step reports every rank's loss and
    sample ids, and a last row has a final checkpoint. Faults as in `loops.exact_loop`:
    kill_at=[[step, attempt, rank, mode], ...]; with `jit`, die_after_report=[...] too; `echo`
    prints "STEP n" on rank 0 after each report; `prepare` reads the loader through
    prepare_data_loader."""
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model, opt = _model_and_optimizer(rank)
    loader, set_epoch = make_loader(config["kind"], config, rank, world)
    if config.get("prepare"):
        loader = prepare_data_loader(loader)
    state = TrainState(model=model, optimizer=opt, loader=loader, epoch=0, step=0,
                       **({"jit_checkpoint": True, "step_seed": 7} if config.get("jit") else {}))
    state.restore()
    for epoch in range(state.epoch, config.get("epochs", 2)):
        set_epoch(epoch)
        for batch in loader:
            _train(config, state, epoch, batch)
        state.epoch = epoch + 1
    state.report({"final": True, "step": state.step}, checkpoint=True)


def ray_data_loop(config: dict) -> None:
    """stream_loop's job over `train.get_dataset_shard("train")` of a Ray Dataset, iterated with
    `iter_torch_batches` as Ray Train scripts do; the shard is the TrainState's loader."""
    model, opt = _model_and_optimizer(train.get_context().get_world_rank())
    shard = train.get_dataset_shard("train")
    state = TrainState(model=model, optimizer=opt, loader=shard, epoch=0, step=0)
    state.restore()
    for epoch in range(state.epoch, config.get("epochs", 2)):
        for batch in shard.iter_torch_batches(batch_size=config.get("batch_size", 4),
                                              dtypes={"x": torch.float32, "y": torch.float32}):
            _train(config, state, epoch, batch)
        state.epoch = epoch + 1
    state.report({"final": True, "step": state.step}, checkpoint=True)
