"""Ray Tune's module path `ray.tune.schedulers.async_hyperband`: the same classes as
`unbroken.tune.schedulers` (defined in `unbroken.tune.asha`)."""

from unbroken.tune.asha import ASHAScheduler

AsyncHyperBandScheduler = ASHAScheduler

__all__ = ["ASHAScheduler", "AsyncHyperBandScheduler"]
