"""A frozen bitsandbytes 4-bit down projection's backward before the non-reentrant recompute,
and what the recompute holds at its up projection (Note [A frozen 4-bit down projection before
the recompute]: analytic/backward_transients.py; Note [The recompute's tensors held at the up
projection]: analytic/forward_transients.py; the ``layer.mlp.down_backward`` point and
``_recompute_up`` of analytic/schedule.py).

Hand derivation on the agreement model (2-layer 2048-wide Llama, i = 5,632, 2 x 256 = 512
tokens), nf4 LoRA on q / v, full checkpointing, transformers 5 (non-reentrant):

* under bf16 autocast, peft's ``prepare_model_for_kbit_training`` keeps the stream in fp32
  (r = 4, c = 2): the MLP's input x = 4 x 512 x 2048 = 4,194,304 B, its bf16 cast for up's
  matmul 2 x 512 x 2048 = 2,097,152 B; the residual is the second RMSNorm's saved input
  (``x.to(float32)`` returns x itself), so it is no tensor of its own;
* bf16-true (transformers' FSDP-QLoRA under accelerate, r = c = 2): x 2,097,152 B and the
  residual 2,097,152 B (the norm saves its fp32 copy, not the residual); no cast.

Down's input gradient is c t i = 2 x 512 x 5632 = 5,767,168 B; the dequantized weight of an MLP
linear 2 x 5632 x 2048 = 23,068,672 B.
"""

from __future__ import annotations

from typing import Any

from conftest import MODELS_DIR, layer_bodies
from trainmem.analytic.activations import activation_profile
from trainmem.analytic.backward_transients import (
    down_backward_before_recompute,
    recompute_runs_down_forward,
)
from trainmem.analytic.forward_transients import recompute_up_held_bytes
from trainmem.analytic.transforms.checkpointing import first_norm_saves_its_input
from trainmem.estimate import estimate, resolve_model
from trainmem.specs.training import TrainingConfig

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
T, H, INTER = 2 * 256, 2048, 5632
NF4_FULL: dict[str, Any] = {
    "lora_rank": 16,
    "quantize_base": "nf4",
    "activation_checkpointing": "full",
}
# transformers' FSDP-QLoRA under accelerate: the model in bf16 (no fp32 upcast by peft)
BF16_TRUE = {
    **NF4_FULL,
    "precision": "bf16-true",
    "data_parallel_size": 4,
    "zero_stage": 3,
    "framework": "accelerate-fsdp",
}


def _training(**settings: Any) -> TrainingConfig:
    return TrainingConfig(micro_batch_size=2, seq_len=256, **settings)


def _held(**settings: Any) -> list[int]:
    training, model = _training(**settings), resolve_model(AGREEMENT)
    terms = activation_profile(model, training).terms
    saves = first_norm_saves_its_input(model, training)
    return recompute_up_held_bytes(model, training, terms, input_saved=saves)


def test_held_tensors_at_the_recomputed_up_projection() -> None:
    assert _held(**NF4_FULL) == [4 * T * H, 2 * T * H]  # x (fp32 stream), its bf16 cast
    assert _held(**BF16_TRUE) == [2 * T * H, 2 * T * H]  # x, the residual


def test_which_layers_run_down_backward_first() -> None:
    assert down_backward_before_recompute(_training(**NF4_FULL))
    assert down_backward_before_recompute(_training(**{**NF4_FULL, "quantize_base": "nf4-dq"}))
    # peft's adapter on down saves its input through the hooks: the recompute runs first
    targets = ("q", "v", "down")
    assert not down_backward_before_recompute(_training(**NF4_FULL, lora_targets=targets))
    # GPTQ's triton kernel and int8's MatMul8bitLt save through save_for_backward
    for base in ("gptq-int4", "int8"):
        assert not down_backward_before_recompute(_training(**{**NF4_FULL, "quantize_base": base}))
    # transformers 4's reentrant checkpoint recomputes the whole layer first
    assert not down_backward_before_recompute(_training(**NF4_FULL, checkpoint_reentrant=True))
    assert not down_backward_before_recompute(_training(lora_rank=16, quantize_base="nf4"))
    # fsdp_qlora's train.py wraps each layer in a reentrant checkpoint unless told otherwise
    fsdp_qlora = {**NF4_FULL, "data_parallel_size": 4, "zero_stage": 3, "framework": "fsdp-qlora"}
    assert not down_backward_before_recompute(_training(**fsdp_qlora))
    assert down_backward_before_recompute(_training(**fsdp_qlora, checkpoint_reentrant=False))


def _recomputed_layer(**settings: Any) -> list[Any]:
    est = estimate(AGREEMENT, _training(**settings), engine="analytic", simulate_allocator=False)
    return layer_bodies(est.schedules[0].step, marker="up_held/0")[-1]


def test_down_backward_then_the_recompute_peaks_at_up() -> None:
    body = _recomputed_layer(**NF4_FULL)
    keys = [(op.action, op.key) for op in body]
    # down's input gradient is made beside down's dequantized weight, before any recomputed
    # block, and stays
    grad = keys.index(("alloc", "mlp_tmp"))
    first_dequant = keys.index(("alloc", "dequant"))
    assert first_dequant < grad < keys.index(("free", "dequant"))
    assert body[grad].size_bytes == 2 * T * INTER
    recomputed = [k for k, (a, key) in enumerate(keys) if a == "alloc" and key.startswith("re/")]
    assert recomputed and grad < min(recomputed)
    # the recompute's dequantization with the held tensors around it, every recomputed block
    # alive; no weight gradient for the frozen down projection
    held = [op for op in body if op.action == "alloc" and op.key.startswith("up_held/")]
    assert [op.size_bytes for op in held] == [4 * T * H, 2 * T * H]
    second = [k for k, (a, key) in enumerate(keys) if (a, key) == ("alloc", "dequant")][1]
    assert body[second].size_bytes == 2 * INTER * H
    assert max(recomputed) < second
    assert all(keys.index(("alloc", op.key)) < second < keys.index(("free", op.key)) for op in held)
    assert ("alloc", "mlp_tmp/weight") not in keys


def test_bf16_true_holds_the_residual() -> None:
    held = [
        op.size_bytes
        for op in _recomputed_layer(**BF16_TRUE)
        if op.action == "alloc" and op.key.startswith("up_held/")
    ]
    assert held == [2 * T * H, 2 * T * H]


def test_a_gptq_recompute_peaks_at_down_with_the_forward_set_held() -> None:
    """Note [The recompute's tensors held at the down projection]: GPTQ's backward unpacks its
    packed tensors first, so the recompute runs through down's forward and holds, at down's
    dequantization: down's output c t h, its input act(gate) * up c t i, the MLP's input x
    r t h and the residual r t h (the model in fp16 / bf16: r = c = 2)."""
    gptq = {**NF4_FULL, "quantize_base": "gptq-int4", "data_parallel_size": 4,
            "zero_stage": 3, "framework": "accelerate-fsdp"}  # fmt: skip
    for precision in ("16-mixed", "bf16-true"):
        body = _recomputed_layer(**gptq, precision=precision)
        keys = [(op.action, op.key) for op in body]
        held = [op for op in body if op.action == "alloc" and op.key.startswith("up_held/")]
        assert [op.size_bytes for op in held] == [2 * T * H, 2 * T * INTER, 2 * T * H, 2 * T * H]
        dequant = [k for k, (a, key) in enumerate(keys) if (a, key) == ("alloc", "dequant")][0]
        assert body[dequant].size_bytes == 2 * INTER * H
        assert all(keys.index(("alloc", op.key)) < dequant < keys.index(("free", op.key))
                   for op in held)  # fmt: skip
    model = resolve_model(AGREEMENT)
    assert recompute_runs_down_forward(model, _training(**gptq))
    # a LoRA adapter on down saves its input through the hooks; bitsandbytes runs down first;
    # a reentrant checkpoint recomputes the whole layer first
    lora_on_down = _training(**gptq, lora_targets=("q", "v", "down"))
    assert not recompute_runs_down_forward(model, lora_on_down)
    assert not recompute_runs_down_forward(model, _training(**NF4_FULL))
    assert not recompute_runs_down_forward(model, _training(**gptq, checkpoint_reentrant=True))
