"""Training loops with a sharded model (FSDP2 on CPU, gloo) for tests/test_sharded.py."""

from __future__ import annotations

import torch

from loops import AugmentedDataset, _die, seed_everything, sgd_step
from unbroken import train


def build_fsdp(width: int = 32, sharded: bool = True) -> torch.nn.Module:
    """The same weights on every rank (seeded), then each rank keeps its shard of them."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 1))
    if sharded:
        from torch.distributed.fsdp import fully_shard

        for layer in (model[0], model[3], model[5]):
            fully_shard(layer)
        fully_shard(model)
    return model


def dump_full_state(state, path: str) -> None:
    """Rank 0 writes the model's and optimizer's whole state to `path` (collective)."""
    from unbroken.state.sharded import full_state_dicts

    full = full_state_dicts(state.model, state.optimizer)
    if train.get_context().get_world_rank() == 0:
        torch.save(full, path)


def fsdp_loop(config: dict) -> None:
    """exact_loop's job (dropout, augmentation, AdamW, a per-step scheduler) on an FSDP2 model,
    checkpointed by TrainState every `ckpt_every` steps.

    Faults: kill_at=[[step, attempt, rank, mode], ...]; `echo` prints "STEP n" on rank 0 after
    each report. `dump_restored`: a path where rank 0 writes the whole model and optimizer
    state right after restore(); `dump_at`: [step, path], the same right after that step's
    report (the state that step's checkpoint holds). `stop_after`: the last step to train.
    """
    from unbroken.train.torch import TrainState, prepare_data_loader

    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    model = build_fsdp(sharded=config.get("sharded", True))
    seed_everything(100 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.8)
    data = torch.utils.data.DataLoader(AugmentedDataset(config.get("samples", 48)),
                                       batch_size=config.get("batch_size", 4), shuffle=True)
    loader = prepare_data_loader(data)
    state = TrainState(model=model, optimizer=opt, scheduler=sched, loader=loader, epoch=0, step=0,
                       checkpoint_upload_mode="ASYNC" if config.get("async_save") else "SYNC")
    restored = state.restore()
    if config.get("dump_restored") and restored:
        dump_full_state(state, config["dump_restored"])
    kills = [tuple(k) for k in config.get("kill_at", [])]
    for epoch in range(state.epoch, config["epochs"]):
        for x, y, idx in loader:
            loss = sgd_step(model, opt, sched, x, y)
            state.step += 1
            for step, attempt, kill_rank, mode in kills:
                if (step, attempt, kill_rank) == (state.step, ctx.get_attempt(), rank):
                    _die(mode, step)
            every = [idx.tolist()]
            if torch.distributed.is_initialized():
                every = [None] * world
                torch.distributed.all_gather_object(every, idx.tolist())
            state.report({"loss": loss.item(), "epoch": epoch, "step": state.step, "indices": every},
                         checkpoint=state.step % config.get("ckpt_every", 4) == 0)
            if config.get("dump_at") and config["dump_at"][0] == state.step:
                dump_full_state(state, config["dump_at"][1])
            if config.get("echo") and rank == 0:
                print(f"STEP {state.step}", flush=True)
            if state.step == config.get("stop_after"):
                return
        state.epoch = epoch + 1
    state.report({"final": True, "step": state.step}, checkpoint=True)

