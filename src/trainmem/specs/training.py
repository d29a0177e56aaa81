"""TrainingConfig: how a model is trained (one data-parallel rank's view).

Precision names follow PyTorch Lightning (``Trainer(precision=...)``):

==============  ===============  ==============  =====================================
precision       weights/grads    compute         notes
==============  ===============  ==============  =====================================
``32-true``     float32          float32         plain fp32
``16-mixed``    float32          float16         torch.autocast + GradScaler (AMP)
``bf16-mixed``  float32          bfloat16        torch.autocast
``16-true``     float16          float16         whole model cast with ``.half()``
``bf16-true``   bfloat16         bfloat16        whole model cast; optimizer states in bf16
==============  ===============  ==============  =====================================

Source: Lightning ``lightning/fabric/plugins/precision`` (``MixedPrecision``, ``HalfPrecision``).

Note [Framework conventions]
    The same "mixed precision" stores different bytes per parameter in different frameworks:

    ==============  =============================================================================
    framework       ``*-mixed`` means
    ==============  =============================================================================
    pytorch-amp     fp32 weights and grads, torch.autocast (16 B/param with Adam); the default.
    hf-trainer      as pytorch-amp (``Trainer(fp16/bf16=True)`` uses torch.autocast); its default
                    optimizer is fused AdamW (``adamw_torch_fused``, transformers >= 4.46).
    litgpt          as the precision says; lit-gpt's own model code (fused qkv, fused GELU) and
                    Fabric's fp32 cast of the model output (logits kept in fp32).
    deepspeed       16-bit weights and grads, fp32 master weights + moments in the optimizer:
                    2 + 2 + 12 B/param (ZeRO paper sec. 3.1); the model runs in 16-bit, no autocast.
    megatron        16-bit weights, fp32 gradient accumulation buffer (``accumulate_allreduce_
                    grads_in_fp32``), fp32 master + moments: 2 + 4 + 12 B/param; no autocast.
    fsdp2           fp32 sharded weights and grads, ``MixedPrecisionPolicy(param_dtype=bf16)``:
                    layers compute on gathered 16-bit weights, no autocast.
    torchtune       as the precision says (``bf16-true`` in its recipes); chunked loss with a
                    per-chunk fp32 upcast (``CEWithChunkedOutputLoss``).
    ==============  =============================================================================
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from trainmem.errors import SpecError

Precision = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "fp8-mixed"]
Optimizer = Literal[
    "sgd",
    "sgd-momentum",
    "adam",
    "adamw",
    "adafactor",
    "lion",
    "adamw-8bit",
    "paged-adamw-8bit",
]
ActivationCheckpointing = Literal["none", "selective", "full"]
Attention = Literal["eager", "sdpa", "flash"]
OptimizerImplementation = Literal["foreach", "fused", "for-loop"]

PRECISIONS: tuple[str, ...] = (
    "32-true",
    "16-mixed",
    "bf16-mixed",
    "16-true",
    "bf16-true",
    "fp8-mixed",
)
OPTIMIZERS: tuple[str, ...] = (
    "sgd",
    "sgd-momentum",
    "adam",
    "adamw",
    "adafactor",
    "lion",
    "adamw-8bit",
    "paged-adamw-8bit",
)
ACTIVATION_CHECKPOINTING: tuple[str, ...] = ("none", "selective", "full")
ATTENTIONS: tuple[str, ...] = ("eager", "sdpa", "flash")
OPTIMIZER_IMPLEMENTATIONS: tuple[str, ...] = ("foreach", "fused", "for-loop")
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "optimizer+gradients", "optimizer+params")
QUANTIZE_BASE: tuple[str, ...] = ("none", "nf4", "nf4-dq", "fp4", "fp4-dq", "int8", "gptq-int4")
LORA_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
"""Linear names ``--lora-targets`` accepts (``all-linear`` means all of them); for fused-qkv
families (GPT-2 ``c_attn``, Falcon / GPT-NeoX ``query_key_value``) any of q, k, v targets the
one fused module, as peft does."""
PIPELINE_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved-1f1b", "gpipe")
FRAMEWORKS: tuple[str, ...] = (
    "pytorch-amp",
    "hf-trainer",
    "deepspeed",
    "megatron",
    "fsdp2",
    "torchtune",
    "litgpt",
)
"""Framework conventions, see Note [Framework conventions]."""
_AUTOCAST_FRAMEWORKS = frozenset({"pytorch-amp", "hf-trainer", "litgpt"})
_MASTER_WEIGHT_FRAMEWORKS = frozenset({"deepspeed", "megatron"})
FSDP_TO_ZERO: dict[str, int] = {"no-shard": 0, "shard-grad-op": 2, "full-shard": 3}
"""FSDP sharding strategies as the ZeRO stage they shard like (torch.distributed.fsdp
``ShardingStrategy``: SHARD_GRAD_OP shards gradients and optimizer states, FULL_SHARD also the
parameters); ``hybrid-shard`` is ``full-shard`` within a node."""

#: (weight dtype, compute dtype) per precision; torch dtype spellings.
_PRECISION_DTYPES: dict[str, tuple[str, str]] = {
    "32-true": ("float32", "float32"),
    "16-mixed": ("float32", "float16"),
    "bf16-mixed": ("float32", "bfloat16"),
    "16-true": ("float16", "float16"),
    "bf16-true": ("bfloat16", "bfloat16"),
    "fp8-mixed": ("float32", "bfloat16"),
}


def _check_choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise SpecError(field, f"unknown value {value!r}; allowed: {', '.join(allowed)}")


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig:
    """One training step on one GPU: the settings that change its memory.

    Raises:
        SpecError: a field outside its allowed values (the message lists them).
    """

    micro_batch_size: int = 1
    """Sequences per forward pass on one GPU (b)."""
    seq_len: int = 1024
    """Tokens per sequence (s). For ViT this is ignored: the sequence is patches + 1."""
    precision: Precision = "bf16-mixed"
    """Lightning precision name, see the module docstring."""
    optimizer: Optimizer = "adamw"
    """Optimizer whose states are kept per trainable parameter."""
    optimizer_implementation: OptimizerImplementation = "foreach"
    """torch.optim implementation: ``foreach`` (the CUDA default), ``fused``, ``for-loop``."""
    activation_checkpointing: ActivationCheckpointing = "none"
    """``none``; ``selective`` (recompute attention core, Korthikanti et al. 2022 sec. 5);
    ``full`` (keep only each layer's input)."""
    attention: Attention = "sdpa"
    """``eager`` (materialised a*s*s scores), ``sdpa`` (PyTorch SDPA, flash/efficient kernels on
    CUDA), ``flash`` (flash-attn 2)."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; gradients persist across them."""
    dropout: bool = True
    """Apply the model's own dropout probabilities (False: treat them as 0)."""
    data_parallel_size: int = 1
    """Data-parallel ranks the model states are sharded over (ZeRO / FSDP)."""
    zero_stage: int = 0
    """ZeRO stage (Rajbhandari et al. 2020, sec. 5): 0 none, 1 optimizer states, 2 + gradients,
    3 + parameters, each sharded over ``data_parallel_size`` ranks."""
    offload: str = "none"
    """``optimizer``: optimizer states (and the step) on the CPU (ZeRO-Offload, Ren et al.
    2021); ``optimizer+gradients``: the reduced gradients are moved to the CPU as well (one
    layer's stay on the GPU until they are reduced); ``optimizer+params``: parameters, gradients
    and states (ZeRO-Infinity style, stage 3 only)."""
    lora_rank: int = 0
    """LoRA rank r (Hu et al. 2021); 0 = full fine-tuning."""
    lora_targets: tuple[str, ...] = ("q", "v")
    """Linears that get LoRA adapters (peft's default for Llama: q_proj, v_proj)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input (peft ``lora_dropout``); > 0 keeps a copy of the input."""
    tensor_parallel_size: int = 1
    """Megatron tensor parallelism t: linear weights, the vocabulary and attention heads split
    over t ranks (Shoeybi et al. 2019)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism: the norm / dropout regions split over the t ranks too
    (Korthikanti et al. 2022, sec. 4.2.2)."""
    pipeline_parallel_size: int = 1
    """Pipeline stages p; each holds about L / p layers."""
    pipeline_schedule: str = "1f1b"
    """``1f1b`` (PipeDream-flush), ``interleaved-1f1b`` (Narayanan et al. 2021), ``gpipe``."""
    virtual_pipeline_stages: int = 2
    """Model chunks per rank for ``interleaved-1f1b`` (Megatron ``virtual_pipeline_model_
    parallel_size``)."""
    context_parallel_size: int = 1
    """Context parallelism: the sequence split over this many ranks (ring attention)."""
    compile: bool = False
    """``torch.compile`` (inductor). Modelled: pointwise chains (tanh GELU, RMSNorm) fused and
    recomputed by the min-cut partitioner, saving only their inputs. Not modelled: anything
    else the partitioner recomputes or saves differently (estimates stay an upper bound)."""
    zero_grad_set_to_none: bool = True
    """``optimizer.zero_grad(set_to_none=...)``: True (the default since PyTorch 2.0) frees the
    gradients after the step; False (the default before 2.0, and HF Trainer's
    ``model.zero_grad()`` on torch 1.x) keeps them allocated, zeroed, through the next forward
    (PyTorch 2.0 release notes, torch/optim/optimizer.py ``zero_grad``)."""
    framework: str = "pytorch-amp"
    """Whose conventions set the bytes per parameter and the loss; Note [Framework conventions]."""
    chunked_cross_entropy: int = 0
    """Compute the loss in this many chunks of tokens (0: in one piece); see
    :func:`trainmem.analytic.activations.loss_backward_transient_bytes`."""
    optimizer_in_backward: bool = False
    """Step each parameter as soon as its gradient is ready and free the gradient (torchtune
    ``optimizer_in_bwd``, ``register_post_accumulate_grad_hook``)."""
    activation_offloading: bool = False
    """Move saved activations to CPU after each layer's forward (torchtune
    ``OffloadActivations``): about two layers' activations stay on the GPU."""
    quantize_base: str = "none"
    """Frozen base linear weights, bitsandbytes names as lit-gpt spells them: ``nf4`` / ``fp4``
    (4-bit, blocksize 64, fp32 absmax), ``nf4-dq`` / ``fp4-dq`` (with QLoRA's double
    quantization, Dettmers et al. 2023; peft's ``bnb_4bit_use_double_quant=True``), ``int8``
    (LLM.int8()), ``gptq-int4`` (GPTQ, Frantar et al. 2022: 4-bit weights, group size 128), or
    ``none``."""

    def __post_init__(self) -> None:
        for field in ("micro_batch_size", "seq_len", "gradient_accumulation_steps"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecError(field, f"must be a positive integer, got {value!r}")
        _check_choice("precision", self.precision, PRECISIONS)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        _check_choice(
            "optimizer_implementation", self.optimizer_implementation, OPTIMIZER_IMPLEMENTATIONS
        )
        _check_choice(
            "activation_checkpointing", self.activation_checkpointing, ACTIVATION_CHECKPOINTING
        )
        _check_choice("attention", self.attention, ATTENTIONS)
        for field in (
            "data_parallel_size",
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "context_parallel_size",
            "virtual_pipeline_stages",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise SpecError(field, f"must be a positive integer, got {value!r}")
        if self.zero_stage not in ZERO_STAGES:
            raise SpecError("zero_stage", f"unknown value {self.zero_stage!r}; allowed: 0, 1, 2, 3")
        _check_choice("offload", self.offload, OFFLOADS)
        if self.offload == "optimizer+params" and self.zero_stage != 3:
            raise SpecError("offload", "optimizer+params needs zero_stage 3 (parameter sharding)")
        if not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise SpecError("lora_rank", f"must be a non-negative integer, got {self.lora_rank!r}")
        for target in self.lora_targets:
            _check_choice("lora_targets", target, LORA_TARGETS + ("lm_head",))
        if not 0.0 <= self.lora_dropout < 1.0:
            raise SpecError("lora_dropout", f"must be in [0, 1), got {self.lora_dropout!r}")
        _check_choice("quantize_base", self.quantize_base, QUANTIZE_BASE)
        _check_choice("framework", self.framework, FRAMEWORKS)
        _check_choice("pipeline_schedule", self.pipeline_schedule, PIPELINE_SCHEDULES)
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise SpecError("sequence_parallel", "needs tensor_parallel_size > 1")
        if not isinstance(self.chunked_cross_entropy, int) or self.chunked_cross_entropy < 0:
            raise SpecError(
                "chunked_cross_entropy",
                f"must be a non-negative integer, got {self.chunked_cross_entropy!r}",
            )
        if self.quantize_base != "none" and self.lora_rank == 0:
            raise SpecError(
                "quantize_base", "a quantized base is frozen: set lora_rank > 0 (QLoRA)"
            )

    @property
    def shard_group_size(self) -> int:
        """Ranks the ZeRO / FSDP shards are spread over: the data-parallel ranks, and for
        torchtitan's FSDP2 (``framework="fsdp2"``) the context-parallel ranks too, since it
        shards over the flattened ``dp_shard_cp`` mesh
        (torchtitan/models/llama3/infra/parallelize.py ``apply_fsdp``;
        torchtitan/distributed/parallel_dims.py)."""
        if self.framework == "fsdp2":
            return self.data_parallel_size * self.context_parallel_size
        return self.data_parallel_size

    @property
    def sequence_parallel_saves_gathered_input(self) -> bool:
        """Sequence parallelism as torchtitan applies it with DTensor (``framework="fsdp2"``):
        ``PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())`` on the
        attention and feed-forward modules all-gathers the normed input before the
        ``ColwiseParallel`` linears, and their matmuls save that full-sequence tensor for the
        weight gradient (torchtitan/models/llama3/infra/parallelize.py ``apply_tp``;
        torch/distributed/tensor/parallel/style.py). Megatron's sequence parallelism saves the
        sequence shard and all-gathers it again in backward (Korthikanti et al. 2022 sec. 4.2.2,
        megatron/core/tensor_parallel/layers.py,
        ``LinearWithGradAccumulationAndAsyncCommunication``)."""
        return self.sequence_parallel and self.framework == "fsdp2"

    @property
    def master_weights(self) -> bool:
        """16-bit model weights with an fp32 master copy kept by the optimizer (DeepSpeed,
        Megatron mixed precision)."""
        return self.is_mixed and self.framework in _MASTER_WEIGHT_FRAMEWORKS

    @property
    def weight_dtype(self) -> str:
        """Dtype of the model's stored parameters (torch spelling)."""
        if self.master_weights:
            return self.compute_dtype
        return _PRECISION_DTYPES[self.precision][0]

    @property
    def grad_dtype(self) -> str:
        """Dtype of the gradients kept between backward and the step (Megatron accumulates in
        fp32)."""
        if self.master_weights and self.framework == "megatron":
            return "float32"
        return self.weight_dtype

    @property
    def optimizer_state_dtype(self) -> str:
        """Dtype of the optimizer's moments (fp32 beside master weights)."""
        return "float32" if self.master_weights else self.weight_dtype

    @property
    def compute_dtype(self) -> str:
        """Dtype of matmul inputs/outputs and most activations (torch spelling)."""
        return _PRECISION_DTYPES[self.precision][1]

    @property
    def step_implementation(self) -> str:
        """The optimizer implementation that runs: as asked, except that the HF Trainer's default
        optimizer (``adamw_torch_fused`` since transformers 4.46 with torch >= 2.5,
        transformers/training_args.py) is fused when the default ``foreach`` was left."""
        if (
            self.framework == "hf-trainer"
            and self.optimizer in ("adam", "adamw")
            and self.optimizer_implementation == "foreach"
        ):
            return "fused"
        return self.optimizer_implementation

    @property
    def is_fp8(self) -> bool:
        """``fp8-mixed``: torchao float8 linears as torchtitan trains (fp32 weights, layers in
        bf16 without autocast, linears in float8). Memory: ``Float8Linear`` saves its
        high-precision input and weight for backward (torchao float8 ``matmul_with_hp_or_
        float8_args``), so activations are those of bf16; with FSDP2 the all-gather is float8
        (``enable_fsdp_float8_all_gather``), one byte per gathered weight."""
        return self.precision == "fp8-mixed"

    @property
    def uses_autocast(self) -> bool:
        """Mixed precision through torch.autocast (fp32 residual stream, per-op casts)."""
        return self.is_mixed and self.framework in _AUTOCAST_FRAMEWORKS and not self.is_fp8

    @property
    def loss_upcast(self) -> bool:
        """The loss works on fp32 logits: HF ``ForCausalLMLoss`` and torchtune upcast; under
        lit-gpt, Lightning Fabric has already cast the model output to fp32."""
        return True

    @property
    def is_lora(self) -> bool:
        """True when only LoRA adapters are trained."""
        return self.lora_rank > 0

    @property
    def is_mixed(self) -> bool:
        """True for the ``*-mixed`` precisions (16-bit compute, an fp32 copy of the weights)."""
        return self.precision.endswith("-mixed")


def zero_stage_from(zero_stage: int, fsdp: str | None) -> int:
    """The ZeRO stage, from ``--zero-stage`` or the FSDP strategy that shards like it
    (``hybrid-shard`` shards like ``full-shard`` within its shard group)."""
    if fsdp is None:
        return zero_stage
    if fsdp == "hybrid-shard":
        return 3
    if fsdp not in FSDP_TO_ZERO:
        allowed = ", ".join((*FSDP_TO_ZERO, "hybrid-shard"))
        raise SpecError("fsdp", f"unknown value {fsdp!r}; allowed: {allowed}")
    return FSDP_TO_ZERO[fsdp]


def resolved_config(training: TrainingConfig) -> dict[str, object]:
    """Every training setting after defaults, JSON-able, plus derived dtypes."""
    # fields hold immutable values (str, int, float, bool, tuples of str): no deep copy needed
    out: dict[str, object] = {f.name: getattr(training, f.name) for f in fields(training)}
    out["weight_dtype"] = training.weight_dtype
    out["compute_dtype"] = training.compute_dtype
    return out
