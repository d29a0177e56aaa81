"""``import trainmem`` and the analytic path never import torch (it is an optional extra)."""

from __future__ import annotations

import subprocess
import sys


def test_analytic_estimate_does_not_import_torch() -> None:
    code = (
        "import sys, trainmem\n"
        "from trainmem.estimate import estimate\n"
        "from trainmem.cli import app\n"
        "estimate('llama-3.1-405b', gpu='H100-80GB')\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
