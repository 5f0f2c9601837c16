"""PB2's bandit: from the population's recorded stretches of training, the hyperparameters an
exploiting trial should train with next (Parker-Holder et al. 2020, "Provably Efficient Online
Hyperparameter Optimization with Population-Based Bandits").

Each stretch is a point x = (time it began, reward it began at, hyperparameters) with
y = reward gained per unit of time. Time and reward are scaled to [0, 1] over the stretches
(and the new one), each hyperparameter over its bounds, y standardized and clipped to [-2, 2].
A Gaussian process (scikit-learn's, an RBF kernel with one length scale per input, which with
time among the inputs stands in for the paper's time-varying kernel, plus white noise) is fitted
to them; the new hyperparameters are the best of `CANDIDATES` random points by the upper
confidence bound mean + kappa * std, at the new stretch's start (the donor's time and reward),
with the paper's kappa = sqrt(0.2 log(0.4 n)) for n stretches. With no stretch recorded yet
they are drawn uniformly within the bounds. The random points come from the decision's seeded
generator, so the same records give the same values.

scikit-learn is an optional dependency (`pip install 'unbroken[pb2]'`). The sweep driver forks
its trials only while it has no threads of its own (`execution.engine.local.start_method`),
and importing scikit-learn starts some (SciPy's BLAS, pyarrow's allocator through pandas); so
while the driver can fork, the model is fitted in a forked child that imports it and sends
the values back, and the driver never imports it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from unbroken.core.processes import die_with_parent, ignore_terminal_signals
from unbroken.errors import MissingDependencyError
from unbroken.execution.engine.local import start_method

CANDIDATES = 1000  # random points the acquisition is maximized over
MOST_STRETCHES = 200  # the latest ones only: a GP's fit grows with the cube of its points

Stretch = tuple[float, float, Sequence[float], float]  # (began at time, at reward, values, gain per time)


def require_sklearn() -> None:
    """MissingDependencyError, naming the extra to install, when scikit-learn is not there
    (found without importing it: PB2's constructor asks, and the import takes a second)."""
    if importlib.util.find_spec("sklearn") is None:
        raise MissingDependencyError("PB2 needs scikit-learn, which is not installed. Hint: pip install "
                                     "'unbroken[pb2]' (installs scikit-learn)")


def select(stretches: Sequence[Stretch], start: tuple[float, float], bounds: Sequence[tuple[float, float]],
           rng: random.Random) -> list[float]:
    """New hyperparameter values, each within its (low, high) of `bounds`, for a stretch that
    begins at `start` (time, reward); `stretches` as recorded, in time order."""
    if not stretches:
        return [low + rng.random() * (high - low) for low, high in bounds]
    require_sklearn()
    args = ([list(s) for s in stretches[-MOST_STRETCHES:]], list(start), [list(b) for b in bounds],
            rng.getrandbits(64))
    if "sklearn" in sys.modules or start_method() != "fork":
        return _fit_and_pick(*args)
    return _in_child(_fit_and_pick, *args)


def _fit_and_pick(stretches: list[list[Any]], start: list[float], bounds: list[list[float]],
                  seed: int) -> list[float]:
    import numpy as np
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.gaussian_process import GaussianProcessRegressor
    from sklearn.gaussian_process.kernels import RBF, ConstantKernel, WhiteKernel

    fixed = np.array([[t, r] for t, r, _, _ in stretches] + [start], dtype=float)
    low_f, span_f = fixed.min(axis=0), np.ptp(fixed, axis=0)
    span_f[span_f <= 0] = 1.0  # one value only: it scales to 0
    low_h = np.array([low for low, _ in bounds], dtype=float)
    span_h = np.array([high for _, high in bounds], dtype=float) - low_h
    x = np.hstack([(fixed[:-1] - low_f) / span_f,
                   (np.array([v for _, _, v, _ in stretches], dtype=float) - low_h) / span_h])
    gains = np.array([g for _, _, _, g in stretches], dtype=float)
    y = np.clip((gains - gains.mean()) / (gains.std() + 1e-8), -2.0, 2.0)

    kernel = (ConstantKernel(1.0, (1e-2, 1e2)) * RBF(np.ones(x.shape[1]), (1e-2, 1e2))
              + WhiteKernel(0.1, (1e-5, 1e1)))
    gp = GaussianProcessRegressor(kernel, alpha=1e-6, n_restarts_optimizer=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        gp.fit(x, y)

    points = np.random.default_rng(seed).random((CANDIDATES, len(bounds)))
    at = np.repeat(((fixed[-1] - low_f) / span_f)[None, :], CANDIDATES, axis=0)
    mean, std = gp.predict(np.hstack([at, points]), return_std=True)
    kappa = math.sqrt(max(0.2 * math.log(0.4 * len(stretches)), 0.0))
    best = points[int(np.argmax(mean + kappa * std))]
    values = [low + float(u) * (high - low) for u, (low, high) in zip(best, bounds, strict=True)]
    return [min(max(v, low), high) for v, (low, high) in zip(values, bounds, strict=True)]


def _in_child(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) in a forked child (module docstring); its value comes back as JSON, its error
    as a RuntimeError naming it."""
    read, write = os.pipe()
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            os.close(read)
            ignore_terminal_signals()  # the driver handles Ctrl-C; this child just finishes
            die_with_parent(parent)
            try:
                out = {"value": fn(*args)}
            except BaseException as e:  # noqa: B036 - reported to the parent, which raises it
                out = {"error": f"{type(e).__name__}: {e}"}
            with os.fdopen(write, "w") as f:
                f.write(json.dumps(out))
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    out = json.loads(text) if text else {"error": "the process fitting PB2's model died"}
    if "error" in out:
        raise RuntimeError(f"PB2 could not choose the new hyperparameters: {out['error']}")
    return out["value"]
