"""unbroken.train.collective (Ray Train V2's barrier and broadcast_from_rank_zero) on real
worker processes: over a real gloo process group (TorchTrainer), and through the driver
where the ranks share none (DataParallelTrainer)."""

import os

import pytest

from unbroken import train
from unbroken.train import DataParallelTrainer, RunConfig, ScalingConfig, TrainingFailedError
from unbroken.train.collective import barrier, broadcast_from_rank_zero
from unbroken.train.torch import TorchTrainer


def collective_loop(config):
    rank = train.get_context().get_world_rank()
    # Rank 0's value reaches every rank; the others' are ignored.
    got = broadcast_from_rank_zero({"seed": 1234, "from": rank} if rank == 0 else None)
    with open(os.path.join(config["out"], f"arrived-{rank}"), "w"):
        pass
    barrier()
    arrived = sorted(f for f in os.listdir(config["out"]) if f.startswith("arrived-"))
    train.report({"got": got, "arrived": arrived})


TRAINERS = pytest.mark.parametrize("trainer", [TorchTrainer, DataParallelTrainer],
                                   ids=["process-group", "through-driver"])


@TRAINERS
def test_broadcast_and_barrier_across_three_workers(storage, tmp_path, trainer):
    result = trainer(collective_loop, train_loop_config={"out": str(tmp_path)},
                          scaling_config=ScalingConfig(num_workers=3),
                          run_config=RunConfig(name="collective", storage_path=storage)).fit()
    assert result.metrics["got"] == {"seed": 1234, "from": 0}
    assert result.metrics["arrived"] == ["arrived-0", "arrived-1", "arrived-2"]


def missing_rank_loop(config):
    """Every rank but the last reaches the barrier; the last one leaves once they are about
    to enter it (each holds a FIFO open until then), without calling it."""
    ctx = train.get_context()
    rank, last = ctx.get_world_rank(), ctx.get_world_size() - 1
    if rank == last:
        for other in range(last):
            with open(os.path.join(config["out"], f"entering-{other}")) as f:
                f.read()  # returns once rank `other` has closed its end, right before barrier()
        raise RuntimeError("the last rank leaves without the barrier")
    with open(os.path.join(config["out"], f"entering-{rank}"), "w"):
        pass
    barrier()
    open(os.path.join(config["out"], f"passed-{rank}"), "w").close()


@TRAINERS
def test_no_rank_passes_a_barrier_that_a_rank_never_reaches(storage, tmp_path, trainer):
    for rank in range(2):
        os.mkfifo(tmp_path / f"entering-{rank}")
    with pytest.raises(TrainingFailedError):
        trainer(missing_rank_loop, train_loop_config={"out": str(tmp_path)},
                     scaling_config=ScalingConfig(num_workers=3),
                     run_config=RunConfig(name="missing", storage_path=storage)).fit()
    assert not [f for f in os.listdir(tmp_path) if f.startswith("passed-")]


def unpicklable_loop(config):
    rank = train.get_context().get_world_rank()
    broadcast_from_rank_zero((lambda: 1) if rank == 0 else None)
    train.report({"unreachable": True})


@TRAINERS
def test_unpicklable_data_fails_every_rank_instead_of_hanging(storage, trainer):
    with pytest.raises(TrainingFailedError) as info:
        trainer(unpicklable_loop, scaling_config=ScalingConfig(num_workers=2),
                     run_config=RunConfig(name="unpicklable", storage_path=storage)).fit()
    cause = info.value.__cause__
    assert isinstance(cause, TypeError) and "cannot be pickled" in str(cause) and "Hint" in str(cause)


def one_worker_loop(config):
    barrier()
    train.report({"got": broadcast_from_rank_zero(7)})


def test_one_worker_needs_no_process_group(storage):
    one = DataParallelTrainer(one_worker_loop, run_config=RunConfig(name="one", storage_path=storage)).fit()
    assert one.metrics["got"] == 7


def interleaved_loop(config):
    """Collective calls right after reports: the driver's reply to a report may reach a rank
    while it waits in a collective call, and a stop in it must hold at the next report."""
    rank = train.get_context().get_world_rank()
    for i in range(6):
        train.report({"i": i})
        assert broadcast_from_rank_zero(i * 10 if rank == 0 else None) == i * 10
        barrier()


def test_collectives_between_reports_keep_the_reports_stop(storage):
    result = DataParallelTrainer(interleaved_loop, scaling_config=ScalingConfig(num_workers=3),
                                 run_config=RunConfig(name="interleaved", storage_path=storage,
                                                      stop={"i": 2})).fit()
    assert [row["i"] for row in result.metrics_dataframe.to_dict("records")] == [0, 1, 2]


def mismatched_loop(config):
    if train.get_context().get_world_rank() == 0:
        barrier()
    else:
        broadcast_from_rank_zero(None)


def test_ranks_making_different_calls_get_an_error_naming_them(storage):
    with pytest.raises(TrainingFailedError) as info:
        DataParallelTrainer(mismatched_loop, scaling_config=ScalingConfig(num_workers=2),
                            run_config=RunConfig(name="mismatch", storage_path=storage)).fit()
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError)
    assert "rank 0: barrier()" in str(cause) and "rank 1: broadcast_from_rank_zero()" in str(cause)


def test_outside_a_training_function_it_says_where_to_call_it():
    with pytest.raises(RuntimeError, match="inside a training function"):
        barrier()
    with pytest.raises(RuntimeError, match="inside a training function"):
        broadcast_from_rank_zero(1)
