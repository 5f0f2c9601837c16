"""Where a trial's driver runs: a process of this machine (`LocalTrialProcess`), or an actor
of the Ray cluster (`tune.ray_trial_process.RayTrialProcess`). The sweep driver handles both
alike:

- `conn`: what the trial sends (its outcome, as `worker.protocol` messages); `sentinel`:
  readable once the trial's driver has ended. Both can be waited on with
  `multiprocessing.connection.wait`, so the sweep driver waits without polling.
- `signal(signum)`: pass a SIGTERM or SIGINT on to the trial's driver, which checkpoints and
  stops as a single run does.
- `kill()` and `join()`: end it now, and wait until it has.
- `died()`: why it ended without an outcome, in words; `lost()`: how its machine was lost,
  when that is why it ended (the sweep then runs the trial again, from its last checkpoint,
  once `relaunch_ready()` says so).
- `reusable`: with `TuneConfig(reuse_actors=True)` (local trials only), the process waits for
  another trial after each one it ends cleanly: `give(payload)` hands it the next one, and
  `close()` lets it end (see `trial.trial_main`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from typing import Any

from unbroken.core.processes import Carried
from unbroken.execution.engine.local import start_method
from unbroken.tune.trial import TrialPayload, trial_main

_TERMINAL = {signal.SIGTERM, signal.SIGINT}


class LocalTrialProcess:
    """A trial's driver in a child process of the sweep driver, which dies with it (PDEATHSIG).

    Forked when this process is fork-safe (as the local engine decides for its workers);
    otherwise spawned, not taken from a forkserver: a forkserver's children keep it alive, so
    they would not die with the sweep driver, while a spawned trial's parent is the sweep
    driver and PDEATHSIG applies. (Spawning re-imports the main script, which must guard its
    sweep with `if __name__ == "__main__":`, as with any multiprocessing spawn.)
    """

    def __init__(self, payload: TrialPayload, name: str) -> None:
        self.method = "fork" if start_method() == "fork" else "spawn"
        self.reusable = payload.reuse
        ctx = mp.get_context(self.method)
        self.conn, writer = ctx.Pipe(duplex=payload.reuse)
        self.proc = ctx.Process(target=trial_main, name=f"unbroken-trial-{name}",
                                args=(Carried(payload), writer, os.getpid()))
        # Blocked around the fork: a signal meant for the sweep cannot hit the new process
        # while it still has the sweep driver's handlers; it is delivered after the fork.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, _TERMINAL)
        try:
            self.proc.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        writer.close()

    @property
    def sentinel(self) -> Any:
        return self.proc.sentinel

    def signal(self, signum: int) -> None:
        try:
            os.kill(self.proc.pid, signum)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.proc.kill()

    def give(self, payload: TrialPayload) -> bool:
        """Hand a process waiting for its next trial that trial; False when it is gone. (Its
        end of the pipe lives on in its workers for a moment after it dies, so a send alone
        could succeed.)"""
        if not self.proc.is_alive():
            return False
        try:
            self.conn.send(Carried(payload))
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Let a process waiting for its next trial end, and wait until it has."""
        try:
            self.conn.send(None)
        except OSError:
            pass  # it is gone already
        self.conn.close()
        self.proc.join()

    def join(self) -> None:
        self.proc.join()

    def lost(self) -> str | None:
        return None  # this machine is the sweep driver's: had it been lost, nobody would ask

    def relaunch_ready(self) -> Callable[[], bool]:
        return lambda: True

    def died(self) -> str:
        code = self.proc.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with code {code}")
        hint = ""
        if self.method == "spawn":
            hint = (" (it was spawned: if the sweep's script has no `if __name__ == '__main__':` "
                    "guard, the spawned process ran the script again; see its stderr)")
        return f"the trial's driver process {how} without reporting an outcome{hint}"
