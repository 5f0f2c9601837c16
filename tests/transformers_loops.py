"""A small Hugging Face Transformers job for the integration tests (importable, so saved by
reference): a two-layer BERT built from a config (nothing downloaded) with dropout, AdamW and a
linear schedule, classifying synthetic token sequences."""

from __future__ import annotations

import os
import signal

import torch
import transformers

from integration_checks import block_at
from unbroken import train
from unbroken.train.huggingface.transformers import (
    RayTrainReportCallback,
    prepare_trainer,
    train_or_resume,
)


class Sequences(torch.utils.data.Dataset):
    """Random token sequences labelled by whether token 5 occurs in them."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 30, (n, 12), generator=g)
        self.labels = (self.ids == 5).any(dim=1).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(12, dtype=torch.long),
                "labels": self.labels[i]}


def tiny_bert() -> transformers.PreTrainedModel:
    config = transformers.BertConfig(vocab_size=32, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=2, intermediate_size=32,
                                     max_position_embeddings=16, num_labels=2)
    return transformers.BertForSequenceClassification(config)


class Probe(transformers.TrainerCallback):
    """Test knobs: `kill_at=[step, attempt, rank]` SIGKILLs that rank when it begins that step;
    `echo` prints "SAVED <step>" on rank 0 after each save's report, and `block_at=[step, fifo]`
    then blocks it in attempt 1; every log entry records the global step the Trainer started (or
    resumed) from as `start_step`."""

    def __init__(self, config: dict) -> None:
        self.config = config
        self.start_step = None

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        self.start_step = state.global_step

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        kill = self.config.get("kill_at")
        attempt = train.get_context().get_attempt()
        if kill and [state.global_step + 1, attempt, args.process_index] == list(kill):
            os.kill(os.getpid(), signal.SIGKILL)

    def on_log(self, args, state, control, logs=None, **kwargs) -> None:
        if state.log_history:
            state.log_history[-1]["start_step"] = self.start_step

    def on_save(self, args, state, control, **kwargs) -> None:
        if args.process_index == 0:
            if self.config.get("echo"):
                print(f"SAVED {state.global_step}", flush=True)
            block_at(self.config, state.global_step)


def transformers_loop(config: dict) -> None:
    """The Ray Train Transformers recipe, ported by imports, resuming with `train_or_resume`."""
    ctx = train.get_context()
    # One directory per trial of a sweep; with per_rank_dir, one per rank, as on separate nodes.
    output_dir = os.path.join(config["output_dir"], ctx.get_trial_name() or "",
                              f"rank{ctx.get_world_rank()}" if config.get("per_rank_dir") else "")
    args = transformers.TrainingArguments(
        output_dir=output_dir,
        max_steps=config.get("max_steps", 12), per_device_train_batch_size=4, per_device_eval_batch_size=16,
        learning_rate=config.get("lr", 5e-3), lr_scheduler_type="linear", warmup_steps=2, seed=0,
        save_strategy="steps", save_steps=3, logging_steps=3, eval_strategy="steps", eval_steps=3,
        report_to=[], disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
    transformers.set_seed(0)  # before the model's initialisation, which draws from the generators
    trainer = transformers.Trainer(model=tiny_bert(), args=args, train_dataset=Sequences(64, 1),
                                   eval_dataset=Sequences(16, 2))
    trainer.add_callback(RayTrainReportCallback())
    trainer.add_callback(Probe(config))  # after the report callback: "SAVED" follows the report
    trainer = prepare_trainer(trainer)
    train_or_resume(trainer)


def final_weights(result) -> dict[str, torch.Tensor]:
    """The model weights in a result's checkpoint."""
    from safetensors.torch import load_file

    with result.checkpoint.as_directory() as d:
        return load_file(os.path.join(d, RayTrainReportCallback.CHECKPOINT_NAME, "model.safetensors"))


FETCHED: dict[str, list[int]] = {}


class Numbered(Sequences):
    """Sequences that record, under their `name`, which samples this process fetched."""

    def __init__(self, n: int, seed: int, name: str) -> None:
        super().__init__(n, seed)
        self.name = name

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        FETCHED.setdefault(self.name, []).append(int(i))
        return super().__getitem__(i)


def shard_loop(config: dict) -> None:
    """One epoch of training and one evaluation on `train.get_dataset_shard` datasets; each rank
    writes the samples it fetched to <out>/fetched<rank>.json."""
    import json
    import warnings

    rank = train.get_context().get_world_rank()
    args = transformers.TrainingArguments(
        output_dir=os.path.join(config["out"], f"rank{rank}"), max_steps=config["steps"],
        per_device_train_batch_size=4, per_device_eval_batch_size=4, save_strategy="no", eval_strategy="no",
        logging_strategy="no", report_to=[], disable_tqdm=True, use_cpu=True, dataloader_num_workers=0)
    trainer = transformers.Trainer(model=tiny_bert(), args=args,
                                   train_dataset=train.get_dataset_shard("train"),
                                   eval_dataset=train.get_dataset_shard("eval"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nothing is reported: this loop only counts
        prepare_trainer(trainer)
    trainer.train()
    trainer.evaluate()
    with open(os.path.join(config["out"], f"fetched{rank}.json"), "w") as f:
        json.dump(FETCHED, f)
    # Without prepare_trainer the report callback refuses to train on a shard.
    unprepared = transformers.Trainer(model=tiny_bert(), args=args, callbacks=[RayTrainReportCallback()],
                                      train_dataset=train.get_dataset_shard("train"))
    try:
        unprepared.train()
        refused = ""
    except Exception as e:
        refused = f"{type(e).__name__}: {e}"
    train.report({"step": trainer.state.global_step, "refused": refused})
