"""The image inputs a vision-language model's own processor makes from one image: how many
tiles of what size reach the vision tower, and the string of tokens the processor expands the
image's placeholder into, mirrored from transformers' ``processing_*`` / ``image_processing_*``
files (transformers 5.24). Pure arithmetic: ``trainmem.trace.hf_inputs`` builds the tensors.

A prompt is a tuple of segments ``(image, count)``: ``count`` image placeholder tokens (the
model puts one row of image features on each) or ``count`` other tokens (the processor's
``<fake_token_around_image>``, ``<row_1_col_1>``, ``<global-img>``, newlines: text ids).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "IDEFICS2_SHORTEST_EDGE",
    "IDEFICS3_LONGEST_EDGE_TILES",
    "MAX_IMAGE_SIZE",
    "ImageLayout",
    "idefics2_layout",
    "idefics3_layout",
]

Segment = tuple[bool, int]
"""(image placeholder tokens?, how many tokens)."""

IDEFICS2_SHORTEST_EDGE = 378
"""``Idefics2ImageProcessor.size["shortest_edge"]`` (``image_processing_idefics2.py``): an
image's shorter sides are raised to it (capped here at the tower's side)."""

MAX_IMAGE_SIZE = 4096
"""``MAX_IMAGE_SIZE`` of ``image_processing_idefics3.py`` / ``image_processing_smolvlm.py``: no
side is resized above it (``_resize_output_size_scale_below_upper_bound``)."""

IDEFICS3_LONGEST_EDGE_TILES = 4
"""``Idefics3ImageProcessor.size = {"longest_edge": 4 * 364}`` with ``max_image_size =
{"longest_edge": 364}`` (``image_processing_idefics3.py``; SmolVLM's released processors:
2048 = 4 x 512): the default processor resizes every image's longest edge to 4 tiles."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ImageLayout:
    """One sample's image as the processor hands it to the model."""

    height: int
    """Pixels of each tile the tower sees (the whole image when unsplit)."""
    width: int
    """Pixels of each tile."""
    tiles: int
    """Images per sample in ``pixel_values`` [b, tiles, channels, height, width]."""
    image: tuple[int, int]
    """(height, width) pixels of the image the tiles are cut from."""
    grid: tuple[int, int]
    """(rows, cols) of the split; (0, 0) when the image is not split."""
    prompt: tuple[Segment, ...]
    """The tokens the processor expands the image placeholder into."""

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens (one row of image features each)."""
        return sum(n for image, n in self.prompt if image)

    @property
    def tokens(self) -> int:
        """All tokens the image takes in the sequence."""
        return sum(n for _, n in self.prompt)


def idefics2_layout(side: int, latents: int, image: tuple[int, int] | None) -> ImageLayout:
    """Idefics2's one unsplit image (``Idefics2ImageProcessor.do_image_splitting = False``):
    resized as ``image_processing_idefics2.py`` ``get_resize_output_image_size`` does (the
    longer side down to ``longest_edge``, each side up to ``shortest_edge``), with
    ``longest_edge`` the tower's ``image_size`` (980 in the processor's default and the
    released checkpoints) and ``shortest_edge`` :data:`IDEFICS2_SHORTEST_EDGE`, at most the
    tower's side. ``processing_idefics2.py`` expands ``<image>`` into
    ``<fake_token_around_image>`` + ``<image>`` x ``image_seq_len`` +
    ``<fake_token_around_image>``, ``image_seq_len`` the perceiver's ``resampler_n_latents``.

    Args:
        side: the vision config's ``image_size`` (pixels).
        latents: ``perceiver_config.resampler_n_latents``.
        image: (height, width) of the image (``--resolution``); None: side x side.

    Returns:
        The layout.
    """
    height, width = image if image is not None else (side, side)
    shortest = min(IDEFICS2_SHORTEST_EDGE, side)
    aspect = width / height
    if width >= height and width > side:
        width, height = side, int(side / aspect)
    elif height > width and height > side:
        height, width = side, int(side * aspect)
    height, width = max(height, shortest), max(width, shortest)
    prompt = ((False, 1), (True, latents), (False, 1))
    return ImageLayout(
        height=height, width=width, tiles=1, image=(height, width), grid=(0, 0), prompt=prompt
    )


def idefics3_layout(
    side: int, patch: int, scale_factor: int, image: tuple[int, int] | None
) -> ImageLayout:
    """Idefics3's and SmolVLM's tiles (``image_processing_idefics3.py`` ``_preprocess`` with
    ``do_image_splitting``): the image, each side rounded up to whole tiles of the tower's
    ``side`` (``resize_for_vision_encoder``), is cut into rows x cols tiles plus the whole
    image resized to one tile (``split_images``); an image of at most one tile stays whole.
    ``image`` is the image as the processor's ``size`` resize left it (its longest edge is
    ``size["longest_edge"]``, :data:`IDEFICS3_LONGEST_EDGE_TILES` tiles by default: None),
    capped at :data:`MAX_IMAGE_SIZE`.

    ``processing_idefics3.py`` ``replace_image_token`` expands ``<image>`` into, per tile,
    ``<fake_token_around_image><row_i_col_j>`` + ``<image>`` x ``image_seq_len``, a newline
    per row, then ``\\n<fake_token_around_image><global-img>`` + ``<image>`` x
    ``image_seq_len`` + ``<fake_token_around_image>``; ``image_seq_len = (side // patch) ** 2
    / scale_factor ** 2`` (the connector's pixel shuffle). The last row's newline and the
    global image's make one "\\n\\n" token, as ``_get_num_multimodal_tokens`` counts for a
    tokenizer with that token (Llama 3's, SmolLM2's).

    Args:
        side: the vision config's ``image_size`` (the processor's ``max_image_size``).
        patch: the vision config's ``patch_size``.
        scale_factor: the config's ``scale_factor``.
        image: (height, width) after the processor's resize; None: the default processor's
            square of :data:`IDEFICS3_LONGEST_EDGE_TILES` tiles a side.

    Returns:
        The layout.
    """
    if image is None:
        height = width = IDEFICS3_LONGEST_EDGE_TILES * side
    else:
        height, width = image
        aspect = width / height  # _resize_output_size_scale_below_upper_bound
        if width >= height and width > MAX_IMAGE_SIZE:
            width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
        elif height > width and height > MAX_IMAGE_SIZE:
            height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
        height, width = max(height, 1), max(width, 1)
    aspect = width / height  # resize_for_vision_encoder
    if width >= height:
        width = math.ceil(width / side) * side
        height = math.ceil(int(width / aspect) / side) * side
    else:
        height = math.ceil(height / side) * side
        width = math.ceil(int(height * aspect) / side) * side
    per_tile = (side // patch) ** 2 // scale_factor**2
    whole: tuple[Segment, ...] = ((False, 2), (True, per_tile), (False, 1))
    if height <= side and width <= side:
        return ImageLayout(
            height=side, width=side, tiles=1, image=(side, side), grid=(0, 0), prompt=whole
        )
    rows, cols = height // side, width // side
    row: tuple[Segment, ...] = ((False, 2), (True, per_tile)) * cols + ((False, 1),)
    return ImageLayout(
        height=side,
        width=side,
        tiles=rows * cols + 1,
        image=(height, width),
        grid=(rows, cols),
        prompt=row * rows + whole,
    )
