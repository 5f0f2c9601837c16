"""Sweep semantics that Ray Tune's own tests expect: a function trainable's return value is its
final result, a trial that never ran has empty metrics, and a restore reconciles the sweep
manifest with trials whose runs ended after the sweep driver last wrote it. Real trial
processes, real kills."""

import json
import os
import signal

import pytest

from conftest import attempts, run_json, run_script, statuses, sweep_json
from tune_loops import KillTrialDriverOnce, returning, tune_loop, yielding
from unbroken import tune
from unbroken.train import RunConfig
from unbroken.tune import TuneConfig, Tuner


def raw_rows(trial_path):
    """Every row on disk, abandoned ones included."""
    with open(os.path.join(trial_path, "result.json")) as f:
        return [json.loads(line) for line in f if line.strip()]


REPORTED = ("score", "final", "_metric")  # every key the trainables here report or return


def user_keys(row):
    """What the trainable reported in a row, without the fields the run adds to every row."""
    return {k: v for k, v in row.items() if k in REPORTED}


# -- a function trainable's return value ---------------------------------------------------------

RETURN_CASES = [
    {"reports": 0, "ret": {"score": 3}},                  # only returns (Ray's documented example)
    {"reports": 2, "ret": {"score": 10, "final": True}},  # reports, then returns: one more, final row
    {"reports": 0, "ret": 5},                             # a number: {"_metric": 5}
    {"reports": 2, "ret": None},                          # None: nothing extra
    {"reports": 0, "ret": 0},                             # 0 is a result as well (Ray drops falsy values)
    {"reports": 0, "ret": "done"},                        # anything else fails the trial
]


def test_function_trainable_return_value_is_its_final_result(storage):
    grid = Tuner(returning, param_space={"case": tune.grid_search(RETURN_CASES)},
                 tune_config=TuneConfig(metric="score", mode="max"),
                 run_config=RunConfig(name="ret", storage_path=storage)).fit()
    assert [r.trial_status for r in grid] == ["TERMINATED"] * 5 + ["ERROR"], [r.error for r in grid]
    only, both, number, none, zero, bad = grid

    assert [user_keys(r) for r in only.rows] == [{"score": 3}] and only.metrics["score"] == 3
    assert [user_keys(r) for r in both.rows] == [{"score": 1}, {"score": 2}, {"score": 10, "final": True}]
    assert [r["training_iteration"] for r in both.rows] == [1, 2, 3]
    assert both.metrics["score"] == 10 and both.metrics["training_iteration"] == 3
    assert both.checkpoint.path.endswith("checkpoint_000002"), "the returned row carries no checkpoint"
    assert [user_keys(r) for r in number.rows] == [{"_metric": 5}]
    assert [user_keys(r) for r in none.rows] == [{"score": 1}, {"score": 2}]
    assert [user_keys(r) for r in zero.rows] == [{"_metric": 0}]
    assert "ValueError" in str(bad.error) and "returned (or yielded) str 'done'" in str(bad.error)
    assert bad.metrics == {} and bad.rows == [], "a trial without rows has empty metrics, as in Ray"

    assert grid.get_best_result() is both
    assert grid.get_best_result("_metric", "max") is number
    assert list(grid.get_dataframe()["score"].fillna(-1)) == [3, 10, -1, 2, -1, -1]

    # A generator function has every value it yields reported; its return value is not (as in Ray).
    [gen] = Tuner(yielding, param_space={"x": 2},
                  run_config=RunConfig(name="gen", storage_path=storage)).fit()
    assert gen.trial_status == "TERMINATED"
    assert [user_keys(r) for r in gen.rows] == [{"score": 2}, {"score": 4}, {"score": 6}, {"_metric": 7}]


def test_returned_row_is_recorded_once_across_a_killed_trial(storage, tmp_path):
    marker = str(tmp_path / "killed")
    path = os.path.join(storage, "once")
    space = {"case": {"reports": 2, "ret": {"score": 10, "final": True}}}
    # The trial's driver is SIGKILLed right after it recorded the returned row (attempt 1).
    [killed] = Tuner(returning, param_space=space,
                     run_config=RunConfig(name="once", storage_path=storage,
                                          callbacks=[KillTrialDriverOnce("final", marker)])).fit()
    assert os.path.exists(marker) and killed.trial_status == "ERROR" and "SIGKILL" in str(killed.error)
    trial = os.path.join(path, "trial_00000")
    assert [(r["training_iteration"], r["attempt"]) for r in raw_rows(trial)] == [(1, 1), (2, 1), (3, 1)]

    [result] = Tuner.restore(path, returning, resume_errored=True).fit()
    assert result.trial_status == "TERMINATED", result.error
    assert attempts(trial) == ["ABORTED", "FINISHED"]
    assert run_json(trial)["attempts"][1]["resumed_from"] == "checkpoint_000002"
    # The resumed function returned again; its row replaces the one recorded by attempt 1.
    assert [(r["training_iteration"], r["attempt"]) for r in result.rows] == [(1, 1), (2, 1), (3, 2)]
    assert [user_keys(r) for r in result.rows] == [{"score": 1}, {"score": 2}, {"score": 10, "final": True}]
    assert len(result.metrics_dataframe) == 3
    assert len([r for r in raw_rows(trial) if r.get("final")]) == 2, "on disk, tagged with their attempts"


# -- a sweep driver killed after a trial's run ended, before the sweep manifest recorded it ------------

KILLED_AT_FIRST_END = """
import sys
from tune_loops import tune_loop
from unbroken import tune
from unbroken.train import RunConfig
space = {"x": tune.grid_search([1, 2]), "iterations": 4}
if sys.argv[3]:
    space["fail_once"] = sys.argv[3]
tune.Tuner(tune_loop, param_space=space,
           tune_config=tune.TuneConfig(metric="score", mode="max", max_concurrent_trials=1),
           run_config=RunConfig(name=sys.argv[2], storage_path=sys.argv[1])).fit()
print("NOT KILLED")
"""


def killed_at_first_end(storage, tmp_path, name, fail):
    """A sweep of two trials, one at a time, whose driver is SIGKILLed when the first trial's
    process has ended (its run FINISHED, or ERRORED with `fail`) and before the sweep manifest
    records it. Returns the sweep's path."""
    log = str(tmp_path / f"{name}.faults")
    fail_once = str(tmp_path / f"{name}.failed") if fail else ""
    proc = run_script(KILLED_AT_FIRST_END, storage, name, fail_once, check=False,
                      UNBROKEN_FAULT="before_trial_record", UNBROKEN_FAULT_LOG=log)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert open(log).read().split()[0] == "before_trial_record"
    path = os.path.join(storage, name)
    assert statuses(path) == {"trial_00000": "RUNNING", "trial_00001": "PENDING"}
    assert run_json(os.path.join(path, "trial_00000"))["status"] == ("ERRORED" if fail else "FINISHED")
    return path


def test_trial_that_never_ran_has_empty_metrics_and_a_finished_run_is_recorded(storage, tmp_path):
    path = killed_at_first_end(storage, tmp_path, "never", fail=False)
    grid = Tuner.restore(path, tune_loop, resume_unfinished=False).fit()
    finished, never = grid
    assert finished.trial_status == "TERMINATED" and finished.metrics["score"] == 4
    assert attempts(finished.path) == ["FINISHED"], "it did not run again"
    assert never.trial_status == "PENDING" and never.metrics == {} and never.metrics.get("score") is None
    assert never.rows == [] and never.checkpoint is None and never.error is None
    assert statuses(path) == {"trial_00000": "TERMINATED", "trial_00001": "PENDING"}, "recorded"
    assert sweep_json(path)["status"] == "INCOMPLETE" and sweep_json(path)["trials"][0]["told"]
    assert grid.get_best_result() is finished
    assert list(grid.get_dataframe()["trial_status"]) == ["TERMINATED", "PENDING"]
    assert Tuner.restore(path, tune_loop).get_results()[1].metrics == {}
    # A later restore runs the trial that never ran.
    assert [r.trial_status for r in Tuner.restore(path, tune_loop).fit()] == ["TERMINATED"] * 2


@pytest.mark.parametrize("flags, outcome", [
    ({"resume_unfinished": False, "resume_errored": True}, "resumed"),
    ({"resume_unfinished": False, "restart_errored": True}, "restarted"),
    ({"resume_unfinished": False}, "left"),
    ({}, "left"),
], ids=["resume_errored", "restart_errored", "resume_nothing", "defaults"])
def test_restore_reconciles_an_errored_trial_the_killed_driver_did_not_record(storage, tmp_path, flags,
                                                                              outcome):
    path = killed_at_first_end(storage, tmp_path, "errored", fail=True)
    trial = os.path.join(path, "trial_00000")
    grid = Tuner.restore(path, tune_loop, **flags).fit()
    first, second = grid
    if outcome == "left":
        assert first.trial_status == "ERROR" and "one-time failure" in str(first.error)
        assert attempts(trial) == ["ERRORED"], "not run again"
        assert first.metrics["training_iteration"] == 1
    else:
        assert first.trial_status == "TERMINATED", first.error
        assert [r["training_iteration"] for r in first.rows] == [1, 2, 3, 4]
        if outcome == "resumed":
            assert attempts(trial) == ["ERRORED", "FINISHED"]
            assert run_json(trial)["attempts"][1]["resumed_from"] == "checkpoint_000001"
            assert [r["attempt"] for r in first.rows] == [1, 2, 2, 2]
        else:
            assert attempts(trial) == ["FINISHED"] and run_json(trial)["attempts"][0]["resumed_from"] is None
            assert attempts(os.path.join(path, ".unbroken", "restarted", "trial_00000.1")) == ["ERRORED"]
    assert statuses(path)["trial_00000"] == first.trial_status, "the sweep manifest records it"
    unfinished = flags.get("resume_unfinished", True)
    assert second.trial_status == ("TERMINATED" if unfinished else "PENDING")
    assert sweep_json(path)["status"] == ("FINISHED" if unfinished else "INCOMPLETE")


# -- leftovers -------------------------------------------------------------------------------------

def test_restore_removes_a_killed_sweep_drivers_temps_before_writing(storage):
    """A sweep driver killed mid-write leaves an atomic-write temp; the next driver of the sweep
    removes it right after taking the lease (the temp of a live writer has that writer's pid)."""
    space = {"x": tune.grid_search([1, 2]), "y": 0, "iterations": 2, "fail_x": 2}
    path = os.path.join(storage, "temps")
    grid = Tuner(tune_loop, param_space=space, run_config=RunConfig(name="temps", storage_path=storage)).fit()
    assert len(grid.errors) == 1
    planted = [os.path.join(path, ".unbroken", "sweep.json.tmp-999999"), os.path.join(path, "x.tmp-999998")]
    for temp in planted:
        with open(temp, "w") as f:
            f.write("half-written")
    Tuner.restore(path, tune_loop, resume_errored=True).fit()
    assert not any(os.path.exists(t) for t in planted)
    assert statuses(path) == {"trial_00000": "TERMINATED", "trial_00001": "TERMINATED"}


def test_restore_records_the_end_a_killed_sweep_driver_did_not(storage):
    """A sweep driver killed after its last trial was recorded, before the sweep's own status
    was, leaves sweep.json saying RUNNING: a restore with nothing to run records FINISHED."""
    space = {"x": tune.grid_search([1, 2]), "y": 0, "iterations": 2}
    path = os.path.join(storage, "late")
    Tuner(tune_loop, param_space=space, run_config=RunConfig(name="late", storage_path=storage)).fit()
    manifest = sweep_json(path)
    assert manifest["status"] == "FINISHED"
    manifest["status"] = "RUNNING"  # the state the killed driver left on storage
    with open(os.path.join(path, ".unbroken", "sweep.json"), "w") as f:
        json.dump(manifest, f)
    rows_before = {t: raw_rows(os.path.join(path, t)) for t in statuses(path)}
    grid = Tuner.restore(path, tune_loop, resume_unfinished=False).fit()
    assert sweep_json(path)["status"] == "FINISHED"
    assert [r.trial_status for r in grid] == ["TERMINATED", "TERMINATED"]
    assert {t: raw_rows(os.path.join(path, t)) for t in statuses(path)} == rows_before, "nothing re-ran"


def test_asha_says_above_the_cutoff_for_a_metric_to_minimise():
    """The stop message speaks in the metric's own terms (mode="min": a loss above the cutoff)."""
    from unbroken.tune.asha import describe_decision

    decision = {"metric": "loss", "value": 0.9, "cutoff": 0.5, "rung": 1, "time_attr": "training_iteration",
                "time": 1}
    assert "loss=0.9 above the cutoff 0.5 of rung 1" in describe_decision(decision)
    score = {**decision, "metric": "score", "value": 0.1}
    assert "score=0.1 below the cutoff 0.5" in describe_decision(score)


def test_asha_brackets_start_a_rung_higher_and_judge_each_bracket_apart(tmp_path):
    """brackets=2: bracket 1's first rung is one reduction higher; a trial's bracket is drawn
    from its name alone (every driver and restore draws the same), likelier for the bracket
    with more rungs; a trial is judged only against trials of its own bracket."""
    from unbroken.store.storage import Storage
    from unbroken.tune.asha import ASHAScheduler, TrialStopper, read_decision

    sched = ASHAScheduler(max_t=8, grace_period=1, reduction_factor=2, brackets=2)
    assert sched.milestones(0) == [1, 2, 4, 8] and sched.milestones(1) == [2, 4, 8]
    names = [f"trial_{i:05d}" for i in range(400)]
    drawn = [sched.bracket_of(n) for n in names]
    assert drawn == [ASHAScheduler(max_t=8, grace_period=1, reduction_factor=2, brackets=2).bracket_of(n)
                     for n in names]
    share = drawn.count(0) / len(drawn)  # Ray's weights: e**0 against e**-1, 0.73 of the trials
    assert 0.65 < share < 0.81, share
    assert ASHAScheduler(brackets=1).bracket_of("trial_00001") == 0
    with pytest.raises(ValueError, match="brackets must be an int >= 1"):
        ASHAScheduler(brackets=0)

    url = str(tmp_path / "sweep")
    zero = [n for n, b in zip(names, drawn, strict=True) if b == 0][:2]
    one = [n for n, b in zip(names, drawn, strict=True) if b == 1][:2]

    def stopper(trial):
        return TrialStopper(trial, url, None, sched, "score", "max")

    # The better trial of each bracket first: the worse one after it is stopped at its first
    # rung, judged against its own bracket's only (bracket 1's first rung is 2, so the
    # bracket-1 trials are not judged at 1 at all).
    assert stopper(zero[0])({"training_iteration": 1, "score": 0.9}) is False
    assert stopper(one[0])({"training_iteration": 1, "score": 0.1}) is False
    assert stopper(zero[1])({"training_iteration": 1, "score": 0.5}) is True
    assert stopper(one[0])({"training_iteration": 2, "score": 0.1}) is False, "first in its bracket's rung 2"
    assert stopper(one[1])({"training_iteration": 2, "score": 0.05}) is True
    storage = Storage.from_url(url)
    assert read_decision(storage, one[1])["bracket"] == 1 and read_decision(storage, zero[1])["bracket"] == 0
    assert sorted(storage.listdir(".unbroken/asha/bracket_1")) == ["rung_2"]
    assert stopper(one[1])({"training_iteration": 3, "score": 1.0}) is True, "stopped stays stopped"


def test_asha_says_in_advance_which_report_it_may_stop_a_trial_at():
    """With time counted in iterations, each rung is known in advance: a trial's ranks wait
    for the verdict at the report of its next rung (or max_t, or the user's own stop) instead
    of beginning one more iteration (`config.stop_due_at`)."""
    from unbroken.tune.asha import TrialStopper
    from unbroken.tune.schedulers import ASHAScheduler

    sched = ASHAScheduler(time_attr="training_iteration", grace_period=1, reduction_factor=2, max_t=8)
    stopper = TrialStopper("trial_00000", "unused://", None, sched, "score", "max")
    assert stopper.verdict_from() == 1, "rungs at 1, 2, 4 and 8"
    assert stopper({"training_iteration": 3}) is False, "a row without the metric is not judged"
    assert stopper.verdict_from() == 4, "the next rung past what the trial reached"
    capped = TrialStopper("trial_00000", "unused://", None, sched, "score", "max",
                          user_stop={"training_iteration": 3})
    assert capped({"training_iteration": 2}) is False and capped.verdict_from() == 3, "before rung 4"
    timed = TrialStopper("trial_00000", "unused://", None,
                         ASHAScheduler(time_attr="time_total_s", grace_period=1, max_t=8), "score", "max")
    assert timed.verdict_from() is None, "time_total_s: nobody can say which report comes at a rung"
