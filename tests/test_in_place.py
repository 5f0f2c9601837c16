"""In-place recovery (FailureConfig(recovery="in_place")): when a rank fails, the others keep
their processes, the failed rank starts again, the state of the last complete report goes from a
survivor to every rank over the new process group, and the run still ends bit for bit like the
uninterrupted one, each iteration once.

Real worker processes: 2 ranks on gloo (DDP), the local engine, `exact_loop` with
TrainState(step_seed=...), a periodic checkpoint every 4 steps; the
failures strike right after the report of step 6.
"""

import contextlib
import io
import json
import os

import pytest
import torch

from loops import exact_loop, steps_run
from test_exact_resume import BASE, assert_identical, assert_same_run, final_files, steps
from test_jit_checkpoint import PERIODIC, STEP
from unbroken.cli import commands as cli
from unbroken.train import FailureConfig, RunConfig, ScalingConfig
from unbroken.train.torch import TorchTrainer


def fit(storage, name, max_failures=1, in_place=True, hang_timeout_s=None, ranks=2, **config):
    return TorchTrainer(exact_loop, train_loop_config={**BASE, "jit": True, **config},
                        scaling_config=ScalingConfig(num_workers=ranks),
                        run_config=RunConfig(name=name, storage_path=storage, failure_config=FailureConfig(
                            max_failures=max_failures, recovery="in_place" if in_place else "checkpoint",
                            hang_timeout_s=hang_timeout_s))).fit()


def attempts(result) -> list[dict]:
    return json.load(open(os.path.join(result.path, ".unbroken", "run.json")))["attempts"]


def pids(directory, attempt) -> list[int]:
    return [int(open(os.path.join(directory, f"rank{r}-a{attempt}")).read()) for r in range(2)]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run with per-step random streams."""
    return fit(str(tmp_path_factory.mktemp("in-place")), "reference", max_failures=0, in_place=False)


def test_a_killed_rank_is_replaced_while_the_survivor_keeps_its_process_and_state(storage, reference,
                                                                                   tmp_path):
    result = fit(storage, "killed", die_after_report=[[STEP, 1, 1, "sigkill"]], pid_dir=str(tmp_path))
    first, second = attempts(result)
    assert (first["status"], second["status"]) == ("ERRORED", "FINISHED")
    assert second["in_place"] == {"iteration": STEP, "source": 0, "kept": [0], "replaced": [1]}, second
    assert second["resumed_from"] is None and second["resumed_iteration"] == STEP
    assert first.get("jit_checkpoint") is None, "nothing was saved to storage for the recovery"
    before, after = pids(tmp_path, 1), pids(tmp_path, 2)
    assert after[0] == before[0], "rank 0 kept its process"
    assert after[1] != before[1], "rank 1 runs in a new process"
    names = sorted(n for n in os.listdir(result.path) if n.startswith("checkpoint_"))
    assert f"checkpoint_{STEP:06d}" not in names, "no checkpoint of step 6 was written for the recovery"
    assert_same_run(result, reference, "rank 1 killed after report 6, recovered in place")
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        cli.main(["show", result.path])
    assert (f"attempt 2: recovered in place from iteration {STEP}: rank 0 sent its state; ranks "
            "started again: 1") in shown.getvalue()


def test_one_setting_recovers_in_place_a_loop_that_asks_for_nothing_else(storage, tmp_path):
    # FailureConfig(recovery="in_place") alone: the loop's TrainState gives neither
    # jit_checkpoint nor step_seed; it is tracked, each rank's streams seeded from its own
    # seed as the loop set it, so an uninterrupted run seeded alike is the reference.
    result = fit(storage, "one-setting", jit=False, die_after_report=[[STEP, 1, 1, "sigkill"]],
                 pid_dir=str(tmp_path))
    first, second = attempts(result)
    assert second["in_place"] == {"iteration": STEP, "source": 0, "kept": [0], "replaced": [1]}, second
    assert pids(tmp_path, 2)[0] == pids(tmp_path, 1)[0], "rank 0 kept its process"
    reference = fit(storage, "one-setting-reference", max_failures=0, in_place=False, step_seed=None)
    assert_same_run(result, reference, "recovery='in_place' and nothing else")


def test_recovery_is_one_of_its_levels_and_the_older_spelling_still_works():
    with pytest.raises(ValueError, match="recovery must be one of 'checkpoint', 'just_in_time', 'in_place'"):
        FailureConfig(recovery="exact")
    with pytest.warns(DeprecationWarning, match="recover_in_place=True"):
        old = FailureConfig(recover_in_place=True, hang_timeout_s=10)
    assert old.recovery == "in_place" and old.collective_timeout_s == 15
    assert FailureConfig(recovery="just_in_time", hang_timeout_s=10).collective_timeout_s is None
    assert FailureConfig().recovery == "in_place", "the strongest by default"
    weakest = FailureConfig(recovery="checkpoint")
    assert weakest.recovers("checkpoint") and not weakest.recovers("just_in_time")


def test_an_elastic_run_on_this_machine_replaces_a_killed_rank_in_place(storage, reference, tmp_path):
    # The local engine can always place max_workers, so an elastic run keeps its size: the
    # killed rank starts again while rank 0 stays, as in a fixed-size run, bit for bit.
    result = fit(storage, "elastic", ranks=(1, 2), die_after_report=[[STEP, 1, 1, "sigkill"]],
                 pid_dir=str(tmp_path))
    first, second = attempts(result)
    assert second["in_place"] == {"iteration": STEP, "source": 0, "kept": [0], "replaced": [1]}, second
    assert (second["num_workers"], second["elastic"]["reason"]) == (2, "rank lost"), second
    assert pids(tmp_path, 2)[0] == pids(tmp_path, 1)[0], "rank 0 kept its process"
    assert_same_run(result, reference, "an elastic run, rank 1 killed after report 6, recovered in place")


def test_a_rank_that_raised_stays_too_and_nobody_is_replaced(storage, reference, tmp_path):
    result = fit(storage, "raised", die_after_report=[[STEP, 1, 1, "raise"]], pid_dir=str(tmp_path))
    first, second = attempts(result)
    assert second["in_place"] == {"iteration": STEP, "source": 0, "kept": [0, 1], "replaced": []}, second
    assert pids(tmp_path, 2) == pids(tmp_path, 1), "both ranks kept their processes"
    assert_same_run(result, reference, "rank 1 raised after report 6, recovered in place")


@pytest.mark.parametrize("mode", ["sigkill", "raise", "sigkill-loader-workers"])
def test_a_loop_that_stays_keeps_everything_its_training_function_built(storage, reference, tmp_path,
                                                                         mode):
    # TrainState.for_each_batch: rank 1 dies (or raises) right after report 5, mid-epoch; rank
    # 0's step 6 fails in its all-reduce, and rank 0 goes on in the same loop, with the same
    # model and optimizer objects (and DataLoader worker processes, when persistent): the code
    # before its loop does not run again.
    at = 5
    workers = {"num_workers": 1, "persistent_workers": True} if mode.endswith("workers") else {}
    if workers:  # fetched in a worker, each sample is seeded on its own: another reference
        reference = fit(storage, "in-loop-reference", max_failures=0, in_place=False, **workers)
    mode = mode.removesuffix("-loader-workers")
    result = fit(storage, f"in-loop-{mode}", in_loop=True, die_after_report=[[at, 1, 1, mode]],
                 pid_dir=str(tmp_path), **workers)
    first, second = attempts(result)
    assert (first["status"], second["status"]) == ("ERRORED", "FINISHED")
    kept, replaced = ([0], [1]) if mode == "sigkill" else ([0, 1], [])
    assert second["in_place"] == {"iteration": at, "source": 0, "kept": kept, "replaced": replaced}, second
    assert not os.path.exists(tmp_path / "rank0-a2"), "rank 0 did not run its training function again"
    rows = steps_run(tmp_path, 0)
    assert {row[0] for row in rows} == {1, 2}
    assert len({row[2:] for row in rows}) == 1, "the same process, model, optimizer (and loader workers)"
    assert all(len(row) == 5 + bool(workers) for row in rows), rows
    assert [row[1] for row in rows if row[0] == 2][0] == at + 1, "step 6 is redone from the state of report 5"
    if mode == "raise":
        assert not os.path.exists(tmp_path / "rank1-a2"), "rank 1, which raised, stayed in its loop too"
        assert len({row[2:] for row in steps_run(tmp_path, 1)}) == 1
    assert_same_run(result, reference, f"rank 1 {mode} after report 5, rank 0 kept its loop")


def test_a_collective_before_the_loop_that_only_the_replacement_makes_falls_back_to_storage(storage,
                                                                                          reference):
    # Rank 0 stays inside its loop; rank 1's replacement runs the training function from its
    # start, where a barrier waits for ranks that never come to it. It fails at the collective
    # timeout (hang_timeout_s), and the run restarts from the latest committed checkpoint
    # instead of pairing that barrier with rank 0's next all-reduce.
    result = fit(storage, "prologue", max_failures=2, hang_timeout_s=3, in_loop=True, prologue_barrier=True,
                 die_after_report=[[5, 1, 1, "sigkill"]])
    first, second, third = attempts(result)
    assert second["in_place"]["iteration"] == 5 and second["status"] == "ERRORED", second
    assert third["resumed_from"] == f"checkpoint_{PERIODIC:06d}" and third["status"] == "FINISHED", third
    assert_same_run(result, reference, "a barrier before the loop, rank 0 stayed in its loop")


def test_a_frozen_rank_is_killed_alone_at_the_hang_timeout_and_the_survivor_stays(storage, reference,
                                                                                 tmp_path):
    # Rank 1 stops (SIGSTOP, as a frozen process) right after report 6, and rank 0 blocks in
    # step 7's all-reduce. At hang_timeout_s the driver asks both for their stacks; rank 1
    # cannot answer, so it alone is killed, and rank 0, released with a dead peer's error,
    # stays and sends its state of round 6 to rank 1's replacement.
    result = fit(storage, "frozen", hang_timeout_s=3, die_after_report=[[STEP, 1, 1, "sigstop"]],
                 pid_dir=str(tmp_path))
    first, second = attempts(result)
    assert "WorkerHangError" in first["error"] and first["hang"]["killed"] == [1], first
    assert first["hang"]["where"]["1"] is None and first["hang"]["where"]["0"], first["hang"]
    assert second["in_place"] == {"iteration": STEP, "source": 0, "kept": [0], "replaced": [1]}, second
    before, after = pids(tmp_path, 1), pids(tmp_path, 2)
    assert after[0] == before[0] and after[1] != before[1]
    assert_same_run(result, reference, "rank 1 frozen after report 6, recovered in place")
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        cli.main(["show", result.path])
    assert "killed alone, so that the others could stay: rank(s) [1]" in shown.getvalue()


def test_a_hang_in_python_code_restarts_every_rank(storage, reference):
    # Rank 1 waits forever in Python code after report 6: both ranks write their stacks, so
    # which one is to blame is not known, and the hang ends the attempt as without in-place
    # recovery: every rank starts again, from the periodic checkpoint.
    result = fit(storage, "python-hang", hang_timeout_s=3, die_after_report=[[STEP, 1, 1, "hang"]])
    first, second = attempts(result)
    assert "WorkerHangError" in first["error"] and "killed" not in first["hang"], first
    assert second.get("in_place") is None and second["resumed_from"] == f"checkpoint_{PERIODIC:06d}"
    assert_same_run(result, reference, "rank 1 hung in Python code after report 6")


def test_a_step_in_flight_falls_back_to_the_restart_from_the_periodic_checkpoint(storage, reference):
    # Rank 1 raises after step 6's optimizer step, before its report: no rank is clean since
    # report 5, so no rank can stay, and the run restarts from checkpoint 4 as before.
    result = fit(storage, "dirty", kill_at=[[STEP, 1, 1, "raise"]])
    first, second = attempts(result)
    assert second.get("in_place") is None and second["resumed_from"] == f"checkpoint_{PERIODIC:06d}"
    assert "an optimizer step began after report 5" in first["jit_checkpoint"]["why_not"], first
    assert_same_run(result, reference, "rank 1 raised after step 6's optimizer step")


@pytest.mark.parametrize("rank", [0, 1], ids=["sender", "receiver"])
def test_a_rank_killed_while_the_state_is_sent_falls_back_to_the_last_checkpoint(storage, reference,
                                                                                  monkeypatch, rank):
    # Attempt 2 recovers in place; rank 0 (the survivor, sending) or rank 1 (its replacement,
    # receiving) is SIGKILLed in the middle of the transfer. Nothing was stored for the
    # recovery, so attempt 3 restarts every rank from checkpoint 4, and the run still ends
    # like the uninterrupted one.
    monkeypatch.setenv("UNBROKEN_FAULT", f"during_peer_share:1:kill:{rank}")
    result = fit(storage, f"share-killed-{rank}", max_failures=2, die_after_report=[[STEP, 1, 1, "sigkill"]])
    first, second, third = attempts(result)
    assert second["in_place"]["iteration"] == STEP and second["status"] == "ERRORED"
    assert f"rank {rank}" in second["error"], second["error"]
    assert third.get("in_place") is None and third["resumed_from"] == f"checkpoint_{PERIODIC:06d}"
    assert_same_run(result, reference, f"rank {rank} killed while the state was sent")


def test_with_three_ranks_both_survivors_stay_and_the_run_ends_as_the_uninterrupted_one(storage, tmp_path):
    def three(name, **config):
        run = RunConfig(name=name, storage_path=storage,
                        failure_config=FailureConfig(max_failures=1, recovery="in_place"))
        return TorchTrainer(exact_loop, train_loop_config={**BASE, "epochs": 2, "jit": True, **config},
                            scaling_config=ScalingConfig(num_workers=3), run_config=run).fit()

    reference = three("three-reference")
    result = three("three-killed", die_after_report=[[5, 1, 1, "sigkill"]], pid_dir=str(tmp_path))
    second = attempts(result)[1]
    assert second["in_place"] == {"iteration": 5, "source": 0, "kept": [0, 2], "replaced": [1]}, second
    pid = {(r, a): open(os.path.join(tmp_path, f"rank{r}-a{a}")).read() for r in range(3) for a in (1, 2)}
    assert pid[(0, 1)] == pid[(0, 2)] and pid[(2, 1)] == pid[(2, 2)] and pid[(1, 1)] != pid[(1, 2)]
    rows = steps(result)
    assert [r["step"] for r in rows] == list(range(1, 9)) and rows == steps(reference)
    # The model bit for bit. AdamW's moments may differ in the last bits, as after any resume
    # with 3 ranks or more: DDP's first step after a start sums the gradients in another order
    # than the steps after it (docs/exact-resume.md).
    got, want = (final_files(r)["train_state.pt"]["state_dicts"] for r in (result, reference))
    assert_identical(got["model"], want["model"], "final model", "rank 1 of 3 killed after report 5")
    for index, moments in want["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.allclose(got["optimizer"]["state"][index][name], value, rtol=1e-5, atol=1e-9), name


def test_an_elastic_shrink_numbers_the_ranks_left_again_in_order_node_by_node():
    # Pure: the plan without the ranks lost with their node, and the placements of those left.
    from unbroken.errors import WorkerDied
    from unbroken.execution.engine.base import Placement, renumbered
    from unbroken.execution.recovery.in_place import InPlacePlan, shrunk

    plan = InPlacePlan(iteration=6, source=1, kept=(1, 3), replaced=(0, 2))
    without = plan.without({2})
    assert without == InPlacePlan(6, source=1, kept=(1, 2), replaced=(0,), dropped=(2,))
    assert without.size == 3 and without.record()["dropped"] == [2]
    assert "dropped" not in plan.record()
    lost = [(2, WorkerDied(2, node_lost="node b")), (0, WorkerDied(0, signal_name="SIGKILL"))]
    assert shrunk(plan, lost, min_workers=3) == without, "3 ranks left: the elastic run goes on without 2"
    assert shrunk(plan, lost, min_workers=4) == plan, "fewer than min_workers left: rank 2 is replaced"
    assert shrunk(plan, lost, min_workers=None) == plan, "a run of fixed size replaces lost ranks"
    assert shrunk(None, lost, min_workers=3) is None

    def on(node: str, rank: int) -> Placement:
        return Placement(rank=rank, node_rank=0, local_rank=0, local_world_size=0, node_id=node,
                         node_address=node)

    old = [on("a", 0), on("a", 1), on("b", 2), on("c", 3), on("c", 4)]
    new = renumbered(old, [0, 2, 3, 4])  # rank 1 dropped
    assert [(p.rank, p.node_id, p.node_rank, p.local_rank, p.local_world_size) for p in new] == [
        (0, "a", 0, 0, 1), (1, "b", 1, 0, 1), (2, "c", 2, 0, 2), (3, "c", 2, 1, 2)]


def test_recovery_says_with_the_failure_policy_how_a_failed_attempt_goes_on():
    # Pure: the failure policy decides whether to go on; the plan left by the failed attempt
    # (its ranks stayed, some lost with their node) decides how; a recovery in place counts.
    from unbroken.execution.recovery.after_failure import Next, Recovery
    from unbroken.execution.recovery.failure_policy import FailurePolicy
    from unbroken.execution.recovery.in_place import InPlacePlan

    config = FailureConfig(max_failures=3)
    recovery = Recovery(None, config, FailurePolicy(config), None)

    class Group:  # a recovery in place keeps the group: nothing is called on it
        pass

    assert recovery.decide(RuntimeError("rank 1 died")) is Next.RESTART
    for plan, want in ((InPlacePlan(6, source=1, kept=(1,), replaced=(0,)), Next.IN_PLACE),
                       (InPlacePlan(8, source=0, kept=(0,), replaced=(), dropped=(1,)), Next.SHRINK)):
        assert recovery.staying() is None
        recovery.plan = plan
        recovery.hand_back(Group(), RuntimeError("rank died"), [], [])
        assert recovery.decide(RuntimeError("rank died")) is want
        assert recovery.staying()[1] == plan, "the next attempt begins on the ranks that stayed"
    assert recovery.decide(RuntimeError("a fourth failure")) is Next.GIVE_UP
    assert Recovery(None, config, FailurePolicy(config), None).decide(KeyboardInterrupt()) is Next.GIVE_UP
