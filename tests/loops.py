"""Training functions and helpers shared by the tests (importable, so saved by reference)."""

from __future__ import annotations

import os
import signal
import tempfile
import threading

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
    forever; print progress lines with `echo`; on_request: also checkpoint when asked to.
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
            threading.Event().wait()  # a stuck rank: the others block in the next allreduce
        metrics = {"loss": loss.item(), "it": it}
        # should_checkpoint() is true on every rank for the same report (asked on preemption).
        asked = config.get("on_request") and ctx.should_checkpoint()
        if (it % config.get("ckpt_every", 2) == 0 or asked) and rank == 0:
            with tempfile.TemporaryDirectory() as d:
                torch.save({"model": _unwrap(model).state_dict(), "optimizer": opt.state_dict(),
                            "iteration": it}, os.path.join(d, "state.pt"))
                train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            train.report(metrics)
        if config.get("echo") and rank == 0:
            print(f"REPORTED {it}", flush=True)
        if config.get("block_fifo") and rank == 0 and it == config.get("block_at", 1):
            print("BLOCKING", flush=True)
            with open(config["block_fifo"]) as f:
                f.read()


def simple_loop(config: dict) -> None:
    """No torch.distributed needed: reports `iterations` rows, checkpointing every other one."""
    start = 0
    ckpt = train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d, open(os.path.join(d, "it.txt")) as f:
            start = int(f.read())
    for it in range(start + 1, config.get("iterations", 4) + 1):
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


def must_not_run(config: dict) -> None:
    raise AssertionError("training should not have run")


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
