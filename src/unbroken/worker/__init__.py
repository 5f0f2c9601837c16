"""Layer 3b, worker: what runs in each rank, on any engine.

The driver-worker messages (`protocol`) and the rank's end of its link to the driver
(`channel`), the rank's body (`runner.serve`), the `Session` behind `train.report` and
friends (`session`, with Ray V2's report options in `report_config`; its parts: the rank's
`worker_info`, the driver's `replies`, the `report_notes`, the `reported_directory`, the
`committed_checkpoints`), asynchronous saves (`async_save`), backends and
torch.distributed set-up (`backend`, `torch_backend`), `TrainState` (`train_state`,
loading in `state_load`, a sharded model in `sharded_objects`) and the worker's half of
recovery (`recovery/`: just in time, in place, staying in the loop, their messages).

May import: `core`, `state` and `store`; not `run` (its sibling), nor anything above.
"""
