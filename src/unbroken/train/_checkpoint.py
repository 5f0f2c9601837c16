"""Ray Train's private module path `ray.train._checkpoint`, which some of Ray's own examples
import `Checkpoint` from."""

from unbroken.train import Checkpoint

__all__ = ["Checkpoint"]
