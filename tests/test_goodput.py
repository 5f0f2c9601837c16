"""Where a run's time went (unbroken.run.goodput): the breakdown of made-up records, exact,
and of real runs with known step times, save stalls and failures, within a stated tolerance."""

import functools
import json
import logging
import re
import statistics
import subprocess
import sys
import time

import pytest

from conftest import run_json
from goodput_loops import paced_loop, timed_loop
from unbroken.run import checkpoint_advice
from unbroken.run import goodput as gp
from unbroken.run.stragglers import Straggler, Stragglers
from unbroken.train import CheckpointConfig, FailureConfig, Result, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer


def row(attempt: int, iteration: int, t: float, took: float, stall: float | None = None) -> dict:
    out = {"attempt": attempt, "training_iteration": iteration, "timestamp": t, "time_this_iter_s": took}
    if stall is not None:
        out["time_checkpoint_s"] = stall
    return out


def saved_stalls(path: str) -> dict[tuple[int, int], float]:
    """{(attempt, iteration): seconds} of each save the run's attempts recorded."""
    return {(a["number"], int(i)): s for a in run_json(path)["attempts"]
            for i, s in (a.get("checkpoint_stalls") or {}).items()}


def test_a_failed_and_restarted_fit_is_cut_into_each_kind_exactly():
    # fit() at 100; attempt 1 starts at 102, its first row 1.5 s later (1 s of work: the median
    # step), then a row a second, a 0.25 s save in row 4; it fails after row 5 and ends at 108.
    # Attempt 2 (the same fit()) waited 0.5 s for capacity, began at 109 from iteration 4, so
    # row 5 of attempt 1 was redone; it ends 0.5 s after its last row.
    attempts = [
        {"number": 1, "started_at": 102.0, "ended_at": 108.0, "status": "ERRORED", "fit_started_at": 100.0},
        {"number": 2, "started_at": 109.0, "ended_at": 114.0, "status": "FINISHED", "fit_started_at": 100.0,
         "elastic": {"reason": "rank lost", "capacity": 2, "previous": 2, "waited_s": 0.5}},
    ]
    rows = [row(1, 1, 103.5, 1.5), row(1, 2, 104.5, 1.0), row(1, 3, 105.5, 1.0), row(1, 4, 106.5, 1.0, 0.25),
            row(1, 5, 107.5, 1.0),
            row(2, 5, 110.5, 1.5), row(2, 6, 111.5, 1.0), row(2, 7, 112.5, 1.0), row(2, 8, 113.5, 1.0)]
    time_spent = gp.of_run(attempts, rows)
    assert time_spent.seconds == pytest.approx({
        gp.PRODUCTIVE: 3.75 + 4.0, gp.CHECKPOINT: 0.25, gp.STARTUP: 2.0 + 0.5, gp.REDONE: 1.0,
        gp.RECOVERY: 0.5 + 0.5 + 0.5, gp.WAITING: 0.5, gp.PREEMPTION: 0.0, gp.OTHER: 0.5})
    assert time_spent.wall_s == pytest.approx(14.0) and time_spent.goodput == pytest.approx(7.75 / 14)
    assert time_spent.by_attempt[2][gp.RECOVERY] == pytest.approx(1.0), "the gap and the set-up before row 5"

    segments = time_spent.segments
    assert all(a.end == pytest.approx(b.start) for a, b in zip(segments, segments[1:], strict=False)), \
        "the segments tile the wall time, in order"

    # Today's runs keep the stall in their attempt, not in the row: the same breakdown.
    attempts[0]["checkpoint_stalls"] = {"4": 0.25}
    rows[3] = row(1, 4, 106.5, 1.0)
    assert gp.of_run(attempts, rows).seconds == pytest.approx(time_spent.seconds)

    # Stopped by a preemption notice instead: the time from its last row to its end is preemption.
    attempts[0].update(status="PREEMPTED", preempted={"source": "SIGTERM"})
    preempted = gp.of_run(attempts, rows)
    assert preempted.by_attempt[1][gp.PREEMPTION] == pytest.approx(0.5)
    assert preempted.by_attempt[1][gp.RECOVERY] == 0.0


def test_a_killed_driver_s_attempt_ends_at_its_last_row_and_the_time_without_a_driver_is_apart():
    # The driver was SIGKILLed after row 3 (its attempt never recorded an end); a new fit() at
    # 200 started attempt 2 from iteration 2.
    attempts = [
        {"number": 1, "started_at": 10.0, "ended_at": None, "status": "ABORTED", "fit_started_at": 9.0},
        {"number": 2, "started_at": 201.0, "ended_at": 204.0, "status": "FINISHED", "fit_started_at": 200.0},
    ]
    rows = [row(1, 1, 11.0, 1.0), row(1, 2, 12.0, 1.0), row(1, 3, 13.0, 1.0),
            row(2, 3, 202.0, 1.0), row(2, 4, 203.0, 1.0)]
    time_spent = gp.of_run(attempts, rows)
    assert time_spent.between_fits_s == pytest.approx(200.0 - 13.0)
    assert time_spent.wall_s == pytest.approx((13.0 - 9.0) + (204.0 - 200.0))
    assert time_spent.seconds[gp.REDONE] == pytest.approx(1.0), "row 3 of the killed attempt"
    assert time_spent.seconds[gp.STARTUP] == pytest.approx(1.0 + 1.0)
    assert time_spent.seconds[gp.PRODUCTIVE] == pytest.approx(2.0 + 2.0)


def test_runs_written_before_fits_were_recorded_still_add_up():
    attempts = [{"number": 1, "started_at": 0.0, "ended_at": 3.0, "status": "ERRORED"},
                {"number": 2, "started_at": 4.0, "ended_at": 6.0, "status": "FINISHED"}]
    rows = [row(1, 1, 1.0, 1.0), row(1, 2, 2.0, 1.0), row(2, 2, 5.0, 1.0)]
    time_spent = gp.of_run(attempts, rows)
    assert time_spent.wall_s == pytest.approx(6.0) and time_spent.between_fits_s == 0
    assert time_spent.seconds[gp.RECOVERY] == pytest.approx(1.0 + 1.0)
    assert gp.of_run([], []).goodput is None


# A real run on 2 workers: 12 steps of 0.1 s, a checkpoint every 4 whose save blocks 0.3 s,
# rank 1 raising before report 6 of attempt 1 (recovery="checkpoint": attempt 2 resumes from
# checkpoint 4, so row 5 is redone). Tolerance: each figure within what the process adds to the injected time.
STEP_S, SAVE_S, TOLERANCE_S = 0.1, 0.3, 0.35


def test_a_real_run_s_breakdown_matches_the_injected_steps_saves_and_failure(tmp_path):
    config = {"iterations": 12, "step_s": STEP_S, "every": 4, "save_s": SAVE_S, "fail_at": 6}
    began = time.time()
    result = TorchTrainer(timed_loop, train_loop_config=config, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="timed", storage_path=str(tmp_path), verbose=0,
                                               failure_config=FailureConfig(max_failures=1,
                                                                            recovery="checkpoint"))).fit()
    wall = time.time() - began
    spent = Result.from_path(result.path).time_spent()
    seconds = spent.seconds
    assert sum(seconds.values()) == pytest.approx(spent.wall_s, abs=1e-6)
    assert spent.wall_s <= wall and spent.wall_s > wall - 0.5, "from fit()'s start to its end"
    assert 12 * STEP_S <= seconds[gp.PRODUCTIVE] <= 12 * STEP_S + TOLERANCE_S, seconds
    assert 3 * SAVE_S <= seconds[gp.CHECKPOINT] <= 3 * SAVE_S + TOLERANCE_S, "checkpoints 4, 8 and 12"
    assert STEP_S <= seconds[gp.REDONE] <= STEP_S + TOLERANCE_S / 2, "row 5 of attempt 1"
    assert seconds[gp.RECOVERY] > 0 and seconds[gp.STARTUP] > 0 and seconds[gp.WAITING] == 0
    assert spent.goodput == pytest.approx(seconds[gp.PRODUCTIVE] / spent.wall_s)
    checkpoints = [r for r in result.rows if r.get("checkpoint_dir_name")]
    assert [r["training_iteration"] for r in checkpoints] == [4, 8, 12]
    stalls = saved_stalls(result.path)
    assert sorted(stalls) == [(1, 4), (2, 8), (2, 12)], stalls
    assert all(SAVE_S <= s < SAVE_S + 0.2 for s in stalls.values()), stalls
    assert not any("time_checkpoint_s" in r for r in result.rows), "the rows hold what the loop reported"
    assert "time_checkpoint_s" not in result.metrics and "time_checkpoint_s" not in result.checkpoints[-1][1]


def test_checkpoint_auto_saves_at_the_young_daly_interval_and_show_advises_it(tmp_path):
    # A save costs 0.2 s, a step 0.05 s, failures are expected every 2 s: Young's interval is
    # sqrt(2 * 0.2 * 2) = 0.89 s of training, about 18 steps. The first auto report saves to
    # measure the cost; after it, each save comes once that much training went by.
    config = {"iterations": 60, "step_s": 0.05, "every": "auto", "save_s": 0.2, "fail_at": 0}
    result = TorchTrainer(timed_loop, train_loop_config=config, run_config=RunConfig(
        name="auto", storage_path=str(tmp_path), verbose=0,
        checkpoint_config=CheckpointConfig(mean_time_between_failures_s=2.0))).fit()
    rows = result.rows
    saves = [i for i, r in enumerate(rows) if r.get("checkpoint_dir_name")]
    assert saves[0] == 1, "the report after the first one saves, to measure a save"
    stalls = {i: s for (_, i), s in saved_stalls(result.path).items()}
    assert sorted(stalls) == [rows[i]["training_iteration"] for i in saves]
    cost = statistics.median(stalls.values())
    interval = checkpoint_advice.young_interval(cost, 2.0)
    assert 0.85 <= interval <= 1.2
    for a, b in zip(saves, saves[1:], strict=False):
        trained = sum(r["time_this_iter_s"] - stalls.get(r["training_iteration"], 0.0)
                      for r in rows[a + 1:b + 1])
        assert interval - 0.1 <= trained <= interval + 0.25, (a, b, trained, interval)
    assert len(saves) >= 3

    out = subprocess.run([sys.executable, "-m", "unbroken", "show", result.path, "--mtbf", "2"],
                         capture_output=True, text=True, check=True).stdout
    advised = re.search(r"advised interval \(Young/Daly\): every ([\d.]+) s of training", out)
    assert advised and float(advised.group(1)) == pytest.approx(interval, abs=0.15), out
    assert "MTBF 2.00 s (given)" in out


def test_the_advice_follows_young_and_the_expected_goodput_peaks_there():
    assert checkpoint_advice.young_interval(2.0, 3600.0) == pytest.approx(120.0)
    best = checkpoint_advice.young_interval(1.0, 1000.0)
    at = functools.partial(checkpoint_advice.expected_goodput, cost_s=1.0, mtbf_s=1000.0, recovery_s=5.0)
    assert at(best) > at(best / 3) and at(best) > at(best * 3)
    attempts = [{"number": 1, "started_at": 0.0, "ended_at": 10.0, "status": "ERRORED"},
                {"number": 2, "started_at": 10.0, "ended_at": 20.0, "status": "FINISHED"}]
    rows = [row(1, 1, 1.0, 1.0), row(1, 2, 2.0, 1.0, 0.5), row(2, 2, 11.0, 1.0), row(2, 3, 12.0, 1.0, 0.5)]
    advice = checkpoint_advice.advise(attempts, rows, gp.of_run(attempts, rows))
    assert (advice.failures, advice.given, advice.cost_s) == (1, False, 0.5)
    assert advice.mtbf_s == pytest.approx(20.0), "the wall time per failure seen"
    assert checkpoint_advice.advise(attempts, rows[:1], gp.of_run(attempts, rows[:1])) is None, "no save yet"


def test_stragglers_are_named_from_a_consistent_median_against_the_other_ranks():
    slow = Stragglers(window=4, min_reports=3, ratio=1.5)
    slow.add({0: 0.01, 1: 0.01, 2: 0.03, 3: None})
    slow.add({0: 0.01, 1: 0.01, 2: 0.03, 3: None})
    assert slow.straggler() is None and slow.summary() is None, "two reports are not yet consistent"
    slow.add({0: 0.01, 1: 0.012, 2: 0.03, 3: None})
    assert slow.straggler() == Straggler(2, 3.0)
    assert slow.summary() == {"median_s": [0.01, 0.01, 0.03, None], "straggler": {"rank": 2, "ratio": 3.0}}
    for _ in range(3):  # rank 2 catches up: the window forgets its slow reports
        slow.add({0: 0.01, 1: 0.01, 2: 0.011, 3: None})
    assert slow.straggler() is None
    even = Stragglers(window=4, min_reports=1, ratio=1.5)
    even.add({0: 0.01, 1: 0.014})
    assert even.straggler() is None, "1.4x is within the spread allowed"


@pytest.mark.parametrize("slow_rank", [1, None])
def test_a_rank_with_a_slow_forward_pass_is_named_in_rows_progress_and_show(tmp_path, slow_rank, caplog):
    config = {"iterations": 14, "forward_s": 0.01, "slow_s": 0.04, "slow_rank": slow_rank}
    with caplog.at_level(logging.INFO, logger="unbroken"):
        result = TorchTrainer(paced_loop, train_loop_config=config,
                              scaling_config=ScalingConfig(num_workers=2),
                              run_config=RunConfig(name="paced", storage_path=str(tmp_path), verbose=1)).fit()
    progress = [r.getMessage() for r in caplog.records if "attempt 1, iteration 14" in r.getMessage()]
    named = [(r.get("straggler_rank"), r["training_iteration"]) for r in result.rows if "straggler_rank" in r]
    attempt = json.loads(open(f"{result.path}/.unbroken/run.json").read())["attempts"][0]
    out = subprocess.run([sys.executable, "-m", "unbroken", "show", result.path],
                         capture_output=True, text=True, check=True).stdout
    assert len(attempt["forward_s"]["median_s"]) == 2
    if slow_rank is None:
        assert named == [] and attempt["forward_s"]["straggler"] is None
        assert "was slow" not in out and progress and "slow" not in progress[-1]
        return
    assert re.search(r", slow: rank 1 \([\d.]+x\): FINISHED$", progress[-1]), progress
    assert [rank for rank, _ in named] == [1] * 10, "from the 5th report on, every row names rank 1"
    assert named[0][1] == 5
    straggler = attempt["forward_s"]["straggler"]
    assert straggler["rank"] == 1 and straggler["ratio"] >= 2.5
    assert re.search(r"rank 1 was slow: 0\.04\d* s per report in the model's forward pass, [\d.]+x", out), out
