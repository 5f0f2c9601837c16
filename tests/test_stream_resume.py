"""Exact resume of streaming and per-rank data: torchdata's StatefulDataLoader, Hugging Face
`datasets` (streamed, and `to_iterable_dataset` split by node) and a stateful IterableDataset of
our own, each killed mid-epoch and compared with its uninterrupted run: every step's sample ids
on every rank, the losses, and the final checkpoint's files bit for bit.

Kill steps are drawn from a seeded generator, printed in each assertion; UNBROKEN_TEST_SEED
replays a failure."""

import json
import os
import random

import pytest
import torch

from conftest import read_until, start_script
from stream_loops import KINDS, make_loader, stream_loop, write_shards
from unbroken.errors import StateMismatchError
from unbroken.state.state_file import STATE_FILE, loader_file, rng_file
from unbroken.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from unbroken.train.torch import TorchTrainer, TrainState

SEED = int(os.environ.get("UNBROKEN_TEST_SEED") or random.SystemRandom().randrange(2**32))
STEPS = 16  # 2 epochs of 8 steps
CKPT = 3


def rng_for(name: str) -> random.Random:
    return random.Random(f"{SEED}-{name}")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("shards"))
    write_shards(directory)
    return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("stream-runs"))


def fit(storage, name, data_dir, workers=2, max_failures=0, recover_in_place=False, **config):
    failure = FailureConfig(max_failures=max_failures, recover_in_place=recover_in_place,
                            **({"hang_timeout_s": 20} if recover_in_place else {}))
    return TorchTrainer(stream_loop, train_loop_config={"data_dir": data_dir, **config},
                        scaling_config=ScalingConfig(num_workers=workers),
                        run_config=RunConfig(name=name, storage_path=storage, failure_config=failure)).fit()


_references: dict = {}


def reference(runs, data_dir, kind, **config):
    """The uninterrupted run of `kind` (made once per module)."""
    key = (kind, tuple(sorted(config.items())))
    if key not in _references:
        _references[key] = fit(runs, f"ref-{kind}-{len(_references)}", data_dir, kind=kind, **config)
    return _references[key]


def steps(result) -> list[dict]:
    df = result.metrics_dataframe
    rows = df[df["ids"].map(lambda v: isinstance(v, list))]
    return [{"step": int(r["step"]), "epoch": int(r["epoch"]), "losses": r["losses"], "ids": r["ids"]}
            for _, r in rows.iterrows()]


def final_files(result) -> dict:
    with result.checkpoint.as_directory() as d:
        return {name: torch.load(os.path.join(d, name), weights_only=True)
                for name in sorted(os.listdir(d)) if name.endswith(".pt")}


def attempts(result) -> list[dict]:
    return json.load(open(os.path.join(result.path, ".unbroken", "run.json")))["attempts"]


def assert_same(a, b, where: str, context: str) -> None:
    if isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and torch.equal(a, b), f"{where} differs ({context})"
    elif isinstance(b, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(a)} vs {sorted(b)} ({context})"
        for k in b:
            assert_same(a[k], b[k], f"{where}[{k!r}]", context)
    elif isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths differ ({context})"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]", context)
    else:
        assert a == b, f"{where}: {a!r} != {b!r} ({context})"


def assert_same_run(got, want, context: str) -> None:
    """Each iteration once; each rank's sample ids and loss at every step; the final
    checkpoint's files (model, optimizer, counters, each rank's RNG) bit for bit."""
    got_steps, want_steps = steps(got), steps(want)
    assert [s["step"] for s in got_steps] == list(range(1, STEPS + 1)), context
    for g, w in zip(got_steps, want_steps, strict=True):
        assert g == w, f"step {w['step']} differs: {g} vs {w} ({context})"
    got_files, want_files = final_files(got), final_files(want)
    for name in (STATE_FILE, rng_file(0), rng_file(1)):
        assert_same(got_files[name], want_files[name], name, context)


def kill_step(name: str) -> int:
    """A step after the first checkpoint and not on one: the resume continues mid-pass."""
    step = rng_for(name).randint(CKPT + 1, STEPS - 1)
    return step + 1 if step % CKPT == 0 else step


def test_each_kind_streams_each_ranks_share_once_an_epoch(runs, data_dir):
    for kind in KINDS:
        rows = steps(reference(runs, data_dir, kind))
        assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), kind
        for epoch in (0, 1):
            seen = sorted(i for r in rows if r["epoch"] == epoch for rank in r["ids"] for i in rank)
            assert seen == list(range(64)), (kind, epoch)
        assert rows[0]["ids"][0] != rows[0]["ids"][1], kind


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_rank_killed_mid_epoch_resumes_each_rank_at_its_next_batch(storage, runs, data_dir, kind):
    step = kill_step(kind)
    context = f"UNBROKEN_TEST_SEED={SEED}, {kind}, rank 1 SIGKILLed at step {step}"
    result = fit(storage, f"killed-{kind}", data_dir, kind=kind, max_failures=1,
                 kill_at=[[step, 1, 1, "sigkill"]])
    first, second = attempts(result)
    assert first["status"] == "ERRORED" and second["resumed_from"] == f"checkpoint_{step // CKPT * CKPT:06d}"
    assert_same_run(result, reference(runs, data_dir, kind), context)
    # Each rank's own position is in the checkpoint where its library is exact; elsewhere the
    # resume replays the pass from the counts in train_state.pt.
    files = final_files(result)
    assert (loader_file(1) in files) == (KINDS[kind] == "seek"), (kind, sorted(files))
    assert files[STATE_FILE]["state_dicts"]["loader"]["kind"] == "stream"
