"""``python -m kvroute ...`` is the ``kvroute`` command."""

from kvroute.deploy.cli import main

raise SystemExit(main())
