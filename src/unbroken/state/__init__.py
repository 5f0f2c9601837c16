"""Layer 1, state: what a training loop's state is made of, independent of any run.

The seeded global sample order (`sampler`, `sample_seed`), sharded (FSDP2 / DTensor) state
through torch.distributed.checkpoint (`sharded`), `enable_reproducibility`
(`reproducibility`) and the TrainState checkpoint format: `train_state.pt`, the per-rank
RNG files and capturing the generators (`state_file`).

May import: `core` (and `unbroken.errors`).
"""
