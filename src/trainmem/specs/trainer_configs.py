"""Read the training configs people already run with: an axolotl YAML, a torchtune recipe YAML,
and a Hugging Face ``TrainingArguments`` / TRL ``SFTConfig`` JSON, into TrainingConfig field
values, as :mod:`trainmem.specs.framework_configs` does for DeepSpeed and accelerate.

Each reader returns the settings it read (TrainingConfig field -> value) and, when given a
``notes`` list, appends one sentence naming every key it read and what it became (a framework
default it resolved included), and one ``ignored: ...`` sentence listing keys that change memory
but trainmem does not model. Keys with no effect on memory (learning rate, datasets, logging,
paths) are skipped silently. A value the framework would refuse, or that trainmem does not know,
is a one-line :class:`~trainmem.errors.SpecError` naming the file, the key and the allowed
values. A key the file leaves out takes the framework's default, not trainmem's: that is the run
the file describes.

Sources (names and defaults, read from the released packages):

- axolotl 0.19.0 ``src/axolotl/utils/schemas/``: ``training.py`` ``HyperparametersConfig``
  (``micro_batch_size`` 1, ``gradient_accumulation_steps`` 1, ``optimizer`` default
  ``adamw_torch_fused``), ``config.py`` ``AxolotlInputConfig`` (``sequence_len`` 512, ``bf16``
  ``"auto"``, ``gradient_checkpointing`` false / true / ``offload``, ``activation_offloading``,
  ``flash_attention`` ... as ``attn_implementation``, ``deepspeed``, ``fsdp_config``,
  ``torch_compile``), ``peft.py`` ``LoraConfig`` (``adapter``, ``load_in_4bit``,
  ``load_in_8bit``, ``lora_r``, ``lora_dropout`` 0.0, ``lora_target_modules``,
  ``lora_target_linear``, ``peft_use_dora``, ``lora_modules_to_save``: ``loaders/adapter.py``
  passes it to peft's ``LoraConfig(modules_to_save=...)``), ``fsdp.py`` ``FSDPConfig``, ``enums.py``
  (``CustomSupportedOptimizers``, ``LEGACY_ATTN_FLAG_TO_IMPL``); ``utils/config/__init__.py``
  ``resolve_dtype`` (the model is loaded in ``torch_dtype`` bfloat16 when ``bf16``) and
  ``normalize_config``; ``loaders/model.py`` (QLoRA's ``BitsAndBytesConfig``: nf4 with
  ``bnb_4bit_use_double_quant=True``); ``integrations/cut_cross_entropy`` (``plugins``
  listing ``CutCrossEntropyPlugin``, its ``cut_cross_entropy`` key, default true).
- torchtune 0.6.1: ``recipes/lora_finetune_single_device.py`` / ``full_finetune_*.py``
  (``batch_size``, ``gradient_accumulation_steps``, ``dtype``, ``enable_activation_
  checkpointing``, ``enable_activation_offloading``, ``compile``, ``optimizer_in_bwd``,
  ``fsdp_cpu_offload``, ``fsdp_reshard_after_forward``), ``torchtune/training/precision.py``
  ``get_dtype`` (no dtype: float32; fp16 refused), ``torchtune/models/*/_model_builders.py``
  (``lora_*`` / ``qlora_*`` builders: ``lora_attn_modules``, ``apply_lora_to_mlp``,
  ``apply_lora_to_output``, ``lora_rank`` 8, ``quantize_base``), ``torchtune/modules/loss/
  ce_chunked_output_loss.py`` (``num_output_chunks=8``), ``recipes/configs/**.yaml``.
- transformers ``training_args.py`` (``TrainingArguments``: ``per_device_train_batch_size`` 8,
  ``gradient_accumulation_steps`` 1, ``gradient_checkpointing``, ``bf16`` / ``fp16``, ``optim``
  from ``OptimizerNames``, ``deepspeed``, ``fsdp`` / ``fsdp_config``, ``torch_compile``;
  trainer_utils.py ``FSDPOption``); TRL 1.16.0 ``trl/trainer/sft_config.py`` (``max_length``
  1024, formerly ``max_seq_length``; ``activation_offloading``; ``model_init_kwargs``) and
  ``base_config.py`` (SFT defaults: ``gradient_checkpointing`` true, ``bf16`` true unless
  ``fp16``).

Known limitations: the number of GPUs is not in any of these files (torchrun / accelerate
launch decide it): sharding (FSDP, ZeRO) needs ``--data-parallel-size N``. axolotl's patched
``prepare_model_for_kbit_training`` (it upcasts fewer modules than peft's) is read as peft's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainmem.errors import SpecError
from trainmem.specs.framework_configs import (
    _FSDP_STRATEGIES,
    _load,
    deepspeed_settings,
)
from trainmem.specs.training import (
    LORA_MODULES_TO_SAVE,
    LORA_MODULES_TO_SAVE_ALIASES,
    LORA_TARGET_ALIASES,
    LORA_TARGETS,
    fsdp_settings,
)

HF_OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    "adamw_torch": ("adamw", "foreach"),
    "adamw_torch_fused": ("adamw", "fused"),
    "adafactor": ("adafactor", None),
    "adamw_bnb_8bit": ("adamw-8bit", None),
    "adamw_8bit": ("adamw-8bit", None),
    "paged_adamw_8bit": ("paged-adamw-8bit", None),
    "paged_adamw_32bit": ("paged-adamw", None),
    "adamw_torch_4bit": ("adamw-4bit", None),
    "adamw_torch_8bit": ("ao-adamw-8bit", None),
    "sgd": ("sgd", None),
    "lion_32bit": ("lion", None),
}
"""transformers ``OptimizerNames`` (training_args.py) trainmem models, as (optimizer,
optimizer_implementation): ``adamw_torch`` is ``torch.optim.AdamW`` with torch's default
(foreach on CUDA), ``adamw_torch_fused`` passes ``fused=True``; ``adamw_bnb_8bit`` /
``adamw_8bit`` / ``paged_adamw_*`` are bitsandbytes', ``adamw_torch_4bit`` / ``_8bit`` torchao's
low-bit AdamW (``_8bit``: ``ao-adamw-8bit``, whose compiled step differs from bitsandbytes', Note
[torchao low-bit AdamW step]); None leaves the implementation to the framework."""

AXOLOTL_OPTIMIZERS: dict[str, tuple[str, str | None]] = {
    **HF_OPTIMIZERS,
    "ao_adamw_4bit": ("adamw-4bit", None),
    "ao_adamw_8bit": ("ao-adamw-8bit", None),
    "ao_adamw_fp8": ("adamw-fp8", None),
}
"""axolotl's ``optimizer``: the transformers names plus its ``CustomSupportedOptimizers``
torchao ones (enums.py)."""

TORCHTUNE_OPTIMIZERS: dict[str, str] = {
    "torch.optim.AdamW": "adamw",
    "torch.optim.Adam": "adam",
    "torch.optim.SGD": "sgd",
    "bitsandbytes.optim.AdamW8bit": "adamw-8bit",
    "bitsandbytes.optim.PagedAdamW": "paged-adamw",
    "bitsandbytes.optim.PagedAdamW32bit": "paged-adamw",
    "bitsandbytes.optim.PagedAdamW8bit": "paged-adamw-8bit",
    "torchao.optim.AdamW8bit": "ao-adamw-8bit",
    "torchao.optim.AdamW4bit": "adamw-4bit",
    "torchao.optim.AdamWFp8": "adamw-fp8",
    "torchao.prototype.low_bit_optim.AdamW8bit": "ao-adamw-8bit",
    "torchao.prototype.low_bit_optim.AdamW4bit": "adamw-4bit",
    "torchao.prototype.low_bit_optim.AdamWFp8": "adamw-fp8",
}
"""torchtune ``optimizer._component_`` classes trainmem models (recipes/configs: torch AdamW,
bitsandbytes ``PagedAdamW`` / ``PagedAdamW8bit``, torchao low-bit AdamW)."""

TORCHTUNE_CPU_OFFLOAD = (
    "torchao.optim.CPUOffloadOptimizer",
    "torchao.prototype.low_bit_optim.CPUOffloadOptimizer",
)
"""torchao's ``CPUOffloadOptimizer`` (its ``optimizer_class`` names the optimizer it runs on the
CPU; ``offload_gradients`` frees the GPU gradients)."""

PEFT_TARGETS: dict[str, str] = {**LORA_TARGET_ALIASES, "lm_head": "lm_head"}
"""peft ``target_modules`` names of the Llama-style modeling code (transformers
``modeling_llama.py``) -> trainmem's linear names."""

TORCHTUNE_ATTN_TARGETS: dict[str, str] = {
    "q_proj": "q",
    "k_proj": "k",
    "v_proj": "v",
    "output_proj": "o",
}
"""torchtune ``LORA_ATTN_MODULES`` (modules/peft/_utils.py) -> trainmem's linear names;
``apply_lora_to_mlp`` adds w1 / w3 / w2 (gate, up, down), ``apply_lora_to_output`` the output
projection (lm_head)."""

AXOLOTL_ATTENTION: dict[str, str] = {
    "eager": "eager",
    "sdpa": "sdpa",
    "flash_attention_2": "flash",
    "flash_attention_3": "flash",
    "flash_attention_4": "flash",
    "flash_attention_torch": "flash",
}
"""axolotl ``attn_implementation`` values (enums.py ``CANONICAL_ATTN_IMPLS``) trainmem models:
every flash-attention kernel saves O(s) softmax statistics, not the s x s scores."""

_AXOLOTL_ATTN_FLAGS = {
    "flash_attention": "flash_attention_2",
    "sdp_attention": "sdpa",
    "eager_attention": "eager",
    "xformers_attention": "xformers",
    "flex_attention": "flex_attention",
    "sage_attention": "sage",
}
"""axolotl's legacy boolean attention flags as ``attn_implementation`` (enums.py
``LEGACY_ATTN_FLAG_TO_IMPL``, in its priority order: specific before generic)."""


def _known(value: Any, table: Any) -> bool:
    """``value`` is a name in ``table`` (a list or a mapping from a file is not)."""
    return isinstance(value, str) and value in table


class _Reading:
    """What one file said: the settings, and a record of each key read and each key ignored."""

    def __init__(self, label: str, path: str, field: str) -> None:
        self.label = label
        self.name = Path(path).name[:120]
        self.field = field
        self.out: dict[str, Any] = {}
        self.read: list[str] = []
        self.ignored: list[str] = []
        self.extra: list[str] = []

    def fail(self, key: str, value: Any, allowed: Any) -> SpecError:
        shown = repr(value) if isinstance(value, str | int | float | bool) else type(value).__name__
        names = ", ".join(str(a) for a in allowed)
        return SpecError(
            self.field, f"{self.name}: {key} {shown[:80]} unknown or not modelled; allowed: {names}"
        )

    def set(self, field: str, value: Any, key: str, why: str = "") -> None:
        self.out[field] = value
        if isinstance(value, bool):
            shown = str(value).lower()
        else:
            shown = ",".join(value) if isinstance(value, tuple) else str(value)
        self.read.append(f"{key} -> {field} {shown}" + (f" ({why})" if why else ""))

    def get(self, cfg: dict[str, Any], key: str, kind: type, what: str, prefix: str = "") -> Any:
        """``cfg[key]`` of type ``kind`` (None when absent or null)."""
        value = cfg.get(key)
        if value is None:
            return None
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
            raise self.fail(prefix + key, value, [what])
        return value

    def positive(self, cfg: dict[str, Any], key: str, prefix: str = "") -> int | None:
        value = self.get(cfg, key, int, "a positive integer", prefix)
        if value is not None and value < 1:
            raise self.fail(prefix + key, value, ["a positive integer"])
        return value  # type: ignore[no-any-return]

    def section(self, cfg: dict[str, Any], key: str) -> dict[str, Any]:
        value = cfg.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.fail(key, value, ["a mapping"])
        return value

    def ignore(self, cfg: dict[str, Any], keys: dict[str, str]) -> None:
        """Record each key of ``keys`` that ``cfg`` sets to something other than off."""
        for key, why in keys.items():
            value = cfg.get(key)
            if value not in (None, False, 0, "", [], {}, "none", "None"):
                self.ignored.append(f"{key} ({why})")

    def finish(self, notes: list[str] | None) -> dict[str, Any]:
        if notes is not None:
            where = f"{self.label} {self.name}"
            if self.read:
                notes.append(f"{where}: " + "; ".join(self.read))
            notes.extend(f"{where}: {line}" for line in self.extra)
            if self.ignored:
                notes.append(
                    f"{where} ignored (changes memory, not modelled): " + "; ".join(self.ignored)
                )
        return self.out


def _nested_path(base: str, path: str) -> str:
    """A path named inside a config file: as written when absolute; else next to the file
    when it is there, else as written (relative to the working directory, where the framework
    itself opens it)."""
    p = Path(path).expanduser()
    if p.is_absolute():
        return str(p)
    beside = Path(base).expanduser().parent / p
    return str(beside) if beside.exists() else str(p)


def _with_deepspeed(r: _Reading, key: str, value: Any, base: str, trainer: dict[str, Any]) -> None:
    """Read the DeepSpeed config a trainer file names (a path or an inline mapping) into
    ``r.out``, its ``"auto"`` values filled from the trainer's own (transformers
    integrations/deepspeed.py ``trainer_config_process``: ``train_micro_batch_size_per_gpu`` <-
    ``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``bf16.enabled`` <-
    ``bf16`` ...). ``trainer`` holds the trainer's values for those fields."""
    auto: dict[str, str] = {}
    if isinstance(value, dict):
        raw, where = value, f"{key} (inline)"
    elif isinstance(value, str) and value:
        path = _nested_path(base, value)
        raw, where = _load(path, "json", "deepspeed_config"), f"{key} {Path(path).name}"
    else:
        raise r.fail(key, value, ["a ds_config.json path", "a mapping"])
    ds = deepspeed_settings(raw, auto)
    if not any(raw.get(k) is not None for k in ("bf16", "bfloat16", "fp16")):
        # no precision section: accelerate adds the Trainer's (utils/dataclasses.py
        # DeepSpeedPlugin.set_mixed_precision)
        ds.pop("precision", None)
        auto["precision"] = "bf16 / fp16 (no section)"
    for field, ds_value in ds.items():
        mine = trainer.get(field)
        if field in trainer and mine != ds_value:
            r.extra.append(
                f"{where} says {field} {ds_value}, the file's own {field} {mine}; DeepSpeed's "
                "value is used (the HF Trainer refuses a mismatch: integrations/deepspeed.py "
                "trainer_config_finalize)"
            )
        r.out[field] = ds_value
    for field, ds_key in auto.items():
        if field in trainer:
            r.out[field] = trainer[field]
            r.read.append(f'{where} {ds_key} "auto" -> {field} {trainer[field]}')
    r.read.append(f"{where} -> DeepSpeed config ({', '.join(f'{k} {v}' for k, v in ds.items())})")


def _fsdp(
    r: _Reading,
    strategy: str,
    version: int,
    *,
    offload: bool,
    checkpointing: bool,
    reshard: bool | None,
    key: str,
) -> None:
    """FSDP through accelerate (the HF Trainer's, axolotl's): ``strategy`` a ``ShardingStrategy``
    name, ``version`` 1 (``accelerate-fsdp``) or 2 (``fsdp2``)."""
    name = _FSDP_STRATEGIES.get(strategy.upper())
    if name is None:
        raise r.fail(key, strategy, [k.lower() for k in _FSDP_STRATEGIES if not k.isdigit()])
    settings = fsdp_settings(0, name.replace("-zero2", ""))
    if name == "hybrid-shard-zero2" or reshard is False:
        settings["reshard_after_forward"] = False
    for field, value in settings.items():
        if value is not None:
            r.set(field, value, key)
    r.set("framework", "fsdp2" if version == 2 else "accelerate-fsdp", f"{key} version {version}")
    if offload:
        r.set("offload", "optimizer+params" if r.out["zero_stage"] == 3 else "optimizer", key)
    if checkpointing:
        r.set("activation_checkpointing", "full", f"{key} activation_checkpointing")
    r.extra.append(
        "FSDP shards over the ranks torchrun / accelerate launch starts, not named in the file: "
        "give --data-parallel-size N"
    )


def _lora_targets(r: _Reading, names: Any, table: dict[str, str], key: str) -> list[str]:
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise r.fail(key, names, ["a list of module names"])
    out = []
    for name in names:
        if name in ("embed_tokens", "tok_embeddings"):
            r.ignored.append(f"{key} {name} (LoRA on the embedding)")
        elif name in table:
            out.append(table[name])
        else:
            raise r.fail(key, name, table)
    return out


# --- axolotl -------------------------------------------------------------------------------

_AXOLOTL_IGNORED = {
    "unfrozen_parameters": "a partly frozen full fine-tune",
    "chunked_cross_entropy": "axolotl's chunked loss",
    "tiled_mlp": "ALST tiled MLP",
    "layer_offloading": "weights offloaded to the CPU between layers",
    "selective_checkpointing": "ops saved inside checkpointed layers",
    "lora_mlp_kernel": "axolotl's fused LoRA MLP kernel",
    "lora_qkv_kernel": "axolotl's fused LoRA QKV kernel",
    "lora_o_kernel": "axolotl's fused LoRA O kernel",
    "liger_fused_linear_cross_entropy": "Liger's fused linear cross-entropy",
    "liger_rms_norm": "Liger's RMSNorm",
    "liger_glu_activation": "Liger's SwiGLU",
    "peft_layers_to_transform": "LoRA on some layers only",
    "lora_target_parameters": "LoRA on expert parameters",
    "relora": "ReLoRA",
    "dp_shard_size": "N-D parallelism (give --data-parallel-size / --zero-stage)",
    "auto_find_batch_size": "the Trainer lowers the batch after an OOM",
}


def _axolotl_precision(r: _Reading, cfg: dict[str, Any], deepspeed: bool) -> None:
    """axolotl loads the model in ``torch_dtype`` (utils/config ``resolve_dtype``: bfloat16 for
    ``bf16`` or ``bfloat16``, float16 for ``fp16`` / ``float16`` / ``load_in_8bit``, else
    float32) and hands ``bf16`` / ``fp16`` to the Trainer, which autocasts: 16-bit weights, so
    ``bf16-true`` / ``16-true``. Under DeepSpeed, ``bf16`` is DeepSpeed's (16-bit weights, fp32
    master weights): ``bf16-mixed``."""
    flag = "true, false or auto"
    bf16 = cfg.get("bf16", "auto")
    if bf16 not in (True, False, "auto", None):
        raise r.fail("bf16", bf16, ["true", "false", "auto"])
    fp16 = r.get(cfg, "fp16", bool, flag)
    if r.get(cfg, "fp8", bool, flag):
        r.set("precision", "fp8-mixed", "fp8: torchao float8 training")
        return
    auto = bf16 == "auto" and not fp16
    if bf16 is True or auto:
        why = "bf16: auto, true on a bf16 GPU (Ampere and later)" if auto else "bf16"
        if deepspeed:
            r.set("precision", "bf16-mixed", why + ", DeepSpeed's bf16")
        else:
            r.set("precision", "bf16-true", why + ": the model is loaded in bfloat16")
    elif fp16:
        if deepspeed:
            r.set("precision", "16-mixed", "fp16, DeepSpeed's fp16")
        else:
            r.set("precision", "16-true", "fp16: the model is loaded in float16")
    elif r.get(cfg, "bfloat16", bool, flag):
        r.set("precision", "bf16-true", "bfloat16: no AMP")
    elif r.get(cfg, "float16", bool, flag):
        r.set("precision", "16-true", "float16: no AMP")
    else:
        r.set("precision", "32-true", "bf16 false, no fp16: float32")


def _axolotl_adapter(r: _Reading, cfg: dict[str, Any], linears: tuple[str, ...]) -> None:
    adapter = cfg.get("adapter")
    flag = "true or false"
    four, eight = r.get(cfg, "load_in_4bit", bool, flag), r.get(cfg, "load_in_8bit", bool, flag)
    if adapter in (None, ""):
        if four or eight:  # peft.py validate_adapter
            raise r.fail("load_in_4bit" if four else "load_in_8bit", True, ["an adapter"])
        return
    if adapter not in ("lora", "qlora"):
        raise r.fail("adapter", adapter, ["lora", "qlora"])
    rank = r.positive(cfg, "lora_r")
    if rank is None:
        raise SpecError(r.field, f"{r.name}: adapter {adapter} needs lora_r (the LoRA rank)")
    r.set("lora_rank", rank, "lora_r")
    dropout = r.get(cfg, "lora_dropout", float, "a number in [0, 1)")
    r.set("lora_dropout", 0.0 if dropout is None else dropout, "lora_dropout")
    if r.get(cfg, "peft_use_dora", bool, flag):  # peft.py peft_use_dora: LoraConfig(use_dora)
        r.set("lora_variant", "dora", "peft_use_dora")
    saved = cfg.get("lora_modules_to_save")
    if saved:  # loaders/adapter.py: LoraConfig(modules_to_save=cfg.lora_modules_to_save or None)
        names = [saved] if isinstance(saved, str) else saved
        allowed = [*LORA_MODULES_TO_SAVE, *LORA_MODULES_TO_SAVE_ALIASES]
        if not isinstance(names, list):
            raise r.fail("lora_modules_to_save", names, ["a list of module names"])
        for name in names:
            if not _known(name, allowed):
                raise r.fail("lora_modules_to_save", name, allowed)
        r.set("lora_modules_to_save", tuple(names), "lora_modules_to_save")
    targets = []
    if cfg.get("lora_target_modules") is not None:
        targets = _lora_targets(r, cfg["lora_target_modules"], PEFT_TARGETS, "lora_target_modules")
    if r.get(cfg, "lora_target_linear", bool, flag):
        targets += linears  # loaders/adapter.py find_all_linear_names, without the head
    if targets:
        r.set("lora_targets", tuple(dict.fromkeys(targets)), "lora_target_modules/_linear")
    else:
        r.extra.append("no lora_target_modules: peft's default for the model (Llama: q,v)")
    bnb = r.section(cfg, "bnb_config_kwargs")
    if r.get(cfg, "gptq", bool, flag):
        r.set("quantize_base", "gptq-int4", "gptq")
    elif adapter == "qlora":
        if eight or not four:  # peft.py validate_qlora
            raise SpecError(
                r.field, f"{r.name}: adapter qlora needs load_in_4bit: true (and no load_in_8bit)"
            )
        kind = bnb.get("bnb_4bit_quant_type", "nf4")
        if kind not in ("nf4", "fp4"):
            raise r.fail("bnb_config_kwargs.bnb_4bit_quant_type", kind, ["nf4", "fp4"])
        double = bnb.get("bnb_4bit_use_double_quant", True) is not False
        r.set(
            "quantize_base", kind + ("-dq" if double else ""), "qlora + load_in_4bit: BitsAndBytes"
        )
    elif eight:
        r.set("quantize_base", "int8", "lora + load_in_8bit: LLM.int8()")
    elif four:
        r.set("quantize_base", "nf4-dq", "lora + load_in_4bit")


def _axolotl_attention(r: _Reading, cfg: dict[str, Any]) -> None:
    impl = cfg.get("attn_implementation")
    key = "attn_implementation"
    if impl is None:
        for flag, name in _AXOLOTL_ATTN_FLAGS.items():
            if cfg.get(flag):
                impl, key = name, flag
                break
    if impl is None:
        return  # transformers' default (sdpa), trainmem's too
    if not _known(impl, AXOLOTL_ATTENTION):
        raise r.fail(key, impl, AXOLOTL_ATTENTION)
    r.set("attention", AXOLOTL_ATTENTION[impl], key)


def _axolotl_reentrant(r: _Reading, cfg: dict[str, Any], checkpointing: bool) -> None:
    """``gradient_checkpointing_kwargs.use_reentrant`` when given, else axolotl's True
    (v0.18.0 utils/config/__init__.py:377-383: ``{"use_reentrant": True}`` when checkpointing
    and neither ``unfrozen_parameters`` nor ``rl`` is set; core/builders/base.py:599-611 passes
    it to ``TrainingArguments``). Read into ``checkpoint_reentrant`` so that it holds under the
    DeepSpeed / FSDP frameworks the file may select too."""
    kwargs = r.section(cfg, "gradient_checkpointing_kwargs")
    given = kwargs.get("use_reentrant")
    if given is not None and not isinstance(given, bool):
        raise r.fail("gradient_checkpointing_kwargs.use_reentrant", given, ["true", "false"])
    if not checkpointing:
        return
    if given is not None:
        r.set("checkpoint_reentrant", given, "gradient_checkpointing_kwargs.use_reentrant")
    elif all(
        cfg.get(k) is None for k in ("gradient_checkpointing_kwargs", "unfrozen_parameters", "rl")
    ):
        r.set("checkpoint_reentrant", True, "gradient_checkpointing (axolotl's use_reentrant True)")


def read_axolotl_config(
    path: str,
    notes: list[str] | None = None,
    model: str | None = None,
    linears: tuple[str, ...] | None = None,
) -> dict[str, Any]:
    """TrainingConfig field values from an axolotl YAML config (see the module docstring).

    Args:
        path: the file.
        notes: if given, receives what was read and what was ignored.
        model: the MODEL the estimate is for; a note says when the file's ``base_model``
            names another one.
        linears: the model's layer linears, what ``lora_target_linear`` targets
            (:func:`~trainmem.specs.training.model_lora_linears`); None: all of
            :data:`~trainmem.specs.training.LORA_TARGETS`.

    Returns:
        TrainingConfig field values (``framework`` ``hf-trainer``, or the DeepSpeed / FSDP
        convention the file selects).

    Raises:
        SpecError: an unreadable file, a value of the wrong type, or one axolotl or trainmem
            does not know.
    """
    f = "axolotl_config"
    cfg = _load(path, "json" if path.endswith(".json") else "yaml", f)
    r = _Reading("axolotl", path, f)
    base = cfg.get("base_model")
    if isinstance(base, str) and model is not None and not same_model(model, base):
        r.extra.append(
            f"base_model {base[:80]} is not MODEL {model[:80]}: the estimate is for {model[:80]}"
        )
    r.set("framework", "axolotl", "axolotl trains with the HF Trainer (--framework axolotl)")
    mbs = r.positive(cfg, "micro_batch_size") or 1
    r.set("micro_batch_size", mbs, "micro_batch_size" if "micro_batch_size" in cfg else "default")
    gas = r.positive(cfg, "gradient_accumulation_steps")
    batch = r.positive(cfg, "batch_size")
    if gas is None and batch is not None:  # utils/config normalize_config
        r.set("gradient_accumulation_steps", max(batch // mbs, 1), "batch_size // micro_batch")
    else:
        r.set("gradient_accumulation_steps", gas or 1, "gradient_accumulation_steps")
    seq = r.positive(cfg, "sequence_len")
    r.set("seq_len", seq or 512, "sequence_len" if seq else "sequence_len default 512")
    deepspeed = cfg.get("deepspeed")
    _axolotl_precision(r, cfg, deepspeed is not None)
    gc = cfg.get("gradient_checkpointing", False)
    if gc not in (True, False, "offload", "offload_disk", None):
        raise r.fail("gradient_checkpointing", gc, ["true", "false", "offload", "offload_disk"])
    if gc:
        r.set("activation_checkpointing", "full", "gradient_checkpointing")
    if gc in ("offload", "offload_disk"):
        r.set("activation_offloading", True, f"gradient_checkpointing {gc}")
    _axolotl_reentrant(r, cfg, bool(gc))
    offload = cfg.get("activation_offloading", False)
    if offload not in (True, False, "legacy", "disk", "hidden_states", None):
        raise r.fail("activation_offloading", offload, ["true", "false", "legacy", "disk"])
    if offload:
        r.set("activation_offloading", True, "activation_offloading")
    _axolotl_attention(r, cfg)
    name = cfg.get("optimizer", "adamw_torch_fused")
    if not _known(name, AXOLOTL_OPTIMIZERS):
        raise r.fail("optimizer", name, AXOLOTL_OPTIMIZERS)
    optimizer, impl = AXOLOTL_OPTIMIZERS[name]
    why = "optimizer" if "optimizer" in cfg else "optimizer default adamw_torch_fused"
    r.set("optimizer", optimizer, why)
    if impl is not None:
        r.set("optimizer_implementation", impl, why)
    _axolotl_adapter(r, cfg, LORA_TARGETS if linears is None else linears)
    compile_ = cfg.get("torch_compile")
    if compile_ not in (True, False, "auto", None):
        raise r.fail("torch_compile", compile_, ["true", "false", "auto"])
    if compile_:
        r.set(
            "compile",
            True,
            "torch_compile" + (" auto: torch >= 2.5.1" if compile_ == "auto" else ""),
        )
    for key in ("tensor_parallel_size", "context_parallel_size"):
        size = r.positive(cfg, key)
        if size is not None and size > 1:
            r.set(key, size, key)
    fsdp_cfg = r.section(cfg, "fsdp_config")
    fsdp_cfg = {
        k[5:] if k.startswith("fsdp_") and k != "fsdp_version" else k: v
        for k, v in fsdp_cfg.items()
    }
    legacy = cfg.get("fsdp") or []
    if fsdp_cfg or legacy:
        if deepspeed is not None:
            raise SpecError(f, f"{r.name}: deepspeed and fsdp_config both set; axolotl runs one")
        if not isinstance(legacy, list):
            raise r.fail("fsdp", legacy, ["a list such as [full_shard, auto_wrap]"])
        strategies = [s for s in legacy if isinstance(s, str) and s not in ("auto_wrap", "offload")]
        version = cfg.get("fsdp_version") or fsdp_cfg.get("fsdp_version") or fsdp_cfg.get("version")
        if str(version or 1) not in ("1", "2"):
            raise r.fail("fsdp_version", version, [1, 2])
        _fsdp(
            r,
            strategies[0] if strategies else "FULL_SHARD",
            int(version or 1),
            offload=bool(fsdp_cfg.get("offload_params")) or "offload" in legacy,
            checkpointing=bool(fsdp_cfg.get("activation_checkpointing")),
            reshard=fsdp_cfg.get("reshard_after_forward"),
            key="fsdp_config",
        )
    if deepspeed is not None:
        trainer = {
            k: r.out[k] for k in ("micro_batch_size", "gradient_accumulation_steps", "precision")
        }
        _with_deepspeed(r, "deepspeed", deepspeed, path, trainer)
    r.ignore(cfg, _AXOLOTL_IGNORED)
    plugins = cfg.get("plugins") or []
    if not isinstance(plugins, list):
        raise r.fail("plugins", plugins, ["a list of plugin class paths"])
    names = [str(p).rsplit(".", 1)[-1] for p in plugins]
    _axolotl_cut_cross_entropy(r, cfg, "CutCrossEntropyPlugin" in names)
    others = [n for n in names if n != "CutCrossEntropyPlugin"]
    if others:
        r.ignored.append("plugins " + ", ".join(others)[:200])
    return r.finish(notes)


def _axolotl_cut_cross_entropy(r: _Reading, cfg: dict[str, Any], plugin: bool) -> None:
    """``cut_cross_entropy``: the plugin's own key (integrations/cut_cross_entropy/args.py
    ``CutCrossEntropyArgs.cut_cross_entropy``, default True), read only with the plugin listed
    (``pre_model_load`` patches the model when it is true; Note [axolotl's Cut Cross Entropy]
    in trainmem/analytic/loss.py); without the plugin the key is not axolotl's."""
    flag = r.get(cfg, "cut_cross_entropy", bool, "true or false")
    if not plugin:
        if flag is not None:
            r.ignored.append("cut_cross_entropy (no CutCrossEntropyPlugin in plugins)")
        return
    on = flag is not False
    why = "plugins CutCrossEntropyPlugin" + (", cut_cross_entropy" if flag is not None else "")
    r.set("cut_cross_entropy", on, why)


def same_model(model: str, base_model: str) -> bool:
    """Whether a preset / path and a hub id plausibly name the same model: one's letters and
    digits contain the other's (``llama-3.1-8b`` and ``meta-llama/Llama-3.1-8B-Instruct``)."""

    def norm(text: str) -> str:
        last = text.rstrip("/").rsplit("/", 1)[-1].lower()
        return "".join(c for c in last.replace("meta-llama-", "llama-") if c.isalnum())

    a, b = norm(model), norm(base_model)
    return bool(a) and bool(b) and (a in b or b in a)


# --- torchtune -----------------------------------------------------------------------------

_TORCHTUNE_DTYPES = {"bf16": "bf16-true", "fp32": "32-true"}
"""torchtune ``dtype`` (training/precision.py ``PRECISION_STR_TO_DTYPE``): the whole model in
that dtype, no autocast; the recipes refuse fp16."""

_TORCHTUNE_LOSSES = {
    "torchtune.modules.loss.CEWithChunkedOutputLoss": True,
    "torch.nn.CrossEntropyLoss": False,
}

_TORCHTUNE_IGNORED = {
    "data_parallel_replicate_dim": "HSDP replicas (give --shard-group-size)",
    "enable_fp8_training": "float8 linears (give -p fp8-mixed)",
}


def _torchtune_optimizer(r: _Reading, cfg: dict[str, Any]) -> None:
    opt = r.section(cfg, "optimizer")
    component = opt.get("_component_")
    if component is None:
        return
    key = "optimizer._component_"
    if component in TORCHTUNE_CPU_OFFLOAD:
        grads = r.get(opt, "offload_gradients", bool, "true or false", "optimizer.")
        r.set(
            "offload", "optimizer+gradients" if grads else "optimizer", key + " CPUOffloadOptimizer"
        )
        component, key = (
            opt.get("optimizer_class", "torch.optim.AdamW"),
            "optimizer.optimizer_class",
        )
    if not _known(component, TORCHTUNE_OPTIMIZERS):
        raise r.fail(key, component, TORCHTUNE_OPTIMIZERS)
    name = TORCHTUNE_OPTIMIZERS[component]
    momentum = r.get(opt, "momentum", float, "a number", "optimizer.")
    if name == "sgd" and momentum:
        name = "sgd-momentum"
    r.set("optimizer", name, key)
    if component.startswith("torch.optim."):
        fused = r.get(opt, "fused", bool, "true or false", "optimizer.")
        foreach = r.get(opt, "foreach", bool, "true or false", "optimizer.")
        if fused:
            r.set("optimizer_implementation", "fused", "optimizer.fused")
        elif foreach is not None:
            r.set(
                "optimizer_implementation",
                "foreach" if foreach else "for-loop",
                "optimizer.foreach",
            )


def _torchtune_model(r: _Reading, cfg: dict[str, Any]) -> None:
    model = r.section(cfg, "model")
    component = model.get("_component_")
    if not isinstance(component, str):
        return
    builder = component.rsplit(".", 1)[-1]
    qlora = builder.startswith("qlora_")
    if not (qlora or builder.startswith("lora_")):
        return
    key = "model."
    rank = r.positive(model, "lora_rank", key)
    r.set(
        "lora_rank",
        8 if rank is None else rank,
        key + "lora_rank" if rank else "lora_rank default 8",
    )
    targets = _lora_targets(
        r, model.get("lora_attn_modules", []), TORCHTUNE_ATTN_TARGETS, key + "lora_attn_modules"
    )
    if r.get(model, "apply_lora_to_mlp", bool, "true or false", key):
        targets += ["gate", "up", "down"]
    if r.get(model, "apply_lora_to_output", bool, "true or false", key):
        targets.append("lm_head")
    if not targets:
        raise SpecError(r.field, f"{r.name}: {builder} with no lora_attn_modules and no MLP")
    r.set("lora_targets", tuple(targets), key + "lora_attn_modules/apply_lora_to_*")
    dropout = r.get(model, "lora_dropout", float, "a number in [0, 1)", key)
    r.set("lora_dropout", dropout or 0.0, key + "lora_dropout")
    if qlora or r.get(model, "quantize_base", bool, "true or false", key):
        # torchao to_nf4: blocks of 64, scales quantized again in blocks of 256
        r.set("quantize_base", "nf4-dq", f"{builder}: torchao NF4")
    if r.get(model, "use_dora", bool, "true or false", key):
        # torchtune's own DoRALinear (modules/peft/dora.py), which TrainingConfig refuses under
        # --framework torchtune with what runs instead (not estimated as plain LoRA)
        r.set("lora_variant", "dora", key + "use_dora")


def _torchtune_sharded_layers(r: _Reading, cfg: dict[str, Any]) -> None:
    """``custom_sharded_layers``: the embedding and the output as FSDP units of their own
    (Note [FSDP embedding and head units]); another list is recorded as ignored."""
    layers = cfg.get("custom_sharded_layers")
    if not layers:
        return
    if isinstance(layers, list) and sorted(layers) == ["output", "tok_embeddings"]:
        r.set("fsdp_embedding_head_units", True, "custom_sharded_layers")
    else:
        r.ignored.append(
            "custom_sharded_layers (FSDP units other than ['tok_embeddings', 'output'])"
        )


def read_torchtune_config(path: str, notes: list[str] | None = None) -> dict[str, Any]:
    """TrainingConfig field values from a torchtune recipe YAML (``framework`` torchtune).

    Args:
        path: the file.
        notes: if given, receives what was read and what was ignored.

    Returns:
        TrainingConfig field values.

    Raises:
        SpecError: an unreadable file, a value of the wrong type, or one torchtune or trainmem
            does not know (fp16, an optimizer or loss not modelled).
    """
    f = "torchtune_config"
    cfg = _load(path, "yaml", f)
    r = _Reading("torchtune", path, f)
    r.set("framework", "torchtune", "a torchtune recipe")
    mbs = r.positive(cfg, "batch_size")
    if mbs is not None:
        r.set("micro_batch_size", mbs, "batch_size")
    gas = r.positive(cfg, "gradient_accumulation_steps")
    if gas is not None:
        r.set("gradient_accumulation_steps", gas, "gradient_accumulation_steps")
    dtype = cfg.get("dtype")
    if dtype is not None and not _known(dtype, _TORCHTUNE_DTYPES):
        raise r.fail("dtype", dtype, _TORCHTUNE_DTYPES)
    r.set("precision", _TORCHTUNE_DTYPES[dtype or "fp32"], "dtype" if dtype else "no dtype: fp32")
    flag = "true or false"
    if r.get(cfg, "enable_activation_checkpointing", bool, flag):
        r.set("activation_checkpointing", "full", "enable_activation_checkpointing")
    if r.get(cfg, "enable_activation_offloading", bool, flag):
        r.set("activation_offloading", True, "enable_activation_offloading")
    if cfg.get("compile"):
        r.set("compile", True, "compile")
    if r.get(cfg, "optimizer_in_bwd", bool, flag):
        r.set("optimizer_in_backward", True, "optimizer_in_bwd")
    _torchtune_optimizer(r, cfg)
    _torchtune_model(r, cfg)
    seq = r.positive(r.section(cfg, "tokenizer"), "max_seq_len", "tokenizer.")
    if seq is not None:
        r.set("seq_len", seq, "tokenizer.max_seq_len")
    else:
        r.extra.append("tokenizer.max_seq_len null: no truncation, give --seq-len (the longest)")
    loss = r.section(cfg, "loss")
    component = loss.get("_component_")
    if component is not None:
        if not _known(component, _TORCHTUNE_LOSSES):
            raise r.fail("loss._component_", component, _TORCHTUNE_LOSSES)
        if _TORCHTUNE_LOSSES[component]:
            chunks = r.positive(loss, "num_output_chunks", "loss.") or 8
            r.set("chunked_cross_entropy", chunks, "loss CEWithChunkedOutputLoss")
    if r.get(cfg, "fsdp_cpu_offload", bool, flag):
        r.set("zero_stage", 3, "fsdp_cpu_offload: FSDP2 fully_shard")
        r.set("offload", "optimizer+params", "fsdp_cpu_offload: CPUOffloadPolicy")
    if r.get(cfg, "fsdp_reshard_after_forward", bool, flag) is False:
        r.set("zero_stage", 3, "FSDP2 fully_shard")
        r.set("reshard_after_forward", False, "fsdp_reshard_after_forward")
    tp = r.positive(cfg, "tensor_parallel_dim")
    if tp is not None and tp > 1:
        r.set("tensor_parallel_size", tp, "tensor_parallel_dim")
    _torchtune_sharded_layers(r, cfg)
    r.ignore(cfg, _TORCHTUNE_IGNORED)
    return r.finish(notes)


# --- Hugging Face TrainingArguments / TRL SFTConfig ----------------------------------------

_SFT_KEYS = (
    "max_length",
    "max_seq_length",
    "packing",
    "dataset_text_field",
    "completion_only_loss",
)
"""Keys only TRL's ``SFTConfig`` has: their presence selects its defaults."""

_HF_IGNORED = {
    "use_liger_kernel": "Liger kernels (fused linear cross-entropy, RMSNorm, SwiGLU)",
    "auto_find_batch_size": "the Trainer lowers the batch after an OOM",
    "optim_target_modules": "GaLore / APOLLO projections",
    "neftune_noise_alpha": "NEFTune noise on the embeddings",
    "torch_empty_cache_steps": "empty_cache() every N steps",
}


def _hf_precision(r: _Reading, args: dict[str, Any], sft: bool, deepspeed: bool) -> None:
    """``bf16`` / ``fp16`` is the Trainer's autocast on the model as loaded: fp32 unless
    ``model_init_kwargs`` (TRL) names a dtype (TRL's SFTTrainer loads a model name in float32
    by default)."""
    flag = "true or false"
    fp16 = r.get(args, "fp16", bool, flag)
    bf16 = r.get(args, "bf16", bool, flag)
    if bf16 is None:
        bf16 = sft and not fp16  # trl base_config.py: bf16 = not fp16 when unset
    init = r.section(args, "model_init_kwargs")
    dtype = init.get("dtype", init.get("torch_dtype"))
    loaded = {"bfloat16": "bf16", "torch.bfloat16": "bf16", "float16": "16", "torch.float16": "16"}
    if deepspeed:
        precision = "bf16-mixed" if bf16 else "16-mixed" if fp16 else "32-true"
        r.set("precision", precision, "bf16 / fp16 under DeepSpeed")
    elif isinstance(dtype, str) and dtype in loaded and (bf16 or fp16):
        r.set("precision", f"{loaded[dtype]}-true", f"model_init_kwargs dtype {dtype}")
    elif bf16:
        r.set("precision", "bf16-mixed", "bf16: autocast on fp32 weights")
        if dtype is None or dtype == "auto":
            r.extra.append(
                "the model's dtype is not in the file (none, or auto: the checkpoint's): "
                "bf16-mixed assumes fp32 weights; a model "
                "loaded in bfloat16 is -p bf16-true"
            )
    elif fp16:
        r.set("precision", "16-mixed", "fp16: autocast + GradScaler on fp32 weights")
    else:
        r.set("precision", "32-true", "no bf16 / fp16")


def _hf_fsdp(r: _Reading, args: dict[str, Any]) -> None:
    fsdp = args.get("fsdp")
    if fsdp in (None, False, "", []):
        return
    items: list[Any]
    if fsdp is True:
        items = []
    elif isinstance(fsdp, str):
        items = fsdp.split()
    elif isinstance(fsdp, list):
        items = fsdp
    else:
        raise r.fail("fsdp", fsdp, ["full_shard", "shard_grad_op", "hybrid_shard", "no_shard"])
    raw = r.section(args, "fsdp_config")
    cfg = {k[5:] if k.startswith("fsdp_") else k: v for k, v in raw.items()}
    strategies = [s for s in items if s not in ("auto_wrap", "offload")]
    version = cfg.get("version", 1)
    if str(version) not in ("1", "2"):
        raise r.fail("fsdp_config.version", version, [1, 2])
    reshard = cfg.get("reshard_after_forward")
    _fsdp(
        r,
        str(strategies[0]) if strategies else "FULL_SHARD",
        int(version),
        offload="offload" in items or bool(cfg.get("cpu_offload") or cfg.get("offload_params")),
        checkpointing=str(cfg.get("activation_checkpointing", "false")).lower() == "true",
        reshard=reshard if isinstance(reshard, bool) else None,
        key="fsdp",
    )


def read_training_args(path: str, notes: list[str] | None = None) -> dict[str, Any]:
    """TrainingConfig field values from a Hugging Face ``TrainingArguments`` (or TRL
    ``SFTConfig``) JSON, as ``args.to_json_string()`` writes it (``framework`` hf-trainer, trl
    for an ``SFTConfig``, or the DeepSpeed / FSDP convention it selects).

    Args:
        path: the file.
        notes: if given, receives what was read and what was ignored.

    Returns:
        TrainingConfig field values.

    Raises:
        SpecError: an unreadable file, a value of the wrong type, or an ``optim`` trainmem does
            not model.
    """
    f = "training_args"
    args = _load(path, "json", f)
    r = _Reading("TrainingArguments", path, f)
    sft = any(k in args for k in _SFT_KEYS)
    if sft:
        r.label = "SFTConfig"
    if sft:  # TRL's SFTTrainer: its release's QLoRA preparation (TrainingConfig.trl_release)
        r.set("framework", "trl", "SFTConfig: TRL's SFTTrainer")
    else:
        r.set("framework", "hf-trainer", "the HF Trainer")
    mbs = r.positive(args, "per_device_train_batch_size")
    r.set(
        "micro_batch_size", mbs or 8, "per_device_train_batch_size" + ("" if mbs else " default 8")
    )
    gas = r.positive(args, "gradient_accumulation_steps")
    r.set("gradient_accumulation_steps", gas or 1, "gradient_accumulation_steps")
    deepspeed = args.get("deepspeed")
    _hf_precision(r, args, sft, deepspeed not in (None, ""))
    flag = "true or false"
    gc = r.get(args, "activation_checkpointing", bool, flag)
    gc = r.get(args, "gradient_checkpointing", bool, flag) if gc is None else gc
    if gc is None and sft:
        gc = True  # trl base_config.py: gradient_checkpointing defaults to True
        r.read.append("gradient_checkpointing default true (TRL)")
    if gc:
        r.set("activation_checkpointing", "full", "gradient_checkpointing")
    if r.get(args, "activation_offloading", bool, flag):
        r.set("activation_offloading", True, "activation_offloading")
    if r.get(args, "torch_compile", bool, flag):
        r.set("compile", True, "torch_compile")
    optim = args.get("optim")
    if optim is not None:
        if not _known(optim, HF_OPTIMIZERS):
            raise r.fail("optim", optim, HF_OPTIMIZERS)
        optimizer, impl = HF_OPTIMIZERS[optim]
        r.set("optimizer", optimizer, "optim")
        if impl is not None:
            r.set("optimizer_implementation", impl, "optim")
    seq = r.positive(args, "max_length") if "max_length" in args else None
    seq = r.positive(args, "max_seq_length") if seq is None else seq
    if seq is not None:
        r.set("seq_len", seq, "max_length" if "max_length" in args else "max_seq_length")
    elif sft and "max_length" not in args:
        r.set("seq_len", 1024, "max_length default 1024 (TRL)")
    elif sft:
        r.extra.append("max_length null: no truncation, give --seq-len (the longest)")
    _hf_fsdp(r, args)
    if deepspeed not in (None, ""):
        trainer = {
            k: r.out[k] for k in ("micro_batch_size", "gradient_accumulation_steps", "precision")
        }
        _with_deepspeed(r, "deepspeed", deepspeed, path, trainer)
    r.ignore(args, _HF_IGNORED)
    return r.finish(notes)
