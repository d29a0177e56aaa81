"""Typed, validating reads of one Hugging Face ``config.json`` dict.

Part of :mod:`trainmem.specs.hf` (split out to keep modules small): errors name the HF field
a user would edit.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainmem.errors import SpecError
from trainmem.specs.bounds import MAX_COUNT, describe_int

Config = Mapping[str, Any]


def short(value: object) -> str:
    """A config value for an error message, at most about 80 characters."""
    if isinstance(value, int) and not isinstance(value, bool):
        return describe_int(value)
    text = (
        repr(value) if isinstance(value, str | float | bool | None) else f"a {type(value).__name__}"
    )
    return text if len(text) <= 80 else text[:77] + "..."


# ---------------------------------------------------------------------------------------
# Field helpers
# ---------------------------------------------------------------------------------------


class Fields:
    """Typed, validating access to one config dict; errors name the HF field."""

    def __init__(self, config: Config, model_type: str) -> None:
        self.config = config
        self.model_type = model_type

    def _missing(self, key: str) -> SpecError:
        return SpecError(
            key, f"required field missing from the config (model_type={self.model_type!r})"
        )

    def positive_int(self, key: str, default: int | None = None) -> int:
        """A required (or defaulted) positive integer field."""
        value = self.config.get(key)
        if value is None:
            if default is None:
                raise self._missing(key)
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SpecError(key, f"must be a positive integer, got {short(value)}")
        if value > MAX_COUNT:
            raise SpecError(
                key, f"must be at most {MAX_COUNT:,} (2^31 - 1), got {describe_int(value)}"
            )
        return value

    def first_int(self, keys: tuple[str, ...], default: int | None = None) -> int:
        """The first present of several aliases (``n_embd`` / ``hidden_size``)."""
        for key in keys:
            if self.config.get(key) is not None:
                return self.positive_int(key)
        if default is None:
            raise self._missing(keys[0])
        return default

    def flag(self, key: str, default: bool) -> bool:
        """A boolean field."""
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise SpecError(key, f"must be true or false, got {short(value)}")
        return value

    def prob(self, key: str, default: float = 0.0) -> float:
        """A dropout probability in [0, 1]."""
        value = self.config.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 1:
            raise SpecError(key, f"must be a probability in [0, 1], got {short(value)}")
        return float(value)

    def fraction(self, key: str, default: float) -> float:
        """A fraction in (0, 1] (partial rotary)."""
        value = self.config.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
            raise SpecError(key, f"must be in (0, 1], got {short(value)}")
        return float(value)

    def string(self, key: str, default: str) -> str:
        """A string field (activation names)."""
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, str):
            raise SpecError(key, f"must be a string, got {short(value)}")
        return value

    def head_dim(self, hidden: int, heads: int, heads_key: str, hidden_key: str) -> int:
        """``head_dim`` if given, else hidden / heads, which must divide."""
        if self.config.get("head_dim") is not None:
            return self.positive_int("head_dim")
        if hidden % heads != 0:
            raise SpecError(
                heads_key,
                f"{heads} attention heads do not divide {hidden_key}={hidden}; "
                "fix the config or give head_dim",
            )
        return hidden // heads

    def kv_heads(self, key: str, heads: int, default: int | None = None) -> int:
        """KV heads (GQA); they must divide the query heads."""
        kv = self.positive_int(key, default if default is not None else heads)
        if heads % kv != 0:
            raise SpecError(key, f"{kv} must divide num_attention_heads={heads}")
        return kv
