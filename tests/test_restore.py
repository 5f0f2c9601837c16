"""The restore rules (SPEC section 2, items 2-7)."""

import json
import logging
import os
import socket
import subprocess
import sys
import threading

import pytest

from conftest import driver_env, read_until, run_script, start_script
from loops import REBUILDS, Handle, linear_loop, must_not_run, simple_loop
from unbroken import train
from unbroken.errors import (
    IdentityMismatchError,
    LeaseHeldError,
    RunExistsError,
    RunNotFoundError,
    TrainerClassMismatchError,
)
from unbroken.train import (
    BaseTrainer,
    DataParallelTrainer,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)
from unbroken.train.torch import TorchTrainer


def failing_loop(config):
    """Reports `iterations` rows with a checkpoint each; fails once at `fail_at` in attempt 1."""
    import tempfile

    start = 0
    if (ckpt := train.get_checkpoint()) is not None:
        start = ckpt.get_metadata()["it"]
    for it in range(start + 1, config["iterations"] + 1):
        if it == config.get("fail_at") and train.get_context().get_attempt() == 1:
            raise RuntimeError("crash")
        with tempfile.TemporaryDirectory() as d:
            ckpt = train.Checkpoint.from_directory(d)
            ckpt.set_metadata({"it": it})
            train.report({"it": it, "handle": type(config.get("handle")).__name__}, checkpoint=ckpt)


class MyTrainer(DataParallelTrainer):
    """A subclass with an extra argument and no restore code of its own."""

    def __init__(self, train_loop_per_worker, *, extra: int = 0, **kwargs):
        super().__init__(train_loop_per_worker, **kwargs)
        self.extra = extra


def crashed_run(storage, name, trainer_cls=DataParallelTrainer, **kwargs):
    kwargs.setdefault("train_loop_config", {"iterations": 4, "fail_at": 3})
    with pytest.raises(TrainingFailedError):
        trainer_cls(failing_loop, run_config=RunConfig(name=name, storage_path=storage), **kwargs).fit()
    return os.path.join(storage, name)


def attempts(path):
    return json.load(open(os.path.join(path, ".unbroken", "run.json")))["attempts"]


def test_subclass_restores_without_restore_code(storage):
    path = crashed_run(storage, "sub", MyTrainer, extra=7)
    trainer = MyTrainer.restore(path)
    assert type(trainer) is MyTrainer and trainer.extra == 7
    result = trainer.fit()
    assert list(result.metrics_dataframe["it"]) == [1, 2, 3, 4]
    assert [a["resumed_from"] for a in attempts(path)] == [None, "checkpoint_000002"]


def test_base_trainer_restore_returns_the_saved_class(storage):
    path = crashed_run(storage, "saved-class", MyTrainer, extra=3)
    trainer = BaseTrainer.restore(path)
    assert type(trainer) is MyTrainer and trainer.extra == 3
    assert DataParallelTrainer.can_restore(path) and MyTrainer.can_restore(path)
    assert not TorchTrainer.can_restore(path)


def test_unrelated_class_is_an_error_naming_the_saved_one(storage):
    path = crashed_run(storage, "unrelated")
    with pytest.raises(TrainerClassMismatchError) as info:
        TorchTrainer.restore(path)
    assert "DataParallelTrainer" in str(info.value) and "DataParallelTrainer.restore(" in str(info.value)


MAIN_TRAINER = """
import sys
from unbroken import train
from unbroken.train import BaseTrainer, RunConfig, TrainingFailedError

class MainTrainer(BaseTrainer):
    def __init__(self, steps, *, run_config=None):
        super().__init__(run_config=run_config)
        self.steps = steps

    def training_loop(self):
        ckpt = train.get_checkpoint()
        start = ckpt.get_metadata()["step"] if ckpt else 0
        import tempfile
        for step in range(start + 1, self.steps + 1):
            if step == 3 and train.get_context().get_attempt() == 1:
                raise RuntimeError("crash in __main__ trainer")
            with tempfile.TemporaryDirectory() as d:
                c = train.Checkpoint.from_directory(d)
                c.set_metadata({"step": step})
                train.report({"step": step}, checkpoint=c)

try:
    MainTrainer(5, run_config=RunConfig(name="main", storage_path=sys.argv[1])).fit()
except TrainingFailedError:
    print("FAILED AS PLANNED")
"""

RESTORE_MAIN = """
import sys
from unbroken.train import BaseTrainer
trainer = BaseTrainer.restore(sys.argv[1])
print("CLASS", type(trainer).__name__)
print("STEPS", list(trainer.fit().metrics_dataframe["step"]))
"""


def test_trainer_defined_in_main_restores_in_a_fresh_process(storage):
    assert "FAILED AS PLANNED" in run_script(MAIN_TRAINER, storage).stdout
    out = run_script(RESTORE_MAIN, os.path.join(storage, "main")).stdout
    assert "CLASS MainTrainer" in out and "STEPS [1, 2, 3, 4, 5]" in out


def test_argument_that_no_longer_unpickles_can_be_respecified(storage):
    config = {"iterations": 4, "fail_at": 3, "handle": Handle()}
    path = crashed_run(storage, "handle", train_loop_config=config)
    REBUILDS.update(count=0, dead=True)  # the "cluster" behind the handle is gone
    try:
        with pytest.raises(ValueError) as info:
            DataParallelTrainer.restore(path)
        message = str(info.value)
        assert "'train_loop_config'" in message and "cluster for handle cluster-1 is gone" in message
        assert f"DataParallelTrainer.restore({path!r}, train_loop_config=...)" in message
        REBUILDS["count"] = 0
        new_config = {"iterations": 4, "handle": Handle("cluster-2")}
        result = DataParallelTrainer.restore(path, train_loop_config=new_config).fit()
        assert REBUILDS["count"] == 0, "the stored argument was never unpickled"
    finally:
        REBUILDS.update(count=0, dead=False)
    assert list(result.metrics_dataframe["it"]) == [1, 2, 3, 4]


def test_argument_that_cannot_be_pickled_fails_before_training(storage):
    trainer = DataParallelTrainer(must_not_run, train_loop_config={"lock": threading.Lock()},
                                  run_config=RunConfig(name="lock", storage_path=storage))
    with pytest.raises(TypeError) as info:
        trainer.fit()
    assert "'train_loop_config'" in str(info.value) and "lock" in str(info.value)
    assert not os.path.exists(os.path.join(storage, "lock")), "nothing written"


def dataset_loop(config):
    train.report({"n": len(train.get_dataset_shard("train"))})


def test_datasets_are_never_pickled_and_must_be_respecified_by_key(storage):
    path = os.path.join(storage, "data")
    DataParallelTrainer(dataset_loop, datasets={"train": list(range(6))},
                        run_config=RunConfig(name="data", storage_path=storage)).fit()
    assert "datasets" not in json.load(open(os.path.join(path, ".unbroken", "run.json")))["params"]
    with pytest.raises(ValueError) as info:
        DataParallelTrainer.restore(path)
    assert "datasets" in str(info.value) and "restore(" in str(info.value) and "'train'" in str(info.value)
    with pytest.raises(ValueError) as info:
        DataParallelTrainer.restore(path, datasets={"valid": [1]})
    assert "same keys" in str(info.value)
    trainer = DataParallelTrainer.restore(path, datasets={"train": list(range(4))})
    assert trainer.datasets == {"train": [0, 1, 2, 3]}


def build_dataset():
    return list(range(5))


def test_dataset_builder_function_is_saved(storage):
    DataParallelTrainer(dataset_loop, datasets={"train": build_dataset},
                        run_config=RunConfig(name="builder", storage_path=storage)).fit()
    trainer = DataParallelTrainer.restore(os.path.join(storage, "builder"))
    assert trainer.datasets["train"] is build_dataset


def test_unknown_override_lists_the_valid_ones(storage):
    path = crashed_run(storage, "unknown")
    with pytest.raises(TypeError) as info:
        DataParallelTrainer.restore(path, learning_rate=0.1)
    assert "learning_rate" in str(info.value)
    for valid in ("train_loop_config", "scaling_config", "run_config", "datasets"):
        assert valid in str(info.value)


SCRIPT = """
import sys
from loops import linear_loop
from unbroken.train import RunConfig, ScalingConfig, TrainingFailedError
from unbroken.train.torch import TorchTrainer
config = {"iterations": 6, "ckpt_every": 2, "fail_at": [4, 1]}
try:
    result = TorchTrainer(linear_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="auto", storage_path=sys.argv[1])).fit()
    print("FINISHED", list(result.metrics_dataframe["training_iteration"]), result.metrics["attempt"])
except TrainingFailedError:
    print("CRASHED")
"""


def test_auto_resume_by_running_the_same_script_again(storage):
    assert "CRASHED" in run_script(SCRIPT, storage).stdout
    assert "FINISHED [1, 2, 3, 4, 5, 6] 2" in run_script(SCRIPT, storage).stdout
    # Third run: the run is finished, so the stored result comes back without training.
    assert "FINISHED [1, 2, 3, 4, 5, 6] 2" in run_script(SCRIPT, storage).stdout
    assert len(attempts(os.path.join(storage, "auto"))) == 2


def test_changed_identity_is_refused_with_the_diff(storage):
    path = crashed_run(storage, "ident")
    before = open(os.path.join(path, ".unbroken", "run.json")).read()
    trainer = DataParallelTrainer(failing_loop, train_loop_config={"iterations": 9, "fail_at": 3},
                                  run_config=RunConfig(name="ident", storage_path=storage))
    with pytest.raises(IdentityMismatchError) as info:
        trainer.fit()
    message = str(info.value)
    assert "train_loop_config.iterations: saved 4 -> now 9" in message
    assert "restore(" in message and "new name" in message
    assert open(os.path.join(path, ".unbroken", "run.json")).read() == before


def test_mutable_settings_may_change_on_auto_resume(storage):
    crashed_run(storage, "mutable")
    result = DataParallelTrainer(failing_loop, train_loop_config={"iterations": 4, "fail_at": 3},
                                 scaling_config=ScalingConfig(num_workers=2),
                                 run_config=RunConfig(name="mutable", storage_path=storage,
                                                      failure_config=FailureConfig(max_failures=3))).fit()
    assert list(result.metrics_dataframe["it"]) == [1, 2, 3, 4]
    assert [a["num_workers"] for a in attempts(result.path)] == [1, 2]


def test_resume_never_and_must(storage):
    crashed_run(storage, "never")
    with pytest.raises(RunExistsError):
        DataParallelTrainer(failing_loop, train_loop_config={"iterations": 4, "fail_at": 3},
                            run_config=RunConfig(name="never", storage_path=storage, resume="never")).fit()
    with pytest.raises(RunNotFoundError):
        DataParallelTrainer(failing_loop, train_loop_config={"iterations": 4},
                            run_config=RunConfig(name="missing", storage_path=storage, resume="must")).fit()
    assert not os.path.exists(os.path.join(storage, "missing"))


def test_finished_run_returns_stored_result_without_training(storage):
    config = {"iterations": 3}
    first = DataParallelTrainer(simple_loop, train_loop_config=config,
                                run_config=RunConfig(name="done", storage_path=storage)).fit()
    # A different function body is allowed; it must not even be called for a finished run.
    again = DataParallelTrainer(must_not_run, train_loop_config=config,
                                run_config=RunConfig(name="done", storage_path=storage)).fit()
    assert again.metrics == first.metrics and len(attempts(first.path)) == 1


def test_finished_run_restored_with_more_iterations_continues(storage):
    first = DataParallelTrainer(simple_loop, train_loop_config={"iterations": 3},
                                run_config=RunConfig(name="more", storage_path=storage)).fit()
    result = DataParallelTrainer.restore(first.path, train_loop_config={"iterations": 5}).fit()
    assert list(result.metrics_dataframe["training_iteration"]) == [1, 2, 3, 4, 5]
    assert [a["resumed_from"] for a in attempts(first.path)] == [None, "checkpoint_000003"]
    assert json.load(open(os.path.join(first.path, "params.json"))) == {"iterations": 5}


BLOCKING = """
import sys
from loops import linear_loop
from unbroken.train import RunConfig
from unbroken.train.torch import TorchTrainer
TorchTrainer(linear_loop, train_loop_config={"iterations": 2, "block_fifo": sys.argv[2]},
             run_config=RunConfig(name="leased", storage_path=sys.argv[1])).fit()
print("DONE")
"""


def test_second_live_driver_is_refused(storage, tmp_path):
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)
    driver = start_script(BLOCKING, storage, fifo)
    try:
        read_until(driver, "BLOCKING")
        trainer = TorchTrainer(linear_loop, train_loop_config={"iterations": 2, "block_fifo": fifo},
                               run_config=RunConfig(name="leased", storage_path=storage))
        with pytest.raises(LeaseHeldError) as info:
            trainer.fit()
        assert f"pid {driver.pid}" in str(info.value)
    finally:
        with open(fifo, "w") as f:
            f.write("go")
        out, err = driver.communicate(timeout=120)
    assert "DONE" in out, err


def test_stale_lease_is_taken_over_with_a_warning(storage, caplog):
    path = crashed_run(storage, "stale")
    lease = os.path.join(path, ".unbroken", "lease.json")
    import socket
    import time
    with open(lease, "w") as f:  # a driver on this host whose process is gone
        json.dump({"token": "x", "host": socket.gethostname(), "pid": 2 ** 22 + 1,
                   "process_start": "1", "heartbeat": time.time(), "ttl_s": 30}, f)
    with caplog.at_level(logging.WARNING, logger="unbroken"):
        result = DataParallelTrainer.restore(path).fit()
    assert result.metrics["it"] == 4
    assert any("taking over the lease" in r.message for r in caplog.records)
    assert not os.path.exists(lease), "released at the end"


def test_a_driver_whose_lease_was_taken_over_stops_writing(storage):
    from unbroken.errors import LeaseLostError
    from unbroken.store.lease import LEASE_JSON, Lease
    from unbroken.store.storage import Storage

    store = Storage.from_url(os.path.join(storage, "taken"))
    store.makedirs(".unbroken")
    first = Lease(store)
    first.acquire()
    record = json.loads(store.read_bytes(LEASE_JSON))
    store.write_atomic(LEASE_JSON, json.dumps(dict(record, token="another-driver")).encode())
    with pytest.raises(LeaseLostError, match="taken over by another driver"):
        first.beat(force=True)
    assert json.loads(store.read_bytes(LEASE_JSON))["token"] == "another-driver", "not overwritten"


def _contend(root: str, go, out, done) -> None:
    from unbroken.store.lease import Lease
    from unbroken.store.storage import Storage

    lease = Lease(Storage.from_url(root))
    go.wait()
    try:
        lease.acquire()
        out.put("won")
    except LeaseHeldError as e:
        out.put(f"refused: {e}")
    done.wait()  # a winner stays alive (a dead holder's lease may be taken over)


@pytest.mark.parametrize("lease", ["free", "dead holder"])
def test_two_drivers_claiming_a_lease_at_once_on_local_disk_one_wins(tmp_path, lease):
    """Of two processes that both find the lease free (or held by a dead driver) and claim it
    at the same moment, exactly one holds it. Write-then-read-back let both believe they held
    it: a free lease in 17 races in 100, a dead holder's in 17 in 100 too."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    dead = ctx.Process(target=os._exit, args=(0,))
    dead.start()
    dead.join()
    for race in range(60):
        root = tmp_path / f"run{race}"
        (root / ".unbroken").mkdir(parents=True)
        if lease == "dead holder":
            (root / ".unbroken" / "lease.json").write_text(json.dumps(
                {"token": "gone", "host": socket.gethostname(), "pid": dead.pid, "heartbeat": 0}))
        go, out, done = ctx.Event(), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_contend, args=(str(root), go, out, done)) for _ in range(2)]
        for p in procs:
            p.start()
        go.set()
        outcomes = sorted(out.get(timeout=60) for _ in procs)
        done.set()
        for p in procs:
            p.join(timeout=60)
        assert outcomes[0].startswith("refused") and outcomes[1] == "won", f"race {race}: {outcomes}"
        assert f"pid {procs[0].pid}" in outcomes[0] or f"pid {procs[1].pid}" in outcomes[0], \
            f"the refusal names the holder: {outcomes[0]}"
        assert not [n for n in os.listdir(root / ".unbroken") if ".tmp-" in n], "no temp file left"


def test_a_run_killed_after_the_report_that_met_its_stop_is_finished_not_run_further(tmp_path):
    """The driver died after the report that met RunConfig.stop (its checkpoint committed) and
    before run.json said FINISHED: a restore finishes the run there, with no new attempt and no
    iteration past the stop (the uninterrupted run's end)."""
    from tune_loops import tune_loop
    from unbroken.train import DataParallelTrainer
    from unbroken.train import RunConfig as Config

    def trainer():
        return DataParallelTrainer(tune_loop, train_loop_config={"iterations": 8},
                                   run_config=Config(name="stopped", storage_path=str(tmp_path), verbose=0,
                                                     stop={"training_iteration": 3}))

    first = trainer().fit()
    manifest_path = os.path.join(first.path, ".unbroken", "run.json")
    manifest = json.load(open(manifest_path))
    manifest["status"] = manifest["attempts"][-1]["status"] = "RUNNING"  # as its killed driver left it
    manifest["attempts"][-1].pop("ended_at", None)
    with open(manifest_path, "w") as f:
        json.dump(manifest, f)
    again = trainer().fit()
    attempts = json.load(open(manifest_path))["attempts"]
    assert [a["status"] for a in attempts] == ["ABORTED"] and again.metrics["training_iteration"] == 3
    assert [r["training_iteration"] for r in again.rows] == [1, 2, 3]


CODE_SCRIPT = """
import os
import sys
from unbroken import train
from unbroken.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from unbroken.train.torch import TorchTrainer


def loop(config):
    start = train.get_checkpoint() is not None
    for it in range(2):
        if os.environ.get("FAIL_ONCE") and not start and it == 1:
            raise RuntimeError("fails once")
        train.report({"it": it})


def changed(config):
    for it in range(2):
        train.report({"it": it + 100})


storage, how = sys.argv[1], sys.argv[2]
if how == "first":
    try:
        TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=1),
                     run_config=RunConfig(name="code", storage_path=storage)).fit()
    except TrainingFailedError:
        print("FAILED")
elif how == "restore":
    TorchTrainer.restore(os.path.join(storage, "code")).fit()
elif how == "same":
    TorchTrainer.restore(os.path.join(storage, "code"), train_loop_per_worker=loop).fit()
elif how == "by-name":
    TorchTrainer(loop, scaling_config=ScalingConfig(num_workers=1),
                 run_config=RunConfig(name="code", storage_path=storage)).fit()
else:
    TorchTrainer.restore(os.path.join(storage, "code"), train_loop_per_worker=changed).fit()
"""


@pytest.mark.parametrize("how", ["restore", "same", "by-name", "changed"])
def test_the_code_changed_message_appears_only_when_the_code_changed(storage, tmp_path, how):
    # The function lives in a file, as in a user's script: its source is read when it is
    # passed, and cannot be once restore() unpickled it.
    script = tmp_path / "script.py"
    script.write_text(CODE_SCRIPT)

    def run(*args: str, **env: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, str(script), storage, *args], env=driver_env(**env),
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr
        return proc

    assert "FAILED" in run("first", FAIL_ONCE="1").stdout
    again = run(how)
    said = "changed since the run was saved" in again.stderr
    assert said == (how == "changed"), again.stderr
