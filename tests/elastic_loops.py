"""A loop for the elastic tests: DDP over 96 numbered samples at a fixed global batch, so a
run can change its number of workers between attempts and still be the same training."""

from __future__ import annotations

import json
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from unbroken import train
from unbroken.train.torch import TrainState, prepare_data_loader, prepare_model

SAMPLES = 96


def batch_loop(config: dict) -> None:
    """Each step takes `global_batch` samples across the ranks (`prepare_data_loader(...,
    global_batch_size=...)`), for `epochs` epochs, a checkpoint at every report. Each rank
    appends the sample ids of each step to `<dir>/ids-a<attempt>-r<rank>.jsonl`. The loop raises
    right after the report of step `stop_at[str(attempt)]`, if given (the run is stopped there
    and restored, perhaps with another number of workers). Reports the loss on the whole
    dataset, which does not depend on the number of workers."""
    ctx = train.get_context()
    rank, world, attempt = ctx.get_world_rank(), ctx.get_world_size(), ctx.get_attempt()
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(0))
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    data = TensorDataset(torch.arange(SAMPLES), x, y)
    loader = prepare_data_loader(DataLoader(data, batch_size=1, shuffle=True),
                                 global_batch_size=config["global_batch"])
    state = TrainState(model=model, optimizer=opt, loader=loader, epoch=0, step=0)
    state.restore()
    stop = config.get("stop_at", {}).get(str(attempt))
    with open(os.path.join(config["dir"], f"ids-a{attempt}-r{rank}.jsonl"), "a") as out:
        for epoch in range(state.epoch, config["epochs"]):
            for ids, xb, yb in loader:
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
                state.step += 1
                out.write(json.dumps({"epoch": epoch, "step": state.step, "ids": ids.tolist()}) + "\n")
                out.flush()
                with torch.no_grad():
                    whole = torch.nn.functional.mse_loss(model(x), y).item()
                state.report({"loss": whole, "samples": len(ids) * world}, checkpoint=True)
                if state.step == stop:
                    raise RuntimeError(f"stopped at step {stop} to change the number of workers")
            state.epoch = epoch + 1
