"""The controller's transitions, driven in-process by a fake worker group (tests/fake_group.py):
rounds, failures, retries, root causes, hangs, mismatched reports, stop conditions and
preemption. The same behaviours with real worker processes are in test_failures.py,
test_reported_rounds.py, test_preemption.py and test_train.py."""

import json
import os

import pytest

from fake_group import HANG, SIGTERM_DRIVER, SLOW, FakeWorkerGroup, call, die, raise_, report
from unbroken.errors import ReportMismatchError, TrainingInterruptedError, WorkerError, WorkerHangError
from unbroken.execution.controller import Controller
from unbroken.execution.controller_state import Errored, Finished
from unbroken.train import (
    DataParallelTrainer,
    FailureConfig,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)
from unbroken.train.open_run import open_run


def never_called(config):
    raise AssertionError("a fake group runs no training loop")


class Harness:
    """A real run directory driven by a controller whose attempts get fake groups."""

    def __init__(self, storage, attempts, max_failures=0, **run_config):
        self.attempts = list(attempts)  # one list of rank scripts per attempt
        self.groups: list[FakeWorkerGroup] = []
        trainer = DataParallelTrainer(
            never_called, scaling_config=ScalingConfig(num_workers=len(self.attempts[0])),
            run_config=RunConfig(name="run", storage_path=storage,
                                 failure_config=FailureConfig(max_failures=max_failures, **{
                                     k: run_config.pop(k) for k in ("hang_timeout_s",
                                                                    "max_preemption_failures")
                                     if k in run_config}),
                                 **run_config))
        self.run, _ = open_run(trainer)
        self.controller = Controller(trainer, self.run, "restore(...)", group_factory=self.group)
        self.path = self.run.path

    def group(self, scaling, warm=None):
        assert scaling.num_workers == len(self.attempts[len(self.groups)])
        g = FakeWorkerGroup(self.attempts[len(self.groups)])
        g.started_warm = warm is not None and warm is self.groups[-1]
        self.groups.append(g)
        return g

    def execute(self):
        self.controller.execute()

    def rows(self):
        with open(os.path.join(self.path, "result.json")) as f:
            return [json.loads(line) for line in f]

    def manifest(self):
        with open(os.path.join(self.path, ".unbroken", "run.json")) as f:
            return json.load(f)


def test_rounds_become_rows_and_every_rank_gets_each_reply(storage):
    h = Harness(storage, [[[report(loss=3), report(loss=2, checkpoint=True), report(loss=1)],
                           [report(loss=9), report(loss=9, checkpoint=True), report(loss=9)]]])
    h.execute()
    assert [(r["training_iteration"], r["loss"]) for r in h.rows()] == [(1, 3), (2, 2), (3, 1)]
    assert [r["checkpoint_dir_name"] for r in h.rows()] == [None, "checkpoint_000002", None]
    assert isinstance(h.controller.state, Finished)
    group = h.groups[0]
    assert [len(r.replies) for r in group.ranks] == [3, 3]
    assert group.finished == {0, 1} and group.shut_down is False
    assert [p.info.local_world_size for p in group.payloads] == [2, 2], "the placement, not a guess"


def test_a_round_completed_after_a_failure_is_kept_and_the_retry_resumes_from_it(storage, monkeypatch):
    monkeypatch.setattr("unbroken.execution.recovery.after_failure.WARM_UP_AFTER_S", 0.0)
    # Rank 1 raises right after report 2; the slower rank 0 sends its report 2 only in a later
    # poll, after the driver has seen the error.
    h = Harness(storage, [
        [[report(it=1), SLOW, SLOW, report(it=2, checkpoint=True)],
         [report(it=1), report(it=2, checkpoint=True), raise_("boom")]],
        [[report(it=3)], [report(it=3)]],
    ], max_failures=1)
    h.execute()
    assert [r["training_iteration"] for r in h.rows()] == [1, 2, 3]
    attempts = h.manifest()["attempts"]
    assert [a["status"] for a in attempts] == ["ERRORED", "FINISHED"]
    assert "boom" in attempts[0]["error"] and attempts[1]["resumed_from"] == "checkpoint_000002"
    assert h.groups[1].payloads[0].info.start_iteration == 2
    assert h.groups[0].shut_down is True, "a failed group is killed"
    # A failure would be retried: the first group warmed up once its ranks were in the loop,
    # and the restart was told it may start warm.
    assert (h.groups[0].warmed, h.groups[0].started_warm, h.groups[1].started_warm) == (True, False, True)


def test_an_attempt_after_a_failure_warms_up_at_its_first_round_the_first_not_before_its_delay(storage):
    # WARM_UP_AFTER_S (10 s) keeps a run's first attempt to itself while it starts; once the run
    # has failed, each next attempt gets its restart ready at once: the next failure may come
    # before 10 s, and a cold restart costs seconds (bench_goodput).
    h = Harness(storage, [[[report(), raise_("boom")], [report(), report()]],
                          [[report(), raise_("boom again")], [report(), report()]],
                          [[report()], [report()]]], max_failures=3)
    h.execute()
    assert [g.warmed for g in h.groups] == [False, True, True]
    assert [g.started_warm for g in h.groups] == [False, False, True]


def test_a_run_that_cannot_retry_never_warms_up_for_a_restart(storage):
    h = Harness(storage, [[[report(), report()], [report(), report()]]], max_failures=0)
    h.execute()
    assert h.groups[0].warmed is False


def test_a_killed_peer_is_the_root_cause_of_its_neighbours_error(storage):
    h = Harness(storage, [[[report(), die("SIGKILL")],
                           [report(), raise_("Connection reset by peer")]]])
    with pytest.raises(TrainingFailedError) as info:
        h.execute()
    cause = info.value.__cause__
    assert isinstance(cause, WorkerError) and cause.rank == 0
    assert "worker rank 0 (of the fake engine) was killed by SIGKILL" in str(cause)
    assert isinstance(h.controller.state, Errored)
    assert [r["training_iteration"] for r in h.rows()] == [1]


def test_failures_that_reach_the_driver_together_keep_the_order_they_happened():
    # Pure: rank 1 ran out of disk and then ended its process group; rank 0's collective broke
    # after that, but in one poll the driver reads rank 0's message first (rank order).
    from unbroken.execution.worker_failures import record, root_cause

    class NoLoss:
        def lost_ranks(self, wait_s):
            return []

    failures: list = []
    record(failures, 0, RuntimeError("Connection closed by peer"), at=2.0)
    record(failures, 1, OSError("No space left on device"), at=1.0)
    assert [rank for rank, _ in failures] == [1, 0]
    assert isinstance(root_cause(NoLoss(), failures), OSError)
    hung = [(1, WorkerHangError("no worker reported within 3 s"))]  # the driver's own, unstamped
    record(hung, 0, RuntimeError("Connection closed by peer"), at=2.0)
    assert [rank for rank, _ in hung] == [1, 0], "a hang found by the driver stays the first failure"


def test_a_rank_that_stops_reporting_is_a_hang_naming_it(storage):
    h = Harness(storage, [[[report(), report()], [report(), HANG]]], hang_timeout_s=0.05)
    with pytest.raises(TrainingFailedError) as info:
        h.execute()
    cause = info.value.__cause__
    assert isinstance(cause, WorkerHangError)
    assert "rank(s) [1] did not report iteration 2" in str(cause) and "rank(s) [0] did" in str(cause)


def test_ranks_that_report_a_different_number_of_times_are_refused_without_retry(storage):
    h = Harness(storage, [[[report(), report(), report()], [report(), report()]]], max_failures=3)
    with pytest.raises(TrainingFailedError) as info:
        h.execute()
    assert isinstance(info.value.__cause__, ReportMismatchError)
    assert "rank 0: 3, rank 1: 2" in str(info.value.__cause__)
    assert len(h.groups) == 1, "a mismatch is never retried"


def test_a_stop_condition_ends_every_rank_at_the_same_report(storage):
    script = [report(), report(), report(), report()]
    h = Harness(storage, [[list(script), list(script)]], stop={"training_iteration": 2})
    h.execute()
    assert [r["training_iteration"] for r in h.rows()] == [1, 2]
    assert [[r.stop for r in rank.replies] for rank in h.groups[0].ranks] == [[False, True]] * 2


def test_a_preemption_asks_for_a_checkpoint_at_the_next_report_then_stops(storage):
    h = Harness(storage, [[[report(), SIGTERM_DRIVER, report(), report(checkpoint=True), report()],
                           [report(), report(), report(checkpoint=True), report()]]])
    with pytest.raises(TrainingInterruptedError) as info:
        h.execute()
    assert "checkpoint_000003" in str(info.value)
    replies = [(r.checkpoint, r.stop) for r in h.groups[0].ranks[1].replies]
    assert replies[-2:] == [(True, False), (False, True)], replies
    assert h.manifest()["status"] == "INTERRUPTED"
    assert [r["training_iteration"] for r in h.rows()] == [1, 2, 3]


def test_a_second_signal_while_the_first_is_being_logged_stops_at_once(storage):
    """The second SIGTERM lands while the controller is still logging the first one (a user
    pressing twice, a scheduler's repeat): it must not be taken for the first."""
    import logging
    import signal as signals

    class SecondSignal(logging.Handler):
        def emit(self, record):
            if "preemption notice (SIGTERM)" in record.getMessage():
                os.kill(os.getpid(), signals.SIGTERM)

    handler = SecondSignal()
    logging.getLogger("unbroken").addHandler(handler)
    try:
        # Rank 0 never reaches the report the first signal asks a checkpoint at.
        h = Harness(storage, [[[report(checkpoint=True), SIGTERM_DRIVER, HANG], [report(), report()]]],
                    hang_timeout_s=2)  # a swallowed second signal would wait for the hang
        with pytest.raises(TrainingInterruptedError) as info:
            h.execute()
    finally:
        logging.getLogger("unbroken").removeHandler(handler)
    assert "checkpoint_000001" in str(info.value)
    assert h.groups[0].shut_down is True, "the second signal kills the group at once"
    assert h.manifest()["status"] == "INTERRUPTED"


class DrainedGroups(Harness):
    """Each attempt's group answers `draining()` as Ray's `get_draining_nodes` would, once a
    rank's script has drained its node (`drain(groups, rank)`)."""

    def group(self, scaling, warm=None):
        g = super().group(scaling, warm)
        g.drained = {}
        g.draining = lambda: dict(g.drained)
        return g


def drain(groups: list, rank: int) -> tuple:
    """A rank's script step: its node ("node-<rank>") is drained, without a deadline."""
    return call(lambda: groups[-1].drained.update({f"node-{rank}": (None, [rank])}))


def test_a_drained_node_stops_the_attempt_at_the_next_report_and_the_run_goes_on_without_it(
        storage, monkeypatch):
    """Rank 1's node is drained after report 2: the reply to the next round asks for a
    checkpoint, the one after stops; the attempt ends PREEMPTED (not a failure: max_failures
    is 0) and the next one resumes from that checkpoint. A second drain in the next attempt is
    one more than max_preemption_failures=1: the run stops, INTERRUPTED and restorable."""
    from unbroken.execution import notices

    monkeypatch.setattr(notices, "DRAIN_POLL_S", 0.0)
    groups: list = []
    full = [report(), report(checkpoint=True), report(checkpoint=True), report(checkpoint=True), report()]
    h = DrainedGroups(storage, [[full, full[:2] + [drain(groups, 1)] + full[2:]],
                                [full, [drain(groups, 1)] + full]], max_preemption_failures=1)
    h.groups = groups
    with pytest.raises(TrainingInterruptedError, match="preemption notice"):
        h.execute()
    first, second = h.manifest()["attempts"]
    notice = first["preempted"]
    assert (first["status"], notice["ranks"], notice["node"]) == ("PREEMPTED", [1], "node-1")
    assert notice["deadline"] == pytest.approx(notice["received_at"] + 30), "the grace, without a deadline"
    assert second["resumed_from"] == "checkpoint_000004" and second["status"] == "PREEMPTED"
    assert h.manifest()["status"] == "INTERRUPTED"
    told = [r.preemption for r in groups[0].ranks[0].replies]
    assert told[:2] == [None, None], "nothing before the drain"
    assert told[-1] == {"deadline_ms": int(notice["deadline"] * 1000),
                        "preempted_node_to_ranks": {"node-1": [1]}}
