"""What one rank of an attempt is given to run: its `WorkerInfo` (rank, world, node, the
run's storage, the checkpoint to resume from) and the trainer whose loop it runs."""

from __future__ import annotations

import dataclasses
from typing import Any

from unbroken.core import faults
from unbroken.core.config import ScalingConfig
from unbroken.execution.engine.base import Placement
from unbroken.run.handle import Run
from unbroken.store.checkpoint import Checkpoint
from unbroken.store.commit import Marker
from unbroken.store.storage import split_run_url
from unbroken.worker.runner import WorkerPayload
from unbroken.worker.worker_info import WorkerInfo


def rank_payload(run: Run, trainer: Any, scaling: ScalingConfig, validates: bool, resume: Marker | None,
                 probe: str | None, peer: tuple[int, int] | None, placement: Placement) -> WorkerPayload:
    """The payload of the rank at `placement` in the current attempt of `run`, resuming from
    `resume` (else the trainer's `resume_from_checkpoint`); `scaling`: the attempt's size;
    `probe`: the token ranks on other nodes read back to check that they share storage;
    `peer`: recovering in place, (the rank that sends the state, the round it is from)."""
    checkpoint = None
    if resume is not None:
        checkpoint = Checkpoint(run.storage.url(resume.name), run.storage.filesystem_arg)
    elif trainer.resume_from_checkpoint is not None:
        checkpoint = trainer.resume_from_checkpoint
    trial = trainer.run_spec.trial
    info = WorkerInfo(
        world_rank=placement.rank, world_size=scaling.num_workers, local_rank=placement.local_rank,
        local_world_size=placement.local_world_size, node_rank=placement.node_rank,
        experiment_name=run.manifest.name, run_path=run.path, storage=run.storage,
        attempt=run.attempt.number, start_iteration=run.attempt.resumed_iteration,
        checkpoint=checkpoint, storage_path=split_run_url(run.storage.url())[0],
        cpus=placement.cpus, use_gpu=scaling.use_gpu, node_id=placement.node_id,
        node_address=placement.node_address, probe=probe, env=faults.carried_env(), validates=validates,
        peer_source=peer[0] if peer is not None else None,
        collective_timeout_s=trainer.run_config.failure_config.collective_timeout_s,
        step_seed=recorded_seed(run, placement.rank, scaling.num_workers),
        recovery=trainer.run_config.failure_config.recovery,
        **(dataclasses.asdict(trial) if trial is not None else {}))  # trial_name, trial_id, trial_dir
    info.env.update(trainer.run_config.worker_env())  # RunConfig(worker_runtime_env={"env_vars": ...})
    return WorkerPayload(info=info, trainer=trainer)


def recorded_seed(run: Run, rank: int, world_size: int) -> int | None:
    """Rank `rank`'s step seed as the run recorded it (run.json's `step_seeds`), when the run
    had this many ranks then."""
    seeds = run.manifest.step_seeds
    return seeds[rank] if seeds is not None and len(seeds) == world_size else None
