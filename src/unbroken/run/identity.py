"""A run's identity: what makes a run this run (its trainer class, its plain non-mutable
arguments, its dataset names), how two identities differ, and the auto-resume guard that
refuses a run started with a different one.
"""

from __future__ import annotations

import inspect
from typing import Any

from unbroken.core.codec import describe, fingerprint, is_function, qualified_name
from unbroken.errors import IdentityMismatchError
from unbroken.store.manifest import RunManifest, config_change_lines

DATASETS = "datasets"
# Arguments that may change between attempts; every other plain argument is the run's identity.
MUTABLE = frozenset({"scaling_config", "run_config", "backend_config", "resume_from_checkpoint",
                     "torch_config", "validation_config"})


def identity(trainer_class: type, init_args: dict[str, Any]) -> dict[str, Any]:
    """What makes a run this run: its class, its plain non-mutable arguments, its dataset names."""
    ident: dict[str, Any] = {"trainer_class": qualified_name(trainer_class)}
    for name, value in sorted(init_args.items()):
        if name in MUTABLE or is_function(value):
            continue
        if name == DATASETS:
            ident[DATASETS] = sorted(value or {})
        else:
            ident[name] = describe(value)
    return ident


def code_fingerprints(init_args: dict[str, Any]) -> dict[str, str]:
    """A fingerprint of each function argument's source (a changed body is allowed and logged)."""
    out = {}
    for name, value in init_args.items():
        if is_function(value):
            try:
                out[name] = fingerprint(inspect.getsource(value))
            except (OSError, TypeError):
                out[name] = fingerprint(getattr(getattr(value, "__code__", None), "co_code", b"").hex())
    return out


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict) and obj and "__object__" not in obj:
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else k))
        return out
    return {prefix: obj}


def identity_changes(saved: dict[str, Any], now: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What differs between two identities, by key path: {key: {"saved": a, "now": b}}, a
    side left out where the key is absent (the form `Attempt.config_change` records)."""
    a, b = _flatten(saved), _flatten(now)
    changes: dict[str, dict[str, Any]] = {}
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b or a[key] != b[key]:
            changes[key] = {side: ident[key] for side, ident in (("saved", a), ("now", b)) if key in ident}
    return changes


def identity_diff(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """`identity_changes` as lines for an error message."""
    return config_change_lines(identity_changes(saved, now))


def check_identity(manifest: RunManifest, trainer_class: type, init_args: dict, path: str,
                   allow_change: bool = False) -> None:
    """Auto-resume guard: raise IdentityMismatchError with the diff and the ways out, unless
    `allow_change` (RunConfig.allow_config_change) accepts it; a different trainer class is
    never accepted."""
    now = identity(trainer_class, init_args)
    lines = identity_diff(manifest.identity, now)
    if not lines:
        return
    diff = "\n".join(lines)
    cls = trainer_class.__name__
    if manifest.identity.get("trainer_class") not in (None, now["trainer_class"]):
        raise IdentityMismatchError(
            f"the run at {path!r} was started by another trainer class:\n{diff}\nHint: run it with "
            f"{manifest.trainer_class.split(':')[-1]}, or give RunConfig a new name for a separate run.")
    if allow_change:
        return
    raise IdentityMismatchError(
        f"the run at {path!r} was started with a different configuration:\n{diff}\n"
        f"Hint: to continue this run with the new configuration (e.g. more epochs), pass "
        f"RunConfig(..., allow_config_change=True); the change is recorded with the attempt. "
        f"To start a separate run, give RunConfig a new name. (Or amend it explicitly: "
        f"{cls}.restore({path!r}, <changed argument>=...).fit().)")
