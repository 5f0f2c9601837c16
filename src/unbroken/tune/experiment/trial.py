"""Ray Tune's `ray.tune.experiment.trial` module path: `Trial`."""

from unbroken.tune.callback import Trial

__all__ = ["Trial"]
