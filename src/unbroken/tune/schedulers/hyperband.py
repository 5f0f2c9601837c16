"""Ray Tune's module path `ray.tune.schedulers.hyperband`: the same class as
`unbroken.tune.schedulers` (defined in `unbroken.tune.hyperband`)."""

from unbroken.tune.hyperband import HyperBandScheduler

__all__ = ["HyperBandScheduler"]
