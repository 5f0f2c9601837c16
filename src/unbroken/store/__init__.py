"""Layer 2, store: everything on storage, and the only layer that reads or writes it.

`storage` (an fsspec filesystem and a root: durable writes, atomic replaces), the checkpoint
commit protocol (`commit`), the committed checkpoints of a run and retention
(`checkpoint_manager`), the user's `Checkpoint` handle (`checkpoint`), the run and sweep
manifests (`manifest`, `sweep_manifest`, on one base), the driver lease (`lease`), the
metric history (`history`), pickled arguments (`pickled`), the returned value
(`return_value`) and the create-or-restore steps shared by runs and sweeps (`opening`).

May import: `core` and `state`.
"""
