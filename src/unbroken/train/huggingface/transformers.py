"""A Hugging Face `transformers.Trainer` inside `train_loop_per_worker`, with Ray Train's
`ray.train.huggingface.transformers` names.

A Ray script ports by changing its imports::

    from unbroken.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer

`RayTrainReportCallback` reports, each time the Trainer saves a checkpoint, the latest logged
metrics together with that checkpoint, in Ray's layout (`checkpoint_00000N/checkpoint/`). The
Transformers checkpoint already holds everything `trainer.train(resume_from_checkpoint=...)`
needs to go on exactly (weights, optimizer, scheduler, trainer state, each process's random
generators), and the Trainer skips the batches of the epoch it had already trained on, so a run
resumed from it repeats the uninterrupted one. `train_or_resume(trainer)` is that resume in one
call.

Transformers is imported when this module is; `pip install 'unbroken[transformers]'` installs it
with `accelerate`, which its Trainer needs.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

from unbroken import train
from unbroken.errors import UnsupportedOptionError
from unbroken.store.checkpoint import Checkpoint
from unbroken.worker import dataset_shard

try:
    import torch
    import transformers
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ModuleNotFoundError:
    raise ModuleNotFoundError(
        "unbroken.train.huggingface.transformers needs Hugging Face Transformers, which is not "
        "installed. Hint: pip install 'unbroken[transformers]'") from None

__all__ = ["RayTrainReportCallback", "checkpoint_path", "prepare_trainer", "train_or_resume"]

_RNG_FILE = re.compile(r"rng_state_(\d+)\.pth")


def _link_or_copy(src: str, dst: str) -> None:
    """A hard link where the two paths share a filesystem (no bytes copied), else a copy."""
    try:
        os.link(src, dst)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copy2(src, dst)


def _stage_own_files(folder: str, dst: str, rank: int) -> None:
    """Put into `dst` the files of the Transformers checkpoint `folder` that this rank wrote.

    Rank 0 writes the model, optimizer, scheduler and trainer state; every process writes its
    own `rng_state_<rank>.pth`. Each rank attaches only its own files, so no rank reads a
    file that a peer may still be writing (the Trainer has no barrier before `on_save`), and
    ranks on different nodes each contribute theirs.
    """
    def others(directory: str, names: list[str]) -> list[str]:
        if directory != folder:
            return []
        return [n for n in names if (m := _RNG_FILE.fullmatch(n)) and int(m[1]) != rank]

    if rank == 0:
        shutil.copytree(folder, dst, ignore=others, copy_function=_link_or_copy)
        return
    os.makedirs(dst)
    own = f"rng_state_{rank}.pth"
    if os.path.exists(os.path.join(folder, own)):
        _link_or_copy(os.path.join(folder, own), os.path.join(dst, own))


class RayTrainReportCallback(transformers.TrainerCallback):
    """After each checkpoint the Trainer saves, reports the logged metrics (every entry of
    `state.log_history` merged, newest last, as Ray does, with `step` set to the global step)
    and that checkpoint, on every rank (`train.report` is collective).

    The unbroken checkpoint holds the Transformers checkpoint directory::

        checkpoint_00000N/
          checkpoint/         model, optimizer.pt, scheduler.pt, trainer_state.json,
                              rng_state_<rank>.pth (one per process)

    Align the save, log and evaluation steps (e.g. all "epoch", or save_steps a multiple of
    eval_steps) so that the reported metrics belong to the checkpoint they come with.
    """

    CHECKPOINT_NAME = "checkpoint"

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        loader = kwargs.get("train_dataloader")
        if args.world_size > 1 and dataset_shard.whole_of(getattr(loader, "dataset", None)) is not None:
            raise UnsupportedOptionError(
                "the Trainer's train_dataset is a shard of train.get_dataset_shard, which the Trainer "
                "would split again among the ranks (each would train on 1/world² of the data). Hint: "
                "call prepare_trainer(trainer) before training: it gives the Trainer the whole dataset "
                "to share out")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        metrics: dict[str, Any] = {}
        for entry in state.log_history:
            metrics.update(entry)
        metrics["step"] = state.global_step
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        with tempfile.TemporaryDirectory(prefix="unbroken-transformers-") as d:
            checkpoint = None
            if os.path.isdir(folder):
                _stage_own_files(folder, os.path.join(d, self.CHECKPOINT_NAME), args.process_index)
                checkpoint = Checkpoint.from_directory(d)
            train.report(metrics, checkpoint=checkpoint)


def prepare_trainer(trainer: Any) -> Any:
    """Check that a `transformers.Trainer` fits the run it is in; returns it.

    Raises `RuntimeError` when the Trainer sees another world size than the run (it would
    train each rank alone). Warns when nothing would be reported (no `RayTrainReportCallback`,
    or `save_strategy="no"`) and when `ignore_data_skip=True`, which makes a resumed run
    train on batches the interrupted one had already used.

    A `train_dataset` or `eval_dataset` that is a shard of `train.get_dataset_shard` is replaced
    by the dataset it was cut from: the Trainer shares out its datasets among the ranks itself,
    and would split this rank's part again.
    """
    context = train.get_context()
    if trainer.args.world_size != context.get_world_size():
        raise RuntimeError(f"the Trainer sees {trainer.args.world_size} process(es) but the run has "
                           f"{context.get_world_size()}{_why_not_the_run(trainer.args)}")
    trainer.train_dataset = _whole(trainer.train_dataset)
    if isinstance(trainer.eval_dataset, dict):
        trainer.eval_dataset = {name: _whole(d) for name, d in trainer.eval_dataset.items()}
    else:
        trainer.eval_dataset = _whole(trainer.eval_dataset)
    if not any(isinstance(c, RayTrainReportCallback) for c in trainer.callback_handler.callbacks):
        warnings.warn("the Trainer has no RayTrainReportCallback, so it reports no metrics and no "
                      "checkpoints. Hint: trainer.add_callback(RayTrainReportCallback())", stacklevel=2)
    if str(getattr(trainer.args.save_strategy, "value", trainer.args.save_strategy)) == "no":
        warnings.warn("save_strategy='no': the Trainer saves no checkpoint, so nothing is reported and "
                      "a restarted run starts again from step 0", stacklevel=2)
    if trainer.args.ignore_data_skip:
        warnings.warn("ignore_data_skip=True: a resumed run trains on the batches of its current epoch "
                      "again instead of skipping to where it stopped", stacklevel=2)
    return trainer


def _why_not_the_run(args: Any) -> str:
    """Why TrainingArguments see another world than the run, as far as can be told here."""
    cpu_forced = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "y", "yes", "t", "true", "on")
    if getattr(args, "use_cpu", True) is False and not cpu_forced and not torch.cuda.is_available():
        return (": without a GPU, TrainingArguments join the run's process group only with "
                "use_cpu=True (accelerate leaves a CPU run undistributed otherwise). Hint: "
                "TrainingArguments(..., use_cpu=True)")
    return ". Hint: build TrainingArguments inside train_loop_per_worker, after the run has started"


def _whole(dataset: Any) -> Any:
    whole = dataset_shard.whole_of(dataset)
    return dataset if whole is None else whole


@contextlib.contextmanager
def checkpoint_path(checkpoint: Checkpoint | None = None) -> Iterator[str | None]:
    """The Transformers checkpoint directory in `checkpoint` (default: `train.get_checkpoint()`,
    the run's latest committed checkpoint) for `trainer.train(resume_from_checkpoint=...)`, or
    None on a fresh run. On remote storage it is a local copy while the block runs.
    """
    checkpoint = checkpoint if checkpoint is not None else train.get_checkpoint()
    with checkpoint.as_directory() if checkpoint is not None else contextlib.nullcontext() as d:
        yield None if d is None else os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME)


def train_or_resume(trainer: Any, **train_kwargs: Any) -> Any:
    """`trainer.train(resume_from_checkpoint=<latest checkpoint>, **train_kwargs)`: starts fresh
    on a new run, and resumes a restored or re-run one from its last committed checkpoint.
    Returns what `trainer.train` returns."""
    with checkpoint_path() as path:
        return trainer.train(resume_from_checkpoint=path, **train_kwargs)
