"""Ray Tune's module path `ray.tune.schedulers.pbt`: the same class as `unbroken.tune.schedulers`
(defined in `unbroken.tune.pbt`)."""

from unbroken.tune.pbt import PopulationBasedTraining

__all__ = ["PopulationBasedTraining"]
