"""The MLP's backward transients linear by linear (Note [An MLP's backward, linear by linear],
analytic/backward_transients.py; issue 26: pipeline parallelism on the agreement model was
-1.3 % off the trace, the formulas above it).

Hand derivation on the agreement model (h = 2048, i = 5632, gated; b 2 x s 256: t = 512
tokens; bf16 autocast, c = 2): at the down projection's backward the trace holds its input
gradient c t i = 5,767,168 B and its 16-bit weight gradient c h i = 23,068,672 B, then the
fp32 cast (4 h i = 46,137,344 B); the product's backward then adds two more c t i
(11,534,336 B) once the weight gradient is gone.
"""

from __future__ import annotations

from conftest import MODELS_DIR, layer_bodies
from trainmem.analytic.backward_transients import MlpBackwardParts, mlp_backward_parts
from trainmem.estimate import estimate, resolve_model
from trainmem.specs.training import TrainingConfig

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
T, H, N_I = 512, 2048, 5632


def _training(**changes: object) -> TrainingConfig:
    return TrainingConfig(micro_batch_size=2, seq_len=256, **changes)  # type: ignore[arg-type]


def test_parts_by_hand() -> None:
    parts = mlp_backward_parts(resolve_model(AGREEMENT), _training())
    assert parts == MlpBackwardParts(2 * T * N_I, 2 * H * N_I, 2 * 2 * T * N_I)
    # bf16-true: no autocast cast, the weight gradient is the .grad itself
    true16 = mlp_backward_parts(resolve_model(AGREEMENT), _training(precision="bf16-true"))
    assert true16 == MlpBackwardParts(2 * T * N_I, 0, 2 * 2 * T * N_I)
    # frozen linears (LoRA's base) make no weight gradient
    lora = mlp_backward_parts(resolve_model(AGREEMENT), _training(lora_rank=8))
    assert lora == MlpBackwardParts(2 * T * N_I, 0, 2 * 2 * T * N_I)
    # ... split too when the layer is recomputed under autocast, where the recompute's own
    # tensors are modelled (Note [The recompute's tensors held at an autocast down projection])
    full = _training(lora_rank=8, activation_checkpointing="full")
    assert mlp_backward_parts(resolve_model(AGREEMENT), full) == lora
    # ... but keep the one block where they are not (the Note's last paragraph): no autocast
    full16 = _training(lora_rank=8, activation_checkpointing="full", precision="bf16-true")
    assert mlp_backward_parts(resolve_model(AGREEMENT), full16) is None


def test_a_quantized_down_projection_dequantizes_beside_its_input_gradient() -> None:
    """GPTQ's triton kernel (fms-acceleration gptqmodel triton_utils/dequant.py
    ``QuantLinearFunction.backward``) and bitsandbytes' ``MatMul4Bit.backward`` dequantize the
    weight (c h i: 2 x 2048 x 5632 = 23,068,672 B) for ``grad_output @ W``, the input gradient
    (c t i = 5,767,168 B) made beside it, and free it on return: the product's two c t i come
    after, without it; no weight gradient."""
    training = _training(lora_rank=16, quantize_base="gptq-int4")
    est = estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)
    body = layer_bodies(est.schedules[0].step)[0]
    keys = [(op.action, op.key) for op in body]
    dequant = [op for op in body if op.key == "dequant" and op.action == "alloc"]
    assert [op.size_bytes for op in dequant] == [2 * H * N_I]  # none at layer.backward
    made, grad, gone = (
        keys.index(("alloc", "dequant")),
        keys.index(("alloc", "mlp_tmp")),
        keys.index(("free", "dequant")),
    )
    assert made < grad < gone < keys.index(("alloc", "mlp_tmp/act"))
    assert [op.size_bytes for op in body if op.key.startswith("mlp_tmp")][:2] == [
        2 * T * N_I,
        2 * 2 * T * N_I,
    ]
    assert ("alloc", "mlp_tmp/weight") not in keys


def test_weight_gradient_is_gone_before_the_product_backward() -> None:
    """The stage-0 peak of PP 2 (accumulation 4) sits at the down projection's fp32 cast:
    c t i + c h i + 4 h i of temporaries made there, not 3 c t i + c h i + 4 h i."""
    training = _training(pipeline_parallel_size=2, gradient_accumulation_steps=4)
    est = estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)
    events = est.schedules[0].expand().events
    live: dict[int, int] = {}
    peak, at_peak = 0, {}
    for ev in events:
        if ev.action == "alloc":
            live[ev.block_id] = ev.size_bytes
        else:
            live.pop(ev.block_id)
        if sum(live.values()) > peak:
            peak, at_peak = sum(live.values()), dict(live)
    sizes = sorted(at_peak.values(), reverse=True)
    assert 4 * H * N_I in sizes and 2 * H * N_I in sizes  # the cast and the 16-bit gradient
    temps = {
        ev.block_id: ev.size_bytes
        for ev in events
        if ev.action == "alloc" and ev.module == "layers.0" and ev.category.value == "temporary"
    }
    held = sorted(size for bid, size in at_peak.items() if bid in temps)
    # the down projection's input gradient alone of the i-sized ones
    assert held.count(2 * T * N_I) == 1
    assert 3 * 2 * T * N_I + 2 * H * N_I not in held
