"""The dtype a framework loads the model in when ``load_dtype`` is not given.

``load_dtype`` (:class:`~trainmem.specs.training.TrainingConfig`) is the dtype
``from_pretrained`` puts the weights in; under a ``*-mixed`` precision whose loop autocasts, a
16-bit load means 16-bit weights, gradients and AdamW states
(``TrainingConfig.autocast_over_loaded_16bit``). Which dtype that is, when the user gives
none, is each framework's and each release's (Note [The framework's load dtype]):

- transformers' ``from_pretrained`` without a dtype: ``torch.get_default_dtype()`` (float32)
  before 5.0 (4.57.6 modeling_utils.py ``_get_dtype``: ``dtype`` None -> the default dtype),
  ``dtype="auto"`` from 5.0 (5.0.0 modeling_utils.py ``from_pretrained``: ``if dtype is None:
  dtype = "auto"``; ``_get_dtype``: ``config.dtype``, the config's ``torch_dtype``). A plain HF
  Trainer script (``--framework hf-trainer``) loads so.
- TRL's ``SFTTrainer(model="<name>")`` (``--framework trl``) loads through
  trl/trainer/utils.py ``create_model_from_path``: before 0.27 it passes no dtype unless
  ``model_init_kwargs`` has one (v0.25.1 ``kwargs.get("dtype")``; v0.26.0-v0.26.2
  ``kwargs.get("dtype", "auto")`` only reads, ``"auto"`` is not written back), so
  transformers' default above; from 0.27 ``kwargs.get("dtype", "float32")`` writes
  ``torch.float32`` (v0.27.0 .. v1.9.0; 1.9.0's SFTTrainer docstring: "it defaults to
  `float32`. This differs from from_pretrained, where (since Transformers v5) the dtype is
  inferred from the model config"). Run for real: benchmarks/load_dtype_by_release.py.
- LLaMA-Factory v0.9.5 loads ``torch_dtype="auto"`` (src/llamafactory/model/loader.py:155;
  v0.8.3 .. v0.9.3 loaded the compute dtype, the same for a 16-bit checkpoint under bf16 /
  fp16), then upcasts every trainable parameter to float32 unless ``pure_bf16``
  (model/adapter.py:313-325, 286-288): LoRA trains fp32 adapters over the checkpoint's
  dtype, full fine-tuning fp32 weights.
- axolotl v0.18.0 loads in its ``torch_dtype`` (the ``bf16`` / ``fp16`` flag's, not the
  checkpoint's): a LoRA base wholly in it, a full fine-tune's norms, embeddings and head in
  float32 beside it (a mixed load, modelled as float32); :func:`_axolotl`.

Qwen-1's remote code (``model_type`` qwen) casts itself at init, whatever dtype
``from_pretrained`` was given: :func:`qwen_init_dtype`, read before transformers' rule for the
HF Trainer and TRL before 0.27.

A 16-bit default is applied only where trainmem models the load
(``TrainingConfig._check_load_dtype``: autocast in that dtype, no quantized base, no ZeRO /
FSDP, no model parallelism); elsewhere the step is the float32 one and
``details["assumed"]["load_dtype"]`` says why: DeepSpeed casts the parameters to its 16-bit
dtype and keeps fp32 masters whatever was loaded (v0.19.5 runtime/engine.py
``_configure_distributed_model``), accelerate's FSDP upcasts low-precision parameters to
float32 under mixed precision (accelerate 0.30.0, accelerator.py ``prepare_model``: "FSDP
upcast of low precision parameters"), a quantized base's other weights take the
quantization's dtype: transformers 4 forces float16 on it (Note [transformers 4 loads a quantized
base in float16]), which stays where ``kbit_16bit_dense`` and peft's fp32 upcast replaces.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from trainmem.errors import SpecError
from trainmem.specs.diffusers import is_diffusers_config
from trainmem.specs.frameworks import parse_version
from trainmem.specs.hardware import GPUSpec
from trainmem.specs.training import TrainingConfig

TRANSFORMERS_AUTO_DTYPE_SINCE = (5, 0)
"""transformers' ``from_pretrained`` defaults to ``dtype="auto"`` (the config's dtype) from
5.0.0 (modeling_utils.py ``from_pretrained``: ``if dtype is None: dtype = "auto"``); before,
``torch.get_default_dtype()`` (4.57.6 ``_get_dtype``)."""
TRL_MODEL_INIT_FLOAT32_SINCE = (0, 27)
"""TRL's ``SFTTrainer`` loads a model name in float32 unless ``model_init_kwargs`` gives a
dtype from 0.27.0 (trl/trainer/utils.py ``create_model_from_path``: ``kwargs.get("dtype",
"float32")`` then ``kwargs["dtype"] = torch.float32``); before, no dtype reaches
``from_pretrained`` (v0.26.2 ``kwargs.get("dtype", "auto")`` leaves ``kwargs`` as it is; a real
CPU run of 0.26.2 on transformers 4.57.6 loads float32, benchmarks/load_dtype_by_release.py)."""

BUILT_IN_CONFIG_DTYPE = frozenset({"chatglm"})
"""Remote-code families whose modeling file creates every module in ``config.torch_dtype``:
THUDM/chatglm3-6b and glm-4-9b-chat modeling_chatglm.py ``_config_to_kwargs`` (``{"dtype":
args.torch_dtype}``) passed to every ``nn.Linear``, the word embedding and the norms. Before
transformers :data:`CONFIG_DTYPE_OVERWRITTEN_SINCE`, ``from_pretrained`` without a dtype leaves
the config's ``torch_dtype`` as config.json says, so the model is built in it; THUDM's own
LoRA figure agrees (ChatGLM3-6B, float16 config, no dtype given, no autocast: 14,082 MiB,
under its fp32 weights alone, 23.3 GiB; THUDM/ChatGLM3 finetune_demo/README.md @9484f82,
benchmarks/published_probe_glm.py)."""

CONFIG_DTYPE_OVERWRITTEN_SINCE = (4, 49)
"""From transformers 4.49 to 5.0, ``from_pretrained`` without a dtype writes torch's default
dtype into the config before building the model (4.49.0 modeling_utils.py ``from_pretrained``:
``config.torch_dtype = default_dtype``, the string "float32" in 4.49.0, ``torch.float32`` from
4.50), so a :data:`BUILT_IN_CONFIG_DTYPE` model is float32 there; 5.0's ``dtype="auto"`` gives
the config's dtype again. Run on CPU (benchmarks/load_dtype_by_release.py's ``chatglm-like``
cell: a model that builds a Linear with ``dtype=config.torch_dtype``, saved with
``torch_dtype`` float16, loaded with no dtype): float16 on 4.30.2, 4.37.1, 4.48.1 and 5.24.0;
"float32" on 4.49.0; float32 on 4.50.0, 4.50.3, 4.51.3, 4.54.1, 4.56.2, 4.57.6."""

QUANTIZED_LOAD_FP16_SOURCE = (
    "modeling_utils.py from_pretrained to 4.36, quantizers' update_torch_dtype 4.40 .. 4.57"
)
"""Where transformers 4.x forces float16 on a quantized model given no dtype.

Note [transformers 4 loads a quantized base in float16]
    Given no ``torch_dtype``, transformers 4.x sets ``torch_dtype = torch.float16`` for a
    bitsandbytes model ("We force the `dtype` to be float16, this is a requirement from
    `bitsandbytes`", 4.30.2 and 4.36.2 modeling_utils.py ``from_pretrained``; from the
    quantizer refactor 4.40.0 .. 4.57.6 quantizers/quantizer_bnb_4bit.py and
    quantizer_bnb_8bit.py ``update_torch_dtype``) and for a GPTQ model (4.36.2
    ``if torch_dtype is None: torch_dtype = torch.float16``; quantizer_gptq.py from 4.40), so
    the unquantized weights (embeddings, norms, LM head) are float16 whatever the checkpoint's
    dtype. 4.22.0 (the first with ``load_in_8bit``) forced float16 even over a given dtype
    (``if torch_dtype == "auto" or torch_dtype != torch.float16``); not modelled, a given
    ``load_dtype`` wins. From 5.0 the bitsandbytes quantizers no longer set a dtype and
    ``from_pretrained``'s ``dtype="auto"`` gives the config's
    (:data:`TRANSFORMERS_AUTO_DTYPE_SINCE`; 5.0.0 quantizer_gptq.py ``update_dtype`` only
    suggests float16). Where peft's ``prepare_model_for_kbit_training`` runs
    (``TrainingConfig.kbit_fp32_upcast``) those weights are then cast to float32 and the load
    dtype is gone; where they stay as loaded (``TrainingConfig.kbit_16bit_dense``) it is
    ``TrainingConfig.kbit_dense_dtype``: float16 under ``16-mixed`` the compute dtype, under
    ``bf16-mixed`` an fp16 stream beside bf16 matmuls (Note [A quantized base's other weights
    in another 16-bit dtype]), modelled with ``--attention flash`` by both engines."""

QWEN_INIT_CAST_SOURCE = (
    "Qwen/Qwen-7B modeling_qwen.py QWenLMHeadModel.__init__ (the Hub repo's copy "
    "zhangningboo/Qwen-7B @ffe04dd5, l. 935-988)"
)
"""Qwen-1's remote code sets its precision at init: with none of the config's ``bf16`` /
``fp16`` / ``fp32`` true (``autoset_precision``) it sets ``bf16`` where ``SUPPORT_BF16``
(``torch.cuda.is_bf16_supported()``), else ``fp16`` where ``SUPPORT_FP16`` (compute capability
major >= 7), else ``fp32``; then ``self.transformer.bfloat16()`` / ``.half()`` and the same for
``lm_head``. The weights loaded afterwards take the parameters' dtype, so the model is in that
dtype whatever ``from_pretrained`` was given (the Qwen README's finetune.py passes none).
Every Qwen-1 size (1.8B .. 72B) ships the same file; config.json has the three flags false."""

TORCH_BF16_EMULATION_SINCE = (2, 3)
"""``torch.cuda.is_bf16_supported()`` is True on any CUDA device that can hold a bf16 tensor
from torch 2.3 (pytorch PR #115924, merged 2024-01-01 after the 2.2 branch cut: "Try creating
a bf16 tensor as a last resort"; ``including_emulation=True`` by default later); before, compute
capability >= 8.0 only (a V100 gives False on torch 2.2.2, pytorch issue #124996). ROCm: True
(``if torch.version.hip: return True``, pytorch PR #80410, from 1.13)."""

LOADS_FROM_PRETRAINED = ("hf-trainer", "trl", "llama-factory", "axolotl")
"""The frameworks whose default load :func:`framework_load_dtype` reads (the others: None)."""

_LLAMA_FACTORY = "LLaMA-Factory v0.9.5"


@dataclass(frozen=True)
class LoadDtype:
    """The dtype ``from_pretrained`` loads the weights in and the source that says so."""

    dtype: str
    """torch spelling: ``float32``, ``bfloat16``, ``float16``."""
    why: str
    """The framework's rule, with its release and file."""


def qwen_init_dtype(t: TrainingConfig, config: Mapping[str, Any] | None, gpu: GPUSpec) -> LoadDtype:
    """The dtype Qwen-1's ``QWenLMHeadModel.__init__`` casts the model to on ``gpu``
    (:data:`QWEN_INIT_CAST_SOURCE`): the config's ``bf16`` / ``fp16`` / ``fp32`` flag when one
    is true, else bf16 where torch says the GPU supports it (compute capability >= 8.0, any
    CUDA device from torch :data:`TORCH_BF16_EMULATION_SINCE`, ROCm), else float16 from
    compute capability 7.0, else float32.

    Raises:
        SpecError: more than one of the flags true (the remote code's assert).
    """
    flags = [f for f in ("bf16", "fp16", "fp32") if config is not None and config.get(f) is True]
    if len(flags) > 1:
        raise SpecError(
            "bf16 / fp16 / fp32",
            f"Qwen's config sets {' and '.join(flags)}; only one may be true (modeling_qwen.py)",
        )
    named = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
    if flags:
        return LoadDtype(
            named[flags[0]],
            f"Qwen-1's config sets {flags[0]}, so {QWEN_INIT_CAST_SOURCE} casts the model to "
            f"{named[flags[0]]}",
        )
    torch = parse_version("torch_version", t.torch_version)
    emulated = torch is None or torch >= TORCH_BF16_EMULATION_SINCE
    major = int(gpu.compute_capability.split(".")[0]) if gpu.vendor == "nvidia" else 0
    auto = f"with no bf16 / fp16 / fp32 in its config {QWEN_INIT_CAST_SOURCE} casts itself to"
    if gpu.vendor != "nvidia" or major >= 8 or emulated:
        reason = (
            "ROCm"
            if gpu.vendor != "nvidia"
            else f"compute capability {gpu.compute_capability}"
            if major >= 8
            else f"torch >= 2.3 counts emulated bf16 on compute capability {gpu.compute_capability}"
        )
        return LoadDtype(
            "bfloat16", f"{auto} bfloat16 where torch.cuda.is_bf16_supported() ({reason})"
        )
    if major >= 7:
        return LoadDtype(
            "float16",
            f"{auto} float16: no bf16 on compute capability {gpu.compute_capability} before "
            "torch 2.3, fp16 from 7.0",
        )
    return LoadDtype(
        "float32", f"{auto} nothing: compute capability {gpu.compute_capability} < 7.0"
    )


def framework_load_dtype(
    t: TrainingConfig,
    checkpoint_dtype: str | None,
    model_type: str | None = None,
    *,
    config: Mapping[str, Any] | None = None,
    gpu: GPUSpec | None = None,
) -> LoadDtype | None:
    """The dtype ``t``'s framework loads the model in when ``load_dtype`` is not given.

    Args:
        t: the training settings (framework, precision, releases, LoRA).
        checkpoint_dtype: the config's ``torch_dtype`` / ``dtype``
            (``ModelSpec.checkpoint_dtype``); None when it names none.
        model_type: the config's ``model_type`` (:data:`BUILT_IN_CONFIG_DTYPE`: the remote code
            builds the model in the config's dtype; qwen: :func:`qwen_init_dtype`); None when
            unknown.
        config: the model's config.json (Qwen-1's ``bf16`` / ``fp16`` / ``fp32``); None: not
            read (the flags taken as false).
        gpu: the GPU (Qwen-1 casts itself by its bf16 support); None: not known, and
            transformers' rule is given with a word on it.

    Returns:
        The dtype and its source; None for a framework that does not load through
        ``from_pretrained`` (a plain loop, Megatron, torchtune, litgpt...) or whose load is
        not read here (Unsloth's: its ``bf16-true`` default already is its 16-bit load).
    """
    auto = checkpoint_dtype or "float32"
    auto_text = (
        f"the config's dtype, {checkpoint_dtype}"
        if checkpoint_dtype
        else "no dtype in the config: the checkpoint's first float weight, taken as float32"
    )
    if t.framework == "llama-factory":
        if not t.is_lora:
            return LoadDtype(
                "float32",
                f"{_LLAMA_FACTORY} upcasts every trainable parameter to float32 "
                "(model/adapter.py:313-325) unless pure_bf16",
            )
        return LoadDtype(
            auto,
            f"{_LLAMA_FACTORY} loads torch_dtype='auto' (model/loader.py:155): {auto_text}; "
            "its LoRA adapters fp32 (adapter.py:286-288)",
        )
    if t.framework == "axolotl":
        return _axolotl(t)
    if t.framework == "trl" and (t.trl_release or ()) >= TRL_MODEL_INIT_FLOAT32_SINCE:
        release = ".".join(map(str, t.trl_release or ()))
        return LoadDtype(
            "float32",
            f"TRL {release} SFTTrainer(model=<name>) loads dtype='float32' unless "
            "model_init_kwargs says (trl/trainer/utils.py create_model_from_path, from 0.27)",
        )
    if t.framework not in ("hf-trainer", "trl"):  # TRL before 0.27: transformers' default
        return None
    qwen = model_type == "qwen" and t.quantize_base == "none"
    if qwen and gpu is not None:
        return qwen_init_dtype(t, config, gpu)
    default = _transformers_default(t, checkpoint_dtype, model_type, auto, auto_text)
    if qwen:  # no GPU: the cast is not known
        return replace(
            default,
            why=f"{default.why}; Qwen-1 then casts itself by the GPU's bf16 support "
            "(modeling_qwen.py QWenLMHeadModel.__init__): give --gpu",
        )
    return default


def _transformers_default(
    t: TrainingConfig,
    checkpoint_dtype: str | None,
    model_type: str | None,
    auto: str,
    auto_text: str,
) -> LoadDtype:
    """transformers' ``from_pretrained`` default for the HF Trainer and TRL before 0.27."""
    trl = ""
    if t.framework == "trl":
        trl = (
            f"TRL {'.'.join(map(str, t.trl_release or ()))} SFTTrainer(model=<name>) passes no "
            "dtype before 0.27 (trl/trainer/utils.py create_model_from_path), so "
        )
    transformers = t.transformers_release
    release = ".".join(map(str, transformers))
    if t.quantize_base != "none" and transformers < TRANSFORMERS_AUTO_DTYPE_SINCE:
        # Note [transformers 4 loads a quantized base in float16]
        return LoadDtype(
            "float16",
            f"{trl}transformers {release} forces float16 on a {t.quantize_base} model given no "
            f"torch_dtype ({QUANTIZED_LOAD_FP16_SOURCE}; before 5.0)",
        )
    if transformers >= TRANSFORMERS_AUTO_DTYPE_SINCE:
        return LoadDtype(
            auto,
            f"{trl}transformers {release} from_pretrained defaults to dtype='auto' "
            f"(modeling_utils.py, from 5.0.0): {auto_text}",
        )
    if (
        model_type in BUILT_IN_CONFIG_DTYPE
        and checkpoint_dtype
        and transformers < CONFIG_DTYPE_OVERWRITTEN_SINCE
    ):
        return LoadDtype(
            checkpoint_dtype,
            f"{trl}transformers {release} from_pretrained passes no dtype and leaves the "
            f"config's, and {model_type}'s remote code builds every module in "
            f"config.torch_dtype, {checkpoint_dtype} (modeling_chatglm.py _config_to_kwargs; "
            "from 4.49 the config gets float32)",
        )
    return LoadDtype(
        "float32",
        f"{trl}transformers {release} from_pretrained loads in torch's default dtype when none "
        "is given (modeling_utils.py _get_dtype, before 5.0)",
    )


def _axolotl(t: TrainingConfig) -> LoadDtype:
    """axolotl v0.18.0 loads in ``cfg.torch_dtype`` (utils/config/__init__.py ``resolve_dtype``:
    bfloat16 under ``bf16``, float16 under ``fp16``, else float32) whatever the checkpoint's;
    ``_configure_embedding_dtypes`` (loaders/model.py:422-477) then puts norms, embeddings and
    head in float32 (not under FSDP) and, with an adapter (``needs_fa2_dtype``), back in
    ``torch_dtype``: a LoRA base wholly in the compute dtype, a full fine-tune's linears in it
    beside fp32 norms, embeddings and head, a mixed load not modelled (float32 here)."""
    flag = {"bfloat16": "bf16", "float16": "fp16"}.get(t.compute_dtype, "")
    if not (t.is_mixed and flag):
        return LoadDtype("float32", "axolotl v0.18.0: no bf16 / fp16, torch_dtype float32")
    source = f"axolotl v0.18.0 loads torch_dtype {t.compute_dtype} under {flag} (resolve_dtype)"
    if t.is_lora:
        return LoadDtype(
            t.compute_dtype,
            f"{source}, norms and embeddings cast back to it with an adapter "
            "(loaders/model.py _configure_embedding_dtypes)",
        )
    return LoadDtype(
        "float32",
        f"{source}, but a full fine-tune keeps norms, embeddings and head in float32 "
        "(loaders/model.py _configure_embedding_dtypes): a mixed load, not modelled",
    )


def _not_modelled(t: TrainingConfig, dtype: str) -> str:
    """Why a 16-bit default load is not applied to ``t`` (``_check_load_dtype`` refuses it),
    in the terms of what the framework then does."""
    if not t.uses_autocast:
        return (
            f"--precision {t.precision} runs no autocast: a {dtype} model then trains in "
            f"{dtype} throughout, which --precision {'bf16' if dtype == 'bfloat16' else '16'}"
            "-true models"
        )
    if t.kbit_fp32_upcast:
        return (
            "a quantized base: peft's prepare_model_for_kbit_training casts its other weights "
            "to float32"
        )
    if t.kbit_16bit_dense and t.uses_autocast and t.attention != "flash":
        return (
            f"a quantized base's other weights in {dtype} under {t.compute_dtype} autocast with "
            f"--attention {t.attention}: the attention returns {t.compute_dtype} and the "
            f"residual stream turns float32, not modelled (--attention flash keeps {dtype})"
        )
    if t.quantize_base != "none":
        return "a quantized base: its other weights take the quantization's dtype"
    if t.zero_stage != 0:
        return (
            "DeepSpeed casts the weights to its 16-bit dtype with fp32 masters whatever is "
            "loaded, and accelerate's FSDP upcasts them to float32 (accelerate 0.30.0 "
            "prepare_model)"
        )
    if t.tensor_parallel_size > 1 or t.pipeline_parallel_size > 1:
        return "a 16-bit load under model parallelism is not modelled"
    if dtype == "float16" and dtype == t.compute_dtype and not t.is_lora:
        # torch/amp/grad_scaler.py ``_unscale_grads_``
        return "16-mixed's GradScaler raises 'Attempting to unscale FP16 gradients.' on them"
    return f"autocast to {t.compute_dtype} over {dtype} weights is not modelled"


def resolve_load_dtype(
    t: TrainingConfig,
    checkpoint_dtype: str | None,
    model_type: str | None = None,
    *,
    config: Mapping[str, Any] | None = None,
    gpu: GPUSpec | None = None,
) -> tuple[TrainingConfig, str | None]:
    """``t`` with the framework's ``load_dtype`` when none is given, and what was assumed.

    Returns:
        ``t`` (with ``load_dtype`` set where the framework's default is a 16-bit load trainmem
        models; a given ``load_dtype`` always wins) and the ``details["assumed"]["load_dtype"]``
        text (None where the framework does not load through ``from_pretrained``).
    """
    if t.load_dtype is not None:
        return t, None
    default = framework_load_dtype(t, checkpoint_dtype, model_type, config=config, gpu=gpu)
    if default is None:
        return t, None
    if default.dtype == "float32":
        return t, f"float32 ({default.why})"
    if not t.uses_autocast and t.compute_dtype == default.dtype:
        # 16-true / bf16-true: the model trains in the loaded dtype throughout, as modelled
        return t, f"{default.dtype} ({default.why}), as --precision {t.precision} trains"
    try:
        loaded = replace(t, load_dtype=default.dtype)
    except SpecError:  # _check_load_dtype: a load the step does not model
        # the precision's own; a quantized base's rest kept as loaded: the compute dtype
        modelled = t.kbit_dense_dtype if t.kbit_16bit_dense else "float32"
        modelled = modelled if t.uses_autocast else t.compute_dtype
        return t, (
            f"{modelled} modelled; the load is {default.dtype} ({default.why}), but "
            f"{_not_modelled(t, default.dtype)}"
        )
    if t.quantize_base == "none":
        return loaded, f"{default.dtype} ({default.why}); --load-dtype float32 overrides it"
    # a quantized base's other weights take a 16-bit load only (kbit_dense_dtype)
    if default.dtype == t.compute_dtype:
        return loaded, f"{default.dtype} ({default.why})"
    return loaded, f"{default.dtype} ({default.why}); --load-dtype {t.compute_dtype} overrides it"


DIFFUSERS_LORA_LOAD = (
    "diffusers' LoRA scripts move the frozen model in weight_dtype (examples/dreambooth/"
    "train_dreambooth_lora_flux.py, _sd3.py, _sdxl.py: transformer / unet.to(accelerator.device, "
    "dtype=weight_dtype); finetrainers trainer.py likewise)"
)
"""Why a diffusers LoRA run under ``*-mixed`` loads its model in the compute dtype."""


def diffusers_lora_load_dtype(
    t: TrainingConfig, config: Mapping[str, Any]
) -> tuple[TrainingConfig, str | None]:
    """``t`` with ``load_dtype`` the compute dtype for LoRA on a diffusers model under an
    autocasting ``*-mixed`` precision when none is given, and what was assumed.

    Note [diffusers' LoRA scripts cast the frozen model]
        Every diffusers LoRA training script casts the frozen denoiser to ``weight_dtype``
        (bf16 / fp16 under ``--mixed_precision``) before ``add_adapter``
        (:data:`DIFFUSERS_LORA_LOAD`), and accelerate autocasts over it: a 16-bit frozen base,
        16-bit adapters (fp32 for fp16, ``cast_training_params``), autocast's fp32 ops
        (``TrainingConfig.autocast_over_loaded_16bit``). Without this, ``*-mixed`` meant an fp32
        frozen transformer (FLUX.1-dev: 44 GiB of weights where the script holds 22). The full
        fine-tuning scripts keep the trained model fp32 (``train_text_to_image.py``), so only
        LoRA takes it. A given ``load_dtype`` wins; where the 16-bit load is not modelled
        (a quantized base, ZeRO / FSDP: ``_check_load_dtype``) the fp32 step stays.

    Returns:
        ``t`` (``load_dtype`` set where it applies) and the ``details["assumed"]["load_dtype"]``
        text, or None where nothing was assumed.
    """
    if t.load_dtype is not None or not t.is_lora or not t.uses_autocast:
        return t, None
    if not is_diffusers_config(config):
        return t, None
    try:
        loaded = replace(t, load_dtype=t.compute_dtype)
    except SpecError:  # _check_load_dtype: a load the step does not model
        return t, None
    return loaded, f"{t.compute_dtype} ({DIFFUSERS_LORA_LOAD}); --load-dtype float32 overrides it"
