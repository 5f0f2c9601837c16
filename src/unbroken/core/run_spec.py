"""RunSpec: what a fit() is asked to do beyond its trainer's constructor arguments.

Which run it continues, which arguments were re-specified, whether its name was made up,
the sweep trial it is and an elastic run's first size travel together as one value, which
the trainer carries (`BaseTrainer.run_spec`). The constructor, `BaseTrainer.restore()` and a
sweep (the Tuner's driver and each trial's process) produce it; opening the run
(`train.open_run`), the controller and each rank's payload read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrialInfo:
    """The sweep trial a run is, as `train.get_context()` gives it to the training function."""

    trial_name: str  # its title (TuneConfig's trial_name_creator), else its name
    trial_id: str
    trial_dir: str  # its run directory, as a URL


@dataclass(frozen=True)
class RunSpec:
    """The intent of one fit(). The default: a new run, or one continued by name
    (RunConfig(resume=...)), outside any sweep."""

    # The URL of the run restore() rebuilt the trainer from: fit() continues exactly that run
    # (no resume mode, no identity check), never one found by name.
    restored_from: str | None = None
    # The constructor arguments re-specified on restore(): a finished run trains again with
    # them instead of returning its stored result. Emptied once a fit() has applied them.
    overrides: frozenset[str] = frozenset()
    # The stored code fingerprints of the arguments restore() loaded from the run instead of
    # having them re-specified, as read with the arguments: such a function is the saved code
    # itself, and its source cannot be read once unpickled, so it keeps its stored fingerprint.
    loaded_fingerprints: Mapping[str, str] = field(default_factory=dict)
    # RunConfig gave no name and the constructor made one up: fit() picks another where that
    # name is taken, rather than continuing a run it never meant.
    name_generated: bool = False
    # The sweep trial this run is (None outside a sweep): its workers' train.get_context() says
    # so, and a configuration it changes by design is logged quietly.
    trial: TrialInfo | None = None
    # An elastic run's most workers for its first attempt: a sweep's share of the Ray cluster
    # for the trial, so that trials started together do not count the same slots. None: its
    # maximum.
    elastic_start_limit: int | None = None

    def replace(self, **changes: Any) -> RunSpec:
        """This spec with `changes` (field names) applied."""
        return dataclasses.replace(self, **changes)
