"""The entry point of a trial's driver process started by a `TrialHost` actor on a node of
the Ray cluster: `python -m unbroken.tune.trial_child <parent pid> <outcome fd>`, with the
sweep driver's import path and the pickled `TrialPayload` on stdin. It runs `trial_main`, as
a trial's process on the sweep driver's machine does."""

from __future__ import annotations

import os
import pickle
import sys
from multiprocessing.connection import Connection

import cloudpickle

from unbroken.core.processes import Carried
from unbroken.tune.trial import trial_main


def main(argv: list[str]) -> None:
    parent, fd = int(argv[0]), int(argv[1])
    sys_path, payload = pickle.loads(sys.stdin.buffer.read())
    # The driver's import path, where its directories exist here: a trainable pickled by
    # reference (defined in the user's modules) loads as it does on the driver's machine.
    sys.path.extend(p for p in sys_path if p not in sys.path and os.path.isdir(p))
    trial_main(Carried(cloudpickle.loads(payload)), Connection(fd, readable=False), parent)


if __name__ == "__main__":
    main(sys.argv[1:])
