"""The stable names of unbroken's own modules in stored data.

A run directory names some of unbroken's classes: run.json's references
(`{"__dataclass__": "unbroken.config:RunConfig"}`, the trainer class
`unbroken.trainer:DataParallelTrainer`, which is part of a run's identity fingerprint) and
the cloudpickled arguments (a callback's class). Those names were fixed before the package
was split into layers, and runs written then must keep loading and auto-resuming. So stored
data keeps naming each moved module by its old name, and reading maps it to where the
module lives now. A module that never moved, or one of the user's, is its own stable name.
"""

from __future__ import annotations

# stable (stored) name -> the module that holds it now
_MOVED = {
    "unbroken.config": "unbroken.core.config",
    "unbroken.faults": "unbroken.core.faults",
    "unbroken.ray_names": "unbroken.core.ray_names",
    "unbroken.engine.process": "unbroken.core.processes",
    "unbroken.sampler": "unbroken.state.sampler",
    "unbroken.sample_seed": "unbroken.state.sample_seed",
    "unbroken.sharded": "unbroken.state.sharded",
    "unbroken.reproducibility": "unbroken.state.reproducibility",
    "unbroken.storage": "unbroken.store.storage",
    "unbroken.commit": "unbroken.store.commit",
    "unbroken.manifest": "unbroken.store.manifest",
    "unbroken.lease": "unbroken.store.lease",
    "unbroken.history": "unbroken.store.history",
    "unbroken.pickled": "unbroken.store.pickled",
    "unbroken.return_value": "unbroken.store.return_value",
    "unbroken.checkpoint": "unbroken.store.checkpoint",
    "unbroken.checkpoint_manager": "unbroken.store.checkpoint_manager",
    "unbroken.opening": "unbroken.store.opening",
    "unbroken.tune.sweep": "unbroken.store.sweep_manifest",
    "unbroken.run": "unbroken.run.handle",
    "unbroken.callbacks": "unbroken.run.callbacks",
    "unbroken.result": "unbroken.run.result",
    "unbroken.restore": "unbroken.run.restore",
    "unbroken.protocol": "unbroken.worker.protocol",
    "unbroken.report_config": "unbroken.worker.report_config",
    "unbroken.async_save": "unbroken.worker.async_save",
    "unbroken.session": "unbroken.worker.session",
    "unbroken.backend": "unbroken.worker.backend",
    "unbroken.torch_backend": "unbroken.worker.torch_backend",
    "unbroken.train_state": "unbroken.worker.train_state",
    "unbroken.engine.worker": "unbroken.worker.runner",
    "unbroken.jit_checkpoint": "unbroken.worker.recovery.just_in_time",
    "unbroken.controller": "unbroken.execution.controller",
    "unbroken.report_rounds": "unbroken.execution.report_rounds",
    "unbroken.failure_policy": "unbroken.execution.recovery.failure_policy",
    "unbroken.preemption": "unbroken.execution.preemption",
    "unbroken.engine": "unbroken.execution.engine.factory",
    "unbroken.engine.base": "unbroken.execution.engine.base",
    "unbroken.engine.local": "unbroken.execution.engine.local",
    "unbroken.engine.ray": "unbroken.execution.engine.ray",
    "unbroken.progress": "unbroken.observe.progress",
    "unbroken.tensorboard_logger": "unbroken.observe.tensorboard_logger",
    "unbroken.mlflow_logger": "unbroken.observe.mlflow_logger",
    "unbroken.trainer": "unbroken.train.trainer",
    "unbroken.cli": "unbroken.cli.commands",
    "unbroken.inspection": "unbroken.cli.inspection",
    "unbroken.plotting": "unbroken.cli.plotting",
}
_STABLE = {now: stable for stable, now in _MOVED.items()}


def stable_module(module: str) -> str:
    """The name stored data gives `module` (its name before it moved, else its own)."""
    return _STABLE.get(module, module)


def current_module(module: str) -> str:
    """The module that a stored module name refers to now."""
    return _MOVED.get(module, module)
