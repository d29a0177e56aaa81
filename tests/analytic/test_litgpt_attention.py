"""litgpt's own attention in the formulas (issue 26; found by tracing litgpt 0.5.13's GPT on the
generic path, trainmem/trace/litgpt_model.py).

litgpt/model.py v0.5.13 ``CausalSelfAttention.forward`` (lit-gpt @8641822 alike):
``qkv = self.qkv(x)`` (one fused linear), ``q = torch.cat((q_roped, q[..., rope_n_elem:]))``
((b, a, s, d)-contiguous), ``y = self.scaled_dot_product_attention(q, k, v, mask)`` (returns
``y.transpose(1, 2)``), ``y = y.reshape(B, T, head_size * n_head)``, ``self.proj(y)``.

Expected by hand on the 2-layer formula Qwen2 (h = 64, a = 4 heads of d = 16, Llama-style
separate q / k / v in transformers, no rotary ``torch.cat`` there), t = 2 x 64 = 128 tokens:
* the flash kernel's output is allocated like q (``empty_like``), so litgpt's reshape copies
  it and ``proj`` saves the copy: c*a*d*t = 2 * 64 * 128 = 16,384 B under bf16-true; none in
  32-true (the memory-efficient kernel allocates (b, s, a, d): the reshape is a view) and none
  for transformers' Qwen2 (its q is a transposed view);
* under bf16-mixed autocast casts the input once for the fused qkv: c*h*t = 16,384 B, where
  transformers' three projections cast it three times (49,152 B).
And the head (Note [litgpt's cast output]): Fabric casts every chunk of the output before the
loop releases the previous micro-batch's logits (sizes in the test). And the norms: from litgpt
0.4.6 a trained RMSNorm multiplies its weight in fp32 and saves the fp32 normalised tensor:
fp32 input 4h + fp32 normalised 4h + fp32 rstd 4 = 516 B per token (66,048 B for 128 tokens)
in bf16-true, where 0.4.0 saved the 16-bit copy (4h + 2h + 4 = 388: 49,664 B); under LoRA the
frozen weight keeps no normalised tensor (4h + 4 = 260: 33,280 B) in either.
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.activations import layer_activation_terms
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

QWEN2 = load_model_spec(str(MODELS_DIR / "formula" / "qwen2.json"))


def _terms(**changes: Any) -> dict[str, int]:
    training = TrainingConfig(micro_batch_size=2, seq_len=64, **changes)
    return layer_activation_terms(QWEN2, training)


@pytest.mark.parametrize(
    ("framework", "precision", "expected"),
    [("litgpt", "bf16-true", 16_384), ("litgpt", "32-true", 0), ("pytorch-amp", "bf16-true", 0)],
)
def test_litgpt_proj_saves_a_copy_of_the_flash_output(
    framework: str, precision: str, expected: int
) -> None:
    terms = _terms(framework=framework, precision=precision)
    assert terms.get("attention/out_proj_input", 0) == expected


@pytest.mark.parametrize(("framework", "expected"), [("litgpt", 16_384), ("pytorch-amp", 49_152)])
def test_autocast_copies_the_input_once_for_litgpt_fused_qkv(framework: str, expected: int) -> None:
    assert _terms(framework=framework, precision="bf16-mixed")["attention/qkv_input"] == expected


def test_fabric_casts_every_chunk_before_the_loop_releases_the_previous_logits() -> None:
    # Note [litgpt's cast output]: GPT.forward returns every 16-bit chunk of the head's output
    # (c V t = 2 * 512 * 128 = 131,072 B in bf16-true) and Fabric's convert_output casts the
    # list to fp32 (4 V t = 262,144 B) before ``logits = model(...)`` rebinds the previous
    # micro-batch's fp32 logits (262,144 B): all three live at once
    from trainmem.breakdown import MemoryCategory as Cat
    from trainmem.estimate import estimate

    training = TrainingConfig(
        micro_batch_size=2, seq_len=64, framework="litgpt", precision="bf16-true",
        lora_rank=8, chunked_cross_entropy=4,
    )  # fmt: skip
    est = estimate(str(MODELS_DIR / "formula" / "qwen2.json"), training, engine="analytic")
    timeline = est.schedules[0].expand()
    events = timeline.events[timeline.steady_state_start :]
    previous = events[0]  # the loop holds it from the micro-batch's start
    assert (previous.action, previous.size_bytes, previous.category) == (
        "alloc", 262_144, Cat.TEMPORARY,
    )  # fmt: skip
    live: dict[int, tuple[int, Cat]] = {}
    for ev in events:
        if ev.action == "free" and ev.block_id == previous.block_id:
            break
        if ev.action == "alloc":
            live[ev.block_id] = (ev.size_bytes, ev.category)
        else:
            live.pop(ev.block_id, None)
    held = sorted(v for v in live.values() if v[0] in (131_072, 262_144))
    assert held == [(131_072, Cat.TEMPORARY), (262_144, Cat.ACTIVATION), (262_144, Cat.TEMPORARY)]


@pytest.mark.parametrize(
    ("version", "lora_rank", "expected"),
    [("0.5.13", 0, 66_048), ("0.4.6", 0, 66_048), ("0.4.0", 0, 49_664), ("0.5.13", 8, 33_280)],
)
def test_litgpt_rmsnorm_saves_its_fp32_product_from_0_4_6(
    version: str, lora_rank: int, expected: int
) -> None:
    terms = _terms(
        framework="litgpt", precision="bf16-true", litgpt_version=version, lora_rank=lora_rank
    )
    assert terms["attention/norm"] == terms["mlp/norm"] == expected


def test_the_head_saves_its_input_and_norm_before_the_loop_rebinds() -> None:
    # full fine-tuning, bf16-true, litgpt 0.5.13: the final norm's fp32 input, fp32 normalised
    # tensor and rstd (4h + 4h + 4 = 516 B per token: 66,048 B), the head's 16-bit input
    # (2h: 16,384 B) and the fp32 output (262,144 B) are saved when Fabric's cast returns,
    # before the loop releases the previous logits
    from trainmem.breakdown import MemoryCategory as Cat
    from trainmem.estimate import estimate

    training = TrainingConfig(
        micro_batch_size=2, seq_len=64, framework="litgpt", precision="bf16-true",
        chunked_cross_entropy=4,
    )  # fmt: skip
    est = estimate(str(MODELS_DIR / "formula" / "qwen2.json"), training, engine="analytic")
    timeline = est.schedules[0].expand()
    events = timeline.events[timeline.steady_state_start :]
    previous = events[0]
    live: dict[int, tuple[str, int, Cat]] = {}
    for ev in events:
        if ev.action == "free" and ev.block_id == previous.block_id:
            break
        if ev.action == "alloc":
            live[ev.block_id] = (ev.module, ev.size_bytes, ev.category)
        else:
            live.pop(ev.block_id, None)
    saved = sorted(
        n for module, n, cat in live.values() if module == "head" and cat == Cat.ACTIVATION
    )
    assert saved == [16_384, 66_048, 262_144]


@pytest.mark.parametrize(("framework", "expected"), [("litgpt", 1), ("pytorch-amp", 0)])
def test_litgpt_loop_binds_the_fp32_logits_through_the_optimizer_step(
    framework: str, expected: int
) -> None:
    # Note [litgpt's bound logits]: the last micro-batch's fp32 logits (4 V t = 4 * 512 * 128
    # B) are alive while the optimizer steps; transformers' loop holds nothing there
    from trainmem.estimate import estimate

    training = TrainingConfig(
        micro_batch_size=2, seq_len=64, framework=framework, precision="bf16-true"
    )
    est = estimate(str(MODELS_DIR / "formula" / "qwen2.json"), training, engine="analytic")
    timeline = est.schedules[0].expand()
    events = timeline.events[timeline.steady_state_start :]
    held = [
        ev
        for ev in events
        if ev.action == "alloc" and ev.phase == "optimizer" and ev.size_bytes == 262_144
    ]
    assert len(held) == expected


@pytest.mark.parametrize(("bnb", "expected"), [("0.42.0", 16_384), ("0.45.0", 0)])
def test_litgpt_quantized_head_saves_its_input_only_before_bnb_0_43_2(
    bnb: str, expected: int
) -> None:
    # litgpt quantizes the output head with every linear; bitsandbytes' MatMul4Bit saved its
    # 16-bit input (c h t = 2 * 64 * 128 B) before 0.43.2 and saves none since
    from trainmem.analytic.head import head_activation_bytes

    training = TrainingConfig(
        micro_batch_size=2, seq_len=64, framework="litgpt", precision="bf16-true",
        lora_rank=8, quantize_base="nf4", bitsandbytes_version=bnb,
    )  # fmt: skip
    assert head_activation_bytes(QWEN2, training).get("lm_head_input", 0) == expected
