"""peft's adapters' matmuls under op-level selective checkpointing (Note [The adapters' matmuls
under op-level selective checkpointing], analytic/op_selective.py; issue 26).

The agreement model (tests/models/agreement/llama_h2048.json: h = 2048, i = 5632, 16 heads of
128, 4 KV heads: k / v out 512) at 2 x 256 tokens (t = 512), bf16-mixed (2 B matmul outputs,
4 B residual stream), SDPA, r 16. torchtitan's policy caches the 1st, 3rd, ... ``aten.mm`` of
the layer; the order is the layer's code (q, k, v, o, gate, up, down) with each adapted
linear's adapters after its base matmul (peft 0.21.2 tuners/lora/layer.py ``Linear.forward``:
the base, then ``lora_A``, ``lora_B``; DoRA, tuners/lora/dora.py ``DoraLinearLayer.forward``:
the base, ``lora_A`` / ``lora_B`` on ``torch.eye(in)``, then on x).
"""

from __future__ import annotations

from typing import Any

from conftest import MODELS_DIR, layer_bodies
from trainmem.analytic.op_selective import op_selective_cache_uses, op_selective_saved_terms
from trainmem.estimate import estimate
from trainmem.schedule import Op
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
T, H, KV, INTER, HEADS, R = 512, 2048, 512, 5632, 16, 16


def _training(targets: tuple[str, ...], variant: str = "lora", **changes: Any) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=2,
        seq_len=256,
        activation_checkpointing="selective",
        lora_rank=R,
        lora_targets=targets,
        lora_variant=variant,
        **changes,
    )


ALWAYS = {  # the layer input (fp32), the SDPA output (bf16) and its logsumexp (fp32)
    "layer_input": 4 * H * T,
    "attention/sdpa_output": 2 * HEADS * 128 * T,
    "attention/logsumexp": 4 * HEADS * T,
}


def test_dora_on_q_v_caches_the_eye_products() -> None:
    # mm 1 q's base, 2 lora_A(eye) [h, r], 3 lora_B(eye) [h, h], 4 lora_A(x), 5 lora_B(x);
    # 6 k; 7 v's base, 8 / 9 the eye pair ([h, r], [h, 512]), 10 / 11 on x; 12 o; 13 gate;
    # 14 up; 15 down: the odd ones cached
    expected = {
        **ALWAYS,
        "mm/q": 2 * H * T,
        "mm/dora_eye_B/q": 2 * H * H,
        "mm/lora_B/q": 2 * H * T,
        "mm/v": 2 * KV * T,
        "mm/dora_eye_B/v": 2 * H * KV,
        "mm/lora_B/v": 2 * KV * T,
        "mm/gate": 2 * INTER * T,
        "mm/down": 2 * H * T,
    }
    training = _training(("q", "v"), "dora")
    kept = op_selective_saved_terms(load_model_spec(AGREEMENT), training)
    assert kept == expected
    # beyond the base linears' (q, v, gate, down as without adapters): 13,107,200 B, the
    # trace's layer-0 cache (q_proj.lora_B 10,485,760 B, v_proj.lora_B 2,621,440 B)
    bases = 2 * H * T + 2 * KV * T + 2 * INTER * T + 2 * H * T  # q, v, gate, down
    assert sum(kept.values()) - sum(ALWAYS.values()) - bases == 13_107_200
    uses = op_selective_cache_uses(load_model_spec(AGREEMENT), training, kept)
    # the base and B outputs are DoRA's saved base_result / lora_result, the products freed;
    # the untargeted gate's output is the activation's input
    assert uses == {
        "mm/q": "dora/q",
        "mm/dora_eye_B/q": "",
        "mm/lora_B/q": "dora/q",
        "mm/v": "dora/v",
        "mm/dora_eye_B/v": "",
        "mm/lora_B/v": "dora/v",
        "mm/gate": "mlp/gated",
    }


def test_lora_on_all_seven_alternates_through_the_adapters() -> None:
    # three matmuls per linear: q 1-3, k 4-6, v 7-9, o 10-12, gate 13-15, up 16-18, down 19-21
    expected = {
        **ALWAYS,
        "mm/q": 2 * H * T,
        "mm/lora_B/q": 2 * H * T,
        "mm/lora_A/k": 2 * R * T,
        "mm/v": 2 * KV * T,
        "mm/lora_B/v": 2 * KV * T,
        "mm/lora_A/o": 2 * R * T,
        "mm/gate": 2 * INTER * T,
        "mm/lora_B/gate": 2 * INTER * T,
        "mm/lora_A/up": 2 * R * T,
        "mm/down": 2 * H * T,
        "mm/lora_B/down": 2 * H * T,
    }
    training = _training(("q", "k", "v", "o", "gate", "up", "down"))
    kept = op_selective_saved_terms(load_model_spec(AGREEMENT), training)
    assert kept == expected
    uses = op_selective_cache_uses(load_model_spec(AGREEMENT), training, kept)
    # A's output is saved by B's matmul; LoRA's base and B outputs only enter
    # ``result + lora_B(...) * scaling`` (an add and a product with a number save neither),
    # the adapted gate's output included: the activation reads the add
    assert {k: v for k, v in uses.items() if v} == {
        "mm/lora_A/k": "lora/k",
        "mm/lora_A/o": "lora/o",
        "mm/lora_A/up": "lora/up",
    }
    assert {k for k, v in uses.items() if not v} == {
        "mm/q", "mm/lora_B/q", "mm/v", "mm/lora_B/v", "mm/gate", "mm/lora_B/gate",
        "mm/down", "mm/lora_B/down",
    }  # fmt: skip


def test_no_adapter_matmuls_under_compile_or_a_quantized_base() -> None:
    model = load_model_spec(AGREEMENT)
    plain = {**ALWAYS, "mm/q": 2 * H * T, "mm/v": 2 * KV * T, "mm/gate": 2 * INTER * T}
    compiled = op_selective_saved_terms(model, _training(("q", "v"), "dora", compile=True))
    assert compiled == plain  # the min-cut drops o / down's and counts no adapters
    nf4 = op_selective_saved_terms(model, _training(("q", "v"), quantize_base="nf4"))
    assert nf4 == {**plain, "mm/down": 2 * H * T}


def _layer_backward(training: TrainingConfig) -> list[Op]:
    est = estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)
    ops: list[Op] = layer_bodies(est.schedules[0].step)[0]
    return ops


def _at(ops: list[Op], action: str, key: str) -> int:
    return next(n for n, op in enumerate(ops) if op.action == action and op.key == key)


def test_dora_recompute_frees_the_products_and_keeps_the_stand_ins() -> None:
    ops = _layer_backward(_training(("q", "v"), "dora"))
    # the saved blocks act/{i}/<n> in op_selective_saved_terms' order: 3 q's base output, 4
    # q's eye product, 5 q's B output, 6 / 7 / 8 v's
    # the incoming gradient's bf16 cast exists before the recompute (Note [The gradient's cast
    # through the recompute]); the recompute's own tensors come after it
    assert ops[0].action == "alloc" and ops[0].key == "grad_cast"
    first_made = next(
        n for n, op in enumerate(ops) if op.action == "alloc" and op.key != "grad_cast"
    )
    last_recomputed = max(
        n for n, op in enumerate(ops) if op.action == "alloc" and op.key.startswith("re/")
    )
    for product in (4, 7):  # popped by q / v's DoRA forward, the recompute's first moment
        assert _at(ops, "free", f"act/{{i}}/{product}") < first_made
    for stand_in in (3, 5, 6, 8):  # DoRA's base_result / lora_result, saved to the backward
        assert _at(ops, "free", f"act/{{i}}/{stand_in}") > last_recomputed
    # DoRA's terms of q and v made again: only the three fp32 [out] vectors each (its
    # base_result and lora_result, 2 out t each, are the cached blocks)
    made = [op.size_bytes for op in ops if op.action == "alloc" and op.key.startswith("re/")]
    assert 3 * 4 * H in made and 3 * 4 * KV in made
    assert not {2 * 2 * H * T + 3 * 4 * H, 2 * 2 * KV * T + 3 * 4 * KV} & set(made)


def test_lora_recompute_frees_the_outputs_no_op_saves() -> None:
    ops = _layer_backward(_training(("q", "k", "v", "o", "gate", "up", "down")))
    # act/{i}/<n>: 3 q's base, 4 q's B, 6 v's base, 7 v's B, 9 gate's base, 10 gate's B (freed
    # where their linears run again), 12 / 13 down's (replayed after down's weight copy, where
    # the recompute holds its tensors: Note [The recompute's tensors held at an autocast
    # down projection]); 5 / 8 / 11, A's outputs of k / o / up, saved by B
    held = _at(ops, "alloc", "up_held/0")
    for n in (3, 4, 6, 7, 9, 10):
        assert _at(ops, "free", f"act/{{i}}/{n}") < held
    for n in (12, 13):
        assert _at(ops, "free", f"act/{{i}}/{n}") > held
    # what the recompute holds at down without down's base output, a cached block: the
    # gradient's cast to 16 bits (2 h t, made before the recompute and held from its start:
    # Note [The gradient's cast through the recompute]) and its product with scaling (2 h t),
    # down's input cast to the fp32 adapters (4 i t) and itself (2 i t), the MLP's input (4 h t)
    sizes = [op.size_bytes for op in ops if op.action == "alloc" and op.key.startswith("up_held/")]
    assert sizes == [2 * H * T, 4 * INTER * T, 2 * INTER * T, 4 * H * T]
    cast = _at(ops, "alloc", "grad_cast")
    assert ops[cast].size_bytes == 2 * H * T and cast < held < _at(ops, "free", "grad_cast")
