"""Two drivers of the same run (or sweep) started at the same moment, over and over, on
local disk and on S3: exactly one trains, the other fails with LeaseHeldError naming the
holder, and nothing stored comes from both.

Each driver is a long-lived process (tests/race_loops.py) that runs one race per line it
reads, so that two races start within microseconds of each other without paying for a
Python start-up each time.
"""

from __future__ import annotations

import json
import uuid

import pytest

from conftest import read_until, s3_env, start_script

DRIVER = "import race_loops; race_loops.main()"
ITERATIONS = 4  # race_loops.ITERATIONS


class Driver:
    """One racing driver process; `ask(name)` runs one race (or inspection) and returns its line."""

    def __init__(self, mode: str, root: str, tag: str, env: dict[str, str]) -> None:
        self.tag = tag
        self.proc = start_script(DRIVER, mode, root, with_stdin=True, RACE_TAG=tag, **env)
        read_until(self.proc, "READY")

    def send(self, name: str) -> None:
        self.proc.stdin.write(f"go {name}\n")
        self.proc.stdin.flush()

    def answer(self) -> str:
        line = read_until(self.proc, " ")[-1].strip()
        assert line.startswith(("OUTCOME ", "STORED ")), line
        return line.split(" ", 1)[1]

    def ask(self, name: str) -> str:
        self.send(name)
        return self.answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.proc.stdout.close()
        self.proc.stderr.close()


def race(mode: str, root: str, env: dict[str, str], races: int) -> None:
    """`races` races of two drivers in `mode`, each checked (see the module docstring)."""
    prepare = Driver("prepare", root, "prep", env) if mode in ("rerun", "restore") else None
    a, b = (Driver(mode, root, tag, env) for tag in ("a", "b"))
    inspect = Driver("inspect", root, "-", env)
    try:
        for i in range(races):
            name = f"{mode}-{i}"
            if prepare is not None:
                assert prepare.ask(name).startswith("failed"), "the run to resume was prepared"
            a.send(name)
            b.send(name)
            outcomes = {a.tag: a.answer(), b.tag: b.answer()}
            winners = [d for d in (a, b) if outcomes[d.tag] == "trained"]
            assert len(winners) == 1, f"race {i}: exactly one driver trains: {outcomes}"
            winner = winners[0]
            loser = b if winner is a else a
            assert outcomes[loser.tag].startswith("refused"), f"race {i}: the other is refused: {outcomes}"
            assert f"pid {winner.proc.pid} " in outcomes[loser.tag], \
                f"race {i}: it names the holder: {outcomes}"
            check_stored(json.loads(inspect.ask(name)), winner.tag, prepared=prepare is not None,
                         where=f"race {i}")
    finally:
        for driver in (prepare, a, b, inspect):
            if driver is not None:
                driver.close()


def check_stored(runs: dict[str, dict], winner: str, prepared: bool, where: str) -> None:
    """Every row and checkpoint comes from the preparing launch or the winner; each iteration
    is recorded once per attempt, and the winner's attempt is the only one added."""
    assert runs, f"{where}: nothing stored"
    for key, run in runs.items():
        at = f"{where} {key}".strip()
        assert run["attempts"] == 1 + prepared, f"{at}: one attempt added: {run['attempts']}"
        owners = {1: "prep", 2: winner} if prepared else {1: winner}
        assert all(tag == owners[attempt] for attempt, _, tag in run["rows"]), f"{at}: {run['rows']}"
        for attempt in owners:
            its = [it for at_, it, _ in run["rows"] if at_ == attempt]
            assert len(its) == len(set(its)), f"{at}: an iteration recorded twice: {run['rows']}"
        assert sorted({it for _, it, _ in run["rows"]}) == list(range(1, ITERATIONS + 1)), run["rows"]
        assert set(run["checkpoint_tags"]) <= set(owners.values()), f"{at}: {run['checkpoint_tags']}"


MODES = ["fresh", "rerun", "restore", "sweep"]


@pytest.mark.parametrize("mode", ["restore"])  # all four in the soak below
def test_two_drivers_started_at_once_on_local_disk_one_trains(tmp_path, mode):
    race(mode, str(tmp_path / "results"), {}, races=1)


@pytest.mark.parametrize("mode", ["restore"])  # all four in the soak below
def test_two_drivers_started_at_once_on_s3_one_trains(s3_endpoint, mode):
    race(mode, f"s3://bucket/race-{uuid.uuid4().hex[:8]}", s3_env(s3_endpoint), races=1)


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["local", "s3"])
@pytest.mark.parametrize("mode", MODES)
def test_two_drivers_started_at_once_soak(tmp_path, s3_endpoint, storage, mode):
    if storage == "local":
        race(mode, str(tmp_path / "results"), {}, races=30)
    else:
        race(mode, f"s3://bucket/race-{uuid.uuid4().hex[:8]}", s3_env(s3_endpoint), races=30)


def test_a_run_that_finishes_between_the_first_read_and_the_lease_is_not_trained_again(storage, monkeypatch):
    """A second driver read run.json while the first still trained (RUNNING); the first then
    finished and released the lease, which the second took. Under the lease the second must
    see FINISHED and return the stored result, not add an attempt (a crash harness finding:
    two FINISHED attempts from one launch with a second driver)."""
    import dataclasses

    from toy_loops import toy_loop
    from unbroken.store import opening
    from unbroken.train import DataParallelTrainer, RunConfig

    def trainer():
        return DataParallelTrainer(toy_loop, train_loop_config={"iterations": 3},
                                   run_config=RunConfig(name="race", storage_path=storage, verbose=0))

    first = trainer().fit()
    assert first.status == "FINISHED"
    existing = opening.existing

    def read_while_it_ran(*args, **kwargs):  # the second driver's first read, from before the end
        manifest = existing(*args, **kwargs)
        return dataclasses.replace(manifest, status="RUNNING")

    monkeypatch.setattr(opening, "existing", read_while_it_ran)
    second = trainer().fit()
    assert second.status == "FINISHED" and second.metrics["training_iteration"] == 3
    with open(f"{first.path}/.unbroken/run.json") as f:
        assert [a["status"] for a in json.load(f)["attempts"]] == ["FINISHED"], "no second attempt"
