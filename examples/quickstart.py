"""unbroken quickstart: train, get killed with SIGKILL, restore, and match an unbroken run.

    python examples/quickstart.py [--storage DIR]

1. Starts a 2-worker DDP training job (an MLP on a synthetic regression set) in a child
   process and SIGKILLs that driver mid-way, as an OOM killer or a lost machine would.
2. Restores the run in this process with `TorchTrainer.restore(path).fit()`: it continues
   from the last committed checkpoint, in the same run directory.
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
from unbroken.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer, prepare_data_loader, prepare_model

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
                                              torch.nn.Linear(64, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    loader = prepare_data_loader(torch.utils.data.DataLoader(make_dataset(), batch_size=64, shuffle=True))

    start_epoch = 0
    checkpoint = train.get_checkpoint()
    if checkpoint:  # resume: load what the last committed checkpoint saved
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1

    for epoch in range(start_epoch, config["epochs"]):
        loader.set_epoch(epoch)  # the data order depends on the epoch only
        total = 0.0
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item()
        metrics = {"epoch": epoch, "loss": total / len(loader)}
        rank = train.get_context().get_world_rank()
        if epoch % 3 == 2 and rank == 0:  # every third epoch, rank 0 saves a checkpoint
            with tempfile.TemporaryDirectory() as d:
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch}, os.path.join(d, "state.pt"))
                train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            train.report(metrics)
        if rank == 0 and os.environ.get("QUICKSTART_ECHO"):
            print(f"epoch {epoch} loss {metrics['loss']:.4f}", flush=True)


def make_trainer(storage: str, name: str) -> TorchTrainer:
    return TorchTrainer(train_loop_per_worker, train_loop_config={"lr": 0.05, "epochs": EPOCHS},
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name=name, storage_path=storage,
                                             checkpoint_config=CheckpointConfig(num_to_keep=2)))


def weights(result) -> dict[str, torch.Tensor]:
    with result.checkpoint.as_directory() as d:
        return torch.load(os.path.join(d, "state.pt"), weights_only=True)["model"]


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
