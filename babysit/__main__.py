"""``python -m babysit``: the same command line as ``babysit``."""

from babysit.supervisor.commands.cli import main

raise SystemExit(main())
