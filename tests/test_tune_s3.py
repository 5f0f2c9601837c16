"""Sweeps on S3-compatible object storage (a real moto server on loopback): Optuna's study kept
as a journal in the bucket and ASHA's judgements under a lock object, a sweep driver killed
mid-way and restored on a fresh machine from the bucket alone. Each driver runs in a process
of its own, as in test_s3."""

import ast
import os
import uuid

import pytest

from conftest import read_until, run_script, s3_env, start_script
from test_s3 import fresh_machine, keys

pytestmark = pytest.mark.usefixtures("s3_endpoint")

SWEEP = """
import os, sys
os.chdir(os.environ["HOME"])
from tune_loops import asha_loop
from unbroken import tune
from unbroken.train import RunConfig
from unbroken.tune.schedulers import ASHAScheduler
from unbroken.tune.search import OptunaSearch
config = tune.TuneConfig(metric="score", mode="max", num_samples=5, seed=5, max_concurrent_trials=1,
                         search_alg=OptunaSearch(),
                         scheduler=ASHAScheduler(max_t=4, grace_period=1, reduction_factor=2))
space = {"x": tune.uniform(0, 4), "y": tune.choice([0.0, 0.5]), "iterations": 4, "block_it": 1}
if sys.argv[3] == "fit":
    grid = tune.Tuner(asha_loop, param_space=space, tune_config=config,
                      run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
else:
    grid = tune.Tuner.restore(f"{sys.argv[1]}/{sys.argv[2]}", asha_loop).fit()
print("DONE", [(r.trial_status, round(r.config["x"], 9), r.config["y"], [row["score"] for row in r.rows])
               for r in grid])
"""


def done_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("DONE"))


def test_optuna_and_asha_sweep_on_s3_restores_on_a_fresh_machine_from_the_bucket_alone(s3_endpoint, tmp_path):
    storage = f"s3://bucket/{uuid.uuid4().hex[:8]}"
    block = tmp_path / "block"
    block.mkdir()
    os.mkfifo(block / "trial_00002")
    env = dict(fresh_machine(tmp_path, s3_endpoint, "a"), TUNE_TEST_BLOCK_DIR=str(block))
    driver = start_script(SWEEP, storage, "sweep", "fit", **env)
    read_until(driver, "trial_00002 BLOCKING")
    driver.kill()
    driver.wait()
    os.remove(block / "trial_00002")
    stored = keys(s3_endpoint, f"{storage}/sweep")
    assert any(k.startswith(".unbroken/optuna/") for k in stored) and "optuna.db" not in stored

    restored = run_script(SWEEP, storage, "sweep", "restore", **fresh_machine(tmp_path, s3_endpoint, "b"))
    reference = run_script(SWEEP, str(tmp_path / "local"), "reference", "fit")  # on a local disk: quicker
    got, want = done_line(restored.stdout), done_line(reference.stdout)
    assert got == want, "the restored sweep proposed, stopped and scored what an uninterrupted one does"
    trials = ast.literal_eval(got[len("DONE "):])
    assert [t[0] for t in trials] == ["TERMINATED"] * 5
    assert any(len(t[3]) < 4 for t in trials), "ASHA stopped a trial early"
    assert ".unbroken/asha/lock" not in keys(s3_endpoint, f"{storage}/sweep"), "the lock was released"


LOCKED = """
import sys, threading, time
from unbroken.store import storage_lock
from unbroken.store.storage import Storage
storage = Storage.from_url(sys.argv[1])
inside, most, order = [0], [0], []

def work(n):
    for _ in range(3):
        with storage_lock.held(storage, "lock"):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            order.append(n)
            time.sleep(0.02)  # widen the section: without the lock, the threads would overlap in it
            inside[0] -= 1

threads = [threading.Thread(target=work, args=(n,)) for n in range(3)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print("MOST", most[0], "SECTIONS", len(order), "LEFT", storage.exists("lock"))
# A holder that died long ago: its lock is taken over.
import json
storage.write_atomic("lock", json.dumps({"token": "dead", "at": time.time() - 3600, "pid": 1}).encode())
with storage_lock.held(storage, "lock"):
    print("TOOK OVER", json.loads(storage.read_bytes("lock"))["token"] != "dead")
print("RELEASED", not storage.exists("lock"))
"""


def test_the_storage_lock_on_s3_lets_one_holder_in_and_takes_over_a_dead_one(s3_endpoint):
    out = run_script(LOCKED, f"s3://bucket/{uuid.uuid4().hex[:8]}", **s3_env(s3_endpoint)).stdout
    assert "MOST 1 SECTIONS 9 LEFT False" in out, out
    assert "TOOK OVER True" in out and "RELEASED True" in out, out
