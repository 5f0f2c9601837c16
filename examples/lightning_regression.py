"""A PyTorch Lightning Trainer on unbroken: killed with SIGKILL, resumed, and identical to a run
that was never stopped.

    pip install 'unbroken[torch,lightning]'
    python examples/lightning_regression.py [--storage DIR]

The training function is Ray Train's Lightning recipe with the imports changed from
`ray.train` to `unbroken.train`. The script

1. runs it on 2 workers in a child process and SIGKILLs that driver after epoch 3;
2. runs the same child command again: the run, found by its name, continues from its last
   committed checkpoint (Lightning's `trainer.fit(ckpt_path=...)`, with the random generators
   that unbroken saves beside Lightning's checkpoint);
3. trains the same job without interruption and compares the final weights, bit for bit.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile

import torch

from unbroken import train
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.lightning import (
    RayDDPStrategy,
    RayLightningEnvironment,
    RayTrainReportCallback,
    pl,
    prepare_trainer,
)
from unbroken.train.torch import TorchTrainer

EPOCHS = 8
KILL_AFTER_EPOCH = 3


class Regressor(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)]


def make_dataset(n: int, seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.TensorDataset(x, torch.sin(x[:, :4].sum(1, keepdim=True)))


class PrintEpochs(pl.Callback):
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.global_rank == 0:
            print(f"epoch {trainer.current_epoch} val_loss {trainer.callback_metrics['val_loss']:.4f}",
                  flush=True)


def train_func(config: dict) -> None:
    torch.manual_seed(0)
    model = Regressor(config["lr"])
    train_loader = torch.utils.data.DataLoader(make_dataset(2048, 0), batch_size=64, shuffle=True)
    val_loader = torch.utils.data.DataLoader(make_dataset(512, 1), batch_size=256)
    trainer = pl.Trainer(max_epochs=config["epochs"], devices="auto", accelerator="auto",
                         strategy=RayDDPStrategy(), plugins=[RayLightningEnvironment()],
                         callbacks=[RayTrainReportCallback(), PrintEpochs()], enable_checkpointing=False,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = prepare_trainer(trainer)

    # Resume from the run's latest committed checkpoint, if there is one. (In one call:
    # unbroken.train.lightning.fit_or_resume(trainer, model, train_dataloaders=..., ...).)
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as ckpt_dir:
            ckpt_path = os.path.join(ckpt_dir, RayTrainReportCallback.CHECKPOINT_NAME)
            trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=val_loader,
                        ckpt_path=ckpt_path)
    else:
        trainer.fit(model, train_dataloaders=train_loader, val_dataloaders=val_loader)


def make_trainer(storage: str, name: str) -> TorchTrainer:
    return TorchTrainer(train_func, train_loop_config={"lr": 0.01, "epochs": EPOCHS},
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name=name, storage_path=storage))


def weights(result) -> dict[str, torch.Tensor]:
    """The model weights in a run's last checkpoint (Lightning's checkpoint.ckpt)."""
    with result.checkpoint.as_directory() as d:
        path = os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME)
        return torch.load(path, weights_only=False)["state_dict"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--storage", default=None, help="storage_path (default: a new temp dir)")
    parser.add_argument("--train-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_only:  # the training script itself, run as a child process
        result = make_trainer(args.storage, "lightning").fit()
        print(f"finished: iteration {result.metrics['training_iteration']}, "
              f"attempt {result.metrics['attempt']}")
        return

    storage = args.storage or tempfile.mkdtemp(prefix="unbroken-lightning-")
    script = [sys.executable, "-u", __file__, "--train-only", "--storage", storage]
    print(f"1. training in a child process; storage: {storage}")
    child = subprocess.Popen(script, stdout=subprocess.PIPE, text=True)
    for line in child.stdout:
        print("   " + line.rstrip())
        if line.startswith(f"epoch {KILL_AFTER_EPOCH} "):
            child.send_signal(signal.SIGKILL)
            break
    child.wait()
    print(f"   killed the driver with SIGKILL (exit code {child.returncode})")

    print("2. the same script again: it resumes the run by its name")
    for line in subprocess.run(script, stdout=subprocess.PIPE, text=True, check=True).stdout.splitlines():
        print("   " + line)
    resumed = train.Result.from_path(os.path.join(storage, "lightning"))
    df = resumed.metrics_dataframe
    print(f"   each epoch reported once: {list(df['epoch']) == list(range(EPOCHS))}; "
          f"attempt 2 resumed from epoch {int(df[df['attempt'] == 2]['epoch'].min())}")

    print("3. the same job without interruption, for comparison")
    reference = make_trainer(storage, "lightning-uninterrupted").fit()
    got, want = weights(resumed), weights(reference)
    same = all(torch.equal(got[k], want[k]) for k in want)
    print(f"   final weights identical to the uninterrupted run: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
