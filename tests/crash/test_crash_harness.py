"""The crash harness (tools/crash_harness.py) as a test: random SIGKILLs of the driver and of
workers, and kills at every step of the commit protocol, then restores until each run finishes.
The harness checks the invariants itself and lists every violation."""

import json
import os
import subprocess
import sys

import pytest

HARNESS = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "crash_harness.py")


def run_harness(trials: int, *extra: str) -> dict:
    proc = subprocess.run([sys.executable, HARNESS, "--trials", str(trials), "--json", *extra],
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode in (0, 1), proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check(report: dict, trials: int, commit_kills: int = 1, restores: int | None = None) -> None:
    where = f"crash harness seed {report['seed']}"
    assert report["violations"] == [], f"{where}: {report['violations']}"
    assert report.get("trials") == trials, where
    assert report.get("restores", 0) >= (trials // 2 if restores is None else restores), where
    assert report.get("kills inside commit", 0) >= commit_kills, where


def test_random_kills_never_lose_or_tear_anything():
    check(run_harness(12), 12)


@pytest.mark.slow
def test_random_kills_soak():
    check(run_harness(200), 200)


def test_random_kills_with_saves_in_the_background():
    check(run_harness(8, "--async"), 8)


@pytest.mark.slow
def test_random_kills_with_saves_in_the_background_soak():
    check(run_harness(200, "--async"), 200)


@pytest.mark.slow  # 20 s; kills on S3 are in test_s3, test_async_save and test_driver_race
def test_random_kills_with_runs_on_s3():
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    check(run_harness(1, "--s3", "--strike", "--max-kills", "2"), 1, commit_kills=0, restores=1)


@pytest.mark.slow
def test_random_kills_on_s3_soak():
    pytest.importorskip("moto")
    check(run_harness(40, "--s3"), 40)


@pytest.mark.slow  # 29 s; rank kills, node losses and driver kills on Ray are in test_ray_engine
def test_random_kills_with_workers_on_a_ray_cluster():
    pytest.importorskip("ray")
    check(run_harness(1, "--ray", "--strike", "--max-kills", "1"), 1, commit_kills=0, restores=1)


@pytest.mark.slow
def test_random_kills_on_a_ray_cluster_soak():
    pytest.importorskip("ray")
    check(run_harness(100, "--ray"), 100)


def test_random_kills_with_just_in_time_checkpoints():
    # The loop's state in a TrainState with just-in-time checkpoints: one rank struck right
    # after a report leaves the survivor's checkpoint of that round committed (the harness
    # checks it), and a kill of the survivor while it saves leaves the previous one.
    report = run_harness(8, "--jit", "--strike")
    check(report, 8)
    assert report.get("jit: saved", 0) + report.get("jit: fell back", 0) >= 1, report


def test_random_kills_with_recovery_in_place():
    # A rank struck right after a report is started again while the other keeps its process
    # and sends the round's state (the harness checks the next attempt recovered in place from
    # it); the sender or the receiver is sometimes killed in the middle of the transfer.
    report = run_harness(5, "--in-place", "--strike")
    # A launch goes on after a failure, so a launch rarely fails and restores (5 trials may
    # have none), and kills seldom land inside a commit: the other modes cover both.
    check(report, 5, commit_kills=0, restores=0)
    assert report.get("in place: recoveries", 0) >= 1, report


def test_preemption_notices_at_random_moments_commit_every_recorded_round():
    # SIGTERM to the driver with a 6 s grace at a random moment, half the time while every
    # rank's next step takes a minute (no report comes in time: the ranks give the step up and
    # the last round is saved just in time); the driver is SIGKILLed at the deadline. The
    # harness checks that every round the launch recorded is committed and the attempt says
    # PREEMPTED; then random kills as usual.
    report = run_harness(3, "--preempt")
    check(report, 3, commit_kills=0, restores=1)
    assert report.get("preempted", 0) >= 1, report


@pytest.mark.slow  # 55 s; the default run drains a node in test_ray_engine
def test_drained_nodes_on_a_ray_cluster_never_fail_the_run():
    # Each trial's first launch drains a rank's node for preemption, 6 s ahead, then the node
    # goes and a replacement joins: the run goes on without it and never fails for it.
    pytest.importorskip("ray")
    report = run_harness(3, "--ray", "--preempt")
    check(report, 3, commit_kills=0, restores=0)
    assert report.get("preempted: went on", 0) >= 1, report


@pytest.mark.slow
def test_preemption_notices_soak():
    check(run_harness(60, "--preempt"), 60, commit_kills=0)


@pytest.mark.slow
def test_random_kills_with_recovery_in_place_soak():
    check(run_harness(150, "--in-place"), 150, restores=50)


@pytest.mark.slow
def test_random_kills_with_recovery_in_place_on_a_ray_cluster_soak():
    # Each trial begins with a report fault; on Ray, 3 in 10 of them have one rank block right
    # after its report and then lose its node, which must be recovered in place too.
    pytest.importorskip("ray")
    report = run_harness(30, "--ray", "--in-place", "--strike")
    check(report, 30, commit_kills=0, restores=0)
    assert report.get("in place: after a lost node", 0) >= 1, report


@pytest.mark.slow  # about a minute a trial: elastic restarts on Ray take seconds
def test_random_kills_node_losses_and_returns_with_an_elastic_run_soak():
    pytest.importorskip("ray")
    check(run_harness(20, "--elastic"), 20)


def test_random_kills_with_a_streaming_loader():
    # The loop reads a per-rank stream (torchdata's StatefulDataLoader, a worker process
    # prefetching): each rank's sample sequence must equal the uninterrupted run's, whether a
    # resume seeks with the rank's own saved state or replays the pass after a just-in-time save.
    report = run_harness(6, "--data", "--strike")
    check(report, 6, restores=2)
    assert report.get("jit: saved", 0) + report.get("jit: fell back", 0) >= 1, report


@pytest.mark.slow
def test_random_kills_with_a_streaming_loader_recovered_in_place_soak():
    check(run_harness(60, "--data", "--in-place"), 60, commit_kills=0, restores=0)


def test_random_kills_with_each_launch_on_another_number_of_workers():
    # A Hugging Face stream split by node, each launch on 1, 2 or 3 workers: a restore carries
    # the pass in progress to the new size; no epoch trains on an example twice, and only a
    # carry's short last batch may leave some out.
    report = run_harness(5, "--resize")
    check(report, 5, commit_kills=0, restores=2)
    assert sum(report.get(f"launches on {n} workers", 0) > 0 for n in (1, 2, 3)) >= 2, report


@pytest.mark.slow
def test_random_kills_with_each_launch_on_another_number_of_workers_soak():
    check(run_harness(60, "--resize"), 60)


def test_a_pbt_sweep_killed_at_random_moments_ends_as_if_it_never_stopped():
    # The sweep driver is SIGKILLed after random reports and between a trial's end and its
    # record (before_trial_record), where a trial that finished at its own stop on a
    # perturbation point looks paused; no trial may run past its stop, or decide otherwise.
    check(run_harness(4, "--sweep"), 4, commit_kills=0, restores=2)


def test_a_pbt_sweep_with_reused_processes_killed_at_random_moments_ends_as_if_it_never_stopped():
    # Launches run with reuse_actors=True at random (the uninterrupted sweep does not), among
    # the same kills; some kill, once, a trial's process or a worker kept idle for the next
    # trial, and must end the sweep all the same.
    check(run_harness(4, "--sweep", "--reuse", "--seed", "11"), 4, commit_kills=0, restores=1)


def test_a_hyperband_sweep_killed_at_random_moments_ends_as_if_it_never_stopped():
    # Synchronous HyperBand: kills between a trial's pause and its record, or between rungs,
    # must not change which trials go on, or let one run past where it was stopped.
    check(run_harness(2, "--sweep", "--hyperband"), 2, commit_kills=0, restores=1)


def test_class_trials_killed_around_their_checkpoint_at_end_end_with_it():
    # Class trainables with checkpoint_at_end, stopped by a score: the sweep driver killed at
    # random, or a trial's rank killed with its at-end files staged and the driver not told
    # (before_attach_staged, then retried): each trial ends with the checkpoint of its last report.
    check(run_harness(4, "--sweep", "--class"), 4, commit_kills=0, restores=1)


@pytest.mark.slow
def test_a_pbt_sweep_killed_at_random_moments_soak():
    check(run_harness(60, "--sweep"), 60, commit_kills=0)


@pytest.mark.slow
def test_a_pbt_sweep_with_reused_processes_killed_at_random_moments_soak():
    check(run_harness(40, "--sweep", "--reuse"), 40, commit_kills=0)
