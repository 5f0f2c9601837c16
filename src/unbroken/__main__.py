"""`python -m unbroken ...`: the same command line as the `unbroken` console script."""

from unbroken.cli.commands import main

raise SystemExit(main())
