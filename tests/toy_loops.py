"""A torch-free training loop for the command-line and callback tests (importable, so
saved by reference and resumable by `unbroken resume` in another process)."""

from __future__ import annotations

import os
import tempfile

from unbroken import train
from unbroken.train import Checkpoint


def toy_loop(config: dict) -> None:
    """Reports loss = 1/iteration + 0.1 * attempt and acc each iteration, with a checkpoint
    every `ckpt_every` iterations.

    Knobs: fail_at=[[iteration, attempt], ...] raises there; echo prints "REPORTED n";
    block_fifo + block_at=[iteration, attempt]: after that report, print "BLOCKING" and block
    reading the FIFO.
    """
    attempt = train.get_context().get_attempt()
    start = 0
    if (ckpt := train.get_checkpoint()) is not None:
        with ckpt.as_directory() as d, open(os.path.join(d, "it.txt")) as f:
            start = int(f.read())
    fail_at = [list(x) for x in config.get("fail_at", [])]
    for it in range(start + 1, config["iterations"] + 1):
        if [it, attempt] in fail_at:
            raise RuntimeError(f"injected failure at iteration {it}")
        metrics = {"loss": 1.0 / it + 0.1 * attempt, "acc": it / config["iterations"]}
        if it % config.get("ckpt_every", 3) == 0:
            with tempfile.TemporaryDirectory() as d:
                with open(os.path.join(d, "it.txt"), "w") as f:
                    f.write(str(it))
                with open(os.path.join(d, "weights.bin"), "wb") as f:
                    f.write(bytes(range(256)) * 16)
                train.report(metrics, checkpoint=Checkpoint.from_directory(d))
        else:
            train.report(metrics)
        if config.get("echo"):
            print(f"REPORTED {it}", flush=True)
        if config.get("block_fifo") and [it, attempt] == list(config["block_at"]):
            print("BLOCKING", flush=True)
            with open(config["block_fifo"]) as f:
                f.read()
