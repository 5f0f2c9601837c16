"""Layer 3a, run: one run directory as the driver sees it, and the rules for restoring it.

The run handle the controller writes through (`handle.Run`: attempts, rows, commits,
manifest saves), the callbacks that observe a run (`callbacks`), `Result` (`result`), a
run's identity (`identity`) and the restore rules: saving a trainer's arguments and
rebuilding it (`restore`).

May import: `core`, `state` and `store`; not `worker` (its sibling), nor anything above.
"""
