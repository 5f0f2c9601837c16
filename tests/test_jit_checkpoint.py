"""Just-in-time checkpoints: when a rank fails, a survivor saves the last complete round, the
next attempt resumes there, and the run still ends bit for bit like the uninterrupted one.

Real worker processes: 2 ranks on gloo (DDP), the local engine, `exact_loop` with
TrainState(jit_checkpoint=True, step_seed=...): dropout, augmentation, AdamW and a scheduler,
a periodic checkpoint every 4 steps. The failures strike right after the report of step 6,
so the JIT checkpoint is 6 and the periodic one 4.
"""

import contextlib
import io
import json
import os
import signal

import pytest
import torch

from conftest import run_script
from loops import exact_loop
from test_exact_resume import BASE, assert_same_run
from unbroken import train
from unbroken.cli import commands as cli
from unbroken.execution.recovery.just_in_time import OFFER_WAIT_S, Coordinator
from unbroken.state.state_file import capture_rng, restore_rng
from unbroken.train import FailureConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer, TrainState, prepare_model
from unbroken.worker.recovery.just_in_time import seed_step
from unbroken.worker.recovery.messages import JitArmed, JitOffer, JitSaved

STEP = 6  # the report the failures follow
PERIODIC = 4  # the periodic checkpoint before it


def fit(storage, name, max_failures=1, **config):
    return TorchTrainer(exact_loop, train_loop_config={**BASE, "jit": True, **config},
                        scaling_config=ScalingConfig(num_workers=2),
                        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(
                            max_failures=max_failures, recovery="just_in_time"))).fit()


def attempts(result) -> list[dict]:
    return json.load(open(os.path.join(result.path, ".unbroken", "run.json")))["attempts"]


def redone(result) -> int:
    """Iterations the first attempt reported that the second one ran again."""
    rows = [json.loads(line) for line in open(os.path.join(result.path, "result.json"))]
    last = max(r["training_iteration"] for r in rows if r["attempt"] == 1)
    return last - attempts(result)[1]["resumed_iteration"]


@pytest.fixture(scope="module")
def jit_reference(tmp_path_factory):
    """The uninterrupted run with per-step random streams."""
    return fit(str(tmp_path_factory.mktemp("jit")), "reference", max_failures=0)


@pytest.mark.parametrize("mode", ["sigkill", "raise"])
def test_a_failed_rank_resumes_from_the_survivors_checkpoint_bit_for_bit(storage, jit_reference, mode):
    # Rank 1 dies (or raises) right after report 6; rank 0, released from step 7's all-reduce,
    # saves checkpoint 6, and the next attempt resumes there instead of at checkpoint 4.
    result = fit(storage, f"jit-{mode}", die_after_report=[[STEP, 1, 1, mode]])
    first, second = attempts(result)
    assert first["status"] == "ERRORED" and second["status"] == "FINISHED"
    assert first["jit_checkpoint"]["iteration"] == STEP and first["jit_checkpoint"]["rank"] == 0, first
    assert second["resumed_from"] == f"checkpoint_{STEP:06d}"
    assert redone(result) <= 1
    assert_same_run(result, jit_reference, f"rank 1 {mode} after report {STEP}")
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        cli.main(["show", result.path])
    assert f"attempt 1: rank 0 saved iteration {STEP} just in time" in shown.getvalue()


def test_a_step_in_flight_falls_back_to_the_periodic_checkpoint(storage, jit_reference):
    # Rank 1 raises after step 6's optimizer step, before its report: no rank is clean since
    # report 5, so there is no JIT checkpoint and the attempt record says why.
    result = fit(storage, "jit-dirty", kill_at=[[STEP, 1, 1, "raise"]])
    first, second = attempts(result)
    assert first["jit_checkpoint"]["iteration"] is None
    assert "an optimizer step began after report 5" in first["jit_checkpoint"]["why_not"], first
    assert second["resumed_from"] == f"checkpoint_{PERIODIC:06d}"
    assert_same_run(result, jit_reference, "rank 1 raised after step 6's optimizer step")


def test_a_survivor_killed_while_saving_leaves_the_previous_checkpoint(storage, jit_reference, monkeypatch):
    # Rank 0 is killed halfway through its emergency save (its random state files staged, not
    # train_state.pt): nothing torn is committed, and the next attempt resumes from checkpoint 4.
    monkeypatch.setenv("UNBROKEN_FAULT", "during_jit_save:1:kill:0")
    result = fit(storage, "jit-saver-killed", die_after_report=[[STEP, 1, 1, "sigkill"]])
    first, second = attempts(result)
    assert first["jit_checkpoint"] == {"iteration": None, "why_not": "rank 0 died while saving"}, first
    assert second["resumed_from"] == f"checkpoint_{PERIODIC:06d}"
    assert not [n for n in os.listdir(result.path) if ".tmp-" in n]
    assert_same_run(result, jit_reference, "rank 0 killed during its just-in-time save")


def test_a_survivor_that_never_offers_is_not_waited_for(storage, jit_reference):
    # Rank 1 dies after report 6 while rank 0 hangs outside any collective (as with a peer on
    # a lost node): the driver waits OFFER_WAIT_S for an offer, then falls back.
    result = fit(storage, "jit-hung", die_after_report=[[STEP, 1, 1, "sigkill"], [STEP, 1, 0, "hang"]])
    first, second = attempts(result)
    assert "no rank offered within" in first["jit_checkpoint"]["why_not"], first
    assert OFFER_WAIT_S <= first["ended_at"] - first["started_at"] < OFFER_WAIT_S + 20
    assert second["resumed_from"] == f"checkpoint_{PERIODIC:06d}"
    assert_same_run(result, jit_reference, "rank 0 hung after report 6")


def test_without_a_step_seed_each_rank_s_own_seed_keeps_the_recovery_exact(storage):
    # No step_seed: each rank's streams are seeded from its torch seed as the loop set it
    # (exact_loop seeds rank r with 100 + r), recorded in run.json; a separate run seeded
    # alike draws alike, so the recovered run ends as the uninterrupted one.
    result = fit(storage, "jit-own-seed", step_seed=None, die_after_report=[[STEP, 1, 1, "sigkill"]])
    first, second = attempts(result)
    assert first["jit_checkpoint"]["iteration"] == STEP and second["resumed_iteration"] == STEP, first
    assert json.load(open(os.path.join(result.path, ".unbroken", "run.json")))["step_seeds"] == [100, 101]
    reference = fit(storage, "jit-own-seed-reference", max_failures=0, step_seed=None)
    assert_same_run(result, reference, "seeded by the loop, not by step_seed")


def unseeded_loop(config: dict) -> None:
    """A loop seeded from entropy (`torch.seed()`): each step draws one number first (rank
    0's is reported); rank 0 is SIGKILLed after report 3 of the first attempt, and rank 1
    saves round 3."""
    ctx = train.get_context()
    torch.seed()
    model = prepare_model(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model=model, optimizer=opt, step=0)
    state.restore()
    while state.step < 6:
        draw = torch.rand(1).item()
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        state.step += 1
        state.report({"draw": draw})
        if (state.step, ctx.get_attempt(), ctx.get_world_rank()) == (3, 1, 0):
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_rank_started_again_draws_from_the_seed_the_run_recorded_for_it(storage):
    # The new process of rank 0 seeds itself anew from entropy; the run's recorded seed wins,
    # so its draws after the resume are the ones the killed process would have made.
    failures = FailureConfig(max_failures=1, recovery="just_in_time")
    result = TorchTrainer(unseeded_loop, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="unseeded", storage_path=storage,
                                               failure_config=failures)).fit()
    first, second = attempts(result)
    assert first["jit_checkpoint"]["iteration"] == 3 and second["resumed_iteration"] == 3, first
    seed = json.load(open(os.path.join(result.path, ".unbroken", "run.json")))["step_seeds"][0]
    rows = [json.loads(line) for line in open(os.path.join(result.path, "result.json"))]
    want = []
    for k in range(6):  # what rank 0 draws in step k + 1: its stream after report k
        seed_step(seed, 0, k, {})
        want.append(torch.rand(1).item())
    assert [r["draw"] for r in rows if r["training_iteration"] <= 6][-6:] == want


def sharded_loop(config: dict) -> None:
    """An FSDP2 model whose TrainState has just-in-time checkpoints; rank 1 dies after report
    4 of the first attempt. A checkpoint at report 2."""
    from sharded_loops import build_fsdp

    ctx = train.get_context()
    model = build_fsdp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    state = TrainState(model=model, optimizer=opt, step=0, jit_checkpoint=True, step_seed=3)
    state.restore()
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(ctx.get_world_rank()))
    while state.step < 6:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        state.step += 1
        state.report({"loss": loss.item()}, checkpoint=state.step == 2)
        if (state.step, ctx.get_attempt(), ctx.get_world_rank()) == (4, 1, 1):
            os.kill(os.getpid(), signal.SIGKILL)


def test_a_sharded_model_falls_back_and_says_why(storage):
    result = TorchTrainer(sharded_loop, scaling_config=ScalingConfig(num_workers=2),
                          run_config=RunConfig(name="sharded", storage_path=storage,
                                               failure_config=FailureConfig(max_failures=1))).fit()
    first, second = attempts(result)
    assert "rank 0: the model is sharded" in first["jit_checkpoint"]["why_not"], first
    assert second["resumed_from"] == "checkpoint_000002" and second["status"] == "FINISHED"


# -- in-process: the pieces -----------------------------------------------------------------------
def test_a_step_seed_is_an_int_and_outside_a_run_nothing_is_armed():
    state = TrainState(model=torch.nn.Linear(2, 1), jit_checkpoint=True)
    assert state._step_seed is None, "no run: no seed of its own, and nothing to arm"
    with pytest.raises(TypeError, match="step_seed"):
        TrainState(model=torch.nn.Linear(2, 1), step_seed=1.5)


def test_step_streams_are_a_function_of_seed_rank_and_report():
    before = capture_rng()
    try:
        g = torch.Generator()
        seed_step(7, 1, 5, {"g": g})
        first, first_g = capture_rng(), g.get_state()
        torch.rand(3, generator=g)
        torch.rand(3)
        seed_step(7, 1, 5, {"g": g})
        again = capture_rng()
        assert torch.equal(first["torch"], again["torch"]) and torch.equal(first_g, g.get_state())
        assert torch.equal(first["python"]["internal"], again["python"]["internal"])
        assert torch.equal(first["numpy"]["keys"], again["numpy"]["keys"])
        seed_step(7, 0, 5, {})
        assert not torch.equal(first["torch"], capture_rng()["torch"])
        seed_step(7, 1, 6, {})
        assert not torch.equal(first["torch"], capture_rng()["torch"])
    finally:
        restore_rng(before)


TRACKER = """
import torch
from unbroken import train
from unbroken.cli import commands as cli
from unbroken.worker.recovery.just_in_time import Tracker
from unbroken.train.torch import TrainState

model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
state = TrainState(model=model, optimizer=opt, scheduler=sched, step=0)
tracker = Tracker(state, step_seed=7, rank=0)
model(torch.randn(8, 4)).sum().backward()
opt.step()
sched.step()
state.step = 1
tracker.snapshot(1)
want = {k: v.clone() for k, v in model.state_dict().items()}
model(torch.randn(8, 4)).sum().backward()  # the next forward moves the BatchNorm statistics
sched.step()
state.step = 2
assert tracker.problem(1) is None
saved = tracker.state_dicts()
assert not torch.equal(model.state_dict()["1.running_mean"], want["1.running_mean"])
assert all(torch.equal(saved["model"][k], want[k]) for k in want)
assert saved["scheduler"]["last_epoch"] == 1 and tracker.values == {"step": 1}
opt.step()
assert tracker.problem(1) == "an optimizer step began after report 1"
assert tracker.problem(2) == "report 2 did not complete on this rank"
print("OK")
"""


def test_tracker_saves_the_state_of_the_last_report():
    # Buffers (BatchNorm statistics), the scheduler and plain values as of the report; the
    # parameters and optimizer live until a step begins. In a fresh process: torch ops here
    # would start threads, and later tests could no longer fork their workers from this one.
    assert run_script(TRACKER).stdout.strip() == "OK"


class Sent:
    """A group that only records what the driver sends."""

    def __init__(self):
        self.sent = []

    def send(self, rank, message):
        self.sent.append((rank, message.iteration))


def test_the_lowest_clean_rank_saves_and_a_higher_one_is_released_while_rank_0_runs():
    jit, group = Coordinator(), Sent()
    for rank in range(3):
        jit.take(group, rank, JitArmed())
    jit.take(group, 2, JitOffer(6))
    jit.choose(group, 6, running={0, 1})
    assert group.sent == [(2, None)] and jit.saver is None  # rank 2 ends: that frees ranks 0, 1
    assert jit.waiting_for({0, 1}) == "offers"
    jit.take(group, 1, JitOffer(None, "an optimizer step began after report 6"))
    jit.take(group, 0, JitOffer(6))
    jit.choose(group, 6, running=set())
    assert group.sent == [(2, None), (1, None), (0, 6)] and jit.saver == 0
    assert jit.waiting_for(set()) == "save"
    jit.take(group, 0, JitSaved(6, []))
    assert jit.waiting_for(set()) is None
    assert jit.reasons == ["rank 1: an optimizer step began after report 6"]


def test_an_offer_of_an_incomplete_round_is_refused_with_the_reason():
    jit, group = Coordinator(), Sent()
    jit.take(group, 0, JitArmed())
    jit.take(group, 0, JitOffer(7))
    jit.choose(group, 6, running=set())
    assert group.sent == [(0, None)] and jit.saver is None
    assert jit.reasons == ["rank 0: its round 7 is not complete"]
    jit.close(group)
    jit.take(group, 1, JitOffer(6))  # too late: told at once
    assert group.sent == [(0, None), (1, None)]
