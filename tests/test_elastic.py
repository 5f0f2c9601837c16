"""Elastic training (`ScalingConfig(num_workers=(min_workers, max_workers))`): each attempt's
size from what can be placed, a shrink at once after a lost node, a grow at a checkpoint when
capacity returns, none of it counted as a failure. The controller is driven here by a fake
worker group and a scripted capacity probe; test_ray_engine.py runs it on a real Ray cluster."""

import json
import os

import pytest

from fake_group import FakeWorkerGroup, call, die, lose_node, report
from unbroken.execution.controller import Controller
from unbroken.execution.elastic import ElasticScaler, ElasticSizing, wait_for_capacity
from unbroken.train import DataParallelTrainer, FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
from unbroken.train.open_run import open_run


def never_called(config):
    raise AssertionError("a fake group runs no training loop")


class Probe:
    """A capacity probe over a pretend cluster: `total` workers fit on the live nodes, and the
    run's current group holds `held` of them."""

    timeout_s = 0.3

    def __init__(self, total):
        self.total = total
        self.held = 0
        self.lost_nodes_seen = []

    def __call__(self, lost_nodes, limit):
        self.lost_nodes_seen.append(set(lost_nodes))
        return max(0, min(self.total - self.held, limit))


class ElasticHarness:
    def __init__(self, storage, scripts_by_size, probe, num_workers=(2, 3), max_failures=1, **run_config):
        self.scripts_by_size = scripts_by_size  # size -> a list of per-attempt rank scripts
        self.probe = probe
        self.groups = []
        trainer = DataParallelTrainer(
            never_called, scaling_config=ScalingConfig(num_workers=num_workers,
                                                       elastic_resize_monitor_interval_s=1e-3),
            run_config=RunConfig(name="run", storage_path=storage, verbose=0,
                                 failure_config=FailureConfig(max_failures=max_failures), **run_config))
        self.run, _ = open_run(trainer)
        self.controller = Controller(trainer, self.run, "restore(...)", group_factory=self.group,
                                     capacity=probe)
        self.path = self.run.path

    def group(self, scaling, warm=None):
        g = FakeWorkerGroup(self.scripts_by_size[scaling.num_workers].pop(0))
        g.started_warm = warm is not None
        self.groups.append(g)
        self.probe.held = scaling.num_workers
        shutdown = g.shutdown

        def released(kill=False, keep_warm=False):
            shutdown(kill, keep_warm)
            if not keep_warm:  # a group kept warm still holds its placement
                self.probe.held = 0
        g.shutdown = released

        def placement_released():
            g.released = True
            self.probe.held = 0
        g.release_placement = placement_released
        return g

    def rows(self):
        with open(os.path.join(self.path, "result.json")) as f:
            return [json.loads(line) for line in f]

    def attempts(self):
        with open(os.path.join(self.path, ".unbroken", "run.json")) as f:
            return json.load(f)["attempts"]


def reports(first, last, checkpoint_from=None):
    return [report(checkpoint=checkpoint_from is not None and it >= checkpoint_from, it=it)
            for it in range(first, last + 1)]


def test_a_lost_node_shrinks_at_once_and_returning_capacity_grows_at_a_checkpoint(storage, capsys):
    probe = Probe(total=3)

    def node(total):
        return call(lambda: setattr(probe, "total", total))

    survivor = reports(1, 2, checkpoint_from=2) + reports(3, 3)
    scripts = {
        3: [[survivor, survivor, reports(1, 2, checkpoint_from=2) + [node(2), lose_node()]],
            [reports(1, 50)] * 3],
        2: [[reports(3, 4) + [node(3)] + reports(5, 50, checkpoint_from=5)] * 2],
    }
    h = ElasticHarness(storage, scripts, probe, stop={"training_iteration": 10})
    h.controller.execute()
    attempts = h.attempts()
    assert [a["status"] for a in attempts] == ["ERRORED", "RESIZED", "FINISHED"]
    assert [a["num_workers"] for a in attempts] == [3, 2, 3]
    assert [a["elastic"]["reason"] for a in attempts] == ["start", "node lost", "capacity returned"]
    rows = h.rows()
    assert [r["training_iteration"] for r in rows if r["attempt"] == 2][0] == 3, "resumed at checkpoint 2"
    timeline = {}
    for r in rows:
        timeline[r["training_iteration"]] = r  # the later attempt's row wins, as in the history
    assert sorted(timeline) == list(range(1, 11))
    resize_at = attempts[2]["resumed_iteration"]
    assert attempts[1]["resumed_iteration"] == 2 and resize_at >= 5
    assert [r["world_size"] for r in rows if r["attempt"] == 2] == [2] * (resize_at - 2), \
        "attempt 2 ran on 2 workers up to the checkpoint the resize asked for"
    assert all(r["world_size"] == 3 for r in rows if r["attempt"] == 3)
    assert h.controller.policy.failures == 1, "the lost node counts as a failure; the resize does not"
    assert probe.lost_nodes_seen[1] == {"fake-node"}, "the restart left the lost node out of its count"
    from unbroken.cli.commands import main

    assert main(["show", h.path]) == 0
    shown = capsys.readouterr().out
    assert "attempt 2: 2 workers, elastic: node lost (2 could be placed, 3 before); began " in shown
    assert "attempt 3: 3 workers, elastic: capacity returned (3 could be placed, 2 before); began " in shown
    from unbroken.cli.plotting import marker_label
    from unbroken.store.manifest import Attempt

    assert [marker_label(Attempt.from_dict(a)) for a in attempts] == [
        "attempt 1: 3 workers, start", "attempt 2: 2 workers, node lost",
        "attempt 3: 3 workers, capacity returned"]


def test_a_killed_rank_on_a_live_node_restarts_at_the_same_size_from_the_group_kept_warm(
        storage, monkeypatch):
    monkeypatch.setattr("unbroken.execution.recovery.after_failure.WARM_UP_AFTER_S", 0.0)
    probe = Probe(total=3)
    killed = reports(1, 2, checkpoint_from=2) + [die()]
    h = ElasticHarness(storage, {3: [[reports(1, 3)] * 2 + [killed], [reports(3, 4)] * 3]}, probe,
                       stop={"training_iteration": 4})
    h.controller.execute()
    sizes = [(a["num_workers"], a["elastic"]["reason"]) for a in h.attempts()]
    assert sizes == [(3, "start"), (3, "rank lost")]
    assert h.groups[1].started_warm, "the restart took the failed group's warm spares"


def test_a_lost_node_shrinks_onto_the_spares_the_failed_group_kept_warm(storage, monkeypatch):
    monkeypatch.setattr("unbroken.execution.recovery.after_failure.WARM_UP_AFTER_S", 0.0)
    probe = Probe(total=3)
    lost = reports(1, 2, checkpoint_from=2) + [call(lambda: setattr(probe, "total", 2)), lose_node()]
    h = ElasticHarness(storage, {3: [[reports(1, 3)] * 2 + [lost]], 2: [[reports(3, 4)] * 2]}, probe,
                       stop={"training_iteration": 4})
    h.controller.execute()
    sizes = [(a["num_workers"], a["elastic"]["reason"], a["elastic"]["capacity"]) for a in h.attempts()]
    assert sizes == [(3, "start", 3), (2, "node lost", 2)]
    assert h.groups[0].released, "the failed group gave its placement back before the new size was counted"
    assert h.groups[1].started_warm, "the smaller group took the spares kept warm on the live nodes"


def test_below_min_workers_it_waits_then_fails_naming_what_is_missing(storage):
    probe = Probe(total=1)
    h = ElasticHarness(storage, {}, probe)
    with pytest.raises(TrainingFailedError, match=r"needs at least 2 workers, and only 1 could be placed "
                                                  r"within 0.3 s \(each worker needs \{'CPU': 1.0\}\)"):
        h.controller.execute()
    assert len(probe.lost_nodes_seen) >= 2, "it polled for capacity while it waited"
    with open(os.path.join(h.path, ".unbroken", "run.json")) as f:
        assert json.load(f)["status"] == "ERRORED"


def test_a_first_start_waits_a_little_for_more_then_takes_what_is_there(storage, monkeypatch):
    monkeypatch.setattr("unbroken.execution.elastic.START_WAIT_S", 0.2)
    probe = Probe(total=2)
    h = ElasticHarness(storage, {2: [[reports(1, 3)] * 2]}, probe, stop={"training_iteration": 3})
    h.controller.execute()
    [(size, record)] = [(a["num_workers"], a["elastic"]) for a in h.attempts()]
    assert size == 2 and record.pop("waited_s") >= 0.2, "the wait is recorded (goodput's waiting)"
    assert record == {"reason": "start", "capacity": 2, "previous": None}
    assert len(probe.lost_nodes_seen) >= 2, "it looked again before settling for fewer than max_workers"


def test_wait_for_capacity_takes_max_at_once_min_after_the_wait_and_gives_up_after_the_timeout():
    sizing = ElasticSizing(min_workers=2, max_workers=4, interval_s=60)
    now = [0.0]

    def wait(seen, more_s=5.0, timeout_s=60.0):
        now[0] = 0.0
        seen = iter(seen)
        return wait_for_capacity(sizing, lambda: next(seen), more_s=more_s, timeout_s=timeout_s,
                                 clock=lambda: now[0], sleep=lambda s: now.__setitem__(0, now[0] + s))

    assert wait([4]) == (4, 4)
    assert wait([9]) == (4, 9), "never more than max_workers"
    assert wait([2] * 10 + [3] * 20) == (3, 3), "after the wait for more, what is there"
    assert wait([2, 2, 4]) == (4, 4), "more came during the wait"
    assert wait([1] * 200, timeout_s=3.0) == (None, 1)
    assert wait([2], more_s=0.0) == (2, 2), "a restart does not wait for more"


def test_growth_checks_come_once_an_interval_and_only_below_max_workers():
    sizing = ElasticSizing(min_workers=1, max_workers=3, interval_s=60)
    sizing.started(100.0)
    assert not sizing.check_due(159.0, current=2)
    assert sizing.check_due(160.0, current=2)
    assert sizing.grow_to(160.0, current=2, capacity=2) is None
    assert not sizing.check_due(200.0, current=2), "the next check is an interval after the last"
    assert sizing.grow_to(221.0, current=2, capacity=5) == 3
    assert not sizing.check_due(10_000.0, current=3), "at max_workers nothing is checked"


@pytest.mark.parametrize("num_workers", [(0, 2), (3, 2), (1, 2, 3), (1.5, 2), (True, 2), ()])
def test_a_bad_worker_range_is_refused_with_a_hint(num_workers):
    with pytest.raises(ValueError, match=r"min_workers <= max_workers.*Hint: num_workers=\(2, 4\)"):
        ScalingConfig(num_workers=num_workers)


def test_a_bad_monitor_interval_is_refused():
    with pytest.raises(ValueError, match="elastic_resize_monitor_interval_s must be > 0"):
        ScalingConfig(num_workers=(1, 2), elastic_resize_monitor_interval_s=0)


def test_on_the_local_engine_an_elastic_run_takes_max_workers_and_rows_carry_the_world_size(storage):
    from toy_loops import toy_loop

    scaling = ScalingConfig(num_workers=[1, 2])
    assert (scaling.num_workers, scaling.min_workers, scaling.max_workers) == ((1, 2), 1, 2)
    result = DataParallelTrainer(toy_loop, train_loop_config={"iterations": 4, "fail_at": [[3, 1]]},
                                 scaling_config=scaling, run_config=RunConfig(
                                     name="local", storage_path=storage, verbose=0,
                                     failure_config=FailureConfig(max_failures=1))).fit()
    assert [(r["training_iteration"], r["world_size"]) for r in result.rows] == [(i, 2) for i in range(1, 5)]
    with open(os.path.join(result.path, ".unbroken", "run.json")) as f:
        attempts = json.load(f)["attempts"]
    assert [(a["num_workers"], a["elastic"]["reason"]) for a in attempts] == [(2, "start"), (2, "failure")]


def _batch_run(storage, directory, name, sizes, stop_at):
    """Run batch_loop on sizes[0] workers, then restore it on each next size after the loop
    stopped itself (stop_at: the step where each attempt stops)."""
    from elastic_loops import batch_loop
    from unbroken.train.torch import TorchTrainer

    config = {"global_batch": 12, "epochs": 2, "dir": directory, "stop_at": stop_at}
    trainer = TorchTrainer(batch_loop, train_loop_config=config,
                           scaling_config=ScalingConfig(num_workers=sizes[0]),
                           run_config=RunConfig(name=name, storage_path=storage, verbose=0))
    for size in sizes[1:]:
        with pytest.raises(TrainingFailedError, match="to change the number of workers"):
            trainer.fit()
        trainer = TorchTrainer.restore(os.path.join(storage, name),
                                       scaling_config=ScalingConfig(num_workers=size))
    return trainer.fit()


def _weights(result):
    import torch

    with result.checkpoint.as_directory() as d:
        saved = torch.load(os.path.join(d, "train_state.pt"), weights_only=True)
    return saved["state_dicts"]["model"]


def test_a_run_whose_world_size_changes_sees_each_sample_once_per_epoch_at_the_same_global_batch(
        storage, tmp_path):
    """3 workers to step 5, 2 to step 11, 3 to the end (16 steps of 12 samples in 2 epochs):
    mid-epoch shrinking and growing. Each sample once per epoch, 12 samples a step throughout,
    every step once; the same resizes at the same steps end bit for bit equal, and the loss
    stays within a float-order tolerance of the run that kept 3 workers."""
    import torch

    runs = {}
    for name in ("resized", "resized-again", "fixed"):
        directory = tmp_path / name
        directory.mkdir()
        sizes, stops = ([3], {}) if name == "fixed" else ([3, 2, 3], {"1": 5, "2": 11})
        runs[name] = (_batch_run(storage, str(directory), name, sizes, stops), directory)
    result, directory = runs["resized"]
    rows = result.rows
    assert [r["training_iteration"] for r in rows] == list(range(1, 17)), "every step once"
    assert {r["samples"] for r in rows} == {12}, "the global batch did not change with the world size"
    seen = {0: [], 1: []}
    for path in directory.glob("ids-a*-r*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            seen[entry["epoch"]].extend(entry["ids"])
    assert {e: sorted(ids) for e, ids in seen.items()} == {0: list(range(96)), 1: list(range(96))}, \
        "each sample exactly once per epoch across 3, 2 and 3 workers"
    assert sorted(p.name for p in directory.glob("ids-*")) == [
        "ids-a1-r0.jsonl", "ids-a1-r1.jsonl", "ids-a1-r2.jsonl", "ids-a2-r0.jsonl", "ids-a2-r1.jsonl",
        "ids-a3-r0.jsonl", "ids-a3-r1.jsonl", "ids-a3-r2.jsonl"]
    again = _weights(runs["resized-again"][0])
    assert all(torch.equal(v, again[k]) for k, v in _weights(result).items()), \
        "two runs that resize at the same steps are equal bit for bit"
    fixed = [r["loss"] for r in runs["fixed"][0].rows]
    assert [r["loss"] for r in rows] == pytest.approx(fixed, rel=1e-5), \
        "only the order of the floating-point gradient sum differs from the fixed-size run"


def test_a_sweep_of_elastic_trainers_runs_each_trial_elastic(storage):
    from toy_loops import toy_loop
    from unbroken import tune

    trainer = DataParallelTrainer(toy_loop, train_loop_config={"iterations": 3},
                                  scaling_config=ScalingConfig(num_workers=(1, 2)))
    grid = tune.Tuner(trainer, param_space={"train_loop_config": {"ckpt_every": tune.grid_search([1, 3])}},
                      tune_config=tune.TuneConfig(max_concurrent_trials=1),
                      run_config=RunConfig(name="sweep", storage_path=storage, verbose=0)).fit()
    assert grid.num_errors == 0 and len(grid) == 2
    for result in grid:
        assert [(r["training_iteration"], r["world_size"]) for r in result.rows] == [(1, 2), (2, 2), (3, 2)]


def test_a_sweep_on_a_cluster_starts_a_trial_when_it_fits_beside_what_the_others_hold_now():
    from unbroken.tune.trial_slots import TrialSlots

    slots = TrialSlots(slots=4, need=1, most=3)  # elastic trials of 1 to 3 workers on 4 slots
    assert slots.share([]) == 3, "the first trial may take its most"
    assert slots.share([3]) == 1 and slots.share([3, 1]) == 0, "one that got 3 leaves room for one more"
    assert slots.share([2, 1]) == 1, "counted at what they hold now, not at their most"
    assert TrialSlots(slots=4, need=2, most=2).share([2, 2]) == 0
    assert TrialSlots(slots=1, need=2, most=2).share([]) == 2, "alone, a trial too large for the cluster"


def test_a_sweeps_share_caps_an_elastic_trials_first_attempt_only(storage):
    probe = Probe(total=3)
    scaler = ElasticScaler(ScalingConfig(num_workers=(1, 3)), probe, start_limit=1)
    assert scaler.next_attempt()[0].num_workers == 1, "it starts at once with its share"
    scaler.failed([])
    assert scaler.next_attempt()[0].num_workers == 3, "later attempts take what can be placed"
