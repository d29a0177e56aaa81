"""Note [transformers 4 expert loop]: transformers 4.48.0 modeling_mixtral.py
``MixtralSparseMoeBlock`` runs its experts one at a time, each a frozen
``w2(act(w1(x)) * w3(x))``. Bytes derived by hand from that code for Mixtral-8x7B (h 4096,
i 14336, 8 experts, top-2) at 4096 tokens, QLoRA on q/k/v/o under bf16 autocast with peft's fp32
upcast (residual stream r = 4 B; bitsandbytes' ``Linear4bit`` casts its output back to its
fp32 input, o = 4 B), bitsandbytes 0.43.3 (``MatMul4Bit`` saves no input)."""

from __future__ import annotations

from trainmem.analytic.activations import layer_activation_terms
from trainmem.analytic.backward_transients import backward_layer_transients
from trainmem.analytic.mlp import expert_loop
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

T = 4096
PAIRS = 2 * T  # top-2 routing
H, FFN, E = 4096, 14336, 8

QLORA = {
    "micro_batch_size": 1,
    "seq_len": T,
    "precision": "bf16-mixed",
    "lora_rank": 16,
    "lora_targets": ("q", "k", "v", "o"),
    "quantize_base": "nf4-dq",
    "framework": "hf-trainer",
    "bitsandbytes_version": "0.43.3",
}


def _training(**kw: object) -> TrainingConfig:
    return TrainingConfig(**{**QLORA, **kw})  # type: ignore[arg-type]


def test_saved_tensors_of_the_expert_loop_by_hand() -> None:
    mixtral = load_model_spec("mixtral-8x7b")
    training = _training(transformers_version="4.48.1")
    assert expert_loop(mixtral, training)
    terms = layer_activation_terms(mixtral, training)
    # fp32 softmax over 8 experts, top-2 values (fp32) and indices (int64), per token
    assert terms["mlp/router"] == (4 * 8 + 12 * 2) * T
    # w1's output, SiLU's output and w3's output, fp32 (Linear4bit's out.to(inp_dtype))
    assert terms["mlp/gated"] == 3 * 4 * FFN * PAIRS == 1_409_286_144
    # w2's output saved by the routing-weight product, the fp32 routing weight, two int64 indices
    assert terms["mlp/expert_outputs"] == (4 * H + 4 + 16) * PAIRS == 134_381_568
    # no gathered expert input and no down-projection input outlive the loop
    assert "mlp/expert_inputs" not in terms and "mlp/down_input" not in terms


def test_backward_runs_one_expert_at_a_time() -> None:
    mixtral = load_model_spec("mixtral-8x7b")
    mlp, _, _ = backward_layer_transients(mixtral, _training(transformers_version="4.48.1"))
    # one expert's share of the pairs (8192 / 8) in fp32: output and input gradients (2h) and
    # the w2-input / product-operand gradients (3i); plus the block input's fp32 gradient
    assert mlp == 4 * (2 * H + 3 * FFN) * (PAIRS // E) + 4 * H * T == 276_824_064


def test_the_rule_applies_only_where_its_source_does() -> None:
    mixtral = load_model_spec("mixtral-8x7b")
    assert not expert_loop(mixtral, _training(transformers_version="5.0"))  # grouped experts
    assert not expert_loop(
        mixtral, _training(transformers_version="4.48.1", lora_targets=("gate",))
    )
    # bitsandbytes before 0.43.2 keeps every 4-bit matmul's input: not this rule
    assert not expert_loop(
        mixtral, _training(transformers_version="4.48.1", bitsandbytes_version="0.43.0")
    )
    assert not expert_loop(load_model_spec("llama-2-7b"), _training(transformers_version="4.48.1"))
