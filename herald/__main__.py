"""``python -m herald ...`` runs the ``herald`` command line (:mod:`herald.cli`)."""

from herald.cli import main

raise SystemExit(main())
