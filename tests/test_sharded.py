"""Sharded checkpoints: an FSDP2 model (gloo, CPU) saved through torch.distributed.checkpoint.

A run killed at random steps (a rank, the driver) and resumed ends with the model and optimizer
state of the uninterrupted run, bit for bit; a checkpoint saved by 2 ranks restores onto 1 and
4 ranks, and into one plain process, with the same state; the files land on S3 too.

The kill steps are drawn from a seeded generator, printed in every assertion message; set
UNBROKEN_TEST_SEED to replay a failure.
"""

import json
import logging
import os
import pickle
import random

import pytest
import torch

from conftest import read_until, run_json, run_script, s3_env, start_script
from sharded_loops import fsdp_loop
from test_exact_resume import assert_identical
from unbroken.state.state_file import STATE_FILE, rng_file
from unbroken.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from unbroken.train.torch import TorchTrainer, TrainState

SEED = int(os.environ.get("UNBROKEN_TEST_SEED") or random.SystemRandom().randrange(2**32))
BASE = {"epochs": 2, "samples": 48, "batch_size": 4, "ckpt_every": 4}  # 2 workers: 6 steps an epoch
TOTAL_STEPS = 12


def rng_for(name: str) -> random.Random:
    return random.Random(f"{SEED}-{name}")


def fit(storage, name, workers=2, max_failures=0, resume_from=None, **config):
    return TorchTrainer(fsdp_loop, train_loop_config={**BASE, **config},
                        scaling_config=ScalingConfig(num_workers=workers), resume_from_checkpoint=resume_from,
                        run_config=RunConfig(name=name, storage_path=storage,
                                             failure_config=FailureConfig(max_failures=max_failures))).fit()


def steps(result) -> list[dict]:
    df = result.metrics_dataframe
    rows = df[df["indices"].map(lambda v: isinstance(v, list))]
    return [{"step": int(r["step"]), "epoch": int(r["epoch"]), "loss": r["loss"], "indices": r["indices"]}
            for _, r in rows.iterrows()]


def assert_same_run(got, want, context: str) -> None:
    """Each step once, with the reference's loss and batches; the final checkpoint's whole state
    (model, optimizer, scheduler, data position, values), gathered in this process, equal."""
    got_steps, want_steps = steps(got), steps(want)
    assert [s["step"] for s in got_steps] == list(range(1, TOTAL_STEPS + 1)), context
    for g, w in zip(got_steps, want_steps, strict=True):
        assert g == w, f"step {w['step']} differs: {g} vs {w} ({context})"
    assert_identical(got.checkpoint.to_state_dict(), want.checkpoint.to_state_dict(), "final state", context)


def attempts(result) -> list[str]:
    return [a["status"] for a in run_json(result.path)["attempts"]]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return str(tmp_path_factory.mktemp("sharded"))


@pytest.fixture(scope="module")
def reference(results):
    return fit(results, "reference")


def test_sharded_checkpoint_layout_each_rank_writes_its_shards(reference):
    rows = steps(reference)
    for epoch in range(2):
        seen = sorted(i for r in rows if r["epoch"] == epoch for rank in r["indices"] for i in rank)
        assert seen == list(range(48)), "each sample once per epoch"
    path = reference.checkpoint.path
    marker = json.load(open(os.path.join(path, ".checkpoint.json")))
    by_rank = {f["path"]: f["rank"] for f in marker["files"]}
    assert by_rank == {STATE_FILE: 0, rng_file(0): 0, rng_file(1): 1, "dcp-a1/.metadata": 0,
                       "dcp-a1/__0_0.distcp": 0, "dcp-a1/__1_0.distcp": 1}
    payload = torch.load(os.path.join(path, STATE_FILE), weights_only=True)
    assert payload["format"] == 2 and payload["torch_version"] == str(torch.__version__)
    assert payload["sharded"] == {"directory": "dcp-a1", "names": ["model", "optimizer"]}
    assert "model" not in payload["state_dicts"] and "optimizer" not in payload["state_dicts"]
    assert set(payload["state_dicts"]) == {"scheduler", "loader"}


def test_a_sharded_checkpoint_loads_whole_into_one_plain_process(reference):
    full = reference.checkpoint.to_state_dict()
    assert {"model", "optimizer", "scheduler", "loader", "epoch", "step"} <= set(full)
    assert full["step"] == TOTAL_STEPS
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    model.load_state_dict(full["model"])  # strict: every parameter, whole
    assert full["optimizer"]["state"]["0.weight"]["exp_avg"].shape == (32, 8)


def test_a_ddp_checkpoint_loads_whole_the_same_way(tmp_path):
    model = torch.nn.Linear(4, 2)
    state = TrainState(model=model, epoch=3)
    state.save(tmp_path)
    full = Checkpoint.from_directory(tmp_path).to_state_dict()
    assert set(full) == {"model", "epoch"} and full["epoch"] == 3
    assert_identical(full["model"], model.state_dict(), "model", "saved unsharded")


@pytest.mark.parametrize("mode,async_save", [("raise", False), ("sigkill", False), ("sigkill", True)])
def test_killed_rank_resumes_bit_for_bit(storage, reference, mode, async_save):
    # With async_save, the shards are written in the background (DCP on a gloo group of its own).
    rng = rng_for(f"kill-{mode}-{async_save}")
    first = rng.randint(1, TOTAL_STEPS)
    resumed = (first - 1) // BASE["ckpt_every"] * BASE["ckpt_every"]
    second = rng.randint(resumed + 1, TOTAL_STEPS)
    kills = [[first, 1, rng.randrange(2), mode], [second, 2, rng.randrange(2), mode]]
    context = f"UNBROKEN_TEST_SEED={SEED}, kill_at={kills}"
    result = fit(storage, f"killed-{mode}", max_failures=2, kill_at=kills, async_save=async_save)
    assert attempts(result) == ["ERRORED", "ERRORED", "FINISHED"], context
    assert_same_run(result, reference, context)


DRIVER = """
import sys
from sharded_loops import fsdp_loop
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
TorchTrainer(fsdp_loop, train_loop_config={**eval(sys.argv[3]), "echo": True},
             scaling_config=ScalingConfig(num_workers=2),
             run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
"""


def test_driver_sigkilled_then_restored_resumes_bit_for_bit(storage, reference):
    step = rng_for("driver").randint(BASE["ckpt_every"] + 1, TOTAL_STEPS - 1)
    context = f"UNBROKEN_TEST_SEED={SEED}, driver killed after step {step} was reported"
    driver = start_script(DRIVER, storage, "driver-killed", repr(BASE))
    read_until(driver, f"STEP {step}")
    driver.kill()
    driver.wait()
    result = TorchTrainer.restore(os.path.join(storage, "driver-killed")).fit()
    assert len(attempts(result)) == 2 and attempts(result)[1] == "FINISHED", context
    assert_same_run(result, reference, context)


def test_a_kill_during_an_async_background_write_keeps_the_previous_checkpoint(storage, reference,
                                                                               monkeypatch):
    # Rank 1 stages two files per checkpoint (its DCP shard file, its RNG file): its fifth file
    # write is the first of step 12's checkpoint, written in the background.
    monkeypatch.setenv("UNBROKEN_FAULT", "after_file_write:5:kill:1")
    with pytest.raises(TrainingFailedError):
        fit(storage, "killed-writing", async_save=True)
    monkeypatch.delenv("UNBROKEN_FAULT")
    run = os.path.join(storage, "killed-writing")
    assert run_json(run)["latest_checkpoint"] == "checkpoint_000008"
    result = TorchTrainer.restore(run).fit()
    assert attempts(result) == ["ERRORED", "FINISHED"]
    assert run_json(run)["attempts"][1]["resumed_from"] == "checkpoint_000008"
    assert_same_run(result, reference, "killed in step 12's background write")


@pytest.fixture(scope="module")
def saved_at_step_4(results):
    """A 2-rank run stopped after step 4, whose checkpoint is taken there, and the whole
    model and optimizer state at that checkpoint."""
    dump = os.path.join(results, "saved-at-4.pt")
    result = fit(results, "two-ranks", stop_after=4, dump_at=[4, dump])
    assert result.checkpoint.path.endswith("checkpoint_000004")
    return result, torch.load(dump, weights_only=True)


@pytest.mark.parametrize("workers", [1, 4])
def test_resharded_restore_equals_the_saved_state(storage, saved_at_step_4, workers):
    saved, want = saved_at_step_4
    dump = os.path.join(storage + "-dump.pt")
    result = fit(storage, f"on-{workers}", workers=workers, resume_from=saved.checkpoint, dump_restored=dump)
    got = torch.load(dump, weights_only=True)
    assert_identical(got, want, f"restored on {workers} ranks", "2 ranks saved")
    # The data position carries over: the rest of epoch 0 is shared out, each sample once.
    before = [i for r in steps(saved) for rank in r["indices"] for i in rank]
    after = [i for r in steps(result) if r["epoch"] == 0 for rank in r["indices"] for i in rank]
    assert sorted(before + after) == list(range(48))
    assert all(len(r["indices"]) == workers for r in steps(result))


def test_a_plain_model_in_one_worker_loads_sharded_state(storage, saved_at_step_4):
    saved, want = saved_at_step_4
    dump = os.path.join(storage + "-dump.pt")
    fit(storage, "plain", workers=1, resume_from=saved.checkpoint, dump_restored=dump, sharded=False)
    got = torch.load(dump, weights_only=True)
    assert_identical(got, want, "restored into a plain model", "2 ranks saved")


def test_a_whole_model_checkpoint_is_not_loaded_into_a_sharded_model(storage):
    plain = fit(storage, "plain-saved", workers=1, sharded=False, stop_after=4)
    assert "sharded" not in torch.load(os.path.join(plain.checkpoint.path, STATE_FILE), weights_only=True)
    with pytest.raises(TrainingFailedError, match="holds a whole .unsharded. model"):
        fit(storage, "sharded-from-plain", resume_from=plain.checkpoint)


def test_other_torch_version_is_named_when_loading(saved_at_step_4, tmp_path, caplog):
    saved, want = saved_at_step_4
    copy = saved.checkpoint.to_directory(str(tmp_path / "copy"))
    payload = torch.load(os.path.join(copy, STATE_FILE), weights_only=True)
    payload["torch_version"] = "1.0.0"
    torch.save(payload, os.path.join(copy, STATE_FILE))
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    state = TrainState(model=model)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        state.load(copy, strict=False)
    assert "saved with torch 1.0.0" in caplog.text and "no compatibility across torch versions" in caplog.text
    assert_identical(model.state_dict(), want["model"], "model", "loaded in this process")


def test_dcp_metadata_that_names_other_code_is_refused(saved_at_step_4, tmp_path):
    saved, _ = saved_at_step_4
    copy = saved.checkpoint.to_directory(str(tmp_path / "copy"))
    with open(os.path.join(copy, "dcp-a1", ".metadata"), "wb") as f:
        pickle.dump(os.system, f)
    with pytest.raises(Exception, match="refusing to load it"):
        Checkpoint.from_directory(copy).to_state_dict()


S3_DRIVER = """
import os, sys
os.chdir(os.environ["HOME"])
from sharded_loops import fsdp_loop
from unbroken.train import RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer
result = TorchTrainer(fsdp_loop, train_loop_config=eval(sys.argv[3]),
                      scaling_config=ScalingConfig(num_workers=2),
                      run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
print("DONE", result.checkpoint.url, flush=True)
"""


READ_BACK = """
import sys, torch
from unbroken.train import Checkpoint
torch.save(Checkpoint(sys.argv[1]).to_state_dict(), sys.argv[2])
"""


@pytest.mark.slow  # 13 s; sharded saves locally and whole-state saves on S3 run by default
def test_sharded_checkpoint_on_s3(s3_endpoint, reference, tmp_path):
    from test_s3 import keys, prefix

    storage = prefix()
    env = dict(s3_env(s3_endpoint), HOME=str(tmp_path))
    out = run_script(S3_DRIVER, storage, "sharded", repr(BASE), **env)
    assert "DONE s3://" in out.stdout, out.stderr
    stored = keys(s3_endpoint, f"{storage}/sharded")
    final = f"checkpoint_{TOTAL_STEPS + 1:06d}"
    for rel in (".checkpoint.json", STATE_FILE, "dcp-a1/.metadata", "dcp-a1/__0_0.distcp",
                "dcp-a1/__1_0.distcp"):
        assert f"{final}/{rel}" in stored, stored
    # Gathered whole in one plain process (another one: s3fs starts an event-loop thread, and
    # this test process forks workers for the other tests).
    dump = str(tmp_path / "from-s3.pt")
    run_script(READ_BACK, f"{storage}/sharded/{final}", dump, **env)
    got = torch.load(dump, weights_only=True)
    assert_identical(got, reference.checkpoint.to_state_dict(), "final state on S3", "vs local")


def test_a_file_already_in_place_is_summed_not_copied_onto_itself(tmp_path):
    # TrainState writes shards straight into the staging directory and hands the report links
    # to them: staging such a link must keep the file (a copy onto itself would empty it).
    from unbroken.store.storage import Storage

    storage = Storage.from_url(str(tmp_path / "run"))
    storage.makedirs("staged")
    with open(storage.local_path("staged/shard"), "wb") as f:
        f.write(b"x" * 1000)
    os.symlink(storage.local_path("staged/shard"), tmp_path / "link")
    assert storage.put_file(str(tmp_path / "link"), "staged/shard")[0] == 1000
    assert open(storage.local_path("staged/shard"), "rb").read() == b"x" * 1000


@pytest.mark.slow  # a fresh driver per kill: about 6 s each here
@pytest.mark.parametrize("point", ["after_file_write", "after_fsync", "before_marker", "after_marker",
                                   "before_rename", "after_rename"])
def test_killed_inside_the_commit_protocol_resumes_bit_for_bit(storage, reference, point):
    # The process that passes `point` (a rank while staging, the driver while committing) is
    # SIGKILLed the n-th time; the restored run must equal the uninterrupted one.
    nth = rng_for(point).randint(1, 3)
    context = f"UNBROKEN_TEST_SEED={SEED}, UNBROKEN_FAULT={point}:{nth}"
    crashed = run_script(DRIVER, storage, "faulted", repr(BASE), check=False, UNBROKEN_FAULT=f"{point}:{nth}")
    assert crashed.returncode != 0, context
    result = TorchTrainer.restore(os.path.join(storage, "faulted")).fit()
    assert attempts(result)[-1] == "FINISHED", context
    assert_same_run(result, reference, context)
