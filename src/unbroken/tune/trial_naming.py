"""Trial names and directory names from `TuneConfig(trial_name_creator=...,
trial_dirname_creator=...)`, as Ray Tune calls them: each with a `tune.callback.Trial` view of
the new trial (its id and config).

The directory name is the trial's name in the sweep manifest and its run directory under the
sweep, so it must be one path component, not hidden (the sweep's own files start with "."),
and unique: a name another trial has is made unique by appending the trial's index
(`lr=0.1_00004`). A trial's names are recorded when it is proposed, so a restore never asks
the creators again for it. Without a creator, trials are `trial_00000`, `trial_00001`, ...
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unbroken.store import sweep_manifest as sw
from unbroken.tune.callback import Trial


@dataclass
class TrialNaming:
    """The creators of a sweep (None: the default names)."""

    name_creator: Callable[[Trial], str] | None = None
    dirname_creator: Callable[[Trial], str] | None = None
    trainable_name: str = ""

    def names(self, index: int, trial_id: str, config: dict[str, Any],
              taken: set[str]) -> tuple[str, str | None]:
        """(the directory name, the trial name when a creator gives one) of trial `index`."""
        default = sw.trial_name(index)
        view = Trial(trial_id=trial_id, trial_name=default, config=config, status=sw.PENDING, path="",
                     trainable_name=self.trainable_name)
        title = None
        if self.name_creator is not None:
            title = _checked(self.name_creator(view), "trial_name_creator")
            view.trial_name = title
        if self.dirname_creator is None:
            return default, title
        name = _checked(self.dirname_creator(view), "trial_dirname_creator")
        if "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"TuneConfig.trial_dirname_creator returned {name!r} for trial {index}: a "
                             "trial's directory must be one path component that does not start with '.'. "
                             "Hint: replace '/' in the name, e.g. name.replace('/', '_')")
        return (f"{name}_{index:05d}" if name in taken else name), title


def _checked(name: Any, creator: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"TuneConfig.{creator} must return a non-empty string, got {name!r}")
    return name
