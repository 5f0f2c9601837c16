"""Layer 8, cli: the `unbroken` command (`commands`: ls, show, verify, resume, plot) and the
read-only inspection and plotting behind it (`inspection`, `plotting`).

May import: every layer below (it is the top).
"""

from unbroken.cli.commands import main

__all__ = ["main"]
