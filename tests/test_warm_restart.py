"""Warm restarts on the local engine: once a run whose failures would be retried has its
ranks in the loop (here at once: UNBROKEN_WARM_UP_AFTER_S=0), a forkserver with torch and
torch._dynamo imported is started in the background, and a restarted attempt forks its
workers from it (instead of importing torch._dynamo again in each new worker, the 1+ s that
DDP's first use costs)."""

import json
import os

from conftest import run_script

SCRIPT = """
import json, os, sys
import torch
from unbroken import train
from unbroken.train import FailureConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer, prepare_model

def loop(config):
    ctx = train.get_context()
    rank, attempt = ctx.get_world_rank(), ctx.get_attempt()
    first_line = {"dynamo": "torch._dynamo" in sys.modules,
                  "forked_by_driver": os.getppid() == config["driver"]}
    with open(os.path.join(config["dir"], f"a{attempt}-r{rank}.json"), "w") as f:
        json.dump(first_line, f)
    model = prepare_model(torch.nn.Linear(2, 1))
    for it in range(1, 5):
        if (it, attempt, rank) == (3, 1, 1):
            raise RuntimeError("injected failure")
        train.report({"it": it})

result = TorchTrainer(loop, train_loop_config={"dir": sys.argv[1], "driver": os.getpid()},
                      scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(name="warm", storage_path=sys.argv[2], verbose=0,
                                           failure_config=FailureConfig(max_failures=int(sys.argv[3])))).fit()
print("ROWS", json.dumps(result.metrics_dataframe["training_iteration"].tolist()))
"""


def first_lines(directory, attempt):
    return [json.load(open(os.path.join(directory, f"a{attempt}-r{r}.json"))) for r in range(2)]


def test_a_restart_starts_its_workers_warm(tmp_path, storage):
    out = run_script(SCRIPT, str(tmp_path), storage, "1", UNBROKEN_WARM_UP_AFTER_S=0).stdout
    assert json.loads(out.split("ROWS", 1)[1]) == [1, 2, 3, 4]
    # The first attempt's workers were forked from the driver, which never imported torch._dynamo.
    assert first_lines(tmp_path, 1) == [{"dynamo": False, "forked_by_driver": True}] * 2
    # The restart's workers come from the warm forkserver: torch._dynamo is there before DDP.
    assert first_lines(tmp_path, 2) == [{"dynamo": True, "forked_by_driver": False}] * 2
