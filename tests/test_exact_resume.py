"""Exact resume: a run killed at any step and resumed equals the uninterrupted run, bit for bit.

The kill steps are drawn from a seeded generator. The seed is new on every test session and
is printed in every assertion message; set UNBROKEN_TEST_SEED to replay a failure.
"""

import json
import os
import random

import pytest
import torch

from conftest import read_until, run_script, start_script
from loops import AugmentedDataset, exact_loop
from unbroken.errors import StateMismatchError, TrainingInterruptedError
from unbroken.state.sample_seed import sample_seed, seed_generators
from unbroken.state.sampler import ResumableSampler
from unbroken.state.state_file import STATE_FILE, capture_rng, restore_rng, rng_file
from unbroken.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from unbroken.train.torch import (
    DeviceDataLoader,
    ResumableDataLoader,
    TorchTrainer,
    TrainState,
    prepare_data_loader,
)

SEED = int(os.environ.get("UNBROKEN_TEST_SEED") or random.SystemRandom().randrange(2**32))
BASE = {"epochs": 3, "samples": 48, "batch_size": 4, "ckpt_every": 4}  # 2 workers: 6 steps an epoch
TOTAL_STEPS = 18


def rng_for(name: str) -> random.Random:
    return random.Random(f"{SEED}-{name}")


def fit(storage, name, workers=2, max_failures=0, **config):
    return TorchTrainer(exact_loop, train_loop_config={**BASE, **config},
                        scaling_config=ScalingConfig(num_workers=workers),
                        run_config=RunConfig(name=name, storage_path=storage,
                                             failure_config=FailureConfig(max_failures=max_failures))).fit()


def random_kills(rng: random.Random, count: int, modes: tuple[str, ...]) -> list[list]:
    """`count` kills, one per attempt, each at a step the attempt is sure to reach: after the
    last checkpoint the previous kill can have left (kills happen before that step's report)."""
    kills, resumed = [], 0
    for attempt in range(1, count + 1):
        step = rng.randint(resumed + 1, TOTAL_STEPS)
        kills.append([step, attempt, rng.randrange(2), rng.choice(modes)])
        resumed = (step - 1) // BASE["ckpt_every"] * BASE["ckpt_every"]
    return kills


def steps(result) -> list[dict]:
    """One dict per training step (the final checkpoint row left out), each step once."""
    df = result.metrics_dataframe
    rows = df[df["losses"].map(lambda v: isinstance(v, list))]
    return [{"step": int(r["step"]), "epoch": int(r["epoch"]), "losses": r["losses"], "indices": r["indices"]}
            for _, r in rows.iterrows()]


def final_files(result) -> dict:
    with result.checkpoint.as_directory() as d:
        return {name: torch.load(os.path.join(d, name), weights_only=True)
                for name in sorted(os.listdir(d)) if name.endswith(".pt")}


def assert_identical(got, want, where: str, context: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape \
            and torch.equal(got, want), f"{where} differs ({context})"
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{where} keys differ: {sorted(got)} vs {sorted(want)} ({context})"
        for key in want:
            assert_identical(got[key], want[key], f"{where}[{key!r}]", context)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where} lengths differ ({context})"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_identical(g, w, f"{where}[{i}]", context)
    else:
        assert got == want, f"{where}: {got!r} != {want!r} ({context})"


def assert_same_run(got, want, context: str) -> None:
    got_steps, want_steps = steps(got), steps(want)
    assert [s["step"] for s in got_steps] == list(range(1, TOTAL_STEPS + 1)), context
    for g, w in zip(got_steps, want_steps, strict=True):
        assert g == w, f"step {w['step']} differs: {g} vs {w} ({context})"
    got_files, want_files = final_files(got), final_files(want)
    assert sorted(got_files) == sorted(want_files) == sorted([STATE_FILE, rng_file(0), rng_file(1)]), context
    # Model, optimizer, scheduler, data position, plain values and every rank's RNG.
    assert_identical(got_files, want_files, "final checkpoint", context)


def attempts(result) -> list[dict]:
    return json.load(open(os.path.join(result.path, ".unbroken", "run.json")))["attempts"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return str(tmp_path_factory.mktemp("exact"))


@pytest.fixture(scope="module")
def reference(results):
    """The uninterrupted run: 2 workers, augmentation in the training process."""
    return fit(results, "reference")


@pytest.fixture(scope="module")
def seeded_reference(results):
    """The uninterrupted run with per-sample seeding (which DataLoader workers get by default)."""
    return fit(results, "seeded-reference", seed_per_sample=True)


# -- whole runs on 2 workers ------------------------------------------------------------


def test_uninterrupted_run_trains_and_sees_each_sample_once_per_epoch(reference):
    rows = steps(reference)
    assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1))
    for epoch in range(3):
        seen = [i for r in rows if r["epoch"] == epoch for rank in r["indices"] for i in rank]
        assert sorted(seen) == list(range(48))
    orders = [[i for r in rows if r["epoch"] == e for i in r["indices"][0]] for e in range(3)]
    assert orders[0] != orders[1], "a new order each epoch"
    assert rows[0]["losses"][0] != rows[0]["losses"][1], "ranks see different data"


@pytest.mark.parametrize("mode", ["raise", "exit", "sigkill"])
def test_killed_workers_resume_bit_for_bit(storage, reference, mode):
    kills = random_kills(rng_for(f"kill-{mode}"), 2, (mode,))
    context = f"UNBROKEN_TEST_SEED={SEED}, kill_at={kills}"
    result = fit(storage, f"killed-{mode}", max_failures=2, kill_at=kills)
    assert [a["status"] for a in attempts(result)] == ["ERRORED", "ERRORED", "FINISHED"], context
    assert_same_run(result, reference, context)


def test_dataloader_workers_resume_bit_for_bit(storage, seeded_reference):
    # Augmentation in 2 DataLoader worker processes per rank, killed mid-run; it must equal the
    # uninterrupted run that fetched every sample in the training process (per-sample seeds).
    kills = random_kills(rng_for("dataloader-workers"), 1, ("raise", "sigkill"))
    context = f"UNBROKEN_TEST_SEED={SEED}, kill_at={kills}"
    result = fit(storage, "dl-workers", max_failures=1, kill_at=kills, num_workers=2)
    assert [a["status"] for a in attempts(result)] == ["ERRORED", "FINISHED"], context
    assert_same_run(result, seeded_reference, context)


def test_failed_run_restored_from_its_path_resumes_bit_for_bit(storage, reference):
    kills = random_kills(rng_for("restore"), 1, ("raise",))
    context = f"UNBROKEN_TEST_SEED={SEED}, kill_at={kills}"
    with pytest.raises(TrainingFailedError):
        fit(storage, "restored", kill_at=kills)
    result = TorchTrainer.restore(os.path.join(storage, "restored")).fit()
    assert [a["status"] for a in attempts(result)] == ["ERRORED", "FINISHED"], context
    assert_same_run(result, reference, context)


def test_preempted_run_checkpoints_by_itself_and_resumes_bit_for_bit(storage, reference):
    # The run checkpoints only when asked: TrainState.report saves on the driver's request
    # after SIGTERM, mid-epoch, and the restored run still equals the reference.
    step = rng_for("preempt").randint(2, TOTAL_STEPS - 4)
    context = f"UNBROKEN_TEST_SEED={SEED}, SIGTERM to the driver at step {step}"
    with pytest.raises(TrainingInterruptedError):
        fit(storage, "preempted", ckpt_every=1000, preempt_at=[step, 1], driver_pid=os.getpid())
    result = TorchTrainer.restore(os.path.join(storage, "preempted")).fit()
    first, second = attempts(result)
    assert first["status"] == "PREEMPTED" and second["resumed_iteration"] >= step, context
    assert_same_run(result, reference, context)


DRIVER = """
import sys
import torch._dynamo  # as conftest does: DDP's first use would import it in every worker
from loops import exact_loop
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
TorchTrainer(exact_loop, train_loop_config={**eval(sys.argv[3]), "echo": True},
             scaling_config=ScalingConfig(num_workers=2),
             run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
"""


@pytest.mark.slow  # a fresh driver process imports torch and torch._dynamo: about 10 s here
def test_driver_sigkilled_then_restored_resumes_bit_for_bit(storage, reference):
    step = rng_for("driver").randint(BASE["ckpt_every"] + 1, TOTAL_STEPS - 1)
    context = f"UNBROKEN_TEST_SEED={SEED}, driver killed after step {step} was reported"
    driver = start_script(DRIVER, storage, "driver-killed", repr(BASE))
    read_until(driver, f"STEP {step}")
    driver.kill()
    driver.wait()
    result = TorchTrainer.restore(os.path.join(storage, "driver-killed")).fit()
    assert len(attempts(result)) == 2 and attempts(result)[1]["status"] == "FINISHED", context
    assert_same_run(result, reference, context)


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(10))
def test_soak_random_kills_resume_bit_for_bit(storage, reference, seeded_reference, trial):
    rng = rng_for(f"soak-{trial}")
    num_workers = rng.choice([0, 2])
    kills = random_kills(rng, rng.randint(1, 4), ("raise", "exit", "sigkill"))
    context = f"UNBROKEN_TEST_SEED={SEED}, trial {trial}, num_workers={num_workers}, kill_at={kills}"
    result = fit(storage, f"soak-{trial}", max_failures=len(kills), kill_at=kills, num_workers=num_workers)
    assert_same_run(result, seeded_reference if num_workers else reference, context)


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_changing_the_number_of_workers_sees_each_sample_once_per_epoch(storage, before, after):
    total = 3 * 48 // (4 * before)
    ckpt_every = 5  # never an epoch boundary (6 or 12 steps an epoch): a mid-epoch resume
    step = rng_for(f"resize-{before}-{after}").randint(ckpt_every + 1, total)
    kills = [[step, 1, 0, "raise"]]
    context = f"UNBROKEN_TEST_SEED={SEED}, kill_at={kills}"
    name = f"resize-{before}-{after}"
    with pytest.raises(TrainingFailedError):
        fit(storage, name, workers=before, ckpt_every=ckpt_every, kill_at=kills)
    path = os.path.join(storage, name)
    result = TorchTrainer.restore(path, scaling_config=ScalingConfig(num_workers=after)).fit()
    resumed = attempts(result)[1]["resumed_iteration"]
    assert resumed % ckpt_every == 0 and resumed % (total // 3) != 0, context
    rows = steps(result)
    assert len({len(r["indices"]) for r in rows}) == 2, f"both worker counts ran ({context})"
    for epoch in range(3):
        seen = [i for r in rows if r["epoch"] == epoch for rank in r["indices"] for i in rank]
        assert sorted(seen) == list(range(48)), f"epoch {epoch} ({context})"
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), context


# -- the sampler ------------------------------------------------------------------------


@pytest.mark.parametrize("n,world,drop_last", [(10, 2, False), (10, 3, False), (10, 3, True), (7, 4, False)])
def test_fresh_epochs_follow_distributed_sampler_order(n, world, drop_last):
    for epoch in range(3):
        for rank in range(world):
            ours = ResumableSampler(n, num_replicas=world, rank=rank, seed=5, drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs = torch.utils.data.DistributedSampler(range(n), num_replicas=world, rank=rank, seed=5,
                                                         drop_last=drop_last)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def _consume(samplers, batches: int, batch_size: int) -> list[list[int]]:
    out = []
    for s in samplers:
        taken = s.indices()[:batches * batch_size]
        s.advance(len(taken))
        out.append(taken)
    return out


def test_sampler_resumes_the_same_layout_and_reshares_a_new_one():
    rng = rng_for("sampler")
    for trial in range(200):
        n, batch = rng.randint(1, 40), rng.randint(1, 4)
        worlds = [rng.randint(1, 4) for _ in range(rng.randint(1, 4))]
        context = f"UNBROKEN_TEST_SEED={SEED}, trial {trial}, n={n}, batch={batch}, worlds={worlds}"
        # Uninterrupted with the first world size: what every rank yields in the epoch.
        plain = [ResumableSampler(n, num_replicas=worlds[0], rank=r, seed=trial) for r in range(worlds[0])]
        want = [s.indices() for s in plain]
        # The same epoch, stopped and resumed at random points, sometimes with another world size.
        state = ResumableSampler(n, num_replicas=worlds[0], seed=trial).state_dict()
        seen: list[int] = []
        same_world_parts: list[list[list[int]]] = []
        for world in worlds:
            samplers = [ResumableSampler(n, num_replicas=world, rank=r, seed=trial) for r in range(world)]
            for s in samplers:
                s.load_state_dict(state)
            left = len(samplers[0])
            assert all(len(s) == left for s in samplers), context
            batches = rng.randint(0, -(-left // batch)) if world != worlds[-1] else -(-left // batch)
            part = _consume(samplers, batches, batch)
            seen += [i for p in part for i in p]
            if world == worlds[0] and all(w == worlds[0] for w in worlds):
                same_world_parts.append(part)
            state = samplers[0].state_dict()
            assert all(s.state_dict() == state for s in samplers), context
        assert state["position"] == n, context
        assert set(seen) == set(range(n)), context
        assert len(seen) - n < sum(worlds), f"only padding repeats samples ({context})"
        if same_world_parts:  # never resized: exactly the uninterrupted sequence, padding included
            assert [sum((p[r] for p in same_world_parts), []) for r in range(worlds[0])] == want, context


def test_sampler_state_refuses_another_dataset_or_seed():
    state = ResumableSampler(10, seed=1).state_dict()
    with pytest.raises(StateMismatchError, match="num_samples=10.*Hint"):
        ResumableSampler(11, seed=1).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="seed=1"):
        ResumableSampler(10, seed=2).load_state_dict(state)


# -- the loader, in this process (one rank) --------------------------------------------------


def _loader(num_workers=0, seed_per_sample=None, **kw):
    data = torch.utils.data.DataLoader(AugmentedDataset(20), batch_size=3, shuffle=True,
                                       num_workers=num_workers, **kw)
    return prepare_data_loader(data, move_to_device=False, seed_per_sample=seed_per_sample)


def _batches(loader, limit=None):
    out = []
    for x, _y, idx in loader:
        out.append((x, idx.tolist()))
        if limit is not None and len(out) == limit:
            break
    return out


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x1, x2) and i1 == i2
                                    for (x1, i1), (x2, i2) in zip(a, b, strict=True))


def test_loader_resumes_mid_epoch_with_the_next_unseen_batches():
    reference = _loader()
    seed_generators(0)
    want = _batches(reference) + _batches(reference)  # two epochs, augmentation from this process's RNG
    assert reference.epoch == 2 and len(reference) == 7
    seed_generators(0)
    first = _loader()
    got = _batches(first, limit=4)
    state, rng = first.state_dict(), capture_rng()
    assert state["epoch"] == 0 and state["position"] == 12
    second = _loader()
    second.load_state_dict(state)
    restore_rng(rng)
    second.set_epoch(0)  # the usual call at the top of an epoch keeps a mid-epoch position
    got += _batches(second) + _batches(second)
    assert _same(got, want)


def test_seeded_augmentation_does_not_depend_on_num_workers_or_resume_point():
    want = _batches(_loader(seed_per_sample=True))
    first = _loader(num_workers=2)
    assert first.seeds_per_sample, "seeded by default with DataLoader workers"
    got = _batches(first, limit=2)
    second = _loader(num_workers=2)
    second.load_state_dict(first.state_dict())
    got += _batches(second)
    assert _same(got, want)
    # A sample's augmentation is a function of (seed, epoch, index) alone.
    index = want[0][1][0]
    seed_generators(sample_seed(0, 0, index))
    assert torch.equal(AugmentedDataset(20)[index][0], want[0][0][0])


def test_fetching_in_the_training_process_does_not_move_its_rng():
    loader = _loader(seed_per_sample=True)
    torch.manual_seed(3)
    before = torch.get_rng_state()
    _batches(loader)
    assert torch.equal(torch.get_rng_state(), before)


def test_loaders_that_cannot_resume_say_why():
    stream = torch.utils.data.DataLoader(torch.utils.data.IterableDataset.__new__(_Stream), batch_size=2)
    loader = prepare_data_loader(stream, move_to_device=False)
    assert isinstance(loader, DeviceDataLoader) and "IterableDataset" in loader.why_not_resumable
    with pytest.raises(TypeError, match="IterableDataset"):
        TrainState(loader=loader)
    assert isinstance(_loader(), ResumableDataLoader)
    with pytest.raises(TypeError, match="DataLoader"):
        prepare_data_loader([1, 2, 3], move_to_device=False)


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


# -- TrainState outside a run -----------------------------------------------------------


def _state(**extra):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    sched.step()
    return TrainState(model=model, optimizer=opt, scheduler=sched, loader=_loader(), **extra)


def test_train_state_round_trip_through_weights_only_files(tmp_path):
    gen = torch.Generator().manual_seed(9)
    state = _state(epoch=2, best=(0.5, "a"), sums={"loss": [1.0, 2.0]}, scaler=torch.nn.BatchNorm1d(2),
                   gen=gen)
    _batches(state.loader, limit=2)
    random.seed(4)
    written = state.save(tmp_path)
    assert written == [STATE_FILE, rng_file(0)]
    for name in written:  # every file loads with weights_only=True
        torch.load(tmp_path / name, weights_only=True)
    expected = (torch.rand(3), random.random(), torch.rand(2, generator=gen))
    saved_position = state.loader.state_dict()

    fresh = _state(epoch=0, best=None, sums={}, scaler=torch.nn.BatchNorm1d(2),
                   gen=torch.Generator().manual_seed(1))
    with torch.no_grad():
        fresh.model.weight.zero_()
    fresh.load(tmp_path)
    assert fresh.epoch == 2 and fresh.best == (0.5, "a") and fresh.sums == {"loss": [1.0, 2.0]}
    assert fresh.loader.state_dict() == saved_position
    assert torch.equal(fresh.model.weight, state.model.weight)
    assert_identical(fresh.optimizer.state_dict(), state.optimizer.state_dict(), "optimizer", "")
    assert fresh.scheduler.state_dict() == state.scheduler.state_dict()
    got = (torch.rand(3), random.random(), torch.rand(2, generator=fresh.gen))
    assert torch.equal(got[0], expected[0]) and got[1] == expected[1] and torch.equal(got[2], expected[2])


def test_train_state_attributes():
    state = _state(epoch=0)
    state.epoch = 3
    assert state.epoch == 3 and state.names() == ["model", "optimizer", "scheduler", "loader", "epoch"]
    with pytest.raises(AttributeError, match=r"TrainState\(\.\.\., epcoh=initial_value\)"):
        state.epcoh = 4
    with pytest.raises(AttributeError, match="no 'missing'"):
        _ = state.missing
    with pytest.raises(TypeError, match="'epoch'.*float\\(x\\)"):
        state.epoch = object()


def test_train_state_bad_input_is_refused_with_a_hint(tmp_path):
    with pytest.raises(TypeError, match="state_dict.*Hint"):
        TrainState(model=object())
    with pytest.raises(TypeError, match="prepare_data_loader"):
        TrainState(loader=torch.utils.data.DataLoader(range(3)))
    with pytest.raises(TypeError, match=r"'lock'.*_thread.lock.*Hint"):
        TrainState(lock=__import__("threading").Lock())
    with pytest.raises(TypeError, match="np_value"):
        TrainState(np_value=__import__("numpy").float64(1.0))
    with pytest.raises(ValueError, match="reserved"):
        TrainState(report=1)
    with pytest.raises(TypeError, match="takes a bool"):
        TrainState().report({}, checkpoint="yes")
    with pytest.raises(StateMismatchError, match="not written by TrainState.*Hint"):
        _state().load(tmp_path)
    _state(epoch=1).save(tmp_path)
    with pytest.raises(StateMismatchError, match=r"not in the checkpoint: \['best'\].*strict=False"):
        _state(epoch=0, best=None).load(tmp_path)
    relaxed = _state(epoch=0, best=None)
    relaxed.load(tmp_path, strict=False)
    assert relaxed.epoch == 1 and relaxed.best is None
    with pytest.raises(RuntimeError, match="inside a training function"):
        _state().restore()


WITHOUT_NUMPY = """
import sys, tempfile
sys.modules["numpy"] = None  # as if numpy were not installed
import torch
from unbroken.train.torch import TrainState, prepare_data_loader
from unbroken.state.state_file import capture_rng
assert "numpy" not in capture_rng()
data = torch.utils.data.DataLoader(list(range(6)), batch_size=2, shuffle=True)
loader = prepare_data_loader(data, move_to_device=False, seed_per_sample=True)
first = next(iter(loader)).tolist()
state = TrainState(model=torch.nn.Linear(2, 1), loader=loader, epoch=1)
directory = tempfile.mkdtemp()
state.save(directory)
state.epoch = 5
state.load(directory)
assert state.epoch == 1 and loader.state_dict()["position"] == 2
print("OK", first)
"""


def test_train_state_works_without_numpy():
    assert "OK" in run_script(WITHOUT_NUMPY).stdout
