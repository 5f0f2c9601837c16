"""A Hugging Face transformers.Trainer on unbroken: killed with SIGKILL, restored, and identical
to a run that was never stopped.

    pip install 'unbroken[torch,transformers]'
    python examples/transformers_classification.py [--storage DIR]

The training function is Ray Train's Transformers recipe with the imports changed from
`ray.train` to `unbroken.train`. The model is a small BERT built from a config, so nothing is
downloaded; the data are synthetic token sequences. The script

1. runs it on 2 workers in a child process and SIGKILLs that driver after the save at step 30;
2. restores the run with `TorchTrainer.restore(path).fit()`: the Trainer resumes from the last
   committed checkpoint (`trainer.train(resume_from_checkpoint=...)`), in the middle of an epoch;
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
import transformers

from unbroken import train
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.huggingface.transformers import RayTrainReportCallback, prepare_trainer
from unbroken.train.torch import TorchTrainer

MAX_STEPS, SAVE_STEPS, KILL_AFTER_STEP = 60, 10, 30


class Sequences(torch.utils.data.Dataset):
    """Random token sequences, labelled 1 when token 7 occurs in them."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 64, (n, 16), generator=g)
        self.labels = (self.ids == 7).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]),
                "labels": self.labels[i]}


class PrintSaves(transformers.TrainerCallback):
    def on_save(self, args, state, control, **kwargs) -> None:
        if state.is_world_process_zero:
            print(f"step {state.global_step} saved", flush=True)


def train_func(config: dict) -> None:
    transformers.set_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=2))
    args = transformers.TrainingArguments(
        output_dir=config["output_dir"], max_steps=MAX_STEPS, per_device_train_batch_size=16,
        learning_rate=config["lr"], lr_scheduler_type="linear", warmup_steps=5, seed=0,
        save_strategy="steps", save_steps=SAVE_STEPS, logging_steps=SAVE_STEPS,
        eval_strategy="steps", eval_steps=SAVE_STEPS, report_to=[], disable_tqdm=True, use_cpu=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Sequences(1024, 0),
                                   eval_dataset=Sequences(128, 1))
    trainer.remove_callback(transformers.PrinterCallback)
    trainer.add_callback(RayTrainReportCallback())
    trainer.add_callback(PrintSaves())
    trainer = prepare_trainer(trainer)

    # Resume from the run's latest committed checkpoint, if there is one. (In one call:
    # unbroken.train.huggingface.transformers.train_or_resume(trainer).)
    checkpoint = train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as checkpoint_dir:
            checkpoint_path = os.path.join(checkpoint_dir, RayTrainReportCallback.CHECKPOINT_NAME)
            trainer.train(resume_from_checkpoint=checkpoint_path)
    else:
        trainer.train()


def make_trainer(storage: str, name: str) -> TorchTrainer:
    return TorchTrainer(train_func,
                        train_loop_config={"lr": 5e-3, "output_dir": os.path.join(storage, f"{name}-output")},
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name=name, storage_path=storage))


def weights(result) -> dict[str, torch.Tensor]:
    """The model weights in a run's last checkpoint (the Trainer's model.safetensors)."""
    from safetensors.torch import load_file

    with result.checkpoint.as_directory() as d:
        return load_file(os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME, "model.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--storage", default=None, help="storage_path (default: a new temp dir)")
    parser.add_argument("--train-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.train_only:  # the child process that gets killed
        make_trainer(args.storage, "transformers").fit()
        return

    storage = args.storage or tempfile.mkdtemp(prefix="unbroken-transformers-")
    path = os.path.join(storage, "transformers")
    print(f"1. training in a child process; storage: {storage}")
    child = subprocess.Popen([sys.executable, "-u", __file__, "--train-only", "--storage", storage],
                             stdout=subprocess.PIPE, text=True)
    for line in child.stdout:
        print("   " + line.rstrip())
        if line.startswith(f"step {KILL_AFTER_STEP} "):
            child.send_signal(signal.SIGKILL)
            break
    child.wait()
    print(f"   killed the driver with SIGKILL (exit code {child.returncode})")

    print(f"2. restoring {path}")
    restored = TorchTrainer.restore(path).fit()
    df = restored.metrics_dataframe
    once = list(df["step"]) == list(range(SAVE_STEPS, MAX_STEPS + 1, SAVE_STEPS))
    first = int(df[df["attempt"] == 2]["step"].min())
    print(f"   each save reported once: {once}; attempt 2 reported from step {first}")

    print("3. the same job without interruption, for comparison")
    reference = make_trainer(storage, "transformers-uninterrupted").fit()
    got, want = weights(restored), weights(reference)
    same = all(torch.equal(got[k], want[k]) for k in want)
    print(f"   final weights identical to the uninterrupted run: {same}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
