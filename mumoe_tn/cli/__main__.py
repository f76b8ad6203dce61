"""``python -m mumoe_tn.cli``: the ``mumoe-tn`` command."""

from mumoe_tn.cli.main import main

raise SystemExit(main())
