"""peft ``modules_to_save`` (``--lora-modules-to-save``) on the generic path, which runs peft
0.21.2's own ``LoraConfig(modules_to_save=[...])`` on the transformers model, against the
formulas (Note [peft modules_to_save] in ``analytic/tensor_states.py``; bytes by hand in
tests/analytic/test_modules_to_save.py): the 2-layer 2048-wide agreement Llama
(tests/models/agreement/llama_h2048.json) with a 32,000-token vocabulary, LoRA r 16 on q, v, at
2 x 256 tokens, within 1 % (issue 26's agreement bar)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

pytest.importorskip("transformers")
pytest.importorskip("peft")

TOLERANCE = 0.01
CONFIG = {
    **json.loads((MODELS_DIR / "agreement" / "llama_h2048.json").read_text()),
    "vocab_size": 32_000,
}
VH = 32_000 * 2_048
BOTH = ("embed_tokens", "lm_head")


def _run(tmp_path: Path, tied: bool, engine: str, **settings: Any) -> Any:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "tie_word_embeddings": tied}))
    training = TrainingConfig(
        micro_batch_size=2, seq_len=256, lora_rank=16, lora_targets=("q", "v"), **settings
    )
    return estimate(str(path), training, engine=engine, simulate_allocator=False).breakdown


def test_peft_holds_a_trained_copy_beside_each_frozen_original(tmp_path: Path) -> None:
    """The traced peft model's weights: two fp32 V x h deep copies more (4 B x VH each), and at
    the peak (the optimizer step) their fp32 gradients beside the adapters' (half the adapters'
    AdamW bytes: 4 B of gradient to 8 B of moments) and AdamW's two fp32 moments of each
    (peft's ``ModulesToSaveWrapper`` as run, not the formulas)."""
    plain = _run(tmp_path, False, "generic")
    saved = _run(tmp_path, False, "generic", lora_modules_to_save=BOTH)
    assert saved.parameters - plain.parameters == 2 * 4 * VH
    assert saved.gradients == 2 * 4 * VH + plain.optimizer_states // 2
    assert saved.optimizer_states - plain.optimizer_states == 2 * 8 * VH


@pytest.mark.parametrize(
    ("tied", "saved", "settings"),
    [
        (False, BOTH, {}),
        (False, ("embed_tokens",), {}),
        (True, BOTH, {}),
        (True, ("lm_head",), {}),
        (
            False,
            BOTH,
            {
                "framework": "hf-trainer",
                "precision": "bf16-mixed",
                "load_dtype": "bfloat16",
                "activation_checkpointing": "full",
                "gradient_accumulation_steps": 4,
            },
        ),
        (
            False,
            BOTH,
            {
                "framework": "deepspeed",
                "zero_stage": 2,
                "data_parallel_size": 4,
                "gradient_accumulation_steps": 4,
            },
        ),
        (False, BOTH, {"framework": "hf-trainer", "data_parallel_size": 2}),
        (False, BOTH, {"framework": "hf-trainer", "quantize_base": "nf4-dq"}),
        (False, BOTH, {"framework": "trl", "quantize_base": "nf4-dq", "trl_version": "0.20.0"}),
    ],
    ids=[
        "untied both",
        "untied embed",
        "tied both",
        "tied head",
        "bf16 hf-trainer ckpt accum",
        "deepspeed zero2 x4 accum",
        "hf-trainer ddp x2",
        "qlora nf4-dq hf-trainer",
        "qlora trl 0.20 bf16 cast",
    ],
)
def test_generic_agrees_with_the_formulas(
    tmp_path: Path, tied: bool, saved: tuple[str, ...], settings: dict[str, Any]
) -> None:
    g = _run(tmp_path, tied, "generic", lora_modules_to_save=saved, **settings)
    a = _run(tmp_path, tied, "analytic", lora_modules_to_save=saved, **settings)
    gap = g.allocated_bytes / a.allocated_bytes - 1
    assert abs(gap) <= TOLERANCE, f"{gap:+.2%}"
