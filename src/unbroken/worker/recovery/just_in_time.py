"""Just-in-time checkpoints: when a rank fails, a surviving rank saves the state of the last
completed report round, so that the next attempt resumes there instead of at the last
periodic checkpoint.

On in a run with `FailureConfig(recovery="just_in_time")` or `"in_place"`, or with
`TrainState(..., jit_checkpoint=True)`. The step streams below are seeded from
`step_seed=1234` when given, else from each rank's own seed (`step_seed_of`), which the
driver records in run.json (`step_seeds`) for the run's later attempts and passes to the
saver.
Data-parallel training keeps a replica of the model and optimizer on every rank, so any
rank that is still alive holds the state a checkpoint of report k would hold, provided
nothing has changed it since report k:

1. Track (worker, every report k): the model's parameters and the optimizers' state are left
   live; an optimizer step pre-hook marks the state dirty when a step begins, so a step in
   flight is never half-saved. What changes before a step (model buffers such as BatchNorm
   statistics in the forward pass, the loader position, the scheduler, plain values) is
   copied at each report (`Tracker.snapshot`). Then every generator is re-seeded from
   (step_seed, rank, k) (`seed_step`): the random draws after report k are a pure function of
   the seed, so the random state of a rank that died is known without that rank.
2. Arm (worker, once): the TrainState tells the driver it can save (`JitArmed`).
3. Offer (worker, when its loop raises, e.g. a collective broken by a dead peer): the rank
   sends `JitOffer(k)` when its state is clean since report k, else `JitOffer(None, why)`,
   then its `Failed`, and waits for the driver's word (`JitSave`).
4. Choose (driver, once the failure is final): the saver is the lowest rank with a valid
   offer, where valid means that round k is complete (every rank reported k, so its metric
   row is recorded) and newer than the latest committed checkpoint. A higher rank that
   offers while a lower armed rank still runs is told not to save: its exit releases the
   lower rank from any collective it is blocked in, which then offers in turn (rank 0's
   plain values are the ones a periodic checkpoint holds). The driver waits for offers at
   most `execution.recovery.just_in_time.OFFER_WAIT_S` (a rank blocked for good, e.g. with a
   peer on a lost node, is not waited for) and for the save at most `SAVE_WAIT_S` or until the saver dies.
5. Save (the chosen rank): the random state of every rank from the seeded streams, then
   `train_state.pt` from the live and copied state, into the staging area of checkpoint k
   with the same helpers a report uses (`commit.staging_name`, `commit.write_rank_files`);
   then `JitSaved(k, files)`.
6. Commit (driver): checkpoint k through the normal commit protocol (marker last), with
   round k's row as its metrics. What happened is kept in the attempt record
   (`Attempt.jit_checkpoint`): the iteration saved and by which rank, or why none was.

A saver killed while saving leaves an unmarked staging directory: the previous checkpoint
stays the resume point and the next attempt removes the leftover. There is no just-in-time
checkpoint, and the run falls back to the last periodic one, when a step began since the
last report, when the model is sharded (FSDP2, tensor parallelism: no rank holds the whole
state), or when no rank could offer in time.

This module is the worker's half (steps 1, 2, 3 and 5); the driver's half (4 and 6's
waiting) is `unbroken.execution.recovery.just_in_time`, so that the driver does not import torch
for it.
"""

from __future__ import annotations

import os
import tempfile
import zlib
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch

from unbroken.core import faults
from unbroken.state.sample_seed import sample_seed, seed_generators
from unbroken.state.state_file import build_payload, capture_rng, restore_rng, unwrap, write_files
from unbroken.store.commit import FileEntry, staging_name, write_rank_files
from unbroken.worker import session as session_mod
from unbroken.worker.recovery.messages import JitArmed, JitOffer, JitSave, JitSaved, Stay

if TYPE_CHECKING:
    from unbroken.worker.session import Session
    from unbroken.worker.train_state import TrainState

# Keeps the step streams apart from the per-sample seeds of the same seed.
_STREAM_SALT = 0x6A69745F73746570


# -- random streams --------------------------------------------------------------------------------
def seed_step(step_seed: int, rank: int, iteration: int, generators: dict[str, torch.Generator]) -> None:
    """Seed this process's generators (python, numpy, torch CPU, the current CUDA device) and
    the TrainState's torch.Generator extras for the steps after report `iteration` of `rank`."""
    seed = sample_seed(step_seed ^ _STREAM_SALT, rank, iteration)
    seed_generators(seed)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed(seed)
    for name, g in generators.items():
        g.manual_seed(sample_seed(seed, zlib.crc32(name.encode()), 0))


def _copy(value: Any) -> Any:
    """`value` with its tensors cloned (on their device) and its containers rebuilt."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _copy(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_copy(v) for v in value)
    return value


def armed(jit_checkpoint: Any) -> bool:
    """Whether a TrainState tracks its state for just-in-time checkpoints: as
    `jit_checkpoint` says, else (None) as the run's `FailureConfig.recovery` does
    ("just_in_time" and "in_place"); never outside a run."""
    if jit_checkpoint is not None and not isinstance(jit_checkpoint, bool):
        raise TypeError(f"TrainState(jit_checkpoint=...) takes a bool, got {type(jit_checkpoint).__name__}")
    session = session_mod.active()
    if session is None or jit_checkpoint is False:
        return False
    return jit_checkpoint or session.info.recovery in ("just_in_time", "in_place")


def step_seed_of(step_seed: Any, jit: bool) -> int | None:
    """The seed of a TrainState's per-step random streams: `step_seed` (checked), or, for a
    state armed for just-in-time checkpoints (`jit`) without one, this rank's own: the one
    the run recorded for it (`WorkerInfo.step_seed`, from an earlier attempt's `JitArmed`),
    else its torch seed as the loop left it (`torch.initial_seed()`: what the loop's own
    seeding chose, so runs seeded alike draw alike). A rank that dies takes its random state
    with it, so a just-in-time checkpoint is exact only when every rank's draws after a
    report follow from (its seed, rank, report)."""
    if step_seed is not None and (isinstance(step_seed, bool) or not isinstance(step_seed, int)):
        raise TypeError(f"TrainState(step_seed=...) takes an int, got {type(step_seed).__name__}")
    if jit and step_seed is None:
        recorded = session_mod.current("TrainState").info.step_seed
        return recorded if recorded is not None else torch.initial_seed()
    return step_seed


# -- worker side -----------------------------------------------------------------------------------
class _Buffers:
    """A module's buffers that its state_dict holds, copied at each report with one fused copy."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.where = [(sub, name, f"{prefix}.{name}" if prefix else name)
                      for prefix, sub in module.named_modules() for name, b in sub._buffers.items()
                      if b is not None and name not in sub._non_persistent_buffers_set]
        self.copies: list[torch.Tensor | None] = [_copy(sub._buffers[name]) for sub, name, _ in self.where]

    def snapshot(self) -> None:
        live = [sub._buffers[name] for sub, name, _ in self.where]
        if not live:
            return
        try:
            torch._foreach_copy_(self.copies, live)
        except (RuntimeError, TypeError):  # a buffer was replaced (another shape, device, None)
            self.copies = [_copy(b) for b in live]

    def overlay(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """`state_dict` with the buffers as they were at the last report."""
        for (_, _, key), copy in zip(self.where, self.copies, strict=True):
            if key in state_dict and copy is not None:
                state_dict[key] = copy
        return state_dict


class Tracker:
    """What a TrainState with `jit_checkpoint=True` keeps between reports to be able to save
    the state of its last report after a failure (one per process: the latest one built)."""

    def __init__(self, state: TrainState, step_seed: int, rank: int) -> None:
        self.state = state
        self.step_seed = step_seed
        self.rank = rank
        self.iteration: int | None = None  # the report the copies are from
        self.clean = False  # no optimizer step has begun since that report
        self.buffers: dict[str, _Buffers] = {}
        self.copied: dict[str, Any] = {}  # state_dicts of the objects neither modules nor optimizers
        self.values: dict[str, Any] = {}
        self.live: set[str] = set()
        for name, obj in state._objects.items():
            module = unwrap(obj) if name == "model" else obj
            if isinstance(module, torch.nn.Module):
                self.buffers[name] = _Buffers(module)
                self.live.add(name)
            elif isinstance(obj, torch.optim.Optimizer):
                obj.register_step_pre_hook(self._step_began)
                self.live.add(name)

    def follow_rank(self, rank: int) -> None:
        """The loop this tracker follows goes on as rank `rank` of the next attempt (a
        recovery in place): the step streams after its reports are that rank's."""
        self.rank = rank

    def _step_began(self, *_: Any) -> None:
        self.clean = False

    def snapshot(self, iteration: int) -> None:
        """Report `iteration` was sent: copy what changes before the next optimizer step."""
        state = self.state
        for buffers in self.buffers.values():
            buffers.snapshot()
        self.copied = {name: _copy(obj.state_dict()) for name, obj in state._objects.items()
                       if name not in self.live}
        self.values = _copy(state._values)
        self.iteration = iteration
        self.clean = True

    def after_report(self, iteration: int) -> None:
        """Called by the session after every report: copy, then start the next steps' streams."""
        self.snapshot(iteration)
        seed_step(self.step_seed, self.rank, iteration, self.state._generators)

    def problem(self, iteration: int) -> str | None:
        """Why this rank cannot save checkpoint `iteration` (its last report), or None."""
        if self.iteration != iteration:
            return f"report {iteration} did not complete on this rank"
        if not self.clean:
            return f"an optimizer step began after report {iteration}"
        if self.state.sharded_names():
            return "the model is sharded (FSDP2 or tensor parallel): no rank holds all of it"
        return None

    def state_dicts(self) -> dict[str, Any]:
        """Every object's state_dict as it was at the last report."""
        out = {}
        for name, obj in self.state._objects.items():
            if name in self.buffers:
                module = unwrap(obj) if name == "model" else obj
                out[name] = self.buffers[name].overlay(module.state_dict())
            elif name in self.live:
                out[name] = obj.state_dict()
            else:
                out[name] = self.copied[name]
        return out


def arm(state: TrainState, step_seed: int) -> None:
    """Inside a run: track `state` for just-in-time checkpoints in this rank (the session calls
    it after every report) and tell the driver. The latest TrainState armed is the one saved."""
    session = session_mod.active()
    if session is None:
        return
    first = session.jit is None
    session.track(Tracker(state, step_seed, session.info.world_rank))
    if first:
        session.send(JitArmed(step_seed))


def offer(session: Session) -> bool:
    """The loop failed: offer the driver a just-in-time checkpoint of the last report (or say
    why not) when a TrainState is armed. Returns whether an offer was sent."""
    tracker = session.jit
    if tracker is None:
        return False
    iteration = session.iteration
    if iteration <= session.info.start_iteration:
        why: str | None = "no report since the attempt began"
    else:
        why = tracker.problem(iteration)
    session.send(JitOffer(None if why else iteration, why or ""))
    return True


def save_if_asked(session: Session) -> Stay | None:
    """Wait for the driver's word on this rank's offer and save when it says so; returns it
    when it says to stay for a recovery in place (see `peer_state`)."""
    message = session.channel.recv()
    while not isinstance(message, (JitSave, Stay)):  # skip the reply to the last report, and the like
        message = session.channel.recv()
    if isinstance(message, Stay):
        return message
    if message.iteration is None or session.jit is None:
        return None
    try:
        files = save(session, session.jit, message.iteration, message.seeds or {})
    except Exception as e:  # noqa: BLE001 - the driver falls back and says why
        session.send(JitSaved(message.iteration, None, f"{type(e).__name__}: {e}"))
        return None
    session.send(JitSaved(message.iteration, files))
    return None


def save(session: Session, tracker: Tracker, iteration: int, seeds: dict[int, int]) -> list[FileEntry]:
    """Stage checkpoint `iteration` from this rank: every rank's random state (from its step
    seed in `seeds`, else this rank's), then `train_state.pt`. Returns the files staged."""
    info = session.info
    staging = staging_name(iteration, info.attempt, info.storage)
    with tempfile.TemporaryDirectory(prefix="unbroken-jit-") as d:
        rng_dir, state_dir = os.path.join(d, "rng"), os.path.join(d, "state")
        os.makedirs(rng_dir)
        os.makedirs(state_dir)
        _write_rng_files(rng_dir, tracker, iteration, info.world_size, seeds)
        guard = session.check_attempt
        files = write_rank_files(info.storage, staging, rng_dir, info.world_rank, guard=guard)
        faults.point("during_jit_save")
        _write_state_file(state_dir, tracker, info.world_size)
        files += write_rank_files(info.storage, staging, state_dir, info.world_rank, guard=guard)
    return files


def _write_rng_files(directory: str, tracker: Tracker, iteration: int, world_size: int,
                     seeds: dict[int, int]) -> None:
    """Each rank's generators as its stream after report `iteration` left them."""
    generators = tracker.state._generators
    mine = capture_rng(generators)
    try:
        for rank in range(world_size):
            seed_step(seeds.get(rank, tracker.step_seed), rank, iteration, generators)
            write_files(directory, rank, None, capture_rng(generators))
    finally:
        restore_rng(mine)
        for name, g in generators.items():
            g.set_state(mine["generators"][name])


def _write_state_file(directory: str, tracker: Tracker, world_size: int) -> None:
    """`train_state.pt` as the checkpoint of the last report would hold it."""
    write_files(directory, 0, build_payload(tracker.state_dicts(), tracker.values, world_size), None)
