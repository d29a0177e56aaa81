"""``import trainmem`` and the analytic path never import torch (it is an optional extra), and
the command line starts without the heavy optional libraries: ``trainmem --help`` and an
analytic ``trainmem estimate`` import neither torch, transformers, matplotlib nor gradio."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "matplotlib", "gradio")


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


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["estimate", "--help"],
        ["estimate", "llama-3.1-8b", "-b", "2", "-s", "2048"],
        ["estimate", "llama-3.1-8b", "-b", "2", "-s", "2048", "--json"],
    ],
    ids=["help", "estimate-help", "estimate", "estimate-json"],
)
def test_cli_starts_without_heavy_libraries(args: list[str]) -> None:
    # the console script's own entry point, in a fresh interpreter
    code = (
        "import sys\n"
        "from trainmem.cli import main\n"
        f"sys.argv = ['trainmem', *{args!r}]\n"
        "try:\n    main()\n"
        "except SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        f"bad = [m for m in {HEAVY!r} if m in sys.modules]\n"
        "print('heavy:', bad, file=sys.stderr)\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "heavy: []" in out.stderr
