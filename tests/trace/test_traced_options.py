"""Training options applied to a traced step as the analytic engine's rules
(trainmem.traced_options; issue 26: every option on every model path).

Expected numbers: the analytic engine (its cited formulas and its own schedule, an independent
derivation of the same run) for the agreement within 1%; sizes of the 2-layer Qwen2 formula
config derived by hand (elements in tests/trace/test_traced_transforms.py: 139,840 trainable).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.breakdown import MemoryCategory
from trainmem.errors import NotApplicableError, UnsupportedError
from trainmem.estimate import estimate, image_sequence, trace_unsupported_settings
from trainmem.schedule import Item, Op, StepSchedule
from trainmem.specs.training import TrainingConfig

pytest.importorskip("transformers")

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
PIXART = str(MODELS_DIR / "diffusers" / "tiny-pixart.json")
TRAINABLE = 139_840


def _training(**changes: Any) -> TrainingConfig:
    return TrainingConfig(micro_batch_size=2, seq_len=64, **changes)


def _generic(model: str, **changes: Any) -> StepSchedule:
    est = estimate(model, _training(**changes), engine="generic", simulate_allocator=False)
    return est.schedules[0]


def _peaks(**changes: Any) -> tuple[int, int]:
    out = []
    for engine in ("generic", "analytic"):
        est = estimate(QWEN2, _training(**changes), engine=engine, simulate_allocator=False)
        out.append(est.breakdown.allocated_bytes)
    return out[0], out[1]


def _generic_and_analytic(**changes: Any) -> tuple[StepSchedule, int, int]:
    """(the generic path's schedule, its peak, the analytic engine's peak)."""
    training = _training(**changes)
    generic = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    analytic = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    g, a = generic.breakdown.allocated_bytes, analytic.breakdown.allocated_bytes
    return generic.schedules[0], g, a


def _ops(items: tuple[Item, ...]) -> list[Op]:
    out: list[Op] = []
    for item in items:
        out += [item] if isinstance(item, Op) else _ops(item.body)
    return out


def _buckets(schedule: StepSchedule) -> list[int]:
    return [op.size_bytes for op in _ops(schedule.setup + schedule.step) if op.key == "ddp/buckets"]


# -- plain DDP ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {},
        pytest.param({"gradient_accumulation_steps": 2}, marks=pytest.mark.slow),
        {"framework": "hf-trainer"},
    ],
    ids=["plain", "accumulation", "hf-trainer"],
)
def test_ddp_on_a_traced_model_matches_the_analytic_engine(changes: dict[str, Any]) -> None:
    generic, analytic = _peaks(data_parallel_size=4, **changes)
    assert abs(generic / analytic - 1) < 0.01, (generic, analytic)
    # the buckets (4 B x 139,840 = 2.7% of this peak) are more than the tolerance
    alone, _ = _peaks(**changes)
    assert generic - alone > 0.01 * generic


def test_ddp_buckets_of_a_traced_qwen2_by_hand() -> None:
    # pytorch-amp keeps fp32 weights under autocast: every trainable gradient is fp32, and
    # DDP's reducer keeps one flat copy of them, 4 B x 139,840, from wrap time (reducer.cpp)
    schedule = _generic(QWEN2, data_parallel_size=4)
    assert _buckets(schedule) == [4 * TRAINABLE]
    assert schedule.live_before_step()[MemoryCategory.GRADIENT] == 4 * TRAINABLE
    # a bf16 run's buckets are bf16
    assert _buckets(_generic(QWEN2, data_parallel_size=4, precision="bf16-true")) == [2 * TRAINABLE]


@pytest.mark.slow
def test_ddp_on_a_diffusers_model_adds_its_gradients_once() -> None:
    # no ModelSpec: the buckets are the traced gradients' bytes
    single = _generic(PIXART)
    ddp = _generic(PIXART, data_parallel_size=4)
    grads = single.category_peak(MemoryCategory.GRADIENT)
    assert grads > 0
    assert _buckets(ddp) == [grads]
    assert ddp.peak().peak_bytes == single.peak().peak_bytes + grads


def test_ddp_with_tensor_parallelism_stays_refused() -> None:
    refused = trace_unsupported_settings(
        _training(data_parallel_size=2, tensor_parallel_size=2), "generic"
    )
    assert refused[0].startswith("data_parallel_size=2 (DDP beside tensor"), refused
    assert "traced: DDP alone" in refused[0]


_STILL_REFUSED: dict[str, dict[str, Any]] = {
    # torchtune beside tensor parallelism (its own TP plans); its bf16-true default is traced
    "torchtune": {"tensor_parallel_size": 2},
    "litgpt": {"tensor_parallel_size": 2},
    # Megatron-LM's context parallelism (traced: one GPU, data, tensor or pipeline
    # parallelism, its memory applied to the transformers layers,
    # tests/trace/test_traced_megatron.py)
    "megatron": {"context_parallel_size": 2},
    # (FSDP1 beside TP / PP is no accelerate or fsdp_qlora run: a SpecError on every path,
    # tests/specs/test_fsdp1_model_parallel.py)
}


@pytest.mark.parametrize("framework", sorted(_STILL_REFUSED))
def test_frameworks_still_refused_say_what_is_traced(framework: str) -> None:
    training = _training(framework=framework, **_STILL_REFUSED[framework])
    refused = trace_unsupported_settings(training, "generic")
    assert refused[-1].startswith(f"framework={framework} ("), refused
    assert "traced: --" in refused[-1] and "--engine analytic" in refused[-1]


@pytest.mark.parametrize("framework", ["hf-trainer", "llama-factory", "axolotl"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hf_trainer_zero_refusal_names_traced_alternatives(framework: str, stage: int) -> None:
    # issue 26: the Trainer's ZeRO is DeepSpeed's engine (--deepspeed ds_config.json) and its
    # --fsdp accelerate's FSDP1; the refusal names both, and both suggestions are traced
    training = _training(framework=framework, zero_stage=stage, data_parallel_size=2)
    refused = trace_unsupported_settings(training, "generic")
    # the why is said once, by the framework's text (ZeRO-3 reads as FSDP: no dp refusal)
    assert [r for r in refused if r.startswith("data_parallel")] in ([], ["data_parallel_size=2"])
    assert refused[-1].startswith(f"framework={framework} (the HF Trainer"), refused
    assert "--framework deepspeed --zero-stage 1, 2 or 3" in refused[-1]
    assert "--framework accelerate-fsdp --zero-stage 3" in refused[-1]
    ds = _training(framework="deepspeed", zero_stage=stage, data_parallel_size=2)
    assert trace_unsupported_settings(ds, "generic") == []
    fsdp1 = _training(framework="accelerate-fsdp", zero_stage=3, data_parallel_size=2)
    assert trace_unsupported_settings(fsdp1, "generic") == []
    # and the Trainer under DDP stays traced
    ddp = _training(framework=framework, zero_stage=0, data_parallel_size=2)
    assert trace_unsupported_settings(ddp, "generic") == []


@pytest.mark.parametrize("stage", [1, 2])
def test_pytorch_amp_zero_refusal_names_deepspeed(stage: int) -> None:
    training = _training(zero_stage=stage, data_parallel_size=2)
    refused = trace_unsupported_settings(training, "generic")
    assert refused[0].startswith(f"data_parallel_size=2 (zero_stage {stage} under pytorch-amp")
    assert "DeepSpeed ZeRO-1/2/3 (--framework deepspeed" in refused[0]


_FSDP2_4: dict[str, Any] = {"data_parallel_size": 4, "zero_stage": 3}


@pytest.mark.parametrize(
    "changes",
    [{}, {"lora_rank": 16, "quantize_base": "nf4"}, _FSDP2_4, {**_FSDP2_4, "lora_rank": 16}],
    ids=["full", "qlora", "fsdp2-4", "fsdp2-4-lora"],
)
def test_torchtune_on_a_traced_model_matches_the_analytic_engine(changes: dict[str, Any]) -> None:
    # torchtune's single-device recipes in their dtype (bf16, no autocast), traced as a plain
    # loop under its conventions (adapters in bf16, torchao NF4 saving no input); its
    # distributed recipes as FSDP2 over 4 ranks without a mixed-precision policy
    g, a = _peaks(framework="torchtune", precision="bf16-true", **changes)
    assert abs(g - a) <= 0.01 * a, (g, a)


def test_torchtune_distributed_shards_its_bf16_weights_by_hand() -> None:
    # FSDP2 on the bf16 model, no mixed-precision policy: every weight's dim-0 quarter (the
    # 2-layer Qwen2's dims all divide by 4), 2 B per element; beside them the rotary buffers
    # (inv_freq, original_inv_freq: head_dim / 2 = 8 fp32 each, not sharded)
    est = estimate(QWEN2, _training(framework="torchtune", precision="bf16-true", **_FSDP2_4),
                   engine="generic", simulate_allocator=False)  # fmt: skip
    assert est.schedules[0].model_states()["parameters"] == 2 * TRAINABLE // 4 + 2 * 8 * 4


def test_torchtune_lora_adapters_in_the_weight_dtype_by_hand() -> None:
    # torchtune's LoRALinear keeps A and B in the model dtype (bf16: 2 B per element, gradients
    # too); peft on the same bf16 base upcasts them to fp32 (4 B); the base is the same
    peft = _generic(QWEN2, precision="bf16-true", lora_rank=16)
    est = estimate(QWEN2, _training(framework="torchtune", precision="bf16-true", lora_rank=16),
                   engine="generic", simulate_allocator=False)  # fmt: skip
    tune = est.schedules[0]
    n = est.num_trainable_parameters
    assert n > 0
    assert peft.model_states()["parameters"] - tune.model_states()["parameters"] == 2 * n
    assert tune.model_states()["gradients"] == 2 * n
    assert peft.model_states()["gradients"] == 4 * n


def test_torchtune_refuses_a_diffusers_model() -> None:
    pytest.importorskip("diffusers")
    with pytest.raises(UnsupportedError, match="framework=torchtune: .* pytorch-amp"):
        estimate(PIXART, _training(framework="torchtune", precision="bf16-true"),
                 engine="generic")  # fmt: skip


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_fsdp_qlora_is_not_applicable_to_a_diffusers_model(checkpointing: str) -> None:
    # Answer.AI's train.py loads AutoModelForCausalLM and trains it on tokenized text; before,
    # with full checkpointing the trace failed inside torch's reentrant checkpoint (no input of a
    # frozen denoiser's block requires a gradient), and without it the step ran as if it applied
    pytest.importorskip("diffusers")
    training = _training(
        framework="fsdp-qlora", zero_stage=3, data_parallel_size=4, lora_rank=16,
        quantize_base="nf4", activation_checkpointing=checkpointing,
    )  # fmt: skip
    with pytest.raises(NotApplicableError, match="framework=fsdp-qlora: .*accelerate-fsdp"):
        estimate(PIXART, training, engine="generic")
    # what the message offers runs: accelerate's FSDP with the same QLoRA settings
    offered = replace(training, framework="accelerate-fsdp", precision="bf16-true")
    est = estimate(PIXART, offered, engine="generic", simulate_allocator=False)
    assert est.breakdown.allocated_bytes > 0


# -- CPU offload -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "changes",
    [
        {"offload": "optimizer"},
        pytest.param(
            {"offload": "optimizer+params", "data_parallel_size": 4, "zero_stage": 3},
            marks=pytest.mark.slow,
        ),
    ],
    ids=["torchao", "fsdp2-params"],
)
def test_offload_on_a_traced_model_matches_the_analytic_engine(changes: dict[str, Any]) -> None:
    generic, analytic = _peaks(**changes)
    assert abs(generic / analytic - 1) < 0.01, (generic, analytic)
    # the offloaded states (fp32 Adam, 8 B x most of 139,840) move the peak beyond the tolerance
    kept, _ = _peaks(**{**changes, "offload": "none"})
    assert kept - generic > 0.01 * generic


def test_torchao_offload_of_a_traced_qwen2_by_hand() -> None:
    # torchao CPUOffloadOptimizer(minimal_size=4096): tensors under 4096 elements keep their
    # Adam states (two fp32 moments, 8 B per element) and gradients on the GPU. Per layer: the
    # q bias 64, k and v weights 2,048 each and biases 32 each, two norms 64 each: 4,352
    # elements; the final norm 64: 2 x 4,352 + 64 = 8,768 elements, 8 B x 8,768 = 70,144.
    schedule = _generic(QWEN2, offload="optimizer")
    assert schedule.model_states()["optimizer_states"] == 70_144
    # with the gradients (Note [torchao gradient offload]): the small ones stay (fp32, 4 B x
    # 8,768), each other leaves in the hook that runs as soon as it is made; the most alive at
    # once is one of them beside the small ones: the embedding's or the head's 512 x 64 =
    # 32,768 elements (a layer's largest, gate / up / down, is 64 x 128 = 8,192)
    offloaded = _generic(QWEN2, offload="optimizer+gradients")
    assert offloaded.category_peak(MemoryCategory.GRADIENT) == 4 * (8_768 + 32_768)
    ops = [op for op in _ops(offloaded.step) if op.category is MemoryCategory.GRADIENT]
    sent = [k for k, op in enumerate(ops) if op.action == "alloc" and op.size_bytes >= 4 * 4096]
    assert len(sent) == 2 * 5 + 2  # q, o, gate, up, down per layer; the embedding, the head
    for k in sent:  # freed before any other gradient is made
        assert ops[k + 1].action == "free" and ops[k + 1].key == ops[k].key


@pytest.mark.slow
def test_offloaded_gradients_on_a_composed_traced_model(tmp_path: Any) -> None:
    # 7 layers: the generic path traces a few and repeats the middle one; the gradients leave
    # inside the repeated body as in the traced layers
    import json

    raw = json.loads((MODELS_DIR / "formula" / "qwen2.json").read_text())
    raw.update(num_hidden_layers=7)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    training = _training(offload="optimizer+gradients")
    generic = estimate(str(path), training, engine="generic", simulate_allocator=False)
    analytic = estimate(str(path), training, engine="analytic", simulate_allocator=False)
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01
    small = 7 * 4_352 + 64
    assert generic.schedules[0].category_peak(MemoryCategory.GRADIENT) == 4 * (small + 32_768)


def test_kept_gradients_under_a_stand_in_optimizer() -> None:
    # zero_grad(set_to_none=False) with the fused stand-in: the steady step allocates and frees
    # nothing after its backward (it was refused: "no backward followed by an optimizer step");
    # the kept fp32 gradients of pytorch-amp's fp32 weights, 4 B x 139,840, live before it
    generic, analytic = _peaks(optimizer="adamw-8bit", zero_grad_set_to_none=False)
    assert abs(generic / analytic - 1) < 0.01, (generic, analytic)
    schedule = _generic(QWEN2, optimizer="adamw-8bit", zero_grad_set_to_none=False)
    assert schedule.live_before_step()[MemoryCategory.GRADIENT] == 4 * TRAINABLE


# -- paged optimizers --------------------------------------------------------------------------


def test_paged_8bit_adamw_on_a_traced_model_matches_the_analytic_engine() -> None:
    # the stand-in's states replaced by the optimizer transform's (no tensor of this config
    # reaches bitsandbytes' 1e5-element paging threshold: the paged bytes are the next test's)
    generic, analytic = _peaks(optimizer="paged-adamw-8bit")
    assert abs(generic / analytic - 1) < 0.01, (generic, analytic)
    adamw, _ = _peaks(optimizer="adamw")
    assert adamw - generic > 0.01 * generic  # 8-bit states, not AdamW's fp32 ones


@pytest.mark.slow
def test_paged_adamw_on_a_traced_model_by_hand_and_against_the_analytic_engine(
    tmp_path: Any,
) -> None:
    # The Qwen2 config at hidden 256, intermediate 512 (head_dim 64, 2 KV heads): tensors of at
    # least 1e5 elements are paged (bitsandbytes optimizer.py get_state_buffer: cudaMallocManaged,
    # outside the caching allocator): the embedding and the head, 512 x 256 = 131,072 each, and
    # per layer gate / up / down, 256 x 512 = 131,072 each (q and o 65,536, k and v 32,768 stay):
    # 2 x 131,072 + 2 x 3 x 131,072 = 1,048,576 elements, both fp32 states: 8 B each.
    import json

    raw = json.loads((MODELS_DIR / "formula" / "qwen2.json").read_text())
    raw.update(hidden_size=256, intermediate_size=512)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    # with accumulation the peak is the second micro-batch's forward (without it the peak is in
    # a layer's backward, where the analytic engine makes the layer's gradients at once and the
    # trace one by one: -5.8% here, the base order's difference; test_traced_transforms.py)
    training = _training(optimizer="paged-adamw", gradient_accumulation_steps=2)
    generic = estimate(str(path), training, engine="generic", simulate_allocator=False)
    analytic = estimate(str(path), training, engine="analytic", simulate_allocator=False)
    paged = 8 * 1_048_576
    assert generic.details["outside_allocator_bytes"]["paged_optimizer_states"] == paged
    assert analytic.details["outside_allocator_bytes"]["paged_optimizer_states"] == paged
    g, a = generic.breakdown.allocated_bytes, analytic.breakdown.allocated_bytes
    assert abs(g / a - 1) < 0.01, (g, a)
    # the paged states are not in the allocator's peak: AdamW's own states would be
    assert generic.schedules[0].model_states()["optimizer_states"] < paged


# -- optimizer in backward ---------------------------------------------------------------------


def test_optimizer_in_backward_on_a_traced_qwen2_by_hand() -> None:
    # torchtune's optimizer_in_bwd steps and frees each gradient in its hook: one gradient is
    # alive at a time, the largest the head's or the embedding's (512 x 64 = 32,768 elements,
    # fp32 under pytorch-amp; a layer's largest, gate / up / down, 8,192), so 4 B x 32,768
    # instead of all 139,840
    schedule = _generic(QWEN2, optimizer_in_backward=True)
    assert schedule.category_peak(MemoryCategory.GRADIENT) == 4 * 32_768
    assert schedule.model_states()["optimizer_states"] == 8 * TRAINABLE  # the states stay
    steps = [op for op in _ops(schedule.step) if op.phase == "optimizer" and op.action == "alloc"]
    assert all(op.size_bytes == 0 for op in steps)  # no step after the backward
    generic, analytic = _peaks(optimizer_in_backward=True)
    assert abs(generic / analytic - 1) < 0.01, (generic, analytic)


# -- activation offloading ---------------------------------------------------------------------


def test_activation_offloading_on_a_traced_model_matches_the_analytic_engine() -> None:
    # 2 layers, no checkpointing: layer 0's saved activations leave once layer 1's forward has
    # run, so the loss's peak holds one layer's fewer (2.3% here)
    schedule, generic, analytic = _generic_and_analytic(activation_offloading=True)
    assert abs(generic / analytic - 1) < 0.01, (generic, analytic)
    kept = _generic(QWEN2).peak().peak_bytes
    assert kept - generic > 0.01 * generic
    # every saved block that left is prefetched again: the step pairs its events
    prefetched = [op for op in _ops(schedule.step) if "prefetched" in op.label]
    assert prefetched and all(op.phase == "backward" for op in prefetched)


@pytest.mark.slow
def test_activation_offloading_on_a_composed_traced_model(tmp_path: Any) -> None:
    # 7 layers: the generic path repeats the middle layers; their bodies free and prefetch the
    # {i_prev} copy of their saved blocks (-27% against keeping them, at 256 tokens)
    import json

    raw = json.loads((MODELS_DIR / "formula" / "qwen2.json").read_text())
    raw.update(num_hidden_layers=7)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    training = TrainingConfig(micro_batch_size=2, seq_len=256, activation_offloading=True)
    generic = estimate(str(path), training, engine="generic", simulate_allocator=False)
    analytic = estimate(str(path), training, engine="analytic", simulate_allocator=False)
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01, ratio


# -- --loss on the generic path ----------------------------------------------------------------


def test_a_loss_on_the_logits_on_the_generic_path_matches_the_analytic_engine() -> None:
    # logits.sum(): no fp32 log-softmax or its gradient (the model's cross-entropy has them),
    # so the peak is lower than with the model's own loss by more than the tolerance
    generic, analytic = _peaks(loss="logits-sum")
    assert abs(generic / analytic - 1) < 0.01, (generic, analytic)
    own, _ = _peaks()
    assert own - generic > 0.01 * generic


def test_a_loss_on_the_logits_is_refused_for_a_diffusers_model() -> None:
    with pytest.raises(NotApplicableError, match="leave --loss unset"):
        _generic(PIXART, loss="logits-sum")


# -- the kept output of a chunked loss ---------------------------------------------------------


def test_kept_logits_of_a_chunked_loss_by_hand_and_against_the_analytic_engine() -> None:
    # keep_logits with torchtune's chunked cross-entropy: the loop holds the model's output, the
    # list of every chunk's logits and the KV cache transformers returns with it, through the
    # backward and the optimizer step (where this run peaks). By hand, the agreement model (2
    # Llama layers, 4 kv heads x 128, V 4096) at 2 x 256 tokens under bf16 autocast: the
    # logits 2 x 256 x 4096 x 2 B = 4 MiB; the cache's rotated keys in fp32 (the rotary tables
    # are fp32) 2 layers x 512 tokens x 512 x 4 B = 2 MiB and its values in bf16, 1 MiB, which
    # outlive SDPA's saved copy once the backward has freed it (transformers 5 cache_utils.py
    # DynamicLayer.update: torch.cat into the cache)
    agreement = str(MODELS_DIR / "agreement" / "llama_h2048.json")
    training = TrainingConfig(micro_batch_size=2, seq_len=256, chunked_cross_entropy=8)
    kept_training = replace(training, keep_logits=True)
    runs = {
        (engine, kept): estimate(
            agreement, kept_training if kept else training, engine=engine,
            simulate_allocator=False,
        ).breakdown.allocated_bytes
        for engine, kept in (("generic", False), ("generic", True), ("analytic", True))
    }  # fmt: skip
    mib = 2**20
    assert runs["generic", True] - runs["generic", False] == 4 * mib + 2 * mib + 1 * mib
    generic, analytic = runs["generic", True], runs["analytic", True]
    assert abs(generic / analytic - 1) < 0.01, (generic, analytic)


# -- padded batches ----------------------------------------------------------------------------


def test_padding_mask_on_the_generic_path_builds_the_models_mask() -> None:
    # a padded batch passes attention_mask [b, s]: the model builds its [b, 1, s, s] bool mask
    # (2 x 64 x 64 = 8,192 B here) and SDPA leaves the flash kernel; each layer's SDPA turns
    # the bool mask into a compute-dtype bias that the memory-efficient kernel saves (aten sdpa
    # convert_boolean_attn_mask), which the formulas count (attention.py
    # materialised_mask_bias_bytes; generic vs analytic +2.1% -> 0.0% at 256 tokens)
    schedule, generic, analytic = _generic_and_analytic(padding_mask=True)
    assert abs(generic / analytic - 1) < 0.01, (generic, analytic)
    masks = [
        op for op in _ops(schedule.step) if op.action == "alloc" and op.size_bytes == 2 * 64 * 64
    ]
    assert masks  # the model's own mask was built


@pytest.mark.slow  # two quantized traces; test_previous_loop_of_a_traced_qwen2_by_hand is fast
def test_previous_loop_on_a_traced_model_matches_the_analytic_engine(tmp_path: Any) -> None:
    # int8 QLoRA (bitsandbytes MatMul8bitLt keeps its inputs as ctx attributes): the previous
    # micro-batch's graph holds them through the next forward, which moves the peak beyond the
    # tolerance; the 2-layer Qwen2 at hidden 256 so that they weigh against the workspaces
    raw = json.loads(Path(QWEN2).read_text())
    raw.update(hidden_size=256, intermediate_size=512)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    training = _training(loop="previous", lora_rank=16, quantize_base="int8")
    generic = estimate(str(path), training, engine="generic", simulate_allocator=False)
    analytic = estimate(str(path), training, engine="analytic", simulate_allocator=False)
    g, a = generic.breakdown.allocated_bytes, analytic.breakdown.allocated_bytes
    assert abs(g - a) <= 0.01 * a, (g, a)
    drop = estimate(str(path), replace(training, loop="drop"), engine="generic",
                    simulate_allocator=False)  # fmt: skip
    assert g - drop.breakdown.allocated_bytes > 0.01 * g
    assert any("loop=previous" in note for note in generic.notes)


def test_previous_loop_of_a_traced_qwen2_by_hand() -> None:
    # the previous micro-batch's logits (b 2 x s 64 x V 512 in the bf16 compute dtype:
    # transformers returns lm_head's output) from each micro-batch's start until its own
    # logits exist; two micro-batches per step, and the warm-up step's as after an earlier one
    schedule = _generic(QWEN2, loop="previous", gradient_accumulation_steps=2)
    held = 2 * 64 * 512 * 2
    before = _made_before_the_release(schedule, "previous/logits", held)
    assert before.module == "lm_head" and before.size_bytes == held
    # no graph-held inputs without a bitsandbytes base
    assert not [op for op in _ops(schedule.step) if op.key == "previous/graph"]


def test_previous_output_of_a_model_without_a_spec_by_hand() -> None:
    # Note [The previous output of a model without a ModelSpec], on a step written out: the
    # forward allocation the step frees in its optimizer phase ("out", 96 B by "head": the
    # loop's binding) is the held output; its copy is made at the micro-batch's start and
    # freed right after the micro-batch's own "out"; the optimizer's temporary and the
    # gradient (freed in the optimizer / zero_grad phases, not made in the forward) are not
    from trainmem.analytic.transforms.base import alloc, free
    from trainmem.traced_options import apply_previous_loop

    act = alloc(64, MemoryCategory.ACTIVATION, "forward", "a", "blocks.0")
    out = alloc(96, MemoryCategory.ACTIVATION, "forward", "out", "head")
    grad = alloc(32, MemoryCategory.GRADIENT, "backward", "g", "blocks.0")
    tmp = alloc(8, MemoryCategory.TEMPORARY, "optimizer", "t")
    step = (act, out, grad, free(act, "backward"), tmp, free(tmp, "optimizer"),
            free(out, "optimizer"), free(grad, "zero_grad"))  # fmt: skip
    training = _training(loop="previous")
    got = apply_previous_loop(StepSchedule(setup=(), step=step), None, training).step
    held = alloc(96, MemoryCategory.ACTIVATION, "forward", "previous/output/0", "head",
                 "the previous micro-batch's output, held by the loop")  # fmt: skip
    assert got == (held, act, out, free(held, "forward"), *step[2:])
    # a forward that returns the loss alone binds nothing past its backward: refused
    bare = (act, grad, free(act, "backward"), tmp, free(tmp, "optimizer"), free(grad, "zero_grad"))
    with pytest.raises(UnsupportedError, match="loop=previous: .* use --loop drop"):
        apply_previous_loop(StepSchedule(setup=(), step=bare), None, training)


def test_previous_loop_of_a_denoiser_holds_its_prediction() -> None:
    # PixArt's prediction: [b 2, out_channels 8, 8, 8] (sample_size 8 latents), bf16 (proj_out
    # under the bf16 autocast), from each micro-batch's start until its own prediction exists;
    # two micro-batches per step, and the warm-up step's as after an earlier one
    pytest.importorskip("diffusers")
    schedule = _generic(PIXART, loop="previous", gradient_accumulation_steps=2)
    held = 2 * 8 * 8 * 8 * 2
    before = _made_before_the_release(schedule, "previous/output/0", held)
    assert before.phase == "forward" and before.size_bytes == held


def _made_before_the_release(schedule: StepSchedule, key: str, held: int) -> Op:
    """The op before the first release of the previous output ``key`` (``held`` bytes, made
    and released twice in the warm-up step and in the step, two micro-batches each)."""
    for items in (schedule.setup, schedule.step):
        ops = [op for op in _ops(items) if op.key.startswith("previous/")]
        assert [(op.action, op.size_bytes) for op in ops] == [("alloc", held), ("free", held)] * 2
    step = list(schedule.step)
    first_free = next(k for k, x in enumerate(step) if isinstance(x, Op)
                      and x.key == key and x.action == "free")  # fmt: skip
    before = step[first_free - 1]
    assert isinstance(before, Op)
    return before


@pytest.mark.slow  # two traces (21 s); the rule itself: the fast test by hand above
def test_previous_loop_of_a_timm_classifier_holds_its_logits() -> None:
    # timm's test_vit: 1,000 classes, b 2, the head's bf16 output under autocast; its peak is
    # in the forward, where the previous logits are held: the peak grows by exactly them
    import importlib.util

    if importlib.util.find_spec("timm") is None:
        pytest.skip("timm is an optional extra")
    held = 2 * 1000 * 2
    peaks = {}
    for loop in ("drop", "previous"):
        training = image_sequence("timm:test_vit", _training(loop=loop), given=False)
        est = estimate("timm:test_vit", training, engine="generic", simulate_allocator=False)
        peaks[loop] = est.breakdown.allocated_bytes
        ops = [op for op in _ops(est.schedules[0].step) if op.key.startswith("previous/")]
        assert [(op.size_bytes, op.module) for op in ops] == [(held, "head")] * 2 * (
            loop == "previous"
        )
    assert peaks["previous"] - peaks["drop"] == held


def test_fsdp1_over_a_quantized_base_runs_or_names_what_works() -> None:
    # GPTQ under accelerate's FSDP1 is traced as fms-acceleration runs it, and a 4-bit base
    # under *-mixed as the 16-bit model it loads (tests/trace/test_traced_fsdp_qlora.py); what
    # stays refused is peft's fp32 upcast asked for under *-mixed (fp32 norms beside 16-bit
    # codes in one unit), naming what is traced, not a ValueError from torch (int8 under
    # FSDP1, which no release runs, is refused by TrainingConfig:
    # tests/specs/test_fsdp1_quantized.py)
    for changes in ({}, {"zero_stage": 3, "data_parallel_size": 4}):
        for base in ("gptq-int4", "nf4"):
            training = _training(framework="accelerate-fsdp", lora_rank=8, quantize_base=base,
                                 **changes)  # fmt: skip
            assert not trace_unsupported_settings(training, "generic")
        upcast = _training(framework="accelerate-fsdp", lora_rank=8, quantize_base="nf4",
                           prepare_kbit_training=True, **changes)  # fmt: skip
        last = trace_unsupported_settings(upcast, "generic")[-1]
        assert last.startswith("quantize_base=nf4 under framework=accelerate-fsdp ("), last
        assert "prepare-kbit-training" in last and "--engine analytic" in last
        true = replace(upcast, precision="bf16-true")  # upcast refused on a 16-bit model
        assert not any(x.startswith("quantize_base=nf4 under") for x in
                       trace_unsupported_settings(true, "generic"))  # fmt: skip


@pytest.mark.slow  # three traces; the splice by hand: tests/analytic/test_varying_lengths.py
def test_earlier_lengths_are_traced_steps_before_the_measured_one() -> None:
    # Note [Steps of varying length]: one traced step per listed length (16, then 32), then
    # the step at seq_len that the measured one follows. The head's input under autocast is a
    # bf16 copy of the hidden states, b x n x h x 2 B = 2 x n x 64 x 2: 4,096, 8,192, 16,384
    training = _training(earlier_seq_lens="16,32")
    est = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    schedule = est.schedules[0]

    def head_inputs(items: tuple[Item, ...]) -> list[int]:
        return [op.size_bytes for op in _ops(items) if op.action == "alloc"
                and op.phase == "forward" and op.module.endswith("lm_head")
                and op.size_bytes in (4_096, 8_192, 16_384)]  # fmt: skip

    assert head_inputs(schedule.setup) == [4_096, 8_192, 16_384]
    assert head_inputs(schedule.step) == [16_384]
    assert est.config["earlier_seq_lens"] == "16,32"
    # the measured step's allocated peak is the step at seq_len's, as the formulas have it
    analytic = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    generic = est.breakdown.allocated_bytes
    assert abs(generic / analytic.breakdown.allocated_bytes - 1) < 0.01
    assert generic == estimate(QWEN2, _training(), engine="generic",
                               simulate_allocator=False).breakdown.allocated_bytes  # fmt: skip


@pytest.mark.slow  # three traces
def test_a_repeated_length_is_traced_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # lengths drawn from a dataset repeat (--sample-lengths: every truncated batch is at
    # seq_len): each distinct length is traced once, seq_len's being the measured step's trace,
    # and spliced at every place it is listed (head inputs 2 x n x 64 x 2 B, as above)
    driver = sys.modules["trainmem.estimate"]  # the package's ``estimate`` is the function
    traced: list[int] = []
    real = driver._traced_step

    def counted(model: object, training: TrainingConfig, *args: object) -> object:
        traced.append(training.seq_len)
        return real(model, training, *args)

    monkeypatch.setattr(driver, "_traced_step", counted)
    training = _training(earlier_seq_lens="16,64,16,32")
    schedule = estimate(QWEN2, training, engine="generic", simulate_allocator=False).schedules[0]
    assert sorted(traced) == [16, 32, 64]
    heads = [op.size_bytes for op in _ops(schedule.setup) if op.action == "alloc"
             and op.phase == "forward" and op.module.endswith("lm_head")
             and op.size_bytes in (4_096, 8_192, 16_384)]  # fmt: skip
    assert heads == [4_096, 16_384, 4_096, 8_192, 16_384]
