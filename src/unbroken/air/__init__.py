"""Layer air: Ray AIR's module paths (`ray.air`, `ray.air.integrations`), which Ray V1 scripts
import: `from unbroken.air import session` (or `Checkpoint`, `ScalingConfig`, ...) fails at
once with UnsupportedAPIError naming the unbroken.train name to use, and so do
`unbroken.air.integrations.mlflow` and `.wandb` (docs/porting-from-ray.md).

May import: `core`.
"""

from __future__ import annotations

from typing import Any

from unbroken.core import ray_names as _ray_names


def __getattr__(name: str) -> Any:
    _ray_names.refuse(__name__, name)
