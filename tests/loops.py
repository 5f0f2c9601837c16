"""Training functions and helpers shared by the tests (importable, so saved by reference)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import threading
import time

import torch

from unbroken import train
from unbroken.train import Checkpoint
from unbroken.train.torch import prepare_model


def make_data(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1
    return x[rank::world_size], y[rank::world_size]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def linear_loop(config: dict) -> None:
    """A real DDP job: one SGD step per iteration, a checkpoint every `ckpt_every` iterations.

    Fault knobs (all optional): fail_at=(iteration, attempt) raises on rank 1;
    kill_worker_at=(iteration, attempt) SIGKILLs rank 1; hang_at=(iteration, attempt) blocks rank 1
    forever, or with `hang_by_sigstop` stops its process (SIGSTOP; after a SIGCONT it goes on),
    after writing its pid to the file `hang_marker`, if given; print progress lines with `echo`;
    on_request: also checkpoint when asked to; rank_files: every rank's checkpoint holds a
    file rank<r>.json saying its attempt and iteration (rank 0's also holds the state);
    signal_at=(iteration, attempt), or a list of such: rank 0 writes "<iteration>" to the FIFO
    `signal_marker` after that report and goes on; step_s: each step takes at least this long (a
    slower model).
    """
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    checkpoint = train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        _unwrap(model).load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["iteration"]
    x, y = make_data(rank, world)
    for it in range(start + 1, config["iterations"] + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if tuple(config.get("fail_at") or ()) == (it, ctx.get_attempt()) and rank == world - 1:
            raise RuntimeError(f"injected failure at iteration {it}")
        if tuple(config.get("kill_worker_at") or ()) == (it, ctx.get_attempt()) and rank == world - 1:
            if config.get("kill_marker"):
                with open(config["kill_marker"], "w") as f:
                    f.write(repr(__import__("time").time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if tuple(config.get("hang_at") or ()) == (it, ctx.get_attempt()) and rank == world - 1:
            if config.get("hang_marker"):
                with open(config["hang_marker"], "w") as f:
                    f.write(str(os.getpid()))
            if config.get("hang_by_sigstop"):  # a frozen machine: nothing runs until SIGCONT
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                threading.Event().wait()  # a stuck rank: the others block in the next allreduce
        metrics = {"loss": loss.item(), "it": it}
        # should_checkpoint() is true on every rank for the same report (asked on preemption).
        asked = config.get("on_request") and ctx.should_checkpoint()
        if (it % config.get("ckpt_every", 2) == 0 or asked) and (rank == 0 or config.get("rank_files")):
            with tempfile.TemporaryDirectory() as d:
                if rank == 0:
                    torch.save({"model": _unwrap(model).state_dict(), "optimizer": opt.state_dict(),
                                "iteration": it}, os.path.join(d, "state.pt"))
                if config.get("rank_files"):
                    with open(os.path.join(d, f"rank{rank}.json"), "w") as f:
                        f.write(f'{{"attempt": {ctx.get_attempt()}, "iteration": {it}}}')
                train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            train.report(metrics)
        if config.get("echo") and rank == 0:
            print(f"REPORTED {it}", flush=True)
        signal_at = config.get("signal_at") or ()
        nested = signal_at and isinstance(signal_at[0], (list, tuple))
        pairs = [tuple(p) for p in signal_at] if nested else [tuple(signal_at)]
        if (it, ctx.get_attempt()) in pairs and rank == 0:
            with open(config["signal_marker"], "w") as f:
                f.write(str(it))
        if config.get("step_s"):
            time.sleep(config["step_s"])
        if config.get("block_fifo") and rank == 0 and it == config.get("block_at", 1):
            print("BLOCKING", flush=True)
            with open(config["block_fifo"]) as f:
                f.read()


def simple_loop(config: dict) -> None:
    """No torch.distributed needed: reports `iterations` rows, checkpointing every `ckpt_every`.

    Knobs: fail_at=iteration raises in attempt 1; bad_metric reports a tensor; uneven makes
    rank 0 report one extra time at the end; ran: a file each rank appends each iteration it
    begins to."""
    start = 0
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d, open(os.path.join(d, "it.txt")) as f:
            start = int(f.read())
    ctx = train.get_context()
    for it in range(start + 1, config.get("iterations", 4) + 1):
        if config.get("ran"):  # a file that lists each iteration each rank began
            with open(config["ran"], "a") as f:
                f.write(f"{ctx.get_world_rank()}:{it}\n")
        if it == config.get("fail_at") and ctx.get_attempt() == 1:
            raise RuntimeError(f"injected failure at iteration {it}")
        if config.get("bad_metric"):
            train.report({"loss": torch.ones(2)})
        if config.get("score"):
            score = config["score"][it - 1]
        else:
            score = it
        if it % config.get("ckpt_every", 1) == 0:
            with tempfile.TemporaryDirectory() as d:
                rank = train.get_context().get_world_rank()
                with open(os.path.join(d, f"rank{rank}.txt" if config.get("per_rank") else "it.txt"),
                          "w") as f:
                    f.write(str(it))
                train.report({"score": score, "it": it}, checkpoint=Checkpoint.from_directory(d))
        else:
            train.report({"score": score, "it": it})
    if config.get("uneven") and ctx.get_world_rank() == 0:
        train.report({"final": True})  # a rank-0-only report: not collective


def must_not_run(config: dict) -> None:
    raise AssertionError("training should not have run")


def device_loop(config: dict) -> None:
    """One report saying where the model went and which process group the rank joined."""
    from unbroken.train.torch import get_device

    model = prepare_model(torch.nn.Linear(4, 1))
    train.report({"device": str(get_device()), "backend": torch.distributed.get_backend(),
                  "param_device": str(next(model.parameters()).device)})


def final_weights(result) -> dict:
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "state.pt"), weights_only=True)["model"]


REBUILDS = {"count": 0, "dead": False}


class Handle:
    """Pickles fine, but unpickling fails once its 'cluster' is gone (REBUILDS['dead'])."""

    def __init__(self, token: str = "cluster-1") -> None:
        self.token = token

    def __reduce__(self):
        return (_rebuild_handle, (self.token,))


def _rebuild_handle(token: str) -> Handle:
    REBUILDS["count"] += 1
    if REBUILDS["dead"] or os.environ.get("HANDLE_DEAD"):
        raise ConnectionError(f"cluster for handle {token} is gone")
    return Handle(token)


class AugmentedDataset(torch.utils.data.Dataset):
    """A regression set whose __getitem__ augments each sample with torch, python and numpy
    randomness, and returns the sample's index so tests can see the data order."""

    def __init__(self, n: int = 48, dim: int = 8) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x @ torch.linspace(-1, 1, dim).unsqueeze(1) + 0.1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        import random

        x = self.x[i] * (1.0 + 0.1 * random.random()) + 0.05 * torch.randn(self.x.shape[1])
        try:
            import numpy as np

            x = x + float(np.random.uniform(-0.05, 0.05))
        except ImportError:
            pass
        return x, self.y[i], i


def seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def _die(mode: str, step: int) -> None:
    if mode == "raise":
        raise RuntimeError(f"injected failure at step {step}")
    if mode == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGSTOP if mode == "sigstop" else signal.SIGKILL)


def sgd_step(model, opt, sched, x, y) -> torch.Tensor:
    """One step of the exact loops: the MSE loss, backward, the optimizer's and the scheduler's
    step. Returns the loss."""
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss


def jit_options(step_seed: int | None) -> dict:
    """TrainState's options for just-in-time checkpoints, with `step_seed` unless it is None."""
    return {"jit_checkpoint": True, **({"step_seed": step_seed} if step_seed is not None else {})}


def exact_loop(config: dict) -> None:
    """A DDP job with dropout, augmentation in the dataset, AdamW and a per-step scheduler, whose
    whole state is a TrainState checkpointed every `ckpt_every` steps (mid-epoch too).

    Reports every rank's loss and batch indices each step, and a last row with a final
    checkpoint. Faults: kill_at=[[step, attempt, rank, mode], ...], mode raise|exit|sigkill;
    preempt_at=[step, attempt] has rank 0 send SIGTERM to the driver (`driver_pid`);
    `echo` prints "STEP n" on rank 0 after each step's report; `async_save` saves in the
    background (TrainState(checkpoint_upload_mode="ASYNC")), `report_upload_mode` names each
    report's. `jit`: just-in-time checkpoints and per-step random streams (`step_seed`, 7 by
    default; None: the run's own seed), with
    die_after_report=[[step, attempt, rank, mode], ...] (mode raise|sigkill|sigstop|hang) striking
    right after that step's report, before the next step begins. `pid_dir`: each rank writes
    its process id to rank<r>-a<attempt> there. `deterministic`: deterministic algorithms only.
    `step_s`: seconds each step takes longer; `slow_after=[step, attempt, seconds]`: every rank
    then sleeps that long after that step's report (rank 0 prints "SLOW n" first);
    `preemption_log`: each rank appends (step, train.get_preemption_info()) there. `in_loop`:
    the loop is TrainState.for_each_batch, and `pid_dir` also gets each step's process and
    objects (`steps_run`). `prologue_barrier`: a barrier before the loop.
    """
    from unbroken.train.torch import TrainState, prepare_data_loader

    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if config.get("deterministic"):  # on a GPU (docs/exact-resume.md: CUBLAS_WORKSPACE_CONFIG is set)
        torch.use_deterministic_algorithms(True)
    # Per-rank random streams (DDP broadcasts rank 0's initial weights).
    seed_everything(100 + rank)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                              torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    data = torch.utils.data.DataLoader(AugmentedDataset(config.get("samples", 48)),
                                       batch_size=config.get("batch_size", 4), shuffle=True,
                                       num_workers=config.get("num_workers", 0),
                                       persistent_workers=config.get("persistent_workers", False))
    loader = prepare_data_loader(data, seed_per_sample=config.get("seed_per_sample"))
    state = TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader, epoch=0, step=0,
                       best=None, checkpoint_upload_mode="ASYNC" if config.get("async_save") else "SYNC",
                       **(jit_options(config.get("step_seed", 7)) if config.get("jit") else {}))
    state.restore()
    if config.get("pid_dir"):  # which process ran this rank in this attempt
        with open(os.path.join(config["pid_dir"], f"rank{rank}-a{ctx.get_attempt()}"), "w") as f:
            f.write(str(os.getpid()))
    kills = [tuple(k) for k in config.get("kill_at", [])]

    def step(batch) -> None:
        x, y, idx = batch
        ctx = train.get_context()
        if config.get("pid_dir"):  # which processes and objects ran each step
            fetching = loader._loader._iterator  # a persistent DataLoader's, with its worker processes
            workers = [w.pid for w in fetching._workers] if fetching is not None else []
            with open(os.path.join(config["pid_dir"], f"rank{rank}-steps"), "a") as f:
                f.write(f"{ctx.get_attempt()} {state.step + 1} {os.getpid()} {id(model)} {id(opt)} "
                        f"{' '.join(map(str, workers))}\n")
        loss = sgd_step(model, opt, sched, x, y)
        state.step += 1
        state.best = loss.item() if state.best is None else min(state.best, loss.item())
        for at, attempt, kill_rank, mode in kills:
            if (at, attempt, kill_rank) == (state.step, ctx.get_attempt(), rank):
                _die(mode, at)
        if config.get("preempt_at") == [state.step, ctx.get_attempt()] and rank == 0:
            os.kill(config["driver_pid"], signal.SIGTERM)
        mine = [loss.item(), idx.tolist()]
        every = [mine]
        if world > 1:
            every = [None] * world
            torch.distributed.all_gather_object(every, mine)
        state.report({"loss": loss.item(), "losses": [e[0] for e in every], "epoch": epoch,
                      "step": state.step, "indices": [e[1] for e in every]},
                     checkpoint=state.step % config.get("ckpt_every", 4) == 0,
                     checkpoint_upload_mode=config.get("report_upload_mode"))
        for at, attempt, kill_rank, mode in config.get("die_after_report", []):
            if (at, attempt, kill_rank) == (state.step, ctx.get_attempt(), rank):
                if mode == "hang" and config.get("hang_marker"):  # where it hangs, on Ray
                    import ray

                    with open(config["hang_marker"], "w") as f:
                        f.write(ray.get_runtime_context().get_node_id())
                threading.Event().wait() if mode == "hang" else _die(mode, at)
        if config.get("preemption_log"):
            info = train.get_preemption_info()
            with open(config["preemption_log"], "a") as f:
                told = info and [info.deadline_ms, info.preempted_ranks]
                f.write(json.dumps([rank, state.step, told]) + "\n")
        if config.get("echo") and rank == 0:
            print(f"STEP {state.step}", flush=True)
        if config.get("slow_after", [0, 0])[:2] == [state.step, ctx.get_attempt()]:
            if rank == 0:
                print(f"SLOW {state.step}", flush=True)
            time.sleep(config["slow_after"][2])
        time.sleep(config.get("step_s", 0))  # a slower step: the run is still going when a node returns

    if config.get("prologue_barrier") and world > 1:  # a collective of its own before the loop
        torch.distributed.barrier()
    for epoch in range(state.epoch, config["epochs"]):
        if config.get("in_loop"):  # survivors of a failure keep this loop (TrainState.for_each_batch)
            state.for_each_batch(loader, step)
        else:
            for batch in loader:
                step(batch)
        state.epoch = epoch + 1
    state.report({"final": True, "step": state.step}, checkpoint=True)


def steps_run(directory, rank) -> list[tuple[int, ...]]:
    """(attempt, step, pid, id(model), id(optimizer), *DataLoader worker pids) of each step
    rank `rank` began."""
    return [tuple(map(int, line.split())) for line in open(os.path.join(directory, f"rank{rank}-steps"))]


def report_then_die(config: dict) -> None:
    """Every rank reports iteration 1 with a checkpoint file of its own; then the ranks in
    `dying` die (`how`: raise|exit|sigkill) in attempt 1 while the others report once more.
    With `death_fifo` (one dying rank), the others report only once it has died.
    A later attempt checks it resumed from iteration 1 and reports iteration 2."""
    ctx = train.get_context()
    rank = ctx.get_world_rank()
    if ctx.get_attempt() > 1:
        seen = None
        if (checkpoint := train.get_checkpoint()) is not None:
            with checkpoint.as_directory() as d:
                seen = sorted(f for f in os.listdir(d) if f.startswith("rank"))
        train.report({"it": 2, "resumed_with": seen})
        return
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, f"rank{rank}.txt"), "w") as f:
            f.write("1")
        if config.get("death_fifo"):
            _after_the_dying_ranks(config["death_fifo"], rank in config["dying"])
        train.report({"it": 1}, checkpoint=Checkpoint.from_directory(d))
    if rank in config["dying"]:
        _die(config["how"], 1)
    train.report({"it": 2})


_HELD: list = []  # a dying rank's end of the FIFO, open until its process ends


def _after_the_dying_ranks(fifo: str, dying: bool) -> None:
    """A dying rank holds the FIFO open for writing until its process ends (by any death:
    the kernel closes its files); the others read it to the end, which comes at that moment."""
    if dying:
        _HELD.append(open(fifo, "w"))
    else:
        with open(fifo) as f:
            f.read()


def big_checkpoint_loop(config: dict) -> None:
    """Checkpoints every iteration: an iteration counter and `ckpt_bytes` of data per rank."""
    ctx = train.get_context()
    rank = ctx.get_world_rank()
    start = 0
    if (checkpoint := train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as d, open(os.path.join(d, "it.txt")) as f:
            start = int(f.read())
    for it in range(start + 1, config["iterations"] + 1):
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "it.txt"), "w") as f:
                f.write(str(it))
            with open(os.path.join(d, f"data{rank}.bin"), "wb") as f:
                f.write(os.urandom(config["ckpt_bytes"]))
            train.report({"it": it}, checkpoint=Checkpoint.from_directory(d))


def async_gate_loop(config: dict) -> dict:
    """`reports` reports, each with an ASYNC checkpoint whose background write waits until the loop
    has looked at storage after the report returned (and, with `train_state`, changed the
    model it saves; with `remove_reported`, removed the directory it reported). Returns (rank
    0) what it saw: its own files of that checkpoint already in the run directory, the
    checkpoints get_all_reported_checkpoints lists, the most writes ever in flight at once,
    whether each reported directory still existed, and the weights at each report."""
    from unbroken.train import CheckpointUploadMode
    from unbroken.train.torch import TrainState
    from unbroken.worker import async_save

    ctx = train.get_context()
    rank = ctx.get_world_rank()
    run = ctx.get_storage().experiment_fs_path
    gates, lock = [threading.Event() for _ in range(config["reports"])], threading.Lock()
    writing, most, started = [0], [0], [0]
    real = async_save.write_rank_files

    def gated(*args, **kwargs):
        with lock:
            gate = gates[started[0]]  # the n-th write is report n's
            started[0] += 1
        gate.wait()
        with lock:
            writing[0] += 1
            most[0] = max(most[0], writing[0])
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                writing[0] -= 1

    async_save.write_rank_files = gated
    model = torch.nn.Linear(2, 1)
    per_report = config.get("train_state") == "report"  # the mode on each report, not the state
    state = TrainState(model=model, checkpoint_upload_mode="SYNC" if per_report else "ASYNC")
    before, kept, weights = [], [], []
    for it in range(1, config["reports"] + 1):
        weights.append(model.weight.detach().clone().tolist())
        if config.get("train_state"):
            state.report({"it": it}, checkpoint=True,
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC if per_report else None)
            with torch.no_grad():
                model.weight.add_(1.0)  # the next step, while the save has not been written yet
        else:
            d = tempfile.mkdtemp()
            with open(os.path.join(d, f"rank{rank}.txt"), "w") as f:
                f.write(str(it))
            train.report({"it": it}, checkpoint=Checkpoint.from_directory(d),
                         checkpoint_upload_mode=CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=not config.get("remove_reported"))
            kept.append(os.path.exists(d))
            if config.get("remove_reported"):  # a mistake: its files are not staged yet
                shutil.rmtree(d)
        before.append(sorted(  # this rank's files of checkpoint `it`, committed or staged
            f"{d}/{f}" for d in os.listdir(run) if d.startswith(f"checkpoint_{it:06d}")
            for f in os.listdir(os.path.join(run, d)) if f"rank{rank}" in f or f == "train_state.pt"))
        gates[it - 1].set()
    reported = [os.path.basename(c.checkpoint.path) for c in train.get_all_reported_checkpoints()]
    return {"before_write": before, "reported": reported, "most_writes_at_once": most[0],
            "kept_local": kept, "weights": weights}
