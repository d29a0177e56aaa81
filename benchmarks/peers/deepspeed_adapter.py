"""DeepSpeed's ZeRO model-state estimators for one row (GPU bytes per GPU).

``estimate_zero2_model_states_mem_needs`` (stage 0-2; one GPU: nothing is partitioned) and
``estimate_zero3_model_states_mem_needs`` (stage 3), the arithmetic behind the
``*_all_cold`` / ``*_all_live`` printers, fed with the parameter count and largest layer of the
row's model built on ``meta`` (what ``*_all_live`` counts). Model states only: no activations.
The formulas assume fp16 mixed-precision Adam; other precisions, optimizers and LoRA (frozen
parameters are counted as trained, DeepSpeed #5304) cannot be expressed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from _common import Answer, build_meta_model, common_limits, serve  # noqa: E402


def answer(req: dict[str, Any]) -> Answer:
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    training = req["training"]
    why = common_limits(training, tool="DeepSpeed")
    if why:
        return {"cannot_express": why}
    if training.get("precision") not in ("16-mixed", "bf16-mixed"):
        return {
            "cannot_express": "the estimators assume fp16 mixed precision; row is "
            f"{training.get('precision')}"
        }
    model = build_meta_model(req["config"])
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    n = training.get("data_parallel_size", 1)
    offload = training.get("offload", "none")
    if training.get("zero_stage", 0) == 3:
        _cpu, gpu, _largest_mem = estimate_zero3_model_states_mem_needs(
            total,
            largest,
            num_gpus_per_node=n,
            num_nodes=1,
            cpu_offload=offload != "none",
            cpu_offload_params=offload == "optimizer+params",
            zero_init=True,
        )
    else:
        _cpu, gpu = estimate_zero2_model_states_mem_needs(
            total, num_gpus_per_node=n, num_nodes=1, cpu_offload=offload != "none"
        )
    return {"predicted_bytes": int(gpu)}


if __name__ == "__main__":
    serve(
        "DeepSpeed ZeRO estimators",
        "deepspeed",
        answer,
        notes=["model states only (fp16 mixed Adam); stage 0-2 rows use the ZeRO-2 formula"],
    )
