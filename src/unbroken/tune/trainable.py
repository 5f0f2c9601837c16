"""Class trainables: Ray Tune's `Trainable` (`setup`, `step`, `save_checkpoint`,
`load_checkpoint`, `reset_config`, `cleanup`), run as a trial like a function trainable.

A trial of a `Trainable` subclass runs `ClassRunner`, a function trainable that builds the
object, loads the trial's latest committed checkpoint into it, then calls `step()` and
reports each result as one row. A step saves a checkpoint every
`CheckpointConfig.checkpoint_frequency` steps, when the driver asks for one (a preemption),
when the step's result says `should_checkpoint=True` (`tune.result.SHOULD_CHECKPOINT`), and,
unless `checkpoint_at_end=False`, with the result that says `done=True`. With
`checkpoint_at_end=True` also with the result that ends the trial otherwise (its stop, a
stopper, a scheduler's decision): each report then waits for its verdict, and the one that
ends the trial gets its checkpoint after it (see `report_pipeline`). The checkpoint
holds what `save_checkpoint(checkpoint_dir)` wrote and `.trainable.json`: the step count and,
when `save_checkpoint` returned a dict, that dict (then `load_checkpoint` gets the dict back,
else the directory's path, as in Ray). A restore resumes at the step after the checkpoint's,
so a trial killed at any moment ends with the rows of the uninterrupted trial, each once.

With `TuneConfig(reuse_actors=True)` the object outlives its run in a kept worker process
(`worker.process_reuse`): the next run there that resumes from a checkpoint, of this trial
or another, gives it its config by `reset_config` and loads the checkpoint into it instead
of building a new one. A run without a checkpoint (a new trial) always builds a new object:
what an object holds beyond its checkpoint never passes from one trial to another.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from unbroken import train
from unbroken.train import Checkpoint
from unbroken.tune.result import SHOULD_CHECKPOINT
from unbroken.worker import process_reuse
from unbroken.worker.replies import StopTraining
from unbroken.worker.session import current as current_session

STATE_FILE = ".trainable.json"
KEPT_KEY = "tune.Trainable"  # the object a run leaves for the next in a kept process


class Trainable:
    """Subclass it and define `setup(config)` and `step() -> dict`; `save_checkpoint` and
    `load_checkpoint` make the trial resumable. Ray Tune's attributes: `config`, `iteration`
    (steps done, the restored ones included), `training_iteration` (the same),
    `trial_name`, `trial_id`, `trial_dir` (and `logdir`)."""

    def __init__(self, config: dict[str, Any] | None = None, **parameters: Any) -> None:
        self.config: dict[str, Any] = dict(config or {})
        self._iteration = 0
        self.setup(self.config, **parameters)

    # -- what a subclass defines ------------------------------------------------------------
    def setup(self, config: dict[str, Any], **parameters: Any) -> None:
        """Build what the steps need (`parameters`: what `tune.with_parameters` gave)."""

    def step(self) -> dict[str, Any]:
        """One step of training; returns its metrics (`done=True` ends the trial)."""
        raise NotImplementedError(f"{type(self).__name__}.step() must return a dict of metrics")

    def save_checkpoint(self, checkpoint_dir: str) -> dict[str, Any] | str | None:
        """Write the state into `checkpoint_dir`, or return it as a dict of plain data."""
        return None

    def load_checkpoint(self, checkpoint: dict[str, Any] | str) -> None:
        """Load what `save_checkpoint` saved: its dict, or the checkpoint directory's path."""

    def reset_config(self, new_config: dict[str, Any]) -> bool:
        """Take a new config without being rebuilt; False (the default): not supported."""
        return False

    def cleanup(self) -> None:
        """Release what `setup` took; called once the trial's steps end."""

    # -- Ray Tune's attributes --------------------------------------------------------------
    @property
    def iteration(self) -> int:
        return self._iteration

    @property
    def training_iteration(self) -> int:
        return self._iteration

    @property
    def trial_name(self) -> str | None:
        return _in_trial("get_trial_name")

    @property
    def trial_id(self) -> str | None:
        return _in_trial("get_trial_id")

    @property
    def trial_dir(self) -> str | None:
        return _in_trial("get_trial_dir")

    logdir = trial_dir


def _in_trial(getter: str) -> str | None:
    """What the trial's context says, or None for an object used outside a trial (as
    `tune.utils.validate_save_restore` uses one)."""
    try:
        context = train.get_context()
    except RuntimeError:
        return None
    return getattr(context, getter)()


def is_trainable_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, Trainable)


class ClassRunner:
    """The function a class trainable's trial runs (see the module docstring)."""

    def __init__(self, cls: type[Trainable], parameters: dict[str, Any] | None = None,
                 frequency: int = 0, at_end: bool | None = None) -> None:
        self.cls, self.parameters = cls, dict(parameters or {})
        self.frequency, self.at_end = frequency, at_end
        self.__name__ = cls.__name__

    @property
    def unbroken_respecify(self) -> bool:
        """Never saved while it holds `tune.with_parameters`' objects."""
        return bool(self.parameters)

    def __call__(self, config: dict[str, Any]) -> None:
        trainable = self._build(config)
        keep = False  # for the next run in this process (`reuse_actors`), once this one ends cleanly
        try:
            self._restore(trainable)
            self._run(trainable)
            keep = process_reuse.kept()
        except StopTraining:  # its stop, a stopper or a scheduler ended it
            keep = process_reuse.kept()
            raise
        finally:
            if keep:
                process_reuse.keep(KEPT_KEY, trainable, trainable.cleanup)
            else:
                trainable.cleanup()

    def _build(self, config: dict[str, Any]) -> Trainable:
        """The trial's object: the one an earlier run left in this process (`reuse_actors`),
        given `config` by `reset_config`, when this run resumes from a checkpoint (loaded into
        it next, as Ray does) and it takes the config; otherwise a new one (`setup`)."""
        left = process_reuse.take(KEPT_KEY)
        if left is None:
            return self.cls(config, **self.parameters)
        kept, release = left
        # By name: a class defined in __main__ is unpickled anew for each run.
        name = (self.cls.__module__, self.cls.__qualname__)
        same = (type(kept).__module__, type(kept).__qualname__) == name
        try:
            if same and train.get_checkpoint() is not None:
                old, kept.config = kept.config, dict(config)
                if kept.reset_config(kept.config):
                    kept._iteration = 0
                    return kept
                kept.config = old
        except BaseException:
            release()  # reset_config raised: the run fails, and the object is cleaned up
            raise
        release()
        return self.cls(config, **self.parameters)

    def _restore(self, trainable: Trainable) -> None:
        checkpoint = train.get_checkpoint()
        if checkpoint is None:
            return
        with checkpoint.as_directory() as directory:
            with open(os.path.join(directory, STATE_FILE)) as f:
                saved = json.load(f)
            trainable.load_checkpoint(saved["state"] if saved.get("state") is not None else directory)
        trainable._iteration = int(saved["iteration"])

    def _run(self, trainable: Trainable) -> None:
        context = train.get_context()
        while True:
            result = trainable.step()
            if not isinstance(result, dict):
                raise TypeError(f"{self.cls.__name__}.step() returned {type(result).__name__}, not a dict "
                                "of metrics. Hint: return {'score': ...}")
            trainable._iteration += 1
            done = bool(result.get("done"))
            if ((self.frequency and trainable.iteration % self.frequency == 0) or context.should_checkpoint()
                    or result.get(SHOULD_CHECKPOINT) or (done and self.at_end is not False)):
                with tempfile.TemporaryDirectory(prefix="unbroken-trainable-") as directory:
                    self._save(trainable, directory)
                    train.report(result, checkpoint=Checkpoint.from_directory(directory))
            elif self.at_end is not True or done:
                train.report(result)
            else:
                self._report_at_end(trainable, result)
            if done:
                return

    def _report_at_end(self, trainable: Trainable, result: dict[str, Any]) -> None:
        """Report `result` without a checkpoint; when its verdict stops the trial (its stop, a
        stopper, a scheduler), save the checkpoint `checkpoint_at_end` asks for, as that
        report's (the trial ends with it, as in Tune)."""
        session = current_session("train.report()")
        try:
            session.report(result, at_end=True)
        except StopTraining as stop:
            if stop.attach:
                with tempfile.TemporaryDirectory(prefix="unbroken-trainable-") as directory:
                    self._save(trainable, directory)
                    session.attach(directory)
            raise

    def _save(self, trainable: Trainable, directory: str) -> None:
        state = trainable.save_checkpoint(directory)
        if isinstance(state, dict):
            try:
                text = json.dumps({"iteration": trainable.iteration, "state": state})
            except (TypeError, ValueError) as e:
                raise TypeError(f"{self.cls.__name__}.save_checkpoint returned a dict that is not plain data "
                                f"({e}). Hint: write tensors and other objects into checkpoint_dir and "
                                "return None") from None
        else:
            text = json.dumps({"iteration": trainable.iteration, "state": None})
        with open(os.path.join(directory, STATE_FILE), "w") as f:
            f.write(text)
