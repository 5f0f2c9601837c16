"""Ray Tune's `ray.tune.syncer` module path: importing it fails at once with
UnsupportedAPIError saying what to use instead of `SyncConfig`: trials write straight to
`RunConfig(storage_path=...)`, which may be an fsspec URL, so there is nothing to sync."""

from unbroken.core import ray_names as _ray_names

_ray_names.refuse("unbroken.tune", "SyncConfig")
