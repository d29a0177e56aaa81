"""Read the config files people already have: a DeepSpeed ``ds_config.json`` and an accelerate
config (YAML written by ``accelerate config``), into TrainingConfig field values.

Only settings that change memory are read; ``"auto"`` values (filled in by the HF Trainer at run
time) are skipped. Unknown keys are ignored, as DeepSpeed and accelerate themselves ignore keys
they do not use.

Sources: DeepSpeed config JSON reference (https://www.deepspeed.ai/docs/config-json/:
``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``bf16.enabled``,
``fp16.enabled``, ``zero_optimization.stage``, ``offload_optimizer.device``,
``offload_param.device``); accelerate ``ClusterConfig`` fields (accelerate/commands/config/
config_args.py: ``distributed_type``, ``mixed_precision``, ``num_processes``, ``fsdp_config``,
``deepspeed_config``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainmem.errors import SpecError
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


def _load(path: str, kind: str, field: str) -> dict[str, Any]:
    try:
        text = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(field, f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        if kind == "json":
            data = json.loads(text)
        else:
            import yaml  # type: ignore[import-untyped]

            data = yaml.safe_load(text)
    except (json.JSONDecodeError, ValueError) as exc:
        raise SpecError(field, f"{path} is not valid {kind.upper()}: {exc}") from exc
    except Exception as exc:  # yaml.YAMLError and kin: one clear line
        raise SpecError(field, f"{path} is not valid {kind.upper()}: {exc}") from exc
    if not isinstance(data, dict):
        raise SpecError(field, f"{path} must hold a mapping at the top level")
    return data


def _set(out: dict[str, Any], key: str, value: Any) -> None:
    if value is not None and value != "auto":
        out[key] = value


def _precision(bf16: bool, fp16: bool) -> str | None:
    if bf16:
        return "bf16-mixed"
    if fp16:
        return "16-mixed"
    return None


def deepspeed_settings(ds: dict[str, Any]) -> dict[str, Any]:
    """TrainingConfig field values from a parsed DeepSpeed config (see module docstring)."""
    out: dict[str, Any] = {"framework": "deepspeed"}
    _set(out, "micro_batch_size", ds.get("train_micro_batch_size_per_gpu"))
    _set(out, "gradient_accumulation_steps", ds.get("gradient_accumulation_steps"))
    bf16 = bool((ds.get("bf16") or ds.get("bfloat16") or {}).get("enabled") is True)
    fp16 = bool((ds.get("fp16") or {}).get("enabled") is True)
    _set(out, "precision", _precision(bf16, fp16))
    zero = ds.get("zero_optimization") or {}
    _set(out, "zero_stage", zero.get("stage"))
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size"):
        bucket = zero.get(key)
        if bucket == "auto" or isinstance(bucket, (int, float)):
            out[key] = bucket if bucket == "auto" else int(bucket)
    if isinstance(zero.get("overlap_comm"), bool):
        out["overlap_comm"] = zero["overlap_comm"]
    opt_dev = (zero.get("offload_optimizer") or {}).get("device", "none")
    param_dev = (zero.get("offload_param") or {}).get("device", "none")
    if param_dev in ("cpu", "nvme"):
        out["offload"] = "optimizer+params"
    elif opt_dev in ("cpu", "nvme"):
        out["offload"] = "optimizer"
    if (ds.get("activation_checkpointing") or {}).get("partition_activations"):
        out["activation_checkpointing"] = "full"
    return out


def read_deepspeed_config(path: str) -> dict[str, Any]:
    """TrainingConfig field values from a DeepSpeed ``ds_config.json``.

    Raises:
        SpecError: the file cannot be read or is not a JSON object.
    """
    return deepspeed_settings(_load(path, "json", "deepspeed_config"))


def read_accelerate_config(path: str) -> dict[str, Any]:
    """TrainingConfig field values from an accelerate config YAML (or JSON).

    Raises:
        SpecError: unreadable file, not a mapping, or an FSDP sharding strategy not known.
    """
    kind = "json" if path.endswith(".json") else "yaml"
    cfg = _load(path, kind, "accelerate_config")
    out: dict[str, Any] = {}
    mp = str(cfg.get("mixed_precision", "no")).lower()
    _set(out, "precision", _precision(mp == "bf16", mp == "fp16"))
    if mp == "fp8":
        raise SpecError("accelerate_config", "mixed_precision fp8 is not modelled yet")
    n = cfg.get("num_processes")
    if isinstance(n, int) and n > 0:
        out["data_parallel_size"] = n
    kind_ = str(cfg.get("distributed_type", "NO")).upper()
    if kind_ == "FSDP":
        fsdp = cfg.get("fsdp_config") or {}
        strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).upper()
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
        machines = cfg.get("num_machines")
        if name.startswith("hybrid") and isinstance(n, int) and isinstance(machines, int):
            out["shard_group_size"] = max(n // max(machines, 1), 1)  # GPUs of one node
        # FSDP (v1) through accelerate: MixedPrecision(param_dtype=bf16); FSDP2 below
        out["framework"] = "accelerate-fsdp"
        if str(fsdp.get("fsdp_offload_params", False)).lower() == "true":
            out["offload"] = "optimizer+params" if out["zero_stage"] == 3 else "optimizer"
        if str(fsdp.get("fsdp_activation_checkpointing", False)).lower() == "true":
            out["activation_checkpointing"] = "full"
        if str(fsdp.get("fsdp_version", 1)) == "2":
            out["framework"] = "fsdp2"
    elif kind_ == "DEEPSPEED":
        ds = cfg.get("deepspeed_config") or {}
        file = ds.get("deepspeed_config_file")
        if file:
            base = Path(path).expanduser().parent
            nested = file if Path(file).is_absolute() else str(base / file)
            out.update(
                {
                    k: v
                    for k, v in read_deepspeed_config(nested).items()
                    if k not in out or k == "framework"
                }
            )
        else:
            out["framework"] = "deepspeed"
            _set(out, "zero_stage", ds.get("zero_stage"))
            _set(out, "gradient_accumulation_steps", ds.get("gradient_accumulation_steps"))
            if ds.get("offload_param_device") in ("cpu", "nvme"):
                out["offload"] = "optimizer+params"
            elif ds.get("offload_optimizer_device") in ("cpu", "nvme"):
                out["offload"] = "optimizer"
    return out
