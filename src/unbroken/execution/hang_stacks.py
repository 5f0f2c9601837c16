"""What a hung attempt was doing: when `hang_timeout_s` fires, every rank's Python stacks are
captured before the group is torn down (`worker.stacks`, through the engine's optional
`WorkerGroup.stacks`), kept under `.unbroken/stacks/attempt-NNN/rank-R.txt`, and the
attempt records which ranks the others waited for and where each rank was
(`Attempt.hang`), which `unbroken show` prints."""

from __future__ import annotations

from unbroken.errors import WorkerHangError
from unbroken.execution.engine.base import WorkerGroup
from unbroken.run.handle import Run
from unbroken.store.manifest import META_DIR
from unbroken.worker.stacks import where

STACKS_DIR = f"{META_DIR}/stacks"
STACK_WAIT_S = 2.0  # how long a rank has to write its stacks (a stopped process never does)


def stacks_dir(attempt: int) -> str:
    return f"{STACKS_DIR}/attempt-{attempt:03d}"


def capture(run: Run, group: WorkerGroup, error: WorkerHangError) -> dict[str, str | None]:
    """Dump every rank's stacks, store them with the attempt and record where each rank was
    (`None`: it did not answer, as a stopped process does not); returns that record's
    `where`. Once per attempt: a second call returns the first one's record."""
    dump = getattr(group, "stacks", None)
    if dump is None or run.attempt is None:
        return {}
    if run.attempt.hang is not None:
        return run.attempt.hang["where"]
    texts = dump(STACK_WAIT_S)
    folder = stacks_dir(run.attempt.number)
    run.storage.makedirs(folder)
    at: dict[str, str | None] = {}
    for rank in range(group.num_workers):
        text = texts.get(rank)
        if text:
            run.storage.write_atomic(f"{folder}/rank-{rank}.txt", text.encode())
        at[str(rank)] = where(text) if text else None
    run.attempt.hang = {"waited_for": list(getattr(error, "waiting", [])), "where": at}
    return at
