"""Uploaded files, read as data only: a model's ``config.json``, a DeepSpeed ``ds_config.json``,
an accelerate config (YAML or JSON), a trainer's own config (axolotl YAML, torchtune recipe
YAML, HF ``TrainingArguments`` / TRL ``SFTConfig`` JSON).

Each file is size-checked (:data:`MAX_UPLOAD_BYTES`) and parsed with ``json.loads`` or
``yaml.safe_load``: never a pickle, never code, never a path named inside the file (an
accelerate config pointing at a ``deepspeed_config_file``, or a trainer config whose
``deepspeed`` is a path, is refused: upload that file itself).
Every failure is a :class:`~trainmem.errors.SpecError` naming the upload.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainmem.errors import SpecError, UnsupportedError
from trainmem.specs.framework_configs import _safe_yaml, deepspeed_settings, read_accelerate_config
from trainmem.specs.hf import model_spec_from_hf
from trainmem.specs.model import ModelSpec
from trainmem.specs.trainer_configs import (
    read_axolotl_config,
    read_torchtune_config,
    read_training_args,
)

MAX_UPLOAD_BYTES = 1 << 20
"""1 MiB: a Hugging Face config.json or a ds_config.json is a few KiB."""


def _read_text(path: str, field: str) -> str:
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > MAX_UPLOAD_BYTES:
            raise SpecError(field, f"{p.name} is {size:,} bytes; the limit is 1 MiB")
        return p.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError(field, f"cannot read {p.name}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise SpecError(field, f"{p.name} is not a UTF-8 text file") from None


def _json_object(path: str, field: str) -> dict[str, Any]:
    name = Path(path).name
    try:
        data = json.loads(_read_text(path, field))
    except json.JSONDecodeError as exc:
        raise SpecError(
            field, f"{name} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})"
        ) from None
    if not isinstance(data, dict):
        raise SpecError(field, f"{name} holds a JSON {type(data).__name__}, expected an object")
    return data


def model_from_upload(path: str) -> tuple[ModelSpec | str, dict[str, Any]]:
    """The model of an uploaded Hugging Face (or diffusers) ``config.json``, and the parsed
    dict: its ModelSpec for a family the formulas cover, else the file's path, which the
    default ``auto`` engine runs through the generic path (:func:`trainmem.estimate.estimate`).

    Raises:
        SpecError: too large, not JSON, not an object, or a bad/missing field of the config.
    """
    config = _json_object(path, "config.json")
    try:
        return model_spec_from_hf(config, name=Path(path).name), config
    except UnsupportedError:
        return path, config


def deepspeed_from_upload(path: str) -> dict[str, Any]:
    """TrainingConfig settings from an uploaded DeepSpeed ``ds_config.json``
    (:func:`trainmem.specs.framework_configs.deepspeed_settings`).

    Raises:
        SpecError: too large, not JSON or not an object.
    """
    return deepspeed_settings(_json_object(path, "deepspeed_config"))


def accelerate_from_upload(path: str) -> dict[str, Any]:
    """TrainingConfig settings from an uploaded accelerate config
    (:func:`trainmem.specs.framework_configs.read_accelerate_config`, YAML safe loader).

    Raises:
        SpecError: too large, not YAML/JSON, not a mapping, an unknown FSDP strategy, or a
            reference to a ``deepspeed_config_file`` (upload that file as a ds_config instead).
    """
    text = _read_text(path, "accelerate_config")
    if "deepspeed_config_file" in text:
        raise SpecError(
            "accelerate_config",
            "it names a deepspeed_config_file; upload that ds_config.json in the DeepSpeed box",
        )
    return read_accelerate_config(path)


def trainer_config_from_upload(path: str) -> tuple[dict[str, Any], list[str]]:
    """TrainingConfig settings from an uploaded trainer config, and the notes of what was read
    and ignored (:mod:`trainmem.specs.trainer_configs`): a ``.json`` file is a HF
    ``TrainingArguments`` / TRL ``SFTConfig``; a YAML file with ``_component_`` entries is a
    torchtune recipe, any other YAML an axolotl config.

    Raises:
        SpecError: too large, not YAML/JSON, not a mapping, a value the reader refuses, or a
            ``deepspeed`` that names a file (upload that ds_config.json instead).
    """
    field = "trainer_config"
    text = _read_text(path, field)
    is_json = path.endswith(".json")
    if is_json:
        data: Any = _json_object(path, "training_args")
    else:
        try:
            data = _safe_yaml(text)
        except Exception as exc:  # yaml.YAMLError and kin: one clear line
            reason = " ".join(str(exc).split())[:200]
            raise SpecError(field, f"{Path(path).name} is not valid YAML: {reason}") from exc
    if not isinstance(data, dict):
        raise SpecError(field, f"{Path(path).name} must hold a mapping at the top level")
    if isinstance(data.get("deepspeed"), str) and data["deepspeed"]:
        raise SpecError(
            field,
            "it names a DeepSpeed file (deepspeed: ...); upload that ds_config.json in the "
            "DeepSpeed box",
        )
    notes: list[str] = []
    if is_json:
        settings = read_training_args(path, notes)
    elif any(isinstance(v, dict) and "_component_" in v for v in data.values()):
        settings = read_torchtune_config(path, notes)
    else:
        settings = read_axolotl_config(path, notes)
    return settings, notes
