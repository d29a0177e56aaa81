"""TrainingConfig: how a model is trained (one data-parallel rank's view).

Note [Config by concern]
    The settings are defined in small frozen dataclasses, one per concern (:data:`CONCERNS`:
    :class:`BatchConfig`, :class:`PrecisionConfig`, :class:`OptimizerConfig`,
    :class:`LoopConfig`, :class:`EmaConfig`, :class:`CheckpointingConfig`,
    :class:`ForwardConfig`, :class:`ParallelismConfig`, :class:`ShardingConfig`,
    :class:`PeftConfig`, :class:`FrameworkConfig`, :class:`DiffusionConfig`). Each field carries
    an attribute docstring (meaning, unit, allowed values, default and whence) and a
    :class:`~trainmem.specs.settings.Setting` (the help, allowed values and flags the CLI
    options and the web form are generated from); each concern checks its own fields in its
    ``__post_init__`` and holds the properties that read only them.

    :class:`TrainingConfig` *inherits* from all of them rather than holding one instance of
    each: the hundreds of ``training.<field>`` reads, ``TrainingConfig(**fields)``,
    ``dataclasses.replace``, equality, hashing (one flat tuple, as fast as before: the planner
    caches on it, benchmarks/analytic_speed.py) and pickling stay what they were; nested
    instances would make every read two attribute lookups and every replace a rebuild of the
    concern. TrainingConfig keeps ``slots=True`` (the concerns cannot have slots of their own:
    several bases with slots cannot be combined), runs every concern's check, then the checks
    that span concerns (:func:`_check_combinations`), and holds the properties that read
    several concerns.

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
                    ``load_dtype`` bfloat16 / float16: the model loaded in 16 bits under the
                    same autocast (16-bit weights, grads, Adam states; 8 B/param).
    hf-trainer      as pytorch-amp (``Trainer(fp16/bf16=True)`` uses torch.autocast); its default
                    optimizer is torch AdamW, fused (``adamw_torch_fused``) from torch 2.8;
                    accelerate returns the 16-bit logits as an fp32 copy (Note
                    [accelerate's fp32 outputs]).
    accelerate-fsdp FSDP (v1) through accelerate / the HF Trainer's ``--fsdp``: fp32 sharded
                    weights, ``MixedPrecision(param_dtype=bf16, reduce_dtype=bf16)``: layers
                    compute on gathered 16-bit weights, no autocast weight copy; accelerate's
                    autocast still runs LayerNorm and ``pow`` in fp32 (Note [Autocast over
                    16-bit weights]) and returns fp32 logits.
    litgpt          as the precision says; lit-gpt's own model code (fused qkv, fused GELU) and
                    Fabric's fp32 cast of the model output (logits kept in fp32); on more than
                    one rank ``full`` checkpointing unless told (its fine-tuning scripts
                    checkpoint every ``Block`` whenever they shard; an explicit value wins).
    deepspeed       16-bit weights and grads, fp32 master weights + moments in the optimizer:
                    2 + 2 + 12 B/param (ZeRO paper sec. 3.1); the model runs in 16-bit, no autocast.
    megatron        16-bit weights, fp32 gradient accumulation buffer (``accumulate_allreduce_
                    grads_in_fp32``), fp32 master + moments: 2 + 4 + 12 B/param; no autocast.
    fsdp2           fp32 sharded weights and grads, ``MixedPrecisionPolicy(param_dtype=bf16)``:
                    layers compute on gathered 16-bit weights, no autocast.
    torchtune       no ``*-mixed``: its recipes build the whole model in their ``dtype``, no
                    autocast, so ``bf16-true`` (the default with it) or ``32-true`` only
                    (``FrameworkConventions.precisions``); chunked loss with a per-chunk fp32
                    upcast (``CEWithChunkedOutputLoss``).
    unsloth         Unsloth 2026.3.5 (unsloth_zoo 2026.3.4) on one GPU under the HF Trainer:
                    the model in bf16 (``bf16-true``, its default; a bf16 full fine-tune keeps
                    bf16 weights), LoRA A / B upcast to fp32 while embeddings, norms and LM
                    head stay 16-bit (unsloth_zoo training_utils.py
                    ``prepare_model_for_training``); by default ``adamw-8bit`` (its notebooks),
                    LoRA on all seven linears (``get_peft_model``'s ``target_modules``) and
                    ``full`` checkpointing as its offloaded "unsloth" mode (Note
                    [Unsloth's offloaded gradient checkpointing]); an explicit value wins.
                    Its fused cross-entropy (no logits kept), LoRA kernels, RMSNorm kernel and
                    allocator settings: Notes [Unsloth's fused cross-entropy], [Unsloth's fast
                    LoRA] (trainmem/analytic/loss.py, lora.py).
    ==============  =============================================================================
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields, replace
from operator import attrgetter
from typing import Any, Literal

from trainmem.errors import SpecError
from trainmem.specs.bounds import MAX_COUNT, describe_int
from trainmem.specs.frameworks import (
    BNB_4BIT_QUANTIZED_IN_ITS_DTYPE_SINCE,
    BNB_INT8_KEEPS_ONLY_GRADED_INPUT_SINCE,
    BNB_MATMUL4BIT_SAVES_NO_INPUT_SINCE,
    DEFAULT_BITSANDBYTES_VERSION,
    DEFAULT_LITGPT_VERSION,
    DEFAULT_PRECISION,
    DEFAULT_TORCHAO_VERSION,
    DEFAULT_TORCHTITAN_VERSION,
    DEFAULT_TORCHTUNE_VERSION,
    DEFAULT_UNSLOTH_VERSION,
    FRAMEWORK_CONVENTIONS,
    GRAD_ACCUM_DTYPES,
    HF_NON_REENTRANT_CHECKPOINT_SINCE,
    HF_TRAINER_STACKS,
    LOOPS,
    PEFT_DEFAULT_LORA_TARGETS,
    TORCHTITAN_COMPILED_LOSS_SINCE,
    TORCHTUNE_RESHAPED_LOSS_SINCE,
    TRAINER_ON_ACCELERATE_SINCE,
    TRL_CASTS_BITSANDBYTES,
    TRL_RELEASES_MODELLED,
    TRL_SFT_ADAPTERS_FP32_SINCE,
    TRL_SFT_BF16_EMBEDDINGS_SINCE,
    TRL_SFT_CHECKPOINTING_SINCE,
    TRL_SFT_NON_REENTRANT_SINCE,
    TRL_SFT_PREPARES_KBIT_UNTIL,
    TRL_SFT_ZERO3_REENTRANT_SINCE,
    UNSLOTH_FUSED_LOSS_SINCE,
    UNSLOTH_OLDEST_MODELLED,
    FrameworkConventions,
    deepspeed_bf16_grads_released,
    deepspeed_bf16_immediate_grad_update,
    deepspeed_copies_fp32_weights,
    deepspeed_flattens_on_device,
    deepspeed_grad_accum_dtype,
    deepspeed_optimizer_wrapper,
    deepspeed_states_at_init,
    deepspeed_zero3_gathers_on_one_rank,
    default_trl_release,
    parse_version,
    softmax_saves_input,
    transformers_release_of,
)
from trainmem.specs.model import SDPA_SINCE, ModelSpec
from trainmem.specs.optimizers import OPTIMIZER_TABLE, Optimizer
from trainmem.specs.sample_lengths import (
    DATASETS,
    LONG_SAMPLES,
    LongSamples,
    parse_sample_lengths,
    sampled_seq_lens,
)
from trainmem.specs.settings import kind_of, setting, settings_of

Precision = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "fp8-mixed"]
ActivationCheckpointing = Literal["none", "selective", "full"]
Attention = Literal["eager", "sdpa", "flash"]
OptimizerImplementation = Literal["foreach", "fused", "for-loop", "cs336"]
Loss = Literal[
    "cross-entropy",
    "transposed-cross-entropy",
    "cs336-cross-entropy",
    "logits-sum",
    "logits-mean",
]

PRECISIONS: tuple[str, ...] = (
    "32-true",
    "16-mixed",
    "bf16-mixed",
    "16-true",
    "bf16-true",
    "fp8-mixed",
)
OPTIMIZERS: tuple[str, ...] = tuple(OPTIMIZER_TABLE)
PAGED_OPTIMIZERS: tuple[str, ...] = tuple(n for n, row in OPTIMIZER_TABLE.items() if row.paged)
"""bitsandbytes paged optimizers (``bnb.optim.PagedAdamW`` 32-bit, ``PagedAdamW8bit``): their
large states live in CUDA managed memory, outside the caching allocator (see
:func:`trainmem.analytic.buffers.paged_state_bytes`)."""
ACTIVATION_CHECKPOINTING: tuple[str, ...] = ("none", "selective", "full")
ATTENTIONS: tuple[str, ...] = ("eager", "sdpa", "flash")
OPTIMIZER_IMPLEMENTATIONS: tuple[str, ...] = ("foreach", "fused", "for-loop", "cs336")
"""torch.optim's three (``foreach``, ``fused``, ``for-loop``) and ``cs336``, the CS336 course's
hand-written AdamW (cs336_basics/optimizer.py ``AdamW.step``: a Python loop over the
parameters building new moments and the update out of place; Adam / AdamW only)."""
LOSSES: tuple[str, ...] = (
    "cross-entropy",
    "transposed-cross-entropy",
    "cs336-cross-entropy",
    "logits-sum",
    "logits-mean",
)
"""``TrainingConfig.loss`` values: ``cross-entropy`` (``F.cross_entropy``, transformers'
``ForCausalLMLoss``), ``transposed-cross-entropy`` (torchtune's recipes before 4fba6cd4, Aug
2024: ``nn.CrossEntropyLoss`` on the shifted fp32 logits' (b, V, s - 1) transposed view;
Note [torchtune's transposed cross-entropy] in :mod:`trainmem.analytic.loss`),
``cs336-cross-entropy`` (the course's written-out
cs336_basics/nn_utils.py ``cross_entropy``), ``logits-sum`` / ``logits-mean`` (``loss =
logits.sum()`` / ``.mean()``, a profiling script's stand-in loss)."""
ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "optimizer+gradients", "optimizer+params")
CHATGLM_QUANTIZE: tuple[str, ...] = ("chatglm-int8", "chatglm-int4")
"""ChatGLM's own ``model.quantize(bits)`` (THUDM remote code quantization.py
``QuantizedLinear`` / ``W8A16Linear``; Note [ChatGLM's quantize] in
:mod:`trainmem.trace.chatglm_quantized`)."""
QUANTIZE_BASE: tuple[str, ...] = (
    "none",
    "nf4",
    "nf4-dq",
    "fp4",
    "fp4-dq",
    "int8",
    "gptq-int4",
    *CHATGLM_QUANTIZE,
)
KBIT_NOT_UPCAST: tuple[str, ...] = ("gptq-int4",)
"""Quantized bases peft's ``prepare_model_for_kbit_training`` leaves in their dtype (peft
utils/other.py: ``if not is_gptq_quantized and not is_aqlm_quantized ...`` around the fp32
cast, since peft 0.4)."""
LORA_TARGETS: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
"""Linear names ``--lora-targets`` accepts (``all-linear`` means all of them); for fused-qkv
families (GPT-2 ``c_attn``, Falcon / GPT-NeoX ``query_key_value``) any of q, k, v targets the
one fused module, as peft does."""
DIFFUSERS_LORA_TARGETS: tuple[str, ...] = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "net.0.proj",
    "net.2",
)
"""diffusers module names ``--lora-targets`` also takes, for a diffusers model only, as its
LoRA scripts and finetrainers write ``target_modules`` (``to_q,to_k,to_v,to_out.0``): each
adapts the linears whose module path ends in it, as peft's ``check_target_module_exists``
matches a name (the name itself or ``.name`` at its end). Unlike ``q,k,v,o``
(``trainmem.trace.diffusers_model.DIFFUSERS_LORA_MODULES``), ``to_q`` leaves joint (MMDiT)
attention's text-stream projections ``add_q_proj`` / ``to_add_out`` unadapted."""
LORA_MODULES_TO_SAVE: tuple[str, ...] = ("embed_tokens", "lm_head")
"""``TrainingConfig.lora_modules_to_save`` values: the modules LoRA trains whole beside its
adapters (peft ``LoraConfig(modules_to_save=[...])``): the input embedding and the LM head.
See Note [peft modules_to_save] in :mod:`trainmem.analytic.tensor_states`."""
LORA_MODULES_TO_SAVE_ALIASES: dict[str, str] = {
    "wte": "embed_tokens",
    "word_embeddings": "embed_tokens",
    "embed_in": "embed_tokens",
    "tok_embeddings": "embed_tokens",
    "embed_out": "lm_head",
}
"""peft ``modules_to_save`` names of other families' modeling code -> trainmem's: GPT-2's and
Qwen-1's ``transformer.wte`` (Qwen finetune.py ``modules_to_save=["wte", "lm_head"]``), BLOOM's /
Falcon's ``word_embeddings``, GPT-NeoX's ``embed_in`` / ``embed_out``, torchtune's / InternLM's
``tok_embeddings``."""
PROMPT_LEARNING: tuple[str, ...] = ("prefix-tuning", "p-tuning", "prompt-tuning")
"""``TrainingConfig.prompt_learning`` values: peft 0.21.2's ``PrefixTuningConfig``,
``PromptEncoderConfig`` and ``PromptTuningConfig`` (``PeftType`` PREFIX_TUNING, P_TUNING,
PROMPT_TUNING)."""
LORA_VARIANTS: tuple[str, ...] = ("lora", "dora", "adalora", "lokr", "loha")
"""``TrainingConfig.lora_variant`` values: peft's adapter types on the targeted linears,
``lora`` (``LoraConfig``), ``dora`` (``LoraConfig(use_dora=True)``, Liu et al. 2024,
arXiv:2402.09353; peft tuners/lora/dora.py), ``adalora`` (``AdaLoraConfig``, Zhang et al. 2023,
arXiv:2303.10512; peft tuners/adalora), ``lokr`` (``LoKrConfig``, LyCORIS' Kronecker
product; peft tuners/lokr) and ``loha`` (``LoHaConfig``, LyCORIS' Hadamard product of two
low-rank pairs, Hyeon-Woo et al. 2022, arXiv:2108.06098; peft tuners/loha)."""
LYCORIS_VARIANTS: dict[str, str] = {"lokr": "LoKr", "loha": "LoHa"}
"""The LyCORIS variants (peft tuners/lycoris_utils.py ``LycorisLayer``) by their peft names:
no input dropout, adapters on torch's Linear / Conv1d / Conv2d only."""
PIPELINE_SCHEDULES: tuple[str, ...] = ("1f1b", "interleaved-1f1b", "gpipe")
EMA_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
"""``TrainingConfig.ema_dtype`` values: diffusers' ``EMAModel`` shadow copy as its training
scripts keep it (``.to(dtype=...)``), fp32 or bf16."""
FROZEN_ON_GPU: tuple[str, ...] = ("none", "vae", "text-encoders", "all")
"""``TrainingConfig.frozen_on_gpu`` values (:data:`trainmem.specs.diffusers.FROZEN_COMPONENTS`)."""
LORA_ADAPTER_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")
"""``TrainingConfig.lora_adapter_dtype`` values."""
LAYERWISE_CASTING: tuple[str, ...] = ("none", "float8_e4m3fn", "float8_e5m2")
"""``TrainingConfig.layerwise_casting`` values: the storage dtype of diffusers' layerwise casting
(``ModelMixin.enable_layerwise_casting(storage_dtype=...)``), or none."""
EMA_DEVICES: tuple[str, ...] = ("cuda", "cpu")
"""``TrainingConfig.ema_device`` values: ``cuda`` (``ema_unet.to(accelerator.device)``) or ``cpu``
(diffusers examples' ``--offload_ema``: on the GPU only for ``ema_unet.step``)."""
PRECISION_ALIASES: dict[str, str] = {
    "bf16": "bf16-mixed",
    "16": "16-mixed",
    "fp16": "16-mixed",
    "32": "32-true",
    "fp32": "32-true",
    "float32": "32-true",
}
"""Short precision names users type, as Lightning maps them (lightning/fabric/connector.py
``_convert_precision_to_unified_args``: ``"bf16"`` -> ``"bf16-mixed"``, ``16`` -> ``"16-mixed"``,
``32`` -> ``"32-true"``); ``fp16`` / ``fp32`` are the HF Trainer's words for the same runs."""

LORA_TARGET_ALIASES: dict[str, str] = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "o_proj": "o",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}
"""peft's ``target_modules`` names of the Llama-style modeling code (transformers
``modeling_llama.py``: ``q_proj`` ... ``down_proj``) -> trainmem's linear names."""

FRAMEWORKS: tuple[str, ...] = tuple(FRAMEWORK_CONVENTIONS)
"""Framework conventions, see Note [Framework conventions] and :mod:`trainmem.specs.frameworks`."""
FRAMEWORK_NAMES: dict[str, str] = {
    "torchtitan": "fsdp2",
    "accelerate": "accelerate-fsdp (or hf-trainer without sharding)",
    "transformers": "hf-trainer",
    "llamafactory": "llama-factory",
    "lightning": "pytorch-amp (or fsdp2 / deepspeed as its strategy)",
    "megatron-lm": "megatron",
    "nemo": "megatron",
    "qlora": "fsdp-qlora (Answer.AI's script), or --quantize-base nf4 with any framework",
}
"""What a user may call a framework that trainmem names otherwise, named in the error."""
FSDP_TO_ZERO: dict[str, int] = {"no-shard": 0, "shard-grad-op": 3, "full-shard": 3}
"""FSDP sharding strategies as the ZeRO stage they shard like (torch.distributed.fsdp
``ShardingStrategy``): FULL_SHARD shards parameters, gradients and optimizer states; SHARD_GRAD_OP
too, outside computation (stage 3 with ``reshard_after_forward=False``: the weights are gathered
from the forward to the backward, and the optimizer step sees sharded weights);
``hybrid-shard`` is ``full-shard`` within a node (``shard_group_size``)."""
FSDP_STRATEGIES: tuple[str, ...] = ("full-shard", "shard-grad-op", "hybrid-shard", "no-shard")
"""The ``--fsdp`` strategies (CLI option and web page dropdown), :data:`FSDP_TO_ZERO`'s and
``hybrid-shard``."""
FSDP_HELP = (
    "FSDP sharding strategy; sets the ZeRO stage it shards like; with --framework hf-trainer, "
    "llama-factory or axolotl it is accelerate-fsdp, the Trainer's FSDP"
)
"""What ``--fsdp`` does, as ``--help`` and the web page say it."""
GPUS_PER_NODE = 8
"""Default HYBRID_SHARD shard group: the GPUs of one node (FSDP builds the intra-node group from
``torch.cuda.device_count()``, 8 on the usual HGX / MI300X node)."""

LOAD_DTYPES = ("float32", "bfloat16", "float16")
"""``load_dtype`` values: the weights' dtype as ``from_pretrained(torch_dtype=...)`` loads
them (torch spellings)."""

#: (weight dtype, compute dtype) per precision; torch dtype spellings.
_PRECISION_DTYPES: dict[str, tuple[str, str]] = {
    "32-true": ("float32", "float32"),
    "16-mixed": ("float32", "float16"),
    "bf16-mixed": ("float32", "bfloat16"),
    "16-true": ("float16", "float16"),
    "bf16-true": ("bfloat16", "bfloat16"),
    "fp8-mixed": ("float32", "bfloat16"),
}


MAX_PIPELINE_MICRO_BATCHES = 4096
"""Most micro-batches per step (``gradient_accumulation_steps``) under pipeline parallelism:
the analytic engine replays each one (10,000 took 113 s, 2^31 - 1 never ended), and a
stage's memory is linear in them, so the count cannot be capped silently."""


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(field: str, value: object, *, minimum: int) -> None:
    what = "a positive integer" if minimum == 1 else "a non-negative integer"
    if not _is_int(value):
        raise SpecError(field, f"must be {what}, got {value!r}")
    assert isinstance(value, int)
    if value < minimum:
        raise SpecError(field, f"must be {what}, got {value}")
    if value > MAX_COUNT:
        raise SpecError(
            field, f"must be at most {MAX_COUNT:,} (2^31 - 1), got {describe_int(value)}"
        )


_RESOLUTION = re.compile(r"\s*([0-9]{1,9})\s*(?:[xX]\s*([0-9]{1,9})\s*)?")


def _parse_resolution(text: str) -> int | str:
    """``"1024"`` -> 1024, ``"480x832"`` -> ``"480x832"``, ``"512x512"`` -> 512.

    Raises:
        SpecError: anything else, or a zero side.
    """
    match = _RESOLUTION.fullmatch(text)
    if match is None or int(match[1]) == 0 or (match[2] is not None and int(match[2]) == 0):
        raise SpecError(
            "resolution",
            f"must be pixels (1024) or HEIGHTxWIDTH (480x832), positive, got {text[:40]!r}",
        )
    height = int(match[1])
    width = height if match[2] is None else int(match[2])
    return height if height == width else f"{height}x{width}"


def _check_choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    if not isinstance(value, str) or value not in allowed:
        lower = str(value).lower()
        hint = lower if lower in allowed else FRAMEWORK_NAMES.get(lower)  # "TRL" is trl
        hint = hint if field == "framework" else None
        said = f" ({value} is --framework {hint})" if hint else ""
        raise SpecError(field, f"unknown value {value!r}; allowed: {', '.join(allowed)}{said}")


def _check_ints(config: object, names: tuple[str, ...], *, minimum: int) -> None:
    """:func:`_check_int` on each field of ``names`` (the common case without a call)."""
    for name in names:
        value = getattr(config, name)
        if type(value) is not int or not minimum <= value <= MAX_COUNT:
            _check_int(name, value, minimum=minimum)


def _check_flags(config: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise SpecError(name, f"must be True or False, got {value!r}")


_CHOICE_FIELDS: dict[type, tuple[tuple[str, tuple[str, ...], bool], ...]] = {}
"""Per concern: (field, allowed names, None allowed) of each field that takes one of a list of
names (:attr:`~trainmem.specs.settings.Setting.choices`, the allowed values the CLI and the page
offer), filled in below the concern dataclasses."""


def _check_choices(config: object, concern: type) -> None:
    """Each field of ``concern`` with named choices holds one of them (or None where that is its
    default), checked in field order."""
    for name, allowed, optional in _CHOICE_FIELDS[concern]:
        value = getattr(config, name)
        if value not in allowed and (value is not None or not optional):
            _check_choice(name, value, allowed)


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """The tokens one step sees on one GPU: micro-batch, sequence lengths, accumulation.

    Raises:
        SpecError: a count that is not a positive integer (``target_seq_len``: not negative).
    """

    micro_batch_size: int = setting(1, "Sequences per GPU per step.", short="-b")
    """Sequences per forward pass on one GPU (b), 1 to 2^31 - 1. Default 1, the smallest
    step (what fits when anything does)."""
    seq_len: int = setting(
        1024,
        "Tokens per sequence.",
        short="-s",
        default_text="model context, max 4096",
        defer="model",
    )
    """Tokens per sequence (s), 1 to 2^31 - 1. For ViT this is ignored: the sequence is
    patches + 1. For an encoder-decoder (T5) it is the encoder's (source) length. Default 1024
    here (GPT-2's context); the CLI and the page leave it to the model: its context length, at
    most 4096 (:func:`trainmem.estimate.default_seq_len_of`)."""
    target_seq_len: int = setting(
        0,
        "Decoder (target) tokens per sequence of an encoder-decoder such as T5.",
        default_text="0, the same as --seq-len",
    )
    """Decoder (target) tokens per sequence of a text encoder-decoder (T5, mT5, BART, Pegasus,
    Marian...: ``labels``, from which ``decoder_input_ids`` are shifted), 0 to 2^31 - 1; 0, the
    default, means the same as ``seq_len``. Ignored by decoder-only and encoder models, and by
    Whisper and image / speech encoder-decoders (their decoder reads ``seq_len`` tokens). See
    :attr:`decoder_seq_len`."""
    earlier_seq_lens: str | None = setting(
        None,
        "Lengths of the steps run before the measured one, comma-separated, none above "
        "--seq-len (batches padded to their longest sample: the allocator's cache under "
        "varying shapes).",
        default_text="none: every step at --seq-len",
    )
    """Token lengths of the training steps that run before the measured one (at ``seq_len``),
    in order, comma-separated (``"96,512,230"``), each at least 1 (one above ``seq_len``
    counts as ``seq_len``, with a warning), at most
    :data:`MAX_EARLIER_STEPS` of them: a dataset padded to the longest sample of each batch
    changes every activation's size from one step to the next, and the caching allocator's
    blocks, cached at one step's sizes, are split or bypassed by the next, so
    ``max_memory_reserved`` depends on the lengths seen (Note [Steps of varying length]);
    None, the default: every step at ``seq_len``. See :attr:`earlier_seq_len_list`."""
    sample_lengths: str | None = setting(
        None,
        "Tokens per sample of the data, when batches are padded to their longest sample: a "
        "dataset (" + ", ".join(DATASETS) + ") or MEAN:SD[:SHORTEST[:LONGEST]]; earlier steps "
        "at lengths drawn from it run before the measured one (--earlier-seq-lens wins).",
        default_text="none: every step at --seq-len",
    )
    """The data's tokens per sample, for a run whose micro-batches are padded to their own
    longest sample: a name of :data:`~trainmem.specs.sample_lengths.DATASETS` (published
    statistics, each cited) or ``"MEAN:SD"`` with optional ``:SHORTEST`` and ``:LONGEST``.
    :data:`~trainmem.specs.sample_lengths.SAMPLED_STEPS` earlier steps at micro-batch
    lengths drawn from it (Note [Lengths from a dataset's statistics]) run before the measured
    step, as :attr:`earlier_seq_lens` would list them; ignored when those are given. None, the
    default: every step at ``seq_len``."""
    long_samples: LongSamples = setting(
        "truncate",
        "What the data pipeline does with a sample above --seq-len, for --sample-lengths:",
        choices=LONG_SAMPLES,
    )
    """A sample above ``seq_len`` under :attr:`sample_lengths`: ``"truncate"`` (cut to it:
    torchtune, litgpt, HF tokenizers' ``truncation=True``; the default) or ``"delete"``
    (dropped from the data: ms-swift's ``--truncation_strategy delete``)."""
    gradient_accumulation_steps: int = setting(
        1,
        "Micro-batches per optimizer step.",
        default_text="1; with pipeline parallelism the pipeline-parallel size, the fewest "
        "torch's Schedule1F1B runs",
        defer="cli",
    )
    """Micro-batches per optimizer step (m), 1 to 2^31 - 1 (at most
    :data:`MAX_PIPELINE_MICRO_BATCHES` under pipeline parallelism); gradients persist across
    them. Default 1; the CLI's default under pipeline parallelism is ``pipeline_parallel_size``
    (torch's ``Schedule1F1B`` needs as many, torch/distributed/pipelining/schedules.py)."""

    @property
    def earlier_seq_len_list(self) -> tuple[int, ...]:
        """:attr:`earlier_seq_lens` as integers; without them the lengths drawn from
        :attr:`sample_lengths` (Note [Lengths from a dataset's statistics]); empty when
        neither is given."""
        if self.earlier_seq_lens:
            return tuple(int(x) for x in self.earlier_seq_lens.split(","))
        if self.sample_lengths:
            return sampled_seq_lens(
                self.sample_lengths, self.seq_len, self.micro_batch_size, self.long_samples
            )
        return ()

    @property
    def decoder_seq_len(self) -> int:
        """Target (decoder) length of an encoder-decoder: ``target_seq_len``, or ``seq_len``
        when it is 0."""
        return self.target_seq_len or self.seq_len

    def __post_init__(self) -> None:
        _check_ints(self, ("micro_batch_size", "seq_len", "gradient_accumulation_steps"), minimum=1)
        _check_ints(self, ("target_seq_len",), minimum=0)
        _check_earlier_seq_lens(self.earlier_seq_lens)
        if self.sample_lengths is not None:
            if not isinstance(self.sample_lengths, str):
                raise SpecError("sample_lengths", f"must be text, got {self.sample_lengths!r}")
            parse_sample_lengths(self.sample_lengths)
        _check_choices(self, BatchConfig)


MAX_EARLIER_STEPS = 64
"""Most steps :attr:`BatchConfig.earlier_seq_lens` lists (each is one more schedule built and
replayed)."""


def _check_earlier_seq_lens(text: object) -> None:
    """``earlier_seq_lens``: None, or comma-separated positive integers (one above ``seq_len``
    counts as ``seq_len``: :func:`trainmem.analytic.varying_lengths.after_earlier_steps`, with
    a warning from :func:`trainmem.estimate.setting_warnings`).

    Raises:
        SpecError: another value.
    """
    if text is None:
        return
    parts = [p.strip() for p in text.split(",")] if isinstance(text, str) else []
    digits = all(p.isascii() and p.isdigit() and int(p) >= 1 for p in parts)
    if not parts or len(parts) > MAX_EARLIER_STEPS or not digits:
        raise SpecError(
            "earlier_seq_lens",
            f"must be comma-separated positive lengths, at most {MAX_EARLIER_STEPS}, got {text!r}",
        )


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """The dtypes: Lightning's precision name, and the dtype DeepSpeed accumulates gradients
    in. Dtypes per precision: the module docstring; per framework: Note [Framework
    conventions].

    Raises:
        SpecError: a name outside :data:`PRECISIONS` (or :data:`PRECISION_ALIASES`), a dtype
            outside :data:`~trainmem.specs.frameworks.GRAD_ACCUM_DTYPES`.
    """

    precision: Precision = setting(
        None,
        "Lightning precision:",
        choices=PRECISIONS,
        short="-p",
        default_text=(
            "bf16-mixed; --framework torchtune: bf16-true, its recipes' dtype; --framework "
            "unsloth: bf16-true, its bf16 model"
        ),
    )
    """Lightning precision name (:data:`PRECISIONS`; the short names of
    :data:`PRECISION_ALIASES` are read as theirs), see the module docstring. None, the default:
    the framework's (``FrameworkConventions.default_precision``, resolved when the
    TrainingConfig is made, so every reader sees a name): ``bf16-mixed``, what current GPUs
    train in (torch.autocast to bf16); torchtune ``bf16-true`` (its recipes' ``dtype: bf16``,
    no autocast). A framework that runs only some precisions refuses the others
    (``FrameworkConventions.precisions``)."""
    grad_accum_dtype: str | None = setting(
        None,
        "DeepSpeed data_types.grad_accum_dtype, the dtype gradients accumulate in:",
        choices=GRAD_ACCUM_DTYPES,
        default_text="DeepSpeed's for --deepspeed-version",
        no_option="a ds_config setting: read from --deepspeed-config, or --set KEY=VALUE",
    )
    """DeepSpeed ``data_types.grad_accum_dtype`` (``float32``, ``bfloat16``, ``float16``): the
    dtype gradients accumulate in, which picks DeepSpeed's optimizer wrapper
    (:attr:`TrainingConfig.deepspeed_optimizer`); None, the default: DeepSpeed's default for
    ``deepspeed_version`` (:func:`~trainmem.specs.frameworks.deepspeed_grad_accum_dtype`). Only
    with ``framework="deepspeed"``."""

    load_dtype: str | None = setting(
        None,
        "Dtype the model's weights are loaded in (transformers from_pretrained torch_dtype) "
        "under a *-mixed autocast:",
        choices=LOAD_DTYPES,
        default_text="the framework's: hf-trainer on transformers >= 5 the config's dtype "
        "(from_pretrained dtype='auto'), TRL before 0.27 likewise, LLaMA-Factory's LoRA the "
        "config's, axolotl's LoRA the compute dtype; a quantized base on transformers < 5 "
        "float16; else float32",
    )
    """The dtype the model's weights are loaded in under a ``*-mixed`` precision whose loop
    autocasts (``FrameworkConventions.autocast``: pytorch-amp, hf-trainer): ``float32``
    (torch.autocast over fp32 weights), or the 16-bit compute dtype, the common
    ``from_pretrained(..., torch_dtype=torch.bfloat16)`` + ``TrainingArguments(bf16=True)``
    recipe (:attr:`TrainingConfig.autocast_over_loaded_16bit`): weights, gradients and
    AdamW's states in 16 bits, autocast still running its fp32 ops. Note [Autocast over
    16-bit weights]. None, the default: the framework's load for the model's config
    (:func:`trainmem.specs.load_dtype.resolve_load_dtype`, applied by the driver: transformers
    >= 5's ``dtype="auto"`` under hf-trainer, TRL's ``create_model_from_path`` by release,
    LLaMA-Factory's, axolotl's), float32 elsewhere; ``details["assumed"]["load_dtype"]`` says
    which."""

    @property
    def is_mixed(self) -> bool:
        """True for the ``*-mixed`` precisions (16-bit compute, an fp32 copy of the weights)."""
        return self.precision.endswith("-mixed")

    @property
    def is_fp8(self) -> bool:
        """``fp8-mixed``: torchao float8 linears as torchtitan trains (fp32 weights, layers in
        bf16 without autocast, linears in float8). Memory: ``Float8Linear`` saves its
        high-precision input and weight for backward (torchao float8 ``matmul_with_hp_or_
        float8_args``), so activations are those of bf16, except under tensor parallelism
        (torchao's float8 TP styles cast the inputs first) and torch.compile (the partition
        recasts in backward): Note [Float8 tensor-parallel inputs], Note [Compiled float8
        linears] in trainmem/analytic/float8.py. With FSDP2 the all-gather is float8
        (``enable_fsdp_float8_all_gather``), one byte per gathered weight."""
        return self.precision == "fp8-mixed"

    @property
    def compute_dtype(self) -> str:
        """Dtype of matmul inputs/outputs and most activations (torch spelling)."""
        return _PRECISION_DTYPES[self.precision][1]

    def __post_init__(self) -> None:
        if self.precision is None:  # alone; TrainingConfig resolves it by framework first
            object.__setattr__(self, "precision", DEFAULT_PRECISION)
        if isinstance(self.precision, str) and self.precision.lower() in PRECISION_ALIASES:
            object.__setattr__(self, "precision", PRECISION_ALIASES[self.precision.lower()])
        _check_choices(self, PrecisionConfig)


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """The optimizer: which one, its torch.optim implementation, and whether it steps inside
    backward.

    Raises:
        SpecError: a name outside the lists, or ``cs336`` with another optimizer than Adam(W).
    """

    optimizer: Optimizer = setting(
        None,
        "Optimizer:",
        choices=OPTIMIZERS,
        short="-o",
        default_text="adamw; --framework unsloth: adamw-8bit, its notebooks'",
    )
    """Optimizer whose states are kept per trainable parameter (:data:`OPTIMIZERS`);
    ``paged-adamw`` is bitsandbytes' 32-bit ``PagedAdamW`` (fp32 states in CUDA managed memory,
    as torchtune's low-memory recipes use); ``adamw-8bit`` is bitsandbytes' ``AdamW8bit``;
    ``ao-adamw-8bit`` / ``adamw-4bit`` / ``adamw-fp8`` are torchao's ``AdamW8bit`` /
    ``AdamW4bit`` / ``AdamWFp8`` (Note [torchao low-bit AdamW step]). torchao's
    ``CPUOffloadOptimizer`` is ``offload="optimizer"`` (``offload_gradients=True``:
    ``"optimizer+gradients"``). None, the default: the
    framework's (``FrameworkConventions.default_optimizer``, resolved when the TrainingConfig
    is built): ``adamw``, the transformers Trainer's and most recipes' choice; ``adamw-8bit``
    under Unsloth, its notebooks' ``optim = "adamw_8bit"``."""
    optimizer_implementation: OptimizerImplementation | None = setting(
        None,
        "torch.optim implementation:",
        choices=OPTIMIZER_IMPLEMENTATIONS,
        default_text="the framework's for --torch-version",
    )
    """torch.optim implementation (:data:`OPTIMIZER_IMPLEMENTATIONS`): ``foreach``, ``fused``,
    ``for-loop``, ``cs336``; None, the default: the framework's default for ``torch_version``
    (:attr:`TrainingConfig.step_implementation`). An explicit value always wins."""
    optimizer_in_backward: bool = setting(False, "Step and free each gradient in backward.")
    """Step each parameter as soon as its gradient is ready and free the gradient (torchtune
    ``optimizer_in_bwd``, ``register_post_accumulate_grad_hook``). Default False, as torch.optim
    steps after the backward."""

    def __post_init__(self) -> None:
        if self.optimizer is None:  # alone; TrainingConfig resolves it by framework first
            object.__setattr__(self, "optimizer", "adamw")
        _check_choices(self, OptimizerConfig)
        _check_flags(self, ("optimizer_in_backward",))
        accepted = OPTIMIZER_TABLE[self.optimizer].temporaries  # torch's three; cs336: Adam(W)
        if self.optimizer_implementation not in (None, *accepted):
            raise SpecError(
                "optimizer_implementation",
                f"cs336 is the CS336 course's AdamW; it cannot run optimizer {self.optimizer!r} "
                "(use --optimizer adamw, or foreach / fused / for-loop)",
            )


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    """The training loop around the model: the loss it computes, what it holds, when it zeroes
    the gradients.

    Raises:
        SpecError: an unknown loss, a negative chunk count, or a loss that cannot be chunked.
    """

    loss: Loss | None = setting(
        None,
        "The loss on the logits:",
        choices=LOSSES,
        default_text="the model's own; cs336_basics: the course's cs336-cross-entropy",
    )
    """The loss the step computes on the logits (:data:`LOSSES`); None, the default: the
    model's own (``ModelSpec.loss_written_out``: the course's cross-entropy for
    ``cs336_basics``, ``F.cross_entropy`` for the transformers families). An explicit value
    always wins."""
    chunked_cross_entropy: int = setting(
        0,
        "Loss in N chunks of tokens (0: whole; --framework unsloth: its fused loss's pieces, "
        "UNSLOTH_CE_LOSS_N_CHUNKS, 0: Unsloth's own count for --gpu).",
    )
    """Compute the loss in this many chunks of tokens, 0 to 2^31 - 1 (0, the default: in one
    piece, as ``F.cross_entropy``; torchtune's ``CEWithChunkedOutputLoss`` uses 8); see
    :func:`trainmem.analytic.activations.loss_backward_transient_bytes`."""
    cut_cross_entropy: bool = setting(
        False,
        "Apple's Cut Cross Entropy replaces a causal LM's head and loss (axolotl's "
        "CutCrossEntropyPlugin): the logits are never built.",
    )
    """A causal LM's LM head and cross-entropy are Apple's Cut Cross Entropy
    (``cut_cross_entropy.linear_cross_entropy`` on the final hidden states and the head
    weight, as axolotl's ``CutCrossEntropyPlugin`` patches the model's forward): no (tokens x
    vocabulary) tensor in the forward or the backward (Note [Unsloth's Cut Cross Entropy],
    trainmem/analytic/loss.py). Default False; the axolotl reader sets it from the plugin.
    Under ``--framework unsloth`` the release decides (it is refused there); it needs
    ``chunked_cross_entropy`` 0 and the cross-entropy loss."""
    keep_logits: bool = setting(
        False,
        "The loop holds `logits = model(x)` until the step ends (through backward and the "
        "optimizer step).",
    )
    """The loop holds the model output until the step ends (``logits = model(x)``, then the
    loss, ``backward`` and ``optimizer.step()`` in one function): the logits live through the
    backward and the optimizer step. False, the default: they are dropped after the loss (HF
    Trainer's ``compute_loss``). Needs ``gradient_accumulation_steps`` 1."""
    loop: str | None = setting(
        None,
        "What the loop holds of a micro-batch's outputs:",
        choices=LOOPS,
        default_text=(
            "the framework's: litgpt previous, fsdp-qlora step, else drop (step with --keep-logits)"
        ),
    )
    """What the training loop holds of a micro-batch's outputs (:data:`~trainmem.specs.
    frameworks.LOOPS`): ``drop`` (nothing past the loss), ``step`` (the logits until the step
    ends, as ``keep_logits``), ``previous`` (the previous micro-batch's logits, and the tensors
    its graph keeps, until the next forward returns). None, the default: the framework's
    (``FrameworkConventions.loop``), or ``step`` with ``keep_logits``; an explicit value always
    wins (:attr:`TrainingConfig.training_loop`).
    """
    zero_grad_set_to_none: bool | None = setting(
        None,
        "zero_grad(set_to_none=...); keep: the gradients stay allocated, zeroed (torch < 2.0's "
        "default, or a loop that never zeroes its gradients).",
        off_flag="--zero-grad-keep",
        default_text="torch's for --torch-version: keep before 2.0",
    )
    """``optimizer.zero_grad(set_to_none=...)``: True frees the gradients after the step;
    False keeps them allocated, zeroed, through the next forward. None, the default: the
    framework's loop with torch's default for ``torch_version``, True from 2.0 and False before
    (``FrameworkConventions.zero_grad_set_to_none``, Note [zero_grad's default by release]:
    a plain loop's ``optimizer.zero_grad()``, the HF Trainer's ``model.zero_grad()``; DeepSpeed
    and Megatron have their own), resolved when the TrainingConfig is built. A loop that never
    zeroes its gradients (they accumulate across steps) holds the same memory as False. An
    explicit value always wins."""
    zero_grad_before_backward: bool = setting(
        False,
        "zero_grad() between the loss and backward(): last step's gradients live through the "
        "forward.",
    )
    """The loop calls ``optimizer.zero_grad()`` between the forward (and the loss) and
    ``loss.backward()`` instead of after the step: the previous step's gradients are alive
    through the forward, freed before the backward, and rebuilt layer by layer in it (with
    ``zero_grad_set_to_none=False`` they are always alive, so this changes nothing). Default
    False (zeroed after the step, as the HF Trainer and the PyTorch examples do). Needs
    ``gradient_accumulation_steps`` 1 (zeroing before each backward would accumulate
    nothing)."""

    def __post_init__(self) -> None:
        if self.zero_grad_set_to_none is None:  # alone; TrainingConfig resolves it by release
            object.__setattr__(self, "zero_grad_set_to_none", True)
        _check_ints(self, ("chunked_cross_entropy",), minimum=0)
        _check_flags(
            self,
            (
                "zero_grad_set_to_none",
                "zero_grad_before_backward",
                "keep_logits",
                "cut_cross_entropy",
            ),
        )
        _check_choices(self, LoopConfig)
        if self.chunked_cross_entropy and self.loss not in (None, "cross-entropy"):
            raise SpecError(
                "loss",
                f"{self.loss!r} cannot be chunked; chunked_cross_entropy "
                f"{self.chunked_cross_entropy} is a cross-entropy (use loss cross-entropy, or "
                "chunked_cross_entropy 0)",
            )
        if self.cut_cross_entropy and (
            self.chunked_cross_entropy or self.loss not in (None, "cross-entropy")
        ):
            # axolotl integrations/cut_cross_entropy/args.py
            # ``check_chunked_cross_entropy_not_set``; the kernel is a cross-entropy
            raise SpecError(
                "cut_cross_entropy",
                "Cut Cross Entropy is the whole cross-entropy: it needs chunked_cross_entropy 0 "
                f"(got {self.chunked_cross_entropy}) and loss cross-entropy or the model's own "
                f"(got {self.loss!r})",
            )


@dataclass(frozen=True, kw_only=True)
class EmaConfig:
    """An exponential moving average of the trainable weights (diffusers' ``EMAModel``).

    Raises:
        SpecError: an unknown dtype or device, or either without ``ema``.
    """

    ema: bool = setting(
        False,
        "An EMA copy of the trainable weights (diffusers EMAModel), stepped after the optimizer.",
    )
    """Keep an exponential moving average of the trainable weights (diffusers
    ``training_utils.EMAModel``: ``shadow_params = [p.clone().detach() ...]``, updated after
    each optimizer step); see Note [EMA weights] in ``analytic/tensor_states.py``. Default
    False (the diffusers scripts' ``--use_ema`` is off by default)."""
    ema_dtype: str | None = setting(
        None,
        "Dtype of the EMA copy:",
        choices=EMA_DTYPES,
        default_text="the trainable parameters' dtype",
    )
    """Dtype of the EMA copy: ``float32`` or ``bfloat16`` (:data:`EMA_DTYPES`); None, the
    default: each trainable parameter's own dtype (``p.clone()``). Needs ``ema``."""
    ema_device: str = setting(
        "cuda",
        "Where the EMA copy lives (cpu: diffusers' --offload_ema, on the GPU only for its step):",
        choices=EMA_DEVICES,
    )
    """Where the EMA copy lives (:data:`EMA_DEVICES`): ``cuda``, the default (the whole run,
    ``ema_unet.to(accelerator.device)``), or ``cpu`` (diffusers examples' ``--offload_ema``:
    moved to the GPU for ``ema.step`` and back). ``cpu`` needs ``ema``."""

    def __post_init__(self) -> None:
        _check_flags(self, ("ema",))
        _check_choices(self, EmaConfig)
        if not self.ema:
            for name, value in (("ema_dtype", None), ("ema_device", "cuda")):
                if getattr(self, name) != value:
                    raise SpecError(name, f"{getattr(self, name)!r} needs ema (set ema true)")


@dataclass(frozen=True, kw_only=True)
class CheckpointingConfig:
    """What the forward keeps for the backward: activation checkpointing and offloading.

    Raises:
        SpecError: an unknown checkpointing mode, a flag that is not a bool.
    """

    activation_checkpointing: ActivationCheckpointing = setting(
        None,
        "Activation checkpointing:",
        choices=ACTIVATION_CHECKPOINTING,
        short="-c",
        default_text='none; --framework unsloth: full, its offloaded "unsloth" mode; '
        "--framework litgpt on more than one rank: full",
    )
    """:data:`ACTIVATION_CHECKPOINTING`: ``none`` (autograd keeps every saved tensor);
    ``selective`` (recompute attention core, Korthikanti et al. 2022 sec. 5); ``full`` (keep
    only each layer's input; under ``--framework unsloth`` Unsloth's offloaded
    ``use_gradient_checkpointing="unsloth"``). None, the default: the framework's
    (``FrameworkConventions.default_activation_checkpointing``): ``none``; Unsloth ``full``;
    litgpt ``full`` on more than one data-parallel rank
    (``FrameworkConventions.sharded_activation_checkpointing``: its fine-tuning scripts
    checkpoint every ``Block`` whenever they shard)."""
    activation_offloading: bool = setting(False, "Saved activations offloaded to CPU.")
    """Move saved activations to CPU after each layer's forward (torchtune
    ``OffloadActivations``): about two layers' activations stay on the GPU. Default False."""
    checkpoint_reentrant: bool | None = setting(
        None,
        "transformers' gradient checkpointing runs torch's reentrant checkpoint "
        "(use_reentrant=True).",
        default_text="transformers' default: reentrant before 5.0",
        no_option="a script's gradient_checkpointing_kwargs: given as --set "
        "checkpoint-reentrant=true",
    )
    """Whether transformers' gradient checkpointing wraps each layer in torch's reentrant
    ``checkpoint`` (``gradient_checkpointing_kwargs={"use_reentrant": True}``); None, the
    default: transformers' own default (:attr:`TrainingConfig.hf_checkpoint_reentrant`:
    reentrant before 5.0). Read only where reentrancy changes memory (Note [FSDP1 frozen units
    under reentrant checkpointing])."""

    def __post_init__(self) -> None:
        if self.activation_checkpointing is None:  # alone; TrainingConfig resolves it first
            object.__setattr__(self, "activation_checkpointing", "none")
        _check_flags(self, ("activation_offloading",))
        _check_choices(self, CheckpointingConfig)
        if self.checkpoint_reentrant is not None and not isinstance(
            self.checkpoint_reentrant, bool
        ):
            raise SpecError(
                "checkpoint_reentrant", f"must be true or false, got {self.checkpoint_reentrant!r}"
            )


@dataclass(frozen=True, kw_only=True)
class ForwardConfig:
    """How the model's forward runs: the attention kernel, dropout, an attention mask,
    torch.compile.

    Raises:
        SpecError: an unknown attention, a flag that is not a bool.
    """

    attention: Attention = setting(
        "sdpa",
        "Attention kernel:",
        choices=ATTENTIONS,
        default_text="sdpa; eager for families transformers runs eager only",
        defer="model",
    )
    """:data:`ATTENTIONS`: ``eager`` (materialised a*s*s scores), ``sdpa`` (PyTorch SDPA,
    flash/efficient kernels on CUDA), ``flash`` (flash-attn 2). Default ``sdpa``,
    transformers' default where the family has it; the CLI and the page leave it to the model
    (eager for BLOOM / Gemma-2, :func:`trainmem.estimate.default_attention_of`)."""
    dropout: bool = setting(True, "Apply the model's dropout.", off_flag="--no-dropout")
    """Apply the model's own dropout probabilities (False: treat them as 0). Default True, as
    ``model.train()`` does."""
    padding_mask: bool = setting(
        False,
        "Padded batches: the model gets an attention mask tensor.",
        no_option="one mask tensor, rarely the peak: given as --set padding-mask=true",
    )
    """The batches are padded, so the model gets an attention mask tensor. False, the default:
    causal attention without a mask (HF's ``is_causal`` path, packed or equal-length
    sequences)."""
    compile: bool = setting(False, "torch.compile: fused pointwise chains (see docs).")
    """``torch.compile`` (inductor). Modelled: pointwise chains (tanh GELU, RMSNorm) fused and
    recomputed by the min-cut partitioner, saving only their inputs. Not modelled: anything
    else the partitioner recomputes or saves differently (estimates stay an upper bound).
    Default False (eager)."""

    def __post_init__(self) -> None:
        _check_flags(self, ("dropout", "padding_mask", "compile"))
        _check_choices(self, ForwardConfig)


@dataclass(frozen=True, kw_only=True)
class ParallelismConfig:
    """How the step is split over GPUs: data, tensor, sequence, pipeline and context
    parallelism, and the communicators' buffers.

    Raises:
        SpecError: a size that is not a positive integer, an unknown schedule, sequence
            parallelism without tensor parallelism, a buffer size outside 0..2^40.
    """

    data_parallel_size: int = setting(1, "Ranks the model states are sharded over.")
    """Data-parallel ranks the model states are sharded over (ZeRO / FSDP), 1 to 2^31 - 1.
    Default 1 (one GPU)."""
    tensor_parallel_size: int = setting(
        1, "Tensor parallelism t (torch DTensor; Megatron's with --framework megatron)."
    )
    """Tensor parallelism t: linear weights, the vocabulary and attention heads split over t
    ranks (Shoeybi et al. 2019). As torch's DTensor applies it (torchtitan's plan,
    ``FrameworkConventions.dtensor_sequence_parallel``) for ``pytorch-amp`` / ``fsdp2``;
    Megatron's own with ``framework="megatron"``. Default 1 (none)."""
    sequence_parallel: bool = setting(False, "Sequence parallelism (needs t > 1).")
    """Sequence parallelism: the norm / dropout regions split over the t ranks too
    (Korthikanti et al. 2022, sec. 4.2.2); torch's ``SequenceParallel`` style saves the
    all-gathered inputs of the column-parallel linears, Megatron (``framework="megatron"``)
    saves the shard and gathers it again in backward. Default False; needs
    ``tensor_parallel_size`` > 1."""
    pipeline_parallel_size: int = setting(1, "Pipeline stages p.")
    """Pipeline stages p, 1 to 2^31 - 1; each holds about L / p layers
    (:func:`pipeline_stage_layers`). Default 1 (none)."""
    pipeline_schedule: str = setting("1f1b", "Pipeline schedule:", choices=PIPELINE_SCHEDULES)
    """:data:`PIPELINE_SCHEDULES`: ``1f1b`` (PipeDream-flush), the default as in Megatron and
    torchtitan; ``interleaved-1f1b`` (Narayanan et al. 2021), ``gpipe``."""
    virtual_pipeline_stages: int = setting(
        2,
        "Model chunks per rank of the interleaved-1f1b schedule.",
        no_option="read by one schedule only: --set virtual-pipeline-stages=N with "
        "--pipeline-schedule interleaved-1f1b",
    )
    """Model chunks per rank for ``interleaved-1f1b`` (Megatron ``virtual_pipeline_model_
    parallel_size``), 1 to 2^31 - 1. Default 2, the fewest that interleave."""
    context_parallel_size: int = setting(1, "Sequence split over this many ranks.")
    """Context parallelism: the sequence split over this many ranks (ring attention), 1 to
    2^31 - 1, a divisor of ``seq_len``. Default 1 (none)."""
    nccl_buffer_bytes: int | None = setting(
        None,
        "Device memory of one NCCL communicator, measured on your cluster.",
        default_text="688 MiB on A100, 1.06 GB on H100 (NCCL issues #964, #1685)",
    )
    """Device memory of one NCCL communicator in bytes, 0 to 2^40 (its buffers,
    ``cudaMalloc``-ed outside the caching allocator), as measured on the user's cluster; None,
    the default: the figure measured for the GPU's generation
    (:func:`trainmem.analytic.buffers.nccl_communicator_bytes`)."""

    def __post_init__(self) -> None:
        _check_ints(
            self,
            (
                "data_parallel_size",
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "context_parallel_size",
                "virtual_pipeline_stages",
            ),
            minimum=1,
        )
        nccl = self.nccl_buffer_bytes
        if nccl is not None and (not _is_int(nccl) or not 0 <= nccl <= 2**40):
            shown = describe_int(nccl) if _is_int(nccl) else f"{nccl!r:.40}"
            raise SpecError(
                "nccl_buffer_bytes", f"got {shown}; allowed: bytes per communicator, 0..2^40"
            )
        _check_flags(self, ("sequence_parallel",))
        _check_choices(self, ParallelismConfig)
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise SpecError("sequence_parallel", "needs tensor_parallel_size > 1")


_DEEPSPEED_ONLY = "a ds_config setting: read from --deepspeed-config, or --set KEY=VALUE"
"""Why the DeepSpeed ``zero_optimization`` settings have no option of their own."""


@dataclass(frozen=True, kw_only=True)
class ShardingConfig:
    """How the model states are sharded and offloaded: ZeRO stage / FSDP strategy, shard
    group, CPU offload, DeepSpeed's buckets.

    Raises:
        SpecError: an unknown stage or offload, ``optimizer+params`` below stage 3, a bucket
            that is neither a non-negative integer nor ``"auto"``.
    """

    zero_stage: int = setting(0, "ZeRO stage:", choices=ZERO_STAGES)
    """ZeRO stage (Rajbhandari et al. 2020, sec. 5), :data:`ZERO_STAGES`: 0 none, the default;
    1 optimizer states, 2 + gradients, 3 + parameters, each sharded over ``data_parallel_size``
    ranks. FSDP's strategies set it (:func:`fsdp_settings`)."""
    offload: str = setting("none", "Offload to the CPU:", choices=OFFLOADS)
    """:data:`OFFLOADS`: ``none``, the default; ``optimizer``: optimizer states (and the step)
    on the CPU (ZeRO-Offload, Ren et al. 2021); ``optimizer+gradients``: the reduced gradients
    are moved to the CPU as well (one layer's stay on the GPU until they are reduced);
    ``optimizer+params``: parameters, gradients and states (ZeRO-Infinity style, stage 3
    only)."""
    shard_group_size: int | None = setting(
        None,
        "Ranks a shard spans (HYBRID_SHARD: one node).",
        default_text="all data-parallel",
    )
    """Ranks the ZeRO / FSDP shards are spread over when smaller than the data-parallel world,
    1 to 2^31 - 1: FSDP ``HYBRID_SHARD`` shards within a node (its intra-node process group)
    and replicates across nodes (torch distributed/fsdp/api.py ``ShardingStrategy``); None, the
    default: all ``data_parallel_size`` ranks."""
    reshard_after_forward: bool = setting(
        True,
        "ZeRO-3 / FSDP frees each module's gathered weights after its forward (false: FSDP "
        "SHARD_GRAD_OP).",
        no_option="set by --fsdp shard-grad-op, or --set reshard-after-forward=false",
    )
    """ZeRO-3 / FULL_SHARD frees each module's gathered weights after its forward (True, the
    default of both); False (FSDP ``SHARD_GRAD_OP``, FSDP2 ``reshard_after_forward=False``)
    keeps them until the module's backward, so every layer's gathered weights are alive at the
    end of the forward (torch distributed/fsdp/api.py ``ShardingStrategy.SHARD_GRAD_OP``:
    "parameters are sharded outside computation", resharded after backward)."""
    fsdp_embedding_head_units: bool = setting(
        False,
        "FSDP: the token embedding and the output head are units of their own, resharded "
        "after forward (torchtune's custom_sharded_layers).",
        no_option="a recipe's custom_sharded_layers: ['tok_embeddings', 'output'], given as "
        "--set fsdp-embedding-head-units=true",
    )
    """FSDP wraps the token embedding and the output head each as a unit of its own, resharded
    after its forward like the layers, instead of leaving them to the root unit, which stays
    gathered from the forward to the end of the backward (Note [FSDP embedding and head
    units]: torchtune's ``custom_sharded_layers: ['tok_embeddings', 'output']``, the default of
    its llama3 / llama3_1 8B and 70B full fine-tuning configs); False, the default: FSDP's
    root holds them."""
    reduce_bucket_size: int | Literal["auto"] | None = setting(
        None,
        "DeepSpeed zero_optimization.reduce_bucket_size, in elements, or auto.",
        default_text="DeepSpeed's 5e8",
        no_option=_DEEPSPEED_ONLY,
    )
    """DeepSpeed ``zero_optimization.reduce_bucket_size`` in elements (>= 0); ``"auto"``: what
    the HF Trainer fills in, hidden_size^2 (transformers integrations/deepspeed.py
    ``trainer_config_finalize``); None, the default: DeepSpeed's default, 5e8
    (runtime/zero/config.py)."""
    stage3_prefetch_bucket_size: int | Literal["auto"] | None = setting(
        None,
        "DeepSpeed ZeRO-3 stage3_prefetch_bucket_size, in elements, or auto.",
        default_text="DeepSpeed's 5e7",
        no_option=_DEEPSPEED_ONLY,
    )
    """DeepSpeed ZeRO-3 ``stage3_prefetch_bucket_size``, elements of parameters gathered ahead
    of use (>= 0); ``"auto"``: the HF Trainer's 0.9 * hidden_size^2; None, the default:
    DeepSpeed's 5e7."""
    stage3_max_live_parameters: int | Literal["auto"] | None = setting(
        None,
        "DeepSpeed ZeRO-3 stage3_max_live_parameters, in elements.",
        default_text="DeepSpeed's 1e9",
        no_option=_DEEPSPEED_ONLY,
    )
    """DeepSpeed ZeRO-3 ``stage3_max_live_parameters``: most gathered parameter elements the
    prefetcher lets be alive (>= 0); None, the default (and ``"auto"``, which the HF Trainer
    does not fill in): DeepSpeed's default, 1e9 (runtime/zero/config.py
    ``max_live_parameters``)."""
    stage3_max_reuse_distance: int | Literal["auto"] | None = setting(
        None,
        "DeepSpeed ZeRO-3 stage3_max_reuse_distance, in elements.",
        default_text="DeepSpeed's 1e9",
        no_option=_DEEPSPEED_ONLY,
    )
    """DeepSpeed ZeRO-3 ``stage3_max_reuse_distance``: a gathered parameter used again within
    this many elements of the module trace is not released (Note [DeepSpeed ZeRO-3 parameter
    gathers]); None, the default (and ``"auto"``, which the HF Trainer does not fill in):
    DeepSpeed's default, 1e9 (runtime/zero/config.py ``max_reuse_distance``)."""
    overlap_comm: bool | None = setting(
        None,
        "DeepSpeed zero_optimization.overlap_comm (doubles the stage 1/2 gradient bucket).",
        default_text="DeepSpeed's: true at stage 3, false below",
        no_option=_DEEPSPEED_ONLY,
    )
    """DeepSpeed ``zero_optimization.overlap_comm`` (doubles the stage 1/2 gradient bucket);
    None, the default: DeepSpeed's default, True at stage 3 and False below
    (``overlap_comm_valid``)."""

    def __post_init__(self) -> None:
        _check_flags(self, ("reshard_after_forward", "fsdp_embedding_head_units"))
        for name in (
            "reduce_bucket_size",
            "stage3_prefetch_bucket_size",
            "stage3_max_live_parameters",
            "stage3_max_reuse_distance",
        ):
            bucket = getattr(self, name)
            if bucket is not None and bucket != "auto":
                if not isinstance(bucket, int) or isinstance(bucket, bool) or bucket < 0:
                    raise SpecError(
                        name, f"must be a non-negative integer or 'auto', got {bucket!r}"
                    )
        if self.overlap_comm is not None and not isinstance(self.overlap_comm, bool):
            raise SpecError("overlap_comm", f"must be true or false, got {self.overlap_comm!r}")
        if self.shard_group_size is not None:
            _check_int("shard_group_size", self.shard_group_size, minimum=1)
        if not _is_int(self.zero_stage) or self.zero_stage not in ZERO_STAGES:
            raise SpecError("zero_stage", f"unknown value {self.zero_stage!r}; allowed: 0, 1, 2, 3")
        _check_choices(self, ShardingConfig)
        if self.offload == "optimizer+params" and self.zero_stage != 3:
            raise SpecError("offload", "optimizer+params needs zero_stage 3 (parameter sharding)")


@dataclass(frozen=True, kw_only=True)
class PeftConfig:
    """Parameter-efficient fine-tuning: LoRA adapters and a quantized frozen base (QLoRA).

    Raises:
        SpecError: a negative rank, an unknown target, a dropout outside [0, 1), an unknown
            quantization, or a quantized base without LoRA.
    """

    lora_rank: int = setting(0, "LoRA rank r (0: full fine-tuning).")
    """LoRA rank r (Hu et al. 2021), 0 to 2^31 - 1; 0, the default: full fine-tuning."""
    lora_targets: tuple[str, ...] = setting(
        None,
        "Linears that get LoRA adapters (on the command line: comma-separated, or all-linear):",
        choices=(*LORA_TARGETS, "lm_head", *DIFFUSERS_LORA_TARGETS),
        default_text="q,v, peft's; --framework unsloth: q,k,v,o,gate,up,down, its get_peft_model's",
    )
    """Linears that get LoRA adapters: names of :data:`LORA_TARGETS` or ``lm_head`` (peft's
    Llama module names of :data:`LORA_TARGET_ALIASES` are read as theirs); for a diffusers
    model also its module names of :data:`DIFFUSERS_LORA_TARGETS` (``to_q,to_k,to_v,to_out.0``,
    refused for other models). None, the default:
    the framework's (``FrameworkConventions.default_lora_targets``, resolved when the
    TrainingConfig is made, so every reader sees names): ``("q", "v")``, peft's default for
    Llama (q_proj, v_proj); under Unsloth all seven linears, ``FastLanguageModel.
    get_peft_model``'s ``target_modules`` (:data:`~trainmem.specs.frameworks.
    UNSLOTH_LORA_TARGETS`). An explicit value always wins, even one another framework
    defaults to."""
    lora_dropout: float = setting(0.0, "Dropout on the LoRA input (peft lora_dropout).")
    """Dropout probability on the LoRA input (peft ``lora_dropout``), in [0, 1); > 0 keeps a
    copy of the input. Default 0.0, peft's."""
    lora_variant: str = setting(
        "lora",
        "peft adapter type on the --lora-targets (dora: LoraConfig(use_dora=True); adalora, "
        "lokr, loha: peft's AdaLoraConfig, LoKrConfig, LoHaConfig):",
        choices=LORA_VARIANTS,
    )
    """peft's adapter type (:data:`LORA_VARIANTS`): ``lora``, the default; ``dora``
    (weight-decomposed LoRA, ``LoraConfig(use_dora=True)``: a trainable fp32 magnitude of
    out_features per targeted linear, and a forward that rebuilds the full weight to take its
    row norms; Note [DoRA] in ``analytic/lora_variants.py``); ``adalora`` (``AdaLoraConfig``
    with ``init_r = lora_rank``: SVD-shaped adapters P, Lambda, Q and the orthogonality penalty
    in the forward); ``lokr`` (``LoKrConfig(r=lora_rank)``: each targeted weight's update as a
    Kronecker product, rebuilt to full size in every forward); ``loha`` (``LoHaConfig(r=
    lora_rank)``: each targeted weight's update as the Hadamard product of two rank-r
    products, rebuilt to full size in every forward). ``adalora`` / ``lokr`` / ``loha`` run peft's
    code on the traced paths only (``trainmem.trace.lora``); AdaLoRA's rank allocator
    (``update_and_allocate``, called by the loop: two averages of the adapters' importance) is
    not modelled. Needs ``lora_rank > 0``."""
    lora_modules_to_save: tuple[str, ...] = setting(
        None,
        "Modules LoRA trains whole beside its adapters (peft modules_to_save; on the command "
        "line: comma-separated):",
        choices=LORA_MODULES_TO_SAVE,
        default_text="none",
    )
    """Modules trained whole beside the LoRA adapters (peft ``LoraConfig(modules_to_save=
    [...])``; axolotl ``lora_modules_to_save``; LLaMA-Factory ``additional_target``): names of
    :data:`LORA_MODULES_TO_SAVE` (``embed_tokens``, ``lm_head``; peft's names of other families
    in :data:`LORA_MODULES_TO_SAVE_ALIASES` are read as theirs). peft keeps the original module
    frozen and trains a deep copy of it, in the original's dtype (Note [peft modules_to_save]
    in :mod:`trainmem.analytic.tensor_states`). None, the default: none, resolved to ``()``
    when the config is made (the web page's unticked group). Needs ``lora_rank > 0``."""
    lora_adapter_dtype: str | None = setting(
        None,
        "Dtype of the LoRA adapters, their gradients and optimizer states (float32: diffusers' "
        "cast_training_params(model, torch.float32), which CogVideo's and finetrainers' LoRA "
        "trainers call for every precision):",
        choices=LORA_ADAPTER_DTYPES,
        default_text="the framework's (peft: float32 over a 16-bit base; diffusers' add_adapter: "
        "the base's)",
    )
    """Dtype of the LoRA adapters (:data:`LORA_ADAPTER_DTYPES`), cast after they are made, as
    diffusers' ``training_utils.cast_training_params(model, dtype)`` casts every trainable
    parameter (CogVideo finetune/trainer.py ``prepare_optimizer`` and finetrainers from d220aac
    call it with ``torch.float32`` for every precision); their gradients and optimizer states
    follow. None, the default: the framework's rule (``trainmem.analytic.lora.
    lora_adapter_dtype``: peft's ``PeftModel`` upcasts adapters over a 16-bit base to fp32,
    diffusers' ``add_adapter`` keeps the base layer's dtype and its scripts upcast for fp16
    only, DeepSpeed casts them with the module, lit-gpt / torchtune keep the model's). Needs
    ``lora_rank > 0``; not with ``zero_stage`` > 0 (DeepSpeed and FSDP flatten or cast the
    wrapped module's parameters to one dtype) nor a quantized base."""
    quantize_base: str = setting(
        "none", "Frozen base weights quantized (QLoRA and kin):", choices=QUANTIZE_BASE
    )
    """Frozen base linear weights (:data:`QUANTIZE_BASE`), bitsandbytes names as lit-gpt spells
    them: ``nf4`` / ``fp4`` (4-bit, blocksize 64, fp32 absmax), ``nf4-dq`` / ``fp4-dq`` (with
    QLoRA's double quantization, Dettmers et al. 2023; peft's
    ``bnb_4bit_use_double_quant=True``), ``int8`` (LLM.int8()), ``gptq-int4`` (GPTQ, Frantar et
    al. 2022: 4-bit weights, group size 128), ``chatglm-int8`` / ``chatglm-int4`` (ChatGLM2 /
    ChatGLM3's own ``model.quantize(8 | 4)`` under P-Tuning v2, as THUDM's ptuning scripts'
    ``--quantization_bit``: :data:`CHATGLM_QUANTIZE`), or ``none``, the default (the base in its
    precision's dtype)."""
    num_virtual_tokens: int = setting(
        0,
        "Virtual tokens trained over a frozen base (peft num_virtual_tokens; prefix tuning / "
        "P-Tuning v2: keys and values per layer, ChatGLM's pre_seq_len); 0: none.",
    )
    """Prefix tuning (Li and Liang 2021, arXiv:2101.00190; P-Tuning v2, Liu et al. 2022,
    arXiv:2110.07602): the number of virtual tokens whose keys and values every layer's
    attention reads before the sequence's (peft ``PrefixTuningConfig(num_virtual_tokens)``;
    ChatGLM2/3's remote code ``config.pre_seq_len``, its own ``PrefixEncoder`` of the same
    shapes), or the prompts of :attr:`prompt_learning`'s other methods. The base is frozen;
    the prefix / prompt encoder is the only trainable module (Note [Prefix tuning] in
    :mod:`trainmem.trace.prefix`). 0, the default: none. Traced (``--engine generic``); not in
    the formulas."""
    prompt_learning: str = setting(
        "prefix-tuning",
        "peft prompt-learning method of the --num-virtual-tokens:",
        choices=PROMPT_LEARNING,
    )
    """peft's prompt-learning method (:data:`PROMPT_LEARNING`) the ``num_virtual_tokens`` are
    trained by: ``prefix-tuning``, the default (``PrefixTuningConfig``: keys and values of
    every layer, P-Tuning v2, ChatGLM's ``pre_seq_len``); ``p-tuning`` (``PromptEncoderConfig``,
    Liu et al. 2021, arXiv:2103.10385: virtual token embeddings through an MLP, prepended to
    the input embeddings); ``prompt-tuning`` (``PromptTuningConfig``, Lester et al. 2021,
    arXiv:2104.08691: virtual token embeddings prepended as they are). The last two lengthen
    every layer's sequence by ``num_virtual_tokens`` (Note [Prefix tuning] in
    :mod:`trainmem.trace.prefix`). Only read with ``num_virtual_tokens``."""
    prefix_projection: bool = setting(
        False,
        "Prefix tuning's two-layer MLP over the prefix embedding (peft / ChatGLM "
        "prefix_projection).",
    )
    """peft's ``PrefixTuningConfig(prefix_projection=True)``: the prefix is an embedding of
    ``token_dim`` per virtual token reparametrised by ``Linear(token_dim, token_dim)``, tanh,
    ``Linear(token_dim, 2 L token_dim)`` (peft tuners/prefix_tuning/model.py
    ``PrefixEncoder``); False, the default (peft's and ChatGLM3's finetune configs'): the
    prefix keys / values are the embedding's weight itself. Needs ``num_virtual_tokens``."""
    prepare_kbit_training: bool | None = setting(
        None,
        "peft's prepare_model_for_kbit_training on a quantized base: embeddings, norms and LM "
        "head cast to fp32.",
        default_text="the framework's",
        no_option="rarely differs from the framework's: given as --set prepare-kbit-training=false",
    )
    """Whether the quantized base goes through peft's ``prepare_model_for_kbit_training``
    (peft utils/other.py: every parameter that is not quantized cast to fp32, so the residual
    stream is fp32 too); None, the default: the framework's
    (``FrameworkConventions.peft_kbit_training``: the HF Trainer / TRL stacks call it; lit-gpt,
    torchtune and Answer.AI fsdp_qlora do not; axolotl calls it and casts the embeddings and
    norms back, Note [axolotl casts a k-bit base's embeddings and norms back]). False for a
    loop that prepares the model
    itself without the upcast (fms-acceleration's accelerated-peft plugins,
    ``framework_plugin_bnb.py _prepare_model_for_kbit_training``: "the stock one in peft will
    introduce extraneous casting"). Only read with a quantized base."""

    @property
    def is_lora(self) -> bool:
        """True when LoRA adapters are trained (beside them, only the modules of
        ``lora_modules_to_save``)."""
        return self.lora_rank > 0

    @property
    def is_prompt_learning(self) -> bool:
        """True when ``num_virtual_tokens > 0`` virtual tokens are trained over a frozen base
        (peft's prompt learning: :attr:`prompt_learning`)."""
        return self.num_virtual_tokens > 0

    @property
    def frozen_base(self) -> bool:
        """The base model's own weights are frozen: LoRA trains its adapters (and the saved
        modules), prompt learning its prompt encoder (Note [Prompt encoder tensors] in
        trainmem/analytic/prompt_encoder.py)."""
        return self.is_lora or self.is_prompt_learning

    @property
    def prepended_tokens(self) -> int:
        """The virtual tokens peft prepends to the input embeddings (and ``p`` ignored labels
        to the labels): ``num_virtual_tokens`` under p-tuning / prompt tuning, 0 under prefix
        tuning (its tokens are keys / values in the cache) or without prompt learning (Note
        [Prefix tuning] in trainmem/trace/prefix.py)."""
        if not self.is_prompt_learning or self.prompt_learning == "prefix-tuning":
            return 0
        return self.num_virtual_tokens

    @property
    def prefix_tokens(self) -> int:
        """The virtual tokens whose keys / values every attention layer reads before the
        sequence's: ``num_virtual_tokens`` under prefix tuning, else 0 (Note [Prefix tuning] in
        trainmem/trace/prefix.py)."""
        if self.is_prompt_learning and self.prompt_learning == "prefix-tuning":
            return self.num_virtual_tokens
        return 0

    @property
    def trains_embedding(self) -> bool:
        """The token embedding's weight gets a gradient: full fine-tuning, or LoRA with
        ``embed_tokens`` in ``lora_modules_to_save`` (peft's trainable copy of it); never
        under prefix tuning (the base is frozen)."""
        if self.is_prompt_learning:
            return False
        return not self.is_lora or "embed_tokens" in self.lora_modules_to_save

    @property
    def trains_lm_head(self) -> bool:
        """The LM head's weight (not a LoRA adapter on it) gets a gradient: full fine-tuning,
        or LoRA with ``lm_head`` in ``lora_modules_to_save`` (peft's trainable copy of it);
        never under prefix tuning (the base is frozen)."""
        if self.is_prompt_learning:
            return False
        return not self.is_lora or "lm_head" in self.lora_modules_to_save

    def __post_init__(self) -> None:
        _check_ints(self, ("lora_rank",), minimum=0)
        if self.lora_targets is None:  # alone; TrainingConfig resolves it by framework first
            object.__setattr__(self, "lora_targets", PEFT_DEFAULT_LORA_TARGETS)
        if not isinstance(self.lora_targets, tuple):
            raise SpecError("lora_targets", f"must be a tuple of names, got {self.lora_targets!r}")
        targets = tuple(
            LORA_TARGET_ALIASES.get(t, t) if isinstance(t, str) else t for t in self.lora_targets
        )
        object.__setattr__(self, "lora_targets", tuple(dict.fromkeys(targets)))
        for target in self.lora_targets:
            _check_choice(
                "lora_targets", target, (*LORA_TARGETS, "lm_head", *DIFFUSERS_LORA_TARGETS)
            )
        if self.lora_rank > 0 and not self.lora_targets:
            raise SpecError("lora_targets", "empty: LoRA (lora_rank > 0) needs at least one")
        if self.lora_modules_to_save is None:
            object.__setattr__(self, "lora_modules_to_save", ())
        if not isinstance(self.lora_modules_to_save, tuple):
            raise SpecError(
                "lora_modules_to_save",
                f"must be a tuple of names, got {self.lora_modules_to_save!r}; allowed: "
                + ", ".join(LORA_MODULES_TO_SAVE),
            )
        saved = tuple(
            LORA_MODULES_TO_SAVE_ALIASES.get(m, m) if isinstance(m, str) else m
            for m in self.lora_modules_to_save
        )
        object.__setattr__(self, "lora_modules_to_save", tuple(dict.fromkeys(saved)))
        for module in self.lora_modules_to_save:
            _check_choice("lora_modules_to_save", module, LORA_MODULES_TO_SAVE)
        if self.lora_modules_to_save and self.lora_rank == 0:
            raise SpecError(
                "lora_modules_to_save",
                f"{','.join(self.lora_modules_to_save)} is trained beside LoRA adapters: set "
                "lora_rank > 0 (full fine-tuning already trains every module)",
            )
        if "lm_head" in self.lora_modules_to_save and "lm_head" in self.lora_targets:
            raise SpecError(
                "lora_modules_to_save",
                "lm_head is also a LoRA target: peft 0.21.2 never adapts a module it saves "
                "(tuners/tuners_utils.py check_target_module_exists: _ExcludedModule), so the "
                "head is trained whole with no adapter; allowed: lm_head in one of "
                "lora_modules_to_save, lora_targets",
            )
        dropout = self.lora_dropout
        if isinstance(dropout, bool) or not isinstance(dropout, int | float):
            raise SpecError("lora_dropout", f"must be a number in [0, 1), got {dropout!r}")
        if not 0.0 <= dropout < 1.0:  # also refuses NaN
            raise SpecError("lora_dropout", f"must be in [0, 1), got {dropout!r}")
        _check_choices(self, PeftConfig)
        if self.lora_adapter_dtype is not None and (
            self.lora_rank == 0 or self.quantize_base != "none"
        ):
            raise SpecError(
                "lora_adapter_dtype",
                f"{self.lora_adapter_dtype} casts LoRA adapters over an unquantized base: set "
                "lora_rank > 0 and quantize_base none, or leave it unset",
            )
        if self.prepare_kbit_training is not None and not isinstance(
            self.prepare_kbit_training, bool
        ):
            raise SpecError(
                "prepare_kbit_training",
                f"must be true or false, got {self.prepare_kbit_training!r}",
            )
        if self.quantize_base in CHATGLM_QUANTIZE:
            _check_chatglm_quantize(self)
        elif self.quantize_base != "none" and self.lora_rank == 0:
            raise SpecError(
                "quantize_base", "a quantized base is frozen: set lora_rank > 0 (QLoRA)"
            )
        if self.lora_variant in LYCORIS_VARIANTS and self.lora_dropout > 0:
            name = LYCORIS_VARIANTS[self.lora_variant]
            raise SpecError(
                "lora_dropout",
                f"{self.lora_dropout}: peft's {name} has no input dropout (its rank_dropout and "
                "module_dropout drop other things); set lora_dropout 0 with lora_variant "
                f"{self.lora_variant}",
            )
        if self.lora_variant != "lora" and self.lora_rank == 0:
            raise SpecError(
                "lora_variant",
                f"{self.lora_variant} is a kind of adapter: set lora_rank > 0 (or leave lora)",
            )
        _check_prefix_tuning(self)


def _check_chatglm_quantize(p: PeftConfig) -> None:
    """ChatGLM's own quantize (:data:`CHATGLM_QUANTIZE`) trains a prompt over its frozen base:
    THUDM's ptuning scripts quantize before P-Tuning v2 (ChatGLM2-6B ptuning/main.py,
    ChatGLM3 finetune_demo/finetune.py @7559fe2: ``model.quantize(quantization_bit)`` then
    ``model.half()`` and the prefix encoder ``.float()``); peft's LoRA cannot wrap its
    ``QuantizedLinear`` (a ``torch.nn.Module``, not a ``Linear``: peft 0.21.2
    tuners/lora/model.py ``_create_new_module`` raises "Target module ... is not supported").

    Raises:
        SpecError: ``quantize_base`` beside LoRA or without virtual tokens.
    """
    if p.is_lora or not p.is_prompt_learning:
        raise SpecError(
            "quantize_base",
            f"{p.quantize_base} (ChatGLM's own quantize) is a frozen base under P-Tuning v2: set "
            "num_virtual_tokens > 0 with lora_rank 0 (peft's LoRA cannot wrap its "
            "QuantizedLinear, not a torch.nn.Linear); for LoRA over a quantized base: nf4, "
            "nf4-dq, fp4, fp4-dq, int8 or gptq-int4",
        )


def _check_prefix_tuning(p: PeftConfig) -> None:
    """Prefix tuning's own checks: a count of virtual tokens, its projection only with a
    prefix, and no LoRA beside it (peft 0.21.2 ``get_peft_model`` makes one adapter type per
    model: a ``PrefixTuningConfig`` is a prompt-learning ``PeftModel``, LoRA a tuner's).

    Raises:
        SpecError: a negative or non-integer count, ``prefix_projection`` not a bool or
            without ``num_virtual_tokens``, or LoRA beside the prefix.
    """
    _check_ints(p, ("num_virtual_tokens",), minimum=0)
    _check_flags(p, ("prefix_projection",))
    if p.prefix_projection and not (p.is_prompt_learning and p.prompt_learning == "prefix-tuning"):
        raise SpecError(
            "prefix_projection",
            "reparametrises a trained prefix: set num_virtual_tokens > 0 with prompt_learning "
            "prefix-tuning (or leave it false)",
        )
    if p.is_prompt_learning and p.is_lora:
        raise SpecError(
            "num_virtual_tokens",
            f"{p.num_virtual_tokens} beside lora_rank {p.lora_rank}: peft trains one adapter "
            "type per model (a PrefixTuningConfig or a LoraConfig); allowed: "
            "num_virtual_tokens 0 with LoRA, or lora_rank 0 with prefix tuning",
        )


@dataclass(frozen=True, kw_only=True)
class FrameworkConfig:
    """Whose code runs: the framework's conventions and the library releases whose memory
    behaviour differs.

    Raises:
        SpecError: an unknown framework, a version that is not a version string.
    """

    framework: str = setting(
        "pytorch-amp",
        "Whose conventions set the bytes per parameter and the loss:",
        choices=FRAMEWORKS,
    )
    """Whose conventions set the bytes per parameter and the loss (:data:`FRAMEWORKS`); Note
    [Framework conventions]. Default ``pytorch-amp``, a plain PyTorch loop with
    torch.autocast."""
    torch_version: str | None = setting(
        None,
        "torch release where a default depends on it.",
        default_text="a current release, >= 2.8",
    )
    """torch release (``"2.5"``) where a default depends on it (the HF Trainer's default
    optimizer, torch's foreach default); None, the default: a current release (>= 2.8)."""
    transformers_version: str | None = setting(
        None,
        "transformers release whose model code runs (before 4.49: GPT-2-era losses on 16-bit "
        "logits, a shifted copy of the logits).",
        default_text="installed",
    )
    """transformers release (``"4.48"``) whose model code runs, where a family's memory depends
    on it (before 4.49: the loss on 16-bit logits of GPT-2, GPTBigCode, Falcon, BLOOM, ...,
    ``ModelSpec.causal_lm_loss_in_logits_dtype``, and a shifted copy of the logits,
    trainmem.analytic.activations ``shifted_logits_bytes``); None, the default: the installed
    transformers, else the newest the ``trace`` extra allows (:attr:`transformers_release`)."""
    bitsandbytes_version: str | None = setting(
        None,
        "bitsandbytes release (4-bit matmuls save their input before 0.43.2).",
        default_text="a current release",
    )
    """bitsandbytes release (``"0.41.1"``) where its memory behaviour changed (``MatMul4Bit``
    saves its input before 0.43.2); None, the default: a current release
    (:data:`~trainmem.specs.frameworks.DEFAULT_BITSANDBYTES_VERSION`)."""
    torchao_version: str | None = setting(
        None,
        "torchao release (before 0.2, NF4 quantization at load is not chunked).",
        default_text="a current release",
    )
    """torchao release (``"0.1"``) whose ``NF4Tensor`` torchtune's QLoRA quantizes with: before
    0.2 the whole weight's nearest-NF4 search at once, the load phase's peak
    (:mod:`trainmem.analytic.load`); None, the default: a current release
    (:data:`~trainmem.specs.frameworks.DEFAULT_TORCHAO_VERSION`)."""
    torchtune_version: str | None = setting(
        None,
        "torchtune release (before 0.3 the recipes' loss takes the shifted logits transposed).",
        default_text="0.6.1",
    )
    """torchtune release (``"0.1"``) whose recipes run with ``framework="torchtune"``: before
    0.3 (:data:`~trainmem.specs.frameworks.TORCHTUNE_RESHAPED_LOSS_SINCE`) their loss is the
    transposed cross-entropy (:attr:`TrainingConfig.recipe_loss`); None, the default:
    :data:`~trainmem.specs.frameworks.DEFAULT_TORCHTUNE_VERSION`."""
    litgpt_version: str | None = setting(
        None,
        "litgpt release (from 0.4.6 its RMSNorm multiplies the weight in fp32).",
        default_text="0.5.13",
    )
    """litgpt release (``"0.4.0"``) whose model code runs with ``framework="litgpt"``: from
    0.4.6 (:data:`~trainmem.specs.frameworks.LITGPT_RMSNORM_FP32_WEIGHT_SINCE`) a trained
    RMSNorm saves its fp32 normalised tensor; None, the default:
    :data:`~trainmem.specs.frameworks.DEFAULT_LITGPT_VERSION`, the release the traced paths
    run."""
    torchtitan_version: str | None = setting(
        None,
        "torchtitan release (from 0.1 its loss is compiled with --compile).",
        default_text="0.0.2 (Dec 2024)",
    )
    """torchtitan release (``"0.1"``) whose train loop runs with ``framework="fsdp2"``: from
    0.1 (:data:`~trainmem.specs.frameworks.TORCHTITAN_COMPILED_LOSS_SINCE`) ``--compile``
    compiles the cross-entropy too (trainmem.analytic.loss ``torchtitan_compiled_loss``);
    None, the default: :data:`~trainmem.specs.frameworks.DEFAULT_TORCHTITAN_VERSION`, the
    December 2024 tree the ``fsdp2`` conventions were read from."""
    load_phase: bool | None = setting(
        None,
        "Model the load phase (building / quantizing the model on the GPU before the step).",
        default_text="the framework's",
        no_option="rarely differs from the framework's: given as --set load-phase=false",
    )
    """Whether the schedule has a load phase before the step (Note [The load phase]: torchtune
    QLoRA on torchao 0.1, fsdp_qlora's FSDP1 initialisation; :func:`trainmem.analytic.load.
    load_rule`); None, the default: wherever a rule applies to the framework and versions;
    False: none (the weights appear as they are, e.g. a run that empties the cache before
    training). True cannot add a load phase no rule describes."""
    unsloth_version: str | None = setting(
        None,
        "Unsloth release with --framework unsloth (from 2024.7; before 2025.3 its older "
        "checkpoint and LoRA kernels, before 2025.8.5 Cut Cross Entropy, before 2024.11.8 "
        "the whole logits).",
        default_text="2026.3.5",
    )
    """Unsloth release (``"2025.1.5"``) whose code runs with ``framework="unsloth"``, from
    :data:`~trainmem.specs.frameworks.UNSLOTH_OLDEST_MODELLED`: before 2025.3.1 the older
    offloaded checkpoint and the LoRA kernels' product tensor
    (:data:`~trainmem.specs.frameworks.UNSLOTH_SMART_CHECKPOINT_SINCE`), before 2025.2.1 no
    dequantization buffer, before 2025.8.5 Apple's Cut Cross Entropy as the loss
    (:data:`~trainmem.specs.frameworks.UNSLOTH_FUSED_LOSS_SINCE`), before 2024.11.8 its own
    kernel on the returned logits; None, the default:
    :data:`~trainmem.specs.frameworks.DEFAULT_UNSLOTH_VERSION`, the release read."""
    deepspeed_version: str | None = setting(
        None,
        "DeepSpeed release (bf16 accumulates in fp32 without ZeRO before 0.17.6).",
        default_text="a current release",
    )
    """DeepSpeed release (``"0.16.9"``) where a default depends on it (bf16 gradients
    accumulate in fp32 without ZeRO before 0.17.6); None, the default: a current release."""
    accelerate_version: str | None = setting(
        None,
        "accelerate release whose prepared optimizer's zero_grad() the loop calls "
        "(--framework accelerate-fsdp; before 0.28 it keeps the gradients as zeros).",
        default_text="a current release",
    )
    """accelerate release (``"0.27.2"``) whose ``AcceleratedOptimizer.zero_grad()`` the loop
    calls (``FrameworkConventions.accelerate_optimizer_zero_grad``: accelerate-fsdp): before
    :data:`~trainmem.specs.frameworks.ACCELERATE_ZERO_GRAD_SET_TO_NONE_SINCE` it passes
    ``set_to_none=False``, so the gradients stay allocated through the next forward (Note
    [zero_grad's default by release]); None, the default: a current release. A given
    ``zero_grad_set_to_none`` wins."""
    trl_version: str | None = setting(
        None,
        "TRL release whose SFTTrainer runs (0.9.3 .. 0.25: peft's k-bit fp32 upcast, then "
        "the embeddings and LM head back to bf16; from 0.26: no upcast, a bitsandbytes base's "
        "adapters in bf16; checkpointing on from 0.22, non-reentrant from 0.27).",
        default_text="--framework trl: the installed TRL, else 1.16.0; else no SFTTrainer",
    )
    """TRL release (``"0.13.0"``) whose ``SFTTrainer`` (given a ``peft_config``) runs
    (:attr:`TrainingConfig.trl_release`; a value given always wins, under any HF Trainer stack
    it says SFTTrainer runs). Before
    :data:`~trainmem.specs.frameworks.TRL_SFT_PREPARES_KBIT_UNTIL` it prepares a quantized base
    with peft's ``prepare_model_for_kbit_training`` (:attr:`TrainingConfig.kbit_fp32_upcast`:
    TRL's ``is_sharded_qlora`` skips it under FSDP / ZeRO-3 as the framework rows do) and from
    :data:`~trainmem.specs.frameworks.TRL_SFT_BF16_EMBEDDINGS_SINCE` under ``bf16-mixed`` casts
    a 4-bit base's embeddings and LM head back to bf16
    (:attr:`TrainingConfig.trl_bf16_embeddings`); from 0.26 it skips the preparation and casts
    a bitsandbytes base's trainable parameters to bf16
    (:attr:`TrainingConfig.trl_bf16_adapters`). The releases with bf16 adapters after the
    upcast (0.7.5 .. 0.8.6, before
    :data:`~trainmem.specs.frameworks.TRL_SFT_ADAPTERS_FP32_SINCE`) are refused. None, the
    default: under ``--framework trl`` the installed TRL, else
    :data:`~trainmem.specs.frameworks.DEFAULT_TRL_VERSION`; elsewhere no SFTTrainer (peft's
    preparation as the framework calls it: a plain Trainer loop calling
    ``prepare_model_for_kbit_training``)."""

    @property
    def conventions(self) -> FrameworkConventions:
        """The framework's row of :data:`trainmem.specs.frameworks.FRAMEWORK_CONVENTIONS`."""
        return FRAMEWORK_CONVENTIONS[self.framework]

    @property
    def transformers_release(self) -> tuple[int, ...]:
        """(major, minor, ...) of the transformers whose model code runs:
        ``transformers_version`` when given (it always wins), else the installed one, else
        :data:`~trainmem.specs.frameworks.DEFAULT_TRANSFORMERS_VERSION`."""
        return transformers_release_of(self.transformers_version)

    @property
    def trl_release(self) -> tuple[int, ...] | None:
        """(major, minor, ...) of the TRL whose ``SFTTrainer`` runs: ``trl_version`` when
        given (it always wins), else under a framework whose loop is SFTTrainer
        (``FrameworkConventions.trl_sft_trainer``: ``--framework trl``) the installed TRL,
        else :data:`~trainmem.specs.frameworks.DEFAULT_TRL_VERSION`
        (:func:`~trainmem.specs.frameworks.default_trl_release`); None: no SFTTrainer (the
        other stacks: the HF Trainer, LLaMA-Factory's Seq2SeqTrainer, axolotl's Trainer)."""
        given = parse_trl_version(self.trl_version)
        if given is not None:
            return given
        return default_trl_release() if self.conventions.trl_sft_trainer else None

    @property
    def torchao_release(self) -> tuple[int, int, int]:
        """(major, minor, patch) of the torchao whose code runs: ``torchao_version`` when given
        (``"0.2"`` is 0.2.0), else :data:`~trainmem.specs.frameworks.DEFAULT_TORCHAO_VERSION`."""
        given = parse_version("torchao_version", self.torchao_version)
        major, minor, patch = (*(given or DEFAULT_TORCHAO_VERSION), 0, 0)[:3]
        return (major, minor, patch)

    @property
    def torchtune_release(self) -> tuple[int, int, int]:
        """(major, minor, patch) of the torchtune whose recipes run: ``torchtune_version`` when
        given (``"0.1"`` is 0.1.0), else
        :data:`~trainmem.specs.frameworks.DEFAULT_TORCHTUNE_VERSION`."""
        given = parse_version("torchtune_version", self.torchtune_version)
        major, minor, patch = (*(given or DEFAULT_TORCHTUNE_VERSION), 0, 0)[:3]
        return (major, minor, patch)

    @property
    def litgpt_release(self) -> tuple[int, int, int]:
        """(major, minor, patch) of the litgpt whose model code runs: ``litgpt_version`` when
        given (``"0.4"`` is 0.4.0), else
        :data:`~trainmem.specs.frameworks.DEFAULT_LITGPT_VERSION`."""
        given = parse_version("litgpt_version", self.litgpt_version)
        major, minor, patch = (*(given or DEFAULT_LITGPT_VERSION), 0, 0)[:3]
        return (major, minor, patch)

    @property
    def torchtitan_release(self) -> tuple[int, int, int]:
        """(major, minor, patch) of the torchtitan whose train loop runs: ``torchtitan_version``
        when given (``"0.1"`` is 0.1.0), else
        :data:`~trainmem.specs.frameworks.DEFAULT_TORCHTITAN_VERSION`."""
        given = parse_version("torchtitan_version", self.torchtitan_version)
        major, minor, patch = (*(given or DEFAULT_TORCHTITAN_VERSION), 0, 0)[:3]
        return (major, minor, patch)

    @property
    def unsloth_release(self) -> tuple[int, int, int]:
        """(year, month, patch) of the Unsloth whose code runs: ``unsloth_version`` when given
        (``"2025.1"`` is 2025.1.0), else
        :data:`~trainmem.specs.frameworks.DEFAULT_UNSLOTH_VERSION`."""
        given = parse_version("unsloth_version", self.unsloth_version)
        year, month, patch = (*(given or DEFAULT_UNSLOTH_VERSION), 0, 0)[:3]
        return (year, month, patch)

    def __post_init__(self) -> None:
        for name in (
            "torch_version",
            "transformers_version",
            "bitsandbytes_version",
            "torchao_version",
            "torchtune_version",
            "litgpt_version",
            "torchtitan_version",
            "unsloth_version",
            "deepspeed_version",
            "accelerate_version",
            "trl_version",
        ):
            parse_version(name, getattr(self, name))
        if self.load_phase is not None and not isinstance(self.load_phase, bool):
            raise SpecError("load_phase", f"must be true or false, got {self.load_phase!r}")
        _check_choices(self, FrameworkConfig)


@dataclass(frozen=True, kw_only=True)
class DiffusionConfig:
    """diffusers image and video models: the image size, frames, prompt tokens and the frozen
    models kept on the GPU. Refused for language models (:mod:`trainmem.specs.diffusers`).

    Raises:
        SpecError: a size that is not a positive integer (or ``HEIGHTxWIDTH``), an unknown
            ``frozen_on_gpu``.
    """

    resolution: int | str | None = setting(
        None,
        "image models (diffusers, ViT, DINOv2, CLIP / SigLIP towers, SegFormer, timm) and "
        "vision-language models (one image per sample): image side in pixels, or "
        "HEIGHTxWIDTH (480x832).",
        default_text="the model's, e.g. 1024",
    )
    """The training images' side in pixels (``1024``) or ``"HEIGHTxWIDTH"`` (``"480x832"``);
    a diffusers model's latents are 1/8 of it on a side; a vision encoder's sequence is its
    patches (Note [Vision encoders at another resolution] in
    :mod:`trainmem.analytic.activation_shapes`); a vision-language model's one image per sample
    (Qwen2-VL and kin: rounded to whole merged patches as their processor does,
    :func:`trainmem.trace.hf_inputs.grid_image_side`); None, the default: the model's
    (:data:`trainmem.specs.diffusers.DIFFUSERS_FAMILIES`, a vision config's ``image_size``). A
    square ``"NxN"`` or a digit string is stored as the int N."""
    frames: int | None = setting(
        None, "diffusers video models: frames per clip.", default_text="the model's"
    )
    """Video models: frames per clip (``1 + 4k`` for Wan's causal VAE), 1 to 2^31 - 1; None,
    the default: the model's. Refused for image models."""
    text_seq_len: int | None = setting(
        None, "diffusers models: prompt tokens.", default_text="FLUX 512, SD3 333, SDXL 77"
    )
    """Text-encoder tokens of the prompt embeddings, 1 to 2^31 - 1 (FLUX 512, SD3 77 + 256,
    SDXL 77); None, the default: the model's. (Language models use ``seq_len``.)"""
    frozen_on_gpu: str = setting(
        "none",
        "diffusers models: the pipeline's frozen models kept on the GPU (none: latents and "
        "embeddings precomputed):",
        choices=FROZEN_ON_GPU,
    )
    """The pipeline's frozen models kept on the GPU through training, as parameters from setup
    (:data:`FROZEN_ON_GPU`): ``vae``, ``text-encoders``, ``all``, or ``none``, the default
    (latents and prompt embeddings precomputed, the models freed or never moved: the scripts'
    ``--cache_latents`` and precomputed embeddings). Their sizes:
    :data:`trainmem.specs.diffusers.FROZEN_COMPONENTS`. A kept VAE also encodes each batch
    inside the step, as the scripts do without cached latents (Note [The frozen VAE encodes
    inside the step], trainmem/trace/frozen_encode.py); kept CLIP / T5 text encoders encode
    its prompts there too, as the scripts do with per-image captions (Note [The frozen text
    encoders encode inside the step])."""
    layerwise_casting: str = setting(
        "none",
        "diffusers models with LoRA: store the frozen layers' weights in this float8 dtype, "
        "each layer cast to the weights' dtype for its forward (diffusers "
        "enable_layerwise_casting; finetrainers --layerwise_upcasting_modules transformer):",
        choices=LAYERWISE_CASTING,
    )
    """The storage dtype of diffusers' layerwise casting of the trained model's frozen layers
    (:data:`LAYERWISE_CASTING`): each ``Linear`` / ``Conv`` / ``Embedding`` outside the skip
    patterns stores its weights in ``float8_e4m3fn`` or ``float8_e5m2`` (1 byte) and is cast to
    the load dtype before its forward and back after it (diffusers ``hooks/
    layerwise_casting.py``; Note [diffusers' layerwise casting] in
    trainmem/trace/layerwise_casting.py). Needs a diffusers model and LoRA (the weights are
    frozen); ``none``, the default: the weights stay in the load dtype."""
    controlnet: bool = setting(
        False,
        "diffusers UNet, FLUX and SD3 models: train a ControlNet made from the model beside "
        "it, frozen, as diffusers' train_controlnet.py / _flux.py / _sd3.py do.",
    )
    """Train a ControlNet made from the given denoiser's config (diffusers ``ControlNetModel.
    from_unet``, ``examples/controlnet/train_controlnet.py`` / ``_sdxl.py``;
    ``FluxControlNetModel.from_transformer`` with 4 double- and 4 single-stream blocks,
    ``train_controlnet_flux.py``; ``SD3ControlNetModel.from_transformer`` with 12 blocks,
    ``train_controlnet_sd3.py``; all without ``--controlnet_model_name_or_path``) in the
    weights' dtype, the denoiser frozen in the compute dtype beside it receiving its residuals
    (``trainmem.trace.controlnet``). Needs a diffusers ``UNet2DConditionModel``,
    ``FluxTransformer2DModel`` or ``SD3Transformer2DModel`` config and no LoRA. Default False:
    the model itself is trained."""
    controlnet_double_layers: int | None = setting(
        None,
        "FLUX with --controlnet: the ControlNet's double-stream blocks "
        "(train_controlnet_flux.py --num_double_layers).",
        default_text="4",
    )
    """A FLUX ControlNet's double-stream blocks (``train_controlnet_flux.py
    --num_double_layers``), 0 to 2^31 - 1; None, the default: the script's 4. Needs
    ``controlnet`` on a ``FluxTransformer2DModel``."""
    controlnet_single_layers: int | None = setting(
        None,
        "FLUX with --controlnet: the ControlNet's single-stream blocks "
        "(train_controlnet_flux.py --num_single_layers).",
        default_text="4",
    )
    """A FLUX ControlNet's single-stream blocks (``train_controlnet_flux.py
    --num_single_layers``; diffusers' README_flux.md command passes 0), 0 to 2^31 - 1; None,
    the default: the script's 4. Needs ``controlnet`` on a ``FluxTransformer2DModel``."""
    train_text_encoder: bool = setting(
        False,
        "diffusers UNet models (SD 1.x, SDXL): train the text encoders too, their forward in "
        "the step (DreamBooth's --train_text_encoder; LoRA on their attention with "
        "--lora-rank).",
    )
    """Train the pipeline's CLIP text encoders with the UNet, their forward on the prompt's
    token ids inside the step (diffusers ``examples/dreambooth/train_dreambooth.py`` /
    ``train_dreambooth_lora_sdxl.py --train_text_encoder``; ``trainmem.trace.text_encoders``):
    full fine-tuning, or with ``lora_rank`` LoRA adapters on their ``q_proj`` / ``k_proj`` /
    ``v_proj`` / ``out_proj`` as those scripts add them. Needs a diffusers
    ``UNet2DConditionModel`` config of SD 1.x (CLIP-L, cross_attention_dim 768) or SDXL
    (CLIP-L + OpenCLIP bigG, 2048); :data:`trainmem.specs.diffusers.TEXT_ENCODERS`. Default
    False: prompt embeddings are inputs."""
    vae_tiling: bool = setting(
        False,
        "diffusers models with --frozen-on-gpu vae / all: the VAE encodes each batch in tiles "
        "inside the step (vae.enable_tiling()).",
    )
    """The kept VAE encodes the batch's pixels tile by tile (diffusers ``vae.enable_tiling()``,
    ``AutoencoderKL._tiled_encode``: tiles of the VAE's ``sample_size`` pixels overlapping by a
    quarter, each through the encoder alone, the tiles' moments blended and concatenated), so
    the encode's peak holds one tile's activations instead of the whole image's (Note [The
    frozen VAE encodes inside the step], trainmem/trace/frozen_encode.py). Needs the VAE kept on
    the GPU (``frozen_on_gpu`` ``vae`` / ``all``); default False: the scripts' untiled encode."""

    @property
    def image_size(self) -> tuple[int, int] | None:
        """``resolution`` as (height, width) pixels, or None (the model's default)."""
        if self.resolution is None:
            return None
        if isinstance(self.resolution, str):
            height, width = self.resolution.split("x")
            return int(height), int(width)
        return self.resolution, self.resolution

    def __post_init__(self) -> None:
        if isinstance(self.resolution, str):
            object.__setattr__(self, "resolution", _parse_resolution(self.resolution))
        for field in ("resolution", "frames", "text_seq_len"):
            value = getattr(self, field)  # only a resolution may be text ("480x832")
            if value is not None and not (field == "resolution" and isinstance(value, str)):
                _check_int(field, value, minimum=1)
        _check_choices(self, DiffusionConfig)
        _check_flags(self, ("controlnet", "train_text_encoder", "vae_tiling"))
        for field in ("controlnet_double_layers", "controlnet_single_layers"):
            if getattr(self, field) is not None:
                _check_int(field, getattr(self, field), minimum=0)


CONCERNS: tuple[type[Any], ...] = (
    BatchConfig,
    PrecisionConfig,
    OptimizerConfig,
    LoopConfig,
    EmaConfig,
    CheckpointingConfig,
    ForwardConfig,
    ParallelismConfig,
    ShardingConfig,
    PeftConfig,
    FrameworkConfig,
    DiffusionConfig,
)
"""The concern dataclasses :class:`TrainingConfig` is composed of, in field order (each checks
its own fields; TrainingConfig checks the combinations)."""

for _concern in CONCERNS:
    _CHOICE_FIELDS[_concern] = tuple(
        (f.name, s.choices, f.default is None)
        for f, s in settings_of(_concern).values()
        if s.choices and kind_of(f) == "choice" and isinstance(s.choices[0], str)
    )
_CONCERN_CHECKS: tuple[Callable[[Any], None], ...] = tuple(c.__post_init__ for c in CONCERNS)


@dataclass(frozen=True, kw_only=True, slots=True)
class TrainingConfig(  # bases listed last concern first: a dataclass's fields are its bases'
    DiffusionConfig,  # in reverse MRO order, so the fields read batch, precision, ... diffusion
    FrameworkConfig,
    PeftConfig,
    ShardingConfig,
    ParallelismConfig,
    ForwardConfig,
    CheckpointingConfig,
    EmaConfig,
    LoopConfig,
    OptimizerConfig,
    PrecisionConfig,
    BatchConfig,
):
    """One training step on one GPU: the settings that change its memory, every field of the
    concern dataclasses (:data:`CONCERNS`) flat, and what follows from them.

    Raises:
        SpecError: a field outside its allowed values (the message lists them), or settings
            that cannot be combined (the message names one of them).
    """

    def __post_init__(self) -> None:
        _resolve_precision(self)
        for check in _CONCERN_CHECKS:
            check(self)
        _check_combinations(self)

    @property
    def loss_parallel(self) -> bool:
        """The loss runs on vocabulary-sharded logits with DTensor's ``loss_parallel``
        (``FrameworkConventions.dtensor_sequence_parallel`` frameworks with tensor parallelism:
        torchtitan's ``enable_loss_parallel``, on by default)."""
        return self.tensor_parallel_size > 1 and self.conventions.dtensor_sequence_parallel

    @property
    def torchtitan_compiles_loss(self) -> bool:
        """torchtitan's train loop compiles its unchunked cross-entropy: ``compile`` on, from
        torchtitan 0.1 (:data:`~trainmem.specs.frameworks.TORCHTITAN_COMPILED_LOSS_SINCE`),
        one pipeline stage, no loss parallelism, no other loss given (Note [torchtitan's
        compiled cross-entropy] in trainmem/analytic/loss.py)."""
        return (
            self.compile
            and self.conventions.torchtitan_train_loop
            and self.torchtitan_release >= TORCHTITAN_COMPILED_LOSS_SINCE
            and self.chunked_cross_entropy == 0
            and not self.loss_parallel
            and self.pipeline_parallel_size == 1
            and self.loss in (None, "cross-entropy")
        )

    @property
    def sequence_parallel_saves_gathered_input(self) -> bool:
        """Sequence parallelism whose column-parallel linears save their all-gathered input
        (``FrameworkConventions.dtensor_sequence_parallel``: torchtitan's DTensor plan)."""
        return self.sequence_parallel and self.conventions.dtensor_sequence_parallel

    @property
    def master_weights(self) -> bool:
        """16-bit model weights with an fp32 master copy kept by the optimizer (DeepSpeed,
        Megatron mixed precision)."""
        return self.is_mixed and self.conventions.master_weights

    @property
    def fp32_master_copy(self) -> bool:
        """The optimizer keeps an fp32 copy of the weights it steps, counted with its states:
        the :attr:`master_weights` of 16-bit weights, or DeepSpeed's ZeRO optimizer on fp32
        weights, which clones this rank's partition all the same
        (:func:`~trainmem.specs.frameworks.deepspeed_copies_fp32_weights`: ZeRO-1/2, and ZeRO-3
        before 0.18.2; deepspeed/runtime/zero/stage_1_and_2.py
        ``single_partition_of_fp32_groups``)."""
        if self.master_weights:
            return True
        return self.deepspeed_optimizer == "zero" and deepspeed_copies_fp32_weights(
            self.zero_stage, parse_version("deepspeed_version", self.deepspeed_version)
        )

    @property
    def weight_dtype(self) -> str:
        """Dtype of the model's stored parameters (torch spelling): the compute dtype under
        16-bit master weights or a model loaded in 16 bits under autocast
        (:attr:`autocast_over_loaded_16bit`)."""
        if self.master_weights or self.autocast_over_loaded_16bit:
            return self.compute_dtype
        return _PRECISION_DTYPES[self.precision][0]

    @property
    def deepspeed_optimizer(self) -> str | None:
        """DeepSpeed's optimizer wrapper (``FrameworkConventions.deepspeed_optimizer_wrappers``):
        ``zero``, ``bf16`` (``BF16_Optimizer``), ``fp16``
        (``FP16_Optimizer``) or ``none``, as deepspeed/runtime/engine.py
        ``_do_optimizer_sanity_check`` chooses from the model dtype and
        :attr:`deepspeed_grad_accum_dtype` (:func:`~trainmem.specs.frameworks.
        deepspeed_optimizer_wrapper`); None for other frameworks.

        Raises:
            SpecError: a dtype mix DeepSpeed refuses.
        """
        if not self.conventions.deepspeed_optimizer_wrappers:
            return None
        return deepspeed_optimizer_wrapper(
            self._deepspeed_model_dtype,
            self.deepspeed_grad_accum_dtype,
            self.zero_stage,
            cpu_offload=self.offload != "none",
            pipeline=self.pipeline_parallel_size > 1,
            version=parse_version("deepspeed_version", self.deepspeed_version),
        )

    @property
    def zero3_one_rank_views(self) -> bool:
        """DeepSpeed ZeRO-3 over one rank gathers nothing: each parameter is its partition (a
        view on the GPU; offloaded, one host-to-device copy), from 0.9.0
        (:data:`~trainmem.specs.frameworks.DEEPSPEED_ZERO3_ONE_RANK_VIEWS_SINCE`)."""
        if self.sharding_degree != 1 or self.zero_stage != 3:
            return False
        version = parse_version("deepspeed_version", self.deepspeed_version)
        return not deepspeed_zero3_gathers_on_one_rank(version)

    @property
    def deepspeed_states_at_init(self) -> bool:
        """DeepSpeed's ZeRO optimizer makes the optimizer states when it is built, up to 0.13.1
        (:data:`~trainmem.specs.frameworks.DEEPSPEED_LAZY_OPTIMIZER_STATES_SINCE`)."""
        version = parse_version("deepspeed_version", self.deepspeed_version)
        return deepspeed_states_at_init(version)

    @property
    def deepspeed_flattens_on_device(self) -> bool:
        """DeepSpeed ZeRO-1/2 flatten the trainable parameters on the GPU beside them, from
        0.19.0 (:data:`~trainmem.specs.frameworks.DEEPSPEED_FLATTENS_ON_DEVICE_SINCE`)."""
        version = parse_version("deepspeed_version", self.deepspeed_version)
        return deepspeed_flattens_on_device(version)

    @property
    def deepspeed_grad_accum_dtype(self) -> str:
        """The dtype DeepSpeed accumulates gradients in: ``grad_accum_dtype`` when given, else
        DeepSpeed's default for ``deepspeed_version`` (:func:`~trainmem.specs.frameworks.
        deepspeed_grad_accum_dtype`: the model dtype; fp32 for bf16 without ZeRO before
        0.17.6)."""
        return deepspeed_grad_accum_dtype(
            self._deepspeed_model_dtype,
            self.zero_stage,
            self.grad_accum_dtype,
            parse_version("deepspeed_version", self.deepspeed_version),
        )

    @property
    def _deepspeed_model_dtype(self) -> str:
        """The model dtype DeepSpeed's engine sees (engine.py ``get_data_types``): the 16-bit
        dtype of an ``fp16`` / ``bf16`` section (the ``*-mixed`` precisions), else fp32."""
        return self.compute_dtype if self.master_weights else "float32"

    @property
    def bf16_optimizer(self) -> bool:
        """DeepSpeed's ``BF16_Optimizer`` runs (:attr:`deepspeed_optimizer` ``bf16``): an fp32
        gradient buffer from init, fp32 master weights and optimizer states partitioned over the
        data-parallel ranks (``FrameworkConventions.deepspeed_optimizer_wrappers``)."""
        return self.deepspeed_optimizer == "bf16"

    @property
    def bf16_optimizer_buffer_dtype(self) -> str | None:
        """Dtype of ``BF16_Optimizer``'s flat gradient buffer (bf16_optimizer.py
        ``fp32_groups_gradients_flat``: ``torch.zeros_like(..., dtype=self.grad_acc_dtype)``,
        the accumulation dtype); None without ``BF16_Optimizer``."""
        return self.deepspeed_grad_accum_dtype if self.bf16_optimizer else None

    @property
    def bf16_optimizer_grads_released(self) -> str | None:
        """When ``BF16_Optimizer`` frees the bf16 ``.grad`` tensors (:func:`~trainmem.specs.
        frameworks.deepspeed_bf16_grads_released`: ``backward``, ``step`` or ``never``); None
        without ``BF16_Optimizer``."""
        if not self.bf16_optimizer:
            return None
        version = parse_version("deepspeed_version", self.deepspeed_version)
        return deepspeed_bf16_grads_released(self.zero_stage, version)

    @property
    def bf16_optimizer_immediate_grad_update(self) -> bool:
        """``BF16_Optimizer`` adds each bf16 gradient into its buffer as autograd makes it
        (``bf16.immediate_grad_update``, default per release: :func:`~trainmem.specs.
        frameworks.deepspeed_bf16_immediate_grad_update`), not after the backward."""
        version = parse_version("deepspeed_version", self.deepspeed_version)
        return self.bf16_optimizer and deepspeed_bf16_immediate_grad_update(version)

    @property
    def optimizer_states_partitioned(self) -> bool:
        """Optimizer states (and fp32 master weights) cover 1/N of the parameters on each of the
        N sharding ranks: ZeRO stage >= 1 / FSDP, or DeepSpeed's ``BF16_Optimizer``
        (:attr:`bf16_optimizer`)."""
        return self.sharding_degree > 1 and (self.zero_stage >= 1 or self.bf16_optimizer)

    @property
    def grad_dtype(self) -> str:
        """Dtype of the gradients kept between backward and the step (Megatron, and DeepSpeed's
        ``BF16_Optimizer``, accumulate in fp32)."""
        if self.master_weights and self.conventions.fp32_grad_buffer:
            return "float32"
        wrapper = self.deepspeed_optimizer
        # BF16_Optimizer: the bf16 .grad autograd makes (its flat buffer in grad_acc_dtype is
        # :attr:`bf16_optimizer_buffer_dtype`, Note [BF16_Optimizer's two gradients])
        # ZeRO-3's gradient partition (stage3.py ``grad_partitions_flat_buffer``,
        # ``dtype=self.gradient_accumulation_dtype``); ZeRO-1 with a separate accumulation dtype
        # keeps each gradient as ``param.grad_accum`` in it (stage_1_and_2.py
        # ``use_grad_accum_attribute``, ``_fill_param_grad_accum_attribute``); ZeRO-2 keeps the
        # model dtype (``grads_in_partition``, ``dtype=self.dtype``)
        if wrapper == "zero" and self.master_weights and self.zero_stage in (1, 3):
            return self.deepspeed_grad_accum_dtype
        return self.weight_dtype

    @property
    def optimizer_state_dtype(self) -> str:
        """Dtype of the optimizer's moments (fp32 beside master weights), the weights' otherwise;
        fp32 for transformers' Adafactor, which upcasts a 16-bit gradient before making its
        states from it (transformers/optimization.py ``Adafactor.step``: ``grad =
        grad.float()``, then ``torch.zeros(...).to(grad)`` / ``torch.zeros_like(grad)``)."""
        if self.optimizer == "adafactor" and self.adafactor_implementation == "transformers":
            return "float32"
        return "float32" if self.master_weights else self.weight_dtype

    @property
    def step_implementation(self) -> str:
        """The optimizer implementation that runs: ``optimizer_implementation`` when given (an
        explicit value always wins), else the framework's default for ``torch_version``
        (:meth:`~trainmem.specs.frameworks.FrameworkConventions.default_optimizer_implementation`:
        the HF Trainer's ``adamw_torch_fused`` from torch 2.8, transformers training_args.py;
        Megatron's / DeepSpeed's fused multi-tensor Adam; torch's foreach from 2.0)."""
        if self.optimizer_implementation is not None:
            return self.optimizer_implementation
        return self.conventions.default_optimizer_implementation(
            parse_version("torch_version", self.torch_version), self.optimizer
        )

    @property
    def layer_checkpoint_reentrant(self) -> bool:
        """The layers' checkpoint is torch's reentrant ``CheckpointFunction`` (Unsloth's
        patched checkpoint aside): Answer.AI fsdp_qlora's ``CheckpointImpl.REENTRANT`` unless
        ``checkpoint_reentrant`` is False (train.py ``--reentrant_checkpointing``: False by
        default, but its README's commands pass ``--reentrant_checkpointing true`` and ask for
        it with bitsandbytes, "to avoid triggering a bug in bitsandbytes which results in high
        memory usage"), else transformers' gradient checkpointing where it is reentrant
        (:attr:`hf_checkpoint_reentrant`). Both engines read it: the formulas' reentrant
        transforms, the trace's ``use_reentrant``.

        Source: fsdp_qlora train.py (50efa1e, 05ed9f2) ``apply_activation_checkpointing``
        and README.md; transformers modeling_utils.py ``gradient_checkpointing_enable``."""
        if self.framework == "fsdp-qlora":
            return self.checkpoint_reentrant is not False
        return self.conventions.hf_model_code and self.hf_checkpoint_reentrant

    @property
    def hf_checkpoint_reentrant(self) -> bool:
        """transformers' gradient checkpointing is torch's reentrant ``checkpoint``:
        ``checkpoint_reentrant`` when given, else transformers' default for
        :attr:`transformers_release`: ``{"use_reentrant": True}`` when no kwargs are given from
        4.37 (modeling_utils.py ``gradient_checkpointing_enable``, transformers PR #28538; torch's
        own default, reentrant, before it) until 5.0 (PR #43203, ``{"use_reentrant": False}``,
        :data:`~trainmem.specs.frameworks.HF_NON_REENTRANT_CHECKPOINT_SINCE`)."""
        if self.checkpoint_reentrant is not None:  # an explicit value always wins
            return self.checkpoint_reentrant
        row = self.conventions.default_checkpoint_reentrant  # LLaMA-Factory's, axolotl's
        if row is not None:
            return row
        trl = self.trl_release
        zero3_peft = self.framework == "deepspeed" and self.zero_stage == 3 and self.is_lora
        if trl is not None and trl >= TRL_SFT_ZERO3_REENTRANT_SINCE and zero3_peft:
            return True  # SFTTrainer forces reentrant for PEFT under ZeRO-3 from 0.28
        if trl is not None and trl >= TRL_SFT_NON_REENTRANT_SINCE:
            return False  # SFTTrainer's setdefault("use_reentrant", False) from 0.27
        return self.transformers_release < HF_NON_REENTRANT_CHECKPOINT_SINCE

    @property
    def kbit_fp32_upcast(self) -> bool:
        """A quantized base whose other parameters peft cast to fp32: ``prepare_kbit_training``
        when given, else the framework's (``FrameworkConventions.peft_kbit_training``)."""
        if self.quantize_base in ("none", *KBIT_NOT_UPCAST, *CHATGLM_QUANTIZE):
            return False  # ChatGLM's scripts run model.half(), no peft preparation
        if self.prepare_kbit_training is not None:  # an explicit value always wins
            return self.prepare_kbit_training
        if self.trl_bf16_adapters:  # TRL's SFTTrainer from 0.26 prepares nothing
            return False
        return self.conventions.peft_kbit_training

    @property
    def trl_bf16_embeddings(self) -> bool:
        """TRL's ``SFTTrainer`` cast a 4-bit base's embeddings and LM head back to bf16 after
        peft's fp32 upcast (``peft_module_casting_to_bf16``: ``lm_head`` / ``embed_tokens`` /
        ``wte`` / ``wpe`` to bf16, the norms fp32; trl v0.13.0 trl/trainer/sft_trainer.py
        ``__init__``, utils.py), under ``TrainingArguments(bf16=True)`` (``bf16-mixed``):
        ``trl_version`` from :data:`~trainmem.specs.frameworks.TRL_SFT_BF16_EMBEDDINGS_SINCE`,
        where peft's preparation runs (:attr:`kbit_fp32_upcast`). Its 2 B a value and no
        autocast copy of the head weight (``cached_cast`` casts only another dtype)."""
        trl = self.trl_release
        return (
            trl is not None
            and not self.conventions.strips_trl_peft_casts
            and TRL_SFT_BF16_EMBEDDINGS_SINCE <= trl < TRL_SFT_PREPARES_KBIT_UNTIL
            and self.kbit_fp32_upcast
            and self.quantize_base in ("nf4", "nf4-dq", "fp4", "fp4-dq")  # is_loaded_in_4bit
            and self.precision == "bf16-mixed"
        )

    @property
    def trl_bf16_adapters(self) -> bool:
        """TRL's ``SFTTrainer`` from 0.26 casts every trainable parameter of a bitsandbytes
        model (:data:`~trainmem.specs.frameworks.TRL_CASTS_BITSANDBYTES`) to bf16 after
        ``get_peft_model``, whatever the precision, and runs no k-bit preparation
        (:data:`~trainmem.specs.frameworks.TRL_SFT_PREPARES_KBIT_UNTIL`; trl v0.26.0
        trl/trainer/sft_trainer.py:715-718): LoRA adapters, their gradients and AdamW states
        in bf16 (``analytic.lora.lora_adapter_dtype``), sharded or not. Not under a stack that
        strips the cast (``FrameworkConventions.strips_trl_peft_casts``: Unsloth)."""
        trl = self.trl_release
        return (
            trl is not None
            and trl >= TRL_SFT_PREPARES_KBIT_UNTIL
            and not self.conventions.strips_trl_peft_casts
            and self.quantize_base in TRL_CASTS_BITSANDBYTES
            and self.is_lora
        )

    @property
    def kbit_fp32_activations(self) -> bool:
        """Every layer activation is fp32 although the compute dtype is 16-bit: peft's upcast
        (:attr:`kbit_fp32_upcast`) of a model loaded in 16 bits without autocast makes the
        embeddings, norms, LM head and adapters fp32, and bitsandbytes' quantized linears return
        their input's dtype (0.45.0 nn/modules.py ``Linear4bit.forward``: ``matmul_4bit(x,
        ...).to(inp_dtype)`` after ``x = x.to(self.compute_dtype)``; autograd/_functions.py
        ``MatMul8bitLt.forward``: ``.to(A.dtype)``), so the whole layer computes in fp32 but
        for each base matmul (its dequantized weight and its input's and output's 16-bit
        copies). Checked on a real CPU run (Note [Traced quantized base]). Not where the
        quantized matmul saves its input (:attr:`quantized_matmul_saves_input`: int8, 4-bit
        before bitsandbytes 0.43.2), which would save a 16-bit cast per linear (three of one
        input for q, k and v): not modelled, refused on the traced paths
        (``trainmem.traced_quantized``)."""
        return (
            self.kbit_fp32_upcast
            and not self.uses_autocast
            and self.compute_dtype != "float32"
            and not self.quantized_matmul_saves_input
        )

    @property
    def kbit_16bit_dense(self) -> bool:
        """A quantized base under autocast whose other parameters (embeddings, norms, LM head)
        stay in the 16-bit dtype it was loaded in, so the residual stream is 16-bit too: no
        fp32 upcast (:attr:`kbit_fp32_upcast`), and transformers loads a quantized model in
        16 bits (quantizers/quantizer_bnb_4bit.py ``update_torch_dtype``: float16 when no
        ``torch_dtype`` is given; the recipes pass the compute dtype). The autocast is
        torch's (:attr:`uses_autocast`) or accelerate's ``native_amp`` over its FSDP1
        (:attr:`accelerate_fp32_outputs`: ``--framework accelerate-fsdp`` under ``*-mixed``,
        where fms-acceleration's plugins load the base in the ``torch_dtype`` given, bf16 for
        ``--bf16``, fp16 for a GPTQ base: accelerated-peft framework_plugin_bnb.py /
        framework_plugin_autogptq.py ``model_loader``, and the 4-bit codes are stored in it,
        :func:`~trainmem.specs.quantization.float_quant_storage`). Not under fsdp_qlora,
        which loads the model itself in fp32 for its autocast precisions (train.py 50efa1e:
        ``bf16_autocast`` / ``fp16_autocast`` set ``torch_dtype = torch.float32``, the
        4-bit weights' ``quant_storage`` too)."""
        return (
            self.quantize_base != "none"
            and (self.uses_autocast or self.accelerate_fp32_outputs)
            and not self.kbit_fp32_upcast
            and self.framework != "fsdp-qlora"
        )

    @property
    def kbit_dense_dtype(self) -> str:
        """The dtype a quantized base's other parameters (embeddings, norms, LM head) are in
        where they stay as loaded (:attr:`kbit_16bit_dense`): ``load_dtype`` when given (16
        bits), else the compute dtype (the recipes pass ``torch_dtype``). Note [A quantized
        base's other weights in another 16-bit dtype]."""
        if self.kbit_16bit_dense and self.load_dtype in ("float16", "bfloat16"):
            return self.load_dtype
        return self.compute_dtype

    @property
    def kbit_dense_cast(self) -> bool:
        """A quantized base's other parameters stay in a 16-bit dtype other than the compute
        dtype autocast runs in (:attr:`kbit_dense_dtype`): fp16 under ``bf16-mixed`` where
        ``from_pretrained`` got no ``torch_dtype``.

        Note [A quantized base's other weights in another 16-bit dtype]
            transformers forces float16 on a bitsandbytes model loaded with no
            ``torch_dtype`` (4.36.2 modeling_utils.py ``from_pretrained``: "We force the
            `dtype` to be float16, this is a requirement from `bitsandbytes`"; from 4.38
            quantizers/quantizer_bnb_4bit.py ``update_torch_dtype``), and
            ``set_module_quantized_tensor_to_device`` puts every unquantized weight on the
            GPU in it (``value.to(device)``). ms-swift @4312aeb loads Qwen-1 so
            (swift/llm/utils/model.py ``get_model_tokenizer_qwen``: ``torch_dtype = None``
            before ``from_pretrained``; the config's ``bf16`` flag casts only the meta weights
            in ``QWenLMHeadModel.__init__``) and trains under the Trainer's bf16 autocast.
            Then:

            * the LM head's fp16 weight is cast to bf16 by autocast at every forward and the
              matmul saves the cast for the input gradient (aten/src/ATen/autocast_mode.cpp
              ``cached_cast`` casts another dtype, and caches only a leaf that requires
              grad; tools/autograd/derivatives.yaml: mm saves ``mat2`` when ``self``
              requires grad): ``V x h`` 16-bit values from the head's forward to its
              backward;
            * the residual stream and the norms' outputs are fp16, so every base linear
              makes its own bf16 copy of its input (bitsandbytes 0.41.3 nn/modules.py
              ``Linear4bit.forward``: ``x = x.to(self.compute_dtype)``, which ``MatMul4Bit``
              saves before 0.43.2; peft's LoRA under autocast casts the dropout output), as
              autocast does over fp32 weights (``autocast_casts_layer_inputs``), and casts
              its output back (``out = out.to(inp_dtype)``);
            * flash-attn takes those fp16 q / k / v as they are (transformers casts them to
              autocast's dtype only when q is fp32: 5.24 integrations/flash_attention.py
              ``get_target_dtype``; flash-attn is on no autocast list) and returns fp16, so
              the output projection casts it too and, where the matmul saves its input,
              keeps that bf16 copy beside the kernel's saved fp16 output (found by the
              generic path's trace, session 29).

            Given as ``load_dtype`` (``--load-dtype float16``) beside ``bf16-mixed``: the
            weights' bytes are the same 2 a value. Both engines run it; a real CPU run
            (bitsandbytes 0.50.2 ``Linear4bit``, peft 0.21.2, a 2-layer Llama in fp16 under
            bf16 autocast with CUDA's lists; benchmarks/kbit_fp16_rest_cpu.py) saves the
            bytes per dtype the trace's stand-in does. The fp16 stream is peft's before
            0.9.0: its ``lora.bnb.Linear4bit`` adds the adapters' output in place (v0.8.2
            tuners/lora/bnb.py ``result += output``: fp16); from v0.9.0 ``result = result +
            output`` adds a bf16 output under autocast to the fp16 base output, so a targeted
            linear returns fp32, flash then casts q / k / v to bf16 and the residual add turns
            the stream fp32 after the first attention (the same CPU run with peft's
            ``torch.is_autocast_enabled()`` answering as on a GPU: +25 % saved bytes). Not
            modelled (no peft release setting): both engines give the fp16 stream."""
        return self.kbit_16bit_dense and self.kbit_dense_dtype != self.compute_dtype

    @property
    def torchao_cpu_offload(self) -> bool:
        """The optimizer offload is torchao's ``CPUOffloadOptimizer`` (single GPU, no ZeRO /
        FSDP; ``FrameworkConventions.optimizer_offload_torchao``): tensors under
        :data:`~trainmem.specs.frameworks.TORCHAO_OFFLOAD_MINIMAL_SIZE` elements keep their
        optimizer states and gradients on the GPU."""
        return (
            self.conventions.optimizer_offload_torchao
            and self.offload in ("optimizer", "optimizer+gradients")
            and self.zero_stage == 0
        )

    @property
    def input_embeddings_require_grad(self) -> bool:
        """The input embeddings' output is made to require grad by a forward hook
        (transformers ``enable_input_require_grads``): transformers models
        (``FrameworkConventions.hf_model_code``) with activation checkpointing, which
        transformers 5's ``_activation_checkpointing_enable`` registers for ``input_ids`` models
        and peft's ``prepare_model_for_kbit_training`` with its (reentrant) checkpointing."""
        return self.conventions.hf_model_code and self.activation_checkpointing != "none"

    @property
    def softmax_saves_input(self) -> bool:
        """Autograd keeps a softmax's and a log-softmax's input beside the output:
        ``torch_version`` before 1.11 (Note [Softmax saving its input before torch 1.11] in
        trainmem/trace/older_softmax.py; :func:`~trainmem.specs.frameworks.
        softmax_saves_input`): an eager attention's scores and a cross-entropy's logits, in
        both engines."""
        return softmax_saves_input(parse_version("torch_version", self.torch_version))

    @property
    def adafactor_implementation(self) -> str:
        """``transformers`` (transformers/optimization.py ``Adafactor``) or ``torch``
        (``torch.optim.Adafactor``, torch >= 2.5): which ``adafactor`` runs
        (``FrameworkConventions.adafactor_from_transformers``)."""
        torch = parse_version("torch_version", self.torch_version)
        if self.conventions.adafactor_from_transformers or (torch or (2, 8)) < (2, 5):
            return "transformers"
        return "torch"

    @property
    def sharding_degree(self) -> int:
        """Ranks each ZeRO / FSDP shard is spread over: ``data_parallel_size`` (times the
        context-parallel size where the framework shards over both,
        ``FrameworkConventions.fsdp_shards_over_context_parallel``), or the shard group when
        smaller (HYBRID_SHARD)."""
        dp = self.data_parallel_size
        if self.conventions.fsdp_shards_over_context_parallel:
            dp *= self.context_parallel_size
        return dp if self.shard_group_size is None else min(dp, self.shard_group_size)

    @property
    def gathered_weight_dtype(self) -> str:
        """Dtype of the weights ZeRO-3 / FSDP gathers: the compute dtype under an FSDP
        mixed-precision policy (``fsdp_param_dtype_follows_precision``), else the weight dtype.
        ``fp8-mixed`` under FSDP is torchao's float8 recipe as torchtitan runs it, with
        ``MixedPrecisionPolicy(param_dtype=bf16)`` whatever the framework (the trace engine's
        ``trainmem.trace.fsdp``): the weights that are not float8-gathered (embedding, norms,
        head) are gathered in bf16, and the token embedding's gradient is bf16."""
        fsdp = self.zero_stage == 3 and self.data_parallel_size > 1
        policy = self.conventions.fsdp_param_dtype_follows_precision or (self.is_fp8 and fsdp)
        if self.is_mixed and policy:
            return self.compute_dtype
        return self.weight_dtype

    @property
    def training_loop(self) -> str:
        """What the loop holds of a micro-batch's outputs (:data:`~trainmem.specs.frameworks.
        LOOPS`): ``loop`` when given (it always wins), ``step`` with ``keep_logits``, else the
        framework's (``FrameworkConventions.loop``), whose ``step`` (fsdp_qlora's: each
        micro-batch's output bound until that micro-batch ends, after the optimizer step on the
        last) is modelled for one micro-batch per step: with more, ``drop`` (the output through
        each micro-batch's own backward not counted)."""
        if self.loop is not None:
            return self.loop
        if self.keep_logits:
            return "step"
        loop = self.conventions.loop
        return "drop" if loop == "step" and self.gradient_accumulation_steps > 1 else loop

    @property
    def recipe_loss(self) -> str | None:
        """The loss the loop computes on the logits, when it is not the model's own: ``loss``
        when given (it always wins), else torchtune's transposed cross-entropy for its recipes
        before 0.3 without a chunked loss (:data:`~trainmem.specs.frameworks.
        TORCHTUNE_RESHAPED_LOSS_SINCE`), else None."""
        if self.loss is not None:
            return self.loss
        if (
            self.framework == "torchtune"
            and self.torchtune_release < TORCHTUNE_RESHAPED_LOSS_SINCE
            and not self.chunked_cross_entropy
        ):
            return "transposed-cross-entropy"
        return None

    @property
    def torchao_nf4_decode(self) -> bool:
        """The quantized base is torchao's ``NF4Tensor`` decoded eagerly: torchtune's QLoRA
        (``quantize_base`` nf4 / nf4-dq) without ``compile``, whose ``linear_nf4`` calls
        ``weight.to(dtype)`` = ``get_original_weight()`` in forward and backward
        (:func:`trainmem.analytic.buffers.torchao_nf4_dequantize_bytes`; the trace's stand-in
        ``trainmem.trace.quantized._torchao_decode``)."""
        return (
            self.framework == "torchtune"
            and self.quantize_base in ("nf4", "nf4-dq")
            and not self.compile
        )

    @property
    def quantized_matmul_saves_input(self) -> bool:
        """A quantized base linear saves its 16-bit input for backward: bitsandbytes int8
        (``MatMul8bitLt``: ``ctx.tensors = (CAt, subA, A)``) always; bitsandbytes 4-bit
        (``MatMul4Bit``) only before 0.43.2 (:data:`~trainmem.specs.frameworks.
        BNB_MATMUL4BIT_SAVES_NO_INPUT_SINCE`); torchao NF4 (torchtune) never; GPTQ never: its
        trainable kernel, triton v2 (fms-acceleration @c70ffe0 plugins/accelerated-peft
        configs/autogptq.yaml ``kernel: triton_v2``, "the triton kernels are the only ones"
        with a backward; exllama's have none), saves the packed tensors only
        (gptqmodel/nn_modules/triton_utils/dequant.py ``QuantLinearFunction.forward``:
        ``ctx.save_for_backward(qweight, scales, qzeros, g_idx)``; AutoGPTQ v0.7.1
        tritonv2 alike) and dequantizes again for the input gradient."""
        if self.quantize_base == "none" or not self.conventions.quantized_base_saves_input:
            return False
        if self.quantize_base in CHATGLM_QUANTIZE:  # W8A16Linear: save_for_backward(inp, ...)
            return True
        if self.quantize_base == "gptq-int4":
            return False
        if self.quantize_base == "int8":
            return True
        version = parse_version("bitsandbytes_version", self.bitsandbytes_version)
        return (version or DEFAULT_BITSANDBYTES_VERSION) < BNB_MATMUL4BIT_SAVES_NO_INPUT_SINCE

    @property
    def checkpoint_keeps_bnb_inputs(self) -> bool:
        """Every checkpointed layer's bitsandbytes linears keep their input from the layer's
        forward to the end of the backward: ``MatMul4Bit`` keeps its 16-bit cast as a ``ctx``
        attribute (:attr:`quantized_matmul_saves_input`: before 0.43.2), ``MatMul8bitLt`` the
        input as given at every release (and before 0.45.0 its int8 transposed copy,
        :attr:`bnb_int8_transposed_copy`), and the layers run under torch's non-reentrant
        checkpoint (full checkpointing, not :attr:`layer_checkpoint_reentrant`; not Unsloth's
        own checkpoint), whose saved-tensor hooks never see that attribute (Note
        [bitsandbytes' inputs under non-reentrant checkpointing] in
        trainmem/analytic/held_outputs.py)."""
        return (
            self.activation_checkpointing == "full"
            and self.quantize_base in ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8")
            and self.quantized_matmul_saves_input
            and not self.layer_checkpoint_reentrant
            and self.framework != "unsloth"
        )

    @property
    def bnb_int8_transposed_copy(self) -> bool:
        """An int8 base's ``MatMul8bitLt`` keeps ``CAt``, the int8 transposed copy of its input
        (1 B a value), beside the input when the input needs a gradient, and the input even
        when it needs none: bitsandbytes before 0.45.0
        (:data:`~trainmem.specs.frameworks.BNB_INT8_KEEPS_ONLY_GRADED_INPUT_SINCE`)."""
        if self.quantize_base != "int8" or not self.conventions.quantized_base_saves_input:
            return False
        version = parse_version("bitsandbytes_version", self.bitsandbytes_version)
        return (version or DEFAULT_BITSANDBYTES_VERSION) < BNB_INT8_KEEPS_ONLY_GRADED_INPUT_SINCE

    @property
    def dequantizes_through_fp16(self) -> bool:
        """bitsandbytes' ``MatMul4Bit`` dequantizes a 4-bit base weight to fp16 and then casts it
        to the compute dtype, both copies alive at the cast (bitsandbytes 0.42.0
        autograd/_functions.py ``F.dequantize_4bit(B, quant_state).to(A.dtype)``), under a
        compute dtype other than fp16, where the weight's ``QuantState.dtype`` is float16: a
        Lightning 4-bit weight (``FrameworkConventions.bnb_4bit_quantized_from_fp16``), and
        every 4-bit weight bitsandbytes itself quantized before 0.43.0
        (:data:`~trainmem.specs.frameworks.BNB_4BIT_QUANTIZED_IN_ITS_DTYPE_SINCE`:
        ``Params4bit.cuda`` quantizes ``self.data.contiguous().half()``, which transformers'
        ``from_pretrained`` reaches through ``set_module_quantized_tensor_to_device``)."""
        if self.quantize_base not in ("nf4", "nf4-dq", "fp4", "fp4-dq"):
            return False
        if self.compute_dtype == "float16":
            return False
        if self.conventions.bnb_4bit_quantized_from_fp16:
            return True
        if not self.conventions.quantized_base_saves_input:  # not bitsandbytes (torchao's NF4)
            return False
        version = parse_version("bitsandbytes_version", self.bitsandbytes_version)
        return (version or DEFAULT_BITSANDBYTES_VERSION) < BNB_4BIT_QUANTIZED_IN_ITS_DTYPE_SINCE

    @property
    def zero3_linear_saves_input(self) -> bool:
        """Every ``F.linear`` saves its input, its weight frozen or not: a DeepSpeed ZeRO-3
        model is built under ``deepspeed.zero.Init`` (transformers modeling_utils
        ``from_pretrained``: ``init_contexts = [deepspeed.zero.Init(config_dict_or_path=
        deepspeed_config())]`` under a ZeRO-3 config; accelerate's ``zero3_init_flag``), whose
        ``__enter__`` replaces ``torch.nn.functional.linear`` with ``zero3_linear_wrap`` for
        good (``mem_efficient_linear=True``; the restore in ``shutdown_init_context`` is
        commented out: "un doing it here will undo it during training"), and
        ``LinearFunctionForZeroStage3.forward`` calls ``ctx.save_for_backward(input, ...)``
        unconditionally. Source: DeepSpeed runtime/zero/partition_parameters.py and
        runtime/zero/linear.py, v0.8.0 (2023-01) to v0.16.4 (2025-02) alike."""
        return self.conventions.zero_ipg_buckets and self.zero_stage == 3

    @property
    def uses_autocast(self) -> bool:
        """Mixed precision through torch.autocast (fp32 residual stream, per-op casts)."""
        return self.is_mixed and self.conventions.autocast and not self.is_fp8

    @property
    def accelerate_fp32_outputs(self) -> bool:
        """accelerate casts the model's 16-bit outputs to fp32 when its forward returns
        (``FrameworkConventions.accelerate_fp32_outputs`` under a 16-bit ``*-mixed`` precision:
        accelerate's ``native_amp``, accelerator.py ``prepare_model``; not float8, whose
        ``native_amp`` path is not modelled); for the HF Trainer from transformers
        :data:`~trainmem.specs.frameworks.TRAINER_ON_ACCELERATE_SINCE`, whose Trainer prepares
        the model through accelerate. Note [accelerate's fp32 outputs]."""
        if not (self.is_mixed and self.conventions.accelerate_fp32_outputs and not self.is_fp8):
            return False
        return (
            not self.conventions.hf_trainer_loop
            or self.transformers_release >= TRAINER_ON_ACCELERATE_SINCE
        )

    @property
    def autocast_over_loaded_16bit(self) -> bool:
        """The loop autocasts (:attr:`uses_autocast`) over a model the user loaded in the 16-bit
        compute dtype (``load_dtype``; transformers ``from_pretrained(torch_dtype=
        torch.bfloat16)`` with ``TrainingArguments(bf16=True)``): weights and gradients in 16
        bits, AdamW's states in the parameter's dtype (torch/optim/adamw.py
        ``torch.zeros_like(p, memory_format=torch.preserve_format)``), peft's LoRA adapters
        fp32 (peft ``autocast_adapter_dtype=True``: tuners_utils.py ``_cast_adapter_dtype``
        upcasts float16 / bfloat16 adapter weights to float32), no autocast copy of a 16-bit
        weight (``cached_cast`` casts only another dtype), autocast's fp32 ops (LayerNorm,
        softmax, log_softmax, pow) still fp32. Note [Autocast over 16-bit weights]."""
        return (
            self.uses_autocast
            and self.load_dtype not in (None, "float32")
            and self.quantize_base == "none"  # a quantized base's: kbit_dense_dtype
        )

    @property
    def autocast_over_16bit_weights(self) -> bool:
        """accelerate's ``native_amp`` autocast runs over weights its FSDP1 ``MixedPrecision``
        already gathers in the 16-bit compute dtype (``--framework accelerate-fsdp`` under
        ``*-mixed`` with sharded data parallelism; accelerator.py ``prepare_model`` wraps the
        forward in ``autocast`` before the FSDP1 wrap): no weight copies and a 16-bit residual
        stream, but autocast's fp32 ops (``layer_norm``, ``pow``) still return fp32, which the
        next linears cast again (Note [Autocast over 16-bit weights],
        trainmem/analytic/activation_shapes.py). False where :attr:`uses_autocast` (fp32
        weights) holds, but for a model loaded in 16 bits (:attr:`autocast_over_loaded_16bit`)."""
        if self.autocast_over_loaded_16bit:
            return True
        return (
            self.accelerate_fp32_outputs
            and not self.uses_autocast
            and self.zero_stage == 3
            and self.data_parallel_size > 1
            and self.gathered_weight_dtype == self.compute_dtype
        )

    @property
    def loss_upcast(self) -> bool:
        """A framework's own loss works on fp32 logits: torchtune's chunked cross-entropy
        upcasts each chunk; under lit-gpt, Lightning Fabric has already cast the model output to
        fp32. The model code's own loss is the model's and the transformers release's
        (``ModelSpec.causal_lm_loss_in_logits_dtype``, ``mlm_loss_in_logits_dtype``; see
        trainmem.analytic.activations ``loss_upcast``)."""
        return True


def _resolve_precision(t: TrainingConfig) -> None:
    """A ``precision`` of None becomes the framework's default
    (``FrameworkConventions.default_precision``: torchtune's ``bf16-true``, else
    :data:`~trainmem.specs.frameworks.DEFAULT_PRECISION`), before any check reads it; an
    unknown framework is left to its own check. So do an ``optimizer``, ``lora_targets`` and
    ``activation_checkpointing`` of None (``FrameworkConventions.default_optimizer``,
    ``default_lora_targets``, ``default_activation_checkpointing``) and a
    ``zero_grad_set_to_none`` of None (``FrameworkConventions.zero_grad_set_to_none`` for
    ``torch_version``); a value given is kept."""
    # a framework of the wrong type (a list from a config file) is its own check's error
    row = FRAMEWORK_CONVENTIONS.get(t.framework) if isinstance(t.framework, str) else None
    if t.precision is None:
        object.__setattr__(
            t, "precision", row.default_precision if row is not None else DEFAULT_PRECISION
        )
    if t.optimizer is None:  # the framework's (FrameworkConventions.default_optimizer)
        object.__setattr__(t, "optimizer", row.default_optimizer if row else "adamw")
    if t.lora_targets is None:  # the framework's (FrameworkConventions.default_lora_targets)
        default_targets = row.default_lora_targets if row else PEFT_DEFAULT_LORA_TARGETS
        object.__setattr__(t, "lora_targets", default_targets)
    if t.zero_grad_set_to_none is None and row is not None:
        # Note [zero_grad's default by release]; a torch_version that is no version string is
        # its own check's error, and leaves torch's current default here
        try:
            release = parse_version("torch_version", t.torch_version)
        except SpecError:
            release = None
        try:
            accelerate = parse_version("accelerate_version", t.accelerate_version)
        except SpecError:  # its own check's error
            accelerate = None
        object.__setattr__(
            t, "zero_grad_set_to_none", row.zero_grad_set_to_none(release, accelerate)
        )
    if t.activation_checkpointing is None:
        default = row.default_activation_checkpointing if row else "none"
        if row is not None and row.trl_sft_trainer:  # SFTConfig's default from 0.22
            default = framework_checkpointing_default(row, t.trl_version)
        sharded = row.sharded_activation_checkpointing if row else None
        if sharded is not None and isinstance(t.data_parallel_size, int):
            default = sharded if t.data_parallel_size > 1 else default
        object.__setattr__(t, "activation_checkpointing", default)


def framework_checkpointing_default(row: FrameworkConventions, trl_version: object) -> str:
    """The framework's ``activation_checkpointing`` when none is given
    (``FrameworkConventions.default_activation_checkpointing``); under TRL's SFTTrainer
    (``trl_sft_trainer``) ``none`` before
    :data:`~trainmem.specs.frameworks.TRL_SFT_CHECKPOINTING_SINCE` (``SFTConfig`` had no
    ``gradient_checkpointing`` default of its own: the Trainer's False)."""
    if row.trl_sft_trainer:
        given = parse_trl_version(trl_version) if isinstance(trl_version, str) else None
        if (given or default_trl_release()) < TRL_SFT_CHECKPOINTING_SINCE:
            return "none"
    return row.default_activation_checkpointing


def _check_framework_precision(t: TrainingConfig) -> None:
    """The precision is one the framework trains in (``FrameworkConventions.precisions``).

    Raises:
        SpecError: ``precision``, naming the framework and the precisions it runs.
    """
    allowed = t.conventions.precisions
    if allowed is None or t.precision in allowed:
        return
    why = {  # torchtune recipes/*_finetune_*.py, v0.1.0 to v0.6.1
        "torchtune": "torchtune's recipes build the whole model in the config's dtype "
        "(training.get_dtype: bf16 or fp32), run no torch.autocast and refuse fp16",
    }.get(t.framework, f"{t.framework} does not train in it")
    raise SpecError(
        "precision",
        f"{t.precision} with --framework {t.framework}: {why}; allowed: {', '.join(allowed)}",
    )


def _check_load_dtype(t: TrainingConfig) -> None:
    """A 16-bit ``load_dtype`` is the compute dtype of a ``*-mixed`` precision the framework
    runs under torch.autocast (``FrameworkConventions.autocast``), on an unquantized,
    unsharded model; over a quantized base whose other weights stay as loaded under autocast
    (``kbit_16bit_dense``), either 16-bit dtype: the one they stay in (``kbit_dense_dtype``,
    Note [A quantized base's other weights in another 16-bit dtype]).

    Raises:
        SpecError: ``load_dtype``, naming what it meets and the allowed values.
    """
    if t.load_dtype in (None, "float32"):
        return
    kbit = t.kbit_16bit_dense and t.uses_autocast
    why = None
    # what else would work here: the compute dtype only where that alone was the mismatch
    allowed = "float32"
    if not (t.is_mixed and not t.is_fp8 and t.conventions.autocast):
        why = (
            f"--precision {t.precision} with --framework {t.framework} runs no torch.autocast "
            "(a 16-bit model without autocast is --precision bf16-true / 16-true)"
        )
    elif t.quantize_base != "none" and not kbit:
        why = (
            "a quantized base's other weights take a 16-bit load dtype only where they stay as "
            "loaded under autocast (prepare_kbit_training false)"
        )
    elif t.load_dtype != t.compute_dtype and not kbit:
        why = f"autocast computes in {t.compute_dtype} under --precision {t.precision}"
        allowed = f"float32 or {t.compute_dtype}"
    elif t.load_dtype != t.compute_dtype and t.attention != "flash":
        # SDPA is on autocast's lower-precision list: it casts q, k, v to the compute dtype and
        # returns it, and the output projection's residual add (fp16 + bf16) promotes to fp32
        why = (
            f"{t.load_dtype} weights under {t.compute_dtype} autocast with --attention "
            f"{t.attention}: the attention returns {t.compute_dtype} and the residual stream "
            "turns float32, not modelled (flash-attn keeps the loaded dtype)"
        )
        allowed = f"float32 or {t.compute_dtype}, or {t.load_dtype} with --attention flash"
    elif t.load_dtype == "float16" and not t.is_lora:
        # torch/amp/grad_scaler.py ``_unscale_grads_``: "Attempting to unscale FP16 gradients."
        why = "16-mixed's GradScaler refuses fp16 gradients (trained fp16 weights); LoRA only"
    elif t.zero_stage != 0 or t.tensor_parallel_size > 1 or t.pipeline_parallel_size > 1:
        why = "modelled without ZeRO / FSDP sharding or model parallelism only"
    if why is not None:
        raise SpecError(
            "load_dtype",
            f"{t.load_dtype}: {why}; allowed here: {allowed} (a 16-bit load dtype is the "
            "compute dtype of a *-mixed precision under autocast, or the dtype a quantized "
            "base's other weights stay in)",
        )


def _check_adapter_dtype(t: TrainingConfig) -> None:
    """An explicit ``lora_adapter_dtype`` on one unsharded model only: DeepSpeed casts the
    module it wraps to one dtype (``FrameworkConventions.adapter_dtype_follows_weights``), and
    sharding flattens or gathers the adapters in the sharded dtype.

    Raises:
        SpecError: ``lora_adapter_dtype`` with ``zero_stage`` > 0 or such a framework.
    """
    if t.lora_adapter_dtype is None:
        return
    if t.zero_stage > 0 or t.conventions.adapter_dtype_follows_weights:
        raise SpecError(
            "lora_adapter_dtype",
            f"{t.lora_adapter_dtype}: with zero_stage {t.zero_stage} under {t.framework} the "
            "adapters are cast or flattened with the model (DeepSpeed, FSDP); allowed: unset, "
            "or zero_stage 0 outside DeepSpeed",
        )


def _check_combinations(t: TrainingConfig) -> None:
    """The checks that span concerns, after each concern has checked its own fields.

    Raises:
        SpecError: naming one field of the pair (the message says which other it meets).
    """
    _check_framework_precision(t)
    _check_load_dtype(t)
    _check_deepspeed_dtypes(t)
    _check_micro_batches(t)
    _check_loop(t)
    _check_cut_cross_entropy(t)
    _check_controlnet_lora(t)
    _check_step_in_backward(t)
    _check_ema_combinations(t)
    _check_fsdp1_model_parallel(t)
    _check_fsdp1_quantized(t)
    _check_prefix_tuning_run(t)
    _check_chatglm_quantize_precision(t)
    _check_float8_quantized(t)
    _check_dora_gptq(t)
    _check_dora_framework(t)
    _check_modules_to_save(t)
    _check_fsdp1_adapters(t)
    _check_adapter_dtype(t)
    _check_unsloth_single_gpu(t)
    _check_trl_release(t)
    if t.seq_len % t.context_parallel_size:
        raise SpecError(
            "context_parallel_size",
            f"{t.context_parallel_size} does not divide seq_len={t.seq_len}: each "
            "context-parallel rank holds seq_len / context_parallel_size tokens",
        )
    _check_context_parallel_sharding(t)


def _check_context_parallel_sharding(t: TrainingConfig) -> None:
    """Context parallelism under a framework whose FSDP2 shards over the data and context
    ranks (``FrameworkConventions.fsdp_shards_over_context_parallel``: ``pytorch-amp``,
    ``fsdp2``) needs that sharding, ZeRO-3.

    Note [Context parallelism needs FSDP over its ranks]
        No release runs torch's context parallelism with whole model states: torchtitan
        builds its "fsdp" mesh of ``dp_shard * cp`` ranks and applies FSDP2 whenever CP is
        on (torchtitan/distributed/parallel_dims.py at b5bcd76: ``fsdp_enabled`` is
        ``dp_shard_enabled or cp_enabled``, "we always assume that when ``cp`` is used, FSDP
        is also applied"; models/llama3/parallelize.py calls ``apply_fsdp_to_decoder`` on
        that mesh unconditionally), and accelerate refuses ``cp_size > 1`` without an FSDP2
        plugin (v1.14.0 state.py ``AcceleratorState``: "no `fsdp_plugin` was provided",
        "requires FSDP2"). The trace engine shards over the CP ranks as torchtitan does
        (trainmem/trace/parallel.py ``parallelize``), so a smaller ``zero_stage`` would have
        the formulas keep whole states the trace shards (llama-3.2-1b, CP 2, 1 x 2048,
        ZeRO-0: trace 14.91 GB, formulas 24.73 GB). The default ``zero_stage`` 0 cannot be
        told from an explicit one, so the pair is refused rather than silently changed.

    Raises:
        SpecError: ``zero_stage``, naming the sources and what runs instead.
    """
    cp = t.context_parallel_size
    if cp == 1 or t.zero_stage == 3 or not t.conventions.fsdp_shards_over_context_parallel:
        return
    raise SpecError(
        "zero_stage",
        f"{t.zero_stage} with --context-parallel-size {cp} and --framework {t.framework}: "
        "context parallelism runs with FSDP2 sharding the model states over the data x "
        "context ranks (torchtitan parallel_dims.py applies FSDP whenever CP is on; "
        "accelerate 1.14 state.py refuses cp_size > 1 without an FSDP2 plugin), never with "
        f"ZeRO-{t.zero_stage}'s states; allowed: --zero-stage 3 (or --fsdp full-shard), or "
        "--context-parallel-size 1",
    )


ADAFACTOR_ON_DTENSORS_CHECKED = (2, 13)
"""The torch release on which Adafactor over DTensor-sharded matrices was run and raised
(:func:`adafactor_on_dtensors`); a ``torch_version`` before it is not refused."""


def adafactor_on_dtensors(t: TrainingConfig) -> bool:
    """Adafactor steps matrices that DTensor shards: FSDP2 (``fully_shard``, ZeRO-3 over more
    than one rank) or DTensor tensor parallelism (``dtensor_vocab_parallel_embedding``
    frameworks).

    Note [Adafactor on DTensor-sharded matrices]
        Adafactor's second moment of a matrix is a row and a column mean of the squared
        gradient, each taken as a norm squared in place: torch.optim.Adafactor
        (torch/optim/_adafactor.py, foreach: ``col_means = [torch.norm(grad, dim=-2,
        keepdim=True) ...]; torch._foreach_mul_(col_means, col_means)``; for-loop:
        ``torch.norm(grad, dim=-2, keepdim=True).square_()``). On a DTensor sharded along
        the reduced dimension (FSDP2's ``Shard(0)``; TP's ``Shard(0)`` / ``Shard(1)``) the
        norm is a ``_NormPartial`` DTensor, and DTensor refuses an in-place op that would
        change its placement ("in-place operations that require placement changes are not
        supported"). transformers' Adafactor (transformers/optimization.py) keeps its
        factored states as plain tensors (``torch.zeros(...).to(grad)``) and fails on them
        ("got mixed torch.Tensor and DTensor"). Run on torch 2.13.0 (CPU, fake process
        group of 2): ``fully_shard`` over two ``nn.Linear``, both torch implementations and
        transformers' 5.24 raise at the first ``step()``; ``ColwiseParallel`` on an
        ``nn.Linear``, torch's for-loop step raises the same. FSDP1 (accelerate-fsdp,
        fsdp-qlora) hands the optimizer flat 1-D shards, which Adafactor does not factor
        (Note [Factored states of flat parameters]), and DeepSpeed and DDP keep plain
        tensors.
    """
    if t.optimizer != "adafactor":
        return False
    fsdp2 = t.conventions.fsdp2_post_backward and t.zero_stage == 3 and t.sharding_degree > 1
    dtensor_tp = t.tensor_parallel_size > 1 and t.conventions.dtensor_vocab_parallel_embedding
    return fsdp2 or dtensor_tp


def _raises_on_dtensors(t: TrainingConfig) -> bool:
    """The modelled torch release is one Adafactor over DTensors was seen to raise on: the
    default (a current release) or ``torch_version`` >= :data:`ADAFACTOR_ON_DTENSORS_CHECKED`."""
    release = parse_version("torch_version", t.torch_version)
    return release is None or release >= ADAFACTOR_ON_DTENSORS_CHECKED


def adafactor_on_dtensors_untraced(t: TrainingConfig) -> bool:
    """Adafactor over DTensor-sharded matrices (:func:`adafactor_on_dtensors`) under an
    older ``torch_version``, which the formulas answer and the traced paths, running the
    installed torch, cannot."""
    return adafactor_on_dtensors(t) and not _raises_on_dtensors(t)


def _check_adafactor_on_dtensors(t: TrainingConfig) -> None:
    """Refuses Adafactor over DTensor-sharded matrices (Note [Adafactor on DTensor-sharded
    matrices]) for a torch release on which it raises (the default, a current one, or
    ``torch_version`` >= :data:`ADAFACTOR_ON_DTENSORS_CHECKED`).

    Raises:
        SpecError: ``optimizer``, naming what runs instead.
    """
    if not adafactor_on_dtensors(t) or not _raises_on_dtensors(t):
        return
    where = "FSDP2 (ZeRO-3)" if t.tensor_parallel_size == 1 else "DTensor tensor parallelism"
    raise SpecError(
        "optimizer",
        f"adafactor under {where} with --framework {t.framework}: torch's and transformers' "
        "Adafactor raise at their first step on DTensor-sharded matrices (the factored "
        "column mean is squared in place on a partial DTensor: 'in-place operations that "
        "require placement changes are not supported', torch 2.13); allowed: adafactor "
        "under --framework accelerate-fsdp (FSDP1's flat shards), DeepSpeed or plain DDP, "
        "or another optimizer (adamw, adamw-8bit, lion, sgd) under FSDP2",
    )


def parse_trl_version(text: str | None) -> tuple[int, ...] | None:
    """``trl_version`` as (major, minor, ...), None when not given.

    Raises:
        SpecError: naming ``trl_version`` and the releases modelled
            (:data:`~trainmem.specs.frameworks.TRL_RELEASES_MODELLED`).
    """
    try:
        return parse_version("trl_version", text)
    except SpecError as error:
        said = str(error).removeprefix("trl_version: ")
        raise SpecError("trl_version", f"{said}; allowed: {TRL_RELEASES_MODELLED}") from None


def _check_trl_release(t: TrainingConfig) -> None:
    """A ``trl_version`` whose SFTTrainer prepares the quantized base in a way not modelled,
    where that preparation runs (:attr:`TrainingConfig.kbit_fp32_upcast`).

    Raises:
        SpecError: naming ``trl_version``, what that release does and the releases modelled.
    """
    trl = parse_trl_version(t.trl_version)
    if trl is None or not t.kbit_fp32_upcast:
        return
    allowed = (
        "allowed: a release before 0.7.5 (peft's preparation alone), 0.9.3 to 0.25 (then "
        "the embeddings and LM head in bf16) or from 0.26 (no preparation, bf16 adapters), "
        "or drop the version"
    )
    if TRL_SFT_BF16_EMBEDDINGS_SINCE <= trl < TRL_SFT_ADAPTERS_FP32_SINCE:
        raise SpecError(
            "trl_version",
            f"{t.trl_version}: TRL 0.7.5 .. 0.8.6 also cast the LoRA layers to bf16 "
            f"(peft_module_casting_to_bf16), which is not modelled; {allowed}",
        )


def _check_unsloth_single_gpu(t: TrainingConfig) -> None:
    """``--framework unsloth`` is Unsloth on one GPU (the conventions read from 2026.3.5 are
    its single-device ones: one ``GPU_BUFFER`` per device, ``is_loaded_in_8bit = True`` set on
    the PEFT model "to disable incorrect DDP", unsloth/models/llama.py ``get_peft_model``).

    Raises:
        SpecError: a parallel size above 1, ZeRO / FSDP sharding, CPU offload or torchtune's
            activation offloading, naming what runs instead.
    """
    if t.framework != "unsloth":
        return
    if t.unsloth_release < UNSLOTH_OLDEST_MODELLED:
        raise SpecError(
            "unsloth_version",
            f"{t.unsloth_version}: Unsloth before 2024.7 (the oldest tag read) is not "
            "modelled; allowed: 2024.7 or later",
        )
    if t.chunked_cross_entropy and t.unsloth_release < UNSLOTH_FUSED_LOSS_SINCE:
        raise SpecError(
            "chunked_cross_entropy",
            f"{t.chunked_cross_entropy} with --unsloth-version {t.unsloth_version}: before "
            "2025.8.5 Unsloth's loss (Cut Cross Entropy, before 2024.11.8 its kernel on the "
            "whole logits) has no pieces (UNSLOTH_CE_LOSS_N_CHUNKS came with its fused loss); "
            "allowed: 0",
        )
    if t.cut_cross_entropy:
        raise SpecError(
            "cut_cross_entropy",
            f"Unsloth's loss is its release's (--unsloth-version {t.unsloth_version}: Cut "
            "Cross Entropy from 2024.11.8 to 2025.8.4, its fused loss after); allowed: false",
        )
    for name in (
        "data_parallel_size",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "context_parallel_size",
    ):
        size = getattr(t, name)
        if size > 1:
            raise SpecError(
                name,
                f"{size} with --framework unsloth: its conventions are Unsloth's on one GPU "
                f"(2026.3.5); allowed: {_flag(name)} 1, or --framework hf-trainer (the HF "
                "Trainer over several GPUs)",
            )
    if t.activation_offloading:
        raise SpecError(
            "activation_offloading",
            "torchtune's OffloadActivations is no Unsloth setting; Unsloth offloads each "
            "checkpointed layer's input itself under --activation-checkpointing full (its "
            '"unsloth" mode, the default with --framework unsloth); allowed: false',
        )
    if t.zero_stage > 0 or t.offload != "none":
        field = "zero_stage" if t.zero_stage > 0 else "offload"
        raise SpecError(
            field,
            f"{getattr(t, field)} with --framework unsloth: Unsloth runs no ZeRO / FSDP "
            "sharding or optimizer offload on one GPU; allowed: --zero-stage 0 --offload none, "
            "or --framework hf-trainer / deepspeed",
        )


_FSDP1_MODEL_PARALLEL: dict[tuple[str, str], str] = {
    ("accelerate-fsdp", "tensor_parallel_size"): (
        "accelerate never wraps FSDP1 beside tensor parallelism: 1.4 .. 1.9's "
        "TorchTensorParallelPlugin sets DistributedType.TP, which skips the FSDP wrap "
        "(state.py AcceleratorState, accelerator.py prepare_model), and from 1.10 "
        "ParallelismConfig(tp_size) runs with FSDP2 only (parallelism_config.py "
        "_validate_accelerator); the HF Trainer's --fsdp with tp_size goes through the same "
        "accelerate; allowed: --framework fsdp2 --zero-stage 3 (FSDP2 with TP), or "
        "--tensor-parallel-size 1"
    ),
    ("accelerate-fsdp", "pipeline_parallel_size"): (
        "accelerate trains with no pipeline parallelism outside its Megatron-LM plugin "
        "(inference.py prepare_pippy is for inference); allowed: --framework fsdp2 --zero-stage "
        "3 (torch.distributed.pipelining with FSDP2, torchtitan), --framework megatron, or "
        "--pipeline-parallel-size 1"
    ),
    ("accelerate-fsdp", "context_parallel_size"): (
        "accelerate's context parallelism (1.10+, 6891c570) runs with FSDP2 only: state.py "
        "AcceleratorState raises 'Using `cp_size>1` requires FSDP2, but the provided "
        "`fsdp_plugin` is using FSDP1' (before 1.10 accelerate has no context parallelism); "
        "allowed: --framework fsdp2 --zero-stage 3 (FSDP2 with CP: torchtitan's, or accelerate's "
        "ParallelismConfig(cp_size) with fsdp_version 2), or --context-parallel-size 1"
    ),
}
"""Model parallelism beside FSDP1 that no run of the framework has (``fsdp-qlora``'s train.py
has no tensor, pipeline or context parallelism: its own message), with what runs instead."""


def _check_fsdp1_model_parallel(t: TrainingConfig) -> None:
    """FSDP1 frameworks beside model parallelism their code does not run: accelerate's FSDP1
    beside tensor, pipeline or context parallelism (:data:`_FSDP1_MODEL_PARALLEL`), Answer.AI
    fsdp_qlora's train.py (e4968fd, Mar 2024: ``FSDP`` over the data-parallel world, no
    tensor, pipeline or context-parallel option) beside any.

    Raises:
        SpecError: the model-parallel size, naming the framework and what runs instead.
    """
    fields_ = ("tensor_parallel_size", "pipeline_parallel_size", "context_parallel_size")
    for name in fields_:
        size = getattr(t, name)
        if size == 1:
            continue
        why = _FSDP1_MODEL_PARALLEL.get((t.framework, name))
        if t.framework == "fsdp-qlora":
            why = (
                "Answer.AI fsdp_qlora's train.py wraps FSDP1 over the data-parallel ranks "
                "only (no tensor, pipeline or context-parallel option); allowed: "
                f"--framework fsdp2 --zero-stage 3 with --quantize-base, or {_flag(name)} 1"
            )
        if why is not None:
            raise SpecError(name, f"{size} with --framework {t.framework}: {why}")


def _check_fsdp1_adapters(t: TrainingConfig) -> None:
    """Adapters FSDP1 with ``use_orig_params=False`` (accelerate's FSDP, Answer.AI
    fsdp_qlora) cannot flatten: a unit's ``FlatParameter`` is all trainable or all frozen
    (torch distributed/fsdp/_flat_param.py ``_validate_tensors_to_flatten``: "Must flatten
    tensors with uniform `requires_grad` when `use_orig_params=False`"), so trainable leaves
    get units of their own, wrapped by peft's ``fsdp_auto_wrap_policy`` (peft utils/other.py)
    or fsdp_qlora's ``get_wrapping_policy``: leaf modules with a trainable ``weight``. LoRA's
    and DoRA's ``lora_A`` / ``lora_B`` / magnitude are such leaves; LoKr's ``lokr_w1`` /
    ``lokr_w2``, LoHa's ``hada_w1_a`` ... ``hada_w2_b`` and AdaLoRA's ``lora_A`` / ``lora_E`` /
    ``lora_B`` are parameters of the adapted layer itself (peft tuners/lokr/layer.py,
    tuners/loha/layer.py, tuners/adalora/layer.py), flattened with
    its frozen base weight. fsdp_qlora's ``train_type`` offers LoRA and DoRA adapters only.

    Raises:
        SpecError: ``lora_variant``, naming the variants that run.
    """
    if t.framework in ("accelerate-fsdp", "fsdp-qlora") and t.lora_variant in (
        "lokr",
        "loha",
        "adalora",
    ):
        raise SpecError(
            "lora_variant",
            f"{t.lora_variant} with --framework {t.framework}: FSDP1 with use_orig_params="
            "False flattens its adapter parameters with the frozen base weight of the layer "
            "they adapt, and torch refuses a flat parameter mixing trainable and frozen "
            "tensors (distributed/fsdp/_flat_param.py: 'Must flatten tensors with uniform "
            "requires_grad'); allowed: lora, dora, or this variant under --framework fsdp2 "
            "(use_orig_params semantics), DeepSpeed or DDP",
        )


PREFIX_TUNING_FRAMEWORKS = (
    "pytorch-amp",
    "hf-trainer",
    "trl",
    "deepspeed",
    "accelerate-fsdp",
    "fsdp2",
)
"""The frameworks whose loop runs peft's ``PrefixTuningConfig`` model as built (the plain
loop, the HF Trainer, TRL's trainers, each over DDP; the HF Trainer's DeepSpeed engine, as
THUDM's finetune_demo runs it, and its FSDP through accelerate; FSDP2); LLaMA-Factory and
axolotl offer no prefix tuning, the others no peft prompt learning. Under data parallelism,
ZeRO and FSDP the prompt encoder is the only trained tensor the rules size (Note [Prompt
encoder tensors] in trainmem/analytic/prompt_encoder.py)."""

_PREFIX_TUNING_UNTRACED = (
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "context_parallel_size",
    "optimizer_in_backward",
    "activation_offloading",
)
"""Settings not modelled beside prompt learning (Note [Prefix tuning] in
:mod:`trainmem.trace.prefix`): the model-parallel layouts (peft's prompt encoder sits outside
the model's tensor / pipeline / context splits: peft wraps a transformers model, which the
frameworks that split it, Megatron, torchtitan, nanotron, build from their own modules, and
none of them runs peft's prompt learning), the optimizer in backward and activation
offloading (not checked with a prompt encoder). Data parallelism, ZeRO, FSDP and their CPU
offload run (the prompt encoder in the state layout, Note [Prompt encoder tensors]; offload
since session 29: DeepSpeed ZeRO-2 / ZeRO-3 and FSDP2 offload, the plain loop's, checked
against the formulas in tests/analytic/test_prompt_learning_formulas.py)."""


def _check_prefix_tuning_run(t: TrainingConfig) -> None:
    """Prefix tuning runs under a framework that runs peft's prefix tuning
    (:data:`PREFIX_TUNING_FRAMEWORKS`), with none of :data:`_PREFIX_TUNING_UNTRACED`.

    Raises:
        SpecError: the first setting prefix tuning is not modelled with.
    """
    if not t.is_prompt_learning:
        return
    if t.framework not in PREFIX_TUNING_FRAMEWORKS:
        raise SpecError(
            "num_virtual_tokens",
            f"prefix tuning under {t.framework} is not modelled (peft's PrefixTuningConfig "
            f"runs in the plain loop, the HF Trainer, TRL, DeepSpeed and FSDP); allowed "
            "frameworks: "
            f"{', '.join(PREFIX_TUNING_FRAMEWORKS)}",
        )
    # an optimizer the trace runs as a stand-in is sized from the state layout, which holds
    # the prompt encoder (Note [Prompt encoder tensors] in trainmem/analytic/prompt_encoder.py)
    defaults = TrainingConfig()
    for name in _PREFIX_TUNING_UNTRACED:
        if getattr(t, name) != getattr(defaults, name):
            raise SpecError(
                name,
                f"{getattr(t, name)} beside prefix tuning (num_virtual_tokens "
                f"{t.num_virtual_tokens}) is not modelled: peft's prompt learning runs on one "
                "GPU or over data parallelism (DDP, DeepSpeed ZeRO, FSDP, with or without CPU "
                "offload), not inside a tensor / pipeline / context-parallel model; allowed: "
                f"{name} {getattr(defaults, name)}",
            )


def _check_chatglm_quantize_precision(t: TrainingConfig) -> None:
    """ChatGLM's own quantize runs over a 16-bit model without autocast: THUDM's ptuning
    scripts call ``model.half()`` after ``quantize`` and pass no ``--fp16`` / ``--bf16``, and
    its dequantization asserts a 16-bit scale (quantization.py ``extract_weight_to_half``:
    ``assert scale_list.dtype in [torch.half, torch.bfloat16]``; a ``model.float()`` model
    fails there).

    Raises:
        SpecError: ``precision``.
    """
    if t.quantize_base in CHATGLM_QUANTIZE and t.precision not in ("16-true", "bf16-true"):
        raise SpecError(
            "precision",
            f"{t.precision} with --quantize-base {t.quantize_base}: ChatGLM's quantized "
            "linears rebuild a 16-bit weight from a 16-bit scale (quantization.py "
            "extract_weight_to_half asserts it) and THUDM's scripts run model.half() without "
            "autocast; allowed: 16-true or bf16-true",
        )


def _check_fsdp1_quantized(t: TrainingConfig) -> None:
    """Quantized bases FSDP1 frameworks never run: bitsandbytes int8 under either (FSDP1
    flattens a unit's parameters into one float tensor: torch 2.13 distributed/fsdp/
    _flat_param.py ``_validate_tensors_to_flatten`` raises "Cannot flatten integer dtype
    tensors" for ``Int8Params``' int8 weight; reported with accelerate, huggingface/accelerate
    #1415, bitsandbytes #1709, peft #2833; LLaMA-Factory #3543 declines 8-bit FSDP-QLoRA),
    and a GPTQ base under Answer.AI fsdp_qlora's train.py (e4968fd / 50efa1e: its
    ``train_type`` quantizes with bitsandbytes 4-bit or HQQ only). A GPTQ base under
    accelerate's FSDP1 runs: its packed tensors are buffers, which FSDP1 leaves whole.

    Raises:
        SpecError: ``quantize_base``, naming what runs instead.
    """
    if t.framework == "fsdp-qlora" and t.quantize_base in ("int8", "gptq-int4"):
        raise SpecError(
            "quantize_base",
            f"{t.quantize_base} with --framework fsdp-qlora: Answer.AI fsdp_qlora's train.py "
            "quantizes with bitsandbytes 4-bit (train_type qlora, custom_qlora, bnb_dora) or "
            "HQQ only; allowed: nf4, nf4-dq, fp4, fp4-dq",
        )
    if t.framework == "accelerate-fsdp" and t.quantize_base == "int8":
        raise SpecError(
            "quantize_base",
            "int8 with --framework accelerate-fsdp: FSDP1 cannot flatten bitsandbytes' int8 "
            "weights into a unit's float tensor (torch distributed/fsdp/_flat_param.py: "
            "'Cannot flatten integer dtype tensors'); allowed: a 4-bit base (nf4, nf4-dq, fp4, "
            "fp4-dq, stored in the model's dtype), gptq-int4, or int8 under --framework fsdp2 "
            "--zero-stage 3, DeepSpeed or DDP",
        )


def _check_float8_quantized(t: TrainingConfig) -> None:
    """A bitsandbytes base (4-bit or int8) with ``fp8-mixed``, which no release runs.

    Note [float8 training over a bitsandbytes base]
        torchao's ``convert_to_float8_training`` swaps every module that ``isinstance(module,
        nn.Linear)`` passes and its filter keeps (torchao 0.18 float8/float8_linear_utils.py
        ``swap_linear_layers``), and bitsandbytes' quantized linears subclass ``nn.Linear``
        (bitsandbytes nn/modules.py ``class Linear4bit(nn.Linear)``, ``class
        Linear8bitLt(nn.Linear)``), so ``Float8Linear.from_float`` takes their packed weight
        as a high-precision one (float8_linear.py: ``new_mod.weight = mod.weight``): a 4-bit
        ``Params4bit`` of shape ``(ceil(n / 2), 1)`` that ``torch._scaled_mm`` cannot multiply,
        or int8 codes without their row scales (``SCB``). accelerate's float8 filter drops
        only the first and last linears and those not divisible by 16 (accelerate 1.14
        utils/ao.py ``filter_linear_layers``), so a QLoRA model under ``mixed_precision="fp8"``
        converts them too; torchtune's QLoRA recipes have no float8 and torchtitan no quantized
        base. A GPTQ base runs: its ``QuantLinear`` is an ``nn.Module`` (auto-gptq
        nn_modules/qlinear/qlinear_tritonv2.py), which torchao leaves, converting the LoRA
        adapters.

    Raises:
        SpecError: ``quantize_base``, naming what runs instead.
    """
    if t.is_fp8 and t.quantize_base not in ("none", "gptq-int4"):
        raise SpecError(
            "quantize_base",
            f"{t.quantize_base} with --precision fp8-mixed: torchao's float8 conversion swaps "
            "every nn.Linear subclass, bitsandbytes' quantized linears included, and "
            "Float8Linear cannot multiply their packed weights (Note [float8 training over a "
            "bitsandbytes base]); allowed: gptq-int4 or none with fp8-mixed, or this base "
            "with bf16-mixed, 16-mixed or 32-true",
        )


def _check_dora_gptq(t: TrainingConfig) -> None:
    """DoRA over a GPTQ base, which peft refuses: its GPTQ LoRA layer raises "does not
    support DoRA yet" when built with ``use_dora`` (peft 0.21 tuners/lora/gptq.py
    ``GPTQLoraLinear.__init__``), and DoRA's weight norm dequantizes through
    ``dequantize_module_weight`` (utils/integrations.py), which knows bitsandbytes' and HQQ's
    weights, not GPTQ's packed ``qweight``.

    Raises:
        SpecError: ``lora_variant``, naming what runs instead.
    """
    if t.lora_variant == "dora" and t.quantize_base == "gptq-int4":
        raise SpecError(
            "lora_variant",
            "dora with --quantize-base gptq-int4: peft's GPTQ LoRA layer refuses DoRA "
            "(tuners/lora/gptq.py: 'does not support DoRA yet'); allowed: lora, adalora or "
            "lokr over gptq-int4, or dora over an unquantized or bitsandbytes base",
        )


_DORA_NOT_PEFT = {
    "fsdp-qlora": "Answer.AI fsdp_qlora (train.py @05ed9f2) runs DoRA only as its own layers over "
    "a quantized base (train_type bnb_dora: BNBDORA, hqq_dora: HQQDORA, scripts/dora.py: the "
    "column norm of W + B A from DORALayer, a MagnitudeLayer); its train_type lora builds peft's "
    "LoraConfig without use_dora",
    "torchtune": "torchtune 0.6.1 runs its own DoRALinear (torchtune/modules/peft/dora.py: the "
    "adapters' weight as lora_b(lora_a(torch.eye(in_dim))), the norm of weight.to(x.dtype) plus "
    "it, over torchao's NF4Tensor when quantized), not peft's DoRA",
    "litgpt": "litgpt 0.5.13 has no DoRA (litgpt/lora.py trains LoRA layers only; no 'dora' in "
    "its source)",
}
"""The frameworks whose DoRA is not peft 0.21's ``DoraLinearLayer``, the one both engines
model (Note [DoRA], Note [QDoRA] in ``analytic/lora_variants.py``), with what they run
instead."""


def _check_dora_framework(t: TrainingConfig) -> None:
    """DoRA (over any base) where the framework's DoRA is not peft's (:data:`_DORA_NOT_PEFT`):
    refused rather than modelled as peft's layer, which those frameworks do not run.

    Raises:
        SpecError: ``lora_variant``, naming what runs instead.
    """
    other = _DORA_NOT_PEFT.get(t.framework)
    if t.lora_variant == "dora" and other is not None:
        base = "" if t.quantize_base == "none" else f" with --quantize-base {t.quantize_base}"
        raise SpecError(
            "lora_variant",
            f"dora{base} under --framework {t.framework}: {other}; not modelled; allowed: lora "
            "under this framework, or dora (unquantized or over bitsandbytes) under a peft "
            "framework (pytorch-amp, hf-trainer, accelerate-fsdp, deepspeed, fsdp2, unsloth)",
        )


_MODULES_TO_SAVE_NOT_PEFT: dict[str, str] = {
    "megatron": "Megatron-LM trains no adapters",
    "torchtune": "torchtune 0.6.1's LoRA recipes build their own LoRALinear layers, with no "
    "modules_to_save (the embedding and output are frozen or trained whole)",
    "litgpt": "litgpt 0.5.13's LoRA (litgpt/lora.py mark_only_lora_as_trainable) has no "
    "modules_to_save",
    "fsdp-qlora": "Answer.AI fsdp_qlora's train.py builds its LoraConfig without modules_to_save",
    "unsloth": "Unsloth's get_peft_model offloads the frozen original to the CPU and trains an "
    "fp16 copy in fp32 (models/llama.py: 'Training embed_tokens in mixed precision to save "
    "VRAM', _offload_frozen_module_for_training), not peft's plain deep copy",
}
"""The frameworks whose LoRA is not peft's ``LoraConfig(modules_to_save=...)`` as Note [peft
modules_to_save] models it, with what they run instead."""


def _check_modules_to_save(t: TrainingConfig) -> None:
    """peft's ``modules_to_save`` (Note [peft modules_to_save]) where it is not modelled: a
    framework whose LoRA is not peft's (:data:`_MODULES_TO_SAVE_NOT_PEFT`), model parallelism
    (the copies' vocabulary split), or parameter sharding (ZeRO-3 / FSDP: peft gathers the
    original to copy it, ``deepspeed.zero.GatheredParameters``, and the copy's units are not
    modelled; Qwen-1's finetune.py refuses ZeRO-3 with it: "ZeRO3 is incompatible with LoRA
    when finetuning on base model").

    Raises:
        SpecError: ``lora_modules_to_save``, naming what runs.
    """
    if not t.lora_modules_to_save or not t.is_lora:
        return
    saved = ",".join(t.lora_modules_to_save)
    other = _MODULES_TO_SAVE_NOT_PEFT.get(t.framework)
    if other is not None:
        raise SpecError(
            "lora_modules_to_save",
            f"{saved} under --framework {t.framework}: {other}; not modelled; allowed: none "
            "under this framework, or a peft framework (pytorch-amp, hf-trainer, trl, "
            "llama-factory, axolotl, deepspeed)",
        )
    if t.tensor_parallel_size > 1 or t.pipeline_parallel_size > 1:
        raise SpecError(
            "lora_modules_to_save",
            f"{saved} with tensor or pipeline parallelism: not modelled; allowed: none, or "
            "tensor_parallel_size 1 and pipeline_parallel_size 1",
        )
    if t.kbit_16bit_dense:
        raise SpecError(
            "lora_modules_to_save",
            f"{saved} over a quantized base kept in 16 bits (no peft k-bit preparation): the "
            "copies' 16-bit training is not modelled; allowed: none, or prepare_kbit_training "
            "true",
        )
    fsdp = t.framework in ("accelerate-fsdp", "fsdp2")
    if t.sharding_degree > 1 and (t.zero_stage == 3 or fsdp):
        raise SpecError(
            "lora_modules_to_save",
            f"{saved} with {'FSDP' if fsdp else 'ZeRO-3'} over {t.sharding_degree} ranks: the "
            "trained copies under parameter sharding are not modelled; allowed: none, or "
            "DDP / DeepSpeed ZeRO-1/2",
        )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check_deepspeed_dtypes(t: TrainingConfig) -> None:
    if t.grad_accum_dtype is not None and not t.conventions.deepspeed_optimizer_wrappers:
        deepspeed = [n for n, c in FRAMEWORK_CONVENTIONS.items() if c.deepspeed_optimizer_wrappers]
        raise SpecError(
            "grad_accum_dtype",
            f"is DeepSpeed's data_types.grad_accum_dtype; framework {t.framework!r} does "
            f"not read it (allowed with: {', '.join(deepspeed)})",
        )
    _ = t.deepspeed_optimizer  # refuses the dtype mixes DeepSpeed refuses


def _check_cut_cross_entropy(t: TrainingConfig) -> None:
    """Cut Cross Entropy patches transformers' ``ForCausalLM.forward`` (axolotl's plugin,
    Note [axolotl's Cut Cross Entropy] in trainmem/analytic/loss.py): refused where the model
    code is the framework's own (litgpt, torchtune, Megatron) and under tensor parallelism
    (its vocabulary-parallel options are not modelled)."""
    if not t.cut_cross_entropy:
        return
    if not t.conventions.hf_model_code:
        raise SpecError(
            "cut_cross_entropy",
            f"--framework {t.framework} runs its own model code, which Cut Cross Entropy "
            "(axolotl's plugin) does not patch; allowed: a transformers framework (axolotl, "
            "hf-trainer, accelerate, deepspeed, ...) or cut_cross_entropy false",
        )
    if t.tensor_parallel_size > 1:
        raise SpecError(
            "cut_cross_entropy",
            "with tensor_parallel_size > 1 (its vocabulary-parallel kernel) is not modelled; "
            "allowed: tensor_parallel_size 1",
        )


def _check_controlnet_lora(t: TrainingConfig) -> None:
    """A ControlNet is trained whole (diffusers v0.40 ``examples/controlnet/
    train_controlnet.py`` / ``_flux.py`` / ``_sd3.py``: ``controlnet.train()``, all its
    parameters to the optimizer, no LoRA adapters), so ``controlnet`` with ``lora_rank`` is
    refused here, whatever the model, where the planner's and the OOM note's changes meet it
    too (:func:`~trainmem.specs.diffusers.check_controlnet` refuses the models)."""
    if t.controlnet and t.lora_rank > 0:
        raise SpecError(
            "controlnet",
            "train_controlnet.py trains the whole ControlNet; set lora_rank 0 (or leave "
            "controlnet off to train LoRA adapters on the denoiser)",
        )


def _check_loop(t: TrainingConfig) -> None:
    """The ``loop`` setting against ``keep_logits``, accumulation and pipelining."""
    if t.keep_logits and t.loop not in (None, "step"):
        raise SpecError(
            "loop",
            f"{t.loop!r} contradicts keep_logits=True (the logits held until the step ends: "
            "loop 'step'); give one of them",
        )
    if t.loop == "step" and t.gradient_accumulation_steps > 1:
        raise SpecError(
            "loop",
            "'step' is modelled for one micro-batch per step; got gradient_accumulation_steps "
            f"{t.gradient_accumulation_steps} (use 1, or loop 'previous' / 'drop')",
        )
    if t.loop == "previous" and t.pipeline_parallel_size > 1:
        raise SpecError(
            "loop",
            "'previous' cannot be combined with pipeline_parallel_size "
            f"{t.pipeline_parallel_size}: the schedule holds each micro-batch's outputs itself "
            "(pipelining's output_chunks)",
        )


def _check_micro_batches(t: TrainingConfig) -> None:
    """What one micro-batch per step (or a bounded number of them) is modelled for."""
    for flag in ("zero_grad_before_backward", "keep_logits"):
        if getattr(t, flag) and t.gradient_accumulation_steps > 1:
            raise SpecError(
                flag,
                "is modelled for one micro-batch per step; got gradient_accumulation_steps "
                f"{t.gradient_accumulation_steps} (use 1, or leave {flag} off)",
            )
    if t.pipeline_parallel_size > 1 and t.gradient_accumulation_steps > MAX_PIPELINE_MICRO_BATCHES:
        raise SpecError(
            "gradient_accumulation_steps",
            f"{t.gradient_accumulation_steps:,} micro-batches under pipeline parallelism; "
            f"allowed: 1..{MAX_PIPELINE_MICRO_BATCHES:,} (a stage's step is replayed micro-"
            "batch by micro-batch, and its memory grows with each: a receive buffer per "
            "micro-batch, the last stage's kept output chunks)",
        )
    # the settings, not a framework's default loop (fsdp-qlora's, refused beside pipelining)
    if (t.keep_logits or t.loop == "step") and t.pipeline_parallel_size > 1:
        raise SpecError(
            "keep_logits" if t.keep_logits else "loop",
            "cannot be combined with pipeline_parallel_size "
            f"{t.pipeline_parallel_size}: the last stage keeps every micro-batch's "
            "logits itself (pipelining's output_chunks, modelled already)",
        )


def _check_step_in_backward(t: TrainingConfig) -> None:
    """Where the optimizer step (and so the gradients' release) meets the loop, the offload
    and the pipeline."""
    if t.zero_grad_before_backward and t.optimizer_in_backward:
        raise SpecError(
            "zero_grad_before_backward",
            "cannot be combined with optimizer_in_backward: the gradients are stepped and "
            "freed in backward, there is nothing to zero",
        )
    _check_torchao_gradient_offload(t)
    _check_optimizer_in_backward_framework(t)
    if t.optimizer_in_backward and t.gradient_accumulation_steps > 1:
        # torchtune's recipes refuse the pair: the step runs inside backward, so there is
        # no gradient left to accumulate into (recipes/full_finetune_*.py).
        raise SpecError(
            "optimizer_in_backward",
            "cannot be combined with gradient_accumulation_steps "
            f"{t.gradient_accumulation_steps}: the gradient is stepped and freed in "
            "backward, nothing is left to accumulate (use gradient_accumulation_steps 1)",
        )
    if t.optimizer_in_backward and t.pipeline_parallel_size > 1:
        # torchtitan refuses the pair (components/optimizer.py: "Optimizers in backward is
        # not supported with Pipeline Parallel."): a pipeline stage's gradients are stepped
        # only after every micro-batch's backward (torch/distributed/pipelining/stage.py)
        raise SpecError(
            "optimizer_in_backward",
            "cannot be combined with pipeline_parallel_size "
            f"{t.pipeline_parallel_size}: a pipeline stage steps its gradients after "
            "every micro-batch's backward (use pipeline_parallel_size 1, or no "
            "optimizer_in_backward)",
        )
    if t.framework == "deepspeed" and t.pipeline_parallel_size > 1 and t.zero_stage > 1:
        # deepspeed/runtime/pipe/engine.py PipelineEngine.__init__ (0.16.4 to 0.19.8):
        # assert zero_optimization_stage() < ZeroStageEnum.gradients
        raise SpecError(
            "zero_stage",
            f"{t.zero_stage} with DeepSpeed pipeline parallelism: DeepSpeed refuses it "
            "(runtime/pipe/engine.py: 'ZeRO-2 and ZeRO-3 are incompatible with pipeline "
            "parallelism'); allowed: 0 or 1",
        )


def _check_optimizer_in_backward_framework(t: TrainingConfig) -> None:
    """Frameworks whose step cannot run in backward: Megatron-LM steps its (distributed)
    optimizer once the gradients are reduced after the whole backward (megatron/training/
    training.py ``train_step``), and FSDP1 with ``use_orig_params=False`` (accelerate's FSDP,
    fsdp_qlora) gives the gradients to each unit's ``FlatParameter``, so the per-parameter
    post-accumulate-grad hooks that step in backward (torchtune ``optimizer_in_bwd``) never
    fire on the original parameters (torch distributed/fsdp/_flat_param.py); the formulas
    ignored the setting under Megatron and broke their own schedule under FSDP1.

    Raises:
        SpecError: ``optimizer_in_backward`` under those frameworks.
    """
    if t.optimizer_in_backward and t.framework in ("megatron", "accelerate-fsdp", "fsdp-qlora"):
        how = (
            "Megatron-LM steps its optimizer after the whole backward"
            if t.framework == "megatron"
            else f"{t.framework}'s FSDP1 (use_orig_params=False) puts the gradients on flat "
            "parameters, where a per-parameter step-in-backward hook never fires"
        )
        raise SpecError(
            "optimizer_in_backward",
            f"not available under --framework {t.framework}: {how}; allowed: "
            "--framework pytorch-amp, torchtune or fsdp2, or leave optimizer_in_backward off",
        )


def _check_torchao_gradient_offload(t: TrainingConfig) -> None:
    """torchao's ``CPUOffloadOptimizer(offload_gradients=True)`` (``offload=
    "optimizer+gradients"`` under a framework whose optimizer offload is torchao's) frees each
    offloaded gradient once its post-accumulate-grad hook has copied it to the CPU
    (``p_device.grad = None``), and its ``zero_grad`` asserts ``set_to_none`` (torchao
    optim/cpu_offload.py ``backward_hook``, ``zero_grad``): no gradient is accumulated or kept
    on the GPU between steps.

    Raises:
        SpecError: ``offload`` with gradient accumulation, ``zero_grad_set_to_none`` False.
    """
    if not (t.torchao_cpu_offload and t.offload == "optimizer+gradients"):
        return
    if t.gradient_accumulation_steps > 1:
        raise SpecError(
            "offload",
            "optimizer+gradients is torchao's CPUOffloadOptimizer(offload_gradients=True) "
            f"under {t.framework}, which frees each gradient once copied to the CPU, so "
            "it cannot accumulate (torchao optim/README.md); allowed with "
            f"gradient_accumulation_steps {t.gradient_accumulation_steps}: none, optimizer",
        )
    if not t.zero_grad_set_to_none:
        raise SpecError(
            "zero_grad_set_to_none",
            "False (gradients kept between steps) cannot be combined with offload "
            f"optimizer+gradients under {t.framework}: torchao's CPUOffloadOptimizer"
            "(offload_gradients=True) frees each gradient once copied to the CPU and its "
            "zero_grad asserts set_to_none (torchao optim/cpu_offload.py); allowed: "
            "zero_grad_set_to_none True (--zero-grad-set-to-none), or offload optimizer",
        )


def _check_ema_combinations(t: TrainingConfig) -> None:
    if not t.ema:
        return
    refusals = (
        (t.offload != "none", "offload", f"{t.offload} (model states on the CPU)"),
        (t.optimizer_in_backward, "optimizer_in_backward", "True (no optimizer step)"),
        (t.tensor_parallel_size > 1, "tensor_parallel_size", "> 1"),
        (t.pipeline_parallel_size > 1, "pipeline_parallel_size", "> 1"),
        (t.zero_stage == 3 and t.data_parallel_size > 1, "zero_stage", "3 (sharded parameters)"),
    )
    for refused, name, what in refusals:
        if refused:
            raise SpecError(
                "ema",
                f"is modelled for unsharded weights on one GPU, not with {name} {what}; "
                f"leave ema off or change {name}",
            )


def zero_stage_from(zero_stage: int, fsdp: str | None) -> int:
    """The ZeRO stage, from ``--zero-stage`` or the FSDP strategy that shards like it
    (``hybrid-shard`` shards like ``full-shard`` within its shard group).

    Raises:
        SpecError: see :func:`fsdp_settings`.
    """
    stage = fsdp_settings(zero_stage, fsdp)["zero_stage"]
    assert isinstance(stage, int)
    return stage


def trainer_sharding_framework(framework: object, zero_stage: object, fsdp: object) -> str | None:
    """The framework that shards an HF Trainer run (hf-trainer, LLaMA-Factory, axolotl:
    :data:`~trainmem.specs.frameworks.HF_TRAINER_STACKS`), or None when ``framework`` stays: the
    Trainer has no sharding of its own, it hands the model to accelerate's FSDP plugin
    (``TrainingArguments(fsdp=...)``: ``--fsdp``, ``accelerate-fsdp``) or to DeepSpeed
    (``TrainingArguments(deepspeed="ds_config.json")``: a ZeRO stage, ``deepspeed``;
    transformers trainer.py ``Trainer.__init__`` / ``create_accelerator_and_postprocess``,
    integrations/deepspeed.py ``deepspeed_init``). So ``--framework hf-trainer --zero-stage
    2`` is DeepSpeed ZeRO-2 under the Trainer, which trainmem estimates as ``--framework
    deepspeed`` (its engine's optimizer wrapper, buckets and fp32 master weights), as a
    DeepSpeed config file given to the Trainer already is (``read_deepspeed_config``).

    Args:
        framework: the framework given or defaulted.
        zero_stage: the ZeRO stage given (0: no sharding).
        fsdp: the ``--fsdp`` strategy given, or None.
    """
    if framework not in HF_TRAINER_STACKS:
        return None
    if fsdp is not None:
        return "accelerate-fsdp"
    if isinstance(zero_stage, int) and not isinstance(zero_stage, bool) and zero_stage > 0:
        return "deepspeed"
    return None


def trainer_sharding(
    settings: dict[str, Any], fsdp: object, sharding: str | None = None
) -> str | None:
    """Make ``settings`` (TrainingConfig field values) an HF Trainer stack's sharded run:
    ``framework`` the one that shards it (``sharding`` when given, a config file's FSDP or
    DeepSpeed, else :func:`trainer_sharding_framework`), with the stack's own defaults that the
    sharding framework's row lacks set where ``settings`` holds None: LLaMA-Factory's and
    axolotl's checkpointing, reentrant checkpoint and LoRA targets, axolotl's fused AdamW,
    which their YAML passes to
    ``TrainingArguments`` / peft whatever the sharding (LLaMA-Factory v0.9.5
    model_utils/checkpointing.py:166-175, examples/accelerate/fsdp_config.yaml and
    examples/deepspeed/ds_z*_config.json beside the same YAML; axolotl v0.18.0
    utils/config/__init__.py:377-383 ``{"use_reentrant": True}`` with or without
    ``fsdp_config`` / ``deepspeed``).

    Returns:
        The stack the run was (to name in a note), or None when ``settings`` is unchanged.
    """
    stack = settings["framework"]
    if sharding is None:
        sharding = trainer_sharding_framework(stack, settings.get("zero_stage"), fsdp)
    if sharding is None or stack not in HF_TRAINER_STACKS:
        return None
    row = FRAMEWORK_CONVENTIONS[stack]
    if row.trl_sft_trainer and settings.get("trl_version") is None:
        # SFTTrainer still runs under the sharding framework: its release as trl would take it
        settings["trl_version"] = ".".join(map(str, default_trl_release()))
    carried: dict[str, object] = {
        "activation_checkpointing": framework_checkpointing_default(
            row, settings.get("trl_version")
        ),
        "checkpoint_reentrant": row.default_checkpoint_reentrant,
        "lora_targets": row.default_lora_targets,
    }
    base = FRAMEWORK_CONVENTIONS["hf-trainer"]  # what the sharding rows default to as well
    for key, value in carried.items():
        if settings.get(key) is None and value != getattr(base, f"default_{key}"):
            settings[key] = value
    # axolotl's default optimizer is adamw_torch_fused on any torch (v0.18.0
    # utils/schemas/training.py:122-123), the Trainer's fused AdamW only from torch 2.8
    adamw = settings.get("optimizer") in (None, "adamw")
    if row.fused_multi_tensor_adam and adamw and settings.get("optimizer_implementation") is None:
        settings["optimizer_implementation"] = "fused"
    sharded = FRAMEWORK_CONVENTIONS[sharding]
    if sharded.accelerate_optimizer_zero_grad and settings.get("zero_grad_set_to_none") is None:
        # the Trainer's model.zero_grad() (Note [zero_grad's default by release]), not the
        # accelerate optimizer's that accelerate-fsdp's own loop calls
        try:
            torch = parse_version("torch_version", settings.get("torch_version"))
        except SpecError:  # its own check's error
            torch = None
        settings["zero_grad_set_to_none"] = row.zero_grad_set_to_none(torch)
    settings["framework"] = sharding
    return str(stack)


def fsdp_settings(zero_stage: int, fsdp: str | None) -> dict[str, int | bool | None]:
    """TrainingConfig fields an FSDP ``ShardingStrategy`` sets: ``zero_stage``,
    ``reshard_after_forward`` (False for ``shard-grad-op``) and ``shard_group_size``
    (:data:`GPUS_PER_NODE` for ``hybrid-shard``); ``{"zero_stage": zero_stage}`` without FSDP.

    Raises:
        SpecError: an unknown strategy (the message lists them), or a non-zero ``zero_stage``
            that says otherwise than the strategy (FSDP and DeepSpeed ZeRO are two ways to
            shard the same states; a run uses one).
    """
    if fsdp is None:
        return {"zero_stage": zero_stage}
    if fsdp not in FSDP_STRATEGIES:
        raise SpecError(
            "fsdp", f"unknown value {fsdp!r:.80}; allowed: {', '.join(FSDP_STRATEGIES)}"
        )
    stage = 3 if fsdp == "hybrid-shard" else FSDP_TO_ZERO[fsdp]
    # SHARD_GRAD_OP is commonly called "ZeRO-2" (DeepSpeed's and FSDP's docs compare them so)
    if zero_stage not in (0, stage) and not (fsdp == "shard-grad-op" and zero_stage == 2):
        raise SpecError(
            "fsdp",
            f"{fsdp} shards like ZeRO stage {stage} but zero_stage {zero_stage!r:.40} was also "
            "given; give one of --fsdp or --zero-stage",
        )
    if fsdp == "hybrid-shard":
        return {"zero_stage": 3, "shard_group_size": GPUS_PER_NODE}
    out: dict[str, int | bool | None] = {"zero_stage": stage}
    if fsdp == "shard-grad-op":
        out["reshard_after_forward"] = False
    return out


def apply_fsdp(settings: dict[str, Any], fsdp: str | None, given: Collection[str]) -> list[str]:
    """Make ``settings`` (TrainingConfig field values) the run of an FSDP strategy, the one
    place the CLI's ``--fsdp`` and the web page's dropdown are read: ``zero_stage`` and the
    fields :func:`fsdp_settings` implies, each unless the user gave it (``given``: a flag or,
    on the page, a widget moved off its default), where the user's value wins
    (``--fsdp hybrid-shard --shard-group-size 4``). Then :func:`trainer_sharding` makes an HF
    Trainer stack accelerate's FSDP, which the caller runs after reading its config files.

    Args:
        settings: field values, changed in place.
        fsdp: the strategy (:data:`FSDP_STRATEGIES`), or None for none.
        given: the fields the user set.

    Returns:
        The fields set from the strategy (empty without one).

    Raises:
        SpecError: as :func:`fsdp_settings` (an unknown strategy, a contradicting stage).
    """
    implied = fsdp_settings(settings["zero_stage"], fsdp)
    if fsdp is None:
        return []
    out = []
    for key, value in implied.items():
        if key == "zero_stage" or key not in given:
            settings[key] = value
            out.append(key)
    return out


_FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(TrainingConfig))
"""TrainingConfig's fields in order (``dataclasses.fields`` rebuilds the tuple on every call;
:func:`resolved_config` runs once per configuration the planner evaluates)."""


_CHECK_OF_FIELD: dict[str, Callable[[Any], None]] = {
    f.name: concern.__post_init__ for concern in CONCERNS for f in fields(concern)
}
"""The check (a concern's ``__post_init__``) that reads each field."""
_ALL_FIELDS = attrgetter(*_FIELD_NAMES)
_SLOT: dict[str, Any] = {name: TrainingConfig.__dict__[name] for name in _FIELD_NAMES}
_SLOTS: tuple[Any, ...] = tuple(_SLOT.values())


FRAMEWORK_VERSION_FIELDS = {
    "torchtune_version": "torchtune",
    "litgpt_version": "litgpt",
    "unsloth_version": "unsloth",
}
"""The release inputs that only one ``framework`` reads (its recipes, model code or kernels)."""


def check_framework_versions(t: TrainingConfig) -> None:
    """A framework's release given beside another framework changes nothing, so a user's
    setting is refused rather than silently ignored. Called where a user's settings become a
    configuration (the CLI); the planner's derived configurations (another framework tried for
    comparison) keep the field and are not checked.

    Raises:
        SpecError: naming the version field and the ``framework`` it applies to.
    """
    for field, framework in FRAMEWORK_VERSION_FIELDS.items():
        if getattr(t, field) and t.framework != framework:
            raise SpecError(
                field,
                f"{getattr(t, field)}: the {framework} release applies only with --framework "
                f"{framework} (got framework={t.framework}); allowed: --framework {framework}, "
                "or drop the version",
            )


def derived(base: TrainingConfig, /, **changes: Any) -> TrainingConfig:
    """``dataclasses.replace(base, **changes)``, with the same checks, faster: ``base`` was
    checked when it was made, so only the concerns that own a changed field check theirs (in
    :data:`CONCERNS` order), then the checks that span concerns (:func:`_check_combinations`).
    Each concern reads only its own fields (Note [Config by concern]), so the answer and the
    error are :func:`~dataclasses.replace`'s. The planner and sweeps derive one configuration
    per point they evaluate (about 4 us instead of 25 us).

    Raises:
        SpecError: as :class:`TrainingConfig`.
        TypeError: a name that is not a field (as :func:`~dataclasses.replace`).
    """
    if not changes.keys() <= _CHECK_OF_FIELD.keys():
        return replace(base, **changes)
    new = object.__new__(TrainingConfig)
    for slot, value in zip(_SLOTS, _ALL_FIELDS(base), strict=True):
        slot.__set__(new, value)
    for name, value in changes.items():
        _SLOT[name].__set__(new, value)
    _resolve_precision(new)
    checks = {_CHECK_OF_FIELD[name] for name in changes}
    for check in _CONCERN_CHECKS:
        if check in checks:
            check(new)
    _check_combinations(new)
    return new


def resolved_config(training: TrainingConfig) -> dict[str, object]:
    """Every training setting after defaults, JSON-able, plus derived dtypes and the optimizer
    implementation that was computed (the framework's default when none was given); under
    DeepSpeed the gradient accumulation dtype and the optimizer wrapper that were computed."""
    # fields hold immutable values (str, int, float, bool, tuples of str): no deep copy needed
    out: dict[str, object] = dict(zip(_FIELD_NAMES, _ALL_FIELDS(training), strict=True))
    out["weight_dtype"] = training.weight_dtype
    out["compute_dtype"] = training.compute_dtype
    out["optimizer_implementation"] = training.step_implementation
    if training.deepspeed_optimizer is not None:  # DeepSpeed's defaults, resolved
        out["grad_accum_dtype"] = training.deepspeed_grad_accum_dtype
        out["deepspeed_optimizer"] = training.deepspeed_optimizer
    return out


def pipeline_sizes(num_layers: int) -> list[int]:
    """Pipeline sizes p whose Megatron-style split leaves every stage at least one layer:
    ``ceil(L / p)`` layers on each stage but the last, which holds the rest
    (``L - (p - 1) * ceil(L / p) >= 1``).

    Args:
        num_layers: transformer blocks L.

    Returns:
        The allowed sizes, ascending (1 and L always among them).
    """
    L = num_layers
    return [p for p in range(1, L + 1) if L - (p - 1) * -(-L // p) >= 1]


def pipeline_stage_layers(num_layers: int, training: TrainingConfig) -> list[range]:
    """The transformer layers of every pipeline stage, first to last (the model chunks of an
    interleaved schedule are stages: ``p * virtual_pipeline_stages`` of them).

    Megatron's split: ``ceil(L / stages)`` layers on each stage but the last, which holds the
    rest. torchtitan's (:attr:`~trainmem.specs.frameworks.FrameworkConventions.
    torchtitan_pipeline_split`; torchtitan/parallelisms/pipelining_utils.py
    ``generate_split_points``, Dec 2024): ``L // stages`` layers on the first stage, one more
    on each of the next ``L % stages`` middle stages, the last stage the rest. Stage ``s`` runs
    on pipeline rank ``s % p`` (torchtitan ``stage_ids_this_rank``, loop style;
    :func:`pipeline_stage_ids`).

    Args:
        num_layers: transformer blocks L.
        training: ``pipeline_parallel_size``, ``pipeline_schedule``,
            ``virtual_pipeline_stages`` and the framework's conventions.

    Returns:
        One ``range`` of layer indices per stage.
    """
    L, p = num_layers, training.pipeline_parallel_size
    interleaved = training.pipeline_schedule == "interleaved-1f1b" and p > 1
    stages = p * (training.virtual_pipeline_stages if interleaved else 1)
    if not training.conventions.torchtitan_pipeline_split:
        per = -(-L // stages)
        sizes = [per] * (stages - 1) + [L - per * (stages - 1)]
    elif stages == 1:
        sizes = [L]
    else:
        base, extra = divmod(L, stages)
        sizes = [base]
        for _ in range(stages - 2):  # generate_split_points: middle stages take the extra layers
            sizes.append(base + (1 if extra > 0 else 0))
            extra -= 1
        sizes.append(L - sum(sizes))
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def pipeline_stage_ids(rank: int, training: TrainingConfig) -> list[int]:
    """The stages pipeline rank ``rank`` runs: itself, or ``rank, rank + p, ...`` for the
    interleaved schedule's ``virtual_pipeline_stages`` model chunks (torchtitan
    ``stage_ids_this_rank``, loop style; Narayanan et al. 2021, sec. 2.2).

    Args:
        rank: the pipeline rank, 0 to ``pipeline_parallel_size - 1``.
        training: ``pipeline_parallel_size``, ``pipeline_schedule``, ``virtual_pipeline_stages``.

    Returns:
        Stage indices, ascending.
    """
    p = training.pipeline_parallel_size
    v = training.virtual_pipeline_stages if training.pipeline_schedule == "interleaved-1f1b" else 1
    return [rank + k * p for k in range(v if p > 1 else 1)]


def _ranges(values: list[int]) -> str:
    """``[1, 2, 3, 5, 8, 9]`` -> ``"1-3, 5, 8-9"``."""
    out: list[str] = []
    start = prev = values[0]
    for v in values[1:] + [0]:
        if v != prev + 1:
            out.append(str(start) if start == prev else f"{start}-{prev}")
            start = v
        prev = v
    return ", ".join(out)


def check_torch_pipeline_microbatches(training: TrainingConfig) -> None:
    """The micro-batch counts ``torch.distributed.pipelining`` accepts (what the frameworks with
    ``FrameworkConventions.torchtitan_pipeline_split`` run, and the trace engine): 1F1B needs at
    least as many micro-batches as stages (``Schedule1F1B.__init__``: "Number of microbatches
    must be greater than or equal to the number of stages"); interleaved 1F1B a multiple of its
    rounds ``max(1, m // p)`` (``ScheduleInterleaved1F1B``). Source:
    torch/distributed/pipelining/schedules.py. Megatron's and DeepSpeed's schedules take fewer.

    Raises:
        SpecError: naming ``gradient_accumulation_steps`` (the micro-batch count m).
    """
    p, m = training.pipeline_parallel_size, training.gradient_accumulation_steps
    if p == 1:
        return
    if training.pipeline_schedule == "1f1b" and m < p:
        raise SpecError(
            "gradient_accumulation_steps",
            f"{m} micro-batches per step; torch's Schedule1F1B needs at least "
            f"pipeline_parallel_size={p} (torch/distributed/pipelining/schedules.py); allowed: "
            f">= {p} (--gradient-accumulation-steps {p})",
        )
    if training.pipeline_schedule == "interleaved-1f1b":
        rounds = max(1, m // p)
        if m % rounds:
            raise SpecError(
                "gradient_accumulation_steps",
                f"{m} micro-batches: torch's ScheduleInterleaved1F1B needs a multiple of the "
                f"number of rounds max(1, m // p) = {rounds}",
            )


def model_lora_linears(model: ModelSpec) -> tuple[str, ...]:
    """The layer linears of ``model`` by their :data:`LORA_TARGETS` names: peft's
    ``all-linear``, every ``nn.Linear`` (and GPT-2 ``Conv1D``) but the output head (peft
    tuners/tuners_utils.py ``_maybe_include_all_linear_layers``,
    ``INCLUDE_LINEAR_LAYERS_SHORTHAND``). ``gate`` only for a gated MLP (phi-2's ``fc1`` /
    ``fc2`` are ``up`` / ``down``); a MoE router is not modelled as a target."""
    return tuple(t for t in LORA_TARGETS if t != "gate" or model.mlp_kind == "gated")


def check_training_for_model(model: ModelSpec, training: TrainingConfig) -> None:
    """The checks that need both the model and the settings.

    - every pipeline stage holds at least one layer (:func:`pipeline_sizes`); with the
      interleaved schedule every model chunk does (``p * v <= L``); torch's pipelining
      schedules get the micro-batch counts they accept (:func:`check_torch_pipeline_microbatches`);
    - learned absolute positions (GPT-2, BERT) cannot go past ``max_position_embeddings``
      (the position embedding lookup fails: transformers ``GPT2Model.forward`` indexes
      ``wpe`` with positions up to ``seq_len - 1``); rotary / ALiBi models can, as
      long-context fine-tuning does;
    - families without SDPA attention in transformers (BLOOM, Gemma-2) run with
      ``attention="eager"``;
    - LoRA targets exist in the model (``gate`` only in gated MLPs, ``lm_head`` only under an
      LM head);
    - no Adafactor over DTensor-sharded matrices (:func:`_check_adafactor_on_dtensors`; here,
      not in :class:`TrainingConfig`, which the engines also build internally with another
      framework for the adapters' dtypes).

    Args:
        model: the model's shape.
        training: the settings.

    Raises:
        SpecError: the first check that fails, naming the field and the allowed values.
    """
    _check_adafactor_on_dtensors(training)
    L, p = model.num_layers, training.pipeline_parallel_size
    if training.conventions.torchtitan_pipeline_split:  # torch.distributed.pipelining's schedules
        check_torch_pipeline_microbatches(training)
    if p > 1 and L - (p - 1) * -(-L // p) < 1:
        raise SpecError(
            "pipeline_parallel_size",
            f"{p} stages leave the last stage no layer of {model.name}'s {L} (ceil(L / p) = "
            f"{-(-L // p)} layers per stage); allowed: {_ranges(pipeline_sizes(L))}",
        )
    if p > 1 and training.pipeline_schedule == "interleaved-1f1b":
        v = training.virtual_pipeline_stages
        if p * v > L:
            raise SpecError(
                "virtual_pipeline_stages",
                f"{p} stages x {v} chunks need at least {p * v} layers, {model.name} has {L}",
            )
    if model.eager_only and training.attention != "eager":
        raise SpecError(
            "attention",
            f"{training.attention!r} is not available for {model.model_type} (its attention "
            "code has no SDPA path, so none of its kernels); allowed: eager (--attention eager)",
        )
    if (
        training.attention == "sdpa"
        and training.conventions.hf_model_code
        and not model.has_sdpa(training.transformers_release)
    ):
        raise SpecError(
            "attention",
            f"'sdpa' is not available for {model.model_type} in transformers "
            f"{training.transformers_version} (its model class has no SDPA attention before "
            f"{'.'.join(map(str, SDPA_SINCE[model.model_type]))}: ModelSpec.has_sdpa); allowed: "
            "eager (--attention eager), flash",
        )
    if (training.loss is not None or training.training_loop == "step") and (
        model.head != "causal-lm"
    ):
        field = "loss" if training.loss is not None else "keep_logits"
        field = "loop" if field == "keep_logits" and not training.keep_logits else field
        raise SpecError(
            field,
            f"is a causal-LM setting (a loss on the logits); {model.name} has head {model.head!r}",
        )
    if training.cut_cross_entropy and model.head != "causal-lm":
        # Note [axolotl's Cut Cross Entropy]: it patches a ``ForCausalLM.forward``
        raise SpecError(
            "cut_cross_entropy",
            f"Cut Cross Entropy replaces a causal LM's head and loss; {model.name} has head "
            f"{model.head!r}: leave it false",
        )
    if training.chunked_cross_entropy and model.architecture == "vision-encoder":
        # accepted and dropped: the formulas chunk only token logits (analytic/loss.py)
        raise SpecError(
            "chunked_cross_entropy",
            f"{training.chunked_cross_entropy}: a chunked cross-entropy splits a language "
            f"model's token logits; {model.name} is a vision encoder (head {model.head!r}, one "
            "loss per image): leave it 0",
        )
    size = training.image_size
    if model.architecture == "vision-encoder" and size is not None and model.patch_size:
        p = model.patch_size
        if min(size) < p:  # Conv2d(kernel=p, stride=p) makes no patch of a smaller side
            raise SpecError(
                "resolution",
                f"{size[0]}x{size[1]} px is smaller than {model.name}'s {p}-pixel patch on a "
                f"side, so its patch convolution makes no patch; allowed: at least {p} px a side",
            )
    positions = model.max_position_embeddings
    if (
        model.position_kind == "learned"
        and model.architecture != "vision-encoder"
        and training.seq_len > positions
    ):
        raise SpecError(
            "seq_len",
            f"{training.seq_len} is longer than {model.name}'s {positions} learned positions "
            f"(max_position_embeddings); allowed: 1-{positions}",
        )
    if model.rotary_buffer and training.seq_len > positions:
        raise SpecError(
            "seq_len",
            f"{training.seq_len} is longer than {model.name}'s RoPE buffer of {positions} "
            "positions (context_length: the course's RotaryEmbedding precomputes cos/sin for "
            f"that many); allowed: 1-{positions}, or a config with a larger context_length",
        )
    if training.is_lora:
        available = list(model_lora_linears(model))
        if model.head in ("causal-lm", "masked-lm"):
            available.append("lm_head")
        framework_default = (
            training.lora_targets == training.conventions.default_lora_targets
            and training.lora_targets != PEFT_DEFAULT_LORA_TARGETS
        )
        for target in training.lora_targets:
            if target not in available:
                why = (
                    f" (--framework {training.framework}'s default targets; --lora-targets "
                    "all-linear for the model's own)"
                    if framework_default
                    else ""
                )
                raise SpecError(
                    "lora_targets",
                    f"{model.name} has no {target!r} linear{why}; allowed: {', '.join(available)}",
                )
