"""A Qwen2-MoE block's backward order (Note [Qwen2-MoE's shared expert around the routed
experts' backward], analytic/backward_transients.py; issue 26: tiny-qwen2-moe under full
checkpointing was -1.17 % below the trace).

Hand derivation from transformers 5.24 modeling_qwen2_moe.py ``Qwen2MoeSparseMoeBlock.forward``
on tests/analytic/configs/tiny-qwen2-moe.json (h = 128; b 8 x s 1024: t = 8192 tokens):
the gate path ``F.sigmoid(self.shared_expert_gate(x)) * shared_expert_output`` is made after
the routed experts, so autograd (latest sequence number first) runs its backward before
theirs. Through the routed experts' backward it leaves:
- the block input's gradient from the gate linear, in the input's dtype (the RMSNorm's output:
  fp32 under bf16 autocast, 4 t h = 4,194,304 B; bf16 in bf16-true, 2,097,152 B);
- the shared expert output's gradient, bf16 (t, h): 2,097,152 B;
and has freed what the gate path saved: the shared expert output (2 t h), the sigmoid's
output (2 t) and, under autocast, the gate linear's bf16 copy of its input (2 t h):
2 * 8192 * (128 + 1 + 128) = 4,210,688 B (2,113,536 B without autocast's copy).
"""

from __future__ import annotations

from pathlib import Path

from conftest import layer_bodies, live_at
from trainmem.analytic.activations import layer_activation_terms
from trainmem.analytic.backward_transients import shared_expert_pending_gradients
from trainmem.analytic.engine import estimate_analytic
from trainmem.specs.hf import load_model_spec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

CONFIGS = Path(__file__).parent / "configs"
T, H = 8192, 128
GATE_PATH_MIXED = 2 * T * (H + 1 + H)


def _training(**changes: object) -> TrainingConfig:
    return TrainingConfig(micro_batch_size=8, seq_len=1024, **changes)  # type: ignore[arg-type]


def _spec(name: str = "tiny-qwen2-moe.json") -> ModelSpec:
    return load_model_spec(str(CONFIGS / name))


def test_pending_gradients_by_hand() -> None:
    mixed = _training(precision="bf16-mixed")
    assert shared_expert_pending_gradients(_spec(), mixed) == 4 * T * H + 2 * T * H
    true16 = _training(precision="bf16-true")
    assert shared_expert_pending_gradients(_spec(), true16) == 2 * T * H + 2 * T * H
    # Qwen3-MoE has no shared expert
    assert shared_expert_pending_gradients(_spec("tiny-qwen3-moe.json"), mixed) == 0


def test_gate_path_term_holds_its_own_input_copy() -> None:
    mixed = layer_activation_terms(_spec(), _training(precision="bf16-mixed"))
    assert mixed["mlp/shared_expert_gate"] == GATE_PATH_MIXED
    # the shared expert's gate and up projections' copies stay in mlp/input
    assert mixed["mlp/input"] == 2 * 2 * T * H
    true16 = layer_activation_terms(_spec(), _training(precision="bf16-true"))
    assert true16["mlp/shared_expert_gate"] == 2 * T * (H + 1)
    assert true16["mlp/input"] == 2 * T * H  # no copies: the saved input itself


def test_gate_path_freed_before_the_experts_backward() -> None:
    training = _training(precision="bf16-mixed", activation_checkpointing="full")
    schedule = estimate_analytic(_spec(), training).schedules[0]
    body = layer_bodies(schedule.step)[0]
    recomputed = {op.key: op.size_bytes for op in body if op.key.startswith("re/")}
    assert GATE_PATH_MIXED in recomputed.values()
    live = live_at(body, "mlp_tmp")
    assert GATE_PATH_MIXED not in {v for k, v in live.items() if k.startswith("re/")}
