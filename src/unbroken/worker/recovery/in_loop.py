"""In-place recovery that does not leave the training loop: `TrainState.for_each_batch(loader,
step)` runs the steps of a pass, and when a step fails right after a report (a collective
broke because a peer died, raised or froze), this rank keeps everything its training
function built: the model and its DDP wrapper, the optimizer, the loader and its worker
processes, the dataset, the compiled code. It tells the driver, as any failed rank does
(`runner.rejoin_in_loop`: the offer, `Failed`, the release of the process group); told to
stay, it begins the next attempt in its loop:

1. Rejoin: a new session, the new process group, the state of the last report sent by the
   source rank (maybe itself), as for any rank that stays (`peer_state`).
2. Rewrap: each DDP wrapper `prepare_model` made is initialised again in place (the loop's
   references to it stay good), without collectives, as the replacement's is; its buckets
   start from the default layout, as a restarted rank's do.
3. Roll back: the partial gradients are dropped, and `TrainState.restore` loads the state
   of the last report into the live objects and seeds the step streams of that report.
4. Meet: every rank of the attempt (the replacement from the top of its training function)
   reaches `for_each_batch` before any step (`meet`, through the driver).
5. Redo: the pass starts again from the loader's position at the last report.

A loop stays only when the run could go on bit for bit: the TrainState is armed
(`jit_checkpoint=True`), the loader is its own resumable one, the last report was made
inside this call with no optimizer step since (`jit.Tracker.problem`), and the next attempt
keeps this rank's number and the world size. Otherwise the failure propagates out of the
training function, and the rank recovers as before: it stays and runs the function again,
or the run restarts from storage.

The meeting is what keeps the ranks' collectives in step: a replacement runs the code
before its loop, the survivors do not. That code must make no collectives of its own
(`prepare_model` makes none in such an attempt); if it does, the replacement waits there
alone until the collective timeout, and the run falls back to the restart from storage
rather than pairing collectives that do not belong together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parallel import DistributedDataParallel

from unbroken.state.state_file import unwrap
from unbroken.worker import runner
from unbroken.worker import session as session_mod

if TYPE_CHECKING:
    from unbroken.worker.session import Session
    from unbroken.worker.train_state import TrainState


def for_each_batch(state: TrainState, loader: Iterable[Any], step: Callable[[Any], Any]) -> None:
    """See `TrainState.for_each_batch`."""
    session = session_mod.active()
    if session is None or not _tracks(state, loader, session):
        for batch in loader:
            step(batch)
        return
    meet(session)
    first = session.iteration  # a report after it was made inside this call
    while True:
        batches = iter(loader)
        try:
            for batch in batches:
                step(batch)
            return
        except Exception as e:  # noqa: BLE001 - the driver decides whether this rank stays
            if not _holds_last_report(session, first):
                raise
            failure = e
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
        runner.rejoin_in_loop(failure)
        session = session_mod.current("TrainState.for_each_batch()")
        _go_on(state, session)


def meet(session: Session) -> None:
    """Step 4, once per attempt that recovers in place: wait, through the driver, until every
    rank has reached its loop."""
    if session.info.peer_source is None or not session.reached_loop():
        return
    met = session.gather("TrainState.for_each_batch()")
    if met.mismatch or met.error:
        raise RuntimeError(f"the ranks did not meet at TrainState.for_each_batch(): "
                           f"{met.mismatch or met.error}")


def _tracks(state: TrainState, loader: Any, session: Session) -> bool:
    """Whether this loop can stay after a failure at all: `state` is the armed TrainState,
    and `loader` is its own, with a position it can go back to."""
    tracker = session.jit
    return (tracker is not None and tracker.state is state and hasattr(loader, "load_state_dict")
            and any(obj is loader for obj in state._objects.values()))


def _holds_last_report(session: Session, first: int) -> bool:
    """Whether this rank still holds the state of its last report, made inside this call."""
    tracker = session.jit
    return (tracker is not None and tracker.iteration is not None and tracker.iteration > first
            and tracker.problem(session.iteration) is None)


def _go_on(state: TrainState, session: Session) -> None:
    """Steps 2 to 4, once this rank has rejoined."""
    for wrapper in session.wrappers:
        kwargs = {**getattr(wrapper, "unbroken_ddp_kwargs", {}), "init_sync": False}
        DistributedDataParallel.__init__(wrapper, wrapper.module, **kwargs)
    for obj in state._objects.values():
        if isinstance(unwrap(obj), torch.nn.Module):
            for parameter in unwrap(obj).parameters():
                parameter.grad = None
        elif isinstance(obj, torch.optim.Optimizer):
            obj.zero_grad(set_to_none=True)
    state.restore()
    meet(session)

