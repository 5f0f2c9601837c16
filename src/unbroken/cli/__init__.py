from unbroken.cli.commands import main

__all__ = ["main"]
