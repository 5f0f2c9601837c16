"""`enable_reproducibility` (Ray Train's `ray.train.torch.enable_reproducibility`): the
settings that make a torch training function deterministic, called at its start."""

from __future__ import annotations

import os
import random


def enable_reproducibility(seed: int = 0) -> None:
    """Seed python, numpy and torch with `seed`, and make torch pick deterministic algorithms
    (cuDNN included; CUBLAS_WORKSPACE_CONFIG set for deterministic cuBLAS). Call it first in
    the training function. Determinism costs speed, and some operations have no deterministic
    version (torch raises when one is used). Across a resume, TrainState restores the random
    generators where they were, so a resumed run does not start them from `seed` again."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy comes with torch in practice
        pass
    else:
        numpy.random.seed(seed)
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
