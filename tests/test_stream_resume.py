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

from conftest import read_until, run_script, start_script
from stream_loops import KINDS, make_loader, stream_loop, write_shards
from test_exact_resume import assert_identical
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


def fit(storage, name, data_dir, workers=2, max_failures=0, recovery=None, **config):
    failure = FailureConfig(max_failures=max_failures, **({"recovery": recovery} if recovery else {}),
                            **({"hang_timeout_s": 20} if recovery == "in_place" else {}))
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


def assert_same_run(got, want, context: str) -> None:
    """Each iteration once; each rank's sample ids and loss at every step; the final
    checkpoint's files (model, optimizer, counters, each rank's RNG) bit for bit."""
    got_steps, want_steps = steps(got), steps(want)
    assert [s["step"] for s in got_steps] == list(range(1, STEPS + 1)), context
    for g, w in zip(got_steps, want_steps, strict=True):
        assert g == w, f"step {w['step']} differs: {g} vs {w} ({context})"
    got_files, want_files = final_files(got), final_files(want)
    for name in (STATE_FILE, rng_file(0), rng_file(1)):
        assert_identical(got_files[name], want_files[name], name, context)


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


@pytest.mark.parametrize("rank", [0, 1])
def test_a_just_in_time_checkpoint_replays_each_ranks_pass_exactly(storage, runs, data_dir, rank):
    # One rank raises right after report 5 (not a periodic checkpoint); a survivor saves round
    # 5 with the counts every rank shares, and no rank's own library state: the resume replays.
    kind = "torchdata-map"
    result = fit(storage, f"jit-{rank}", data_dir, kind=kind, jit=True, max_failures=1,
                 recovery="just_in_time", die_after_report=[[5, 1, rank, "raise"]])
    first, second = attempts(result)
    assert first["jit_checkpoint"]["iteration"] == 5, first
    assert second["resumed_from"] == "checkpoint_000005"
    assert_same_run(result, reference(runs, data_dir, kind, jit=True), f"rank {rank} raised after report 5")


def test_recovery_in_place_restarts_the_loop_of_a_stream_and_replays_exactly(storage, runs, data_dir):
    # A stream loader does not stay inside its loop (its dataset may not go back to the start
    # of a pass), but the survivor keeps its process, gets round 5 from a peer and replays.
    kind = "hf-shards"
    result = fit(storage, "in-place", data_dir, kind=kind, jit=True, max_failures=1, recovery="in_place",
                 die_after_report=[[5, 1, 1, "sigkill"]])
    second = attempts(result)[1]
    assert second["in_place"]["iteration"] == 5 and second["in_place"]["kept"] == [0], second
    assert_same_run(result, reference(runs, data_dir, kind, jit=True), "rank 1 SIGKILLed after report 5")


@pytest.mark.parametrize("kind", ["torchdata-hf-buffer", "hf-shards"])
def test_a_driver_killed_and_restored_resumes_exactly(storage, runs, data_dir, kind):
    step = kill_step(f"driver-{kind}")
    context = f"UNBROKEN_TEST_SEED={SEED}, {kind}, driver SIGKILLed after step {step}"
    driver = start_script(DRIVER, storage, f"driver-{kind}", repr({"data_dir": data_dir, "kind": kind}))
    read_until(driver, f"STEP {step}")
    driver.kill()
    driver.wait()
    result = TorchTrainer.restore(os.path.join(storage, f"driver-{kind}")).fit()
    assert [a["status"] for a in attempts(result)][-1] == "FINISHED", context
    assert_same_run(result, reference(runs, data_dir, kind), context)


DRIVER = """
import sys
from stream_loops import stream_loop
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
TorchTrainer(stream_loop, train_loop_config={**eval(sys.argv[3]), "echo": True},
             scaling_config=ScalingConfig(num_workers=2),
             run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
"""


def test_another_number_of_workers_is_refused_and_nothing_stored_changes(storage, data_dir):
    # Our own stateful dataset keeps one position per rank, which other ranks cannot continue.
    with pytest.raises(TrainingFailedError):
        fit(storage, "resize", data_dir, kind="custom", kill_at=[[5, 1, 0, "raise"]])
    path = os.path.join(storage, "resize")
    before = sorted(os.listdir(path))
    with pytest.raises(TrainingFailedError) as failed:
        TorchTrainer.restore(path, scaling_config=ScalingConfig(num_workers=1)).fit()
    text = str(failed.value)
    assert "StateMismatchError" in text and "saved by 2 ranks" in text and "num_workers=2" in text, text
    assert sorted(os.listdir(path)) == before
    result = TorchTrainer.restore(path, scaling_config=ScalingConfig(num_workers=2)).fit()  # goes on
    assert [s["step"] for s in steps(result)] == list(range(1, STEPS + 1))


@pytest.mark.parametrize("kind", ["hf-shards", "hf-stream"])
def test_a_hugging_face_pass_goes_on_at_other_sizes_each_shard_where_it_was(storage, data_dir, kind):
    # 2 ranks fail mid-epoch 0; a restore on 3 ranks takes the rest of the pass, each shard
    # where the 2 left it, and fails in it (step 7: a carried pass carried again) or in the next
    # epoch's own split (step 10); a restore on 1 rank takes what the 3 left. Each example of an
    # epoch is trained on once, but for what a short last global batch cannot split evenly
    # (fewer than the ranks).
    rng = rng_for(f"resize-{kind}")
    first, second = rng.choice([4, 5]), rng.choice([7, 10])
    context = f"UNBROKEN_TEST_SEED={SEED}, {kind}: raised at step {first} on 2 ranks, at {second} on 3"
    with pytest.raises(TrainingFailedError):
        fit(storage, f"grow-{kind}", data_dir, kind=kind,
            kill_at=[[first, 1, 0, "raise"], [second, 2, 2, "raise"]])
    path = os.path.join(storage, f"grow-{kind}")
    with pytest.raises(TrainingFailedError):
        TorchTrainer.restore(path, scaling_config=ScalingConfig(num_workers=3)).fit()
    result = TorchTrainer.restore(path, scaling_config=ScalingConfig(num_workers=1)).fit()
    rows = steps(result)
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1)), context
    for epoch in (0, 1):
        ids = [i for r in rows if r["epoch"] == epoch for rank in r["ids"] for i in rank]
        assert len(ids) == len(set(ids)), f"epoch {epoch}: an example trained on twice ({context})"
        lost = sorted(set(range(64)) - set(ids))
        assert len(lost) <= 2, f"epoch {epoch}: lost {lost} ({context})"
    sizes = [len(r["ids"]) for r in rows]
    on_three = second // CKPT * CKPT  # the last step the 3 ranks checkpointed
    assert sizes[:3] == [2] * 3 and sizes[3:on_three] == [3] * (on_three - 3), (sizes, context)
    assert set(sizes[on_three:]) == {1}, (sizes, context)


# -- the loaders outside a run ----------------------------------------------------------


def _take(loader, n=None):
    out = []
    for batch in loader:
        out.append(batch["id"].tolist())
        if n is not None and len(out) == n:
            break
    return out


def test_a_resume_seeks_with_the_ranks_own_state_instead_of_reading_again(data_dir, tmp_path):
    import stream_loops

    config = {"data_dir": data_dir}
    loader, _ = make_loader("custom", config, 0, 2)
    state = TrainState(loader=loader)
    first = _take(loader, 3)
    state.save(tmp_path)
    again, _ = make_loader("custom", config, 0, 2)
    reads = []
    original = stream_loops.ShardStream.__iter__

    def counting(self):
        for row in original(self):
            reads.append(int(row["id"]))
            yield row
    stream_loops.ShardStream.__iter__ = counting
    try:
        resumed = TrainState(loader=again)
        resumed.load(tmp_path)
        rest = _take(again)
    finally:
        stream_loops.ShardStream.__iter__ = original
    whole, _ = make_loader("custom", config, 0, 2)
    assert first + rest == _take(whole)
    assert len(reads) == sum(len(b) for b in rest), "the resume read the trained batches again"


def test_a_stream_without_a_state_is_refused_when_the_state_is_built():
    class Plain(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    loader = torch.utils.data.DataLoader(Plain(), batch_size=2)
    with pytest.raises(TypeError, match="Plain.*StatefulDataLoader.*state_dict"):
        TrainState(loader=loader)
    with pytest.raises(TypeError, match="StatefulDataLoader"):
        TrainState(val=loader)


def test_a_state_that_is_not_plain_data_is_stored_as_data(tmp_path):
    np = pytest.importorskip("numpy")

    class NumpyStream(torch.utils.data.IterableDataset):
        def __init__(self):
            self.offset = np.int64(0)

        def __iter__(self):
            while self.offset < 8:
                self.offset += 1
                yield torch.tensor(int(self.offset))

        def state_dict(self):
            return {"offset": self.offset, "seen": np.arange(int(self.offset))}

        def load_state_dict(self, state):
            self.offset = np.int64(state["offset"])

    loader = torch.utils.data.DataLoader(NumpyStream(), batch_size=2)
    state = TrainState(loader=loader)
    _ = [next(iter(loader)) for _ in range(1)]
    state.save(tmp_path)
    saved = torch.load(tmp_path / loader_file(0), weights_only=True)["loader"]["library"]
    assert saved["offset"] == 2 and torch.equal(saved["seen"], torch.arange(2))
    again = torch.utils.data.DataLoader(NumpyStream(), batch_size=2)
    resumed = TrainState(loader=again)
    resumed.load(tmp_path)
    assert [b.tolist() for b in again] == [[3, 4], [5, 6], [7, 8]]


# Importing Hugging Face datasets starts a thread, after which this process would start every
# later test's workers from a forkserver rather than by fork: these run in a process of their own.
HF_IN_A_PROCESS = """
import os, sys
import pytest
from stream_loops import make_loader
from test_stream_resume import _take
from unbroken.errors import StateMismatchError
from unbroken.train.torch import TrainState, prepare_data_loader

config, saved_in = {"data_dir": sys.argv[1]}, sys.argv[2]
# Data that changed since the checkpoint is named, and nothing stored changes.
loader, _ = make_loader("hf-shards", config, 0, 2)
state = TrainState(loader=loader)
_take(loader, 2)
state.save(saved_in)
saved = {name: open(os.path.join(saved_in, name), "rb").read() for name in os.listdir(saved_in)}
other, _ = make_loader("hf-shards", {**config, "shards": 8}, 0, 2)
with pytest.raises(StateMismatchError, match="num_shards was 2, is 4"):
    TrainState(loader=other).load(saved_in)
assert {name: open(os.path.join(saved_in, name), "rb").read() for name in os.listdir(saved_in)} == saved
# After a seek, a later pass reads the whole pass, with or without set_epoch (datasets starts
# each pass of the epoch it was given a state in at that state).
whole = _take(make_loader("hf-shards", config, 0, 2)[0])
loader, set_epoch = make_loader("hf-shards", config, 0, 2)
state = TrainState(loader=loader)
_take(loader, 1)
os.makedirs(saved_in + "-seek")
state.save(saved_in + "-seek")
again, set_epoch = make_loader("hf-shards", config, 0, 2)
TrainState(loader=again).load(saved_in + "-seek")
assert _take(again) == whole[1:]
assert _take(again) == whole
set_epoch(1)
assert _take(again) == whole
# At another number of ranks the data must still be the same, even between passes.
from unbroken.state.stream_loader import StreamLoader
loader, _ = make_loader("hf-shards", config, 0, 2)
ended = StreamLoader.of(loader, 2)
_take(loader)
other, _ = make_loader("hf-shards", {**config, "shards": 8}, 0, 4)
with pytest.raises(StateMismatchError, match="total_shards was 4, is 8"):
    StreamLoader.of(other, 4).load_state_dict(ended.state_dict())
# prepare_data_loader keeps a stream as it is: not split a second time.
loader, _ = make_loader("hf-shards", config, 1, 2)
whole = _take(make_loader("hf-shards", config, 1, 2)[0])
prepared = prepare_data_loader(loader, move_to_device=False)
assert prepared is loader and _take(prepared) == whole
print("OK")
"""


def test_changed_data_is_named_and_prepare_data_loader_does_not_split_a_stream_again(data_dir, tmp_path):
    assert "OK" in run_script(HF_IN_A_PROCESS, data_dir, str(tmp_path)).stdout
    from unbroken.train.torch import prepare_data_loader

    with pytest.raises(ValueError, match="global_batch_size"):
        prepare_data_loader(make_loader("custom", {"data_dir": data_dir}, 0, 2)[0], move_to_device=False,
                            global_batch_size=8)


def test_a_shuffled_stateful_loader_resumes_without_moving_the_training_generators(tmp_path):
    # StatefulDataLoader(shuffle=True): its sampler seeds a generator of its own when it is built
    # (from the global one, in the user's code, before and after a resume alike); iterating
    # leaves the training generators as they were, and a resume continues the same order.
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader():
        return StatefulDataLoader(list(range(40)), batch_size=4, shuffle=True)

    def passes(dl, state=None, stop=None):
        out = []
        for _ in range(2):
            for batch in dl:
                out.append(batch.tolist())
                if len(out) == stop:
                    state.save(tmp_path)
                    return out
        return out

    torch.manual_seed(5)
    whole = loader()
    TrainState(loader=whole)
    before = torch.get_rng_state()
    everything = passes(whole)
    assert torch.equal(torch.get_rng_state(), before)
    assert everything[:10] != everything[10:], "a new order each pass"
    torch.manual_seed(5)
    first = loader()
    head = passes(first, TrainState(loader=first), stop=13)
    torch.manual_seed(5)
    again = loader()
    TrainState(loader=again).load(tmp_path)
    tail = [b.tolist() for b in again]
    assert head + tail == everything[:20]
