"""Two rules checked against the generic path's trace of the real code, tested here by hand on
the 2-layer Qwen2 formula config (tests/models/formula/qwen2.json: h = 64, i = 128, separate
q / k / v, gated MLP) at micro-batch 2 x 64 tokens, t = 128:

- Note [Frozen down projection's input] (analytic/lora.py): with down frozen the product
  act(gate) * up is saved by nothing; gate's, act's and up's outputs stay (3 c i t).
- first_norm_saves_its_input (analytic/transforms/checkpointing.py): under full
  checkpointing the first RMSNorm saves the kept layer input itself only on an fp32 residual
  stream; on a bf16 one its ``x.to(float32)`` is a copy the recomputation makes again.
- Note [Final RMSNorm's backward] (analytic/head.py): five fp32 (tokens x h) transients.
"""

from __future__ import annotations

from typing import Any

from conftest import MODELS_DIR
from trainmem.analytic.transforms.checkpointing import first_norm_saves_its_input
from trainmem.estimate import estimate
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
T, H, FFN = 128, 64, 128


def _estimate(**changes: Any) -> Any:
    training = TrainingConfig(micro_batch_size=2, seq_len=64, **changes)
    return estimate(QWEN2, training, engine="analytic", simulate_allocator=False)


def test_frozen_down_projection_saves_no_product() -> None:
    c = 2  # bf16
    full = _estimate(precision="bf16-true").details["activation_terms_per_layer_bytes"]
    # gate, act and up outputs (3 c i t) and the product down saves (c i t)
    assert (full["mlp/gated"], full["mlp/down_input"]) == (3 * c * FFN * T, c * FFN * T)
    lora = _estimate(precision="bf16-true", lora_rank=8, lora_targets=("q", "v"))
    terms = lora.details["activation_terms_per_layer_bytes"]
    assert (terms["mlp/gated"], terms["mlp/down_input"]) == (3 * c * FFN * T, 0)
    # a targeted down reads its input again (autocast: its own copy), which it saves
    targeted = _estimate(precision="bf16-mixed", lora_rank=8, lora_targets=("q", "v", "down"))
    terms = targeted.details["activation_terms_per_layer_bytes"]
    assert (terms["mlp/gated"], terms["mlp/down_input"]) == (3 * c * FFN * T, c * FFN * T)


def _recomputed_per_layer(est: Any) -> int:
    """Bytes the backward recomputes for one layer (the schedule's ``re/<n>`` blocks)."""
    sizes: dict[str, int] = {}

    def walk(items: tuple[Item, ...]) -> None:
        for x in items:
            if isinstance(x, Repeat):
                walk(x.body)
            elif isinstance(x, Op) and x.action == "alloc" and x.key.startswith("re/"):
                sizes.setdefault(x.key, x.size_bytes)

    walk(est.schedules[0].step)
    return sum(sizes.values())


def test_first_norm_copy_is_recomputed_on_a_16_bit_residual_stream() -> None:
    model = load_model_spec(QWEN2)
    assert first_norm_saves_its_input(model, TrainingConfig(precision="bf16-mixed"))
    assert not first_norm_saves_its_input(model, TrainingConfig(precision="bf16-true"))
    # bf16-true: every saved term is made again, the first norm's fp32 copy (4 h t), its bf16
    # output (saved for the trained weight, 2 h t) and its fp32 rstd (4 t) included
    est = _estimate(precision="bf16-true", activation_checkpointing="full")
    terms = est.details["activation_terms_per_layer_bytes"]
    assert terms["attention/norm"] == (4 * H + 2 * H + 4) * T
    assert _recomputed_per_layer(est) == sum(terms.values())
    # bf16-mixed: the fp32 residual's to(float32) is the kept input itself (4 h t not made
    # again); autocast's weight copies are recomputed under their own keys ("wcopy/re/<n>")
    est = _estimate(precision="bf16-mixed", activation_checkpointing="full")
    terms = est.details["activation_terms_per_layer_bytes"]
    copies = terms["autocast_weight_copies"]
    assert _recomputed_per_layer(est) == sum(terms.values()) - copies - 4 * H * T


def _final_norm_ops(est: Any) -> list[Op]:
    out: list[Op] = []

    def walk(items: tuple[Item, ...]) -> None:
        for x in items:
            if isinstance(x, Repeat):
                walk(x.body)
            elif isinstance(x, Op) and x.key.startswith(("final_norm_tmp/", "act/head/0")):
                out.append(x)

    walk(est.schedules[0].step)
    return out


def test_final_rmsnorm_backward_holds_five_fp32_tensors() -> None:
    # Note [Final RMSNorm's backward] (analytic/head.py): five fp32 (tokens x h) tensors,
    # 4 B x 64 x 128 = 32,768 B each, after the loss's and the LM head's backward, with the
    # norm's saved tensors (head block 0) freed after them
    for precision in ("bf16-true", "bf16-mixed"):
        ops = _final_norm_ops(_estimate(precision=precision))
        tmp = [op for op in ops if op.key.startswith("final_norm_tmp/")]
        assert [op.size_bytes for op in tmp if op.action == "alloc"] == [4 * H * T] * 5
        keys = [(op.action, op.key) for op in ops]
        saved_free = keys.index(("free", "act/head/0"))
        assert all(keys.index(("free", op.key)) < saved_free for op in tmp)
    # LayerNorm's backward is one kernel (GPT-2): no such transients
    gpt2 = estimate("tiny-gpt2-test", TrainingConfig(micro_batch_size=2, seq_len=64),
                    engine="analytic", simulate_allocator=False)  # fmt: skip
    assert not [op for op in _final_norm_ops(gpt2) if op.key.startswith("final_norm_tmp/")]
