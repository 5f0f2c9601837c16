"""Layer 8, cli: the `unbroken` command (`commands`: ls, show, verify, resume, plot, run), the
read-only inspection and plotting behind it (`inspection`, `plotting`) and the supervisor that
starts a training script again when its driver dies (`supervisor`, `unbroken run`).

May import: every layer below (it is the top).
"""

from unbroken.cli.commands import main

__all__ = ["main"]
