"""Imported only inside the forkserver process, as one of its preloads.

SIGTERM or SIGINT sent to the whole process group (Ctrl-C, a batch scheduler's
preemption) must reach the driver, which coordinates the shutdown, and not kill the
forkserver: its workers die with it (PDEATHSIG). Python's forkserver already ignores
SIGINT; this makes it ignore SIGTERM too. It still exits when the driver goes away.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
