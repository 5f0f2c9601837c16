"""Opening a run for fit(): create it, auto-resume it by name, or continue a restored one,
by the restore rules (docs/restore.md), through `store.opening` with what is particular to
runs (`RUN`). Nothing is written before every check has passed.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from unbroken.core import supervision
from unbroken.core.config import generated_name
from unbroken.execution.engine.factory import check_can_run
from unbroken.run.handle import Run
from unbroken.run.identity import check_identity, identity_changes
from unbroken.run.restore import PARAMS_JSON, SavedTrainer, encode_trainer, write_trainer
from unbroken.run.result import Result
from unbroken.store import opening
from unbroken.store.commit import remove_leftovers
from unbroken.store.manifest import FINISHED, RunManifest, config_change_lines
from unbroken.store.manifest import is_run_dir as manifest_exists
from unbroken.store.manifest import load as load_manifest
from unbroken.store.storage import Storage

log = logging.getLogger("unbroken")


def restore_hint(trainer_class: type, path: str) -> str:
    """How to continue the run at `path` (the tail of TrainingFailedError's message)."""
    return (f"{trainer_class.__name__}.restore({path!r}).fit(), or by running the same script "
            "again with the same RunConfig(name=..., storage_path=...)")


# What is particular to runs in opening one (see unbroken.store.opening). Leftovers: what a torn
# checkpoint holds is freed before anything else is written.
RUN = opening.Kind(
    noun="run", load=load_manifest, exists=manifest_exists, first_files=frozenset({PARAMS_JSON}),
    first_meta=frozenset({"lease.json", "lease.lock", "pickled", "trainer.pkl"}),
    free=lambda storage, manifest: remove_leftovers(storage, manifest.attempt_count))


def _new_manifest(name: str) -> RunManifest:
    return RunManifest(name=name, trainer_class="", trainer_mro=[])  # write_trainer fills it


def open_run(trainer: Any) -> tuple[Any, Any]:
    """Apply the restore rules for a fit() call. Returns (Run to drive, None) or (None, Result)
    for a finished run. Raises before writing anything when the run must not start."""
    cls = type(trainer)
    config, spec = trainer.run_config, trainer.run_spec
    restored = spec.restored_from is not None
    if restored:
        storage = Storage.from_url(spec.restored_from, config.storage_filesystem)
    else:
        root = Storage.from_url(config.resolved_storage_path(), config.storage_filesystem)
        storage = root.child(config.name)
        while spec.name_generated and not opening.is_fresh_dir(RUN, storage):
            config = trainer.run_config = dataclasses.replace(config, name=generated_name(cls.__name__))
            storage = root.child(config.name)
    path = storage.url()
    check_can_run(trainer.scaling_config)  # fails now for an engine or GPUs this machine lacks
    saved = encode_trainer(cls, trainer.init_args)  # fails now if an argument cannot be saved
    _keep_loaded_fingerprints(saved, spec.loaded_fingerprints)

    # The run's state now, even after restore() read it: another driver may have changed it since.
    manifest = opening.existing(
        RUN, storage, exists=restored or manifest_exists(storage), restored=restored, resume=config.resume,
        check_identity=lambda m: check_identity(m, cls, trainer.init_args, path, config.allow_config_change))
    if _finished(manifest, spec.overrides, saved):
        log.info("run %s already finished; returning its stored result", path)
        return None, Result.from_path(path, config.storage_filesystem)

    with opening.leased(RUN, storage, manifest, _new_manifest) as (lease, manifest, previous):
        if previous is not None and _finished(manifest, spec.overrides, saved):
            # It finished between the first read and the lease: another driver drove it.
            lease.release()
            log.info("run %s finished meanwhile; returning its stored result", path)
            return None, Result.from_path(path, config.storage_filesystem)
        if spec.trial is None:  # `unbroken run` restarts the script that opened it (a trial: its sweep)
            supervision.record(supervision.RUN, path)
        # A sweep's trial changes its config by design (population-based training): said quietly.
        quiet = spec.trial is not None
        change = _amendments(manifest, saved, path, quiet) if previous is not None else {}
        write_trainer(storage, manifest, saved)
        run = Run(storage, manifest, previous, lease, config.checkpoint_config)
        run.config_change = change or None
        return run, None


def _finished(manifest: RunManifest | None, overrides: frozenset[str], saved: SavedTrainer) -> bool:
    """The run finished, and this fit() neither re-specifies an argument (`overrides`) nor
    changes its identity: it returns the stored result instead of training."""
    if manifest is None or manifest.status != FINISHED or overrides:
        return False
    return not identity_changes(manifest.identity, saved.fields["identity"])


def _keep_loaded_fingerprints(saved: SavedTrainer, loaded: Mapping[str, str]) -> None:
    """A function restore() loaded from the run is the saved code itself: it keeps its stored
    fingerprint (`loaded`; its source cannot be read once unpickled, so a new one would
    differ), and only a re-specified function is compared with what was saved."""
    fingerprints = saved.fields["code_fingerprints"]
    fingerprints.update({name: fp for name, fp in loaded.items() if name in fingerprints})


def _amendments(manifest: RunManifest, saved: SavedTrainer, path: str,
                quiet: bool = False) -> dict[str, dict[str, Any]]:
    """Log how this fit() changes the run's identity and code; returns the identity change."""
    change = identity_changes(manifest.identity, saved.fields["identity"])
    if change:
        level = logging.INFO if quiet else logging.WARNING
        log.log(level, "run %s continues with a changed configuration:\n%s", path,
                "\n".join(config_change_lines(change)))
    for name, fp in saved.fields["code_fingerprints"].items():
        if manifest.code_fingerprints.get(name) not in (None, fp):
            log.info("run %s: %s changed since the run was saved; using the new code", path, name)
    return change
