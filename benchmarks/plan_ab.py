"""``trainmem plan`` on two source trees: the same answers, and which is faster (issue 28).

A speed change to the planner's path (imports, the closed form, the schedule's expansion, the
allocator replay) must leave every answer as it was. This runs ``trainmem plan ... --json``
and the table output on :data:`CONFIGURATIONS` (distinct models, GPUs, precisions, sequence
lengths and settings) with each tree's ``src`` first on ``PYTHONPATH``, in a fresh process
each, and compares the outputs byte for byte; then it times ``cli_speed.py``'s ``plan`` line
(a fresh process per run, CPU seconds of the child) alternately on both trees, base first,
so that both see the same machine state, and prints both medians.

Run: ``python benchmarks/plan_ab.py BASE_SRC [RUNS]`` from a checkout (its ``src`` is the
new tree), the base a fixed snapshot of the commit the new tree is on, e.g. ``git archive main
src | tar -x -C /tmp/base`` then ``python benchmarks/plan_ab.py /tmp/base/src 7`` (a checkout
that moves during the run compares two different programs). The exit status is 1 when any
output differs. Not a test: it needs two trees, and the timings depend on the
machine; the answers' identity is the check (the lead's README speed block is measured on a
quiet machine by ``cli_speed.py``).
"""

from __future__ import annotations

import difflib
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from speed_common import child_cpu_seconds, machine

CONFIGURATIONS: tuple[tuple[str, ...], ...] = (
    ("llama-3.2-3b", "--gpu", "A100-80GB", "--precision", "bf16-true", "--seq-len", "4096"),
    ("llama-3.2-1b", "--gpu", "RTX-4090", "--precision", "bf16-mixed", "--seq-len", "2048"),
    ("llama-3.1-8b", "--gpu", "H100-80GB", "--precision", "bf16-true", "--seq-len", "8192"),
    ("llama-3.1-8b", "--gpu", "A100-80GB", "--activation-checkpointing", "full"),
    ("gpt2", "--gpu", "T4", "--precision", "32-true", "--seq-len", "1024"),
    ("gpt2-xl", "--gpu", "A10G", "--precision", "16-mixed", "--attention", "eager"),
    ("qwen2.5-7b", "--gpu", "A100-80GB", "--lora-rank", "16", "--quantize-base", "nf4"),
    ("mistral-7b-v0.1", "--gpu", "L40S", "--precision", "bf16-true", "--seq-len-multiple-of", "1"),
    ("gemma-2b", "--gpu", "RTX-3090", "--precision", "bf16-mixed", "--seq-len", "512"),
    ("llama-2-7b", "--gpu", "A100-40GB", "--zero-stage", "3", "--data-parallel-size", "8"),
    ("llama-2-13b", "--gpu", "H100-80GB", "--framework", "deepspeed", "--zero-stage", "2"),
    ("bert-base-uncased", "--gpu", "V100-16GB", "--precision", "16-mixed"),
    ("cs336-2.7b", "--gpu", "H100-80GB", "--precision", "bf16-mixed", "--seq-len", "1024"),
    ("llama-3.1-70b", "--gpu", "H200", "--tensor-parallel-size", "8", "--seq-len", "4096"),
    ("dinov2-large", "--gpu", "L4", "--precision", "bf16-mixed"),
    ("llama-3.2-3b", "--gpu", "RTX-4090", "--lora-rank", "8", "--seq-len", "2048"),
    ("llama-3.1-8b", "--gpu", "A100-40GB", "--pipeline-parallel-size", "4"),
)
"""Arguments after ``trainmem plan``: one each per model family, GPU size and setting the
planner's path treats differently (LoRA / QLoRA, ZeRO, tensor and pipeline parallelism,
checkpointing, a vision encoder, token granularity)."""

TIMED: tuple[str, ...] = CONFIGURATIONS[0]
"""README's speed block's ``plan`` line (``cli_speed.py``)."""


def _run(src: Path, args: list[str], env: dict[str, str]) -> str:
    """The command's stdout (and exit status) with ``src`` first on the path."""
    done = subprocess.run(
        [sys.executable, "-m", "trainmem", *args],
        capture_output=True,
        text=True,
        check=False,
        env={**env, "PYTHONPATH": str(src), "COLUMNS": "160"},
    )
    return f"exit {done.returncode}\n{done.stdout}{done.stderr}"


def main(base: Path, runs: int) -> int:
    """Compare and time; 1 when an output differs."""
    new = Path(__file__).resolve().parents[1] / "src"
    print(machine())
    print(f"base {base}\nnew  {new}")
    differ = 0
    with tempfile.TemporaryDirectory(prefix="trainmem-pycache-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        # each tree's bytecode apart, written by the comparison's runs before any is timed
        trees = {n: {**env, "PYTHONPYCACHEPREFIX": str(Path(cache) / n)} for n in ("base", "new")}
        for config in CONFIGURATIONS:
            for json_flag in (["--json"], []):
                args = ["plan", *config, *json_flag]
                outs = [_run(src, args, trees[n]) for n, src in (("base", base), ("new", new))]
                same = outs[0] == outs[1]
                differ += not same
                print(f"{'same' if same else 'DIFFERS'}: trainmem {' '.join(args)}")
                if not same:  # the first lines that differ, base then new
                    lines = difflib.unified_diff(*(o.splitlines() for o in outs), n=0)
                    print("\n".join(list(lines)[:12]))
        cpu: dict[str, list[float]] = {"base": [], "new": []}
        argv = [sys.executable, "-m", "trainmem", "plan", *TIMED]
        for _ in range(runs):  # alternately: both trees see the same machine state
            for name, src in (("base", base), ("new", new)):
                c, _wall = child_cpu_seconds(argv, {**trees[name], "PYTHONPATH": str(src)})
                cpu[name].append(c)
    label = " ".join(TIMED)
    for name in ("base", "new"):
        xs = cpu[name]
        runs_text = ", ".join(f"{x:.3f}" for x in xs)
        print(f"{name}: trainmem plan {label}: {statistics.median(xs):.3f} s CPU [{runs_text}]")
    print(f"{differ} of {2 * len(CONFIGURATIONS)} outputs differ")
    return 1 if differ else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1]).resolve(), int(sys.argv[2]) if len(sys.argv) > 2 else 7))
