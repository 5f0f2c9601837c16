"""Ray Tune's `ray.tune.utils.mock_trainable`, which its examples use as a stand-in model:
`MyTrainableClass`, a class trainable whose `episode_reward_mean` rises along a sigmoid set
by the config's `width` and `height`."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from unbroken.tune.trainable import Trainable

MOCK_TRAINABLE_NAME = "mock_trainable"
MOCK_ERROR_KEY = "mock_error"


class MyTrainableClass(Trainable):
    """Step t reports `episode_reward_mean = height * tanh(t / width)` (both 1 by default).
    Config `sleep`: seconds each step sleeps; `mock_error=True`: steps after the first raise
    until the trial was restored from a checkpoint (`persistent_error=True`: always)."""

    def setup(self, config: dict[str, Any], **parameters: Any) -> None:
        self._sleep_time = config.get("sleep", 0)
        self._mock_error = config.get(MOCK_ERROR_KEY, False)
        self._persistent_error = config.get("persistent_error", False)
        self.timestep = 0
        self.restored = False

    def step(self) -> dict[str, Any]:
        if self._mock_error and self.timestep > 0 and (self._persistent_error or not self.restored):
            raise RuntimeError(f"failing on purpose at timestep {self.timestep}")
        if self._sleep_time > 0:
            time.sleep(self._sleep_time)
        self.timestep += 1
        value = np.tanh(float(self.timestep) / self.config.get("width", 1)) * self.config.get("height", 1)
        return {"episode_reward_mean": float(value)}

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        with open(os.path.join(checkpoint_dir, "checkpoint"), "w") as f:
            json.dump({"timestep": self.timestep}, f)

    def load_checkpoint(self, checkpoint: dict[str, Any] | str) -> None:
        with open(os.path.join(str(checkpoint), "checkpoint")) as f:
            self.timestep = json.load(f)["timestep"]
        self.restored = True
