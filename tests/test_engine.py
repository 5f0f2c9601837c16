"""The local engine's process start: fork when safe, a forkserver when the driver has threads."""

from conftest import run_script

THREADED_DRIVER = """
import torch
from unbroken import train
from unbroken.execution.engine.local import start_method
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
import sys

a = torch.randn(1500, 1500)
(a @ a).sum()  # starts the driver's OpenMP pool: a forked child would hang in its next matmul
print("METHOD", start_method(), flush=True)

def loop():  # defined in __main__: travels to the forkserver's workers by value
    import multiprocessing
    b = torch.randn(1500, 1500)
    train.report({"threads": torch.get_num_threads(), "v": float((b @ b).sum() * 0),
                  "child_start": multiprocessing.get_start_method()})

result = TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": 2}),
                      run_config=RunConfig(name="threads", storage_path=sys.argv[1])).fit()
print("THREADS", result.metrics["threads"])
print("CHILD START", result.metrics["child_start"])
"""


def test_driver_with_an_openmp_pool_uses_a_forkserver_and_does_not_hang(tmp_path):
    out = run_script(THREADED_DRIVER, str(tmp_path)).stdout
    assert "METHOD forkserver" in out
    assert "THREADS 2" in out
    # The loop's own processes (DataLoader workers) start as in a plain process, not from a
    # forkserver of the rank's, which would outlive a SIGKILLed rank with its children.
    assert "CHILD START fork" in out


FORK_DRIVER = """
import sys
from unbroken.execution.engine.local import start_method
from unbroken.train import DataParallelTrainer, RunConfig
from unbroken import train
import torch
import unbroken.train.torch
print("METHOD", start_method(), flush=True)
lock_free = {"x": 1}
def loop(config):
    train.report({"x": config["x"]})
print("X", DataParallelTrainer(loop, train_loop_config=lock_free,
      run_config=RunConfig(name="fork", storage_path=sys.argv[1])).fit().metrics["x"])
print("AFTER FIT", start_method(), flush=True)  # fit() itself starts no lasting threads
"""


def test_single_threaded_driver_forks_its_workers(tmp_path):
    out = run_script(FORK_DRIVER, str(tmp_path)).stdout
    assert "METHOD fork" in out and "X 1" in out and "AFTER FIT fork" in out
