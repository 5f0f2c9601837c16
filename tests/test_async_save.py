"""Asynchronous checkpoint saves (`checkpoint_upload_mode=ASYNC`, on a TrainState, its report, or
`train.report`): the report returns before the files are written, the
checkpoint commits only once every rank's files are durable, and a run with background saves
killed anywhere (a rank, in the middle of a background write, on S3 too) resumes to the
uninterrupted run's state bit for bit.

The kill steps are drawn from a seeded generator (printed in every assertion message); set
UNBROKEN_TEST_SEED to replay a failure.
"""

import json
import os

import pytest
import torch

from conftest import run_json, run_script, s3_env
from loops import async_gate_loop, exact_loop
from test_exact_resume import (
    BASE,
    SEED,
    TOTAL_STEPS,
    assert_identical,
    assert_same_run,
    attempts,
    fit,
    random_kills,
    results,  # noqa: F401 - the fixture `reference` needs
    rng_for,
)
from unbroken.errors import CheckpointChangedError, TrainingInterruptedError
from unbroken.execution.commit_ledger import PendingCommit, PendingCommits
from unbroken.state.state_file import STATE_FILE
from unbroken.store.commit import FileEntry
from unbroken.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from unbroken.train.torch import TorchTrainer
from unbroken.worker.async_save import BackgroundSave
from unbroken.worker.protocol import Staged

LATEST_BEFORE_STEP_12 = "checkpoint_000008"  # checkpoints every 4 steps


@pytest.fixture(scope="module")
def reference(results):  # noqa: F811
    """The uninterrupted run with synchronous saves: the asynchronous runs must equal it."""
    return fit(results, "reference")


@pytest.mark.parametrize("how", ["train.report", "TrainState", "TrainState.report"])
def test_the_report_returns_before_its_files_are_written(storage, how):
    # The loop holds each background write until the report has returned and the loop has
    # looked at storage: nothing of that checkpoint is there, nothing committed. TrainState's
    # saves hold the state of their report, though the model changed before they were written.
    config = {"reports": 4, "train_state": {"TrainState": "state", "TrainState.report": "report"}.get(how)}
    result = TorchTrainer(async_gate_loop, train_loop_config=config,
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name=f"gate-{how}", storage_path=storage)).fit()
    seen = result.return_value
    assert seen["before_write"] == [[] for _ in range(4)], seen
    # get_all_reported_checkpoints waits for the driver's commit of the latest save.
    assert seen["reported"] == [f"checkpoint_{i:06d}" for i in range(1, 5)], seen
    assert seen["most_writes_at_once"] == 1, seen
    assert result.checkpoint.path.endswith("checkpoint_000004")
    rows = result.metrics_dataframe
    assert list(rows["checkpoint_dir_name"]) == [f"checkpoint_{i:06d}" for i in range(1, 5)]
    if how == "train.report":
        assert seen["kept_local"] == [False] * 4, seen  # ASYNC deletes the reported directory
        return
    for i, weights in enumerate(seen["weights"], start=1):
        saved = torch.load(os.path.join(result.path, f"checkpoint_{i:06d}", STATE_FILE), weights_only=True)
        assert saved["state_dicts"]["model"]["weight"].tolist() == weights, i


def test_a_reported_directory_removed_before_its_files_are_staged_fails_clearly(storage):
    trainer = TorchTrainer(async_gate_loop, train_loop_config={"reports": 2, "remove_reported": True},
                           scaling_config=ScalingConfig(num_workers=2),
                           run_config=RunConfig(name="removed", storage_path=storage,
                                                failure_config=FailureConfig(max_failures=2)))
    with pytest.raises(TrainingFailedError) as failed:
        trainer.fit()
    error = failed.value.__cause__
    assert isinstance(error, CheckpointChangedError), failed.value
    assert "changed before its files were staged" in str(error) and "Hint:" in str(error)
    run = os.path.join(storage, "removed")
    assert len(run_json(run)["attempts"]) == 1  # not retried: a restart would remove it again
    assert run_json(run)["latest_checkpoint"] is None


@pytest.mark.parametrize("mode,spelling", [("raise", "state"), ("sigkill", "state"), ("sigkill", "report")])
def test_killed_ranks_resume_bit_for_bit(storage, reference, mode, spelling):
    # The upload mode on the TrainState, or on each report (state.report(...,
    # checkpoint_upload_mode="ASYNC"), as train.report takes it).
    kills = random_kills(rng_for(f"async-{mode}-{spelling}"), 2, (mode,))
    context = f"UNBROKEN_TEST_SEED={SEED}, kill_at={kills}, upload mode on the {spelling}"
    how = {"async_save": True} if spelling == "state" else {"report_upload_mode": "ASYNC"}
    result = fit(storage, f"async-{mode}-{spelling}", max_failures=2, kill_at=kills, **how)
    assert [a["status"] for a in attempts(result)] == ["ERRORED", "ERRORED", "FINISHED"], context
    assert_same_run(result, reference, context)


def test_a_kill_during_the_background_write_keeps_the_previous_checkpoint(storage, reference, monkeypatch):
    # Rank 1 writes one file per checkpoint: its third file write is step 12's, in the background.
    monkeypatch.setenv("UNBROKEN_FAULT", "after_file_write:3:kill:1")
    with pytest.raises(TrainingFailedError):
        fit(storage, "killed-writing", async_save=True)
    monkeypatch.delenv("UNBROKEN_FAULT")
    run = os.path.join(storage, "killed-writing")
    assert run_json(run)["latest_checkpoint"] == LATEST_BEFORE_STEP_12
    assert not os.path.exists(os.path.join(run, "checkpoint_000012"))  # staged, never committed
    result = TorchTrainer.restore(run).fit()
    first, second = attempts(result)
    assert first["status"] == "ERRORED" and second["resumed_from"] == LATEST_BEFORE_STEP_12
    assert not [n for n in os.listdir(run) if ".tmp-" in n]  # the torn staging is gone
    assert_same_run(result, reference, "killed in step 12's background write")


def test_a_rank_that_raises_after_its_report_still_commits_the_save_in_flight(storage, reference,
                                                                              monkeypatch):
    # Rank 1 raises right after report 8 (a checkpoint): it finishes that save before it says it
    # failed, rank 0 finishes its own, and the driver commits checkpoint 8 before giving up.
    monkeypatch.setenv("UNBROKEN_FAULT", "after_report:8:raise:1")
    with pytest.raises(TrainingFailedError):
        fit(storage, "raised", async_save=True)
    monkeypatch.delenv("UNBROKEN_FAULT")
    run = os.path.join(storage, "raised")
    assert run_json(run)["latest_checkpoint"] == "checkpoint_000008"
    result = TorchTrainer.restore(run).fit()
    assert attempts(result)[1]["resumed_from"] == "checkpoint_000008"
    assert_same_run(result, reference, "raised after report 8")


def test_preemption_waits_for_the_save_in_flight_and_commits_it(storage, reference):
    step = rng_for("async-preempt").randint(2, TOTAL_STEPS - 4)
    context = f"UNBROKEN_TEST_SEED={SEED}, SIGTERM to the driver at step {step}"
    with pytest.raises(TrainingInterruptedError):
        fit(storage, "preempted", ckpt_every=1000, preempt_at=[step, 1], driver_pid=os.getpid(),
            async_save=True)
    run = os.path.join(storage, "preempted")
    first = run_json(run)["attempts"][0]
    assert first["status"] == "PREEMPTED" and first["preempted"]["source"].startswith("SIGTERM"), context
    latest = run_json(run)["latest_checkpoint"]
    assert latest is not None and int(latest.split("_")[1]) >= step, context
    result = TorchTrainer.restore(run).fit()
    assert attempts(result)[1]["resumed_from"] == latest, context
    assert_same_run(result, reference, context)


def test_retention_keeps_the_latest_while_saves_are_in_flight(storage, reference):
    result = TorchTrainer(exact_loop, train_loop_config={**BASE, "async_save": True},
                          scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="kept", storage_path=storage,
                                               checkpoint_config=CheckpointConfig(num_to_keep=1))).fit()
    names = sorted(n for n in os.listdir(result.path) if n.startswith("checkpoint_"))
    assert names == [f"checkpoint_{TOTAL_STEPS + 1:06d}"]
    assert_same_run(result, reference, "num_to_keep=1 with background saves")


S3_DRIVER = """
import json, os, sys
os.chdir(os.environ["HOME"])
from loops import exact_loop
from unbroken.train import Checkpoint, RunConfig, ScalingConfig, TrainingFailedError
from unbroken.train.torch import TorchTrainer
storage, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
url = f"{storage}/{name}"
try:
    if TorchTrainer.can_restore(url):
        result = TorchTrainer.restore(url).fit()
    else:
        result = TorchTrainer(exact_loop, train_loop_config=json.loads(sys.argv[4]),
                              scaling_config=ScalingConfig(num_workers=2),
                              run_config=RunConfig(name=name, storage_path=storage)).fit()
except TrainingFailedError:
    print("FAILED", flush=True)
    sys.exit(0)
import torch
torch.save(Checkpoint(result.checkpoint.url).to_state_dict(), out)
print("DONE", result.metrics["attempt"], flush=True)
"""


@pytest.mark.slow  # 14 s; killed uploads on S3 (sync) are in test_s3, killed async saves in the harness
def test_on_s3_a_killed_upload_is_never_committed_and_the_run_resumes(s3_endpoint, reference, tmp_path):
    from test_s3 import keys, prefix, read

    storage, out = prefix(), str(tmp_path / "final.pt")
    env = dict(s3_env(s3_endpoint), HOME=str(tmp_path))
    config = json.dumps({**BASE, "async_save": True})
    failed = run_script(S3_DRIVER, storage, "async", out, config, UNBROKEN_FAULT="after_file_write:3:kill:1",
                        **env)
    assert "FAILED" in failed.stdout, failed.stderr
    url = f"{storage}/async"
    stored = keys(s3_endpoint, url)
    # Uploaded in place under its final name, with no marker: not a checkpoint.
    assert "checkpoint_000012/rng_rank1.pt" in stored and "checkpoint_000012/.checkpoint.json" not in stored
    run = json.loads(read(s3_endpoint, url, ".unbroken/run.json"))
    assert run["latest_checkpoint"] == LATEST_BEFORE_STEP_12
    done = run_script(S3_DRIVER, storage, "async", out, config, **env)
    assert "DONE 2" in done.stdout, done.stderr
    run = json.loads(read(s3_endpoint, url, ".unbroken/run.json"))
    assert run["attempts"][1]["resumed_from"] == LATEST_BEFORE_STEP_12
    assert_identical(torch.load(out, weights_only=True), reference.checkpoint.to_state_dict(),
                     "final state on S3", "async saves, killed in an upload")


# -- the bookkeeping on its own ---------------------------------------------------------------
def test_a_failed_background_save_is_raised_in_the_training_thread_once():
    saver = BackgroundSave()

    def fail():
        raise OSError("disk gone")

    saver.start(fail)
    with pytest.raises(OSError, match="disk gone"):
        saver.wait()
    saver.wait()  # raised once; nothing in flight any more
    assert not saver.writing


def test_pending_commits_keep_rounds_in_order_and_take_early_files():
    seen = []
    saves = PendingCommits(lambda metrics, marker: seen.append((metrics[0]["it"], marker)))
    entry = FileEntry("f", 1, 0, 1)
    # Rank 1's files of round 2 arrive before rank 0's report completes the round.
    assert saves.staged(1, Staged(2, [entry])) is None
    saves.round(PendingCommit(1, None, {}, [{"it": 1}], waiting=set()))  # no checkpoint
    assert seen == [(1, None)]
    assert saves.round(PendingCommit(2, None, {}, [{"it": 2}], waiting={0, 1})) is None  # rank 0 due
    saves.round(PendingCommit(3, None, {}, [{"it": 3}], waiting=set()))
    assert seen == [(1, None)], "round 3 is reported after round 2's checkpoint"
    assert saves.can_complete(gone=set()) and not saves.can_complete(gone={0})
    ready = saves.staged(0, Staged(2, [FileEntry("g", 1, 0, 0)]))
    assert ready is not None and ready.per_rank_files() == [[FileEntry("g", 1, 0, 0)], [entry]]
    saves.committed(ready, "marker-2")
    assert seen == [(1, None), (2, "marker-2"), (3, None)]
    # A save that never commits: the rounds behind it are reported when the attempt ends.
    saves.round(PendingCommit(4, None, {}, [{"it": 4}], waiting={1}))
    saves.round(PendingCommit(5, None, {}, [{"it": 5}], waiting=set()))
    saves.close()
    assert seen[3:] == [(4, None), (5, None)]


def test_checkpoints_rank_in_report_order_whatever_order_they_commit_in(tmp_path):
    """An asynchronous checkpoint 1 that commits after a synchronous checkpoint 2: without a
    score attribute Ray ranks by report, so 2 is the latest and the first of `best()`, and a
    restored Result lists 2 last."""
    from unbroken.core.config import CheckpointConfig as Config
    from unbroken.store import commit
    from unbroken.store.checkpoint_manager import CheckpointManager
    from unbroken.store.storage import Storage

    storage = Storage.from_url(str(tmp_path / "run"))
    manager = CheckpointManager(storage, Config())
    for iteration in (2, 1):
        local = tmp_path / f"local{iteration}"
        local.mkdir()
        (local / "w.bin").write_bytes(b"weights %d" % iteration)
        files = commit.write_rank_files(storage, commit.staging_name(iteration, 1, storage), str(local), 0)
        manager.commit(iteration, 1, [files], {"training_iteration": iteration})
    assert [m.iteration for m in manager.committed] == [1, 2]
    assert manager.latest.iteration == 2
    assert [m.iteration for m in manager.best()] == [2, 1]
    assert manager.recover().iteration == 2, "a restore resumes from the same one"


def test_async_save_is_the_older_spelling_of_the_async_upload_mode(tmp_path):
    import torch

    from unbroken.errors import UnsupportedOptionError
    from unbroken.train import CheckpointUploadMode
    from unbroken.train.torch import TrainState

    model = torch.nn.Linear(2, 1)
    with pytest.warns(DeprecationWarning, match="checkpoint_upload_mode=CheckpointUploadMode.ASYNC"):
        assert TrainState(model=model, async_save=True)._async_save
    assert TrainState(model=model, checkpoint_upload_mode=CheckpointUploadMode.ASYNC)._async_save
    assert not TrainState(model=model)._async_save
    with pytest.raises(UnsupportedOptionError, match="Hint: use CheckpointUploadMode.SYNC"):
        TrainState(model=model, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
    with pytest.raises(TypeError, match="takes a CheckpointUploadMode"):
        TrainState(model=model, checkpoint_upload_mode=True)
