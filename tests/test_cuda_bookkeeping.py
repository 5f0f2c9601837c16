"""The CUDA path's bookkeeping, on the CPU: what can be checked without a GPU is checked here,
so that a regression shows before anyone runs scripts/gpu_check.sh (tests/test_gpu.py runs the
real thing). torch.cuda is replaced by a fake with one device and a generator of its own."""

import pytest
import torch

from unbroken.state import state_file
from unbroken.state.state_file import capture_rng, map_location, restore_rng, snapshot
from unbroken.worker.recovery import just_in_time as jit


class FakeCuda:
    """One CUDA device, initialised, whose generator state is a tensor the test can see."""

    def __init__(self, devices: int = 1) -> None:
        self.devices = devices
        self.state = torch.arange(16, dtype=torch.uint8)
        self.seeded: list[int] = []

    def install(self, monkeypatch) -> None:
        for name, fn in {"is_available": lambda: True, "is_initialized": lambda: True,
                         "current_device": lambda: 0, "device_count": lambda: self.devices,
                         "get_rng_state": self.get_rng_state, "set_rng_state": self.set_rng_state,
                         "manual_seed": self.seeded.append}.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def get_rng_state(self, device: int = 0) -> torch.Tensor:
        return self.state.clone()

    def set_rng_state(self, state: torch.Tensor, device: int = 0) -> None:
        self.state = state.clone()


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    fake = FakeCuda(devices=2)
    fake.install(monkeypatch)
    return fake


def test_the_cuda_generator_is_saved_with_its_device_and_set_back(cuda, tmp_path):
    saved = capture_rng()
    assert saved["cuda"]["device"] == 0 and torch.equal(saved["cuda"]["state"], cuda.state)
    path = tmp_path / "rng.pt"
    torch.save(saved, path)  # as a checkpoint's rng_rank<r>.pt, loaded the safe way
    loaded = torch.load(path, weights_only=True)
    cuda.state = torch.zeros(16, dtype=torch.uint8)
    restore_rng(loaded)
    assert torch.equal(cuda.state, torch.arange(16, dtype=torch.uint8))


def test_a_checkpoint_without_a_cuda_generator_leaves_the_gpu_s_alone(cuda):
    saved = capture_rng()
    del saved["cuda"]  # saved on a CPU-only worker
    restore_rng(saved)
    assert torch.equal(cuda.state, torch.arange(16, dtype=torch.uint8))


def test_tensors_saved_on_any_gpu_load_onto_this_rank_s(cuda):
    assert map_location() == {"cuda:0": "cuda:0", "cuda:1": "cuda:0"}


def test_without_cuda_tensors_load_onto_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert map_location() == "cpu"
    assert "cuda" not in capture_rng()


def test_per_step_random_streams_seed_the_gpu_s_generator_too(cuda):
    jit.seed_step(7, rank=1, iteration=4, generators={})
    first = list(cuda.seeded)
    jit.seed_step(7, rank=1, iteration=4, generators={})
    jit.seed_step(7, rank=0, iteration=4, generators={})
    assert len(first) == 1 and cuda.seeded[1] == first[0], "the same stream for the same step"
    assert cuda.seeded[2] != first[0], "each rank a stream of its own"


def test_a_snapshot_copies_host_tensors_and_asks_no_pinned_memory_for_them():
    asked = []
    state = {"w": torch.ones(3), "nested": [torch.zeros(2), {"step": 4}]}
    copy = snapshot(state, host=lambda t: asked.append(t) or torch.empty_like(t))
    state["w"].add_(1)
    assert asked == [], "CPU tensors are copied where they are"
    assert torch.equal(copy["w"], torch.ones(3)) and copy["nested"][1] == {"step": 4}
    assert copy["nested"][0] is not state["nested"][0]


def test_pinned_buffers_are_asked_with_the_tensor_s_shape_and_type(monkeypatch):
    made = {}

    def empty(shape, dtype, device, pin_memory):
        made.update(shape=tuple(shape), dtype=dtype, device=device, pin_memory=pin_memory)
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(state_file.torch, "empty", empty)
    buffer = state_file._pinned_like(torch.ones(2, 5, dtype=torch.bfloat16))
    assert made == {"shape": (2, 5), "dtype": torch.bfloat16, "device": "cpu", "pin_memory": True}
    assert buffer.shape == (2, 5)


def test_a_driver_that_started_cuda_starts_its_workers_from_a_forkserver(cuda, monkeypatch):
    from unbroken.execution.engine import local

    monkeypatch.delenv("UNBROKEN_START_METHOD", raising=False)
    monkeypatch.setattr(local, "_thread_count", lambda: local._clean_threads)  # no other reason to avoid fork
    assert local.start_method() == "forkserver", "a forked child cannot use CUDA its parent started"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert local.start_method() == "fork"
