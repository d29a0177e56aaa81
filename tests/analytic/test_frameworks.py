"""Framework conventions (specs/frameworks.py), each rule against a hand derivation from the
source file it mirrors (issue 12).

llama-2-7b, used throughout: h = 4096, i = 11008, L = 32, V = 32000, a = 32 heads of d = 128.
One layer's linear weights: 4 h^2 (q, k, v, o) + 3 h i (gate, up, down)
= 67,108,864 + 135,266,304 = 202,375,168; with its two RMSNorm vectors 202,383,360.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from conftest import Invoke
from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.activations import layer_activation_terms
from trainmem.analytic.autocast import autocast_cached_weight_bytes
from trainmem.analytic.buffers import (
    gathered_layer_bytes,
    gradients_alive_in_forward,
    kept_gathered_layer_bytes,
    reduce_scatter_layer_bytes,
)
from trainmem.analytic.temporaries import optimizer_step_temporary_bytes
from trainmem.analytic.tensor_states import state_layout, tensor_states
from trainmem.errors import SpecError
from trainmem.estimate import estimate as estimate_analytic
from trainmem.schedule import Op
from trainmem.specs.frameworks import FRAMEWORK_CONVENTIONS
from trainmem.specs.hardware import DEFAULT_CUDA_CONTEXT_BYTES
from trainmem.specs.hf import load_model_spec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import FRAMEWORKS, TrainingConfig, fsdp_settings

LAYER_LINEAR = 4 * 4096 * 4096 + 3 * 4096 * 11008
LAYER_NUMEL = LAYER_LINEAR + 2 * 4096
PSI = 6_738_415_616  # llama-2-7b parameters
assert LAYER_LINEAR == 202_375_168 and LAYER_NUMEL == 202_383_360


def _layer(model: object, training: TrainingConfig) -> list:  # type: ignore[type-arg]
    return state_layout(model, training).layer  # type: ignore[arg-type]


def _candidates(model: object, training: TrainingConfig) -> dict[str, int]:
    """The peak of each phase of the step schedule (``details["phase_peaks_bytes"]``)."""
    est = estimate_analytic(model, training, simulate_allocator=False)  # type: ignore[arg-type]
    return dict(est.details["phase_peaks_bytes"])  # type: ignore[arg-type]


def _flat(items: object) -> list[Op]:
    """The ops of a step schedule, its repeats unrolled once (in order)."""
    out: list[Op] = []
    for item in items:  # type: ignore[attr-defined]
        out += [item] if isinstance(item, Op) else _flat(item.body)
    return out


def test_every_framework_has_one_conventions_row() -> None:
    assert set(FRAMEWORKS) == set(FRAMEWORK_CONVENTIONS)
    assert {"accelerate-fsdp", "hf-trainer", "megatron", "deepspeed"} <= set(FRAMEWORKS)
    for name in FRAMEWORKS:
        assert TrainingConfig(framework=name).conventions.name == name


# -- item 1: accelerate / HF Trainer FSDP (v1) installs MixedPrecision(param_dtype=bf16) --------


def test_accelerate_fsdp_gathers_and_reduces_in_bf16(llama_2_7b: ModelSpec) -> None:
    # accelerate utils/dataclasses.py set_mixed_precision: MixedPrecision(param_dtype=bf16,
    # reduce_dtype=bf16): a gathered layer is 2 bytes per element, so is its unsharded gradient
    acc = TrainingConfig(framework="accelerate-fsdp", data_parallel_size=8, zero_stage=3)
    assert gathered_layer_bytes(_layer(llama_2_7b, acc), acc) == 2 * LAYER_NUMEL == 404_766_720
    assert reduce_scatter_layer_bytes(_layer(llama_2_7b, acc), acc) == 404_766_720
    # FSDP without a policy (pytorch-amp: autocast on fp32 gathers) moves fp32: 4 bytes each
    amp = TrainingConfig(framework="pytorch-amp", data_parallel_size=8, zero_stage=3)
    assert gathered_layer_bytes(_layer(llama_2_7b, amp), amp) == 4 * LAYER_NUMEL == 809_533_440
    assert reduce_scatter_layer_bytes(_layer(llama_2_7b, amp), amp) == 809_533_440


def test_accelerate_fsdp_runs_bf16_without_autocast_casts(llama_2_7b: ModelSpec) -> None:
    acc = TrainingConfig(framework="accelerate-fsdp", data_parallel_size=8, zero_stage=3)
    # residual stream in bf16 (the gathered embedding is bf16), not autocast's fp32
    assert compute_and_residual_bytes(acc) == (2, 2)
    assert acc.weight_dtype == "float32" and acc.gathered_weight_dtype == "bfloat16"
    t = 2048
    terms = layer_activation_terms(llama_2_7b, TrainingConfig(**{**_fields(acc), "seq_len": t}))  # type: ignore[arg-type]
    # q, k, v read one bf16 norm output: one saved copy (autocast would cast it three times)
    assert terms["attention/qkv_input"] == 2 * 4096 * t
    assert "autocast_weight_copies" not in terms


def _fields(training: TrainingConfig) -> dict[str, object]:
    from dataclasses import fields

    return {f.name: getattr(training, f.name) for f in fields(training)}


# -- item 1: autocast caches only leaf, non-view tensors that require grad ---------------------


def test_autocast_cache_holds_only_trainable_leaf_weights(llama_2_7b: ModelSpec) -> None:
    # aten autocast_mode.cpp cached_cast: arg.requires_grad() && arg.is_leaf() && !arg.is_view()
    full = TrainingConfig(activation_checkpointing="full")
    assert autocast_cached_weight_bytes(llama_2_7b, full) == 2 * LAYER_LINEAR == 404_750_336  # type: ignore[arg-type]
    # LoRA r=8 on q, v: the frozen base is not cached; the fp32 adapters are:
    # 2 adapters x r (in + out) = 2 x 8 x (4096 + 4096) = 131,072 elements, 2 bytes each
    lora = TrainingConfig(activation_checkpointing="full", lora_rank=8, lora_targets=("q", "v"))
    assert autocast_cached_weight_bytes(llama_2_7b, lora) == 2 * 131_072 == 262_144  # type: ignore[arg-type]
    # FSDP1-gathered weights (the HF Trainer's accelerate FSDP) are views of the flat
    # parameter: nothing cached; FSDP2's unsharded parameters (pytorch-amp's ZeRO-3, as traced)
    # are leaves: cached like unsharded weights (FSDPParam.init_unsharded_param: nn.Parameter)
    fsdp = dict(activation_checkpointing="full", data_parallel_size=8, zero_stage=3)
    hf = TrainingConfig(framework="hf-trainer", **fsdp)  # type: ignore[arg-type]
    assert autocast_cached_weight_bytes(llama_2_7b, hf) == 0  # type: ignore[arg-type]
    fsdp2 = TrainingConfig(**fsdp)  # type: ignore[arg-type]
    assert autocast_cached_weight_bytes(llama_2_7b, fsdp2) == 2 * LAYER_LINEAR  # type: ignore[arg-type]


# -- item 7: the HF Trainer's default optimizer by torch version; explicit always wins ---------


def test_deepspeed_fuses_adam_and_lion_only() -> None:
    # DeepSpeed v0.16.4 runtime/engine.py _configure_basic_optimizer: Adam / AdamW -> FusedAdam,
    # Lion -> FusedLion; any other name -> getattr(torch.optim, name)(params, **params): torch's
    # own default (foreach on CUDA from torch 2.0, the loop before)
    def impl(optimizer: str, **kw: object) -> str:
        t = TrainingConfig(framework="deepspeed", zero_stage=2, optimizer=optimizer, **kw)  # type: ignore[arg-type]
        return t.step_implementation

    assert [impl(o) for o in ("adam", "adamw", "lion")] == ["fused"] * 3
    assert [impl(o) for o in ("sgd", "sgd-momentum", "adafactor")] == ["foreach"] * 3
    assert impl("adafactor", torch_version="1.13") == "for-loop"
    # Megatron's SGD is apex / TransformerEngine FusedSGD: unchanged
    assert TrainingConfig(framework="megatron", optimizer="sgd").step_implementation == "fused"


def test_hf_trainer_default_optimizer_follows_torch_version() -> None:
    # transformers training_args.py: default_optim = "adamw_torch"; "adamw_torch_fused" if
    # is_torch_greater_or_equal_than_2_8. torch AdamW: foreach on CUDA from 2.0, loop before.
    assert TrainingConfig(framework="hf-trainer", torch_version="2.7").step_implementation == (
        "foreach"
    )
    assert TrainingConfig(framework="hf-trainer", torch_version="2.8.0").step_implementation == (
        "fused"
    )
    assert TrainingConfig(framework="hf-trainer").step_implementation == "fused"
    assert TrainingConfig(torch_version="1.10").step_implementation == "for-loop"
    assert TrainingConfig().step_implementation == "foreach"
    explicit = TrainingConfig(framework="hf-trainer", optimizer_implementation="foreach")
    assert explicit.step_implementation == "foreach"
    with pytest.raises(SpecError, match="torch_version"):
        TrainingConfig(torch_version="two")


def test_hf_trainer_explicit_foreach_is_computed_and_reported() -> None:
    bert = load_model_spec("bert-base-uncased")
    kw = {"framework": "hf-trainer", "precision": "32-true", "micro_batch_size": 2, "seq_len": 16}
    fused = estimate_analytic(bert, TrainingConfig(**kw), simulate_allocator=False)  # type: ignore[arg-type]
    foreach = estimate_analytic(
        bert,
        TrainingConfig(**kw, optimizer_implementation="foreach"),  # type: ignore[arg-type]
        simulate_allocator=False,
    )
    assert fused.config["optimizer_implementation"] == "fused"
    assert foreach.config["optimizer_implementation"] == "foreach"
    # torch/optim/adam.py _multi_tensor_adam: torch._foreach_sqrt(exp_avg_sqs) is one fp32
    # copy of every trainable parameter: 4 bytes x N
    n = foreach.num_trainable_parameters
    gap = (
        foreach.details["phase_peaks_bytes"]["optimizer"]
        - fused.details["phase_peaks_bytes"][  # type: ignore[index]
            "optimizer"
        ]
    )
    assert gap == 4 * n


def test_cli_torch_version_and_explicit_implementation(invoke: Invoke) -> None:
    args = ["estimate", "bert-base-uncased", "-p", "32-true", "-s", "16", "--json"]
    old = invoke(*args, "--framework", "hf-trainer", "--torch-version", "2.5")
    assert json.loads(old.stdout)["config"]["optimizer_implementation"] == "foreach"
    new = invoke(*args, "--framework", "hf-trainer")
    assert json.loads(new.stdout)["config"]["optimizer_implementation"] == "fused"
    bad = invoke(*args, "--torch-version", "latest", exit_code=2)
    assert "torch_version" in bad.output


# -- item 5: bitsandbytes --------------------------------------------------------------------


def test_matmul4bit_saves_its_input_only_before_0_43_2() -> None:
    # bitsandbytes autograd/_functions.py MatMul4Bit: ctx.tensors = (None, B) since 0.43.2
    def saves(**kw: object) -> bool:
        base = {"lora_rank": 8, "quantize_base": "nf4"}
        return TrainingConfig(**{**base, **kw}).quantized_matmul_saves_input  # type: ignore[arg-type]

    assert saves(bitsandbytes_version="0.43.1")
    assert not saves(bitsandbytes_version="0.43.2")
    assert not saves()
    assert saves(quantize_base="int8")  # MatMul8bitLt still saves A
    assert not saves(framework="torchtune", bitsandbytes_version="0.41.1")  # torchao NF4


def test_qlora_activations_with_new_and_old_bitsandbytes(llama_2_7b: ModelSpec) -> None:
    # LoRA on q, v over an nf4 base, bf16-true, b1 s1024 (t = 1024): with (A, B) saved the
    # frozen q/k/v input (c h t, one tensor), gate/up input (c h t) and down input (c i t)
    # stay; with (None, B) they do not. LoRA A saves its own fp32 cast of the q/v input either
    # way (peft ``_cast_input_dtype`` to the fp32 adapters), not the 16-bit input.
    # (peft's fp32 upcast off: a bf16 stream, where each input is one 16-bit tensor)
    kw = {"lora_rank": 8, "quantize_base": "nf4", "precision": "bf16-true", "seq_len": 1024,
          "prepare_kbit_training": False}  # fmt: skip
    old = sum(
        layer_activation_terms(
            llama_2_7b, TrainingConfig(**kw, bitsandbytes_version="0.41.1")
        ).values()
    )  # type: ignore[arg-type]
    new = sum(layer_activation_terms(llama_2_7b, TrainingConfig(**kw)).values())  # type: ignore[arg-type]
    assert old - new == 2 * 1024 * (4096 + 4096 + 11008) == 39_321_600


def test_quantized_base_dequantizes_its_largest_linear(llama_2_7b: ModelSpec) -> None:
    from trainmem.analytic.buffers import dequantized_weight_bytes

    # bitsandbytes MatMul4Bit: dequantize_4bit(B).to(A.dtype) per matmul, one at a time; the
    # largest of llama-2-7b's base linears is gate / up / down, 4096 x 11008, in bf16
    qlora = TrainingConfig(lora_rank=8, quantize_base="nf4")
    assert dequantized_weight_bytes(_layer(llama_2_7b, qlora), qlora) == 2 * 4096 * 11008
    tp2 = TrainingConfig(lora_rank=8, quantize_base="nf4", tensor_parallel_size=2)
    assert dequantized_weight_bytes(_layer(llama_2_7b, tp2), tp2) == 4096 * 11008
    plain = TrainingConfig(lora_rank=8)
    assert dequantized_weight_bytes(_layer(llama_2_7b, plain), plain) == 0


def test_paged_adamw_states_live_outside_the_allocator(llama_2_7b: ModelSpec) -> None:
    # bitsandbytes optimizer.py get_state_buffer: fp32 states of tensors >= 1e5 elements come
    # from F.get_paged (cudaMallocManaged); smaller ones from torch.zeros_like
    paged = TrainingConfig(optimizer="paged-adamw", precision="bf16-true")
    states = {s.name: s for s in tensor_states(llama_2_7b, paged)}  # type: ignore[arg-type]
    q, norm = states["q"], states["vector"]
    assert (q.paged_state_bytes, q.state_bytes) == (2 * 4 * 4096 * 4096, 0) == (134_217_728, 0)
    assert (norm.paged_state_bytes, norm.state_bytes) == (0, 2 * 4 * 4096)
    # whole model: 65 norm vectors of 4096 stay in the allocator, everything else is paged
    total = 8 * (PSI - 65 * 4096)
    assert total == 53_905_195_008
    est = estimate_analytic(llama_2_7b, paged, simulate_allocator=False)  # type: ignore[arg-type]
    assert est.details["outside_allocator_bytes"] == {"paged_optimizer_states": total}
    b = est.breakdown
    assert b.device_total_bytes - b.reserved_bytes == DEFAULT_CUDA_CONTEXT_BYTES + total
    assert b.optimizer_states == 65 * 8 * 4096
    assert any("outside the caching allocator" in n for n in est.notes)
    # 8-bit paged: the uint8 states are paged, the fp32 absmax (2 x 4 B per 256) is not
    q8 = next(
        s
        for s in tensor_states(llama_2_7b, TrainingConfig(optimizer="paged-adamw-8bit"))
        if s.name == "q"
    )  # type: ignore[arg-type]
    assert (q8.paged_state_bytes, q8.state_bytes) == (2 * 4096 * 4096, 2 * 4 * 4096 * 4096 // 256)


# -- item 2: SHARD_GRAD_OP reshards after backward; HYBRID_SHARD shards within a node ---------


def test_fsdp_strategies_as_settings() -> None:
    assert fsdp_settings(0, "shard-grad-op") == {"zero_stage": 3, "reshard_after_forward": False}
    assert fsdp_settings(0, "hybrid-shard") == {"zero_stage": 3, "shard_group_size": 8}
    assert fsdp_settings(2, None) == {"zero_stage": 2}


def test_hybrid_shard_shards_over_the_node_only(llama_2_7b: ModelSpec) -> None:
    t = TrainingConfig(data_parallel_size=32, zero_stage=3, shard_group_size=8)
    states = tensor_states(llama_2_7b, t)  # type: ignore[arg-type]
    params = sum(s.param_bytes for s in states)
    # fp32 weights over 8 ranks (not 32): 4 PSI / 8, each tensor's shard rounded up
    assert 4 * PSI // 8 <= params <= 4 * PSI // 8 + len(states)


def test_shard_grad_op_keeps_gathered_layers_from_forward_to_backward(
    llama_2_7b: ModelSpec,
) -> None:
    base = {"framework": "accelerate-fsdp", "data_parallel_size": 8, "seq_len": 512}
    sgo = TrainingConfig(**base, **fsdp_settings(0, "shard-grad-op"))  # type: ignore[arg-type]
    full = TrainingConfig(**base, **fsdp_settings(0, "full-shard"))  # type: ignore[arg-type]
    assert kept_gathered_layer_bytes(_layer(llama_2_7b, sgo), sgo) == 2 * LAYER_NUMEL
    assert kept_gathered_layer_bytes(_layer(llama_2_7b, full), full) == 0
    a, b = _candidates(llama_2_7b, sgo), _candidates(llama_2_7b, full)
    # end of forward: all 32 bf16 layers gathered; FULL_SHARD's forward peaks with the current
    # and the prefetched layer (2) inside the last layer, or with the current one (1) at the loss
    layer = 404_766_720
    assert (32 - 2) * layer <= a["forward"] - b["forward"] <= (32 - 1) * layer
    # the optimizer step sees the same sharded fp32 weights (4 PSI / 8), not full ones
    assert a["optimizer"] == b["optimizer"]


def test_no_shard_makes_its_16bit_copy_per_unit_like_full_shard(llama_2_7b: ModelSpec) -> None:
    # Note [FSDP1 NO_SHARD's 16-bit copy]: torch's post_reshard frees _mp_shard after each
    # unit's forward, so nothing is kept from forward to backward; and at once (no free event
    # is queued for NO_SHARD, and no forward prefetch): the forward holds one layer's 16-bit
    # copy (2 x LAYER_NUMEL bytes) where FULL_SHARD's holds two (the running layer's and the
    # previous one's, freed and pending: Note [FSDP1 unshard stream pool]); beyond that only
    # the states differ: whole fp32 weights and gradients instead of 1/8 shards
    base = {"framework": "accelerate-fsdp", "data_parallel_size": 8, "seq_len": 512}
    none = TrainingConfig(**base, **fsdp_settings(0, "no-shard"))  # type: ignore[arg-type]
    full = TrainingConfig(**base, **fsdp_settings(0, "full-shard"))  # type: ignore[arg-type]
    assert kept_gathered_layer_bytes(_layer(llama_2_7b, none), none) == 0
    a, b = _candidates(llama_2_7b, none), _candidates(llama_2_7b, full)
    # so the forward peaks differ by that copy and the model states: whole fp32 weights and Adam
    # states (4 + 8 B per parameter) against this rank's shards of them; no DDP buckets (FSDP1
    # all-reduces flat_param.grad itself, _reduce_grad_no_shard), no kept copies
    whole, sharded = state_layout(llama_2_7b, none), state_layout(llama_2_7b, full)
    assert whole.total("param_bytes") + whole.total("state_bytes") == 12 * PSI
    shards = sharded.total("param_bytes") + sharded.total("state_bytes")
    assert 12 * PSI // 8 <= shards < 12 * PSI // 8 + 12 * 8 * 300  # each tensor rounded up
    assert a["forward"] - b["forward"] == 12 * PSI - shards - 2 * LAYER_NUMEL


def test_no_shard_makes_each_units_gradient_at_its_post_backward(llama_2_7b: ModelSpec) -> None:
    # Note [FSDP1 NO_SHARD's 16-bit copy]: FSDP1's post-backward hook casts a unit's flat
    # gradient to fp32 once the unit's backward is done, so the head's gradient (in the root
    # unit with the embedding) is made after every layer's, at the end of the backward
    training = TrainingConfig(framework="accelerate-fsdp", data_parallel_size=8, seq_len=512)
    est = estimate_analytic(llama_2_7b, training, simulate_allocator=False)
    made = [
        "head" if ev.module == "head" else "layer"
        for ev in est.schedules[0].events()
        if ev.action == "alloc"
        and ev.phase == "backward"
        and ev.category.name == "GRADIENT"
        and ev.module != "embedding"
    ]
    # the warm-up step and the recorded one: 32 layers of 7 linears and 2 norms, then the
    # head group's (the final norm and the head)
    assert made == 2 * (["layer"] * 32 * 9 + ["head"] * 2)


# -- item 3: Megatron grad buffer from init; fused multi-tensor Adam ------------------------


def test_megatron_grad_buffer_exists_in_the_forward(llama_2_7b: ModelSpec) -> None:
    # megatron param_and_grad_buffer.py: grad_data = torch.zeros(...) at wrap time, fp32
    assert gradients_alive_in_forward(TrainingConfig(framework="megatron"))
    assert not gradients_alive_in_forward(TrainingConfig(framework="deepspeed", zero_stage=1))
    # DeepSpeed ZeRO-3: stage3.py grad_partitions_flat_buffer from init
    assert gradients_alive_in_forward(TrainingConfig(framework="deepspeed", zero_stage=3))
    assert not gradients_alive_in_forward(TrainingConfig(zero_stage=3))
    kw = {"seq_len": 512}
    for fw, stage, grad_bytes in (("megatron", 0, 0), ("deepspeed", 1, 2 * PSI)):
        kw["zero_stage"] = stage
        one = _candidates(llama_2_7b, TrainingConfig(framework=fw, **kw))  # type: ignore[arg-type]
        acc = _candidates(
            llama_2_7b, TrainingConfig(framework=fw, gradient_accumulation_steps=2, **kw)
        )  # type: ignore[arg-type]
        # accumulation adds the gradients to the forward unless they were there already:
        # DeepSpeed's bf16 gradients 2 x PSI = 13,476,831,232 B; Megatron's already counted
        assert acc["forward"] - one["forward"] == grad_bytes


def test_deepspeed_bf16_without_zero_runs_the_bf16_optimizer(llama_2_7b: ModelSpec) -> None:
    # deepspeed/runtime/engine.py _do_optimizer_sanity_check: bf16 weights with fp32 gradient
    # accumulation -> BF16_Optimizer (before 0.17.6 get_data_types made fp32 the default for
    # bf16 without ZeRO; since then it must be asked for); bf16_optimizer.py: bf16 weights
    # (2 B), one flat fp32 gradient buffer of every parameter from init (4 B, never
    # partitioned) beside the parameters' own bf16 .grad (2 B; zeroed in place, never freed
    # without ZeRO from 0.16.5), fp32 master + Adam moments on this rank's 1/N partition
    # ((4 + 8) B / N) (from 0.18.5 that explicit fp32 mix is refused: see the test below)
    for kw in (
        {"deepspeed_version": "0.17.5"},
        {"grad_accum_dtype": "float32", "deepspeed_version": "0.18.4"},
    ):
        t = TrainingConfig(framework="deepspeed", data_parallel_size=4, **kw)  # type: ignore[arg-type]
        assert t.deepspeed_optimizer == "bf16"
        est = estimate_analytic(llama_2_7b, t, simulate_allocator=False)  # type: ignore[arg-type]
        assert est.model_states_bytes == {
            "parameters": 2 * PSI,
            "gradients": 4 * PSI + 2 * PSI,
            "optimizer_states": 12 * PSI // 4,
        }
        assert gradients_alive_in_forward(t)
    # ZeRO-1 keeps bf16 gradients (grad_accum_dtype = model dtype with ZeRO on), none in forward
    z1 = TrainingConfig(framework="deepspeed", zero_stage=1, data_parallel_size=4)
    assert z1.grad_dtype == "bfloat16" and not gradients_alive_in_forward(z1)
    # fp16 runs FP16_Optimizer, not BF16_Optimizer: 16-bit gradients, unpartitioned states
    fp16 = TrainingConfig(framework="deepspeed", precision="16-mixed", data_parallel_size=4)
    assert not fp16.bf16_optimizer and fp16.grad_dtype == "float16"
    # Megatron and the other frameworks are untouched
    assert not TrainingConfig(framework="pytorch-amp", data_parallel_size=4).bf16_optimizer


def test_deepspeed_optimizer_wrapper_follows_the_engine() -> None:
    # engine.py get_data_types / _do_optimizer_sanity_check (0.17.5 and 0.19.8 sdists):
    # (precision, zero stage, data_types.grad_accum_dtype, version) -> wrapper, gradient dtype
    cases = [
        # BF16_Optimizer: the bf16 .grad autograd makes (its fp32 buffer is a second tensor)
        ("bf16-mixed", 0, None, "0.17.5", "bf16", "bfloat16"),  # fp32 default without ZeRO
        ("bf16-mixed", 0, None, None, "fp16", "bfloat16"),  # DDP_BFLOAT16 since 0.17.6
        ("bf16-mixed", 0, "float32", "0.18.4", "bf16", "bfloat16"),  # refused from 0.18.5
        ("16-mixed", 0, None, "0.14.4", "fp16", "float16"),
        ("32-true", 0, None, None, "none", "float32"),
        ("bf16-mixed", 1, "float32", None, "bf16", "bfloat16"),  # ZeRO-1 + fp32 -> BF16_Optimizer
        ("bf16-mixed", 1, None, None, "zero", "bfloat16"),
        ("16-mixed", 1, "float32", None, "zero", "float32"),  # grad_accum attribute, fp32
        ("bf16-mixed", 2, "float32", None, "zero", "bfloat16"),  # grads_in_partition: self.dtype
        ("bf16-mixed", 3, "float32", None, "zero", "float32"),  # grad_partitions_flat_buffer
        ("bf16-mixed", 3, None, None, "zero", "bfloat16"),
    ]
    for precision, stage, accum, version, wrapper, grad in cases:
        t = TrainingConfig(
            framework="deepspeed",
            precision=precision,  # type: ignore[arg-type]
            zero_stage=stage,
            grad_accum_dtype=accum,
            deepspeed_version=version,
            data_parallel_size=4,
        )
        assert (t.deepspeed_optimizer, t.grad_dtype) == (wrapper, grad), (precision, stage, accum)
    # ZeRO-1 + fp32 accumulation with the optimizer offloaded stays the ZeRO optimizer
    off = TrainingConfig(
        framework="deepspeed", zero_stage=1, grad_accum_dtype="float32", offload="optimizer"
    )
    assert off.deepspeed_optimizer == "zero"
    # what DeepSpeed refuses (NotImplementedError) is refused, naming the field
    for kw in (
        {"grad_accum_dtype": "bfloat16", "deepspeed_version": "0.16.9"},
        {"precision": "16-mixed", "grad_accum_dtype": "float32"},
    ):
        with pytest.raises(SpecError, match="grad_accum_dtype"):
            TrainingConfig(framework="deepspeed", **kw)  # type: ignore[arg-type]
    with pytest.raises(SpecError, match="allowed with: deepspeed"):
        TrainingConfig(framework="megatron", grad_accum_dtype="float32")
    with pytest.raises(SpecError, match="float32, bfloat16, float16"):
        TrainingConfig(framework="deepspeed", grad_accum_dtype="fp8")


def test_cli_deepspeed_version_and_grad_accum_dtype_are_reported(invoke: Invoke) -> None:
    args = ["estimate", "gpt2", "-s", "128", "--framework", "deepspeed", "--json"]
    new = json.loads(invoke(*args).stdout)["config"]
    assert (new["grad_accum_dtype"], new["deepspeed_optimizer"]) == ("bfloat16", "fp16")
    old = invoke(*args, "--deepspeed-version", "0.16.9")
    config = json.loads(old.stdout)["config"]
    assert (config["grad_accum_dtype"], config["deepspeed_optimizer"]) == ("float32", "bf16")
    fp32_args = [*args, "--set", "grad-accum-dtype=float32", "--deepspeed-version", "0.18.4"]
    fp32 = json.loads(invoke(*fp32_args).stdout)
    assert fp32["config"]["deepspeed_optimizer"] == "bf16"
    # DeepSpeed 0.18.5+ (the default 0.19.8): engine.py raises NotImplementedError for it
    now = invoke(*args, "--set", "grad-accum-dtype=float32", exit_code=2)
    assert "0.18.5 and later refuse" in now.output
    refused = invoke(
        *args, "--deepspeed-version", "0.16.9", "--set", "grad-accum-dtype=bfloat16", exit_code=None
    )
    assert refused.exit_code != 0 and "grad_accum_dtype" in refused.output


def test_deepspeed_gradient_copies_at_the_step(llama_2_7b: ModelSpec) -> None:
    from trainmem.analytic.buffers import deepspeed_step_gradient_copies

    # stage_1_and_2.py step: flatten(averaged_gradients).to(fp32): a bf16 flat copy of this
    # rank's partition (freed once .to returns) + its fp32 copy (kept through optimizer.step).
    # Partition: PSI padded to a multiple of 2 x 8 (PSI = 16 x 421,150,976 already is), / 8
    part = PSI // 8
    assert part == 842_301_952
    z2 = TrainingConfig(framework="deepspeed", zero_stage=2, data_parallel_size=8, seq_len=512)
    assert deepspeed_step_gradient_copies(PSI, z2) == (2 * part, 4 * part)
    # the optimizer phase peaks at the model states + both cuBLAS workspaces + 2 + 4 B / element
    est = estimate_analytic(llama_2_7b, z2, simulate_allocator=False)  # type: ignore[arg-type]
    states = sum(est.model_states_bytes.values())
    assert states == 2 * PSI + 2 * part + 12 * part  # 2 + (2 + 12) / 8 B per parameter
    workspaces = 2 * 8_519_680
    assert est.details["phase_peaks_bytes"]["optimizer"] == states + workspaces + 6 * part  # type: ignore[index]
    # padding: 10 elements over 4 ranks pad to 16 (multiple of 2 x 4): partitions of 4
    small = TrainingConfig(framework="deepspeed", zero_stage=2, data_parallel_size=4)
    assert deepspeed_step_gradient_copies(10, small) == (2 * 4, 4 * 4)
    # fp32 gradients (ZeRO-1, fp16 weights, fp32 grad_accum attribute): .to(fp32) is the flat
    # copy itself, nothing transient
    z1 = TrainingConfig(
        framework="deepspeed",
        precision="16-mixed",
        zero_stage=1,
        grad_accum_dtype="float32",
        data_parallel_size=4,
    )
    assert deepspeed_step_gradient_copies(16, z1) == (0, 4 * 4)
    # FP16_Optimizer (fused_optimizer.py step): every p.grad.to(fp32), then their torch.cat
    fp16 = TrainingConfig(framework="deepspeed", precision="16-mixed", data_parallel_size=8)
    assert deepspeed_step_gradient_copies(PSI, fp16) == (4 * PSI, 4 * PSI)
    # BF16_Optimizer with fp32 accumulation steps on its fp32 buffer: no copy; offload: none
    bf16 = TrainingConfig(
        framework="deepspeed", grad_accum_dtype="float32", deepspeed_version="0.18.4"
    )
    assert deepspeed_step_gradient_copies(PSI, bf16) == (0, 0)
    off = TrainingConfig(framework="deepspeed", zero_stage=2, offload="optimizer")
    assert deepspeed_step_gradient_copies(PSI, off) == (0, 0)
    assert deepspeed_step_gradient_copies(PSI, TrainingConfig(zero_stage=2)) == (0, 0)


def test_deepspeed_zero2_accumulation_reduces_into_a_fresh_partition(llama_2_7b: ModelSpec) -> None:
    from trainmem.schedule import Repeat

    # stage_1_and_2.py: the kept averaged_gradients / all_grad_tensors hold the first
    # micro-batch's grads_in_partition; _release_ipg_buffers drops the attribute, so each later
    # micro-batch's backward allocates a fresh partition (2 B x PSI / 8) and adds it in
    def fresh(m: int) -> list[Op]:
        t = TrainingConfig(
            framework="deepspeed",
            zero_stage=2,
            data_parallel_size=8,
            seq_len=512,
            gradient_accumulation_steps=m,
        )
        est = estimate_analytic(llama_2_7b, t, simulate_allocator=False)  # type: ignore[arg-type]
        found: list[Op] = []

        def walk(items: tuple[object, ...], times: int) -> None:
            for item in items:
                if isinstance(item, Repeat):
                    walk(item.body, times * item.count)
                elif isinstance(item, Op) and item.key == "grad/fresh_partition":
                    found.extend([item] * times)

        walk(est.schedules[0].step, 1)
        return found

    assert fresh(1) == []
    ops = fresh(3)  # micro-batches 2 and 3: an alloc and a free each
    assert sorted(op.action for op in ops) == ["alloc", "alloc", "free", "free"]
    assert {op.size_bytes for op in ops} == {2 * PSI // 8}


def test_deepspeed_zero3_steps_one_sub_group_at_a_time(llama_2_7b: ModelSpec) -> None:
    from trainmem.analytic.buffers import deepspeed_zero3_sub_group_elements

    # stage3.py _create_fp16_sub_groups: partitions gathered until a group reaches 1e9
    assert deepspeed_zero3_sub_group_elements([6 * 10**8] * 3) == 12 * 10**8  # [1.2e9], [6e8]
    assert deepspeed_zero3_sub_group_elements([3 * 10**8] * 3) == 9 * 10**8  # one group
    assert deepspeed_zero3_sub_group_elements([4, 4, 4], sub_group_size=5) == 8  # [8], [4]
    # llama-2-7b over 8 ranks: a 842,301,952-element partition, one sub-group; the step holds
    # its bf16 flat copy and fp32 copy (_prepare_fp32_grad_for_sub_group) over the model
    # states, ZeRO-3's persistent IPG bucket (5e8 bf16) and both cuBLAS workspaces
    z3 = TrainingConfig(framework="deepspeed", zero_stage=3, data_parallel_size=8, seq_len=512)
    est = estimate_analytic(llama_2_7b, z3, simulate_allocator=False)  # type: ignore[arg-type]
    part = PSI // 8
    states = sum(est.model_states_bytes.values())
    assert states == 16 * part
    peak = states + 2 * 500_000_000 + 2 * 8_519_680 + (2 + 4) * part
    assert est.details["phase_peaks_bytes"]["optimizer"] == peak  # type: ignore[index]


def test_deepspeed_zero3_norms_each_gradient_partition_in_fp64(llama_2_7b: ModelSpec) -> None:
    # stage3.py step -> _get_norm_groups -> get_grad_norm_direct: g.to(device).double().norm(2)
    # per gradient partition, one at a time, before the sub-groups' copies (v0.9.0 .. v0.19.5).
    # llama-2-7b's largest parameters are the untied 32000 x 4096 embedding and head:
    # 131,072,000 elements, 8 B each in fp64, 1/8 of them over 8 ranks

    def optimizer_ops(**kw: object) -> list[tuple[str, str, int]]:
        t = TrainingConfig(framework="deepspeed", seq_len=512, **kw)  # type: ignore[arg-type]
        est = estimate_analytic(llama_2_7b, t, simulate_allocator=False)
        ops = _flat(est.schedules[0].step)
        return [(o.action, o.key, o.size_bytes) for o in ops if o.phase == "optimizer"]

    emb = 32000 * 4096
    ops = optimizer_ops(zero_stage=3, data_parallel_size=8)
    norm = ("alloc", "grad/norm_fp64", 8 * emb // 8)
    assert ops.index(norm) + 1 == ops.index(("free", "grad/norm_fp64", 8 * emb // 8))
    assert ops.index(norm) < ops.index(("alloc", "grad/step_copy", 2 * PSI // 8))
    # one rank: the whole embedding's gradient
    assert ("alloc", "grad/norm_fp64", 8 * emb) in optimizer_ops(zero_stage=3)
    # an offloaded optimizer (its norms are taken in the backward): none
    for kw in (
        {"zero_stage": 3, "offload": "optimizer"},
        {"zero_stage": 2, "offload": "optimizer"},
    ):
        assert not any(key == "grad/norm_fp64" for _, key, _ in optimizer_ops(**kw))
    # ZeRO-1/2 (stage_1_and_2.py scaled_global_norm -> get_grad_norm_direct): g.double() per
    # tensor's piece of this rank's flat partition, v0.9.0 .. v0.19.5. The flat group
    # (embedding, 32 layers, norm, head) padded to a multiple of 2N, N equal partitions:
    # N 8: 6,738,415,616 / 16 = 421,150,976 -> P = 842,301,952; the embedding (131,072,000
    # elements at offset 0) lies in rank 0's partition whole, the largest piece: 8 B x it.
    for stage in (1, 2):
        ops = optimizer_ops(zero_stage=stage, data_parallel_size=8)
        norm = ("alloc", "grad/norm_fp64", 8 * emb)
        assert ops.index(norm) + 1 == ops.index(("free", "grad/norm_fp64", 8 * emb))
        assert ops.index(norm) < ops.index(("alloc", "grad/step_copy", 2 * 842_301_952))
    # N 64: 6,738,415,616 / 128 = 52,643,872 -> P = 105,287,744, under the embedding: rank 0
    # holds its first P elements (rank 1 the other 25,784,256), a full partition: 8 B x P
    ops = optimizer_ops(zero_stage=2, data_parallel_size=64)
    assert ("alloc", "grad/norm_fp64", 8 * 105_287_744) in ops
    # ZeRO-1: the norm is taken on the partition once the full gradients are reduced into it
    ops = optimizer_ops(zero_stage=1, data_parallel_size=8)
    assert ops.index(("alloc", "grad/partition", 2 * 842_301_952)) < ops.index(norm)


def test_deepspeed_zero1_reduces_into_the_partition_before_the_step(llama_2_7b: ModelSpec) -> None:
    # ZeRO-1 (stage_1_and_2.py reduce_gradients -> copy_grads_in_partition): the flat partition
    # buffer (2 B x PSI / 8) is allocated while the full bf16 gradients (2 B x PSI) are alive;
    # then only the partition is left, and the step's copies (6 B x PSI / 8) come on it
    z1 = TrainingConfig(framework="deepspeed", zero_stage=1, data_parallel_size=8, seq_len=512)
    est = estimate_analytic(llama_2_7b, z1, simulate_allocator=False)  # type: ignore[arg-type]
    part = PSI // 8
    workspaces = 2 * 8_519_680
    weights_and_states = 2 * PSI + 12 * part
    peak = weights_and_states + 2 * PSI + 2 * part + workspaces
    assert est.details["phase_peaks_bytes"]["optimizer"] == peak  # type: ignore[index]
    # with two ranks the step's copies are the higher point: 2 + 2 + 4 B x PSI / 2
    two = TrainingConfig(framework="deepspeed", zero_stage=1, data_parallel_size=2, seq_len=512)
    est = estimate_analytic(llama_2_7b, two, simulate_allocator=False)  # type: ignore[arg-type]
    half = PSI // 2
    peak = 2 * PSI + 12 * half + max(2 * PSI + 2 * half, 8 * half) + workspaces
    assert est.details["phase_peaks_bytes"]["optimizer"] == peak  # type: ignore[index]


def test_deepspeed_casts_peft_adapters_to_bf16(llama_2_7b: ModelSpec) -> None:
    # engine.py _configure_distributed_model: every parameter of the wrapped module in bf16,
    # peft's fp32 adapters included; ZeRO-2 over 4 ranks: bf16 gradient 2 / 4 B, fp32 master +
    # Adam moments 12 / 4 B per element. LoRA A of q at r = 8: 8 x 4096 = 32,768 elements
    t = TrainingConfig(framework="deepspeed", lora_rank=8, zero_stage=2, data_parallel_size=4)
    a = next(s for s in tensor_states(llama_2_7b, t) if s.name == "lora_A.q")  # type: ignore[arg-type]
    assert (a.param_bytes, a.grad_bytes, a.state_bytes) == (2 * 32768, 2 * 32768 // 4, 98_304)
    # peft alone (pytorch-amp) keeps them fp32
    amp = TrainingConfig(lora_rank=8)
    a = next(s for s in tensor_states(llama_2_7b, amp) if s.name == "lora_A.q")  # type: ignore[arg-type]
    assert a.param_bytes == 4 * 32768


def test_megatron_and_deepspeed_adam_is_fused() -> None:
    for fw in ("megatron", "deepspeed"):
        t = TrainingConfig(framework=fw)
        assert (
            optimizer_step_temporary_bytes(t, num_trainable_parameters=1000, largest_parameter=10)
            == 0
        )
        # an explicit foreach wins: one fp32 (master-dtype) copy, 4 x 1000
        t = TrainingConfig(framework=fw, optimizer_implementation="foreach")
        assert (
            optimizer_step_temporary_bytes(t, num_trainable_parameters=1000, largest_parameter=10)
            == 4000
        )


# -- item 8: device total: NCCL communicators, BLAS workspaces per GPU family -----------------


def test_blas_workspaces_per_gpu_family() -> None:
    from trainmem.specs.hardware import get_gpu

    # CublasHandlePool.cpp: ":4096:2:16:8" = 4096 KiB x 2 + 16 KiB x 8 before Hopper, 32 MiB on
    # 9.x-12.x; ROCm rocBLAS 128 MiB on gfx942 (32 MiB elsewhere) + hipBLASLt 76 MiB
    assert get_gpu("A100-80GB").cublas_workspace_bytes == 4096 * 1024 * 2 + 16 * 1024 * 8
    assert get_gpu("H100-80GB").cublas_workspace_bytes == 32 * 2**20
    assert get_gpu("MI300X").cublas_workspace_bytes == (128 + 76) * 2**20 == 213_909_504
    assert get_gpu("MI250").cublas_workspace_bytes == (32 + 76) * 2**20


def test_nccl_communicators_join_the_device_total(llama_2_7b: ModelSpec) -> None:
    from trainmem.analytic.buffers import nccl_communicator_bytes

    mib = 2**20
    assert nccl_communicator_bytes(TrainingConfig()) == {}
    # NVIDIA/nccl#964: 688 MB for a group of more than two ranks, 544 MB for two
    t = TrainingConfig(data_parallel_size=8, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert nccl_communicator_bytes(t) == {
        "data": 688 * mib,
        "tensor": 544 * mib,
        "pipeline": 544 * mib,
    }
    hybrid = TrainingConfig(data_parallel_size=32, zero_stage=3, shard_group_size=8)
    assert nccl_communicator_bytes(hybrid) == {"shard": 688 * mib, "replicate": 688 * mib}
    dp = TrainingConfig(data_parallel_size=8, zero_stage=3, seq_len=512)
    est = estimate_analytic(llama_2_7b, dp, simulate_allocator=False)  # type: ignore[arg-type]
    b = est.breakdown
    assert b.device_total_bytes - b.reserved_bytes == DEFAULT_CUDA_CONTEXT_BYTES + 688 * mib


# -- item 4: DeepSpeed gradient buckets ------------------------------------------------------


def test_deepspeed_gradient_buckets(llama_2_7b: ModelSpec) -> None:
    from trainmem.analytic.buffers import (
        deepspeed_backward_bucket_bytes,
        deepspeed_persistent_bucket_bytes,
    )

    def ds(**kw: object) -> TrainingConfig:
        return TrainingConfig(framework="deepspeed", data_parallel_size=8, seq_len=512, **kw)  # type: ignore[arg-type]

    # stage_1_and_2.py backward(): torch.empty(reduce_bucket_size = 5e8, dtype=bf16), a second
    # one with overlap_comm: 2 B x 5e8 = 1e9 B, 2e9 B
    assert deepspeed_backward_bucket_bytes(llama_2_7b, ds(zero_stage=2)) == 1_000_000_000  # type: ignore[arg-type]
    assert (
        deepspeed_backward_bucket_bytes(llama_2_7b, ds(zero_stage=1, overlap_comm=True))
        == 2 * 10**9
    )  # type: ignore[arg-type]
    # "auto" (HF Trainer): hidden_size^2 = 4096^2 elements, 2 bytes each
    auto = ds(zero_stage=2, reduce_bucket_size="auto")
    assert deepspeed_backward_bucket_bytes(llama_2_7b, auto) == 2 * 4096 * 4096 == 33_554_432  # type: ignore[arg-type]
    # stage3.py __init__: one bucket for the whole run, not a backward one
    z3 = ds(zero_stage=3)
    assert deepspeed_persistent_bucket_bytes(llama_2_7b, z3) == 1_000_000_000  # type: ignore[arg-type]
    assert deepspeed_backward_bucket_bytes(llama_2_7b, z3) == 0  # type: ignore[arg-type]
    assert deepspeed_backward_bucket_bytes(llama_2_7b, TrainingConfig(zero_stage=2)) == 0  # type: ignore[arg-type]
    # the closed form adds it to every candidate of stage 3, to backward ones below
    big, small = (
        _candidates(llama_2_7b, z3),
        _candidates(llama_2_7b, ds(zero_stage=3, reduce_bucket_size=1)),
    )
    assert {k: big[k] - small[k] for k in big} == {k: 2 * (5 * 10**8 - 1) for k in big}
    big, small = (
        _candidates(llama_2_7b, ds(zero_stage=2)),
        _candidates(llama_2_7b, ds(zero_stage=2, reduce_bucket_size=1)),
    )
    assert big["optimizer"] == small["optimizer"] and big["forward"] == small["forward"]
    assert big["backward"] - small["backward"] == 2 * (5 * 10**8 - 1)


def test_ds_config_buckets_are_read(tmp_path: object) -> None:
    from trainmem.specs.framework_configs import deepspeed_settings

    zero = {"stage": 2, "reduce_bucket_size": "auto", "overlap_comm": True}
    out = deepspeed_settings({"zero_optimization": zero})
    assert (out["reduce_bucket_size"], out["overlap_comm"]) == ("auto", True)
    out = deepspeed_settings({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2e8}})
    assert out["reduce_bucket_size"] == 200_000_000
    out = deepspeed_settings({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9}})
    assert out["stage3_max_live_parameters"] == 1_000_000_000
    out = deepspeed_settings({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 5e8}})
    assert out["stage3_max_reuse_distance"] == 500_000_000


# -- item 6: torchao low-bit AdamW -----------------------------------------------------------


def test_torchao_low_bit_adamw_states(llama_2_7b: ModelSpec) -> None:
    # torchao optim/adam.py: AdamW4bit block 128 (packed 4-bit codes n/2 B + fp32 scale per
    # block), AdamWFp8 block 256 (float8 codes n B + fp32 scale per block); two states each
    n = 4096 * 4096
    four = {s.name: s for s in tensor_states(llama_2_7b, TrainingConfig(optimizer="adamw-4bit"))}  # type: ignore[arg-type]
    assert four["q"].state_bytes == 2 * (n // 2 + 4 * n // 128) == 17_825_792
    # a 4096-element norm weight is quantized too (>= 4096 and a multiple of 128)
    assert four["vector"].state_bytes == 2 * (4096 // 2 + 4 * 4096 // 128) == 4352
    fp8 = {s.name: s for s in tensor_states(llama_2_7b, TrainingConfig(optimizer="adamw-fp8"))}  # type: ignore[arg-type]
    assert fp8["q"].state_bytes == 2 * (n + 4 * n // 256) == 34_078_720
    # LoRA A of r=8 over 4096 inputs: 32768 elements, quantized; GPT-2's 768-wide bias is not
    lora = TrainingConfig(optimizer="adamw-4bit", lora_rank=8)
    a = next(s for s in tensor_states(llama_2_7b, lora) if s.name == "lora_A.q")  # type: ignore[arg-type]
    assert a.state_bytes == 2 * (32768 // 2 + 4 * 32768 // 128) == 34_816
    gpt2 = {
        s.name: s
        for s in tensor_states(load_model_spec("gpt2"), TrainingConfig(optimizer="adamw-fp8"))
    }
    assert gpt2["vector"].state_bytes == 2 * 4 * 768  # fp32 zeros_like for 768 < 4096


def test_torchao_cpu_offload_keeps_small_tensors_on_the_gpu() -> None:
    # torchao optim/cpu_offload.py: CPUOffloadOptimizer(minimal_size=4096) keeps parameters of
    # fewer than 4096 elements in a GPU optimizer (fused AdamW, two bf16 states under bf16-true)
    # and, with offload_gradients=True, frees only the larger ones' gradients. GPT-2 small:
    # per block ln_1 / ln_2 weight and bias (4 x 768), c_attn bias 2304, attn c_proj bias 768,
    # c_fc bias 3072, mlp c_proj bias 768; ln_f weight and bias; every matrix and wpe is larger
    small = 12 * (4 * 768 + 2304 + 768 + 3072 + 768) + 2 * 768
    assert small == 121_344
    gpt2 = load_model_spec("gpt2")

    def states(**kw: object) -> dict[str, int]:
        t = TrainingConfig(precision="bf16-true", seq_len=128, **kw)  # type: ignore[arg-type]
        return estimate_analytic(gpt2, t, simulate_allocator=False).model_states_bytes

    n = states()["parameters"] // 2  # every parameter, bf16
    assert states(framework="torchtune")["optimizer_states"] == 2 * 2 * n
    ao = states(framework="torchtune", offload="optimizer")
    assert ao["optimizer_states"] == 2 * 2 * small and ao["gradients"] == 2 * n
    ao_grads = states(framework="torchtune", offload="optimizer+gradients")
    assert ao_grads["optimizer_states"] == 2 * 2 * small
    # the larger gradients leave in their hooks as soon as made (Note [torchao gradient
    # offload]): the most gradient bytes at once are at block 0's MLP c_proj weight (768 x
    # 3072, its first), beside the tied wte's (50257 x 768: the head's part waits in autograd's
    # buffer for the lookup's before its hook runs) and the small ones kept by then, ln_f's and
    # the 11 later blocks' (9,984 elements each); bf16, 2 B
    held = 50257 * 768 + 768 * 3072 + 2 * 768 + 11 * (4 * 768 + 2304 + 768 + 3072 + 768)
    assert ao_grads["gradients"] == 2 * held
    # DeepSpeed's ZeRO-Offload moves every state (its own rule), and so does FSDP's CPU offload
    assert states(framework="deepspeed", offload="optimizer")["optimizer_states"] == 0
    # offload_gradients=True "is not compatible with gradient accumulation" (optim/README.md)
    with pytest.raises(SpecError, match="offload"):
        TrainingConfig(
            framework="torchtune", offload="optimizer+gradients", gradient_accumulation_steps=2
        )


# -- item 9: the FSDP2 root gather is a new buffer beside the shard ---------------------------


def test_fsdp2_root_gather_does_not_subtract_the_shard(llama_2_7b: ModelSpec) -> None:
    from trainmem.analytic.buffers import root_gathered_bytes

    layout = state_layout(
        llama_2_7b, TrainingConfig(framework="fsdp2", data_parallel_size=8, zero_stage=3)
    )  # type: ignore[arg-type]
    outer = layout.embedding + layout.head
    # embeddings + LM head 2 x 32000 x 4096 + final norm 4096 = 262,148,096 elements, gathered
    # in bf16 (MixedPrecisionPolicy); the fp32 shard (4 B / 8 ranks each) is not subtracted
    fsdp2 = TrainingConfig(framework="fsdp2", data_parallel_size=8, zero_stage=3)
    assert root_gathered_bytes(outer, fsdp2) == 2 * 262_148_096 == 524_296_192
    amp = TrainingConfig(data_parallel_size=8, zero_stage=3)
    assert root_gathered_bytes(outer, amp) == 4 * 262_148_096


def test_gpt2_hf_only_terms_not_under_megatron() -> None:
    # transformers GPT-2: DynamicCache k/v copies (2 c h t) and gelu_new as 5 separate tensors
    # (5 c i t); Megatron's own GPT runs a fused bias-GELU that saves its input (+ the down
    # projection's input: 2 c i t) and has no cache. gpt2: h = 768, i = 3072; t = 128.
    gpt2 = load_model_spec("gpt2")
    kw = {"precision": "bf16-mixed", "seq_len": 128, "dropout": False}
    hf = layer_activation_terms(gpt2, TrainingConfig(framework="deepspeed", **kw))  # type: ignore[arg-type]
    mg = layer_activation_terms(gpt2, TrainingConfig(framework="megatron", **kw))  # type: ignore[arg-type]
    assert hf["attention/kv_cache_copy"] == 2 * 2 * 768 * 128
    assert "attention/kv_cache_copy" not in mg
    assert hf["mlp/activation"] == 5 * 2 * 3072 * 128 == 3_932_160
    assert mg["mlp/activation"] == 2 * 2 * 3072 * 128 == 1_572_864


def test_peft_kbit_training_keeps_non_quantized_weights_in_fp32(llama_2_7b: ModelSpec) -> None:
    # peft prepare_model_for_kbit_training: every non-Params4bit 16-bit parameter -> fp32
    kw = {"lora_rank": 8, "quantize_base": "nf4", "precision": "bf16-true"}
    peft = {s.name: s for s in tensor_states(llama_2_7b, TrainingConfig(**kw))}  # type: ignore[arg-type]
    lit = {s.name: s for s in tensor_states(llama_2_7b, TrainingConfig(framework="litgpt", **kw))}  # type: ignore[arg-type]
    assert peft["embedding/tokens"].param_bytes == 4 * 32000 * 4096 == 524_288_000
    assert lit["embedding/tokens"].param_bytes == 2 * 32000 * 4096
    assert peft["vector"].param_bytes == 4 * 4096
    # the fp32 embedding output makes the residual stream fp32, and bitsandbytes returns each
    # quantized linear's output in its fp32 input's dtype (Linear4bit.forward ``.to(inp_dtype)``;
    # a real CPU run in tests/trace/test_traced_quantized.py): every activation fp32 (session
    # 22: "compute stays bf16" was the matmul's dtype only)
    assert compute_and_residual_bytes(TrainingConfig(**kw)) == (4, 4)  # type: ignore[arg-type]
    assert compute_and_residual_bytes(TrainingConfig(framework="litgpt", **kw)) == (2, 2)  # type: ignore[arg-type]


def test_deepspeed_zero3_prefetch_runs_ahead_to_max_live(llama_2_7b: ModelSpec) -> None:
    # Note [DeepSpeed ZeRO-3 parameter gathers]: every hooked module prefetches up to
    # min(max_live - n_available, bucket) more, so the layers' gathered elements rise to
    # stage3_max_live_parameters (1e9), or all 32 layers' if fewer
    from trainmem.analytic.zero3_gathers import zero3_gathers

    def gathers(**kw: object) -> object:
        t = TrainingConfig(framework="deepspeed", data_parallel_size=8, zero_stage=3, **kw)  # type: ignore[arg-type]
        lay = state_layout(llama_2_7b, t)
        return zero3_gathers(lay.layer, 32, lay.embedding, lay.head, tied=False, training=t)

    g = gathers()
    assert 32 * LAYER_NUMEL > 10**9
    assert g.pool == 2 * 10**9  # type: ignore[attr-defined]
    # a bigger budget: every layer (32 x 202,383,360 elements, bf16)
    assert gathers(stage3_max_live_parameters=10**10).pool == 2 * 32 * LAYER_NUMEL  # type: ignore[attr-defined]
    # a budget below one layer: the layer is fetched all the same; no prefetch bucket, no run-ahead
    assert gathers(stage3_max_live_parameters=10**8).pool == 2 * LAYER_NUMEL  # type: ignore[attr-defined]
    assert gathers(stage3_prefetch_bucket_size=0).pool == 2 * LAYER_NUMEL  # type: ignore[attr-defined]
    # untied 32000 x 4096 head (+ the final norm): 2 H = 262,160,384 elements; layer j from the
    # end is kept across the turnaround while 2 j x 202,383,360 + 262,160,384 < 1e9: j = 0, 1
    assert g.turnaround == 2 * 2 * LAYER_NUMEL  # type: ignore[attr-defined]
    assert g.head == 2 * (32000 * 4096 + 4096)  # type: ignore[attr-defined]
    assert g.embedding == 2 * 32000 * 4096  # type: ignore[attr-defined]
    # the embedding's next use is its own backward, 2 x (32 layers + head) elements away
    assert g.embedding_release == "stack.pre_forward" and g.embedding_backward  # type: ignore[attr-defined]
    assert g.copy(1000) == 0  # type: ignore[attr-defined]


def test_deepspeed_zero3_tied_small_model_keeps_the_embedding() -> None:
    # gpt2: 12 layers of 7,087,872 elements (12 h^2 + 13 h, h = 768), tied 50257 x 768 wte:
    # the layers (85,054,464 elements) are fewer than max_reuse_distance (1e9), so the tied
    # weight stays gathered from the lookup to its own backward, every layer across the
    # turnaround; fp32 (32-true), one rank with parameter offload on DeepSpeed 0.8.0 (a
    # gathered buffer beside the partition's host copy; one rank gathers nothing from 0.9.0)
    from trainmem.analytic.zero3_gathers import zero3_gathers

    model = load_model_spec("gpt2")
    t = TrainingConfig(
        framework="deepspeed", zero_stage=3, offload="optimizer+params", precision="32-true",
        deepspeed_version="0.8.0",
    )  # fmt: skip
    lay = state_layout(model, t)
    g = zero3_gathers(lay.layer, 12, lay.embedding, lay.head, tied=True, training=t)
    per_layer = 12 * 768 * 768 + 13 * 768
    assert per_layer == 7_087_872
    assert g.pool == g.turnaround == 4 * 12 * per_layer
    assert g.embedding_release == "embedding.post_backward" and not g.embedding_backward
    assert g.head == 0  # the tied weight is already gathered
    assert g.copy(4 * 50257 * 768) == 4 * 50257 * 768  # one rank: the whole partition
    # stage3_max_reuse_distance 1000 elements: nothing is kept between two uses; the embedding
    # (wte + wpe 1024 x 768) freed after the lookup, the tied head (wte + ln_f) fetched
    # again, the embedding gathered again for its own backward
    near = dataclasses.replace(t, stage3_max_reuse_distance=1000)
    g = zero3_gathers(lay.layer, 12, lay.embedding, lay.head, tied=True, training=near)
    assert g.turnaround == 0 and g.pool == 4 * 12 * per_layer
    assert g.embedding_release == "stack.pre_forward" and g.embedding_backward
    assert g.embedding == 4 * (50257 + 1024) * 768
    assert g.head == 4 * (50257 * 768 + 2 * 768)


def test_sdpa_expands_gqa_keys_and_values_with_a_padding_mask() -> None:
    # transformers sdpa_attention.py use_gqa_in_sdpa: torch >= 2.5 and attention_mask is None,
    # else repeat_kv. llama-3.1-8b: a = 32, k = 8, d = 128; bf16, t = 1024 tokens
    model = load_model_spec("llama-3.1-8b")
    kw = {"precision": "bf16-true", "seq_len": 1024}
    plain = layer_activation_terms(model, TrainingConfig(**kw))  # type: ignore[arg-type]
    padded = layer_activation_terms(model, TrainingConfig(padding_mask=True, **kw))  # type: ignore[arg-type]
    old = layer_activation_terms(model, TrainingConfig(torch_version="2.4", **kw))  # type: ignore[arg-type]
    assert plain["attention/v"] == 2 * 8 * 128 * 1024 == 2_097_152
    assert padded["attention/v"] == old["attention/v"] == 2 * 32 * 128 * 1024 == 8_388_608
    assert padded["attention/q_k"] == 2 * (32 + 32) * 128 * 1024 == 16_777_216
    flash = layer_activation_terms(
        model, TrainingConfig(attention="flash", padding_mask=True, **kw)
    )  # type: ignore[arg-type]
    assert flash["attention/v"] == 2_097_152  # flash-attn takes kv heads (varlen), no repeat


def test_set_types_optional_framework_fields() -> None:
    from trainmem.cli.options import parse_set

    out = parse_set("reduce-bucket-size=200000000 overlap-comm=true shard-group-size=8")
    assert out == {"reduce_bucket_size": 200_000_000, "overlap_comm": True, "shard_group_size": 8}
    assert parse_set("reduce-bucket-size=auto") == {"reduce_bucket_size": "auto"}


def test_torch_adafactor_versus_transformers_adafactor() -> None:
    # torch/optim/_adafactor.py: one var_estimate (row_var @ col_var) per parameter in its dtype,
    # all at once with foreach; transformers' Adafactor.step on fp32 weights and gradients:
    # `update = (grad**2) + eps` (two fp32 tensors while the sum is built), the factored
    # `update = _approx_sq_grad(...)` (new product beside the old update), `p.add_(-update)`
    # (-update beside update): two fp32 temporaries of the largest parameter
    kw = {"optimizer": "adafactor", "precision": "32-true"}
    n, big = 1000, 10
    torch_foreach = TrainingConfig(**kw)  # type: ignore[arg-type]
    assert torch_foreach.adafactor_implementation == "torch"
    assert (
        optimizer_step_temporary_bytes(
            torch_foreach, num_trainable_parameters=n, largest_parameter=big
        )
        == 4 * n
    )
    loop = TrainingConfig(optimizer_implementation="for-loop", **kw)  # type: ignore[arg-type]
    assert (
        optimizer_step_temporary_bytes(loop, num_trainable_parameters=n, largest_parameter=big)
        == 4 * big
    )
    for hf in (
        TrainingConfig(framework="hf-trainer", **kw),
        TrainingConfig(torch_version="2.4", **kw),
    ):  # type: ignore[arg-type]
        assert hf.adafactor_implementation == "transformers"
        assert (
            optimizer_step_temporary_bytes(hf, num_trainable_parameters=n, largest_parameter=big)
            == 2 * 4 * big
        )
    # bf16 weights and gradients (bf16-true): grad.float() and p.float() add two fp32 copies
    # kept through the parameter's step: 4 x 4 B per element of the largest parameter
    true16 = TrainingConfig(framework="hf-trainer", optimizer="adafactor", precision="bf16-true")
    assert (
        optimizer_step_temporary_bytes(true16, num_trainable_parameters=n, largest_parameter=big)
        == 4 * 4 * big
    )


def test_cli_hf_trainer_with_fsdp_is_accelerate_fsdp() -> None:
    from trainmem.cli.options import training_from_options

    t = training_from_options("gpt2", {"framework": "hf-trainer", "fsdp": "shard-grad-op"})
    assert (t.framework, t.zero_stage, t.reshard_after_forward) == ("accelerate-fsdp", 3, False)
    assert training_from_options("gpt2", {"framework": "hf-trainer"}).framework == "hf-trainer"


@pytest.mark.parametrize(
    ("stage", "version", "params", "grads", "states"),
    [
        # ZeRO-1: fp32 weights and gradients whole; fp32 copy 4 + exp_avg 4 + exp_avg_sq 4,
        # sharded: 12 / 4 = 3 bytes per parameter of optimizer state on each of 4 ranks
        (1, None, 4, 4, 3),
        # ZeRO-2: gradients sharded too, 4 / 4 = 1 byte per parameter
        (2, None, 4, 1, 3),
        # ZeRO-3 since 0.18.2 reuses the fp32 partition: states 8 / 4 = 2 bytes per parameter
        (3, None, 1, 1, 2),
        # ZeRO-3 before 0.18.2 cloned it (stage3.py .clone().float().detach()): 12 / 4 = 3
        (3, "0.18.1", 1, 1, 3),
    ],
)
def test_deepspeed_zero_keeps_an_fp32_copy_of_fp32_weights(
    stage: int, version: str | None, params: int, grads: int, states: int
) -> None:
    # deepspeed/runtime/zero/stage_1_and_2.py: single_partition_of_fp32_groups is
    # parallel_partitioned_bit16_groups[i][partition_id].detach().clone().to(fp32), a second
    # tensor even when the model is fp32; AdamW's exp_avg and exp_avg_sq are fp32 beside it.
    # GPT-2 small, 124,439,808 parameters; every tensor's bytes divide by the 4 ranks.
    n = 124_439_808
    training = TrainingConfig(
        framework="deepspeed",
        precision="32-true",
        zero_stage=stage,
        data_parallel_size=4,
        deepspeed_version=version,
    )
    assert training.deepspeed_optimizer == "zero"
    got = tensor_states(load_model_spec("gpt2"), training)
    assert sum(s.param_bytes for s in got) == params * n
    assert sum(s.grad_bytes for s in got) == grads * n
    assert sum(s.state_bytes for s in got) == states * n


def test_deepspeed_zero2_fp32_copy_on_llama_2_7b_from_the_cli(invoke: Invoke) -> None:
    # 6,738,415,616 parameters over 8 ranks: fp32 copy 4 + moments 8 = 12 bytes / 8 each
    n = 6_738_415_616
    args = ["estimate", "llama-2-7b", "--framework", "deepspeed", "-p", "32-true"]
    args += ["--zero-stage", "2", "--data-parallel-size", "8", "-s", "128", "-c", "full", "--json"]
    r = invoke(*args)
    states = json.loads(r.stdout)["model_states_bytes"]
    assert states["optimizer_states"] == 12 * n // 8
    assert (states["parameters"], states["gradients"]) == (4 * n, 4 * n // 8)


def test_deepspeed_mixed_precision_master_copy_is_unchanged() -> None:
    # 16-bit weights: the fp32 master copy was already counted (ZeRO paper 2 + 2 + 12)
    t = TrainingConfig(framework="deepspeed", zero_stage=2, data_parallel_size=4)
    assert t.fp32_master_copy and t.master_weights
    plain = TrainingConfig(precision="32-true", zero_stage=2, data_parallel_size=4)
    assert not plain.fp32_master_copy  # torch's ZeRO (FSDP) steps the weights themselves


def test_gptq_bases_and_unprepared_bases_stay_16_bit_under_autocast(llama_2_7b: ModelSpec) -> None:
    # peft utils/other.py prepare_model_for_kbit_training: the fp32 cast is skipped for GPTQ
    # (``if not is_gptq_quantized ...``); without the cast a quantized base keeps the 16-bit
    # dtype transformers loaded it in (quantizer_bnb_4bit.update_torch_dtype: float16 when no
    # torch_dtype is given), so under autocast the embedding and the residual stream are 16-bit
    kw = {"lora_rank": 8, "precision": "bf16-mixed", "framework": "hf-trainer"}
    gptq = TrainingConfig(quantize_base="gptq-int4", **kw)  # type: ignore[arg-type]
    nf4 = TrainingConfig(quantize_base="nf4", **kw)  # type: ignore[arg-type]
    unprepared = TrainingConfig(quantize_base="nf4", prepare_kbit_training=False, **kw)  # type: ignore[arg-type]
    prepared = TrainingConfig(
        framework="fsdp-qlora", quantize_base="nf4", prepare_kbit_training=True, lora_rank=8
    )
    assert not gptq.kbit_fp32_upcast and nf4.kbit_fp32_upcast and not unprepared.kbit_fp32_upcast
    assert prepared.kbit_fp32_upcast  # an explicit value wins over the framework's
    # nf4 first: the explicit setting must not be answered from a cache keyed without it
    for training, embedding, residual in ((nf4, 4, 4), (unprepared, 2, 2), (gptq, 2, 2)):
        states = {s.name: s for s in tensor_states(llama_2_7b, training)}
        assert states["embedding/tokens"].param_bytes == embedding * 32000 * 4096
        assert states["vector"].param_bytes == embedding * 4096
        assert compute_and_residual_bytes(training) == (2, residual)
    # a full fine-tune under autocast keeps its fp32 weights and residual stream
    assert compute_and_residual_bytes(TrainingConfig(**{**kw, "lora_rank": 0})) == (2, 4)  # type: ignore[arg-type]


def test_deepspeed_zero3_linear_saves_frozen_inputs(llama_2_7b: ModelSpec) -> None:
    # zero.Init's persistent F.linear replacement (LinearFunctionForZeroStage3:
    # ctx.save_for_backward(input, ...) whatever requires grad): a frozen base keeps every
    # linear's input, as full fine-tuning does; 1 x 1024 tokens, bf16 (c = 2), LoRA on q, v
    from trainmem.analytic.activations import layer_activation_terms

    def terms(stage: int) -> dict[str, int]:
        t = TrainingConfig(
            framework="deepspeed", zero_stage=stage, data_parallel_size=8, precision="bf16-true",
            micro_batch_size=1, seq_len=1024, lora_rank=8, lora_targets=("q", "v"),
        )  # fmt: skip
        assert t.zero3_linear_saves_input is (stage == 3)
        return layer_activation_terms(llama_2_7b, t)

    z2, z3 = terms(2), terms(3)
    # gate / up read the post-attention norm's output: saved once, 2 x 4096 x 1024
    assert z2["mlp/input"] == 0 and z3["mlp/input"] == 2 * 4096 * 1024
    # down reads the gated product: 2 x 11008 x 1024 more, its own input term (Note [Frozen
    # down projection's input])
    assert z3["mlp/down_input"] - z2["mlp/down_input"] == 2 * 11008 * 1024
    assert z3["mlp/gated"] == z2["mlp/gated"]


def test_deepspeed_zero3_offload_on_one_gpu_gathers_in_order(llama_2_7b: ModelSpec) -> None:
    # Note [DeepSpeed ZeRO-3 parameter gathers] on one rank with parameter offload (fp32):
    # the embedding (32000 x 4096) gathered with its host partition's copy beside it, freed
    # before the pool (1e9 fp32 elements: 32 layers of 202,383,360 exceed it) fills; the
    # untied head (32000 x 4096 + the final norm) fetched while the pool is alive, its copy
    # beside it, released after the head's backward (DeepSpeed 0.8.0: one rank gathers as many
    # do; from 0.9.0 the copy is the gathered parameter, the next test)

    t = TrainingConfig(
        framework="deepspeed", zero_stage=3, offload="optimizer+params", precision="32-true",
        micro_batch_size=1, seq_len=64, activation_checkpointing="none",
        deepspeed_version="0.8.0",
    )  # fmt: skip
    est = estimate_analytic(llama_2_7b, t, simulate_allocator=False)

    ops = [
        (op.action, op.key, op.size_bytes)
        for op in _flat(est.schedules[0].step)
        if op.key.startswith("gather/")
    ]
    emb, head = 4 * 32000 * 4096, 4 * (32000 * 4096 + 4096)
    pool = 4 * 10**9
    assert ops[:8] == [
        ("alloc", "gather/embedding", emb),
        ("alloc", "gather/embedding/h2d", emb),
        ("free", "gather/embedding/h2d", emb),
        ("free", "gather/embedding", emb),
        ("alloc", "gather/pool", pool),
        ("alloc", "gather/head", head),
        ("alloc", "gather/head/h2d", head),
        ("free", "gather/head/h2d", head),
    ]
    # the forward's pool freed; kept across the turnaround, the layers j from the end whose two
    # uses are 2 j x 202,383,360 + 2 x 131,076,096 elements apart, below 1e9: j = 0, 1
    assert 2 * 202_383_360 + 2 * 131_076_096 < 10**9 < 4 * 202_383_360 + 2 * 131_076_096
    assert ops[8:11] == [
        ("free", "gather/pool", pool),
        ("alloc", "gather/kept", 4 * 2 * 202_383_360),
        ("free", "gather/head", head),
    ]


def test_deepspeed_zero3_one_rank_gathers_nothing_from_0_9(llama_2_7b: ModelSpec) -> None:
    # DeepSpeed partition_parameters.py all_gather_coalesced from 0.9.0 (PR #2953): a parameter
    # over one rank is not gathered, NoGatherCoalescedHandle sets param.data = param.ds_tensor.
    # data.to(device).view(shape): the partition itself on the GPU (no block), one host-to-device
    # copy when offloaded (that copy is the gathered parameter, nothing beside it). 0.8.0 has no
    # such path (read on the 0.8.0, 0.9.0, 0.12.3 and 0.19.5 tags)

    def gathers(**kw: object) -> list[tuple[str, str, int]]:
        kw = {"precision": "bf16-mixed", **kw}
        t = TrainingConfig(
            framework="deepspeed", zero_stage=3, micro_batch_size=1, seq_len=64,
            activation_checkpointing="none", **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        est = estimate_analytic(llama_2_7b, t, simulate_allocator=False)
        step = _flat(est.schedules[0].step)
        return [(op.action, op.key, op.size_bytes) for op in step if op.key.startswith("gather/")]

    assert TrainingConfig(framework="deepspeed", zero_stage=3).zero3_one_rank_views
    assert TrainingConfig(
        framework="deepspeed", zero_stage=3, deepspeed_version="0.9.0"
    ).zero3_one_rank_views
    assert not TrainingConfig(
        framework="deepspeed", zero_stage=3, deepspeed_version="0.8.0"
    ).zero3_one_rank_views
    assert not TrainingConfig(
        framework="deepspeed", zero_stage=3, data_parallel_size=2
    ).zero3_one_rank_views
    assert not TrainingConfig(framework="deepspeed", zero_stage=2).zero3_one_rank_views
    # one GPU, partitions on the GPU: no gathered weight at all (0.12.3, Qwen-1's README runs)
    assert gathers(deepspeed_version="0.12.3") == []
    assert gathers() == []
    # 0.8.0 on one GPU, and two ranks on any release, gather: the bf16 pool of 1e9 elements
    pool = 2 * 10**9
    assert ("alloc", "gather/pool", pool) in gathers(deepspeed_version="0.8.0")
    assert ("alloc", "gather/pool", pool) in gathers(data_parallel_size=2)
    # one GPU with the parameters offloaded (fp32): the embedding (32000 x 4096), the pool and
    # the untied head (+ the final norm) as the 0.8.0 test has them, without the h2d copies
    emb, head = 4 * 32000 * 4096, 4 * (32000 * 4096 + 4096)
    ops = gathers(offload="optimizer+params", precision="32-true")
    assert ops[:5] == [
        ("alloc", "gather/embedding", emb),
        ("free", "gather/embedding", emb),
        ("alloc", "gather/pool", 4 * 10**9),
        ("alloc", "gather/head", head),
        ("free", "gather/pool", 4 * 10**9),
    ]
    assert not any(key.endswith("/h2d") for _, key, _ in ops)


def test_deepspeed_zero3_gathers_allocate_on_the_all_gather_stream(llama_2_7b: ModelSpec) -> None:
    # DeepSpeed parameter_offload.py (v0.8.0 .. v0.19.5): ``self.__allgather_stream =
    # get_accelerator().Stream() if overlap_comm else get_accelerator().default_stream()``;
    # partitioned_param_coordinator.py fetch_sub_module gathers and waits inside ``with
    # get_accelerator().stream(self.__allgather_stream)``, so every gathered buffer
    # (partition_parameters.py all_gather_coalesced: ``torch.empty(buffer_size, ...)``) comes
    # from that stream's pool. overlap_comm is None -> True at stage 3 (runtime/zero/config.py
    # overlap_comm_valid). Two ranks, bf16: the pool is 1e9 elements, 2e9 bytes, either way.
    from trainmem.timeline import ALL_GATHER_STREAM

    def gathers(**kw: object) -> set[tuple[str, int]]:
        t = TrainingConfig(
            framework="deepspeed", zero_stage=3, data_parallel_size=2, precision="bf16-mixed",
            micro_batch_size=1, seq_len=64, activation_checkpointing="none",
            **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        est = estimate_analytic(llama_2_7b, t, simulate_allocator=False)
        step = _flat(est.schedules[0].step)
        ops = [op for op in step if op.key.startswith("gather/")]
        assert ("alloc", "gather/pool", 2 * 10**9) in [(o.action, o.key, o.size_bytes) for o in ops]
        return {(op.key, op.stream) for op in ops}

    on = gathers()
    assert {stream for _, stream in on} == {ALL_GATHER_STREAM} != {0}
    assert {key for key, _ in on} >= {"gather/pool", "gather/embedding", "gather/head"}
    assert on == gathers(overlap_comm=True)
    off = gathers(overlap_comm=False)
    assert {stream for _, stream in off} == {0}
    assert {key for key, _ in off} == {key for key, _ in on}
    # everything else stays on the default stream
    t = TrainingConfig(
        framework="deepspeed", zero_stage=3, data_parallel_size=2, precision="bf16-mixed",
        micro_batch_size=1, seq_len=64, activation_checkpointing="none",
    )  # fmt: skip
    step = _flat(estimate_analytic(llama_2_7b, t, simulate_allocator=False).schedules[0].step)
    assert {op.stream for op in step if not op.key.startswith("gather/")} == {0}


def test_deepspeed_zero3_head_and_embedding_new_gradients_are_whole(llama_2_7b: ModelSpec) -> None:
    # Note [Whole new gradients of the head and the embedding under ZeRO-3]: autograd makes
    # the gathered weight's full-shape .grad; stage3.py (v0.13.1, v0.14.2) leaves a gradient
    # larger than reduce_bucket_size out of the contiguous bucket (__add_grad_to_ipg_bucket),
    # reduce-scatters it as one tensor (reduce_scatter_coalesced: a view of it when its numel
    # divides by N) and frees it in partition_grads (param.grad = None). llama-2-7b's untied
    # 32000 x 4096 lm_head and embed_tokens over 4 ranks, bf16 gradients (DeepSpeed's
    # gradient_accumulation_dtype is the model dtype under ZeRO): 262,144,000 B each, whole,
    # where the rank's partition is 65,536,000 B; the final norm's 4096 x 2 = 8,192 B
    def new_grads(**kw: object) -> dict[str, int]:
        t = TrainingConfig(
            framework="deepspeed", zero_stage=3, precision="bf16-mixed", micro_batch_size=1,
            seq_len=64, activation_checkpointing="none", **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        est = estimate_analytic(llama_2_7b, t, simulate_allocator=False)
        step = _flat(est.schedules[0].step)
        return {
            op.key: op.size_bytes
            for op in step
            if op.action == "alloc" and op.key.startswith(("new_grad/head", "new_grad/embedding"))
        }

    whole = 32000 * 4096 * 2
    assert whole == 262_144_000
    four = new_grads(data_parallel_size=4)
    assert sorted(four.values()) == [8192, whole, whole]
    assert new_grads(data_parallel_size=8) == four  # whole on any number of ranks
    # one rank: the partition is the whole gradient anyway
    assert sorted(new_grads().values()) == [8192, whole, whole]


def test_deepspeed_zero2_head_and_embedding_new_gradients_are_whole(llama_2_7b: ModelSpec) -> None:
    # Note [Whole new gradients of the head and the embedding under ZeRO-2]: autograd makes
    # each micro-batch's .grad whole (zero_grad(set_to_none=True) in the backward's epilogue
    # leaves none defined); stage_1_and_2.py (v0.12.3, v0.16.4, v0.19.5)
    # reduce_independent_p_g_buckets_and_remove_grads copies it into the reduce bucket, or
    # keeps it as param.grad when larger than reduce_bucket_size until reduce_ipg_grads, and
    # copy_grads_in_partition moves this rank's piece into grads_in_partition. llama-2-7b's
    # untied 32000 x 4096 lm_head and embed_tokens, bf16 gradients, over 4 ranks: the new
    # gradient 32000 x 4096 x 2 = 262,144,000 B while the rank keeps 262,144,000 / 4 =
    # 65,536,000 B of it; the final norm's 4096 x 2 = 8,192 B, kept 2,048 B
    def backward(**kw: object) -> list[Op]:
        t = TrainingConfig(
            framework="deepspeed", zero_stage=2, precision="bf16-mixed", micro_batch_size=1,
            seq_len=64, activation_checkpointing="none", data_parallel_size=4, **kw,  # type: ignore[arg-type]
        )  # fmt: skip
        step = _flat(estimate_analytic(llama_2_7b, t, simulate_allocator=False).schedules[0].step)
        return [op for op in step if op.phase == "backward" and op.module in ("head", "embedding")]

    whole, kept = 32000 * 4096 * 2, 32000 * 4096 * 2 // 4
    assert (whole, kept) == (262_144_000, 65_536_000)
    ops = backward()
    new = [(op.action, op.size_bytes) for op in ops if op.key.startswith("new_grad/")]
    assert new == [
        ("alloc", 8192), ("free", 8192), ("alloc", whole), ("free", whole),  # head: norm, lm_head
        ("alloc", whole), ("free", whole),  # embedding
    ]  # fmt: skip
    # the rank's piece is made while the whole gradient exists
    keys = [(op.action, op.key) for op in ops if op.size_bytes in (whole, kept)]
    assert keys == [
        ("alloc", "new_grad/head/1"), ("alloc", "grad/head/1"), ("free", "new_grad/head/1"),
        ("alloc", "new_grad/embedding/0"), ("alloc", "grad/embedding/0"),
        ("free", "new_grad/embedding/0"),
    ]  # fmt: skip
    # a later micro-batch makes them whole again (not the 65,536,000 B piece)
    later = [op.size_bytes for op in backward(gradient_accumulation_steps=2)]
    assert later.count(whole) == 2 * 2 * 2 and kept in later
