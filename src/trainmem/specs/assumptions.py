"""What an estimate assumed that the user may not have said: the framework's conventions and
the library versions whose defaults changed between releases.

The JSON carries it as ``details["assumed"]`` and the CLI prints it on one line, so a user can
see which training stack the number is for (issue: "one flag halves the answer silently").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainmem.specs.frameworks import (
    DEFAULT_BITSANDBYTES_VERSION,
    DEFAULT_DEEPSPEED_VERSION,
    DEFAULT_LITGPT_VERSION,
    DEFAULT_PRECISION,
    DEFAULT_TORCH_VERSION,
    DEFAULT_TORCHAO_VERSION,
    DEFAULT_TORCHTITAN_VERSION,
    DEFAULT_TORCHTUNE_VERSION,
    DEFAULT_TRANSFORMERS_VERSION,
    DEFAULT_TRL_VERSION,
    DEFAULT_UNSLOTH_VERSION,
    DEFAULT_UNSLOTH_ZOO_VERSION,
    FRAMEWORK_CONVENTIONS,
    PEFT_DEFAULT_LORA_TARGETS,
    installed_transformers_version,
    installed_version,
)
from trainmem.specs.sample_lengths import LongSamples, describe_lengths, sampled_seq_lens
from trainmem.specs.training import CHATGLM_QUANTIZE

NOT_BITSANDBYTES: tuple[str, ...] = ("none", "gptq-int4", *CHATGLM_QUANTIZE)
"""``quantize_base`` values whose weights bitsandbytes does not hold: none, GPTQ (its own
kernels' packed ``qweight``), ChatGLM's own ``quantize`` (its remote code's quantization.py,
Note [ChatGLM's quantize]); the assumed bitsandbytes release is named only beside its
quantized bases or 8-bit optimizers."""

FRAMEWORK_SUMMARY: dict[str, str] = {
    "pytorch-amp": "a plain PyTorch loop: autocast on fp32 weights, fp32 gradients, torch.optim",
    "hf-trainer": "the transformers Trainer: accelerate's native AMP, its optimizer defaults",
    "trl": (
        "TRL's SFTTrainer on the transformers Trainer: its QLoRA preparation and "
        "checkpointing defaults by release"
    ),
    "llama-factory": (
        "LLaMA-Factory 0.9.5's YAML defaults on the HF Trainer: reentrant gradient "
        "checkpointing on, LoRA on every linear"
    ),
    "axolotl": (
        "axolotl 0.18.0 on the HF Trainer: adamw_torch_fused, reentrant checkpointing when on"
    ),
    "accelerate-fsdp": "accelerate's FSDP: MixedPrecision(param_dtype=the 16-bit dtype)",
    "deepspeed": "the DeepSpeed engine: 16-bit weights and gradients, fp32 master in the optimizer",
    "megatron": "Megatron-LM: fp32 grad buffer from init, fp32 master, vocab-parallel loss",
    "fsdp2": "torchtitan: FSDP2 with bf16 all-gathers, DTensor tensor/sequence parallelism",
    "torchtune": "torchtune recipes: torchtune's model code, weights in the training dtype",
    "litgpt": "lit-gpt with Lightning Fabric: its own model code and output head, fp32 outputs",
    "fsdp-qlora": "Answer.AI fsdp_qlora: bitsandbytes 4-bit linears under FSDP1, peft adapters",
    "unsloth": (
        "Unsloth on one GPU: bf16 model, fp32 LoRA on all seven linears, CPU-offloaded "
        "checkpoints, fused loss, adamw-8bit, expandable segments"
    ),
}
"""One line per ``--framework`` on what its conventions mean for memory (the rows and their
sources are in :mod:`trainmem.specs.frameworks`)."""

PYTORCH_TRUE_SUMMARY = "a plain PyTorch loop: the whole model in {dtype}, no autocast, torch.optim"
"""The plain loop's line under a ``*-true`` precision (``model.to(dtype)``: weights, gradients
and activations in that dtype), where :data:`FRAMEWORK_SUMMARY`'s autocast line does not hold."""

LOADED_16BIT_SUMMARY = (
    "autocast over a model loaded in {dtype} (--load-dtype): {dtype} weights, gradients and "
    "AdamW states, peft's LoRA adapters {adapters}, autocast's fp32 ops (LayerNorm, softmax, pow)"
)
"""The line of an autocasting framework over a model loaded in 16 bits
(``TrainingConfig.autocast_over_loaded_16bit``), where its fp32-weights line does not hold."""

LOADED_16BIT_QUANTIZED_SUMMARY = (
    "autocast over a quantized base whose embeddings, norms and LM head stay {dtype} as loaded "
    "(--load-dtype){casts}"
)
"""The same line over a quantized base kept as loaded (``TrainingConfig.kbit_16bit_dense``;
Note [A quantized base's other weights in another 16-bit dtype])."""


def framework_means(framework: str, precision: Any) -> str:
    """:data:`FRAMEWORK_SUMMARY`'s line for ``framework``; the plain loop's under a
    ``*-true`` precision is :data:`PYTORCH_TRUE_SUMMARY` (``"bf16-true"`` -> bf16)."""
    if framework == "pytorch-amp" and str(precision).endswith("-true"):
        dtype = {"32": "fp32", "16": "fp16"}.get(str(precision)[:-5], str(precision)[:-5])
        return PYTORCH_TRUE_SUMMARY.format(dtype=dtype)
    return FRAMEWORK_SUMMARY.get(framework, "")


def _version(value: Any, default: tuple[int, ...]) -> str:
    return str(value) if value else ".".join(map(str, default)) + " (default)"


def _transformers(value: Any) -> str:
    """The transformers release: as given, else the installed one, else the pinned default
    (``TrainingConfig.transformers_release``)."""
    if value:
        return str(value)
    installed = installed_transformers_version()
    if installed is not None:
        return ".".join(map(str, installed)) + " (installed)"
    return ".".join(map(str, DEFAULT_TRANSFORMERS_VERSION)) + " (default)"


def _trl(config: Mapping[str, Any], framework: str) -> str | None:
    """The TRL release whose SFTTrainer runs (``TrainingConfig.trl_release``): as given, else
    under ``--framework trl`` the installed one, else the newest modelled; None where no
    SFTTrainer runs."""
    if config.get("trl_version"):
        return str(config["trl_version"])
    row = FRAMEWORK_CONVENTIONS.get(framework)
    if row is None or not row.trl_sft_trainer:
        return None
    installed = installed_version("trl")
    if installed is not None:
        return ".".join(map(str, installed)) + " (installed)"
    newest = ".".join(map(str, DEFAULT_TRL_VERSION))
    return f"{newest} (default: none installed, the newest modelled)"


def loop_of(config: Mapping[str, Any]) -> str:
    """The training loop the estimate assumes, in words, from the loop settings in ``config``
    (``loop``, else ``keep_logits`` and the framework's loop, as
    ``TrainingConfig.training_loop``; ``zero_grad_set_to_none``, ``zero_grad_before_backward``,
    ``gradient_accumulation_steps``, ``optimizer_in_backward``)."""
    steps = int(config.get("gradient_accumulation_steps") or 1)
    framework = FRAMEWORK_CONVENTIONS.get(str(config.get("framework") or "pytorch-amp"))
    loop = config.get("loop") or (
        "step" if config.get("keep_logits") else (framework.loop if framework else "drop")
    )
    if loop == "step" and steps > 1 and not config.get("loop"):
        loop = "drop"  # a framework's step loop over more micro-batches (training_loop)
    held = {
        "step": "logits held to the end of the step",
        "previous": "the previous micro-batch's logits and graph held through the next "
        "forward (loop previous)",
    }
    parts = [
        f"{steps} micro-batches per step" if steps > 1 else "one micro-batch per step",
        held.get(str(loop), "the step's outputs dropped after the loss"),
    ]
    if config.get("optimizer_in_backward"):
        parts.append("optimizer stepped in backward")
    elif config.get("zero_grad_set_to_none", True) is False:
        parts.append("zero_grad() keeps the gradients allocated")
    elif config.get("zero_grad_before_backward"):
        parts.append("zero_grad() between the loss and backward()")
    else:
        parts.append("zero_grad(set_to_none=True) after the step")
    return ", ".join(parts)


def framework_precision(config: Mapping[str, Any]) -> str:
    """The precision in words when it is the framework's own default rather than
    :data:`~trainmem.specs.frameworks.DEFAULT_PRECISION` (torchtune: ``"bf16-true
    (torchtune's default: ...)"``), else ``""``: the estimate's precision is not the one
    other frameworks would assume, so the assumption line names it."""
    framework = str(config.get("framework") or "pytorch-amp")
    row = FRAMEWORK_CONVENTIONS.get(framework)
    if row is None or row.default_precision == DEFAULT_PRECISION or row.precisions is None:
        return ""
    precision = config.get("precision")
    if precision != row.default_precision:
        return ""
    return (
        f"{precision} ({framework}'s default: the whole model in one dtype, no autocast; "
        f"it trains in {' or '.join(row.precisions)})"
    )


def framework_lora_targets(config: Mapping[str, Any]) -> str:
    """The LoRA targets in words when they are the framework's own default rather than peft's
    q, v (:data:`~trainmem.specs.frameworks.PEFT_DEFAULT_LORA_TARGETS`; Unsloth: ``"q,k,v,o,
    gate,up,down (unsloth's default: ...)"``), else ``""``: only under LoRA
    (``lora_rank > 0``), and, as :func:`framework_precision`, whenever the targets equal that
    default, given or not."""
    framework = str(config.get("framework") or "pytorch-amp")
    row = FRAMEWORK_CONVENTIONS.get(framework)
    if row is None or row.default_lora_targets == PEFT_DEFAULT_LORA_TARGETS:
        return ""
    targets = tuple(config.get("lora_targets") or ())
    if not int(config.get("lora_rank") or 0) or targets != row.default_lora_targets:
        return ""
    return f"{','.join(targets)} ({framework}'s default; --lora-targets q,v for peft's)"


def assumptions(config: Mapping[str, Any], library: str = "transformers") -> dict[str, str]:
    """The framework and library versions an estimate's resolved ``config`` stands for.

    Args:
        config: ``MemoryEstimate.config`` (every resolved setting).
        library: what built the model: ``"transformers"`` (the formula families and the HF
            configs), ``"diffusers"`` or ``"timm"`` (the generic path); for the last two the
            installed release of that library is reported instead of transformers', whose
            version setting does not apply to them.

    Returns:
        ``{"framework", "framework_means", "loop", "torch", "transformers", "bitsandbytes",
        "torchao", "deepspeed", "torchtitan", "accelerate"}`` as text (``loop``:
        :func:`loop_of`; bitsandbytes beside its quantized bases and 8-bit optimizers,
        accelerate where the loop calls its optimizer's zero_grad), and
        ``"litgpt_sharding"`` for litgpt on more than one rank (:data:`LITGPT_SHARDING`),
        ``"precision"`` where it is the framework's own default (:func:`framework_precision`:
        torchtune's ``bf16-true``), ``"lora_targets"`` likewise (:func:`framework_lora_targets`:
        Unsloth's seven linears), ``"lengths"`` for a language model without
        ``earlier_seq_lens`` (:data:`FIXED_LENGTH`); a version
        the user did not give reads ``"2.8 (default)"`` (transformers: ``"5.24.0 (installed)"``
        when installed; TRL, where its SFTTrainer runs, likewise, else ``"1.16.0 (default:
        none installed, the newest modelled)"``).
    """
    framework = str(config.get("framework") or "pytorch-amp")
    out = {
        "framework": framework,
        "framework_means": framework_means(framework, config.get("precision")),
        "loop": loop_of(config),
        "torch": _version(config.get("torch_version"), DEFAULT_TORCH_VERSION),
    }
    load_dtype = config.get("load_dtype")
    if load_dtype not in (None, "float32"):  # accepted only under autocast (training.py)
        # diffusers' add_adapter: the base's dtype, fp32 for fp16 (Note [diffusers' adapters
        # take the base dtype]); PeftModel's autocast_adapter_dtype elsewhere: fp32
        adapters = load_dtype if library == "diffusers" and load_dtype != "float16" else "fp32"
        if config.get("lora_adapter_dtype"):  # given: it wins (diffusers' cast_training_params)
            adapters = f"{config['lora_adapter_dtype']} (--lora-adapter-dtype)"
        out["framework_means"] = LOADED_16BIT_SUMMARY.format(dtype=load_dtype, adapters=adapters)
        if config.get("quantize_base") not in (None, "none"):
            compute = config.get("compute_dtype")
            casts = (
                ""
                if compute in (None, load_dtype)
                else (f": autocast casts the head weight and each linear's input to {compute}")
            )
            out["framework_means"] = LOADED_16BIT_QUANTIZED_SUMMARY.format(
                dtype=load_dtype, casts=casts
            )
    casting = config.get("layerwise_casting")
    if casting not in (None, "none"):  # Note [diffusers' layerwise casting]
        out["framework_means"] += (
            f"; the frozen layers stored in {casting}, each cast for its forward "
            "(--layerwise-casting; norms, pos_embed / patch_embed, proj_in / proj_out and the "
            "adapters kept)"
        )
    precision = framework_precision(config)
    if precision:
        out["precision"] = precision
    targets = framework_lora_targets(config)
    if targets:
        out["lora_targets"] = targets
    if library == "transformers":
        out["transformers"] = _transformers(config.get("transformers_version"))
        if config.get("earlier_seq_lens"):
            pass  # the user's own lengths (the config holds them)
        elif config.get("sample_lengths"):  # Note [Lengths from a dataset's statistics]
            text = str(config["sample_lengths"])
            long_samples: LongSamples = (
                "delete" if config.get("long_samples") == "delete" else "truncate"
            )
            seq_len = int(config.get("seq_len") or 1)
            b = int(config.get("micro_batch_size") or 1)
            lengths = sampled_seq_lens(text, seq_len, b, long_samples)
            out["lengths"] = describe_lengths(text, lengths, long_samples, seq_len, b)
        else:
            out["lengths"] = FIXED_LENGTH
    else:
        installed = installed_version(library)
        out[library] = ".".join(map(str, installed)) + " (installed)" if installed else "?"
    quantize = config.get("quantize_base") or "none"
    if quantize not in NOT_BITSANDBYTES or "8bit" in str(config.get("optimizer")):
        out["bitsandbytes"] = _version(
            config.get("bitsandbytes_version"), DEFAULT_BITSANDBYTES_VERSION
        )
    if framework == "torchtune" and config.get("quantize_base", "none") != "none":
        # torchtune's QLoRA quantizes with torchao's NF4Tensor (its load phase depends on it)
        out["torchao"] = _version(config.get("torchao_version"), DEFAULT_TORCHAO_VERSION)
    if framework == "torchtune":
        # before 0.3 its recipes' loss takes the shifted logits transposed (recipe_loss)
        out["torchtune"] = _version(config.get("torchtune_version"), DEFAULT_TORCHTUNE_VERSION)
    if framework == "litgpt":
        # from 0.4.6 its RMSNorm multiplies the weight in fp32 (norms.norm_options)
        out["litgpt"] = _version(config.get("litgpt_version"), DEFAULT_LITGPT_VERSION)
        if int(config.get("data_parallel_size") or 1) > 1:
            out["litgpt_sharding"] = LITGPT_SHARDING
    if framework == "unsloth":
        given = config.get("unsloth_version")
        out["unsloth"] = _version(given, DEFAULT_UNSLOTH_VERSION)
        if not given:  # the unsloth_zoo read with the default release
            zoo = ".".join(map(str, DEFAULT_UNSLOTH_ZOO_VERSION))
            out["unsloth"] = out["unsloth"].replace("(default)", f"(default; unsloth_zoo {zoo})")
    row = FRAMEWORK_CONVENTIONS.get(framework)
    if row is not None and row.accelerate_optimizer_zero_grad:
        # its loop calls accelerate's optimizer's zero_grad(), which keeps the gradients
        # before 0.28 (Note [zero_grad's default by release])
        given = config.get("accelerate_version")
        out["accelerate"] = str(given) if given else "a current release (default)"
    if framework == "deepspeed":
        out["deepspeed"] = _version(config.get("deepspeed_version"), DEFAULT_DEEPSPEED_VERSION)
    trl = _trl(config, framework)
    if trl is not None:  # TRL's SFTTrainer: its QLoRA preparation, checkpointing defaults
        out["trl"] = trl
    if framework == "fsdp2" and config.get("compile"):
        # torchtitan compiles its loss from 0.1 (Note [torchtitan's compiled cross-entropy])
        out["torchtitan"] = _version(config.get("torchtitan_version"), DEFAULT_TORCHTITAN_VERSION)
    return out


LITGPT_SHARDING = (
    "FSDP1 with one unit per Block (finetune/full.py, adapter*.py, and lora.py through 0.5.7); "
    "from 0.5.8 lora.py wraps each Linear and from 0.5.11 shards with FSDP2 "
    "(ModelParallelStrategy): modelled only as no gradient of the frozen weights; every Block "
    "checkpointed unless told"
)
"""How litgpt's sharded fine-tuning is modelled (``assumptions()["litgpt_sharding"]``; litgpt
0.5.13 finetune/full.py and lora.py, 281510ab, 5ac69b06)."""


FIXED_LENGTH = (
    "every micro-batch at the sequence length (padded or packed to it); batches padded "
    "to their own longest sample reserve more, as the caching allocator splits and keeps "
    "blocks of every size it met: --sample-lengths (a dataset's lengths) or --earlier-seq-lens "
    "replays such steps first"
)
"""What a language model's estimate assumes of its steps' lengths (``assumptions()
["lengths"]``, without ``earlier_seq_lens``): one fixed shape, whose replay the caching
allocator's reserved bytes come from (Note [Steps of varying length]). Published runs over
unpacked data measure more reserved memory (session 25's ms-swift probe:
benchmarks/published_probe_swift.py, every cell under at fixed length)."""


LOAD_OFF_HINT = "--set load-phase=false for none"
"""How the ``load`` assumption says it is turned off (``TrainingConfig.load_phase``)."""


_NOT_VERSIONS = (
    "framework",
    "framework_means",
    "loop",
    "load",
    "precision",
    "lora_targets",
    "load_dtype",
    "litgpt_sharding",
    "lengths",
)
"""The keys of :func:`assumptions`' result that are not library versions."""


def versions_text(assumed: Mapping[str, str]) -> str:
    """The library versions of :func:`assumptions`' result: ``"torch 2.8 (default), ..."``,
    then litgpt's sharding (``"litgpt_sharding"``), then the load phase assumed (``"load"``,
    set by the driver), if any."""
    text = ", ".join(f"{k} {v}" for k, v in assumed.items() if k not in _NOT_VERSIONS)
    if assumed.get("litgpt_sharding"):
        text += f"; litgpt's sharding: {assumed['litgpt_sharding']}"
    if assumed.get("load"):
        text += f"; load phase: {assumed['load']} ({LOAD_OFF_HINT})"
    return text


def assumptions_line(a: Mapping[str, str]) -> str:
    """:func:`assumptions`' result (``MemoryEstimate.details["assumed"]``, with the driver's
    ``"load"`` rule if any) on one line, for the CLI."""
    return (
        f"assumed: --framework {a['framework']} ({a['framework_means']}); "
        f"{precision_text(a)}loop: {a['loop']}; {versions_text(a)}"
        + (f"; lengths: {a['lengths']}" if a.get("lengths") else "")
    )


def precision_text(assumed: Mapping[str, str]) -> str:
    """``"precision: bf16-true (torchtune's default: ...); "`` when :func:`assumptions` names
    the framework's own default precision, else ``""``; then ``"LoRA targets: ...; "`` when it
    names the framework's own default targets (Unsloth's seven linears); then ``"load dtype:
    ...; "`` when the driver assumed the framework's (``"load_dtype"``)."""
    text = f"precision: {assumed['precision']}; " if assumed.get("precision") else ""
    if assumed.get("lora_targets"):
        text += f"LoRA targets: {assumed['lora_targets']}; "
    if assumed.get("load_dtype"):  # the driver's (trainmem.specs.load_dtype)
        text += f"load dtype: {assumed['load_dtype']}; "
    return text
