"""Read a Hugging Face ``config.json`` into a :class:`~trainmem.specs.model.ModelSpec`.

This module (with its parts ``hf_fields.py``, typed reads, and ``hf_table.py``, one row per
family) is the only place that knows Hugging Face field names (``n_layer``,
``num_hidden_layers``, ``num_key_value_heads``, ``multi_query``...). Shipped presets are
plain ``config.json`` files in ``presets/`` and go through the same code path as a file a
user passes by path, so there is one loader, not two.

A config is read through its family's row in :data:`~trainmem.specs.hf_table.FAMILIES`: the
canonical transformers field name first, then the family's ``attribute_map`` alias, with the
defaults of ``configuration_<family>.py`` (transformers 5.x) for fields a config leaves out,
and the traits of ``modeling_<family>.py``. The shape fields (layers, width, heads,
vocabulary, MLP width where the family has no rule for it) are required: an estimate
silently built on a library default would be worse than an error.

No network access happens here except for an ``org/name`` hub id that is neither a preset
nor a local path, and only when ``huggingface_hub`` is installed (``pip install
trainmem[hub]``).
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from trainmem.errors import SpecError, UnsupportedError
from trainmem.specs.diffusers import is_diffusers_config
from trainmem.specs.files import parse_json, path_kind, read_text_file, resolve_path
from trainmem.specs.hf_fields import Config, Fields, short
from trainmem.specs.hf_table import FAMILIES, Family
from trainmem.specs.hub import hub_config_path
from trainmem.specs.model import HeadKind, ModelSpec

__all__ = [
    "PRESETS_DIR",
    "SUPPORTED_MODEL_TYPES",
    "list_presets",
    "load_hf_config",
    "load_model_spec",
    "model_spec_from_hf",
    "preset_index",
]

PRESETS_DIR = Path(__file__).parent / "presets"
"""Folder holding the shipped ``<preset>.json`` configs and ``index.json``."""

# ---------------------------------------------------------------------------------------
# Finding and reading a config
# ---------------------------------------------------------------------------------------


def preset_index() -> dict[str, dict[str, str | int | None]]:
    """The preset index: preset name -> ``{"file", "hub_id", "source"}``, plus
    ``num_parameters`` for presets no formula family counts (diffusers models; checked against
    the meta-built model's numel in tests/specs/test_diffusers_presets.py).

    Returns:
        A fresh dict read from ``presets/index.json``; ``hub_id`` is None for the tiny
        test configs that exist only here.
    """
    with (PRESETS_DIR / "index.json").open(encoding="utf-8") as f:
        index: dict[str, dict[str, str | int | None]] = json.load(f)
    return index


def list_presets() -> list[str]:
    """Names of the shipped model presets, sorted.

    Returns:
        Preset names accepted by :func:`load_hf_config` (``"gpt2"``, ``"llama-3.1-8b"``...).
    """
    return sorted(preset_index())


def _read_json(path: Path) -> dict[str, Any]:
    data = parse_json(read_text_file(path, "model"), str(path)[:200], "model")
    if not isinstance(data, dict):
        raise SpecError(
            "model",
            f"{str(path)[:200]} holds a JSON {type(data).__name__}, expected an object "
            "(a Hugging Face config.json)",
        )
    return data


def load_hf_config(name_or_path: str) -> dict[str, Any]:
    """Load a Hugging Face config dict by preset name, path, or hub id.

    Resolution order: a shipped preset name (``"llama-3.1-8b"``) or the hub id a preset was
    taken from (``"meta-llama/Llama-3.1-8B"``, case-insensitive, served offline); an
    existing path to a ``config.json`` or to a folder holding one; an ``org/name`` hub id,
    fetched with ``huggingface_hub`` only if it is installed.

    Args:
        name_or_path: preset name, file or folder path, or hub id.

    Returns:
        The parsed ``config.json`` as a dict.

    Raises:
        SpecError: unknown preset (with close names), unreadable or non-JSON file, folder
            without ``config.json``, or a hub id that cannot be fetched.
    """
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise SpecError(
            "model",
            f"must be a preset name, a config.json path or a hub id, got {short(name_or_path)}",
        )
    timm_name = name_or_path.strip()
    if timm_name.lower().startswith(TIMM_PREFIX):
        return timm_config(timm_name[len(TIMM_PREFIX) :])
    index = preset_index()
    by_hub_id = {str(e["hub_id"]).lower(): name for name, e in index.items() if e["hub_id"]}
    by_name = {name.lower(): name for name in index}  # presets ignore case: llama-3.1-8B
    folded = name_or_path.strip().lower()
    preset = by_name.get(folded) or by_hub_id.get(folded)
    if preset is not None:
        return _read_json(PRESETS_DIR / str(index[preset]["file"]))

    path = resolve_path(name_or_path, "model")
    kind = path_kind(path)
    if kind == "dir":
        config_file = path / "config.json"
        if path_kind(config_file) is None:
            raise SpecError("model", f"folder {str(path)[:200]} has no config.json")
        return _read_json(config_file)
    if kind == "file":
        return _read_json(path)

    looks_like_path = name_or_path.endswith(".json") or name_or_path.startswith((".", "/", "~"))
    if not looks_like_path and name_or_path.count("/") == 1:
        return _read_json(hub_config_path(name_or_path))

    close = difflib.get_close_matches(name_or_path[:100].lower(), list(index), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    what = "file or folder not found" if looks_like_path else "unknown model preset"
    raise SpecError(
        "model",
        f"{what} {short(name_or_path)}; {hint}list presets with `trainmem models`, "
        "or pass the path to a Hugging Face config.json",
    )


TIMM_PREFIX = "timm:"
"""A model name given as ``timm:<name>`` (``timm:resnet50``, ``timm:vit_base_patch16_224``) is
the timm model of that name, as ``timm.create_model`` builds it."""


def timm_config(name: str) -> dict[str, Any]:
    """The config of the timm model ``name`` (``resnet50``), as the Hugging Face hub stores a
    timm model's ``config.json`` (``architecture``, ``num_classes``; timm/_hub.py
    ``save_config_for_hf``); its input size is the model's own ``pretrained_cfg``.

    Raises:
        SpecError: an empty or malformed name.
    """
    if not name or not all(c.isalnum() or c in "_.-" for c in name) or len(name) > 200:
        raise SpecError(
            "model",
            f"timm:{short(name)} is not a timm model name; allowed: timm:<name> with a name "
            "`timm.list_models()` gives, e.g. timm:resnet50",
        )
    return {"architecture": name}


def is_timm_config(config: Mapping[str, Any]) -> bool:
    """A timm model's config (``architecture`` naming a timm model, no transformers
    ``model_type``, no diffusers ``_class_name``): the hub's timm ``config.json`` layout."""
    return (
        isinstance(config.get("architecture"), str)
        and not config.get("model_type")
        and not config.get("_class_name")
    )


def load_model_spec(name_or_path: str) -> ModelSpec:
    """Load a preset, config file or hub id straight into a ModelSpec.

    Args:
        name_or_path: anything :func:`load_hf_config` accepts.

    Returns:
        The spec, named after ``name_or_path`` (a preset by its own spelling).
    """
    presets = {p.lower(): p for p in list_presets()} if isinstance(name_or_path, str) else {}
    name = presets.get(name_or_path.strip().lower(), name_or_path) if presets else name_or_path
    return model_spec_from_hf(load_hf_config(name_or_path), name=name)


# ---------------------------------------------------------------------------------------
# Reading a config through its family's row (specs/hf_table.py)
# ---------------------------------------------------------------------------------------

_REQUIRED = frozenset(
    {"num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"}
)
"""Shape fields every row reads, with no library default unless the row gives one."""

_READS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("num_hidden_layers", ("num_layers",), "int"),
    ("hidden_size", ("hidden_size",), "int"),
    ("num_attention_heads", ("num_heads",), "int"),
    ("num_key_value_heads", ("num_kv_heads",), "kv"),
    ("head_dim", ("head_dim",), "head_dim"),
    ("intermediate_size", ("intermediate_size",), "int"),
    ("hidden_act", ("hidden_act",), "str"),
    ("vocab_size", ("vocab_size",), "int"),
    ("max_position_embeddings", ("max_position_embeddings",), "int"),
    ("type_vocab_size", ("type_vocab_size",), "int"),
    ("tie_word_embeddings", ("tie_word_embeddings",), "flag"),
    ("attention_bias", ("attention_bias", "attention_out_bias"), "flag"),
    ("qkv_bias", ("attention_bias",), "flag"),
    ("mlp_bias", ("mlp_bias",), "flag"),
    ("parallel_attention", ("parallel_attention",), "flag"),
    ("qk_norm", ("qk_norm",), "flag"),
    ("partial_rotary_factor", ("partial_rotary_factor",), "fraction"),
    ("num_experts", ("num_experts",), "int"),
    ("num_experts_per_tok", ("num_experts_per_tok",), "int"),
    ("hidden_dropout", ("hidden_dropout",), "prob"),
    ("attention_dropout", ("attention_dropout",), "prob"),
    ("embedding_dropout", ("embedding_dropout",), "prob"),
)
"""Canonical quantity (transformers' canonical config name where it has one), the ModelSpec
fields it sets, and how it is validated; read in this order, so a default may depend on an
earlier value."""

_HEAD_BY_ARCHITECTURE: dict[str, HeadKind] = {
    "decoder": "causal-lm",
    "encoder": "masked-lm",
    "vision-encoder": "none",
    "encoder-decoder": "seq2seq-lm",
}


# ---------------------------------------------------------------------------------------
# Head (task) from `architectures`
# ---------------------------------------------------------------------------------------

_HEAD_SUFFIXES: tuple[tuple[str, HeadKind], ...] = (
    ("ForCausalLM", "causal-lm"),
    ("LMHeadModel", "causal-lm"),
    ("ForMaskedLM", "masked-lm"),
    ("ForSequenceClassification", "sequence-classification"),
    ("ForImageClassification", "image-classification"),
    ("ForConditionalGeneration", "seq2seq-lm"),
)


def read_head(fields: Fields, default: HeadKind) -> tuple[HeadKind, int]:
    """Head kind from ``architectures[0]`` and its label count.

    ``FooModel`` (no ``For``) is the bare trunk, head ``none``. Labels come from
    ``id2label`` if present, else ``num_labels``, else transformers' default of 2.
    """
    architectures = fields.config.get("architectures")
    head: HeadKind = default
    if architectures:
        if not isinstance(architectures, list) or not isinstance(architectures[0], str):
            raise SpecError(
                "architectures", f"must be a list of class names, got {short(architectures)}"
            )
        arch = architectures[0]
        for suffix, kind in _HEAD_SUFFIXES:
            if arch.endswith(suffix):
                head = kind
                break
        else:
            if arch.endswith("Model") and "For" not in arch:
                head = "none"
            else:
                supported = ", ".join(s for s, _ in _HEAD_SUFFIXES)
                raise UnsupportedError(
                    f"architectures: head {short(arch)} is not modelled (supported: classes "
                    f"ending in {supported}, or a bare XModel); edit 'architectures' in the config "
                    "to the closest supported class, or use --engine trace"
                )
    if head not in ("sequence-classification", "image-classification"):
        return head, 0
    id2label = fields.config.get("id2label")
    if isinstance(id2label, dict) and id2label:
        return head, len(id2label)
    return head, fields.positive_int("num_labels", 2)


def _key(row: Family, config: Config, canonical: str) -> str:
    """The config key holding ``canonical`` for this family: the first present of its
    rename, or the canonical name then its ``attribute_map`` alias then a legacy name; if none
    is present, the name the family's config stores it under (for an error message)."""
    if canonical in row.renames:
        return row.renames[canonical]
    names = [canonical, row.aliases.get(canonical), row.legacy.get(canonical)]
    for name in names:
        if name is not None and config.get(name) is not None:
            return name
    return row.aliases.get(canonical, canonical)


def _read(row: Family, f: Fields, spec: dict[str, Any]) -> None:
    """Fill ``spec`` with every quantity the row reads, in :data:`_READS` order."""
    for canonical, targets, kind in _READS:
        if all(t in row.traits for t in targets):
            continue
        if canonical in row.derived:
            spec[targets[0]] = row.derived[canonical](spec)
            continue
        listed = canonical in row.defaults
        if not listed and canonical not in _REQUIRED and kind not in ("kv", "head_dim"):
            continue
        key = _key(row, f.config, canonical)
        default: Any = row.defaults.get(canonical)
        if callable(default):
            default = default(spec) if f.config.get(key) is None else None
        if kind == "int":
            value: Any = f.positive_int(key, default)
        elif kind == "kv":
            heads = spec["num_heads"]
            value = f.kv_heads(key, heads, default) if listed else heads
        elif kind == "head_dim":
            if f.config.get("head_dim") is None and default is not None:
                value = default
            else:
                heads_key = _key(row, f.config, "num_attention_heads")
                hidden_key = _key(row, f.config, "hidden_size")
                value = f.head_dim(spec["hidden_size"], spec["num_heads"], heads_key, hidden_key)
        elif kind == "str":
            value = f.string(key, default)
        elif kind == "flag":
            value = f.flag(key, default)
        elif kind == "fraction":
            value = f.fraction(key, default)
        else:
            value = f.prob(key, default)
        for target in targets:
            if target not in row.traits:
                spec[target] = value
    if spec.get("num_experts_per_tok", 1) > spec.get("num_experts", 1):
        raise SpecError(
            _key(row, f.config, "num_experts_per_tok"),
            f"{spec['num_experts_per_tok']} exceeds "
            f"{_key(row, f.config, 'num_experts')}={spec['num_experts']}",
        )


SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(FAMILIES))
HF_MODEL_TYPES: tuple[str, ...] = tuple(
    t
    for t in SUPPORTED_MODEL_TYPES
    if not (FAMILIES[t].not_transformers or FAMILIES[t].analytic_only)
)
"""The supported ``model_type`` values a Hugging Face config.json can carry (trainmem's own,
``cs336_basics`` and ``torchvision_vit``, left out)."""
"""HF ``model_type`` values :func:`model_spec_from_hf` understands."""


def model_spec_from_hf(config: Mapping[str, Any], name: str) -> ModelSpec:
    """Translate a Hugging Face config dict into a ModelSpec.

    Args:
        config: the parsed ``config.json``.
        name: what to call the spec (preset name or path).

    Returns:
        The spec; its parameter count equals ``sum(p.numel())`` of the transformers model
        class named in ``architectures`` (tested per preset on the meta device).

    Raises:
        SpecError: missing ``model_type`` or required shape field, a non-positive size,
            heads that do not divide the width.
        UnsupportedError: a ``model_type`` or option that is not modelled, or a diffusers
            config (``_class_name``: the trace engine builds those).
    """
    if not isinstance(config, Mapping):
        raise SpecError("model", f"a config must be a mapping, got {short(config)}")
    if is_timm_config(config):
        raise UnsupportedError(
            f"{short(config.get('architecture'))} is a timm model, not a formula family of the "
            "analytic engine; use --engine generic (it builds the model with timm)"
        )
    if is_diffusers_config(config):
        raise UnsupportedError(
            f"{short(config.get('_class_name'))} is a diffusers model, not a formula family of "
            "the analytic engine; use --engine trace (it builds the model with diffusers)"
        )
    model_type = config.get("model_type")
    if not model_type or not isinstance(model_type, str):
        # a training-arguments file passed as MODEL (transformers' TrainingArguments fields)
        trainer = {"output_dir", "per_device_train_batch_size"} & set(config)
        hint = (
            f"; this file has {', '.join(sorted(trainer))}: a TrainingArguments / SFTConfig "
            "file, which --training-args FILE reads beside MODEL"
            if trainer
            else ""
        )
        raise SpecError(
            "model_type",
            "required field missing from the config; a Hugging Face config.json names its "
            f"family there (supported: {', '.join(HF_MODEL_TYPES)}){hint}",
        )
    row = FAMILIES.get(model_type)
    if row is None:
        raise UnsupportedError(
            f"model_type {short(model_type)} is not supported by the analytic engine "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); use --engine trace, or pass "
            "the config of a supported family with the same shapes"
        )
    f = Fields(config, model_type)
    if row.refuse is not None:
        row.refuse(f)
    spec: dict[str, Any] = dict(row.traits)
    _read(row, f, spec)
    spec["head"], spec["num_labels"] = read_head(f, _HEAD_BY_ARCHITECTURE[spec["architecture"]])
    # the family configs default to True; a null reaches the model as None, which builds no
    # cache (modeling_llama.py ``if use_cache and past_key_values is None``)
    use_cache = config.get("use_cache", True)
    if use_cache is not None and not isinstance(use_cache, bool):
        raise SpecError("use_cache", f"must be true, false or null, got {short(use_cache)}")
    spec["use_cache"] = bool(use_cache)
    if row.adjust is not None:
        row.adjust(f, spec)
    spec["checkpoint_dtype"] = checkpoint_dtype(config)
    return ModelSpec(name=name, model_type=model_type, **spec)


def checkpoint_dtype(config: Mapping[str, Any]) -> str | None:
    """A config's ``torch_dtype`` (transformers 5 writes ``dtype``) in torch spelling
    (``"torch.bfloat16"`` and ``"bfloat16"`` alike) when it is float32, bfloat16 or float16,
    the dtype ``from_pretrained(dtype="auto")`` loads (``ModelSpec.checkpoint_dtype``); None
    otherwise (none given, ``"auto"``, another dtype)."""
    for key in ("dtype", "torch_dtype"):
        value = config.get(key)
        if isinstance(value, str):
            name = value.removeprefix("torch.")
            return name if name in ("float32", "bfloat16", "float16") else None
    return None
