"""unbroken quickstart: train, get killed with SIGKILL, restore, and match an unbroken run.

    python examples/quickstart.py [--storage DIR]

1. Starts a 2-worker DDP training job (an MLP with dropout on a synthetic regression set, with
   a learning-rate schedule) in a child process and SIGKILLs that driver mid-way, as an OOM
   killer or a lost machine would.
2. Restores the run in this process with `TorchTrainer.restore(path).fit()`: it continues
   from the last committed checkpoint, in the same run directory. `TrainState` puts back the
   model, optimizer, scheduler, data order position, epoch counter and every rank's RNG.
3. Runs the same job without interruption and checks the final weights match bit for bit.
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
from unbroken.train import CheckpointConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer, TrainState, prepare_data_loader, prepare_model

EPOCHS = 30
KILL_AFTER_EPOCH = 12


def make_dataset(n: int = 4096) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = torch.sin(x[:, :4].sum(1, keepdim=True)) + 0.1 * torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def train_loop_per_worker(config: dict) -> None:
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                              torch.nn.Dropout(0.1), torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    loader = prepare_data_loader(torch.utils.data.DataLoader(make_dataset(), batch_size=64, shuffle=True))

    # Everything the loop needs to continue exactly; restore() loads the last committed
    # checkpoint into it (and does nothing on a fresh run).
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, epoch=0)
    state.restore()

    for epoch in range(state.epoch, config["epochs"]):
        total = 0.0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        scheduler.step()
        state.epoch = epoch + 1
        metrics = {"epoch": epoch, "loss": total / len(loader)}
        state.report(metrics, checkpoint=epoch % 3 == 2)  # every third epoch, a checkpoint
        if train.get_context().get_world_rank() == 0 and os.environ.get("QUICKSTART_ECHO"):
            print(f"epoch {epoch} loss {metrics['loss']:.4f}", flush=True)


def make_trainer(storage: str, name: str) -> TorchTrainer:
    return TorchTrainer(train_loop_per_worker, train_loop_config={"lr": 0.05, "epochs": EPOCHS},
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name=name, storage_path=storage,
                                             checkpoint_config=CheckpointConfig(num_to_keep=2)))


def weights(result) -> dict[str, torch.Tensor]:
    """The model weights in a run's last checkpoint (TrainState's train_state.pt)."""
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "train_state.pt"), weights_only=True)["state_dicts"]["model"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--storage", default=None, help="storage_path (default: a new temp dir)")
    parser.add_argument("--train-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_only:  # the child process that gets killed
        make_trainer(args.storage, "quickstart").fit()
        return

    storage = args.storage or tempfile.mkdtemp(prefix="unbroken-quickstart-")
    path = os.path.join(storage, "quickstart")
    print(f"1. training in a child process; storage: {storage}")
    child = subprocess.Popen([sys.executable, "-u", __file__, "--train-only", "--storage", storage],
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "QUICKSTART_ECHO": "1"})
    for line in child.stdout:
        print("   " + line.rstrip())
        if line.startswith(f"epoch {KILL_AFTER_EPOCH} "):
            child.send_signal(signal.SIGKILL)
            break
    child.wait()
    print(f"   killed the driver with SIGKILL (exit code {child.returncode})")

    print(f"2. restoring {path}")
    print(f"   TorchTrainer.can_restore(path) = {TorchTrainer.can_restore(path)}")
    restored = TorchTrainer.restore(path).fit()
    df = restored.metrics_dataframe
    resumed = int(df[df["attempt"] == 2]["training_iteration"].min()) - 1
    print(f"   resumed from checkpoint_{resumed:06d}; finished at iteration "
          f"{restored.metrics['training_iteration']} with loss {restored.metrics['loss']:.4f}")
    print(f"   metric history: {len(df)} rows, each iteration once: "
          f"{list(df['training_iteration']) == list(range(1, EPOCHS + 1))}")

    print("3. the same job without interruption, for comparison")
    reference = make_trainer(storage, "quickstart-uninterrupted").fit()
    got, want = weights(restored), weights(reference)
    same = all(torch.equal(got[k], want[k]) for k in want)
    print(f"   final weights identical to the uninterrupted run: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
