"""Inputs of a transformers model's synthetic training batch whose values matter: token ids
that avoid the config's special tokens, with their values known to the trace (Note [Known
values of a synthetic batch], ``trainmem.trace.known_values``).
"""

from __future__ import annotations

import inspect
from typing import Any

from trainmem.trace._torch import require_torch
from trainmem.trace.known_values import known

torch = require_torch()

__all__ = ["special_token_ids", "text_side_inputs", "token_ids", "vision_language_batch"]

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
    return known(lambda: _text_ids(cfg, vocab, shape))


def _text_ids(cfg: Any, vocab: int, shape: tuple[int, ...]) -> Any:
    special = sorted(v for v in special_token_ids(cfg) if v < vocab)
    free = next((i for i in range(vocab - 1, -1, -1) if i not in special), 0)
    ids = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(_SEED))
    for v in special:
        ids = torch.where(ids == v, free, ids)
    return ids


def _image_token(cfg: Any) -> int | None:
    for key in ("image_token_id", "image_token_index"):
        value = getattr(cfg, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def _image_rows(model: Any, pixels: Any, text_width: int) -> int | None:
    """Rows of image features one image gives the language model: the model's own
    ``get_image_features`` run on the (fake) pixels, its features' elements over the text
    width, per image; None when the model has no such method or it fails on them."""
    get = getattr(model, "get_image_features", None)
    if get is None:
        return None
    try:
        with torch.no_grad():
            out = get(pixel_values=pixels)
    except Exception:  # noqa: BLE001 - a model that needs more than pixels: text only
        return None
    features = getattr(out, "pooler_output", None)
    if features is None:
        features = getattr(out, "last_hidden_state", out)
    flat = [t for t in torch.utils._pytree.tree_flatten(features)[0] if isinstance(t, torch.Tensor)]
    total = sum(t.numel() for t in flat)
    if not flat or total % (text_width * pixels.shape[0]):
        return None
    return total // (text_width * pixels.shape[0])


def vision_language_batch(
    model: Any, vocab: int, b: int, s: int, dtype: Any
) -> dict[str, Any] | None:
    """One image per sample and ``s`` text tokens for a vision-language model, or None when
    the model takes no ``pixel_values`` or trainmem cannot place its image (text only then).

    ``pixel_values`` [b, channels, height, width] at the vision config's ``image_size``;
    where the config names an image placeholder token (``image_token_id`` /
    ``image_token_index``), the ids start with one placeholder per row of image features the
    model's ``get_image_features`` gives for that image (LLaVA: the patches of the selected
    layer, projected), as the processor expands ``<image>``, then ``s`` text ids: [b, n + s],
    ``labels`` the same ids. A model without a placeholder adds the image itself (BLIP,
    BLIP-2, GIT). Q-Former instructions (``qformer_input_ids``, InstructBLIP) are ``s`` ids of
    the Q-Former vocabulary; Kosmos-2's ``image_embeds_position_mask`` marks the
    ``latent_query_num`` positions its image embeddings take. Values known to the forward
    (Note [Known values of a synthetic batch]). A model that also reads the processor's patch
    grid (``image_grid_thw`` / ``image_grid_hw``: Qwen2-VL and kin) trains on text only: that
    grid is not built yet.

    Args:
        model: the (peft-unwrapped) model.
        vocab: the text vocabulary.
        b, s: batch size, text tokens per sample.
        dtype: the pixels' dtype (the parameters').

    Returns:
        Keyword arguments, or None.
    """
    cfg = model.config
    params = inspect.signature(model.forward).parameters
    vision = getattr(cfg, "vision_config", None)
    size = getattr(vision, "image_size", None)
    if "pixel_values" not in params or "input_ids" not in params or not size:
        return None
    if any("grid" in name for name in params):
        return None  # the image's patch grid the processor computes (image_grid_thw): not built
    height, width = size if isinstance(size, (list, tuple)) else (size, size)
    pixels = torch.randn(b, getattr(vision, "num_channels", 3) or 3, height, width, dtype=dtype)
    batch: dict[str, Any] = {"pixel_values": pixels}
    token = _image_token(cfg)
    n = 0
    if "image_embeds_position_mask" in params:
        n = int(getattr(cfg, "latent_query_num", 0))
        batch["image_embeds_position_mask"] = known(
            lambda: torch.arange(n + s).expand(b, n + s) < n
        )
    elif token is not None:
        rows = _image_rows(model, pixels, cfg.get_text_config().hidden_size)
        if rows is None:
            return None
        n = rows
    fill = token if token is not None else 0
    ids = known(lambda: torch.cat([torch.full((b, n), fill), _text_ids(cfg, vocab, (b, s))], dim=1))
    batch["input_ids"] = ids
    if "labels" in params:
        batch["labels"] = known(
            lambda: torch.cat([torch.full((b, n), fill), _text_ids(cfg, vocab, (b, s))], dim=1)
        )
    qformer = getattr(cfg, "qformer_config", None)
    if "qformer_input_ids" in params and qformer is not None:
        batch["qformer_input_ids"] = token_ids(qformer, qformer.vocab_size, (b, s))
    return batch


def text_side_inputs(model: Any, b: int, s: int) -> dict[str, Any]:
    """Inputs a text model's forward needs beside its ids, by argument name: ``lang_ids`` [b]
    (X-MOD's per-sample language adapter: all samples the first language, a monolingual
    fine-tune; ``modeling_xmod.py`` refuses a batch without a language). Values known to the
    forward.

    Args:
        model: the (peft-unwrapped) model.
        b, s: batch size, tokens per sample.

    Returns:
        Keyword arguments (empty when the forward takes none of these).
    """
    params = inspect.signature(model.forward).parameters
    out: dict[str, Any] = {}
    if "lang_ids" in params:
        out["lang_ids"] = known(lambda: torch.zeros(b, dtype=torch.long))
    return out
