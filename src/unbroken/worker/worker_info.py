"""`WorkerInfo`: a rank's place in its run, as the driver hands it to the rank at the start
of each attempt (its ranks and sizes, the run's storage, the checkpoint it starts from, and
the options of the run that the rank acts on)."""

from __future__ import annotations

from dataclasses import dataclass, field

from unbroken.store.checkpoint import Checkpoint
from unbroken.store.storage import Storage


@dataclass
class WorkerInfo:
    """Everything a worker needs to know about its place in the run."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    run_path: str
    storage: Storage
    attempt: int
    start_iteration: int
    checkpoint: Checkpoint | None
    storage_path: str
    cpus: int = 1
    use_gpu: bool = False
    trial_name: str | None = None
    trial_id: str | None = None
    trial_dir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    node_id: str = ""                 # the engine's name for this rank's machine
    node_address: str = "127.0.0.1"   # where the other ranks reach this rank's machine
    probe: str | None = None          # the token the driver wrote for `engine.worker` to check
    validates: bool = False           # the trainer has a ValidationConfig: validations get done
    peer_source: int | None = None    # recovering in place: the rank that sends every rank the state
    collective_timeout_s: float | None = None  # FailureConfig.collective_timeout_s
    step_seed: int | None = None      # this rank's step seed as the run recorded it (`jit.step_seed_of`)
    recovery: str = "in_place"        # FailureConfig.recovery: "just_in_time" and up arm TrainState
