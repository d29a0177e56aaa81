"""Inputs of a transformers model's synthetic training batch whose values matter: token ids
that avoid the config's special tokens, with their values known to the trace (Note [Known
values of a synthetic batch], ``trainmem.trace.known_values``).
"""

from __future__ import annotations

from typing import Any

from trainmem.trace._torch import require_torch
from trainmem.trace.known_values import known

torch = require_torch()

__all__ = ["special_token_ids", "token_ids"]

_SEED = 0
"""Seed of the batch's token ids: the same ids every trace, so a forward that reads them takes
the same path each time."""


_RESERVED_SUFFIXES = ("_token_id", "_token_ids", "_token_index", "_index", "_id")
"""Config fields naming a reserved id (``pad_token_id``, ``image_token_index``, XLM's
``pad_index``, ``decoder_start_token_id``...)."""


def special_token_ids(cfg: Any) -> set[int]:
    """Every id a config reserves: the int fields named by :data:`_RESERVED_SUFFIXES` in the
    config and its sub-configs (``pad_token_id``, ``eos_token_id``, a VLM's ``image_token_id`` /
    ``image_token_index``, ``boi_token_id``, ``decoder_start_token_id``...;
    ``transformers/configuration_utils.py`` and each model's configuration file).

    Args:
        cfg: a ``PretrainedConfig``.

    Returns:
        The reserved ids (non-negative ints).
    """
    out: set[int] = set()
    seen: set[int] = set()

    def visit(c: Any) -> None:
        if id(c) in seen:
            return
        seen.add(id(c))
        items = c.to_dict().items() if hasattr(c, "to_dict") else c.items()
        for key, value in items:
            if isinstance(value, dict):
                visit(value)
            elif isinstance(key, str) and key.endswith(_RESERVED_SUFFIXES):
                values = value if isinstance(value, (list, tuple)) else [value]
                out.update(v for v in values if isinstance(v, int) and not isinstance(v, bool))

    visit(cfg)
    return {v for v in out if v >= 0}


def token_ids(cfg: Any, vocab: int, shape: tuple[int, ...]) -> Any:
    """[shape] int64 text token ids in ``range(vocab)``, none of them a special token
    (:func:`special_token_ids`; a real batch's text has no padding, and its image or audio
    placeholders are where the processor puts them), drawn from a fixed seed; their value is
    known to the trace's forward (Note [Known values of a synthetic batch]).

    Args:
        cfg: the model's config.
        vocab: the vocabulary size.
        shape: e.g. (b, s).

    Returns:
        The ids (fake inside ``FakeTensorMode``).
    """
    special = sorted(v for v in special_token_ids(cfg) if v < vocab)
    free = next((i for i in range(vocab - 1, -1, -1) if i not in special), 0)

    def make() -> Any:
        ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(_SEED))
        for v in special:
            ids = torch.where(ids == v, free, ids)
        return ids

    return known(make)
