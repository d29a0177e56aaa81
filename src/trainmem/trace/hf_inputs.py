"""Inputs of a transformers model's synthetic training batch whose values matter: token ids
that avoid the config's special tokens, with their values known to the trace (Note [Known
values of a synthetic batch], ``trainmem.trace.known_values``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

from trainmem.errors import SpecError, UnsupportedError
from trainmem.trace._torch import require_torch
from trainmem.trace.known_values import known, known_values
from trainmem.trace.processor_layouts import ImageLayout, idefics2_layout, idefics3_layout

torch = require_torch()

from torch.utils._python_dispatch import _disable_current_modes  # noqa: E402

__all__ = [
    "IMAGE_BATCH_NOTE",
    "flattened_patch_batch",
    "patch_sequence_batch",
    "perceiver_text_batch",
    "special_token_ids",
    "text_side_inputs",
    "token_ids",
    "vision_language_batch",
]

IMAGE_BATCH_NOTE = "vision-language model: one "
"""How a note describing a vision-language batch with an image starts."""

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


def _image_rows(model: Any, pixels: Any, text_width: int, extra: dict[str, Any]) -> int | None:
    """Rows of image features one image gives the language model: the model's own
    ``get_image_features`` run on the (fake) pixels (and ``extra``: ``image_sizes``), its
    features' elements over the text width, per image; None when the model has no such
    method or it fails on them."""
    get = getattr(model, "get_image_features", None)
    if get is None:
        return None
    try:
        with torch.no_grad(), known_values():
            out = get(pixel_values=pixels, **extra)
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
    model: Any,
    vocab: int,
    b: int,
    s: int,
    dtype: Any,
    image_size: tuple[int, int] | None = None,
    notes: list[str] | None = None,
) -> dict[str, Any] | None:
    """One image per sample and ``s`` text tokens for a vision-language model, or None when
    the model takes no ``pixel_values`` or trainmem cannot place its image (text only then).

    ``pixel_values`` [b, channels, height, width] at the vision config's ``image_size``;
    where the config names an image placeholder token (``image_token_id`` /
    ``image_token_index``), the ids start with one placeholder per row of image features the
    model's ``get_image_features`` gives for that image (LLaVA: the patches of the selected
    layer, projected), as the processor expands ``<image>``, then ``s`` text ids: [b, n + s],
    ``labels`` the same ids; a model that also reads ``image_sizes`` (Pixtral in Mistral-3,
    ``modeling_mistral3.py``) gets each image's (height, width), and one with
    ``image_grid_pinpoints`` (LLaVA-NeXT, OneVision) its "anyres" tiles
    (:func:`_tiled_pixels`); both take any ``--resolution``. A model without a
    placeholder adds the image itself (BLIP,
    BLIP-2, GIT). Q-Former instructions (``qformer_input_ids``, InstructBLIP) are ``s`` ids of
    the Q-Former vocabulary; Kosmos-2's ``image_embeds_position_mask`` marks the
    ``latent_query_num`` positions its image embeddings take. Values known to the forward
    (Note [Known values of a synthetic batch]). A model that reads the processor's patch grid
    ``image_grid_thw`` (Qwen2-VL and kin) gets :func:`_grid_batch`'s; another grid
    (``image_grid_hw``, Molmo's ``image_grids``) trains on text only. ``image_size``
    (``--resolution``) replaces the vision config's size.

    Args:
        model: the (peft-unwrapped) model.
        vocab: the text vocabulary.
        b, s: batch size, text tokens per sample.
        dtype: the pixels' dtype (the parameters').
        image_size: (height, width) pixels of the one image per sample; None: the model's.
        notes: where the batch's description goes (one line for the estimate's notes).

    Returns:
        Keyword arguments, or None (text only: a note says so).
    """
    said = notes if notes is not None else []
    before = len(said)
    batch = _vision_language_batch(model, vocab, b, s, dtype, image_size, said)
    if batch is None and len(said) == before:
        said.append(
            "vision-language model: the batch is text only (input_ids), no image tokens (trainmem "
            "cannot build this model's image inputs yet); the vision tower gets no gradient"
        )
    return batch


def _vision_language_batch(
    model: Any,
    vocab: int,
    b: int,
    s: int,
    dtype: Any,
    image_size: tuple[int, int] | None,
    notes: list[str],
) -> dict[str, Any] | None:
    cfg = model.config
    params = inspect.signature(model.forward).parameters
    vision = getattr(cfg, "vision_config", None)
    if "pixel_values" not in params or "input_ids" not in params or vision is None:
        return None
    if "image_grid_thw" in params:
        return _grid_batch(model, vocab, b, s, dtype, image_size, notes)
    if "pixel_attention_mask" in params:
        return _tiled_batch(model, vocab, b, s, dtype, image_size, notes)
    size = getattr(vision, "image_size", None)
    if not size or any("grid" in name for name in params):
        return None  # another patch grid the processor computes (image_grid_hw): not built
    height, width = size if isinstance(size, (list, tuple)) else (size, size)
    patch = getattr(vision, "patch_size", None)
    tiled = bool(getattr(cfg, "image_grid_pinpoints", None)) and "image_sizes" in params
    any_size = getattr(vision, "model_type", None) == "pixtral" and "image_sizes" in params
    if image_size is not None and tiled:
        height, width = image_size  # any size: the processor picks the tiling that fits it
    elif image_size is not None and any_size and isinstance(patch, int):
        # Pixtral's any-size images (image_processing_pixtral.py: scaled down to fit the
        # config's size, each side a multiple of the patch, merged 2 x 2 in Mistral-3)
        merge = getattr(cfg, "spatial_merge_size", None) or 1
        scale = min(1.0, height / image_size[0], width / image_size[1])  # the longest edge
        height, width = grid_image_side(
            patch * merge, (int(image_size[0] * scale), int(image_size[1] * scale))
        )
    elif image_size is not None and tuple(image_size) != (height, width):
        raise UnsupportedError(
            f"resolution: {type(model).__name__} takes its vision config's {height} x {width} "
            f"pixel images (the tower's position embeddings are sized for them; the processor "
            f"resizes every image to it), not {image_size[0]} x {image_size[1]}: leave "
            "--resolution unset, or set it to that size"
        )
    channels = getattr(vision, "num_channels", 3) or 3
    queries = getattr(cfg, "num_query_tokens", None)
    video = isinstance(queries, int) and hasattr(cfg, "video_token_index")  # InstructBLIP-Video
    if tiled:
        pixels = _tiled_pixels(cfg, b, channels, (height, width), dtype)
    elif video or "image_attention_mask" in params:  # [b, frames or images, c, h, w]
        shape = (b, VIDEO_FRAMES if video else 1, channels, height, width)
        pixels = torch.randn(*shape, dtype=dtype)
    else:
        pixels = torch.randn(b, channels, height, width, dtype=dtype)
    batch: dict[str, Any] = {"pixel_values": pixels}
    token = _image_token(cfg)
    n, extra, said = 0, 0, ""
    if "image_embeds_position_mask" in params:
        n = int(getattr(cfg, "latent_query_num", 0))
        batch["image_embeds_position_mask"] = known(
            lambda: torch.arange(n + s).expand(b, n + s) < n
        )
    elif "image_attention_mask" in params:
        extra = IDEFICS_IMAGE_TOKENS
        batch["image_attention_mask"] = known(
            lambda: (torch.arange(extra + s) >= 1).long().expand(b, extra + s)[..., None]
        )
        said = (
            f"; the image's {extra} tokens <fake_token_around_image><image>"
            "<fake_token_around_image> start the text, which attends to the image by "
            "cross-attention (image_attention_mask, processing_idefics.py)"
        )
    elif isinstance(queries, int) and queries > 0:  # BLIP-2, InstructBLIP(-Video)
        token, said = _query_placeholder(cfg, vocab, video)
        n = queries * pixels.shape[1] if video else queries
        if video:
            said = f"; a clip of {VIDEO_FRAMES} such frames, {queries} query tokens each{said}"
    elif token is not None:
        text_width = cfg.get_text_config().hidden_size
        rows = _image_rows(model, pixels, text_width, {})
        if rows is None and "image_sizes" in params:  # Pixtral / Mistral-3: each image's size
            sizes = {"image_sizes": known(lambda: torch.tensor([[height, width]] * b))}
            rows = _image_rows(model, pixels, text_width, sizes)
            batch.update(sizes)
        if rows is None:
            return None
        n = rows
    fill = token if token is not None else 0
    length = extra + s  # IDEFICS' tokens around its image are text ids

    def ids() -> Any:
        return torch.cat([torch.full((b, n), fill), _text_ids(cfg, vocab, (b, length))], dim=1)

    batch["input_ids"] = known(ids)
    if "labels" in params:
        decoder = getattr(cfg.get_text_config(), "is_encoder_decoder", False) and queries
        # (BLIP-2 with Flan-T5: the labels are the decoder's target text, s ids)
        batch["labels"] = token_ids(cfg, vocab, (b, s)) if decoder else known(ids)
    qformer = getattr(cfg, "qformer_config", None)
    if "qformer_input_ids" in params and qformer is not None:
        batch["qformer_input_ids"] = token_ids(qformer, qformer.vocab_size, (b, s))
    notes.append(
        f"{IMAGE_BATCH_NOTE}{height} x {width} pixel image per sample "
        f"({'--resolution' if image_size else 'the vision config image_size'}), "
        f"{n} image tokens before the {s} text tokens{said}"
    )
    return batch


IDEFICS_IMAGE_TOKENS = 3
"""``<fake_token_around_image><image><fake_token_around_image>``: what IDEFICS' processor puts
for an image (``processing_idefics.py`` ``image_tokens``); the text from the ``<image>`` token on
attends to it (``image_attention_mask_for_packed_input_ids``: 0 before the first image, its
index after; one-hot by ``incremental_to_binary_attention_mask``)."""

VIDEO_FRAMES = 4
"""Frames of an InstructBLIP-Video clip: "InstrucBLIP works with 4 frames only"
(``processing_instructblipvideo.py``: ``num_query_tokens * 4`` video tokens;
``modeling_instructblipvideo.py``: "video has frames=4 always")."""


def _query_placeholder(cfg: Any, vocab: int, video: bool) -> tuple[int, str]:
    """The id of the placeholder a Q-Former model's processor puts ``num_query_tokens`` times
    (per frame) before the text (``processing_blip_2.py``, ``processing_instructblip.py``,
    ``processing_instructblipvideo.py``), and how the note names it. A config without one
    (``image_token_index`` / ``video_token_index`` None: transformers' default configs) gets
    the largest id of the text vocabulary that no field reserves, set on the model's config:
    the processor adds its ``<image>`` token to the tokenizer as a new id, and the forward
    scatters the query outputs onto the ids equal to the config's (``modeling_blip_2.py``
    ``get_placeholder_mask``)."""
    key = "video_token_index" if video else "image_token_index"
    token = getattr(cfg, key, None)
    if isinstance(token, int) and token >= 0:
        return token, ""
    special = special_token_ids(cfg)
    token = next(i for i in range(vocab - 1, -1, -1) if i not in special)
    setattr(cfg, key, token)
    return token, f"; the config names no {key}: id {token}, the vocabulary's last free id"


def _tiled_batch(
    model: Any,
    vocab: int,
    b: int,
    s: int,
    dtype: Any,
    image_size: tuple[int, int] | None,
    notes: list[str],
) -> dict[str, Any] | None:
    """One image per sample as Idefics2's, Idefics3's or SmolVLM's processor hands it over
    (:func:`~trainmem.trace.processor_layouts.idefics2_layout`, ``idefics3_layout``):
    ``pixel_values`` [b, tiles, channels, height, width] and ``pixel_attention_mask`` [b, tiles,
    height, width] all ones (no padding: every sample's image has the same size), the ids the
    processor's expanded placeholder (image tokens and the separators around them, text ids)
    then ``s`` text ids, ``labels`` the same. The pixels' value is kept: the model drops
    all-zero padding images by reading them (``modeling_idefics2.py`` ``get_image_features``).
    The model's ``get_image_features`` must give one row per image token, else None (text
    only, a note says why)."""
    cfg = model.config
    vision = cfg.vision_config
    side, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    token = _image_token(cfg)
    if not isinstance(side, int) or not isinstance(patch, int) or token is None:
        return None
    perceiver = getattr(cfg, "perceiver_config", None)
    scale = getattr(cfg, "scale_factor", None)
    layout: ImageLayout
    if perceiver is not None:  # Idefics2
        layout = idefics2_layout(side, perceiver.resampler_n_latents, image_size)
    elif isinstance(scale, int):  # Idefics3, SmolVLM
        layout = idefics3_layout(side, patch, scale, image_size)
    else:
        return None
    channels = getattr(vision, "num_channels", 3) or 3
    tiles, height, width = layout.tiles, layout.height, layout.width
    pixels = known(lambda: torch.ones(b, tiles, channels, height, width, dtype=dtype))
    mask = known(lambda: torch.ones(b, tiles, height, width, dtype=torch.long))
    try:
        with torch.no_grad(), known_values():
            out = model.get_image_features(pixel_values=pixels, pixel_attention_mask=mask)
    except Exception as exc:  # noqa: BLE001 - a config whose tower cannot take its tiles
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:160]
        notes.append(
            "vision-language model: the batch is text only (input_ids), no image tokens: the "
            f"vision tower fails on the processor's {tiles} tiles of {height} x {width} pixels "
            f"({reason}); the vision tower gets no gradient"
        )
        return None
    flat = torch.utils._pytree.tree_flatten(out.pooler_output)[0]
    rows = sum(t.shape[0] for t in flat if isinstance(t, torch.Tensor))
    if rows != b * layout.image_tokens:
        notes.append(
            "vision-language model: the batch is text only (input_ids), no image tokens: the "
            f"vision tower gives {rows} rows of image features for {b} x {tiles} tiles, not the "
            f"{b} x {layout.image_tokens} image tokens the processor would place; the vision "
            "tower gets no gradient"
        )
        return None
    n = layout.tokens
    flags = [image for image, count in layout.prompt for _ in range(count)] + [False] * s

    def ids() -> Any:
        return torch.where(torch.tensor(flags), token, _text_ids(cfg, vocab, (b, n + s)))

    params = inspect.signature(model.forward).parameters
    batch: dict[str, Any] = {
        "pixel_values": pixels,
        "pixel_attention_mask": mask,
        "input_ids": known(ids),
    }
    if "labels" in params:
        batch["labels"] = known(ids)
    rows_cols = layout.grid
    split = (
        f"{rows_cols[0]} x {rows_cols[1]} tiles of {side} x {side} pixels and the whole image "
        f"at {side} x {side} ({tiles} images through the tower)"
        if tiles > 1
        else f"not split ({height} x {width} pixels through the tower)"
    )
    if image_size is None:
        said = (
            "the vision config image_size"
            if perceiver is not None
            else f"the default processor's longest edge, {layout.image[0]} pixels"
        )
    else:
        said = f"--resolution {image_size[0]} x {image_size[1]}" + (
            ", resized by the processor" if tuple(image_size) != layout.image else ""
        )
    notes.append(
        f"{IMAGE_BATCH_NOTE}{layout.image[0]} x {layout.image[1]} pixel image per sample "
        f"({said}), {split}, {layout.image_tokens} image tokens ({n} with the processor's "
        f"separators) before the {s} text tokens"
    )
    return batch


def _rope_positions(
    model: Any, ids: Callable[[], Any], types: Callable[[], Any], grid: Callable[[], Any]
) -> list[Any] | None:
    """The multimodal rotary positions [3, b, n + s] the model's own ``get_rope_index``
    (``modeling_qwen2_vl.py``) computes from the batch's ids, token types and grid, run on
    the real CPU values (it builds them with ``torch.tensor`` from Python lists of
    per-sample results, which fake tensors cannot do); None when the model has none or it
    fails. The forward would compute the same small int64 tensor from the same inputs."""
    rope = next((m.get_rope_index for m in model.modules() if hasattr(m, "get_rope_index")), None)
    if rope is None:
        return None
    try:
        with _disable_current_modes():
            out = rope(ids(), mm_token_type_ids=types(), image_grid_thw=grid())
        positions = out[0] if isinstance(out, tuple) else out
        return positions.tolist()  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - another signature: the forward computes them
        return None


def _tiled_pixels(cfg: Any, b: int, channels: int, image: tuple[int, int], dtype: Any) -> Any:
    """LLaVA-NeXT's "anyres" pixels [b, tiles, channels, side, side]: the image resized to the
    ``image_grid_pinpoints`` resolution that fits it best, cut into tiles of the vision tower's
    ``side`` plus one tile of the whole image downscaled (``image_processing_llava_next.py``;
    the count is transformers' own ``image_size_to_num_patches``, which the model's
    ``get_image_features`` applies to ``image_sizes``)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    side = cfg.vision_config.image_size
    tiles = image_size_to_num_patches(list(image), cfg.image_grid_pinpoints, side)
    return torch.randn(b, tiles, channels, side, side, dtype=dtype)


GRID_MAX_PIXELS = 28 * 28 * 1280
"""Pixels of the largest image Qwen2-VL's image processor keeps unresized by default
(``transformers/models/qwen2_vl/image_processing_qwen2_vl.py``: ``max_pixels`` /
``size["longest_edge"]`` = 28 * 28 * 1280, i.e. 1280 merged patches of 28 x 28 pixels): the
image a grid model's batch takes when neither ``--resolution`` nor its vision config gives one."""


def grid_image_side(factor: int, size: tuple[int, int] | int | None) -> tuple[int, int]:
    """(height, width) pixels of a grid model's image: ``size`` rounded to the nearest multiple
    of ``factor`` (patch size x spatial merge size), at least one ``factor``, as Qwen2-VL's
    ``smart_resize`` rounds (``image_processing_qwen2_vl.py``: ``round(height / factor) *
    factor``); None: the largest square of at most :data:`GRID_MAX_PIXELS` pixels whose side is
    a multiple of ``factor`` (980 x 980 for Qwen2-VL's 28).

    Args:
        factor: pixels per merged patch side.
        size: (height, width) or a side in pixels, or None.
    """
    if size is None:
        side = max(1, math.isqrt(GRID_MAX_PIXELS) // factor) * factor
        return side, side
    height, width = size if isinstance(size, (list, tuple)) else (size, size)
    return tuple(max(factor, round(x / factor) * factor) for x in (height, width))  # type: ignore[return-value]


def _grid_batch(
    model: Any,
    vocab: int,
    b: int,
    s: int,
    dtype: Any,
    image_size: tuple[int, int] | None,
    notes: list[str],
) -> dict[str, Any] | None:
    """One image per sample in the patch layout of Qwen2-VL's processor, or None when the
    vision config does not name it (text only then).

    ``image_processing_qwen2_vl.py`` (``_preprocess``): the image, resized to multiples of
    ``patch_size * spatial_merge_size`` (:func:`grid_image_side`), repeated to
    ``temporal_patch_size`` frames, is cut into ``grid_h * grid_w`` patches (``grid_h = height
    / patch_size``), each flattened to ``channels * temporal_patch_size * patch_size ** 2``
    values: ``pixel_values`` [b * grid_h * grid_w, channels * temporal_patch_size *
    patch_size ** 2] in the parameter dtype, ``image_grid_thw`` [b, 3] = (1, grid_h, grid_w)
    per image. The processor expands each image placeholder to ``grid_h * grid_w /
    spatial_merge_size ** 2`` image tokens (``processing_qwen2_vl.py``); the ids are those
    tokens then ``s`` text ids, ``labels`` the same, ``mm_token_type_ids`` 1 on image tokens
    and 0 on text (``modeling_qwen2_vl.py`` ``get_rope_index``: text 0, image 1). The model's
    ``get_image_features`` must return one feature row per image token, else None.
    """
    cfg = model.config
    vision = cfg.vision_config
    sizes: list[Any] = [getattr(vision, k, None) for k in ("patch_size", "spatial_merge_size")]
    frames = getattr(vision, "temporal_patch_size", None) or 1
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", None) or 3
    token = _image_token(cfg)
    if not all(isinstance(x, int) and x > 0 for x in (*sizes, frames)) or token is None:
        return None
    patch, merge = int(sizes[0]), int(sizes[1])
    height, width = grid_image_side(
        patch * merge, image_size or getattr(vision, "image_size", None)
    )
    gh, gw = height // patch, width // patch
    n = gh * gw // merge**2
    pixels = torch.randn(b * gh * gw, channels * frames * patch * patch, dtype=dtype)
    grid = known(lambda: torch.tensor([[1, gh, gw]] * b))
    try:
        with torch.no_grad(), known_values():  # (the grid's values: rotary positions)
            out = model.get_image_features(pixel_values=pixels, image_grid_thw=grid)
    except Exception:  # noqa: BLE001 - a grid model with other inputs: text only
        return None
    features = getattr(out, "pooler_output", None)
    features = out if features is None else features
    flat = [t for t in torch.utils._pytree.tree_flatten(features)[0] if isinstance(t, torch.Tensor)]
    text_width = cfg.get_text_config().hidden_size
    if sum(t.shape[0] for t in flat) != b * n or any(t.shape[-1] != text_width for t in flat):
        notes.append(
            "vision-language model: the batch is text only (input_ids), no image tokens: the "
            f"vision tower's image features ({', '.join(str(tuple(t.shape)) for t in flat)}) "
            f"are not one row of the text width {text_width} per image token ({b} x {n}), so this "
            "config cannot place an image; the vision tower gets no gradient"
        )
        return None

    def ids() -> Any:
        return torch.cat([torch.full((b, n), token), _text_ids(cfg, vocab, (b, s))], dim=1)

    params = inspect.signature(model.forward).parameters
    batch: dict[str, Any] = {
        "pixel_values": pixels,
        "image_grid_thw": grid,
        "input_ids": known(ids),
    }
    if "labels" in params:
        batch["labels"] = known(ids)

    def types() -> Any:
        return (torch.arange(n + s) < n).to(torch.int32).expand(b, n + s).contiguous()

    if "mm_token_type_ids" in params:
        batch["mm_token_type_ids"] = known(types)
    positions = _rope_positions(model, ids, types, lambda: torch.tensor([[1, gh, gw]] * b))
    if positions is not None and "position_ids" in params:
        batch["position_ids"] = known(lambda: torch.tensor(positions))
    said = (
        "--resolution"
        if image_size
        else (
            "the vision config image_size"
            if getattr(vision, "image_size", None)
            else "no size given: the largest square Qwen2-VL's processor keeps, "
            f"{GRID_MAX_PIXELS:,} pixels at most; --resolution sets it"
        )
    )
    notes.append(
        f"{IMAGE_BATCH_NOTE}{height} x {width} pixel image per sample ({said}), "
        f"{gh} x {gw} patches of {patch} pixels, {n} image tokens before the {s} text tokens"
    )
    return batch


PIX2STRUCT_MAX_PATCHES = 2048
"""``Pix2StructImageProcessor.max_patches`` (``image_processing_pix2struct.py``): every image is
rescaled to at most this many patches and padded to exactly this many."""


def flattened_patch_batch(
    model: Any, vocab: int, b: int, s: int, dtype: Any, image_size: tuple[int, int] | None
) -> tuple[dict[str, Any], str]:
    """Pix2Struct's batch: ``flattened_patches`` [b, max_patches, 2 + patch values] (each
    patch's row and column then its ``patch_embed_hidden_size`` pixel values) as
    ``image_processing_pix2struct.py`` ``extract_flattened_patches`` makes them, padded to
    :data:`PIX2STRUCT_MAX_PATCHES`, and ``labels`` [b, s], the text the decoder writes. The
    processor rescales any image to fit ``max_patches`` and pads the rest, so the shapes do
    not depend on the image: ``--resolution`` is refused.

    Args:
        model: the (peft-unwrapped) Pix2Struct model.
        vocab: the decoder's vocabulary.
        b, s: batch size, decoder tokens per sample.
        dtype: the patches' dtype (the parameters').
        image_size: ``--resolution``; must be None.

    Returns:
        The keyword arguments and a note describing them.

    Raises:
        UnsupportedError: a ``--resolution`` was given.
    """
    if image_size is not None:
        raise UnsupportedError(
            f"resolution: {type(model).__name__}'s processor resizes every image to at most "
            f"{PIX2STRUCT_MAX_PATCHES} patches (max_patches) and pads it to "
            f"{PIX2STRUCT_MAX_PATCHES}, so the batch and its memory are the same for any image: "
            "leave --resolution unset"
        )
    width = model.config.vision_config.patch_embed_hidden_size + 2
    patches = torch.randn(b, PIX2STRUCT_MAX_PATCHES, width, dtype=dtype)
    batch: dict[str, Any] = {"flattened_patches": patches}
    if "labels" in inspect.signature(model.forward).parameters:
        batch["labels"] = token_ids(model.config.get_text_config(), vocab, (b, s))
    note = (
        f"{IMAGE_BATCH_NOTE}image per sample as {PIX2STRUCT_MAX_PATCHES} flattened patches "
        f"(the processor's max_patches, any image size), {s} decoder tokens"
    )
    return batch, note


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


def patch_sequence_batch(
    cfg: Any, b: int, dtype: Any, image_size: tuple[int, int]
) -> dict[str, Any]:
    """The batch of a vision model that takes its image as a padded sequence of patches
    (SigLIP 2's NaFlex variant: ``forward(pixel_values, pixel_attention_mask,
    spatial_shapes)``), as its processor lays one image out (transformers 5.24
    ``models/siglip2/image_processing_pil_siglip2.py`` ``_preprocess``, the torchvision
    backend's layout too): the image resized, keeping
    its aspect ratio, to the largest patch grid of at most ``num_patches`` patches
    (``get_image_size_for_max_num_patches``, called here), cut into ``patch_size`` squares of
    ``num_channels * patch_size**2`` values, padded to ``num_patches``; ``pixel_attention_mask``
    marks the grid's patches, ``spatial_shapes`` is the grid. Mask and grid have known values
    (the embeddings resize their positions to the grid). Every sample is the same image.

    Args:
        cfg: the vision config (``num_patches``, ``patch_size``, ``num_channels``).
        b: micro-batch size.
        dtype: the pixels' dtype.
        image_size: (height, width) of the image before the processor resizes it.

    Returns:
        ``pixel_values`` [b, num_patches, num_channels * patch_size**2], ``pixel_attention_mask``
        [b, num_patches] and ``spatial_shapes`` [b, 2].
    """
    from transformers.models.siglip2.image_processing_pil_siglip2 import (
        get_image_size_for_max_num_patches,
    )

    patch = int(cfg.patch_size)
    slots = int(cfg.num_patches)
    height, width = get_image_size_for_max_num_patches(*image_size, patch, slots)
    grid = (height // patch, width // patch)
    used = grid[0] * grid[1]
    channels = getattr(cfg, "num_channels", None) or 3
    return {
        "pixel_values": torch.randn(b, slots, channels * patch * patch, dtype=dtype),
        "pixel_attention_mask": known(
            lambda: (torch.arange(slots) < used).to(torch.int32).expand(b, slots).clone()
        ),
        "spatial_shapes": known(lambda: torch.tensor([grid] * b)),
    }


def perceiver_text_batch(model: Any, b: int, s: int, takes_labels: bool) -> dict[str, Any]:
    """The batch of a Perceiver on bytes (``PerceiverForMaskedLM``: ``inputs`` through its
    ``PerceiverTextPreprocessor``): ``inputs`` [b, s] byte ids, with ``labels`` [b, s].

    Its decoder emits a fixed ``max_position_embeddings`` positions (transformers 5.24
    modeling_perceiver.py ``PerceiverForMaskedLM.__init__``: ``output_index_dims=
    config.max_position_embeddings``, "we need to define the seq_len of the inputs
    beforehand"; the loss flattens those logits against the labels, and the model's example
    pads every text to that length, ``padding="max_length"``), so ``s`` must be that length.

    Raises:
        SpecError: ``s`` is not ``max_position_embeddings`` (names ``seq_len`` and the length
            that works).
        UnsupportedError: a Perceiver whose preprocessor is not the text one (images, audio,
            multimodal).
    """
    cfg = model.config
    preprocessor = getattr(getattr(model, "perceiver", None), "input_preprocessor", None)
    if type(preprocessor).__name__ != "PerceiverTextPreprocessor":
        raise UnsupportedError(
            f"{type(model).__name__} takes inputs through "
            f"{type(preprocessor).__name__}, whose batch trainmem does not build (known: "
            "PerceiverForMaskedLM's byte ids); use --engine analytic"
        )
    n = int(cfg.max_position_embeddings)
    if s != n:
        raise SpecError(
            "seq_len",
            f"{s}: {type(model).__name__} decodes a fixed max_position_embeddings={n} "
            "positions (modeling_perceiver.py: output_index_dims=max_position_embeddings; its "
            f"tokenizer pads every text to them); allowed: --seq-len {n}",
        )
    ids = token_ids(cfg, int(cfg.vocab_size), (b, s))
    return {"inputs": ids, "labels": ids} if takes_labels else {"inputs": ids}
