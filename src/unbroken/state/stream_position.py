"""StreamPosition: how far one rank has got through a loader whose data has no global sample
order to resume (a stream: an IterableDataset, or a loader whose state is its rank's own).

The position is counted in what the training loop received, never in what a prefetcher
(DataLoader workers, `prefetch_factor`) has read ahead: `passes` is the number of passes
begun (`iter(loader)` calls; the current pass is the last one begun), `batches` the number of
batches the current pass has handed to the loop, `done` whether that pass ran to its end.

Data-parallel ranks step together, one batch each per step, so at a report every rank holds
the same counts: rank 0 can save them for all, and a rank that died is still known to have
reached them. A resumed pass is continued by skipping `batches` batches of a fresh pass
(replaying the epoch's deterministic stream), unless the caller can seek with a library's
own state (`StreamLoader`). A pass that had run to its end is not continued: the next
`iter()` begins a new one, as it would have in the run that was never stopped.

The counts are a rank's own, so another number of ranks can load them only at a pass boundary
(none begun, or the last one ended), or when the caller can carry the pass over
(`stream_carry`): `carried` then says where the rest of the pass starts, and `batches` counts
what this size has taken of that rest.

Pure: no loader, rank or time in here.
"""

from __future__ import annotations

from typing import Any

from unbroken.errors import StateMismatchError

KIND = "stream"
_KEYS = ("passes", "batches", "done", "world_size")


class StreamPosition:
    """The counts of one rank's stream (see the module docstring), and a loaded one waiting
    for the next pass to continue it."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.passes = 0
        self.batches = 0
        self.done = False
        self.carried: dict[str, int] | None = None  # the current pass is another size's, carried over
        self._continue = False  # the next pass continues a loaded, unfinished one

    def begin(self) -> int:
        """A pass begins: how many batches of it were trained on already (to skip), 0 for a
        new pass."""
        if self._continue:
            self._continue = False
            return self.batches
        self.passes += 1
        self.batches = 0
        self.done = False
        self.carried = None
        return 0

    def took(self) -> None:
        """The loop received one more batch of the current pass."""
        self.batches += 1

    def end(self) -> None:
        """The current pass ran to its end."""
        self.done = True

    def state_dict(self) -> dict[str, Any]:
        """The counts, in plain ints and bools."""
        carried = {} if self.carried is None else {"carried": dict(self.carried)}
        return {"kind": KIND, "passes": self.passes, "batches": self.batches, "done": self.done,
                "world_size": self.world_size, **carried}

    def load_state_dict(self, state: dict[str, Any], loader: str = "the loader",
                        carry: dict[str, int] | None = None, why_not: str | None = None) -> None:
        """Continue from saved counts; the next pass continues the saved one unless it had
        ended. Saved by another number of ranks, the pass in progress continues only as `carry`
        (where its rest starts); without one it is refused, with `why_not` as the cause."""
        if not isinstance(state, dict) or state.get("kind") != KIND or set(_KEYS) - set(state):
            raise StateMismatchError(
                f"the checkpoint's state for {loader} is not a stream position ({_describe(state)}): "
                "the run saved another kind of loader. Hint: resume with the loader the run was "
                "started with, or start a new run")
        resized = int(state["world_size"]) != self.world_size and bool(state["passes"]) and not state["done"]
        if resized and carry is None:
            raise StateMismatchError(
                f"{loader} keeps a data position per rank, saved by {state['world_size']} ranks mid-pass, "
                f"and this run has {self.world_size}: "
                f"{why_not or 'its per-rank position cannot be shared out'}"
                ", so the rest of the pass cannot go to other ranks without repeating or skipping data. "
                "Hint: resume with "
                f"ScalingConfig(num_workers={state['world_size']}), or read a map-style dataset through "
                "prepare_data_loader(DataLoader(...)), whose position any number of ranks can "
                "continue (docs/exact-resume.md, the loader table)")
        self.passes = int(state["passes"])
        self.batches = 0 if resized else int(state["batches"])
        self.done = bool(state["done"])
        self.carried = carry if resized else state.get("carried")
        self._continue = self.passes > 0 and not self.done

    @property
    def continuing(self) -> bool:
        """True when the next pass continues a loaded one."""
        return self._continue


def _describe(state: Any) -> str:
    if isinstance(state, dict):
        return f"keys {sorted(map(str, state))[:6]}"
    return type(state).__name__
