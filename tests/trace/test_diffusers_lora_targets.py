"""LoRA targets as diffusers users write them (``--lora-targets to_q,to_k,to_v,to_out.0``;
``trainmem.specs.training.DIFFUSERS_LORA_TARGETS``): peft's suffix match on diffusers' module
names, so FLUX's joint attention keeps its text-stream projections (``add_*_proj``,
``to_add_out``) unadapted, where trainmem's ``q,k,v,o`` adapts them too.

Expected counts: the Hugging Face blog flux-qlora (@2ece681) prints 4,669,440 trainable
parameters for FLUX.1-dev with r 4 on ``to_q``, ``to_k``, ``to_v``, ``to_out.0``; by hand, 3072
wide, 19 double-stream blocks x 4 linears x 4 x (3072 + 3072) + 38 single-stream blocks x 3
(``to_q/k/v``; their output is ``proj_out``) x 4 x (3072 + 3072) = 1,867,776 + 2,801,664."""

from __future__ import annotations

import pytest

from conftest import Invoke
from trainmem.errors import SpecError
from trainmem.specs.training import TrainingConfig

pytest.importorskip("diffusers")


def _trainable(targets: tuple[str, ...]) -> int:
    from trainmem.specs.hf import PRESETS_DIR, load_hf_config
    from trainmem.trace.diffusers_model import build_diffusers_model

    raw = load_hf_config(str(PRESETS_DIR / "flux.1-dev-transformer.json"))
    t = TrainingConfig(lora_rank=4, lora_targets=targets, precision="bf16-mixed")
    model = build_diffusers_model(raw, t)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_diffusers_module_names_leave_joint_attention_text_projections() -> None:
    assert _trainable(("to_q", "to_k", "to_v", "to_out.0")) == 4_669_440
    # q,k,v,o adds add_q/k/v_proj and to_add_out of the 19 double blocks: 4 x 4 x 6144 each
    assert _trainable(("q", "k", "v", "o")) == 4_669_440 + 19 * 4 * 4 * 6144


def test_diffusers_module_names_refused_for_a_language_model(invoke: Invoke) -> None:
    from trainmem.specs.diffusers import check_diffusers_lora_targets

    t = TrainingConfig(lora_rank=8, lora_targets=("to_q", "v"))
    with pytest.raises(SpecError, match="lora_targets: to_q: diffusers module names"):
        check_diffusers_lora_targets({"model_type": "llama"}, t)
    r = invoke("estimate", "gpt2", "--lora-rank", "8", "--lora-targets", "to_q", exit_code=2)
    assert "lora_targets" in r.stderr and "to_q" in r.stderr
