"""Which engine answers an estimate: the names ``trainmem estimate --engine`` and the web
page's engine field accept.

Note [--help imports no engine]
    The CLI's option tables need only these names, so they live apart from
    :mod:`trainmem.estimate`, which imports the analytic engine (about 0.1 s of CPU); the CLI
    imports that module inside the functions that estimate, so ``trainmem --help`` and a
    command's ``--help`` never load an engine (``benchmarks/cli_speed.py`` times them).
"""

from __future__ import annotations

from typing import Literal

Engine = Literal["auto", "analytic", "generic", "trace"]
"""``auto``: the formulas for a formula family, else the generic (traced) path; ``analytic``:
the formulas only; ``generic``: trace the model on fake tensors and apply the framework's
transforms; ``trace``: the trace engine alone."""

ENGINES: tuple[str, ...] = ("auto", "analytic", "generic", "trace")
"""The values of :data:`Engine`, ``auto`` first."""
