"""The ``mumoe-tn`` command line: one module per command, built into one parser.

The entry point and the registry of commands are in [`mumoe_tn.cli.main`][mumoe_tn.cli.main].

Commands: ``compare`` cost tables, ``plan`` a contraction, ``demo`` and ``specialisation`` (expert
polysemanticity against the number of experts), ``design`` a network for a budget, ``explore`` a
model's experts in an HTML page, ``distill`` a model's MLP blocks.
"""

from mumoe_tn.cli.main import main

__all__ = ["main"]
