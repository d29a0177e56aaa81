"""accelerate ``estimate-memory``: "Training using Adam (Peak vRAM)" for one row.

The CLI resolves Hub ids only: ``create_empty_model`` calls ``huggingface_hub.model_info`` before
reading any config, so it cannot take a local ``config.json`` and cannot run offline (checked on
every run below and reported in ``notes``). The figure is therefore computed by the CLI's own
code after that lookup: ``AutoModel.from_config`` in float32 under ``init_empty_weights`` (what
``create_empty_model`` builds for a ``transformers`` repo without ``auto_map``), then
``calculate_maximum_sizes`` and ``estimate_training_usage``, and the max over its stages, as
``estimate_command`` prints. Batch size, sequence length and checkpointing are not inputs.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import Answer, build_meta_model, common_limits, serve  # noqa: E402

_DTYPE = {"32-true": "float32", "16-mixed": "float16", "bf16-mixed": "bfloat16"}


def cli_accepts_local_config(config: dict[str, Any]) -> str:
    """Try the CLI's loader on a local folder holding ``config.json``; say what happened."""
    from accelerate.commands.estimate import create_empty_model

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        try:
            create_empty_model(tmp, library_name="transformers")
        except Exception as exc:  # noqa: BLE001
            return f"rejected a local config folder: {type(exc).__name__}: {str(exc)[:160]}"
    return "accepted a local config folder"


def answer(req: dict[str, Any]) -> Answer:
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes

    training = req["training"]
    why = common_limits(training, tool="accelerate")
    if why:
        return {"cannot_express": why}
    if training.get("data_parallel_size", 1) > 1:
        return {"cannot_express": "accelerate estimate-memory has no ZeRO/FSDP sharding"}
    dtype = _DTYPE.get(training.get("precision", "bf16-mixed"))
    if dtype is None:
        return {
            "cannot_express": f"no {training['precision']} training in estimate_training_usage "
            "(its 16-bit path assumes an fp32 master copy)"
        }
    model = build_meta_model(req["config"], base_model=True)
    total_size, _largest = calculate_maximum_sizes(model)
    stages = estimate_training_usage(total_size, dtype)
    return {"predicted_bytes": int(max(stages.values()))}


if __name__ == "__main__":
    # One probe of the CLI's loader on a small config, reported with the results.
    probe = cli_accepts_local_config(
        {"model_type": "gpt2", "n_layer": 1, "n_embd": 64, "n_head": 2, "vocab_size": 128}
    )
    serve(
        "accelerate estimate-memory",
        "accelerate",
        answer,
        notes=[
            f"CLI loader (create_empty_model) {probe}; figures use its own "
            "calculate_maximum_sizes + estimate_training_usage on AutoModel built locally"
        ],
    )
