"""Ray Tune's module path `ray.tune.schedulers.pb2`: the same class as `unbroken.tune.schedulers`
(defined in `unbroken.tune.pb2`)."""

from unbroken.tune.pb2 import PB2

__all__ = ["PB2"]
