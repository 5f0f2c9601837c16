"""What `train.get_context()` returns in a worker: its rank, sizes, run and attempt
(`TrainContext`, with Ray Train's `get_*` spellings), and where the run is stored
(`StorageContext`, Ray Train V2's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from unbroken.store.storage import split_run_url

if TYPE_CHECKING:
    from unbroken.worker.session import Session


class TrainContext:
    """What `train.get_context()` returns: this worker's rank, sizes, run and attempt."""

    def __init__(self, session: Session) -> None:
        self.follow(session)

    def follow(self, session: Session) -> None:
        """Describe `session`'s attempt from now on (a loop that stays holds on to its context)."""
        self._info = session.info
        self._session = session

    world_rank = property(lambda self: self._info.world_rank)
    world_size = property(lambda self: self._info.world_size)
    local_rank = property(lambda self: self._info.local_rank)
    local_world_size = property(lambda self: self._info.local_world_size)
    node_rank = property(lambda self: self._info.node_rank)
    experiment_name = property(lambda self: self._info.experiment_name)
    storage_path = property(lambda self: self._info.storage_path)
    run_path = property(lambda self: self._info.run_path)
    attempt = property(lambda self: self._info.attempt)
    trial_name = property(lambda self: self._info.trial_name)
    trial_id = property(lambda self: self._info.trial_id)

    # Ray Train spellings, so ported scripts keep working.
    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.local_world_size

    def get_node_rank(self) -> int:
        return self.node_rank

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_trial_name(self) -> str | None:
        return self.trial_name

    def get_trial_id(self) -> str | None:
        return self.trial_id

    def get_trial_dir(self) -> str | None:
        """The trial's run directory (Ray Tune's name), or None outside a sweep."""
        return self._info.trial_dir

    def get_storage_path(self) -> str:
        return self.storage_path

    def get_attempt(self) -> int:
        return self.attempt

    def get_storage(self) -> StorageContext:
        """Where the run lives: its storage root, filesystem and directory (Ray Train V2)."""
        storage = self._info.storage
        return StorageContext(storage_path=self.storage_path, experiment_dir_name=self.experiment_name,
                              storage_filesystem=storage.fs, experiment_fs_path=storage.path(),
                              storage_fs_path=split_run_url(storage.path())[0])

    def should_checkpoint(self) -> bool:
        """True when the driver asks for a checkpoint at this report (e.g. on preemption).

        Every rank gets the same answer for the same report.
        """
        return self._session.should_checkpoint()


@dataclass(frozen=True)
class StorageContext:
    """What `train.get_context().get_storage()` returns: the storage root as configured
    (`storage_path`), the run's directory name in it (`experiment_dir_name`), the fsspec
    filesystem, and the root and the run directory as paths on that filesystem. Write your
    own files elsewhere than the run directory: its contents belong to unbroken."""

    storage_path: str
    experiment_dir_name: str
    storage_filesystem: Any
    storage_fs_path: str
    experiment_fs_path: str


@dataclass(frozen=True)
class PreemptionInfo:
    """What `train.get_preemption_info()` returns (Ray Train V2's fields): the deadline
    (UNIX time in milliseconds) and, for each machine that goes away (a Ray node id, or a
    host name), the world ranks on it."""

    deadline_ms: int | None
    preempted_node_to_ranks: dict[str, list[int]]

    @property
    def preempted_node_ids(self) -> list[str]:
        return sorted(self.preempted_node_to_ranks)

    @property
    def preempted_ranks(self) -> list[int]:
        return sorted({r for ranks in self.preempted_node_to_ranks.values() for r in ranks})
