"""``--framework unsloth`` on the generic path (trainmem.traced_unsloth, Note [Unsloth on a
traced step]; issue 26: every option on every model path).

Expected numbers: the analytic engine's schedule of the same run for the agreement within 1%
(the traced state, adapters and 8-bit optimizer step are the trace's, an independent
derivation of them); sizes by hand from Unsloth's code for the 2-layer 1024-wide Llama of
tests/models/agreement (vocabulary 4,096) at 2 x 2,048 tokens: the offloaded checkpoint's
buffer ``torch.empty(2*256*2048, bf16)`` = 2,097,152 B grown to b s h = 2 x 2,048 x 1,024 bf16
elements = 8,388,608 B (unsloth_zoo 2026.3.4 gradient_checkpointing.py); the LoRA A of q,
r x h = 16 x 1,024 upcast to fp32 = 65,536 B (training_utils.py ``prepare_model_for_training``);
transformers' loss on the upcast logits makes t V fp32 = 4,096 x 4,096 x 4 = 67,108,864 B,
Unsloth's fused loss never does (Note [Unsloth's fused cross-entropy]).
"""

from __future__ import annotations

from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.breakdown import MemoryCategory
from trainmem.errors import NotApplicableError, UnsupportedError
from trainmem.estimate import estimate, trace_unsupported_settings
from trainmem.schedule import Item, Op, StepSchedule
from trainmem.specs.training import TrainingConfig

pytest.importorskip("transformers")

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
LLAMA = str(MODELS_DIR / "agreement" / "llama_h1024.json")
QWEN1 = str(MODELS_DIR / "remote_code" / "qwen-7b.json")
PIXART = str(MODELS_DIR / "diffusers" / "tiny-pixart.json")
WHISPER = str(MODELS_DIR / "whisper.json")


def _unsloth(**changes: Any) -> TrainingConfig:
    settings = {"micro_batch_size": 2, "seq_len": 1024, "lora_rank": 16, **changes}
    return TrainingConfig(framework="unsloth", **settings)


def _peak(model: str, training: TrainingConfig, engine: str) -> tuple[int, StepSchedule]:
    est = estimate(model, training, engine=engine, simulate_allocator=False)
    return est.breakdown.allocated_bytes, est.schedules[0]


def _ops(items: tuple[Item, ...]) -> list[Op]:
    out: list[Op] = []
    for item in items:
        out += [item] if isinstance(item, Op) else _ops(item.body)
    return out


@pytest.mark.parametrize(
    ("model", "changes"),
    [
        (QWEN2, {}),
        (QWEN2, {"quantize_base": "nf4"}),
        (QWEN2, {"gradient_accumulation_steps": 2}),
        # what spans the micro-batches and the optimizer step: the formulas' holds and
        # releases around the traced optimizer step
        (QWEN2, {"keep_logits": True}),
        (QWEN2, {"loop": "previous", "gradient_accumulation_steps": 2}),
        (QWEN2, {"optimizer_in_backward": True, "optimizer": "adamw"}),
        (QWEN2, {"zero_grad_set_to_none": False}),
        # b s h = 4,194,304 elements > MINIMUM_SIZE: every layer input but the last offloaded
        (LLAMA, {"seq_len": 2048, "quantize_base": "nf4"}),
    ],
    ids=[
        "lora",
        "qlora-nf4",
        "accumulation",
        "keep-logits",
        "previous-loop",
        "optimizer-in-backward",
        "zero-grad-keeps",
        "llama-qlora-offloaded",
    ],
)
def test_unsloth_on_a_traced_model_matches_the_analytic_engine(
    model: str, changes: dict[str, Any]
) -> None:
    training = _unsloth(**changes)
    generic, _ = _peak(model, training, "generic")
    analytic, _ = _peak(model, training, "analytic")
    assert abs(generic / analytic - 1) < 0.01, (generic, analytic)
    # transformers + peft in the same dtypes under the HF Trainer peak elsewhere (the fp32
    # logits, peft's saved tensors): the rewrite is what brings the trace to Unsloth's step
    hf = replace_framework(training)
    plain, _ = _peak(model, hf, "generic")
    assert abs(plain / generic - 1) > 0.01, (plain, generic)


def replace_framework(training: TrainingConfig) -> TrainingConfig:
    """The Unsloth run's settings under the HF Trainer (its conventions' dtypes otherwise)."""
    t = training
    # the HF Trainer's QLoRA under autocast (its bf16 run), not bf16-true under peft's upcast
    precision = "bf16-mixed" if t.quantize_base != "none" else t.precision
    return TrainingConfig(
        framework="hf-trainer",
        micro_batch_size=t.micro_batch_size,
        seq_len=t.seq_len,
        lora_rank=t.lora_rank,
        lora_targets=t.lora_targets,
        quantize_base=t.quantize_base,
        precision=precision,
        optimizer=t.optimizer,
        activation_checkpointing=t.activation_checkpointing,
        gradient_accumulation_steps=t.gradient_accumulation_steps,
    )


def test_unsloth_on_a_traced_llama_by_hand() -> None:
    _, schedule = _peak(LLAMA, _unsloth(seq_len=2048, quantize_base="nf4"), "generic")
    ops = _ops(schedule.setup + schedule.step)
    buffers = {op.size_bytes for op in ops if op.key.startswith("unsloth_gc/buffer")}
    assert buffers == {2_097_152, 8_388_608}
    # the 2 MiB buffer is made with the state (at load), before the warm-up step
    state = [op for op in _ops(schedule.setup) if op.phase == "init"]
    assert any(op.key == "unsloth_gc/buffer0" for op in state)
    # the adapters are the trace's, upcast to fp32
    lora_a = [op for op in ops if "q_proj.lora_A" in op.module and op.action == "alloc"]
    assert lora_a and {op.size_bytes for op in lora_a} == {65_536}
    # Unsloth's fused loss never makes the t x V fp32 logits transformers' loss does
    step = _ops(schedule.step)
    assert max(op.size_bytes for op in step) < 67_108_864
    _, traced_hf = _peak(LLAMA, replace_framework(_unsloth(seq_len=2048)), "generic")
    assert any(op.size_bytes >= 67_108_864 for op in _ops(traced_hf.step))


def test_kept_gradients_once_by_hand() -> None:
    # zero_grad(set_to_none=False): the trace's state holds the kept gradients, and the
    # formulas' warm-up step makes them; counted once. LoRA r = 16 on the tiny Qwen2's seven
    # linears (h 64, k / v 32 wide, MLP 128): q 2,048 + k 1,536 + v 1,536 + o 2,048 + gate,
    # up, down 3,072 each = 16,384 per layer, 32,768 for 2 layers, fp32: 131,072 B
    _, schedule = _peak(QWEN2, _unsloth(zero_grad_set_to_none=False), "generic")
    assert schedule.live_before_step()[MemoryCategory.GRADIENT] == 131_072


@pytest.mark.slow
def test_unsloth_on_a_remote_code_config() -> None:
    # Qwen-1 (model_type "qwen", remote code): Unsloth loads it through FastModel with
    # trust_remote_code; the table row gives its shape, the trace its state
    training = _unsloth(micro_batch_size=1)
    generic, schedule = _peak(QWEN1, training, "generic")
    analytic, _ = _peak(QWEN1, training, "analytic")
    assert abs(generic / analytic - 1) < 0.01, (generic, analytic)
    assert any(op.key == "unsloth_gc/buffer0" for op in _ops(schedule.setup))


def test_unsloth_is_traced_not_refused() -> None:
    assert trace_unsupported_settings(_unsloth(), "generic") == []
    assert trace_unsupported_settings(_unsloth(quantize_base="nf4"), "generic") == []


def test_unsloth_refusals_say_why() -> None:
    # no ModelSpec: the formulas' rules are sized from the model's shape
    with pytest.raises(UnsupportedError, match="framework=unsloth on a model without a ModelSpec"):
        estimate(WHISPER, _unsloth(seq_len=64), engine="generic", simulate_allocator=False)
    # Unsloth loads transformers models, not diffusers ones
    with pytest.raises(NotApplicableError, match="framework=unsloth: Unsloth's FastLanguageModel"):
        estimate(PIXART, _unsloth(), engine="generic", simulate_allocator=False)
