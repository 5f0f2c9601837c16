"""A small PyTorch Lightning job for the integration tests (importable, so saved by reference):
a regressor with dropout, AdamW and a StepLR schedule on synthetic data, trained with
unbroken.train.lightning's strategy, environment and report callback."""

from __future__ import annotations

import os
import signal

import torch

from integration_checks import block_at
from unbroken import train
from unbroken.train.lightning import (
    RayDDPStrategy,
    RayFSDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    fit_or_resume,
    pl,
    prepare_trainer,
)


def regression_data(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x @ torch.linspace(-1, 1, 8).unsqueeze(1) + 0.1)


class Regressor(pl.LightningModule):
    """Dropout makes the result depend on the random generators; the schedule and AdamW on the
    optimizer and scheduler state. Logs the global step that training (re)started from."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                       torch.nn.Linear(16, 1))
        self.start_step = 0

    def on_train_start(self) -> None:
        self.start_step = self.trainer.global_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, on_step=False, on_epoch=True)
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"], on_step=False, on_epoch=True)
        self.log("start_step", float(self.start_step), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)]


class Probe(pl.Callback):
    """Test knobs: `kill_at=[epoch, attempt, rank]` SIGKILLs that rank at the epoch's first batch,
    `preempt_at=[epoch, attempt, 0]` has rank 0 send SIGTERM to the driver there;
    `echo` prints "REPORTED <epoch>" on rank 0 once the epoch's report has been sent;
    `block_at=[epoch, fifo]` then blocks rank 0 of attempt 1 reading `fifo` (never written)."""

    def __init__(self, config: dict) -> None:
        self.config = config

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        kill = self.config.get("kill_at")
        here = [trainer.current_epoch, train.get_context().get_attempt(), trainer.global_rank]
        if kill and here == list(kill):
            os.kill(os.getpid(), signal.SIGKILL)
        if batch_idx == 0 and self.config.get("preempt_at") == here[:2] + [0]:
            os.kill(os.getppid(), signal.SIGTERM)  # the driver (workers are forked from it)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            if self.config.get("echo"):
                print(f"REPORTED {trainer.current_epoch}", flush=True)
            block_at(self.config, trainer.current_epoch)


def lightning_loop(config: dict) -> None:
    """The Ray Train Lightning recipe, ported by imports, resuming with `fit_or_resume`."""
    torch.manual_seed(0)
    model = Regressor(config.get("lr", 0.02))
    train_loader = torch.utils.data.DataLoader(regression_data(64, 1), batch_size=8, shuffle=True)
    val_loader = torch.utils.data.DataLoader(regression_data(32, 2), batch_size=16)
    strategy = RayFSDPStrategy() if config.get("fsdp") else RayDDPStrategy()
    trainer = pl.Trainer(max_epochs=config["epochs"], accelerator="cpu", devices="auto", strategy=strategy,
                         plugins=[RayLightningEnvironment()],
                         callbacks=[RayTrainReportCallback(), Probe(config)], enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = prepare_trainer(trainer)
    fit_or_resume(trainer, model, train_dataloaders=train_loader, val_dataloaders=val_loader)


def final_weights(result) -> dict[str, torch.Tensor]:
    """The model weights in a result's checkpoint."""
    with result.checkpoint.as_directory() as d:
        path = os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME)
        return torch.load(path, weights_only=False)["state_dict"]


class IndexModel(pl.LightningModule):
    """A model over datasets of sample indices that records which indices this rank trained and
    validated on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(1, 1)
        self.seen: dict[str, list[int]] = {"train": [], "val": []}

    def training_step(self, batch, batch_idx):
        self.seen["train"] += batch.tolist()
        x = batch.float().unsqueeze(1)
        return torch.nn.functional.mse_loss(self.net(x), x)

    def validation_step(self, batch, batch_idx):
        self.seen["val"] += batch.tolist()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def quiet_trainer(**kwargs) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                      enable_checkpointing=False, **kwargs)


def shard_loop(config: dict) -> None:
    """One epoch over `train.get_dataset_shard` loaders with Ray's strategy; each rank writes the
    indices it saw to <out>/seen<rank>.json."""
    import json

    from torch.utils.data import DataLoader

    model = IndexModel()
    trainer = prepare_trainer(quiet_trainer(max_epochs=1, devices="auto", strategy=RayDDPStrategy(),
                                            plugins=[RayLightningEnvironment()], num_sanity_val_steps=0))
    trainer.fit(model, DataLoader(train.get_dataset_shard("train"), batch_size=4, shuffle=True),
                DataLoader(train.get_dataset_shard("val"), batch_size=4))
    rank = train.get_context().get_world_rank()
    with open(os.path.join(config["out"], f"seen{rank}.json"), "w") as f:
        json.dump(model.seen, f)
    train.report({"steps": trainer.global_step})


def no_strategy_loop(config: dict) -> None:
    """Ray's checkpoint snippet as it is, without the Ray strategy: each rank's Trainer trains
    alone. `differ`: each rank starts from other weights."""
    rank = train.get_context().get_world_rank()
    torch.manual_seed(rank if config.get("differ") else 0)
    trainer = quiet_trainer(max_epochs=1, callbacks=[RayTrainReportCallback()])
    trainer.fit(Regressor(0.02), torch.utils.data.DataLoader(regression_data(16, 1), batch_size=8))
