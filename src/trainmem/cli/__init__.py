"""Command-line interface: every command and option parser lives in this package, so no other
stage imports the CLI (STYLE.md sec. 1: ``... -> planner -> report -> cli``).

- :mod:`trainmem.cli.app`: the typer app, ``estimate``, ``formulas``, ``models``, ``gpus``,
  ``compare-snapshot``;
- :mod:`trainmem.cli.options`: the training options every command shares;
- :mod:`trainmem.cli.planner`: ``plan``, ``fit``, ``sweep``;
- :mod:`trainmem.cli.compare`: ``compare``;
- :mod:`trainmem.cli.serve`: ``serve``, the web calculator (:mod:`trainmem.web`).
"""

from trainmem.cli.app import app, main

__all__ = ["app", "main"]
