"""What the recovery benchmarks' jobs share (_ray_job.py, _elastic_job.py): notes for the
benchmark, and the tiny DDP job's resume and report, for Ray Train or unbroken (the caller
passes its `train` module and `Checkpoint` class)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import torch


def note(work: str, name: str, data: dict) -> None:
    """Write `data` to `<work>/<name>` atomically, for the benchmark to read."""
    path = os.path.join(work, name)
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


def resume(train: Any, model: Any, opt: Any, jit: bool) -> tuple[int, Any]:
    """(the iteration to continue after, the TrainState with just-in-time checkpoints or None)."""
    if jit:
        from unbroken.train.torch import TrainState

        state = TrainState(model=model, optimizer=opt, iteration=0, jit_checkpoint=True, step_seed=0)
        state.restore()
        return state.iteration, state
    checkpoint = train.get_checkpoint()
    if checkpoint is None:
        return 0, None
    with checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "state.pt"), weights_only=True)["iteration"], None


def report(train: Any, checkpoint_cls: Any, state: Any, it: int, loss: float, checkpoint: bool,
           rank: int) -> None:
    """Report iteration `it`: through the TrainState, or with rank 0's checkpoint when `checkpoint`."""
    if state is not None:
        state.iteration = it
        state.report({"loss": loss}, checkpoint=checkpoint)
    elif checkpoint and rank == 0:
        with tempfile.TemporaryDirectory() as d:
            torch.save({"iteration": it}, os.path.join(d, "state.pt"))
            train.report({"loss": loss}, checkpoint=checkpoint_cls.from_directory(d))
    else:
        train.report({"loss": loss})


def fit_timed(classes: tuple[Any, Any, Any, Any], loop: Any, config: dict, scaling: dict, work: str) -> None:
    """Build the job's trainer from `classes` (TorchTrainer, ScalingConfig, RunConfig,
    FailureConfig of Ray Train or unbroken), restarting after every failure, run fit() and
    print "RESULT {"fit_s": ...}" for the benchmark."""
    trainer_cls, scaling_cls, run_cls, failure_cls = classes
    trainer = trainer_cls(loop, train_loop_config=config, scaling_config=scaling_cls(**scaling),
                          run_config=run_cls(name="bench", storage_path=os.path.join(work, "storage"),
                                             failure_config=failure_cls(max_failures=-1)))
    t_fit = time.time()
    trainer.fit()
    print("RESULT " + json.dumps({"fit_s": time.time() - t_fit}), flush=True)
