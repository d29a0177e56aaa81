"""Read the config files people already have: a DeepSpeed ``ds_config.json`` and an accelerate
config (YAML written by ``accelerate config``), into TrainingConfig field values.

Only settings that change memory are read. A DeepSpeed config is read as DeepSpeed reads it: a
run with no ``bf16`` / ``fp16`` section, or with both disabled, is fp32 (``32-true``; runtime/
precision_config.py ``DeepSpeedBF16Config.enabled`` / ``DeepSpeedFP16Config.enabled`` default to
False, and nothing autocasts). An ``"auto"`` value is what the HF Trainer fills in from its own
arguments (transformers integrations/deepspeed.py ``HfTrainerDeepSpeedConfig.
trainer_config_process``: ``train_micro_batch_size_per_gpu`` <- ``per_device_train_batch_size``,
``bf16.enabled`` <- ``bf16`` ...), for trainmem the option's own value (an explicit flag or the
default): it is left out of the settings read and reported through ``auto``. Unknown keys are
ignored, as DeepSpeed and accelerate themselves ignore keys they do not use.

Sources: DeepSpeed config JSON reference (https://www.deepspeed.ai/docs/config-json/:
``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``bf16.enabled``,
``fp16.enabled``, ``zero_optimization.stage``, ``offload_optimizer.device``,
``offload_param.device``, ``data_types.grad_accum_dtype``); accelerate ``ClusterConfig`` fields
(accelerate/commands/config/config_args.py: ``distributed_type``, ``mixed_precision``,
``num_processes``, ``fsdp_config``, ``deepspeed_config``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from trainmem.errors import SpecError
from trainmem.specs.files import parse_json, read_text_file, resolve_path
from trainmem.specs.training import fsdp_settings

_FSDP_STRATEGIES = {
    "FULL_SHARD": "full-shard",
    "1": "full-shard",
    "SHARD_GRAD_OP": "shard-grad-op",
    "2": "shard-grad-op",
    "NO_SHARD": "no-shard",
    "3": "no-shard",
    "HYBRID_SHARD": "hybrid-shard",
    "4": "hybrid-shard",
    "HYBRID_SHARD_ZERO2": "hybrid-shard-zero2",
    "5": "hybrid-shard-zero2",
}
"""FSDP ``ShardingStrategy`` names (or accelerate's older 1-5 numbering) as ``--fsdp`` values
(:func:`trainmem.specs.training.fsdp_settings`); HYBRID_SHARD_ZERO2 is SHARD_GRAD_OP within a
node."""


_DS_DTYPES = {
    **dict.fromkeys(("fp32", "float32", "float", "torch.float32"), "float32"),
    **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "bfloat16"),
    **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), "float16"),
}
"""DeepSpeed ``data_types.grad_accum_dtype`` spellings (runtime/config.py ``DtypeEnum``; its
``int8`` is not a gradient accumulation dtype) as torch spellings."""


MAX_YAML_NODES = 10_000
"""Most YAML nodes a config may expand to once aliases are followed. An accelerate config has a
few dozen; a "billion laughs" file (aliases of aliases) expands to billions from a few lines and
would exhaust memory as soon as anything walked it."""


def _expanded_nodes(node: Any, sizes: dict[int, int], open_: set[int]) -> int:
    """Nodes ``node`` stands for with every alias expanded (memoised on the shared nodes)."""
    import yaml  # type: ignore[import-untyped]

    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise yaml.YAMLError("a recursive alias (a node that contains itself)")
    open_.add(key)
    n = 1
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            n += _expanded_nodes(k, sizes, open_) + _expanded_nodes(v, sizes, open_)
            if n > MAX_YAML_NODES:
                break
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            n += _expanded_nodes(item, sizes, open_)
            if n > MAX_YAML_NODES:
                break
    open_.discard(key)
    if n > MAX_YAML_NODES:
        raise yaml.YAMLError(
            f"expands to more than {MAX_YAML_NODES:,} nodes through its aliases (&anchor / "
            "*alias); write the values out"
        )
    sizes[key] = n
    return n


def _safe_yaml(text: str) -> Any:
    """``yaml.safe_load`` (plain data, no Python tags) that refuses alias expansion beyond
    :data:`MAX_YAML_NODES`."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):  # type: ignore[misc]
        def get_single_node(self) -> Any:
            node = super().get_single_node()
            if node is not None:
                _expanded_nodes(node, {}, set())
            return node

    return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - a SafeLoader subclass


def _load(path: str, kind: str, field: str) -> dict[str, Any]:
    file = resolve_path(path, field)
    text = read_text_file(file, field)
    name = str(file)[:200]
    if kind == "json":
        data = parse_json(text, name, field)
    else:
        try:
            data = _safe_yaml(text)
        except RecursionError as exc:
            raise SpecError(field, f"{name} is nested too deeply to be a config") from exc
        except Exception as exc:  # yaml.YAMLError and kin: one clear line
            reason = " ".join(str(exc).split())[:200]
            raise SpecError(field, f"{name} is not valid YAML: {reason}") from exc
    if not isinstance(data, dict):
        raise SpecError(field, f"{name} must hold a mapping at the top level")
    return data


def _section(cfg: dict[str, Any], key: str, field: str) -> dict[str, Any]:
    """A nested mapping (``{}`` when absent or null)."""
    value = cfg.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(field, f"{key} must be a mapping, got {type(value).__name__}")
    return value


def _value(cfg: dict[str, Any], key: str, field: str, kind: type, what: str) -> Any:
    """A scalar of type ``kind`` (None when absent, null or ``"auto"``)."""
    value = cfg.get(key)
    if value is None or value == "auto":
        return None
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        shown = repr(value) if isinstance(value, str | int | float) else type(value).__name__
        raise SpecError(field, f"{key} must be {what}, got {shown[:80]}")
    return value


def _device(cfg: dict[str, Any], key: str, field: str) -> str:
    device = _value(_section(cfg, key, field), "device", field, str, "cpu, nvme or none")
    return "none" if device is None else device


def _set(out: dict[str, Any], key: str, value: Any) -> None:
    if value is not None and value != "auto":
        out[key] = value


def _precision(bf16: bool, fp16: bool) -> str | None:
    if bf16:
        return "bf16-mixed"
    if fp16:
        return "16-mixed"
    return None


def _deepspeed_precision(ds: dict[str, Any], auto: dict[str, str]) -> str | None:
    """The precision a DeepSpeed config trains in: ``bf16-mixed`` / ``16-mixed`` for an enabled
    ``bf16`` (or its old name ``bfloat16``) / ``fp16`` section, ``32-true`` when neither is
    enabled, None when an ``"auto"`` leaves it to the Trainer's precision (recorded in ``auto``).

    Source: deepspeed/runtime/precision_config.py ``get_bfloat16_config`` /
    ``get_float16_config`` (``enabled: bool = False``); runtime/config.py (``'bfloat16 and fp16
    modes cannot be simultaneously enabled'``).

    Raises:
        SpecError: a section that is not a mapping, an ``enabled`` that is not a flag, or both
            sections enabled (DeepSpeed refuses it).
    """
    f = "deepspeed_config"
    flag = 'true, false or "auto"'
    bf16_key = "bf16" if ds.get("bf16") is not None else "bfloat16"
    sections = {bf16_key: _section(ds, bf16_key, f), "fp16": _section(ds, "fp16", f)}
    enabled = {k: _value(v, "enabled", f, bool, flag) for k, v in sections.items()}
    bf16, fp16 = enabled[bf16_key] is True, enabled["fp16"] is True
    if bf16 and fp16:
        raise SpecError(
            f,
            f"{bf16_key} and fp16 are both enabled; DeepSpeed refuses it (runtime/config.py: "
            "'bfloat16 and fp16 modes cannot be simultaneously enabled'); enable one",
        )
    if bf16 or fp16:
        return _precision(bf16, fp16)
    autos = [k for k, v in sections.items() if v.get("enabled") == "auto"]
    if autos:
        auto["precision"] = " / ".join(f"{k}.enabled" for k in autos)
        return None
    return "32-true"


def deepspeed_settings(ds: dict[str, Any], auto: dict[str, str] | None = None) -> dict[str, Any]:
    """TrainingConfig field values from a parsed DeepSpeed config (see module docstring).

    Args:
        ds: the parsed ``ds_config.json``.
        auto: if given, receives ``{field: DeepSpeed key}`` for every ``"auto"`` value that
            leaves a field to the Trainer (the field is then not in the result).

    Returns:
        TrainingConfig field values.

    Raises:
        SpecError: a section that is not a mapping, or a value of the wrong type.
    """
    f = "deepspeed_config"
    auto = {} if auto is None else auto
    out: dict[str, Any] = {"framework": "deepspeed"}
    integer = 'an integer or "auto"'
    for field, key in (
        ("micro_batch_size", "train_micro_batch_size_per_gpu"),
        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
    ):
        _set(out, field, _value(ds, key, f, int, integer))
        if ds.get(key) == "auto":
            auto[field] = key
    _set(out, "precision", _deepspeed_precision(ds, auto))
    zero = _section(ds, "zero_optimization", f)
    _set(out, "zero_stage", _value(zero, "stage", f, int, "0, 1, 2 or 3"))
    for key in (
        "reduce_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
    ):
        bucket = zero.get(key)
        if bucket is None or bucket == "auto":
            if bucket == "auto":
                out[key] = bucket
            continue
        if isinstance(bucket, bool) or not isinstance(bucket, int | float):
            raise SpecError(f, f'{key} must be a number of elements or "auto", got {bucket!r:.80}')
        if not math.isfinite(bucket) or not 0 <= bucket <= 2**62:
            raise SpecError(f, f"{key} must be a non-negative number of elements, got {bucket!r}")
        out[key] = int(bucket)
    flag = 'true, false or "auto"'
    overlap = _value(zero, "overlap_comm", f, bool, flag)
    if overlap is not None:
        out["overlap_comm"] = overlap
    opt_dev = _device(zero, "offload_optimizer", f)
    param_dev = _device(zero, "offload_param", f)
    if param_dev in ("cpu", "nvme"):
        out["offload"] = "optimizer+params"
    elif opt_dev in ("cpu", "nvme"):
        out["offload"] = "optimizer"
    if _value(_section(ds, "activation_checkpointing", f), "partition_activations", f, bool, flag):
        out["activation_checkpointing"] = "full"
    accum = _value(_section(ds, "data_types", f), "grad_accum_dtype", f, str, "a dtype name")
    if accum is not None:
        if accum not in _DS_DTYPES:
            raise SpecError(
                f,
                f"data_types.grad_accum_dtype {accum!r:.40} unknown; allowed: "
                + ", ".join(_DS_DTYPES),
            )
        out["grad_accum_dtype"] = _DS_DTYPES[accum]
    return out


def read_deepspeed_config(path: str, auto: dict[str, str] | None = None) -> dict[str, Any]:
    """TrainingConfig field values from a DeepSpeed ``ds_config.json``.

    Args:
        path: the file.
        auto: as :func:`deepspeed_settings`.

    Returns:
        TrainingConfig field values.

    Raises:
        SpecError: the file cannot be read or is not a JSON object.
    """
    return deepspeed_settings(_load(path, "json", "deepspeed_config"), auto)


def _scalar_text(cfg: dict[str, Any], key: str, field: str, default: str) -> str:
    """A scalar setting as text (accelerate writes ``true`` or ``"true"``, ``2`` or ``"2"``)."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, str | int | float | bool):
        raise SpecError(field, f"{key} must be a single value, got {type(value).__name__}")
    return str(value)


def read_accelerate_config(path: str, auto: dict[str, str] | None = None) -> dict[str, Any]:
    """TrainingConfig field values from an accelerate config YAML (or JSON).

    Args:
        path: the file.
        auto: as :func:`deepspeed_settings`, for the ``deepspeed_config_file`` it names.

    Returns:
        TrainingConfig field values.

    Raises:
        SpecError: unreadable file, not a mapping, or an FSDP sharding strategy not known.
    """
    kind = "json" if path.endswith(".json") else "yaml"
    cfg = _load(path, kind, "accelerate_config")
    out: dict[str, Any] = {}
    f = "accelerate_config"
    mp = _scalar_text(cfg, "mixed_precision", f, "no").lower()  # YAML reads a bare no as false
    _set(out, "precision", _precision(mp == "bf16", mp == "fp16"))
    if mp == "fp8":
        raise SpecError("accelerate_config", "mixed_precision fp8 is not modelled yet")
    kind_ = _scalar_text(cfg, "distributed_type", f, "NO").upper()
    if mp in ("no", "false") and kind_ != "DEEPSPEED":
        # accelerate/accelerator.py: mixed_precision "no" runs no autocast: fp32 training
        # (under DeepSpeed the ds_config's own bf16 / fp16 section decides, read below)
        out["precision"] = "32-true"
    # A plain `accelerate launch` script builds its own torch.optim.AdamW, whose default on
    # CUDA is the foreach implementation (torch/optim/optimizer.py
    # _default_to_fused_or_foreach); the HF Trainer's fused default (training_args.py,
    # torch >= 2.8) applies only under the Trainer (--framework hf-trainer).
    out["optimizer_implementation"] = "foreach"
    n = _value(cfg, "num_processes", f, int, "a positive integer")
    if n is not None and n > 0:
        out["data_parallel_size"] = n
    if kind_ == "FSDP":
        fsdp = _section(cfg, "fsdp_config", f)
        strategy = _scalar_text(fsdp, "fsdp_sharding_strategy", f, "FULL_SHARD").upper()
        if strategy not in _FSDP_STRATEGIES:
            raise SpecError(
                "accelerate_config",
                f"fsdp_sharding_strategy {strategy!r} unknown; allowed: "
                + ", ".join(k for k in _FSDP_STRATEGIES if not k.isdigit()),
            )
        name = _FSDP_STRATEGIES[strategy]
        out.update(fsdp_settings(0, name.replace("-zero2", "")))
        if name == "hybrid-shard-zero2":
            out["reshard_after_forward"] = False
        machines = _value(cfg, "num_machines", f, int, "a positive integer")
        if name.startswith("hybrid") and n is not None and machines is not None:
            out["shard_group_size"] = max(n // max(machines, 1), 1)  # GPUs of one node
        # FSDP (v1) through accelerate: MixedPrecision(param_dtype=bf16); FSDP2 below
        out["framework"] = "accelerate-fsdp"
        if _scalar_text(fsdp, "fsdp_offload_params", f, "false").lower() == "true":
            out["offload"] = "optimizer+params" if out["zero_stage"] == 3 else "optimizer"
        if _scalar_text(fsdp, "fsdp_activation_checkpointing", f, "false").lower() == "true":
            out["activation_checkpointing"] = "full"
        if _scalar_text(fsdp, "fsdp_version", f, "1") == "2":
            out["framework"] = "fsdp2"
    elif kind_ == "DEEPSPEED":
        ds = _section(cfg, "deepspeed_config", f)
        file = _value(ds, "deepspeed_config_file", f, str, "a path")
        if file:
            base = Path(path).expanduser().parent
            nested = file if Path(file).is_absolute() else str(base / file)
            out.update(
                {
                    k: v
                    for k, v in read_deepspeed_config(nested, auto).items()
                    if k not in out or k == "framework"
                }
            )
        else:
            out["framework"] = "deepspeed"
            integer = 'an integer or "auto"'
            _set(out, "zero_stage", _value(ds, "zero_stage", f, int, "0, 1, 2 or 3"))
            _set(
                out,
                "gradient_accumulation_steps",
                _value(ds, "gradient_accumulation_steps", f, int, integer),
            )
            devices = "cpu, nvme or none"
            if _value(ds, "offload_param_device", f, str, devices) in ("cpu", "nvme"):
                out["offload"] = "optimizer+params"
            elif _value(ds, "offload_optimizer_device", f, str, devices) in ("cpu", "nvme"):
                out["offload"] = "optimizer"
    return out
