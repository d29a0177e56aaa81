#!/usr/bin/env bash
# Create benchmarks/.peers-venv with the peer estimators at their current PyPI versions.
#
# Usage: bash benchmarks/peers/setup_venv.sh [VENV_DIR]
# Idempotent: an existing venv is reused and the peers upgraded to their latest releases.
# torch is installed first (the peers import it; the CPU wheel is enough: every peer here is
# arithmetic or builds models on the meta device). DeepSpeed is installed without building
# its CUDA ops (DS_BUILD_OPS=0) and without build isolation, since its setup.py imports torch.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${1:-$here/../.peers-venv}"
python="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --upgrade pip setuptools wheel
"${pip[@]}" torch==2.13.0
"${pip[@]}" --upgrade accelerate transformers
# llm-analysis 0.2.2 pins huggingface-hub<0.15, which would drag accelerate and transformers back
# to 2023 releases; the adapter builds its ModelConfig from a local config and never touches the
# hub, so install it without its pins (fire is the only other dependency it imports).
"${pip[@]}" --upgrade --no-deps llm-analysis
"${pip[@]}" "fire>=0.5,<0.6"
DS_BUILD_OPS=0 DS_SKIP_CUDA_CHECK=1 "${pip[@]}" --upgrade --no-build-isolation deepspeed
"$venv/bin/python" - <<'PY'
from importlib.metadata import version
for name in ("torch", "accelerate", "transformers", "deepspeed", "llm-analysis"):
    print(f"{name}=={version(name)}")
PY
