"""Crash harness: kill real training runs at random moments and check that nothing breaks.

Each trial starts a real 2-worker TorchTrainer job (gloo, DDP, a checkpoint every other
iteration from both ranks, retention keeping two). Each launch of its driver is one of:
SIGKILL the driver at a uniformly random moment, SIGKILL one worker at a random moment,
a fault-injection point (`unbroken.core.faults`) that SIGKILLs a process at one step of the
commit protocol (file writes, fsync, marker, rename, retention, atomic replaces), every
rank (or one rank) raising, exiting or being SIGKILLed right after it sent a report, or (where a tmpfs
can be mounted) a disk that fills up at a random moment, or a second driver of the same run
started at a random moment while the first trains; with --ray, the workers are Ray
actors on a local 2-node Ray cluster, and a launch may also lose a node (removed without
warning, then replaced); with --elastic, the run is elastic (num_workers=(2, 3)) on a 3-node
cluster, and a launch may remove a node for good (the next fit() runs on 2 workers) or add
one back (the run grows at its next check, a RESIZED attempt within the launch); with
--async, the checkpoint files are written in the background (the fault points inside the
write then strike in the background thread). Then the
run is restored (by `TorchTrainer.restore(path)` or by running the same trainer again
under its name), again and again, until it finishes.

Invariants checked at every launch and at the end of each trial:
  - a restore never fails for any reason but the kill we injected;
  - every attempt resumes from the newest committed checkpoint as it was on disk before
    the launch, and what the loop loads is intact (its own hash matches);
  - a round every rank reported is recorded, and its checkpoint committed, even when the
    ranks die right after sending it (with --async: when they raise, which lets the
    background write finish; a write killed with its process leaves the previous checkpoint);
  - with --jit (the loop's state in a TrainState with just-in-time checkpoints): when one
    rank dies or raises right after a report, the survivor's checkpoint of that round is
    committed (the kills of the survivor during that save are among the random kills);
  - with --in-place (--jit, FailureConfig(recovery="in_place", max_failures=2,
    hang_timeout_s=6)): when one rank dies, raises or stops (SIGSTOP, found at the hang
    timeout and killed alone) right after a report (or every rank raises), the next attempt
    of the launch recovers in place from that round, reading nothing from storage, and its loop
    gets that round's state (kills of the sending survivor or of the receiving replacement
    in the middle of the transfer are among the faults: the launch then restarts from the
    newest committed checkpoint; with --ray too, a rank that blocks right after a report and
    then loses its node, which the next attempt must also recover in place from); half the
    trials loop with TrainState.for_each_batch, whose survivors stay inside their loop;
  - with --data (--jit, the loop reading a per-rank stream through torchdata's
    StatefulDataLoader with a worker process prefetching): each rank's sample sequence
    equals the uninterrupted run's, whether a resume seeks with the rank's own saved state
    (a periodic checkpoint) or replays the pass (a just-in-time one);
  - with --resize (--data over a Hugging Face stream split by node, 6 shards, and each launch
    on 1, 2 or 3 workers at random, so a restore carries the pass in progress to another
    size): each epoch trains on each example at most once, and loses at most what the carries'
    short last batches cannot split evenly (fewer than the ranks, at most 2 a launch);
  - with --ray, a launch may drain a rank's node for preemption (6 s ahead; then the node
    goes and a replacement joins): the run goes on without it, and never fails for it;
  - with --jit, a launch may get a preemption notice instead of a kill (--preempt: each
    trial's first launch does): SIGTERM to the driver at a random moment, half the time while
    every rank's next step takes a minute, and SIGKILL at the deadline (FailureConfig's
    sigterm_grace_s, 6 s) if the driver still runs: every round the launch recorded is
    committed by then (at the report after the notice, or just in time), and an attempt that
    ended by itself says PREEMPTED, with the notice;
  - a full disk fails the launch with StorageFullError, and the next launch (with room
    again) resumes;
  - a second driver started while the first holds the run fails with LeaseHeldError naming
    the first (or, once the first has finished, returns its result), and adds no attempt;
  - nothing under a committed checkpoint name is ever torn;
  - no leftovers (staging, half-deleted, quarantined dirs, atomic-write temps) at the end;
  - the metric timeline has each iteration exactly once, and its losses equal the
    uninterrupted run's, bit for bit (--elastic: within a float-order tolerance, as the
    number of workers changes);
  - the final model equals the uninterrupted run's, bit for bit (--elastic: the same);
  - within a launch, only a resize (RESIZED) is followed by another attempt (--in-place: a
    failure too);
  - every checkpoint asks for a validation (but with --jit), which runs in the background
    while the run trains and the kills strike (a fault point also kills the driver between a
    validation's end and its record): at the end each kept checkpoint has one
    record, VALIDATED on its own intact files (or failed because a kill-worker launch killed
    that validation process), and retention never deleted one still pending.

With --sweep, the harness of sweeps runs instead (tools/sweep_harness.py: a population-based
training sweep's driver killed at random moments and at `before_trial_record`; with --reuse,
also processes kept for the next trial killed while idle).

Usage:  python tools/crash_harness.py --trials 200 [--seed N] [--json] [--s3] [--ray] [--async]
        [--jit] [--in-place] [--data] [--preempt] [--elastic] [--sweep [--reuse]] [--strike]
        [--max-kills N]
(Local runs live on a tmpfs mounted for the harness when that is allowed, e.g. as root.)
Exit status 0 when no invariant was violated, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import multiprocessing as mp
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch
import torch._dynamo  # noqa: F401  (DDP imports it; forked drivers and workers inherit it)

from unbroken import train
from unbroken.errors import TornCheckpointError, TrainingFailedError
from unbroken.run import goodput
from unbroken.store import commit, validation_record
from unbroken.store import manifest as manifest_mod
from unbroken.store.history import RESULT_JSON, read_rows, timeline
from unbroken.store.storage import Storage
from unbroken.train import (
    Checkpoint,
    CheckpointConfig,
    CheckpointUploadMode,
    FailureConfig,
    Result,
    RunConfig,
    ScalingConfig,
    ValidationConfig,
)
from unbroken.train.torch import TorchTrainer, prepare_model
from unbroken.worker import session as session_mod

ITERATIONS = 16
CKPT_EVERY = 2
WORKER_POINTS = ("after_file_write", "after_fsync")
COMMIT_POINTS = ("before_marker", "after_marker", "before_rename", "after_rename")
RETENTION_POINTS = ("before_delete", "during_delete")
OTHER_POINTS = ("before_replace",)
S3_POINTS = ("after_fold", "during_copy_rename")  # steps only object stores take
REPORT_ACTIONS = ("kill", "exit", "raise")  # --in-place: also "stop" (SIGSTOP)
HANG_S = 6.0  # --in-place: FailureConfig.hang_timeout_s, which finds a stopped rank
PREEMPT_GRACE_S = 6.0  # --jit: FailureConfig.sigterm_grace_s; a preempted driver is SIGKILLed then
DRAIN_S = 6.0  # --ray: a drained node goes this long after its drain
MAX_KILLS = 4
UPLOAD_MODE = {False: CheckpointUploadMode.SYNC, True: CheckpointUploadMode.ASYNC}
ASYNC_SAVES = [False]  # --async: the loop's checkpoints are written in the background
JIT = [False]  # --jit: the loop's state is a TrainState with just-in-time checkpoints
IN_PLACE = [False]  # --in-place: --jit, and a failed rank is replaced while the others stay
DATA = [False]  # --data: --jit, and the loop reads a streaming loader (per-rank position)
PREEMPT = [False]  # --preempt: --jit, and each trial's first launch gets a preemption notice (--ray: a drain)
ELASTIC = [False]  # --elastic: num_workers=(2, 3) on a 3-node Ray cluster that loses and regains nodes
RESIZE = [False]  # --resize: --data over a Hugging Face stream, each launch on WORKERS[0] workers
WORKERS = [2]  # the workers of the next launch (--resize draws it before each)
HF_ROWS = 24  # --resize: 6 shards of 4; 1, 2 or 3 ranks take whole shards

# Lease takeovers after each kill are expected here; keep the output to the counts.
logging.getLogger("unbroken").setLevel(logging.ERROR)


# -- the job ---------------------------------------------------------------------------------
def crash_loop(config: dict) -> None:
    """A DDP regression whose checkpoints carry their own hash; logs what each attempt loads."""
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    with open(config["log"] + ".pids", "a") as f:  # where a kill-worker launch finds Ray's actors
        f.write(f"{os.getpid()}\n")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    model = prepare_model(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    inner = model.module if hasattr(model, "module") else model
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            blob = open(os.path.join(d, "state.pt"), "rb").read()
            meta = json.load(open(os.path.join(d, "meta.json")))
            intact = hashlib.sha256(blob).hexdigest() == meta["sha256"] and all(
                json.load(open(os.path.join(d, f"rank{r}.json")))["iteration"] == meta["iteration"]
                for r in range(meta.get("world", world)))  # the world that wrote it (elastic: another)
        if rank == 0:
            with open(config["log"], "a") as f:
                f.write(json.dumps({"attempt": ctx.get_attempt(), "loaded": os.path.basename(
                    checkpoint.path.rstrip("/")), "iteration": meta["iteration"], "intact": intact}) + "\n")
        if not intact:
            raise RuntimeError("a torn checkpoint was handed to the training loop")
        state = torch.load(io.BytesIO(blob), weights_only=True)
        inner.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = meta["iteration"]
    g = torch.Generator().manual_seed(7)
    x = torch.randn(config.get("samples", 256), 16, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    everything = (x, y) if config.get("on_request") else None  # elastic: report the loss on all of it
    x, y = x[rank::world], y[rank::world]
    for it in range(start + 1, config["iterations"] + 1):
        time.sleep(config.get("step_s", 0.0))  # elastic: long enough for a node to join and a resize
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if everything is not None:  # rank 0's share changes with the number of workers
            with torch.no_grad():
                loss = torch.nn.functional.mse_loss(model(everything[0]), everything[1])
        asked = config.get("on_request") and ctx.should_checkpoint()  # an elastic resize asks
        if it % config["every"] and not asked:
            train.report({"loss": loss.item()})
            continue
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, f"rank{rank}.json"), "w") as f:
                json.dump({"iteration": it}, f)
            if rank == 0:
                buf = io.BytesIO()
                torch.save({"model": inner.state_dict(), "optimizer": opt.state_dict()}, buf)
                with open(os.path.join(d, "state.pt"), "wb") as f:
                    f.write(buf.getvalue())
                with open(os.path.join(d, "meta.json"), "w") as f:
                    json.dump({"iteration": it, "world": world,
                               "sha256": hashlib.sha256(buf.getvalue()).hexdigest()}, f)
            train.report({"loss": loss.item()}, checkpoint=Checkpoint.from_directory(d),
                         checkpoint_upload_mode=UPLOAD_MODE[config.get("async", False)],
                         validation=bool(config.get("validate")))


def validate_checkpoint(checkpoint: Checkpoint) -> dict:
    """The harness's checkpoint validation: which iteration the checkpoint holds and whether
    its files are intact (what check_finished compares with the checkpoint's marker)."""
    with checkpoint.as_directory() as d:
        blob = open(os.path.join(d, "state.pt"), "rb").read()
        meta = json.load(open(os.path.join(d, "meta.json")))
    intact = hashlib.sha256(blob).hexdigest() == meta["sha256"]
    return {"val_iteration": meta["iteration"], "val_intact": intact}


class RankStream(torch.utils.data.IterableDataset):
    """--data: a stateful stream of this rank's samples ({"id", "x", "y"}), a seeded order per
    pass of `length` samples, its position (pass, offset) in state_dict()."""

    def __init__(self, rank: int, world: int, length: int = 20) -> None:
        self.rank, self.world, self.length = rank, world, length
        self.passes, self.offset = 0, 0

    def __iter__(self) -> Iterator[dict]:
        g = torch.Generator().manual_seed(1000 * self.passes + self.rank)
        order = torch.randperm(self.length, generator=g)
        while self.offset < self.length:
            i = int(order[self.offset]) * self.world + self.rank
            self.offset += 1
            x = torch.randn(16, generator=torch.Generator().manual_seed(i))
            yield {"id": torch.tensor(i), "x": x, "y": torch.sin(x.sum(dim=0, keepdim=True))}
        self.passes, self.offset = self.passes + 1, 0

    def state_dict(self) -> dict:
        return {"passes": self.passes, "offset": self.offset}

    def load_state_dict(self, state: dict) -> None:
        self.passes, self.offset = state["passes"], state["offset"]


def _stream(loader: Any, state: Any = None) -> Iterator[Any]:
    """--data: batches of pass after pass of `loader` (each `iter` a pass it counts); with a
    state, its `epoch` counts the passes ended."""
    while True:
        yield from loader
        if state is not None:
            state.epoch += 1


def hf_loader(rank: int, world: int) -> Any:
    """--resize: rank's DataLoader over a Hugging Face stream of HF_ROWS rows in 6 shards, split
    by node, no shuffle buffer, no loader workers (a pass any number of ranks can carry on)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from datasets import Dataset
    from datasets.distributed import split_dataset_by_node

    x = torch.randn(HF_ROWS, 16, generator=torch.Generator().manual_seed(3))
    rows = Dataset.from_dict({"id": list(range(HF_ROWS)), "x": x.tolist(),
                              "y": torch.sin(x.sum(dim=1, keepdim=True)).tolist()})
    data = split_dataset_by_node(rows.to_iterable_dataset(num_shards=6), rank=rank, world_size=world)
    return torch.utils.data.DataLoader(data.with_format("torch"), batch_size=4)


def jit_loop(config: dict) -> None:
    """crash_loop's job, with dropout, through TrainState(jit_checkpoint=True, step_seed=...):
    a failing rank's survivor saves the last round. Logs what each attempt loads, checked
    against its commit marker."""
    from unbroken.train.torch import TrainState, prepare_data_loader

    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    with open(config["log"] + ".pids", "a") as f:
        f.write(f"{os.getpid()}\n")
    torch.manual_seed(0)
    # Elastic: no dropout, whose per-rank streams would differ with the number of workers.
    dropout = torch.nn.Identity() if config.get("on_request") else torch.nn.Dropout(0.1)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), dropout, torch.nn.Linear(32, 1))
    model = prepare_model(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = None
    if config.get("in_loop"):  # TrainState.for_each_batch: one pass of one batch per iteration
        loader = prepare_data_loader(torch.utils.data.DataLoader(range(world * config["iterations"]),
                                                                 batch_size=1, shuffle=False))
    if config.get("hf"):
        loader = hf_loader(rank, world)
    elif config.get("data"):  # a per-rank stream through torchdata (a worker process prefetching)
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(RankStream(rank, world), batch_size=4, num_workers=1)
    state = TrainState(model=model, optimizer=opt, iteration=0, jit_checkpoint=True, step_seed=11,
                       **({"loader": loader} if loader is not None else {}),
                       **({"epoch": 0} if config.get("hf") else {}))
    checkpoint = train.get_checkpoint()
    from_peer = session_mod.active().peer_state is not None  # recovering in place
    state.restore()
    if from_peer:
        if rank == 0:
            with open(config["log"], "a") as f:
                f.write(json.dumps({"attempt": ctx.get_attempt(), "loaded": "peer",
                                    "iteration": state.iteration, "intact": True}) + "\n")
    elif checkpoint is not None:
        where, name = checkpoint.url.rstrip("/").rsplit("/", 1)
        try:
            marker: commit.Marker | None = commit.verify(Storage.from_url(where), name, full=True)
        except TornCheckpointError:
            marker = None
        intact = marker is not None and marker.iteration == state.iteration
        if rank == 0:
            with open(config["log"], "a") as f:
                f.write(json.dumps({"attempt": ctx.get_attempt(), "loaded": name,
                                    "iteration": state.iteration, "intact": intact}) + "\n")
        if not intact:
            raise RuntimeError("a torn checkpoint was handed to the training loop")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(config.get("samples", 256), 16, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    everything = (x, y) if config.get("on_request") else None  # elastic: report the loss on all of it
    x, y = x[rank::world], y[rank::world]
    batches = _stream(loader, state if config.get("hf") else None) if config.get("data") else None
    attempts = [ctx.get_attempt()]

    def step(_batch: Any = None) -> None:
        it = state.iteration + 1
        ctx = train.get_context()
        if ctx.get_attempt() != attempts[-1]:  # the loop stayed (for_each_batch) into a new attempt
            attempts.append(ctx.get_attempt())
            with open(config["log"], "a") as f:
                f.write(json.dumps({"attempt": ctx.get_attempt(), "loaded": "peer", "in_loop": True,
                                    "rank": rank, "iteration": state.iteration, "intact": True}) + "\n")
        time.sleep(config.get("step_s", 0.0))  # elastic: long enough for a node to join and a resize
        if os.path.exists(config["log"] + ".stall"):  # a preemption while every rank's step is long
            time.sleep(60)
        xs, ys, ids = x, y, None
        if batches is not None:
            batch = next(batches)
            xs, ys, ids = batch["x"].float(), batch["y"].float(), batch["id"].tolist()
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if everything is not None:
            with torch.no_grad():
                loss = torch.nn.functional.mse_loss(model(everything[0]), everything[1])
        state.iteration = it
        asked = bool(config.get("on_request")) and ctx.should_checkpoint()
        metrics = {"loss": loss.item()}
        if ids is not None:  # every rank's samples of this step, checked against the reference
            every = [None] * world
            torch.distributed.all_gather_object(every, ids)
            metrics["ids"] = every
            if config.get("hf"):
                metrics["epoch"] = state.epoch
        state.report(metrics, checkpoint=it % config["every"] == 0 or asked)

    if config.get("in_loop"):  # one batch per iteration, in one pass: survivors stay in this loop
        state.for_each_batch(loader, step)
    else:
        for _ in range(state.iteration + 1, config["iterations"] + 1):
            step()


def loops_stay(log: str) -> bool:
    """--in-place: whether the trial that logs to `log` loops with TrainState.for_each_batch, whose
    survivors stay inside their loop (half the trials, the elastic and --data ones aside)."""
    index = re.findall(r"[0-9]+", os.path.basename(log))  # trial-<index>.log
    return IN_PLACE[0] and not ELASTIC[0] and not DATA[0] and bool(index) and int(index[0]) % 2 == 0


def make_trainer(storage: str, name: str, log: str) -> TorchTrainer:
    validate = not JIT[0]  # every checkpoint of the crash loop is validated in the background
    config = {"iterations": ITERATIONS, "every": CKPT_EVERY, "log": log, "async": ASYNC_SAVES[0],
              "validate": validate}
    scaling = ScalingConfig(num_workers=WORKERS[0], resources_per_worker={"CPU": 1})
    if ELASTIC[0]:  # 2 or 3 workers; 240 samples share out evenly to either, so only float order differs
        scaling = ScalingConfig(num_workers=(2, 3), resources_per_worker={"CPU": 1},
                                elastic_resize_monitor_interval_s=1.0)
        config.update(samples=240, on_request=True, step_s=0.3)
    elif PREEMPT[0] and os.environ.get("RAY_ADDRESS"):  # a drain lands while the ranks train
        config.update(step_s=0.2)
    config.update(in_loop=loops_stay(log), data=DATA[0], hf=RESIZE[0])
    return TorchTrainer(
        jit_loop if JIT[0] else crash_loop, train_loop_config=config,
        validation_config=ValidationConfig(validate_checkpoint) if validate else None,
        scaling_config=scaling,
        run_config=RunConfig(name=name, storage_path=storage, verbose=0,
                             checkpoint_config=CheckpointConfig(num_to_keep=2),
                             failure_config=FailureConfig(
                                 max_failures=2 if IN_PLACE[0] else 0,
                                 recovery="in_place" if IN_PLACE[0] else "checkpoint",
                                 hang_timeout_s=HANG_S if IN_PLACE[0] else None,
                                 sigterm_grace_s=PREEMPT_GRACE_S)))


def _driver(storage: str, name: str, log: str, how: str, fault: str | None, fault_log: str,
            outcome: str) -> None:
    """One launch of the driver (a forked child of the harness, as a fresh script would be)."""
    os.environ.pop("UNBROKEN_FAULT", None)
    if fault:
        os.environ.update(UNBROKEN_FAULT=fault, UNBROKEN_FAULT_LOG=fault_log)
    path = f"{storage}/{name}"
    try:
        resized = {"scaling_config": ScalingConfig(num_workers=WORKERS[0], resources_per_worker={"CPU": 1})}
        trainer = (TorchTrainer.restore(path, **(resized if RESIZE[0] else {})) if how == "restore"
                   else make_trainer(storage, name, log))
        trainer.fit()
        result = "finished"
    except TrainingFailedError as e:
        cause = e.__cause__
        result = f"failed {type(cause).__name__}: {str(cause).splitlines()[0] if cause else e}"
    except BaseException as e:  # noqa: BLE001 - any other error is a finding
        result = f"error {type(e).__name__}: {e}"
    with open(outcome, "w") as f:
        f.write(result)
    sys.stdout.flush()
    os._exit(0)


# -- checks ------------------------------------------------------------------------------------
def newest_committed(path: str, violations: list[str]) -> str | None:
    """The newest checkpoint whose marker verifies, read-only; a torn one under a committed
    name is itself a violation (the protocol must never expose one). On object stores files
    are uploaded under the final name and the marker goes last, so there an unmarked
    directory is an upload in progress, not a violation."""
    storage = Storage.from_url(path)
    names, _ = commit.scan(storage)
    newest = None
    for name in names:
        try:
            commit.verify(storage, name, full=True)
            newest = name
        except TornCheckpointError as e:
            if storage.is_local or storage.exists(f"{name}/{commit.MARKER}"):
                violations.append(f"torn checkpoint under a committed name: {e}")
    return newest


def leftovers(path: str) -> list[str]:
    storage = Storage.from_url(path)
    found = [n for n in storage.listdir() if any(t in n for t in (".tmp-", ".del-", ".corrupt-"))]
    found += [n for n in commit.scan(storage)[0] if not storage.exists(f"{n}/{commit.MARKER}")]
    found += [f".unbroken/{n}" for n in storage.listdir(".unbroken") if ".tmp-" in n]
    return found


def read_manifest(path: str) -> dict | None:
    try:
        return json.loads(Storage.from_url(path).read_bytes(".unbroken/run.json"))
    except (FileNotFoundError, ValueError):
        return None


def read_struck(fault_log: str) -> list[str]:
    """The fault points that struck, in order, as UNBROKEN_FAULT_LOG recorded them."""
    return open(fault_log).read().split()[::2] if os.path.exists(fault_log) else []


def read_log(log: str) -> list[dict]:
    if not os.path.exists(log):
        return []
    return [json.loads(line) for line in open(log) if line.strip()]


class Harness:
    def __init__(self, seed: int, workdir: str, root: str, disk: SmallDisk | None = None,
                 cluster: RayCluster | None = None, strike: bool = False, max_kills: int = MAX_KILLS) -> None:
        self.rng = random.Random(seed)
        self.strike = strike  # each trial's first launch is a fault that always strikes
        self.max_kills = max_kills  # faults per trial; the launches after them run to the end
        self.cluster = cluster  # the Ray cluster the workers run on (--ray), else local workers
        self.workdir = workdir
        self.root = root  # where the runs live: the work directory, or an s3:// prefix
        self.disk = disk  # the tmpfs the runs live on, when one could be mounted
        self.ctx = mp.get_context("fork")
        self.counts: Counter[str] = Counter()
        self.violations: list[str] = []
        self.reference_losses: list[float] = []
        self.reference_ids: list[Any] = []
        self.reference_weights: dict[str, torch.Tensor] = {}
        self.duration = 1.0

    def launch(self, storage: str, name: str, log: str, how: str, fault: str | None,
               outcome: str = "outcome") -> tuple[Any, str]:
        outcome = os.path.join(self.workdir, outcome)
        if os.path.exists(outcome):
            os.remove(outcome)
        proc = self.ctx.Process(target=_driver, args=(storage, name, log, how, fault,
                                                      os.path.join(self.workdir, "faults"), outcome))
        proc.start()
        return proc, outcome

    def reference(self) -> None:
        storage = f"{self.root}/reference"
        t0 = time.monotonic()
        proc, outcome = self.launch(storage, "run", os.path.join(self.workdir, "ref.log"), "fresh", None)
        proc.join()
        self.duration = time.monotonic() - t0
        if open(outcome).read() != "finished":
            raise SystemExit(f"the uninterrupted reference run failed: {open(outcome).read()}")
        result = Result.from_path(f"{storage}/run")
        self.reference_losses = [row["loss"] for row in _timeline(result.url)]
        self.reference_ids = [row.get("ids") for row in _timeline(result.url)]
        self.reference_weights = self.final_weights(result)

    @staticmethod
    def final_weights(result: Result) -> dict[str, torch.Tensor]:
        with result.checkpoint.as_directory() as d:
            if JIT[0]:
                state = torch.load(os.path.join(d, "train_state.pt"), weights_only=True)
                return state["state_dicts"]["model"]
            return torch.load(os.path.join(d, "state.pt"), weights_only=True)["model"]

    def choose(self, kills: int) -> tuple[str, str | None, float | None]:
        """(kind, fault spec, kill delay) for the next launch."""
        if kills >= self.max_kills:
            return "none", None, None
        if self.strike and kills == 0:
            return self.report_fault()
        if PREEMPT[0] and kills == 0:  # with --ray: a drained node; while the ranks train
            delay = self.rng.uniform(0.2, 0.8) * self.duration
            return ("preempt" if self.cluster is None else "drain"), None, delay
        if ELASTIC[0] and self.rng.random() < 0.35:  # the cluster shrinks (a node lost for good) or grows
            delay = self.rng.uniform(0, self.duration)
            if self.cluster.nodes == 3:
                return "remove-node", None, delay
            # the run grows within the launch (the node joins early enough for it), and half the
            # time the driver is killed between the attempt that stopped for it and the next one
            return ("add-node", "after_resize_stop:1" if self.rng.random() < 0.5 else None,
                    delay / 3)
        r = self.rng.random()
        if r < 0.15:
            return "worker-fault", f"{self.rng.choice(WORKER_POINTS)}:{self.rng.randint(1, 6)}", None
        if r < 0.40:
            return "commit-fault", f"{self.rng.choice(COMMIT_POINTS)}:{self.rng.randint(1, 6)}", None
        if r < 0.50:
            return "retention-fault", f"{self.rng.choice(RETENTION_POINTS)}:{self.rng.randint(1, 4)}", None
        if r < 0.55:
            if self.root.startswith("s3://") and self.rng.random() < 0.5:  # a launch folds a few times
                return "replace-fault", f"{self.rng.choice(S3_POINTS)}:{self.rng.randint(1, 3)}", None
            if not JIT[0] and self.rng.random() < 0.3:  # a validation ended; its record not written yet
                return "validation-fault", f"before_validation_record:{self.rng.randint(1, 4)}", None
            return "replace-fault", f"{self.rng.choice(OTHER_POINTS)}:{self.rng.randint(1, 12)}", None
        if r < 0.65:
            return self.report_fault()
        if r < 0.72 and self.disk is not None:
            return "disk-full", None, None
        delay = self.rng.uniform(0, self.duration)
        if r < 0.78:  # half of them start the second driver at the same moment as the first
            return "second-driver", None, delay if self.rng.random() < 0.5 else 0.0
        if r < 0.85:  # --jit: half of them a preemption notice instead
            preempt = JIT[0] and self.cluster is None and self.rng.random() < 0.5
            return ("preempt" if preempt else "kill-driver"), None, delay
        if self.cluster is not None and r < 0.95:  # a node lost without warning, or drained first
            return ("lose-node" if r < 0.9 else "drain"), None, delay
        return "kill-worker", None, delay

    def report_fault(self) -> tuple[str, str, None]:
        """Every rank, or one, raises, exits or is SIGKILLed (--in-place: or stopped) right
        after sending report n; with --ray --in-place, one rank may instead block there and
        lose its node (`lose_struck_node`)."""
        if self.cluster is not None and IN_PLACE[0] and self.rng.random() < (0.6 if ELASTIC[0] else 0.3):
            # one rank blocks right after report n, and its node is lost then (lose_struck_node)
            rank = self.rng.choice(":0 :1".split())
            return "report-node-loss", f"after_report:{self.rng.randint(1, 6)}:block{rank}:once", None
        action = self.rng.choice(REPORT_ACTIONS)
        if IN_PLACE[0] and self.rng.random() < 0.2:
            action = "stop"  # frozen: found at hang_timeout_s, then killed alone (or all restart)
        rank = self.rng.choice(["", ":0", ":1"])
        fault = f"after_report:{self.rng.randint(1, 6)}:{action}{rank}"
        if IN_PLACE[0] and rank:
            fault += ":once"  # not again in the rank started in its place
            if self.rng.random() < 0.3:  # and the sender or the receiver dies as the state goes over
                fault += f",during_peer_share:1:kill:{self.rng.choice('01')}:once"
        elif JIT[0] and rank and self.rng.random() < 0.3:
            fault += ",during_jit_save:1:kill"  # and the survivor dies while it saves the round
        return "report-fault", fault, None

    def lose_struck_node(self, proc: Any, fault_log: str) -> None:
        """Once the report fault struck (a rank blocks right after its report), lose the node
        that runs the rank's process, as a machine lost at that moment."""
        while proc.is_alive():
            struck = open(fault_log).read().split() if os.path.exists(fault_log) else []
            if struck:
                # --elastic: half the time for good, which an elastic run of 3 shrinks in place
                for_good = ELASTIC[0] and self.cluster.nodes > 2 and self.rng.random() < 0.5
                lost = (self.cluster.remove_node if for_good else self.cluster.lose_node)(struck[1])
                self.counts["nodes lost for good right after a report"] += for_good and lost != "-"
                self.counts["nodes lost right after a report"] += lost != "-"
                return
            time.sleep(0.05)

    def trial(self, index: int) -> None:
        storage = f"{self.root}/trial-{index}"
        name, log = "run", os.path.join(self.workdir, f"trial-{index}.log")
        path = f"{storage}/{name}"
        kills = 0
        for launch in range(self.max_kills + 3):
            before = newest_committed(path, self.violations)
            attempts_before = _attempt_count(path)
            # A driver killed after the run finished but before it said so: this launch only
            # returns the stored result.
            finished_before = (read_manifest(path) or {}).get("status") == "FINISHED"
            self.counts["launches of a finished run"] += finished_before
            exists = TorchTrainer.can_restore(path)
            how = self.rng.choice(["restore", "rerun"]) if exists else "fresh"
            kind, fault, delay = self.choose(kills)
            if exists:
                self.counts["restores"] += 1
            fault_log = os.path.join(self.workdir, "faults")
            if os.path.exists(fault_log):
                os.remove(fault_log)
            if kind == "disk-full":
                self.disk.leave_free(self.rng.randint(0, 40) * 4096)
            if RESIZE[0]:
                WORKERS[0] = self.rng.choice([1, 2, 3])
                self.counts[f"launches on {WORKERS[0]} workers"] += 1
            proc, outcome = self.launch(storage, name, log, how, fault)
            self.counts["launches"] += 1
            if kind == "report-node-loss":
                self.lose_struck_node(proc, fault_log)
            proc.join(delay)
            struck = None
            second = self.start_second(proc, storage, name, log, exists) if kind == "second-driver" else None
            if proc.is_alive() and kind == "lose-node":
                self.cluster.lose_node()
                self.counts["nodes lost"] += 1
                kills += 1
                struck = "lose-node"
            elif kind == "remove-node":  # the run shrinks (in its next fit(): max_failures is 0)
                self.cluster.remove_node()
                self.counts["nodes removed"] += 1
                kills += 1
                struck = "remove-node"
            elif kind == "add-node":  # a run at 2 workers grows at its next check
                self.cluster.add_node()
                self.counts["nodes added"] += 1
            elif proc.is_alive() and kind == "drain":
                struck = self.drain(proc, log)
                kills += struck is not None
            elif proc.is_alive() and kind == "preempt":
                self.preempt(proc, log)
                kills += 1
                struck = "preempt"
            elif proc.is_alive() and kind != "second-driver":
                victim = proc.pid
                if kind == "kill-worker":
                    workers = self.workers(proc.pid, log)
                    victim = self.rng.choice(workers) if workers else proc.pid
                    self.counts["kills: worker" if workers else "kills: driver"] += 1
                    struck = "kill-worker" if workers else None
                else:
                    self.counts["kills: driver"] += 1
                os.kill(victim, signal.SIGKILL)
                kills += 1
            proc.join()
            injected = open(fault_log).read().split()[0] if os.path.exists(fault_log) else None
            if injected:
                kills += 1
                self.counts[f"kills at {injected}"] += 1
                if injected in COMMIT_POINTS + RETENTION_POINTS + WORKER_POINTS:
                    self.counts["kills inside commit"] += 1
            injected = injected or struck
            result = open(outcome).read() if os.path.exists(outcome) else "killed"
            if second is not None:
                result = self.check_second(proc, second, result, path, attempts_before,
                                           finished_before, f"trial {index} launch {launch}")
            if kind == "disk-full":
                self.disk.grow()
                if result.startswith("error StorageFullError"):  # full before training began
                    result = "failed" + result[len("error"):]
                if result != "finished":
                    kills += 1
                    injected = "disk-full"
                    self.counts["disk full"] += 1
                    if "StorageFullError" not in result:
                        self.violations.append(f"trial {index} launch {launch}: the disk filled up, "
                                               f"but the run failed with {result}")
            self.check_launch(path, log, before, attempts_before, result, injected, index, launch)
            if struck == "drain" and result.startswith("failed"):
                self.violations.append(f"trial {index} launch {launch}: a node drained for preemption "
                                       f"failed the run: {result}")
            if struck == "preempt" and result != "finished":
                self.check_preempted(path, attempts_before, result, f"trial {index} launch {launch}")
            if injected == "after_report":
                self.check_reported_round(path, before, fault, attempts_before,
                                          f"trial {index} launch {launch}")
            if result == "finished":
                self.check_time(path, launch + 1, f"trial {index}")
                self.check_finished(path, index, launch + 1)
                return
        self.violations.append(f"trial {index}: the run did not finish after {self.max_kills + 3} launches")

    def preempt(self, proc: Any, log: str) -> None:
        """A preemption notice: SIGTERM to the driver, half the time while every rank's next
        step takes a minute (so that no report comes before the deadline); at the deadline,
        the machine goes (the driver SIGKILLed, its workers with it)."""
        stall = log + ".stall"
        if self.rng.random() < 0.5:
            open(stall, "w").close()
            self.counts["preempted: in a long step"] += 1
        with contextlib.suppress(ProcessLookupError):  # it may have just finished
            os.kill(proc.pid, signal.SIGTERM)
        self.counts["preempted"] += 1
        proc.join(PREEMPT_GRACE_S)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
            self.counts["preempted: still running at the deadline"] += 1
        proc.join()
        if os.path.exists(stall):
            os.remove(stall)

    def drain(self, proc: Any, log: str) -> str | None:
        """Ray drains the node of one of the run's ranks for preemption, DRAIN_S ahead; at the
        deadline the node goes and a replacement joins. The run goes on without it (a
        preemption is not a failure: max_failures is 0). Returns "drain", or None when no
        rank was running."""
        workers = self.workers(proc.pid, log)
        node = self.cluster.drain(self.rng.choice(workers), DRAIN_S) if workers else "-"
        if node == "-":
            return None
        self.counts["nodes drained"] += 1
        proc.join(DRAIN_S)
        self.cluster.reclaim(node)
        return "drain"

    def check_preempted(self, path: str, attempts_before: int, result: str, where: str) -> None:
        """A preempted launch committed every round it recorded before the deadline (at the
        report after the notice, or just in time), and its attempt says PREEMPTED."""
        rows = [r for r in read_rows(Storage.from_url(path)) if r.get("attempt", 0) > attempts_before]
        last = max((r["training_iteration"] for r in rows), default=None)
        newest = newest_committed(path, self.violations)
        if last is not None and (newest is None or commit.iteration_of(newest) != last):
            self.violations.append(f"{where}: preempted after recording round {last}, and the newest "
                                   f"committed checkpoint is {newest}")
        attempt = ((read_manifest(path) or {}).get("attempts") or [{}])[-1]
        if result != "killed" and attempt.get("number", 0) > attempts_before:
            if attempt.get("status") != "PREEMPTED" or not attempt.get("preempted"):
                self.violations.append(f"{where}: a preempted launch ended {result!r} with its attempt "
                                       f"{attempt.get('status')}")
            self.counts["preempted: stopped by itself"] += 1

    def start_second(self, first: Any, storage: str, name: str, log: str, exists: bool) -> Any | None:
        """Start a second driver of the run now (restore, or where the run may not exist yet,
        the same trainer again), while `first` may still drive it; None when the first has
        finished already."""
        if not first.is_alive():
            self.counts["second driver: first already done"] += 1
            return None
        how = self.rng.choice(["restore", "rerun"]) if exists else "rerun"
        return self.launch(storage, name, log, how, None, outcome="outcome-second")[0]

    def check_second(self, first: Any, second: Any, result: str, path: str, attempts_before: int,
                     finished_before: bool, where: str) -> str:
        """Of two drivers of one run, one finishes it and the other is refused with
        LeaseHeldError naming it (or, started after the first finished, finds it finished);
        only one attempt is added (none to a run that had finished before both). Returns the
        outcome of the one that drove the run."""
        second.join()
        outcome = os.path.join(self.workdir, "outcome-second")
        other = open(outcome).read() if os.path.exists(outcome) else "no outcome"

        def refused(text: str, holder: int) -> bool:
            return text.startswith("error LeaseHeldError") and f"pid {holder} " in text

        if result == "finished" and refused(other, first.pid):
            self.counts["second driver: refused"] += 1
        elif other == "finished" and refused(result, second.pid):
            self.counts["second driver: won, the first refused"] += 1
            result = other
        elif result == other == "finished":
            self.counts["second driver: found it finished"] += 1
        else:
            self.violations.append(f"{where}: two drivers of the run at once ended with {result!r} "
                                   f"(the first) and {other!r} (the second)")
        added, expected = _attempt_count(path) - attempts_before, 0 if finished_before else 1
        if added != expected:
            self.violations.append(f"{where}: two drivers of the run added {added} attempts, "
                                   f"not {expected}")
        return result

    def workers(self, driver: int, log: str) -> list[int]:
        """The live worker processes of the launch: the driver's children, or Ray's actors."""
        if self.cluster is None:
            return _children(driver)
        pids = open(log + ".pids").read().split()[-2:] if os.path.exists(log + ".pids") else []
        return [int(p) for p in pids if _alive(int(p))]

    def check_launch(self, path: str, log: str, before: str | None, attempts_before: int, result: str,
                     injected: str | None, trial: int, launch: int) -> None:
        where = f"trial {trial} launch {launch}"
        if result.startswith("error"):
            self.violations.append(f"{where}: restore failed: {result}")
        elif result.startswith("failed") and not injected and "SIGKILL" not in result:
            self.violations.append(f"{where}: the run failed without an injected fault: {result}")
        manifest = read_manifest(path)
        if manifest is None:
            return
        new = manifest["attempts"][attempts_before:]
        for previous, attempt in zip([None, *new][:len(new)], new, strict=True):
            jit = attempt.get("jit_checkpoint")
            if jit:
                self.counts["jit: saved" if jit["iteration"] else "jit: fell back"] += 1
                if attempt.get("preempted") and jit["iteration"]:
                    self.counts["preempted: saved just in time"] += 1
                elif attempt.get("preempted"):
                    self.counts[f"preempted: fell back: {re.sub(r'[0-9]+', 'N', jit['why_not'])}"] += 1
            if attempt["status"] == "RESIZED":
                self.counts["resizes"] += 1
            if attempt["status"] == "PREEMPTED":
                went_on = attempt is not new[-1]
                self.counts["preempted: went on" if went_on else "preempted: ended the launch"] += 1
            if attempt.get("in_place"):
                self.check_in_place(path, log, previous, attempt, where)
                after = (previous or {}).get("error") or ""
                self.counts["in place: after a lost node"] += "with its node" in after
            if IN_PLACE[0] and "with its node" in (attempt.get("error") or ""):
                self.counts["in place: attempts lost with a node"] += 1
                if jit and not jit["iteration"]:  # why the next attempt could not stay in place
                    why = re.sub(r"[0-9]+", "N", jit["why_not"])
                    self.counts[f"in place: not after a lost node: {why}"] += 1
            killed = (attempt.get("hang") or {}).get("killed", [])
            if killed:
                self.counts["in place: frozen ranks killed alone"] += len(killed)
        # Within a launch only an elastic resize starts another attempt (max_failures is 0); it
        # resumes from the checkpoint it asked for, the newest committed at its start.
        if new and new[0]["resumed_from"] != before:
            self.violations.append(f"{where}: attempt {new[0]['number']} resumed from "
                                   f"{new[0]['resumed_from']}, the newest committed was {before}")
        # --in-place: max_failures 2; a preemption (a drained node) is not a failure
        going_on = ("RESIZED", "PREEMPTED", "ERRORED") if IN_PLACE[0] else ("RESIZED", "PREEMPTED")
        if any(a["status"] not in going_on for a in new[:-1]):
            self.violations.append(f"{where}: a launch went on after an attempt that was not a resize: "
                                   f"{[a['status'] for a in new]}")
        for entry in read_log(log):
            if entry["loaded"] == "peer":  # checked against the attempt record (check_in_place)
                self.counts["in place: loops that stayed"] += bool(entry.get("in_loop")) and \
                    entry["attempt"] > attempts_before
                continue
            first = entry["attempt"] == attempts_before + 1
            if entry["attempt"] > attempts_before and ((first and entry["loaded"] != before)
                                                       or not entry["intact"]):
                self.violations.append(f"{where}: the loop loaded {entry} (expected {before}, intact)")

    def check_in_place(self, path: str, log: str, previous: dict | None, attempt: dict, where: str) -> None:
        """An attempt that recovered in place resumed from the last round the attempt before it
        completed, read nothing from storage, and its loop got that round's state."""
        self.counts["in place: recoveries"] += 1
        self.counts["in place: recoveries of a for_each_batch loop"] += loops_stay(log)
        self.counts["in place: ranks replaced"] += len(attempt["in_place"]["replaced"])
        self.counts["in place: ranks dropped (shrunk)"] += len(attempt["in_place"].get("dropped", []))
        rows = [r for r in read_rows(Storage.from_url(path))
                if previous is not None and r.get("attempt") == previous["number"]]
        last = max((r["training_iteration"] for r in rows), default=None)
        if attempt["in_place"]["iteration"] != last or attempt["resumed_from"] is not None:
            self.violations.append(f"{where}: attempt {attempt['number']} recovered in place as "
                                   f"{attempt['in_place']} (resumed from {attempt['resumed_from']}), and the "
                                   f"attempt before it completed round {last} last")
        loaded = [e for e in read_log(log) if e["attempt"] == attempt["number"]]
        first = [e["iteration"] for e in loaded if e.get("rank", 0) == 0]  # rank 0's, loop stayed or not
        if attempt["status"] != "ERRORED" and (first != [last] or {e["iteration"] for e in loaded} != {last}):
            self.violations.append(f"{where}: attempt {attempt['number']} recovered in place from round "
                                   f"{last}, and its loop logged {loaded}")

    def check_reported_round(self, path: str, before: str | None, fault: str, attempts_before: int,
                             where: str) -> None:
        """Every rank sent report n of this launch, and then one rank or all of them died: that
        round is on record, and committed when it carried a checkpoint."""
        iteration = (commit.iteration_of(before) if before else 0) + int(fault.split(":")[1])
        attempt = attempts_before + 1
        every = read_rows(Storage.from_url(path))
        rows = [r for r in every if r.get("attempt") == attempt]
        if iteration not in [r["training_iteration"] for r in rows]:
            seen = [(r.get("attempt"), r.get("training_iteration")) for r in every]
            storage = Storage.from_url(path)
            stored = f"{storage.size(RESULT_JSON)} bytes" if storage.exists(RESULT_JSON) else "missing"
            self.violations.append(f"{where}: every rank reported iteration {iteration}, then "
                                   f"{fault} struck, but its row was lost (expected in attempt "
                                   f"{attempt}; rows as (attempt, iteration): {seen}; "
                                   f"{RESULT_JSON} {stored}; run.json has {_attempt_count(path)} attempts)")
        committed = newest_committed(path, self.violations)
        # A background write dies with its process; a rank that raises finishes it first.
        durable = not ASYNC_SAVES[0] or fault.split(":")[2] == "raise"
        one_rank = fault.split(",")[0].split(":")[3:4] not in ([], [""])
        after = (read_manifest(path) or {}).get("attempts", [])[attempts_before + 1:attempts_before + 2]
        if IN_PLACE[0] and after:
            # The launch went on (max_failures 2). One rank struck: the other, clean since report
            # n, stays and the next attempt resumes from round n in place (after the last report
            # the other finishes instead, and the run resumes from its final checkpoint). Every
            # rank struck: no rank holds round n (the fault strikes before a rank's state tracks
            # the report), and the next attempt resumes from checkpoint n when round n carried one.
            resumed = after[0].get("in_place") or {}
            struck = read_struck(os.path.join(self.workdir, "faults"))
            self.counts["in place: killed while the state was sent"] += "during_peer_share" in struck
            if one_rank and iteration < ITERATIONS and resumed.get("iteration") != iteration:
                failed = (read_manifest(path) or {}).get("attempts", [])[attempts_before]
                why = {k: failed.get(k) for k in ("error", "hang", "jit_checkpoint")}
                self.violations.append(f"{where}: every rank reported iteration {iteration}, then {fault} "
                                       f"struck one rank, and the next attempt is {after} (expected in "
                                       f"place from round {iteration}); the struck attempt: {why}")
            if (not one_rank and iteration % CKPT_EVERY == 0 and durable
                    and after[0]["resumed_from"] != commit.checkpoint_name(iteration)):
                self.violations.append(f"{where}: every rank reported iteration {iteration} with a "
                                       f"checkpoint, then {fault} struck, and the next attempt resumed "
                                       f"from {after[0]['resumed_from']}")
            return
        if JIT[0] and not IN_PLACE[0] and one_rank and iteration % CKPT_EVERY and WORKERS[0] > 1:
            # One rank struck right after report n: the survivor saves round n just in time,
            # unless it was killed while saving, which must leave round n uncommitted (a single
            # rank has no survivor).
            saver_killed = "during_jit_save" in read_struck(os.path.join(self.workdir, "faults"))
            self.counts["kills at during_jit_save"] += saver_killed
            if saver_killed == (committed == commit.checkpoint_name(iteration)):
                self.violations.append(f"{where}: every rank reported iteration {iteration}, then {fault} "
                                       f"struck one rank{' and the saver' if saver_killed else ''}, "
                                       f"and the newest committed checkpoint is {committed}")
        if iteration % CKPT_EVERY == 0 and durable and committed != commit.checkpoint_name(iteration):
            self.violations.append(f"{where}: every rank reported iteration {iteration} with a "
                                   f"checkpoint, then {fault} struck, but the newest committed "
                                   f"checkpoint is {committed}")

    def check_finished(self, path: str, trial: int, launches: int) -> None:
        self.counts["trials"] += 1
        where = f"trial {trial}"
        left = leftovers(path)
        if left:
            self.violations.append(f"{where}: leftovers after the run finished: {left}")
        result = Result.from_path(path)
        rows = _timeline(path)
        iterations = [row["training_iteration"] for row in rows]
        # Elastic: another number of workers changes only the order of the float sums.
        same = (lambda a, b: torch.allclose(a, b, rtol=1e-4, atol=1e-6)) if ELASTIC[0] else torch.equal
        if iterations != list(range(1, ITERATIONS + 1)):
            self.violations.append(f"{where}: timeline is {iterations}")
        elif RESIZE[0]:
            self.check_epochs(rows, launches, where)
        elif not same(torch.tensor([row["loss"] for row in rows]), torch.tensor(self.reference_losses)):
            self.violations.append(f"{where}: losses differ from the uninterrupted run")
        elif [row.get("ids") for row in rows] != self.reference_ids:
            self.violations.append(f"{where}: a rank's sample sequence differs from the uninterrupted run")
        weights = self.final_weights(result)
        if RESIZE[0]:  # other sizes take other batches: only the data is compared
            weights = self.reference_weights = {}
        if weights.keys() != self.reference_weights.keys() or not all(
                same(weights[k], self.reference_weights[k]) for k in weights):
            self.violations.append(f"{where}: final weights differ from the uninterrupted run")
        if (read_manifest(path) or {}).get("status") != "FINISHED":
            self.violations.append(f"{where}: run.json does not say FINISHED")
        if not JIT[0]:
            self.check_validations(path, where)
        Storage.from_url(path.rsplit("/", 1)[0]).remove("")


    def check_epochs(self, rows: list[dict], launches: int, where: str) -> None:
        """--resize: each epoch's kept rows train on each example once at most, and lose fewer
        than 3 examples a launch (a carry's short last batch); the last, unfinished epoch only
        once at most."""
        epochs: dict[int, list[int]] = {}
        for row in rows:
            epochs.setdefault(row["epoch"], []).extend(i for rank in row["ids"] for i in rank)
        for epoch, ids in sorted(epochs.items()):
            lost = sorted(set(range(HF_ROWS)) - set(ids))
            if len(ids) != len(set(ids)):
                self.violations.append(f"{where}: epoch {epoch} trained on an example twice: {ids}")
            elif epoch < max(epochs) and len(lost) > 2 * launches:
                self.violations.append(f"{where}: epoch {epoch} lost {lost} in {launches} launches")
            self.counts["examples lost to a carry's last batch"] += len(lost) if epoch < max(epochs) else 0

    def check_time(self, path: str, launches: int, where: str) -> None:
        """Where the finished run's time went adds up after every kill: each fit() (at most
        one per launch) is cut, without gaps or overlaps, from its start to its last attempt's
        end (a killed driver's attempt ends at its last row); each kept row is productive
        once, each dropped row redone once; nothing is negative."""
        storage = Storage.from_url(path)
        attempts = [dataclasses.asdict(a) for a in manifest_mod.load(storage).attempts]
        rows = read_rows(storage)
        spent = goodput.of_run(attempts, rows)
        fits: dict[float, float] = {}
        for a in attempts:
            mine = [r["timestamp"] for r in rows if r.get("attempt") == a["number"]]
            ended = a["ended_at"] if a["status"] != "ABORTED" else None
            end = max([a["started_at"], *mine] + ([ended] if ended else []))
            fits[a["fit_started_at"]] = max(fits.get(a["fit_started_at"], end), end)
        wall = sum(end - start for start, end in fits.items())
        kinds = Counter(s.kind for s in spent.segments)
        kept = len(timeline(rows))
        gaps = [b.start - a.end for a, b in zip(spent.segments, spent.segments[1:], strict=False)]
        problems = []
        if not 1 <= len(fits) <= launches:
            problems.append(f"{len(fits)} fit() starts recorded in {launches} launches")
        if abs(spent.wall_s - wall) > 1e-6:
            problems.append(f"wall time {spent.wall_s:.3f} s, its fit() spans add up to {wall:.3f} s")
        if kinds[goodput.PRODUCTIVE] != kept or kinds[goodput.REDONE] != len(rows) - kept:
            problems.append(f"{kinds[goodput.PRODUCTIVE]} productive and {kinds[goodput.REDONE]} redone "
                            f"stretches for {kept} kept and {len(rows) - kept} dropped rows")
        if any(g < -1e-9 for g in gaps) or sum(g > 1e-9 for g in gaps) > len(fits) - 1:
            problems.append("the stretches overlap, or leave a gap within a fit()")
        if problems:
            self.violations.append(f"{where}: where the time went: {'; '.join(problems)}")
        self.counts["time checked"] += 1

    def check_validations(self, path: str, where: str) -> None:
        """Every kept checkpoint of a finished run was validated, on its own intact files (or its
        validation process was among the processes a kill-worker launch killed), and recorded."""
        storage = Storage.from_url(path)
        for name in commit.scan(storage)[0]:
            marker = commit.read_marker(storage, name)
            record = validation_record.read(storage, name)
            if marker.validation is None or record is None:
                self.violations.append(f"{where}: {name} has no validation record ({marker.validation})")
            elif record.status == validation_record.VALIDATED:
                self.counts["validations recorded"] += 1
                if record.metrics != {"val_iteration": marker.iteration, "val_intact": True}:
                    self.violations.append(f"{where}: {name} validated as {record.metrics}")
            elif "validation process died" in record.error:
                self.counts["validations killed"] += 1
            else:
                self.violations.append(f"{where}: {name}'s validation is {record.status}: {record.error}")


def _timeline(path: str) -> list[dict]:
    # Not Result.metrics_dataframe: pandas starts threads, and this process forks drivers.
    return timeline(read_rows(Storage.from_url(path)))


def _attempt_count(path: str) -> int:
    return len((read_manifest(path) or {}).get("attempts", []))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError:
        return []


class SmallDisk:
    """A tmpfs whose size the harness sets: to what is in use plus a little, so that it fills
    up during the next launch, and back to plenty afterwards."""

    ROOMY = 1 << 30

    def __init__(self, path: str) -> None:
        self.path = path

    @classmethod
    def mount(cls, path: str) -> SmallDisk | None:
        os.makedirs(path, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={cls.ROOMY}", "tmpfs", path],
                              capture_output=True)
        return cls(path) if done.returncode == 0 else None

    def _resize(self, size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", self.path], check=True, capture_output=True)

    def leave_free(self, free: int) -> None:
        st = os.statvfs(self.path)
        # At least a page: a tmpfs of size 0 has no limit (and cannot get one back).
        self._resize(max((st.f_blocks - st.f_bfree) * st.f_frsize + free, st.f_frsize))

    def grow(self) -> None:
        self._resize(self.ROOMY)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", self.path], capture_output=True)


class RayCluster:
    """A local Ray cluster of `nodes` one-CPU nodes in a process of its own (tools/ray_cluster.py):
    this process forks its drivers, so it must not hold Ray's threads. Drivers find it through
    RAY_ADDRESS."""

    def __init__(self, nodes: int = 2) -> None:
        server = os.path.join(os.path.dirname(__file__), "ray_cluster.py")
        self.proc = subprocess.Popen([sys.executable, server, str(nodes)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.address = self.proc.stdout.readline().split()[1]
        self.nodes = nodes

    def _ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().split()[1]

    def lose_node(self, pid: str | None = None) -> str:
        """Remove a node without warning (the one running process `pid` if given) and add a
        replacement; returns the lost node's id ("-": no node runs `pid`)."""
        return self._ask(f"lose {pid}" if pid else "lose")

    def remove_node(self, pid: str | None = None) -> str:
        """Remove a node without warning (the one running process `pid` if given), and no
        replacement; returns its id ("-": no node runs `pid`)."""
        lost = self._ask(f"remove {pid}" if pid else "remove")
        self.nodes -= lost != "-"
        return lost

    def add_node(self) -> str:
        self.nodes += 1
        return self._ask("add")

    def drain(self, pid: int, seconds: float) -> str:
        """Drain the node running process `pid` for preemption, `seconds` ahead; returns its id
        ("-": no node runs `pid`)."""
        return self._ask(f"drain {pid} {seconds}")

    def reclaim(self, node_id: str) -> None:
        """The deadline of a drain: the node goes, a replacement joins."""
        self._ask(f"reclaim {node_id}")

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


@contextlib.contextmanager
def ray_cluster(wanted: bool, nodes: int = 2) -> Iterator[RayCluster | None]:
    if not wanted:
        yield None
        return
    cluster = RayCluster(nodes)
    os.environ["RAY_ADDRESS"] = cluster.address  # the drivers' engine="auto" picks Ray
    try:
        yield cluster
    finally:
        os.environ.pop("RAY_ADDRESS", None)
        cluster.close()


@contextlib.contextmanager
def local_disk(workdir: str, wanted: bool) -> Iterator[SmallDisk | None]:
    disk = SmallDisk.mount(os.path.join(workdir, "disk")) if wanted else None
    try:
        yield disk
    finally:
        if disk is not None:
            disk.unmount()


@contextlib.contextmanager
def s3_server(wanted: bool) -> Iterator[str | None]:
    """A moto S3 server on loopback with a bucket; yields the runs' s3:// root (None if not wanted)."""
    if not wanted:
        yield None
        return
    server = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "s3_server.py")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().split()[1]
        os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                          AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
        Storage.from_url("s3://crash-harness").makedirs()
        yield "s3://crash-harness/runs"
    finally:
        server.stdin.close()
        server.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", action="store_true", help="print the counts as one JSON object")
    parser.add_argument("--s3", action="store_true",
                        help="keep the runs on an S3-compatible server (moto) started on loopback")
    parser.add_argument("--max-kills", type=int, default=MAX_KILLS,
                        help=f"faults per trial at most (default {MAX_KILLS})")
    parser.add_argument("--preempt", action="store_true",
                        help="--jit, beginning each trial with a preemption notice at a random moment: "
                             f"SIGTERM to the driver with a {PREEMPT_GRACE_S:.0f} s grace, half the time "
                             "while every rank is in a long step; SIGKILL at the deadline (with --ray: "
                             f"a drain of a rank's node, {DRAIN_S:.0f} s ahead, which goes then)")
    parser.add_argument("--strike", action="store_true",
                        help="begin each trial with a fault that always strikes (a rank dying "
                             "right after a report), then random ones")
    parser.add_argument("--async", dest="async_saves", action="store_true",
                        help="the loop's checkpoints are written in the background (ASYNC upload)")
    parser.add_argument("--in-place", action="store_true",
                        help="--jit, with FailureConfig(recovery='in_place', max_failures=2): a rank "
                             "struck after a report is started again while the others keep their processes")
    parser.add_argument("--jit", action="store_true",
                        help="the loop keeps its state in a TrainState with just-in-time checkpoints")
    parser.add_argument("--data", action="store_true",
                        help="--jit, with the loop reading a per-rank stream (torchdata's StatefulDataLoader "
                             "over a stateful IterableDataset, one worker process prefetching)")
    parser.add_argument("--resize", action="store_true",
                        help="--data over a Hugging Face stream, each launch on 1, 2 or 3 workers")
    parser.add_argument("--ray", action="store_true",
                        help="run the workers on a local 2-node Ray cluster (the Ray engine)")
    parser.add_argument("--sweep", action="store_true",
                        help="kill a population-based training sweep's driver instead "
                             "(tools/sweep_harness.py)")
    parser.add_argument("--hyperband", action="store_true",
                        help="with --sweep: a synchronous HyperBand sweep instead of PBT")
    parser.add_argument("--class", dest="class_", action="store_true",
                        help="with --sweep: class trainables with checkpoint_at_end instead of PBT")
    parser.add_argument("--reuse", action="store_true",
                        help="with --sweep: launches with reuse_actors=True at random, idle processes killed")
    parser.add_argument("--elastic", action="store_true",
                        help="an elastic run, num_workers=(2, 3), on a local 3-node Ray cluster that "
                             "loses nodes for good and gets them back among the faults")
    args = parser.parse_args(argv)
    if args.sweep:
        import sweep_harness

        return sweep_harness.main(["--trials", str(args.trials), *(["--json"] if args.json else []),
                                   *(["--hyperband"] if args.hyperband else []),
                                   *(["--class"] if args.class_ else []),
                                   *(["--reuse"] if args.reuse else []),
                                   *(["--seed", str(args.seed)] if args.seed is not None else [])])
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 30)
    ASYNC_SAVES[0] = args.async_saves
    JIT[0] = args.jit or args.in_place or args.data or args.preempt or args.resize
    PREEMPT[0] = args.preempt
    DATA[0] = RESIZE[0] = args.resize
    DATA[0] = DATA[0] or args.data
    IN_PLACE[0] = args.in_place
    ELASTIC[0] = args.elastic
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="unbroken-crash-") as workdir, s3_server(args.s3) as root, \
            local_disk(workdir, not args.s3) as disk, \
            ray_cluster(args.ray or args.elastic, 3 if args.elastic else 2) as cluster:
        harness = Harness(seed, workdir, root or (disk.path if disk else workdir), disk, cluster, args.strike,
                          args.max_kills)
        harness.reference()
        for i in range(args.trials):
            seen = len(harness.violations)
            harness.trial(i)
            if not args.json:
                for v in harness.violations[seen:]:
                    print("\nVIOLATION:", v)
                print(f"\rtrial {i + 1}/{args.trials}, violations: {len(harness.violations)}",
                      end="", flush=True)
    counts = dict(sorted(harness.counts.items()))
    report = {"seed": seed, "seconds": round(time.monotonic() - started, 1), **counts,
              "violations": harness.violations}
    if args.json:
        print(json.dumps(report))
    else:
        print()
        width = max(len(k) for k in report)
        for key, value in report.items():
            shown = len(value) if key == "violations" else value
            print(f"{key:<{width}}  {shown}")
    return 1 if harness.violations else 0


if __name__ == "__main__":
    sys.exit(main())
