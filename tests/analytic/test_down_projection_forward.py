"""A quantized base's forward dequantization at the MLP's down projection, beside what the
forward's code still holds there (Note [Forward tensors held at the down projection]:
analytic/forward_transients.py, the ``layer.mlp.forward`` point of analytic/schedule.py).

Hand derivation on the agreement model (2-layer 2048-wide Llama, i = 5,632, 2 x 256 = 512
tokens), accelerate FSDP1 over 4 ranks, bf16-true (c = r = 2 B), nf4 LoRA on q / v
(bitsandbytes 0.45: ``MatMul4Bit`` saves no input, so neither the MLP's input nor
``act(gate) * up`` is saved):
down's output 2 x 512 x 2048 = 2,097,152 B; its input 2 x 512 x 5632 = 5,767,168 B; the MLP's
input, the residual and the layer's input 2,097,152 B each; from layer 1 on the embeddings'
output (``inputs_embeds``) 2,097,152 B too. The dequantized down weight is 2 x 5632 x 2048 =
23,068,672 B.
"""

from __future__ import annotations

from conftest import MODELS_DIR, layer_bodies
from trainmem.analytic.activations import activation_profile
from trainmem.analytic.forward_transients import down_projection_held_bytes
from trainmem.analytic.transforms.checkpointing import first_norm_saves_its_input
from trainmem.estimate import estimate, resolve_model
from trainmem.specs.training import TrainingConfig

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
T, H, INTER = 2 * 256, 2048, 5632
# transformers' FSDP-QLoRA under accelerate: the model in bf16 (no fp32 upcast by peft)
QLORA = {
    "lora_rank": 16,
    "quantize_base": "nf4",
    "precision": "bf16-true",
    "data_parallel_size": 4,
    "zero_stage": 3,
    "framework": "accelerate-fsdp",
}


def _held(first_layer: bool, **changes: object) -> list[int]:
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **changes)  # type: ignore[arg-type]
    model = resolve_model(AGREEMENT)
    terms = activation_profile(model, training).terms
    return down_projection_held_bytes(
        model,
        training,
        terms,
        input_saved=first_norm_saves_its_input(model, training),
        first_layer=first_layer,
        has_embedding=True,
    )


def test_held_tensors_of_a_bf16_qlora_layer() -> None:
    out, product, x, residual, layer_input, embeds = 2 * T * H, 2 * T * INTER, *[2 * T * H] * 4
    assert _held(False, **QLORA) == [out, product, x, residual, layer_input, embeds]
    # the first layer's input is the embeddings' output: one tensor
    assert _held(True, **QLORA) == [out, product, x, residual, layer_input]
    # under full checkpointing the checkpoint keeps the layer's input (and layer 0's, which
    # is the embeddings' output); nothing inside the layer is saved
    full = {**QLORA, "activation_checkpointing": "full"}
    assert _held(False, **full) == [out, product, x, residual]


def test_inputs_saved_by_adapters_are_left_out() -> None:
    # LoRA on every linear: gate's / up's lora_A save the MLP's input, down's its product
    targets = ("q", "k", "v", "o", "gate", "up", "down")
    everywhere = {**QLORA, "lora_targets": targets}
    assert _held(False, **everywhere) == [2 * T * H] * 4  # out, residual, input, inputs_embeds


def test_forward_peak_is_the_down_projection_with_its_held_tensors() -> None:
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **QLORA)  # type: ignore[arg-type]
    est = estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)
    body = layer_bodies(est.schedules[0].step, marker="down_held/0")[-1]
    keys = [(op.action, op.key) for op in body]
    held = [op for op in body if op.action == "alloc" and op.key.startswith("down_held/")]
    assert [op.size_bytes for op in held] == [2 * T * H, 2 * T * INTER] + [2 * T * H] * 4
    dequant = [k for k, op in enumerate(body) if op.key == "dequant" and op.action == "alloc"]
    assert [body[k].size_bytes for k in dequant] == [2 * INTER * H] * 2
    down = dequant[-1]
    # every saved block and every held tensor is alive when down's weight is made
    saved = [k for k, (action, key) in enumerate(keys) if action == "alloc" and "act/" in key]
    assert max(saved) < down
    assert all(keys.index(("alloc", op.key)) < down < keys.index(("free", op.key)) for op in held)
    # and that is the step's peak: layer 1's forward (the backward's loss peak is lower)
    peak = est.schedules[0].peak()
    assert (peak.phase, peak.label) == ("forward", "a dequantized base weight")


def test_gptq_saves_no_input_so_its_layer_holds_both_at_the_down_projection() -> None:
    """GPTQ's trainable kernel (triton v2: ``QuantLinearFunction.forward`` saves qweight,
    scales, qzeros and g_idx only) keeps neither the MLP's input nor down's: with LoRA on q / v
    under bf16 autocast over the 16-bit model (c = r = 2) both are unsaved tensors at the down
    projection, as under bitsandbytes 0.45."""
    gptq = {"lora_rank": 16, "quantize_base": "gptq-int4"}
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **gptq)  # type: ignore[arg-type]
    assert not training.quantized_matmul_saves_input
    terms = activation_profile(resolve_model(AGREEMENT), training).terms
    assert (terms["mlp/input"], terms["mlp/down_input"]) == (0, 0)
    out, product, x, residual, layer_input, embeds = 2 * T * H, 2 * T * INTER, *[2 * T * H] * 4
    assert _held(False, **gptq) == [out, product, x, residual, layer_input, embeds]


def test_frozen_embeddings_output_is_held_though_the_norm_would_save_its_input() -> None:
    """32-true (c = r = 4 B): the first norm saves its input as itself (``x.to(float32)`` is the
    input), so a fully trained model's ``inputs_embeds`` is layer 0's saved input. Under LoRA
    the embeddings are frozen and torch saves nothing for an input that needs no grad (a real
    CPU run, transformers 5.24 + peft 0.21.2: ``inputs_embeds`` is never among the saved
    tensors), so from layer 1 on it is held at the down projection, 4 x 512 x 2048 B. Beside
    it (LoRA on q / v): down's output, its input (a frozen down saves none) and the MLP's input
    (frozen gate / up save none); fully trained, only down's output (the rest saved)."""
    out, product, x, embeds = 4 * T * H, 4 * T * INTER, 4 * T * H, 4 * T * H
    assert _held(False, lora_rank=16, precision="32-true") == [out, product, x, embeds]
    assert _held(True, lora_rank=16, precision="32-true") == [out, product, x]
    assert _held(False, precision="32-true") == [out]
