"""The CUDA path, on a real GPU: NCCL process groups, CUDA generator state, FSDP2 shards of CUDA
DTensors through DCP, an asynchronous save's pinned-memory snapshot, just-in-time checkpoints
of CUDA tensors and one GPU worker placed by the Ray engine.

Every test is marked `gpu` and skipped where `torch.cuda.is_available()` is false, so the CPU
suite is unchanged; `scripts/gpu_check.sh` runs them and fails when it finds no GPU. Tests
that need NCCL between two ranks need two GPUs (NCCL refuses two ranks on one device) and
are skipped on one, saying so. Deterministic kernels need `CUBLAS_WORKSPACE_CONFIG` in the
environment before CUDA starts: set here for the workers, which inherit it.
"""

import os

import pytest
import torch

from conftest import read_until, run_json, run_script, start_script
from loops import device_loop, exact_loop
from sharded_loops import fsdp_loop
from unbroken.execution.engine.local import visible_gpus
from unbroken.train import FailureConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer

GPUS = visible_gpus()[0]  # counted without starting CUDA here (NVML), as the engine counts them
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS == 0, reason="no CUDA GPU")]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="NCCL between two ranks needs two GPUs; this machine has one")

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
BASE = {"epochs": 2, "samples": 48, "batch_size": 4, "ckpt_every": 4, "deterministic": True}
TOTAL_STEPS = 24  # one worker: 12 steps an epoch


def fit(storage: str, name: str, loop=exact_loop, workers: int = 1, max_failures: int = 0, **config):
    return TorchTrainer(loop, train_loop_config={**BASE, **config},
                        scaling_config=ScalingConfig(num_workers=workers, use_gpu=True),
                        run_config=RunConfig(name=name, storage_path=storage, verbose=0,
                                             failure_config=FailureConfig(max_failures=max_failures))).fit()


def final_state(result) -> dict:
    """The final checkpoint's whole state (model, optimizer, scheduler, data position, values,
    gathered from shards if sharded) and each rank's generators (CUDA's among them)."""
    state = result.checkpoint.to_state_dict()
    with result.checkpoint.as_directory() as d:
        for name in sorted(os.listdir(d)):
            if name.startswith("rng_rank"):
                state[name] = torch.load(os.path.join(d, name), weights_only=True, map_location="cpu")
    return state


def losses(result) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in result.rows if "losses" in r or "indices" in r]


def assert_equal(got, want, where: str = "state") -> None:
    if isinstance(want, torch.Tensor):
        assert torch.equal(got.cpu(), want.cpu()), f"{where} differs"
    elif isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            assert_equal(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_equal(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def assert_same_run(got, want, steps: int = TOTAL_STEPS) -> None:
    """Each step once with the uninterrupted run's loss, and the final state bit for bit."""
    assert [s for s, _ in losses(got)] == list(range(1, steps + 1))
    assert losses(got) == losses(want)
    assert_equal(final_state(got), final_state(want))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return str(tmp_path_factory.mktemp("gpu"))


@pytest.fixture(scope="module")
def reference(results):
    return fit(results, "reference")


@pytest.fixture(scope="module")
def jit_reference(results):
    return fit(results, "jit-reference", jit=True)


def test_the_state_is_on_the_gpu_and_the_group_is_nccl(results):
    result = fit(results, "where", loop=device_loop)
    assert result.metrics["device"] == "cuda:0" and result.metrics["backend"] == "nccl"
    assert result.metrics["param_device"] == "cuda:0"


def test_a_worker_sigkilled_on_the_gpu_resumes_bit_for_bit(storage, reference):
    result = fit(storage, "killed", max_failures=1, kill_at=[[7, 1, 0, "sigkill"]])
    assert [a["status"] for a in run_json(result.path)["attempts"]] == ["ERRORED", "FINISHED"]
    assert run_json(result.path)["attempts"][1]["resumed_from"] == "checkpoint_000004"
    assert_same_run(result, reference)


DRIVER = """
import sys
from loops import device_loop, exact_loop
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
TorchTrainer(exact_loop, train_loop_config={**eval(sys.argv[3]), "echo": True},
             scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
             run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
"""


def test_the_driver_sigkilled_then_restored_resumes_bit_for_bit(storage, reference):
    driver = start_script(DRIVER, storage, "driver-killed", repr(BASE))
    read_until(driver, "STEP 10")
    driver.kill()
    driver.wait()
    result = TorchTrainer.restore(os.path.join(storage, "driver-killed")).fit()
    assert run_json(result.path)["attempts"][-1]["resumed_from"] in ("checkpoint_000008",
                                                                     "checkpoint_000012")
    assert_same_run(result, reference)


# In a process of its own: this one forks workers, which could not use CUDA had it started here.
GENERATOR = """
import torch
from unbroken.state.state_file import capture_rng, restore_rng
torch.cuda.manual_seed(5)
torch.randn(3, device="cuda")
state = capture_rng()
assert "cuda" in state and state["cuda"]["state"].device.type == "cpu"
want = torch.randn(4, device="cuda")
torch.cuda.manual_seed(99)
restore_rng(state)
print("SAME", torch.equal(torch.randn(4, device="cuda"), want))
"""


def test_the_cuda_generator_is_captured_and_restored():
    assert "SAME True" in run_script(GENERATOR).stdout


def test_a_checkpoint_on_the_gpu_holds_the_cuda_generator(reference):
    # exact_loop's model has dropout: its masks come from the CUDA generator, which TrainState
    # saves per rank; a resumed run that drew other masks would not end bit for bit equal.
    assert "cuda" in final_state(reference)["rng_rank0.pt"]


SNAPSHOT = """
import statistics, time
import torch
from unbroken.state.state_file import snapshot
state = {f"w{i}": torch.randn(64, 1024, 1024, device="cuda") for i in range(4)}  # 1 GiB
torch.cuda.synchronize()
pinned, plain = [], []
for _ in range(3):
    began = time.perf_counter()
    copy = snapshot(state)
    pinned.append(time.perf_counter() - began)
    began = time.perf_counter()
    {k: v.to("cpu", copy=True) for k, v in state.items()}
    plain.append(time.perf_counter() - began)
assert all(t.is_pinned() and t.device.type == "cpu" for t in copy.values())
assert all(torch.equal(copy[k], state[k].cpu()) for k in state)
print(f"1 GiB snapshot: pinned {statistics.median(pinned):.3f} s, pageable {statistics.median(plain):.3f} s")
"""


def test_an_asynchronous_save_snapshots_through_pinned_memory_and_is_timed():
    print("\n" + run_script(SNAPSHOT).stdout.strip())


def test_a_run_with_asynchronous_saves_on_the_gpu_resumes_bit_for_bit(storage, reference):
    result = fit(storage, "async", max_failures=1, async_save=True, kill_at=[[10, 1, 0, "sigkill"]])
    assert [a["status"] for a in run_json(result.path)["attempts"]] == ["ERRORED", "FINISHED"]
    saved = [r for r in result.rows if r.get("checkpoint_dir_name")]
    attempts = run_json(result.path)["attempts"]
    stalls = [s for a in attempts for s in (a.get("checkpoint_stalls") or {}).values()]
    assert saved and stalls and all(s < 1.0 for s in stalls)
    assert_same_run(result, reference)


def test_a_just_in_time_checkpoint_of_cuda_tensors_resumes_bit_for_bit(storage, jit_reference):
    result = fit(storage, "jit", max_failures=1, jit=True, die_after_report=[[6, 1, 0, "raise"]])
    first = run_json(result.path)["attempts"][0]
    assert first["jit_checkpoint"]["iteration"] == 6, first
    assert run_json(result.path)["attempts"][1]["resumed_from"] == "checkpoint_000006"
    assert_same_run(result, jit_reference)


@pytest.fixture(scope="module")
def fsdp_reference(results):
    return fit(results, "fsdp-reference", loop=fsdp_loop)


def test_fsdp2_on_one_gpu_saves_through_dcp_and_resumes_bit_for_bit(storage, fsdp_reference):
    result = fit(storage, "fsdp-killed", loop=fsdp_loop, max_failures=1, kill_at=[[7, 1, 0, "sigkill"]])
    checkpoint = result.checkpoint.path
    assert any(name.startswith("dcp") for name in os.listdir(checkpoint)), os.listdir(checkpoint)
    assert [r["step"] for r in result.rows if "indices" in r] == list(range(1, TOTAL_STEPS + 1))
    assert [r["loss"] for r in result.rows if "indices" in r] == \
        [r["loss"] for r in fsdp_reference.rows if "indices" in r]
    assert_equal(final_state(result), final_state(fsdp_reference))


@two_gpus
def test_two_ranks_on_nccl_killed_resume_bit_for_bit(storage, results):
    want = fit(results, "two-reference", workers=2)
    got = fit(storage, "two-killed", workers=2, max_failures=1, kill_at=[[5, 1, 1, "sigkill"]])
    assert_same_run(got, want, steps=TOTAL_STEPS // 2)


@pytest.mark.ray
def test_the_ray_engine_places_one_gpu_worker(tmp_path):
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        result = TorchTrainer(device_loop, scaling_config=ScalingConfig(num_workers=1, use_gpu=True,
                                                                        engine="ray"),
                              run_config=RunConfig(name="ray-gpu", storage_path=str(tmp_path),
                                                   verbose=0)).fit()
    finally:
        ray.shutdown()
    assert result.metrics["device"] == "cuda:0" and result.metrics["backend"] == "nccl"
