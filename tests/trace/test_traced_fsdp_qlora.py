"""Answer.AI fsdp_qlora's FSDP1 over a 4-bit base traced for real on fake tensors (issue 26;
Note [Tracing FSDP1] in trainmem/trace/fsdp.py, Note [Traced quantized base] in
trainmem/trace/quantized.py): the packed codes stored in the model's dtype (bitsandbytes
``quant_storage``), flattened, sharded and gathered by torch's ``FullyShardedDataParallel``.

Expected sizes derived by hand for the 2-layer Qwen2 formula config (tests/models/formula/
qwen2.json: h = 64, i = 128, 4 heads of 16, 2 key/value heads, V = 512, untied head), nf4, LoRA
rank 16 on q and v (the default targets), bf16-true (fsdp_qlora's ``--precision bf16``):

* a layer's frozen flat parameter: the codes of q (64 x 64 values: 2,048 B = 1,024 bf16
  elements), k and v (64 x 32: 512 elements each), o (1,024), gate / up / down (64 x 128:
  2,048 each) = 9,216 elements, the biases of q, k, v (64 + 32 + 32) and two norms (2 x 64):
  9,472 bf16 elements, gathered as 18,944 B; over 4 ranks 2,368 elements = 4,736 B a rank;
* the root (embedding, final norm, head; the head is not quantized): 2 x 512 x 64 + 64 =
  65,600 elements, 32,800 B a rank;
* LoRA's A of q (16 x 64 in bf16, the base weight's dtype under fsdp_qlora: 2,048 B) and B of
  v (32 x 16: 1,024 B) each their own unit: 512 and 256 B a rank;
* the absmax statistics (one fp32 per 64 values: q 256 B, k / v 128, o 256, gate / up / down
  512 each = 2,304 B a layer) are bitsandbytes' ``QuantState``, no parameter: whole on every
  rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

pytest.importorskip("transformers")

from conftest import MODELS_DIR  # noqa: E402
from trainmem.breakdown import MemoryCategory  # noqa: E402
from trainmem.estimate import estimate  # noqa: E402
from trainmem.schedule import Op, Repeat, StepSchedule  # noqa: E402
from trainmem.specs.quantization import float_quant_storage  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
LAYER = "base_model.model.model.layers.{}"


def _fsdp_qlora(**changes: Any) -> TrainingConfig:
    base: dict[str, Any] = {
        "micro_batch_size": 2,
        "seq_len": 64,
        "framework": "fsdp-qlora",
        "lora_rank": 16,
        "quantize_base": "nf4",
        "precision": "bf16-true",
        "data_parallel_size": 4,
        "zero_stage": 3,
    }
    return TrainingConfig(**{**base, **changes})


def _setup_allocations(schedule: StepSchedule, category: MemoryCategory) -> dict[str, int]:
    """Bytes the step starts from in ``category``, by module (a repeated body's once per
    repeat)."""
    out: dict[str, int] = {}

    def walk(items: Any, count: int) -> None:
        for x in items:
            if isinstance(x, Repeat):
                walk(x.body, count * x.count)
            elif x.action == "alloc" and x.category is category:
                assert isinstance(x, Op)
                out[x.module] = out.get(x.module, 0) + count * x.size_bytes

    walk(schedule.setup or schedule.step, 1)
    return out


def _units(training: TrainingConfig, layer: int, a: int, b: int, whole: int) -> tuple[Any, Any]:
    """Both engines' estimates of ``training`` after checking the generic path's FSDP1 units
    by hand: the root's shard (32,800 B), each layer's (``layer`` B), LoRA's A of q and B of v
    (``a``, ``b``), and the buffers FSDP1 leaves whole (``whole`` B a layer)."""
    generic = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    analytic = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    schedule = generic.schedules[0]
    flat = _setup_allocations(schedule, MemoryCategory.PARAMETER)
    assert flat["_flat_param"] == 32_800
    for i in (0, 1):
        name = LAYER.format(i)
        assert flat[f"{name}._flat_param"] == layer
        assert flat[f"{name}.self_attn.q_proj.lora_A.default._flat_param"] == a
        assert flat[f"{name}.self_attn.v_proj.lora_B.default._flat_param"] == b
    buffers = _setup_allocations(schedule, MemoryCategory.BUFFER)
    assert sum(v for k, v in buffers.items() if k.endswith("quant_statistics")) == 2 * whole
    return generic, analytic


def test_quant_storage_is_the_dtype_fsdp_qlora_loads_the_model_in() -> None:
    # train.py 50efa1e: bf16 -> torch_dtype bf16; bf16_autocast / fp16_autocast -> fp32
    assert float_quant_storage(_fsdp_qlora()) == "bfloat16"
    assert float_quant_storage(_fsdp_qlora(precision="bf16-mixed")) == "float32"
    assert float_quant_storage(_fsdp_qlora(quantize_base="nf4-dq")) == "bfloat16"
    assert not _fsdp_qlora(precision="bf16-mixed").kbit_16bit_dense  # loaded in fp32
    # transformers' FSDP-QLoRA under accelerate: the dtype the model is loaded in, the weight
    # dtype under a *-true precision; under *-mixed the 16-bit dtype fms-acceleration loads it
    # in for --bf16 / --fp16 (no fp32 upcast: accelerate-fsdp runs no
    # prepare_model_for_kbit_training)
    assert float_quant_storage(_fsdp_qlora(framework="accelerate-fsdp")) == "bfloat16"
    assert float_quant_storage(_fsdp_qlora(framework="accelerate-fsdp", precision="32-true")) == (
        "float32"
    )
    mixed = _fsdp_qlora(framework="accelerate-fsdp", precision="bf16-mixed")
    assert mixed.kbit_16bit_dense and float_quant_storage(mixed) == "bfloat16"
    fp16 = _fsdp_qlora(framework="accelerate-fsdp", precision="16-mixed")
    assert float_quant_storage(fp16) == "float16"
    # peft's fp32 upcast asked for: fp32 norms beside 16-bit codes, no storage FSDP1 flattens
    upcast = _fsdp_qlora(framework="accelerate-fsdp", precision="bf16-mixed",
                         prepare_kbit_training=True)  # fmt: skip
    assert float_quant_storage(upcast) is None
    # fms-acceleration's GPTQ patch views qweight / qzeros as the model's dtype for FSDP1
    gptq = _fsdp_qlora(framework="accelerate-fsdp", quantize_base="gptq-int4")
    assert float_quant_storage(gptq) == "bfloat16"
    assert float_quant_storage(replace(gptq, precision="16-mixed")) == "float16"
    # the Trainer makes a bitsandbytes storage FSDP1's policy, not GPTQ's (it reads
    # quantization_method == BITS_AND_BYTES): under bf16-true GPTQ's units have no policy
    from trainmem.trace.fsdp import fsdp1_policy_dtype

    assert fsdp1_policy_dtype(_fsdp_qlora(framework="accelerate-fsdp")) == "bfloat16"
    assert fsdp1_policy_dtype(gptq) is None
    assert fsdp1_policy_dtype(replace(gptq, precision="16-mixed")) == "float16"
    # bitsandbytes' default uint8 elsewhere, GPTQ's int32 outside accelerate's FSDP1
    assert float_quant_storage(_fsdp_qlora(framework="pytorch-amp")) is None
    assert float_quant_storage(replace(gptq, framework="pytorch-amp")) is None


def test_fsdp1_flattens_float_stored_codes_by_hand_and_matches_the_formulas() -> None:
    generic, analytic = _units(_fsdp_qlora(), 4_736, 512, 256, 2_304)
    schedule = generic.schedules[0]
    # each layer's codes, biases and norms gathered for its forward (FULL_SHARD), in every
    # step the schedule expands to, and freed in it; layer 0's free is pending until the rate
    # limiter synchronises on it (Note [FSDP1 streams on the trace]): after layer 1's gather
    gathers = [ev for ev in schedule.events() if ev.size_bytes == 18_944 and ev.phase == "forward"]
    made = [ev.module for ev in gathers if ev.action == "alloc"]
    assert set(made) == {LAYER.format(0), LAYER.format(1)}
    assert made.count(LAYER.format(0)) == made.count(LAYER.format(1))
    assert len(made) == sum(ev.action == "free" for ev in gathers)
    order = [(ev.action, ev.module) for ev in gathers][:4]
    assert order == [("alloc", LAYER.format(0)), ("alloc", LAYER.format(1)),
                     ("free", LAYER.format(0)), ("free", LAYER.format(1))]  # fmt: skip
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_accelerate_fsdp_qlora_gathers_fp32_adapters_in_the_storage_dtype(precision: str) -> None:
    # bf16-mixed as fms-acceleration runs it (--bf16: the model loaded in bf16, the codes
    # stored in it, accelerate's autocast over it): the same units as bf16-true
    #
    # transformers' FSDP-QLoRA (BitsAndBytesConfig(bnb_4bit_quant_storage=bfloat16), the model
    # loaded in bf16) under accelerate's FSDP1: the frozen flat parameters as fsdp_qlora's
    # (4,736 B a rank a layer, 32,800 B the root), but peft upcasts the adapters on a 16-bit
    # base to fp32 (autocast_adapter_dtype) and accelerate keeps trainable flat parameters in
    # fp32: A of q 16 x 64 x 4 B = 4,096 B, 1,024 a rank; B of v 32 x 16 x 4 B, 512 a rank.
    # transformers' Trainer makes the policy the storage dtype (_fsdp_qlora_plugin_updates),
    # so A's shard is cast to bf16 (FSDP1's _mp_shard: 512 B) and gathered in bf16 (16 x 64 x
    # 2 = 2,048 B) for the forward, both transient.
    training = _fsdp_qlora(framework="accelerate-fsdp", precision=precision)
    generic, analytic = _units(training, 4_736, 1_024, 512, 2_304)
    schedule = generic.schedules[0]
    gathered = {
        ev.size_bytes
        for ev in schedule.events()
        if ev.phase == "forward" and ev.module.endswith("q_proj.lora_A.default")
        and ev.action == "alloc" and ev.category is MemoryCategory.TEMPORARY
    }  # fmt: skip
    assert gathered == {512, 2_048}
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01


def test_accelerate_fsdp_gptq_flattens_qweight_and_qzeros_by_hand() -> None:
    # fms-acceleration's AutoGPTQ plugin under accelerate's FSDP1 (autogptq_utils.py
    # build_patch_to_view_tensor_to_parameter_for_fsdp_gptq): qweight and qzeros viewed as
    # frozen Parameters of the model's dtype (bf16 here, bf16-mixed: the model loaded in bf16),
    # flattened and sharded with the layer's unit; scales (fp16) and g_idx (int32) stay
    # buffers, whole on every rank. Per linear (in, out), group 128 (one group, in <= 128):
    # qweight in x out / 2 B, qzeros out / 2 B, scales 2 out B, g_idx 4 in B:
    #   q, o (64, 64): 2,048 + 32 flattened, 128 + 256 whole; k, v (64, 32): 1,024 + 16, 64 + 256;
    #   gate, up (64, 128): 4,096 + 64, 256 + 256; down (128, 64): 4,096 + 32, 128 + 512.
    # A layer's flat parameter: 18,688 B of codes (9,344 bf16 elements), the q / k / v biases
    # (128) and two norms (128) in bf16: 9,600 elements, 19,200 B gathered, 4,800 B a rank;
    # 3,072 B of buffers a layer. The root and the fp32 adapters as for the 4-bit base above.
    training = _fsdp_qlora(framework="accelerate-fsdp", quantize_base="gptq-int4",
                           precision="bf16-mixed")  # fmt: skip
    generic, analytic = _units(training, 4_800, 1_024, 512, 3_072)
    schedule = generic.schedules[0]
    gathers = {
        ev.module
        for ev in schedule.events()
        if ev.size_bytes == 19_200 and ev.phase == "forward" and ev.action == "alloc"
    }
    assert gathers == {LAYER.format(0), LAYER.format(1)}
    # the formulas' model states: the same bytes a rank (the root; per layer the codes' shard,
    # the fp32 adapters: A and B of q 16 x 64 each and A of v 16 x 64, 1,024 B a rank each, B
    # of v 32 x 16, 512 B; the whole buffers)
    states = analytic.schedules[0].live_before_step()[MemoryCategory.PARAMETER]
    assert states == 32_800 + 2 * (4_800 + 3 * 1_024 + 512 + 3_072)
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [
        {"precision": "bf16-mixed"},  # fp32 codes, weights and adapters under autocast
        {"data_parallel_size": 1},  # torch switches FSDP1 on one rank to NO_SHARD
        {"zero_stage": 0},  # --sharding_strategy ddp
        {"reshard_after_forward": False},  # shard_grad_op
        {"quantize_base": "nf4-dq", "gradient_accumulation_steps": 2},
        {"activation_checkpointing": "full"},
    ],
    ids=["bf16-mixed", "one-gpu", "no-shard", "shard-grad-op", "nf4-dq-accumulation", "ckpt"],
)
def test_fsdp_qlora_variants_match_the_formulas(changes: dict[str, Any]) -> None:
    # the fast representative is the FULL_SHARD test above
    training = _fsdp_qlora(**changes)
    generic = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    analytic = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01


def test_accelerate_fsdp_qlora_adapters_read_in_the_storage_dtype_without_sharding() -> None:
    # FSDP1's NO_SHARD (one rank, or --fsdp no-shard) casts its flat parameters under the
    # policy like FULL_SHARD (Note [FSDP1 NO_SHARD's 16-bit copy]), so with transformers'
    # bf16-storage policy the fp32 adapters are read in bf16 (2 B) and peft's
    # x.to(lora_A.weight.dtype) makes no fp32 copy; without a 4-bit base and a *-true
    # precision no policy applies: fp32 adapters (4 B)
    from trainmem.analytic.lora import adapter_matmul_bytes

    for changes in ({"data_parallel_size": 1}, {"zero_stage": 0}, {}):
        assert adapter_matmul_bytes(_fsdp_qlora(framework="accelerate-fsdp", **changes)) == 2
    plain = _fsdp_qlora(framework="accelerate-fsdp", quantize_base="none", data_parallel_size=1)
    assert adapter_matmul_bytes(plain) == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [
        {"data_parallel_size": 1},
        {"zero_stage": 0},
        {"precision": "32-true"},
        {"quantize_base": "nf4-dq"},
        # the 16-bit model under accelerate's autocast: no NO_SHARD copy of its frozen units
        # (the policy's dtype is theirs); was 34 % over on the 2048-wide Llama
        {"precision": "bf16-mixed", "data_parallel_size": 1},
        {"quantize_base": "gptq-int4", "precision": "16-mixed", "zero_stage": 0},
        # no policy for GPTQ's units under bf16-true: fp32 adapters read in fp32 (was -6.2 %
        # on the 2048-wide Llama with the bitsandbytes policy)
        {"quantize_base": "gptq-int4"},
    ],
    ids=["one-gpu", "no-shard", "32-true", "nf4-dq", "mixed-one-gpu", "gptq-no-shard", "gptq"],
)
def test_accelerate_fsdp_qlora_variants_match_the_formulas(changes: dict[str, Any]) -> None:
    # the fast representative is the FULL_SHARD test above
    training = _fsdp_qlora(framework="accelerate-fsdp", **changes)
    generic = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    analytic = estimate(QWEN2, training, engine="analytic", simulate_allocator=False)
    ratio = generic.breakdown.allocated_bytes / analytic.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01


def test_fsdp_qlora_cpu_offload_keeps_only_the_statistics_on_the_gpu() -> None:
    # fsdp_qlora's default --use_cpu_offload is FSDP1's CPUOffload(offload_params=True): every
    # flat parameter's shard (codes, norms, root, adapters) and its gradient and Adam states
    # live on the CPU, the step runs there (Note [Offload on a traced step]); bitsandbytes'
    # QuantState is no parameter, so the absmax statistics (2 x 2,304 B) stay on the GPU
    # (Note [bitsandbytes statistics under sharding])
    training = _fsdp_qlora(offload="optimizer+params")
    generic = estimate(QWEN2, training, engine="generic", simulate_allocator=False)
    schedule = generic.schedules[0]
    assert sum(_setup_allocations(schedule, MemoryCategory.PARAMETER).values()) == 0
    assert schedule.category_peak(MemoryCategory.OPTIMIZER_STATE) == 0
    statistics = {
        k: v
        for k, v in _setup_allocations(schedule, MemoryCategory.BUFFER).items()
        if k.endswith("quant_statistics")
    }
    assert sum(statistics.values()) == 2 * 2_304


@pytest.mark.parametrize(
    ("changes", "reentrant"),
    [
        ({}, True),  # train.py's CheckpointImpl.REENTRANT (its README's --reentrant_checkpointing)
        ({"checkpoint_reentrant": False}, False),  # --reentrant_checkpointing false
        ({"framework": "pytorch-amp"}, False),  # transformers 5's use_reentrant=False
        ({"framework": "pytorch-amp", "checkpoint_reentrant": True}, True),
    ],
)
def test_the_trace_checkpoints_as_the_run_does(changes: dict[str, Any], reentrant: bool) -> None:
    # both engines read TrainingConfig.layer_checkpoint_reentrant: the formulas for their
    # reentrant transforms, the trace for torch.utils.checkpoint's use_reentrant
    import torch

    from trainmem.trace.engine import apply_activation_checkpointing

    training = _fsdp_qlora(activation_checkpointing="full", **changes)
    assert training.layer_checkpoint_reentrant is reentrant
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(4, 4)]))
    apply_activation_checkpointing(model, "full", reentrant=training.layer_checkpoint_reentrant)
    layer = model[0][0]
    assert layer.forward.keywords["use_reentrant"] is reentrant
