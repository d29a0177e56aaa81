"""diffusers models: which ``config.json`` is one, and the batch a training step feeds it.

A diffusers model config names its class in ``_class_name`` (``FluxTransformer2DModel``,
``SD3Transformer2DModel``, ``UNet2DConditionModel``, ``WanTransformer3DModel``) and has no
``model_type``. Such a model is not a formula family of the analytic engine; the trace engine
builds it with diffusers (``trainmem.trace.diffusers_model``). This module holds what needs no
torch: recognising the config, each class's batch geometry (VAE factors, packing, default
resolution / frames / text length) and the checks of ``--resolution``, ``--frames`` and
``--text-seq-len`` against the model.

Batch geometry, from the diffusers pipelines and training scripts (diffusers v0.42):

=========================  ==========  =======  ===========  ==========================
class                      VAE factor  packing  text tokens  default
=========================  ==========  =======  ===========  ==========================
FluxTransformer2DModel     8           2x2      512 (T5)     1024 px
SD3Transformer2DModel      8           patch 2  77+256       ``sample_size`` * 8 px
UNet2DConditionModel       8           none     77           ``sample_size`` * 8 px
WanTransformer3DModel      8, time 4   1x2x2    512 (umT5)   480x832 px, 81 frames
other transformers / UNets 8 (1 for    config   77 (CLIP)    ``sample_size`` * 8 px;
                           pixel                             video: 17 frames, time 4
                           space)
=========================  ==========  =======  ===========  ==========================

Pixel-space UNets (3 or 6 input channels: DDPM's ``UNet2DModel``, DeepFloyd IF) take
``--resolution`` as the pixels they denoise. :data:`DIFFUSERS_FAMILIES` holds the rows that
differ from the defaults (their pipelines' resolution, frames, text length and latent layout).

Sources: ``pipelines/flux/pipeline_flux.py`` (``vae_scale_factor`` 8, ``_pack_latents`` 2x2,
``max_sequence_length=512``), ``pipelines/stable_diffusion_3/pipeline_stable_diffusion_3.py``
(77 CLIP tokens + ``max_sequence_length=256`` T5 tokens; ``default_sample_size``),
``pipelines/stable_diffusion_xl/pipeline_stable_diffusion_xl.py`` (77 tokens, ``sample_size *
vae_scale_factor``), ``pipelines/wan/pipeline_wan.py`` (height 480, width 832, 81 frames,
``vae_scale_factor_temporal`` 4, ``(num_frames - 1) // 4 + 1`` latent frames,
``max_sequence_length=512``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from trainmem.errors import NotApplicableError, SpecError, UnsupportedError
from trainmem.specs.bounds import MAX_COUNT, describe_int
from trainmem.specs.training import DIFFUSERS_LORA_TARGETS, LORA_TARGETS

__all__ = [
    "DIFFUSERS_FAMILIES",
    "DiffusersFamily",
    "LAYOUTS",
    "TEXT_ENCODERS",
    "TEXT_ENCODER_MAX_TOKENS",
    "TextEncoder",
    "trained_text_encoders",
    "FROZEN_COMPONENTS",
    "SD1_UNET",
    "FrozenComponent",
    "ImageBatch",
    "MAX_DIFFUSERS_BLOCKS",
    "CONTROLNET_BASES",
    "check_controlnet",
    "check_layerwise_casting",
    "check_diffusers_config",
    "check_diffusers_lora_targets",
    "check_image_options",
    "diffusers_class",
    "diffusers_family",
    "frozen_components",
    "kept_components",
    "image_batch",
    "is_diffusers_config",
    "is_pixel_space",
    "takes_pixels",
]


@dataclass(frozen=True, slots=True)
class DiffusersFamily:
    """Batch geometry of one diffusers model class."""

    vae_factor: int
    """Pixels per latent pixel (the VAE's spatial downsampling); 1 for a pixel-space model."""
    pixel_multiple: int
    """Height and width must be multiples of this (VAE factor x patch / packing)."""
    text_seq_len: int
    """Text tokens the pipeline feeds by default."""
    resolution: tuple[int, int] | None
    """Default (height, width) in pixels; None: the config's size (``sample_size``...) *
    ``vae_factor``."""
    temporal_factor: int = 0
    """Frames per latent frame (causal video VAE, first frame alone; 1 for a per-frame image
    VAE); 0 for image models."""
    frames: int = 0
    """Default frame count (video)."""
    layout: str = ""
    """How the noisy latent is laid out (:data:`LAYOUTS`); empty: from the forward signature
    (``trainmem.trace.diffusers_model``)."""


LAYOUTS: dict[str, str] = {
    "image": "[b, c, h, w]",
    "video": "[b, c, f, h, w]",
    "video-fc": "[b, f, c, h, w]",
    "tokens": "[b, (h / 2)(w / 2), c]: 2x2 patches packed into channels",
    "video-tokens": "[b, f h w, c]: one token per latent pixel",
    "video-hwc": "[b, f, h, w, c]",
    "sequence": "[b, c, sample_size]: a 1-D signal",
    "sequence-tokens": "[b, length, c]: 1-D audio latents, length = --resolution",
    "joint-tokens": "[b, t + (h / 2)(w / 2), c]: text and packed image tokens in one sequence",
    "vector": "[b, c]: one embedding (a prior's CLIP image embedding)",
    "per-sample": "a list of b tensors [c, 1, h, w]",
    "patches": "[b, (h / ph)(w / pw), c, pt, ph, pw]: one image's latent cut into patch_size "
    "patches",
}
"""The latent layouts of ``hidden_states`` / ``sample`` (b micro-batch, c ``in_channels``, f
latent frames, h, w latent height / width), from the forward docstrings of the classes."""


_WAN = DiffusersFamily(8, 16, 512, (480, 832), temporal_factor=4, frames=81)
_PER_FRAME_UNET = DiffusersFamily(8, 8, 77, None, temporal_factor=1, frames=16)

DIFFUSERS_FAMILIES: dict[str, DiffusersFamily] = {
    "FluxTransformer2DModel": DiffusersFamily(8, 16, 512, (1024, 1024)),
    "SD3Transformer2DModel": DiffusersFamily(8, 16, 77 + 256, None),
    "UNet2DConditionModel": DiffusersFamily(8, 8, 77, None),
    "WanTransformer3DModel": _WAN,
    "CogVideoXTransformer3DModel": DiffusersFamily(
        8, 16, 226, (480, 720), temporal_factor=4, frames=49, layout="video-fc"
    ),
    "ConsisIDTransformer3DModel": DiffusersFamily(
        8, 16, 226, (480, 720), temporal_factor=4, frames=49, layout="video-fc"
    ),
    "LTXVideoTransformer3DModel": DiffusersFamily(
        32, 32, 128, (512, 704), temporal_factor=8, frames=161, layout="video-tokens"
    ),
    "LTX2VideoTransformer3DModel": DiffusersFamily(
        32, 32, 1024, (512, 768), temporal_factor=8, frames=121, layout="video-tokens"
    ),
    "SanaWMLTX2RefinerTransformer3DModel": DiffusersFamily(  # LTX-2 latents, its geometry
        32, 32, 1024, (512, 768), temporal_factor=8, frames=121, layout="video-tokens"
    ),
    "MochiTransformer3DModel": DiffusersFamily(
        8, 16, 256, (480, 848), temporal_factor=6, frames=163
    ),
    "Kandinsky5Transformer3DModel": DiffusersFamily(
        8, 16, 256, (512, 768), temporal_factor=4, frames=121, layout="video-hwc"
    ),
    "Kandinsky6Transformer3DModel": DiffusersFamily(
        8, 16, 256, (512, 768), temporal_factor=4, frames=121, layout="video-hwc"
    ),
    "Kandinsky6SRTransformer3DModel": DiffusersFamily(
        8, 16, 0, None, temporal_factor=4, frames=17, layout="video-hwc"
    ),
    "Krea2Transformer2DModel": DiffusersFamily(8, 16, 77, None, layout="tokens"),
    "Ideogram4Transformer2DModel": DiffusersFamily(8, 16, 77, None, layout="joint-tokens"),
    "ZImageTransformer2DModel": DiffusersFamily(8, 16, 512, (1024, 1024), layout="per-sample"),
    "PriorTransformer": DiffusersFamily(1, 1, 77, (1, 1), layout="vector"),
    "JoyImageEditPlusTransformer3DModel": DiffusersFamily(8, 16, 77, None, layout="patches"),
    "HunyuanVideoFramepackTransformer3DModel": DiffusersFamily(  # a 9-latent-frame window
        8, 16, 77, None, temporal_factor=4, frames=33
    ),
    "MiniMaxMusic3Transformer1DModel": DiffusersFamily(1, 1, 0, None, layout="sequence"),
    "AnyFlowTransformer3DModel": DiffusersFamily(
        8, 16, 512, (480, 832), temporal_factor=4, frames=81, layout="video-fc"
    ),
    "AnyFlowFARTransformer3DModel": DiffusersFamily(
        8, 16, 512, (480, 832), temporal_factor=4, frames=81, layout="video-fc"
    ),
    # Wan-Animate: a 77-frame segment (20 latent frames) after the reference image's latent
    # frame: 81 frames' worth of latents (pipeline_wan_animate.py, segment_frame_length=77)
    "WanAnimateTransformer3DModel": _WAN,
    "WanVACETransformer3DModel": _WAN,
    "UNet3DConditionModel": _PER_FRAME_UNET,
    "UNetMotionModel": _PER_FRAME_UNET,
    "I2VGenXLUNet": _PER_FRAME_UNET,
    "UNetSpatioTemporalConditionModel": DiffusersFamily(
        8, 8, 1, (576, 1024), temporal_factor=1, frames=14, layout="video-fc"
    ),
}
"""Classes whose pipeline sets the batch geometry; see the module docstring. Any other
transformer / UNet class takes :func:`diffusers_family`'s defaults."""

_PER_FRAME_VIDEO = frozenset({"TransformerTemporalModel"})
"""Video classes of per-frame image VAEs (temporal factor 1) without a row."""


def _is_video(name: str) -> bool:
    return "3D" in name or "Video" in name or name in _PER_FRAME_VIDEO


def _spatial_patch(config: Mapping[str, Any]) -> int:
    """The spatial patch size (``patch_size`` or its last entry, Wan's ``(1, 2, 2)``), 1 if
    none."""
    value = config.get("patch_size")
    if isinstance(value, list | tuple) and value:
        value = value[-1]
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def _unet_downsampling(config: Mapping[str, Any]) -> int:
    blocks = config.get("down_block_types")
    return 2 ** (len(blocks) - 1) if isinstance(blocks, list | tuple) and blocks else 1


def is_pixel_space(name: str, config: Mapping[str, Any]) -> bool:
    """A UNet denoising pixels, not latents: 3 input channels (RGB: DDPM's ``UNet2DModel``,
    DeepFloyd IF stage I) or 6 (RGB and an RGB condition image: IF stage II); latent models
    take 4, 16 or more channels (the VAE's)."""
    return "UNet" in name and config.get("in_channels") in (3, 6)


def diffusers_family(config: Mapping[str, Any]) -> tuple[str, DiffusersFamily]:
    """The class and its batch geometry: its row of :data:`DIFFUSERS_FAMILIES`, else the
    defaults: the 8x spatial VAE of SD / FLUX / Wan (1 in pixel space, :func:`is_pixel_space`),
    77 text tokens (CLIP's context, ``train_text_to_image.py``), the config's sample size, and
    for a video class (``3D`` / ``Video`` in its name) a causal VAE of temporal factor 4 at 17
    frames (Wan / HunyuanVideo / CogVideoX VAEs: ``(frames - 1) // 4 + 1`` latent frames).

    Raises:
        UnsupportedError: a class that is not a denoising transformer or UNet.
    """
    name = diffusers_class(config)
    row = DIFFUSERS_FAMILIES.get(name)
    if row is not None:
        return name, row
    if name == "UNet1DModel":
        return name, DiffusersFamily(1, 1, 0, None, layout="sequence")
    if "UNet" not in name and ("1D" in name or "Audio" in name):  # audio latent tokens
        return name, DiffusersFamily(1, 1, 77, None, layout="sequence-tokens")
    vae = 1 if is_pixel_space(name, config) else 8
    multiple = vae * max(_spatial_patch(config), 2) * _unet_downsampling(config)
    if _is_video(name):
        factor = 1 if name in _PER_FRAME_VIDEO else 4
        return name, DiffusersFamily(vae, multiple, 77, None, temporal_factor=factor, frames=17)
    return name, DiffusersFamily(vae, multiple, 77, None)


def is_diffusers_config(config: Mapping[str, Any]) -> bool:
    """A diffusers model config: a ``_class_name`` and no transformers ``model_type``."""
    return isinstance(config.get("_class_name"), str) and not config.get("model_type")


def diffusers_class(config: Mapping[str, Any]) -> str:
    """The config's ``_class_name``, if it is a denoising model trainmem trains (a diffusers
    transformer or UNet: ``Transformer`` or ``UNet`` in its name).

    Raises:
        UnsupportedError: another diffusers class (a VAE, a ControlNet...), naming examples.
    """
    name = str(config.get("_class_name"))
    if "Transformer" not in name and "UNet" not in name:
        raise UnsupportedError(
            f"_class_name: diffusers model {name[:80]!r} is not a denoising transformer or "
            f"UNet, the models trainmem trains ({', '.join(list(DIFFUSERS_FAMILIES)[:4])}, "
            "...); trace it with trainmem.trace(build_model, make_batch, loss_fn=...) from "
            "Python"
        )
    return name


MAX_DIFFUSERS_BLOCKS = 1_000
"""Blocks per list a diffusers config may ask for (``num_layers``, ``num_single_layers``,
``layers_per_block``...): about 20x the deepest released model (FLUX.1 has 19 + 38, Wan 2.1
14B 40). diffusers builds every block, about 50 ms each, so ten million hung the build."""


MINUS_ONE_MEANS_AUTO = frozenset({"refer_offset_t", "refer_offset_h", "refer_offset_w"})
"""Integer fields where diffusers reads -1 as "resolve from the input" (Wan-Animate 2's
reference-grid offsets, default ``refer_offset_w=-1``: ``transformer_wan_animate_2.py``)."""


def _counts_blocks(key: str) -> bool:
    return (key.startswith("num_") and key.endswith("layers")) or key.endswith("layers_per_block")


def check_diffusers_config(config: Mapping[str, Any]) -> None:
    """Range-check the integers of a diffusers config before diffusers builds it: no size,
    count or index is negative (but -1 where it means "from the input":
    :data:`MINUS_ONE_MEANS_AUTO`) or above 2^31 - 1, and no block list is deeper than
    :data:`MAX_DIFFUSERS_BLOCKS` (``num_layers: -2`` was accepted, ``10000000`` hung).

    Raises:
        SpecError: the first offending field, with the allowed range.
    """
    for key, value in config.items():
        items = value if isinstance(value, list | tuple) else [value]
        top = MAX_DIFFUSERS_BLOCKS if _counts_blocks(key) else MAX_COUNT
        low = -1 if key in MINUS_ONE_MEANS_AUTO else 0
        for item in items:
            if isinstance(item, bool) or not isinstance(item, int):
                continue  # floats, names and flags are diffusers' to check
            if not low <= item <= top:
                raise SpecError(str(key)[:80], f"got {describe_int(item)}; allowed: {low}..{top:,}")


@dataclass(frozen=True, slots=True)
class ImageBatch:
    """The geometry of one diffusers micro-batch, settings resolved against the model."""

    height: int
    """Pixels."""
    width: int
    """Pixels."""
    frames: int
    """Video frames (0 for an image model)."""
    text_seq_len: int
    """Text-encoder tokens (the cross / joint attention context)."""
    latent_height: int
    """``height / vae_factor``."""
    latent_width: int
    """``width / vae_factor``."""
    latent_frames: int
    """``(frames - 1) / temporal_factor + 1`` (0 for an image model)."""


def _sample_size(config: Mapping[str, Any]) -> tuple[int, int]:
    """(height, width) of the config's latent: ``sample_height`` / ``sample_width`` (CogVideoX,
    Allegro), else ``sample_size`` (an integer or [height, width]); 64 (SD 1.x's 512 px) for a
    config without any (``UNet2DConditionModel``'s default ``sample_size=None``)."""
    h, w = config.get("sample_height"), config.get("sample_width")
    if isinstance(h, int) and isinstance(w, int) and h > 0 and w > 0:
        return h, w
    value = config.get("sample_size", 64)
    if value is None:
        value = 64
    if isinstance(value, list | tuple) and value:
        pair = (value[0], value[-1])
    else:
        pair = (value, value)
    for v in pair:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise SpecError("sample_size", f"must be a positive integer, got {value!r:.80}")
    return pair


_JOINT_POSITION_TABLES = frozenset({"CogVideoXTransformer3DModel", "ConsisIDTransformer3DModel"})
"""Classes whose patch embedding adds one position table over the text and the video tokens."""


def fixed_text_seq_len(name: str, config: Mapping[str, Any]) -> int | None:
    """Text tokens a model accepts when it takes only one count, else None.

    CogVideoX and ConsisID without rotary positions (``use_rotary_positional_embeddings``
    false, CogVideoX-2b's layout) add one position table of ``max_text_seq_length`` + video
    tokens rows to the joined text and video embeddings (diffusers 0.42 models/embeddings.py
    ``CogVideoXPatchEmbed``: ``joint_pos_embedding = torch.zeros(1, self.max_text_seq_length +
    num_patches, ...)``; ``embeds = embeds + pos_embedding``), so any other text length fails
    to broadcast. Default ``max_text_seq_length`` 226 (the T5 prompt length of the pipelines).

    Args:
        name: the diffusers class name.
        config: the diffusers ``config.json``.

    Returns:
        The one text length, or None where any length runs.
    """
    if name not in _JOINT_POSITION_TABLES or config.get("use_rotary_positional_embeddings"):
        return None
    return int(config.get("max_text_seq_length", 226))


def image_batch(config: Mapping[str, Any], training: Any) -> ImageBatch:
    """Resolve ``resolution`` / ``frames`` / ``text_seq_len`` against a diffusers config.

    Explicit settings win; otherwise the defaults of :func:`diffusers_family`. A pixel-space
    model (:func:`is_pixel_space`) takes ``resolution`` as its input's pixels.

    Args:
        config: the diffusers ``config.json``.
        training: a :class:`~trainmem.specs.training.TrainingConfig`.

    Returns:
        The batch geometry.

    Raises:
        SpecError: a resolution that is not a multiple of the model's pixel multiple, frames
            for an image model, a frame count the video VAE cannot encode.
        UnsupportedError: an unsupported diffusers class.
    """
    name, fam = diffusers_family(config)
    if training.image_size is not None:
        height, width = training.image_size
    elif fam.resolution is not None:
        height, width = fam.resolution
    else:
        latent_h, latent_w = _sample_size(config)
        height, width = latent_h * fam.vae_factor, latent_w * fam.vae_factor
    if height % fam.pixel_multiple or width % fam.pixel_multiple:
        raise SpecError(
            "resolution",
            f"{height}x{width} px is not a multiple of {fam.pixel_multiple} for {name} "
            f"(VAE factor {fam.vae_factor} x patch size); e.g. "
            f"{max(height // fam.pixel_multiple, 1) * fam.pixel_multiple}",
        )
    frames = 0
    if fam.temporal_factor:
        frames = fam.frames if training.frames is None else int(training.frames)
        if (frames - 1) % fam.temporal_factor:
            raise SpecError(
                "frames",
                f"{frames} frames: {name}'s video VAE encodes 1 + {fam.temporal_factor}k frames "
                f"(1, {1 + fam.temporal_factor}, ..., {fam.frames}); e.g. "
                f"{(frames - 1) // fam.temporal_factor * fam.temporal_factor + 1}",
            )
    elif training.frames is not None:
        raise SpecError("frames", f"{name} is an image model; --frames is only for video models")
    text = fam.text_seq_len if training.text_seq_len is None else int(training.text_seq_len)
    fixed = fixed_text_seq_len(name, config)
    if fixed is not None and training.text_seq_len is None:
        text = fixed
    elif fixed is not None and text != fixed:
        raise SpecError(
            "text_seq_len",
            f"{text} text tokens: {name} with position embeddings takes exactly its config's "
            f"max_text_seq_length ({fixed}); e.g. --text-seq-len {fixed}",
        )
    return ImageBatch(
        height=height,
        width=width,
        frames=frames,
        text_seq_len=text,
        latent_height=height // fam.vae_factor,
        latent_width=width // fam.vae_factor,
        latent_frames=(frames - 1) // fam.temporal_factor + 1 if fam.temporal_factor else 0,
    )


IMAGE_OPTIONS: tuple[str, ...] = ("resolution", "frames", "text_seq_len")
"""TrainingConfig fields that describe a diffusers batch (``--resolution``, ``--frames``,
``--text-seq-len``)."""


def check_image_options(
    config: Mapping[str, Any], training: Any, *, pixels: bool | None = None
) -> None:
    """Refuse the diffusers batch options for a model that is not a diffusers model, and check
    them against a diffusers one.

    Args:
        config: the model's ``config.json``.
        training: a :class:`~trainmem.specs.training.TrainingConfig`.
        pixels: the model takes an image (``resolution`` allowed); None: from ``config``
            (:func:`takes_pixels`).

    A vision-language model (``vision_config`` beside ``text_config`` or a vocabulary) takes
    ``resolution`` as its one image per sample (``trainmem.trace.hf_inputs.
    vision_language_batch``).

    Raises:
        SpecError: an image option on a language model (names the option), or a bad value.
    """
    frozen_components(config, training)
    check_controlnet(config, training)
    check_layerwise_casting(config, training)
    check_diffusers_lora_targets(config, training)
    trained_text_encoders(config, training)
    if is_diffusers_config(config):
        check_diffusers_config(config)
        image_batch(config, training)
        return
    pixels = takes_pixels(config) if pixels is None else pixels
    language_and_vision = "vision_config" in config and bool(
        config.get("text_config") or config.get("vocab_size")
    )
    for name in IMAGE_OPTIONS:
        if getattr(training, name) is None or (
            name == "resolution" and (pixels or language_and_vision)
        ):
            continue
        flag = "--" + name.replace("_", "-")
        if language_and_vision:
            raise SpecError(
                name,
                f"{flag} describes the batch of a diffusers image/video model; a vision-language "
                "model takes one image per sample and its text: use --resolution and --seq-len",
            )
        if pixels:
            raise SpecError(
                name,
                f"{flag} describes the batch of a diffusers image/video model; this model takes "
                "one image per sample: use --resolution and --micro-batch-size",
            )
        raise SpecError(
            name,
            f"{flag} describes the batch of an image model (a diffusers config.json with "
            "_class_name, or a transformers vision model); this model takes tokens: use "
            "--seq-len and --micro-batch-size",
        )


def takes_pixels(config: Mapping[str, Any]) -> bool:
    """A transformers config whose model's own input is an image (ViT, DINOv2, the CLIP /
    SigLIP vision towers, SegFormer, ConvNeXt...): it names ``num_channels`` or ``image_size``
    (transformers' vision configs; a default one may be left out of the file) and no token
    vocabulary, and is not a composite (a vision-language or encoder-decoder config keeps its
    parts in ``vision_config`` / ``text_config`` / ``encoder``). Such a model takes
    ``--resolution`` as its training images' size (``make_hf_batch``'s ``pixel_values``; the
    analytic engine's patch count, :func:`trainmem.analytic.activation_shapes.
    tokens_per_sequence`). A head on a vision backbone whose own config has neither field
    (UperNet: transformers ``UperNetConfig`` keeps ``num_channels`` in its ``backbone_config``,
    as the Hub's openmmlab/upernet-* config.json files do) takes pixels when its
    ``backbone_config`` does."""
    composite = ("text_config", "vision_config", "encoder", "decoder")
    backbone = config.get("backbone_config")
    return (
        "model_type" in config
        and bool(
            config.get("num_channels")
            or config.get("image_size")
            or (isinstance(backbone, Mapping) and takes_pixels(backbone))
        )
        and not config.get("vocab_size")
        and not any(key in config for key in composite)
    )


CONTROLNET_BASES: tuple[str, ...] = (
    "UNet2DConditionModel",
    "FluxTransformer2DModel",
    "SD3Transformer2DModel",
)
"""Classes a ControlNet is made from: diffusers ``ControlNetModel.from_unet``
(``train_controlnet.py`` / ``_sdxl.py``), ``FluxControlNetModel.from_transformer``
(``train_controlnet_flux.py``), ``SD3ControlNetModel.from_transformer``
(``train_controlnet_sd3.py``)."""


def check_controlnet(config: Mapping[str, Any], training: Any) -> None:
    """Refuse ``controlnet`` where diffusers' ControlNet scripts do not run it.

    Args:
        config: the model's ``config.json``.
        training: a :class:`~trainmem.specs.training.TrainingConfig`.

    Raises:
        SpecError: ``controlnet`` on a model that is not one of :data:`CONTROLNET_BASES`
            (with LoRA: TrainingConfig refuses it, whatever the model); a FLUX ControlNet's
            block counts without ``controlnet`` on a FLUX transformer.
    """
    name = str(config.get("_class_name", ""))[:80] if is_diffusers_config(config) else ""
    for field in ("controlnet_double_layers", "controlnet_single_layers"):
        if getattr(training, field) is not None and not (
            training.controlnet and name == "FluxTransformer2DModel"
        ):
            raise SpecError(
                field,
                f"{getattr(training, field)}: the blocks of a FLUX ControlNet "
                "(train_controlnet_flux.py); set with controlnet on a FluxTransformer2DModel "
                "config, or leave it unset",
            )
    if not training.controlnet:
        return
    if name not in CONTROLNET_BASES:
        what = f"diffusers {name}" if name else "not a diffusers model"
        raise SpecError(
            "controlnet",
            "a ControlNet is made from a diffusers UNet2DConditionModel (SD 1.x / 2.x, SDXL: "
            "the pipeline's unet/config.json), FluxTransformer2DModel or SD3Transformer2DModel "
            f"config (transformer/config.json); this model is {what}: leave it off",
        )


def check_diffusers_lora_targets(config: Mapping[str, Any], training: Any) -> None:
    """Refuse diffusers module names in ``lora_targets`` for a model that is not a diffusers
    model (:data:`~trainmem.specs.training.DIFFUSERS_LORA_TARGETS`).

    Raises:
        SpecError: ``lora_targets``, naming the diffusers names and what the model takes.
    """
    named = [t for t in training.lora_targets if t in DIFFUSERS_LORA_TARGETS]
    if not named or training.lora_rank == 0 or is_diffusers_config(config):
        return
    raise SpecError(
        "lora_targets",
        f"{','.join(named)}: diffusers module names, for a diffusers model (a config.json with "
        f"_class_name); this model takes {','.join(LORA_TARGETS)}",
    )


def check_layerwise_casting(config: Mapping[str, Any], training: Any) -> None:
    """Refuse ``layerwise_casting`` where trainmem does not run diffusers' layerwise casting
    (Note [diffusers' layerwise casting] in trainmem/trace/layerwise_casting.py).

    Args:
        config: the model's ``config.json``.
        training: a :class:`~trainmem.specs.training.TrainingConfig`.

    Raises:
        SpecError: ``layerwise_casting`` on a model that is not a diffusers model, without LoRA
            (finetrainers applies it to LoRA runs only: the trained weights would be float8),
            with a quantized base, a ControlNet or trained text encoders, sharded
            (``zero_stage`` > 0: finetrainers casts the model back to one dtype for FSDP;
            tensor parallelism) or compiled.
    """
    which = training.layerwise_casting
    if which == "none":
        return
    why = ""
    if not is_diffusers_config(config):
        why = "casts a diffusers model's layers (a config.json with _class_name); this is not one"
    elif training.lora_rank == 0:
        why = (
            "stores the frozen weights in float8; without LoRA the weights are trained "
            "(finetrainers applies it to LoRA runs only): set lora_rank"
        )
    elif training.quantize_base != "none":
        why = f"and quantize_base={training.quantize_base} both store the frozen weights: pick one"
    elif training.controlnet or training.train_text_encoder:
        why = "is modelled on the trained denoiser alone: leave controlnet / train_text_encoder off"
    elif training.zero_stage > 0 or training.tensor_parallel_size > 1:
        why = (
            "is modelled on one unsharded model (finetrainers casts the model back to one dtype "
            "when it shards it): zero_stage 0, tensor_parallel_size 1"
        )
    elif training.compile:
        why = "is not modelled under torch.compile (its hooks swap the weights): compile off"
    if why and not is_diffusers_config(config):  # an option of diffusers models only
        raise NotApplicableError(f"layerwise_casting: {which} {why}; allowed here: none")
    if why:
        raise SpecError("layerwise_casting", f"{which} {why}; allowed here: none")


@dataclass(frozen=True, slots=True)
class TextEncoder:
    """A pipeline text encoder as ``TrainingConfig.train_text_encoder`` trains it."""

    attribute: str
    """The pipeline's attribute (``text_encoder``, ``text_encoder_2``)."""
    model_class: str
    """The transformers class (``CLIPTextModel``, ``CLIPTextModelWithProjection``)."""
    config: Mapping[str, Any]
    """Its ``CLIPTextConfig`` fields, from the Hub config it is counted from (the same as
    :class:`FrozenComponent`'s; tests/specs/test_frozen_components.py)."""


CLIP_L_TEXT: Mapping[str, Any] = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "hidden_act": "quick_gelu",
    "projection_dim": 768,
}
"""openai/clip-vit-large-patch14 ``text_config`` (SD 1.x's and SDXL's ``text_encoder``)."""
CLIP_G_TEXT: Mapping[str, Any] = {
    "vocab_size": 49408,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "max_position_embeddings": 77,
    "hidden_act": "gelu",
    "projection_dim": 1280,
}
"""laion/CLIP-ViT-bigG-14-laion2B-39B-b160k ``text_config`` (SDXL's ``text_encoder_2``)."""

TEXT_ENCODERS: dict[str, tuple[TextEncoder, ...]] = {
    "sd1": (TextEncoder("text_encoder", "CLIPTextModel", CLIP_L_TEXT),),
    "sdxl": (
        TextEncoder("text_encoder", "CLIPTextModel", CLIP_L_TEXT),
        TextEncoder("text_encoder_2", "CLIPTextModelWithProjection", CLIP_G_TEXT),
    ),
}
"""The text encoders ``train_text_encoder`` trains, per UNet pipeline: SD 1.x (a UNet with
``cross_attention_dim`` 768 and no added conditions; runwayml/stable-diffusion-v1-5
text_encoder/config.json) and SDXL (``addition_embed_type`` text_time, 2048 = 768 + 1280;
stabilityai/stable-diffusion-xl-base-1.0). The encoders' states are concatenated into
``encoder_hidden_states``, SDXL's bigG projection is the ``text_embeds`` condition."""

TEXT_ENCODER_MAX_TOKENS = 77
"""CLIP's ``max_position_embeddings``: the prompt tokens a trained CLIP text encoder reads."""


def trained_text_encoders(config: Mapping[str, Any], training: Any) -> tuple[TextEncoder, ...]:
    """The text encoders ``training.train_text_encoder`` trains beside the UNet of ``config``.

    Args:
        config: the model's ``config.json``.
        training: a :class:`~trainmem.specs.training.TrainingConfig`.

    Returns:
        :data:`TEXT_ENCODERS`' row (empty without ``train_text_encoder``).

    Raises:
        SpecError: ``train_text_encoder`` on a model that is not an SD 1.x / SDXL UNet, with
            ``controlnet``, or with more than 77 prompt tokens.
    """
    if not training.train_text_encoder:
        return ()
    name = str(config.get("_class_name", ""))[:80] if is_diffusers_config(config) else ""
    width = config.get("cross_attention_dim")
    added = config.get("addition_embed_type")
    kind = ""
    if name == "UNet2DConditionModel":
        if added == "text_time" and width == 2048:
            kind = "sdxl"
        elif added is None and width == 768:
            kind = "sd1"
    if not kind:
        what = f"diffusers {name}" if name else "not a diffusers model"
        if name == "UNet2DConditionModel":
            what += f" with cross_attention_dim {width!r:.20}"
        raise SpecError(
            "train_text_encoder",
            "the text encoders trained are SD 1.x's CLIP-L (a UNet2DConditionModel with "
            "cross_attention_dim 768) and SDXL's CLIP-L + bigG (text_time, 2048); this model "
            f"is {what}: leave it off",
        )
    if training.controlnet:
        raise SpecError(
            "train_text_encoder",
            "train_controlnet.py keeps the text encoder frozen; leave one of them off",
        )
    if training.text_seq_len is not None and training.text_seq_len > TEXT_ENCODER_MAX_TOKENS:
        raise SpecError(
            "text_seq_len",
            f"{training.text_seq_len}: a CLIP text encoder reads at most "
            f"{TEXT_ENCODER_MAX_TOKENS} tokens (with train_text_encoder)",
        )
    return TEXT_ENCODERS[kind]


@dataclass(frozen=True, slots=True)
class FrozenComponent:
    """One frozen model of a diffusers pipeline besides the trained one (a VAE or a text
    encoder), as its training scripts keep it on the GPU."""

    attribute: str
    """The pipeline's attribute (``vae``, ``text_encoder``, ``text_encoder_2``...)."""
    kind: str
    """``vae`` or ``text-encoder`` (``TrainingConfig.frozen_on_gpu``)."""
    source: str
    """The model class and the Hub config it was counted from."""
    num_params: int
    """``sum(p.numel())`` of the class built from that config on ``meta``
    (tests/specs/test_frozen_components.py rebuilds each)."""
    dtype: str | None = None
    """The dtype the scripts move it in; None: their ``weight_dtype`` (the run's 16-bit
    compute dtype, fp32 for ``32-true``)."""
    build: tuple[str, Mapping[str, Any]] | None = None
    """A VAE's diffusers class and its constructor arguments (the config ``num_params`` was
    counted from), for its encode inside the step (Note [The frozen VAE encodes inside the
    step], trainmem/trace/frozen_encode.py); None for a text encoder."""
    text: tuple[str, Mapping[str, Any], str] | None = None
    """A text encoder's transformers model class, its config class's arguments (the config
    ``num_params`` was counted from) and the prompt tokens it reads (:data:`PROMPT_TOKENS`),
    for its forward inside the step (Note [The frozen text encoders encode inside the step]);
    None: not traced (a VAE, or an encoder without a config here)."""


PROMPT_TOKENS: tuple[str, ...] = ("clip", "all", "after-clip")
"""A frozen text encoder's prompt tokens: ``clip`` CLIP's 77 (``tokenize_prompt(...,
max_sequence_length=77)``), ``all`` the run's ``text_seq_len`` (FLUX's T5 at
``--max_sequence_length``, 512), ``after-clip`` ``text_seq_len`` - 77 (SD3's T5: its 256
tokens follow the 77 CLIP ones in ``prompt_embeds``)."""


T5_XXL: Mapping[str, Any] = {
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "feed_forward_proj": "gated-gelu",
    "tie_word_embeddings": False,
}
"""google/t5-v1_1-xxl ``config.json``'s encoder fields (FLUX's ``text_encoder_2``, SD3's
``text_encoder_3``, LTX-Video's and CogVideoX's ``text_encoder``)."""

_CLIP_L = FrozenComponent(
    "text_encoder",
    "text-encoder",
    "CLIPTextModel, openai/clip-vit-large-patch14 text_config",
    123_060_480,
    text=("CLIPTextModel", CLIP_L_TEXT, "clip"),
)
_CLIP_L_PROJ = FrozenComponent(
    "text_encoder",
    "text-encoder",
    "CLIPTextModelWithProjection, openai/clip-vit-large-patch14 text_config",
    123_650_304,
    text=("CLIPTextModelWithProjection", CLIP_L_TEXT, "clip"),
)
_CLIP_G_PROJ = FrozenComponent(
    "text_encoder_2",
    "text-encoder",
    "CLIPTextModelWithProjection, laion/CLIP-ViT-bigG-14-laion2B-39B-b160k text_config",
    694_659_840,
    text=("CLIPTextModelWithProjection", CLIP_G_TEXT, "clip"),
)
_T5_XXL = FrozenComponent(
    "text_encoder_2",
    "text-encoder",
    "T5EncoderModel, google/t5-v1_1-xxl",
    4_762_310_656,
    text=("T5EncoderModel", T5_XXL, "all"),
)
SD_VAE: Mapping[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "block_out_channels": (128, 256, 512, 512),
    "layers_per_block": 2,
    "down_block_types": ("DownEncoderBlock2D",) * 4,
    "up_block_types": ("UpDecoderBlock2D",) * 4,
    "norm_num_groups": 32,
    "act_fn": "silu",
}
"""The ``AutoencoderKL`` fields SD 1.x's, SDXL's, SD3's and FLUX's ``vae/config.json`` share
(runwayml/stable-diffusion-v1-5, stabilityai/stable-diffusion-xl-base-1.0,
black-forest-labs/FLUX.1-dev); ``latent_channels`` and the quant convs differ."""

_VAE_16 = FrozenComponent(
    "vae",
    "vae",
    "AutoencoderKL, 16 latent channels, no quant convs (FLUX.1-dev / SD3 vae/config.json)",
    83_819_683,
    build=(
        "AutoencoderKL",
        {**SD_VAE, "latent_channels": 16, "use_quant_conv": False, "use_post_quant_conv": False},
    ),
)
_VAE_4 = ("AutoencoderKL", {**SD_VAE, "latent_channels": 4})

SD1_UNET = "UNet2DConditionModel (SD 1.x)"
""":data:`FROZEN_COMPONENTS`' key of an SD 1.x UNet (``cross_attention_dim`` 768, no added
conditions): CLIP-L and the 4-channel VAE, both in the scripts' ``weight_dtype``
(``train_dreambooth.py`` / ``train_controlnet.py``: ``vae.to(device, dtype=weight_dtype)``)."""

FROZEN_COMPONENTS: dict[str, tuple[FrozenComponent, ...]] = {
    "FluxTransformer2DModel": (_CLIP_L, _T5_XXL, _VAE_16),
    "SD3Transformer2DModel": (
        _CLIP_L_PROJ,
        _CLIP_G_PROJ,
        FrozenComponent(
            "text_encoder_3",
            "text-encoder",
            "T5EncoderModel, google/t5-v1_1-xxl",
            4_762_310_656,
            text=("T5EncoderModel", T5_XXL, "after-clip"),
        ),
        _VAE_16,
    ),
    "UNet2DConditionModel": (
        _CLIP_L,
        _CLIP_G_PROJ,
        FrozenComponent(
            "vae",
            "vae",
            "AutoencoderKL, 4 latent channels (stabilityai/stable-diffusion-xl-base-1.0 "
            "vae/config.json)",
            83_653_863,
            dtype="float32",
            build=_VAE_4,
        ),
    ),
    SD1_UNET: (
        _CLIP_L,
        FrozenComponent(
            "vae",
            "vae",
            "AutoencoderKL, 4 latent channels (runwayml/stable-diffusion-v1-5 vae/config.json)",
            83_653_863,
            build=_VAE_4,
        ),
    ),
    "LTXVideoTransformer3DModel": (
        FrozenComponent(
            "text_encoder",
            "text-encoder",
            "T5EncoderModel, google/t5-v1_1-xxl",
            4_762_310_656,
            text=("T5EncoderModel", T5_XXL, "all"),
        ),
        FrozenComponent(
            "vae",
            "vae",
            "AutoencoderKLLTXVideo, LTX-Video 0.9.0 (diffusers scripts/convert_ltx_to_diffusers.py "
            "get_vae_config; equal to the class defaults)",
            419_193_649,
            build=("AutoencoderKLLTXVideo", {}),
        ),
    ),
    "HunyuanVideoTransformer3DModel": (
        FrozenComponent(
            "text_encoder",
            "text-encoder",
            "LlamaModel, llava-llama-3-8b text model (hidden 4096, 32 layers, 8 KV heads, "
            "intermediate 14336, vocabulary 128320)",
            7_505_186_816,
        ),
        FrozenComponent(
            "text_encoder_2",
            "text-encoder",
            "CLIPTextModel, openai/clip-vit-large-patch14 text_config (HunyuanVideo)",
            123_060_480,
        ),
        FrozenComponent(
            "vae",
            "vae",
            "AutoencoderKLHunyuanVideo, its defaults (HunyuanVideo)",
            246_478_803,
            build=("AutoencoderKLHunyuanVideo", {}),
        ),
    ),
    "CogVideoXTransformer3DModel": (
        FrozenComponent(
            "text_encoder",
            "text-encoder",
            "T5EncoderModel, google/t5-v1_1-xxl (CogVideoX)",
            4_762_310_656,
            text=("T5EncoderModel", T5_XXL, "all"),
        ),
        FrozenComponent(
            "vae",
            "vae",
            "AutoencoderKLCogVideoX, its defaults (CogVideoX-2b / 5b)",
            215_583_907,
            build=("AutoencoderKLCogVideoX", {}),
        ),
    ),
    "WanTransformer3DModel": (
        FrozenComponent(
            "text_encoder",
            "text-encoder",
            "UMT5EncoderModel, google/umt5-xxl (Wan-AI/Wan2.1-T2V-1.3B-Diffusers)",
            5_680_910_336,
        ),
        FrozenComponent(
            "vae",
            "vae",
            "AutoencoderKLWan, its defaults (Wan-AI/Wan2.1-T2V-1.3B-Diffusers vae/config.json)",
            126_892_531,
            build=("AutoencoderKLWan", {}),
        ),
    ),
}
"""The frozen models of each trained class's pipeline: FLUX.1 (CLIP-L, T5-XXL encoder, the
16-channel VAE), SD3 / SD3.5 (CLIP-L and OpenCLIP bigG with projections, T5-XXL, the 16-channel
VAE), SDXL (CLIP-L, bigG with projection, the 4-channel VAE; a UNet with
``addition_embed_type: text_time``), SD 1.x (:data:`SD1_UNET`: CLIP-L, the 4-channel VAE), Wan
2.1 (umT5-XXL encoder, the Wan VAE), LTX-Video (T5-XXL encoder, its VAE), HunyuanVideo (the
llava-llama-3-8b text model, CLIP-L, its VAE) and CogVideoX (T5-XXL encoder, its VAE). Counted by
building each class from its Hub config on ``meta`` with transformers 5 / diffusers 0.42.

The scripts move them with ``.to(accelerator.device, dtype=weight_dtype)`` (diffusers
examples/dreambooth/train_dreambooth_lora_flux.py, train_dreambooth_lora_sd3.py), except
SDXL's VAE: ``vae.to(accelerator.device, dtype=torch.float32)`` ("The VAE is always in float32
to avoid NaN losses", examples/text_to_image/train_text_to_image_lora_sdxl.py). Wan has no
diffusers training example; the same convention is assumed. The video pipelines are as
finetrainers (e5df80c, Jan 2025) trains them without precomputation: each model's
``load_condition_models`` / ``load_latent_models`` in ``--text_encoder_dtype`` /
``--text_encoder_2_dtype`` / ``--vae_dtype``, all ``bf16`` by default (finetrainers/args.py),
here the run's compute dtype; its docs' "before training start" allocations are these counts
in bf16 beside the transformer and its LoRA r 128 to 0.04 GiB (LTX-Video: 13.486 GiB against
(4,762,310,656 + 419,193,649 + 1,923,385,472 + 117,440,512) x 2 B = 13.453 GiB; HunyuanVideo:
38.889 against 38.854)."""


def frozen_components(config: Mapping[str, Any], training: Any) -> list[tuple[str, int, str]]:
    """The frozen pipeline models ``training.frozen_on_gpu`` keeps on the GPU beside the trained
    diffusers model, as ``(pipeline attribute, elements, dtype)`` (:func:`kept_components`'
    rows in the dtype the scripts move them in)."""
    return [
        (c.attribute, c.num_params, c.dtype or training.compute_dtype)
        for c in kept_components(config, training)
    ]


def kept_components(config: Mapping[str, Any], training: Any) -> list[FrozenComponent]:
    """The frozen pipeline models ``training.frozen_on_gpu`` keeps on the GPU beside the trained
    diffusers model.

    Args:
        config: the trained model's diffusers ``config.json``.
        training: a :class:`~trainmem.specs.training.TrainingConfig`.

    Returns:
        :data:`FROZEN_COMPONENTS`' rows kept (none for ``frozen_on_gpu="none"``).

    Raises:
        SpecError: ``frozen_on_gpu`` for a model that is not a diffusers model, or for a UNet
            that is neither SDXL's nor SD 1.x's; ``vae_tiling`` without the VAE kept.
    """
    which = training.frozen_on_gpu
    if getattr(training, "vae_tiling", False) and which not in ("vae", "all"):
        raise SpecError(
            "vae_tiling",
            f"the VAE encodes in tiles inside the step when it is kept on the GPU, and "
            f"frozen_on_gpu is {which}; set --frozen-on-gpu vae or all (or leave vae_tiling off)",
        )
    if which == "none":
        return []
    if not is_diffusers_config(config):
        raise SpecError(
            "frozen_on_gpu",
            f"{which}: the VAE and text encoders of a diffusers pipeline (a config.json with "
            "_class_name); this model has none (use none)",
        )
    name = diffusers_class(config)
    if name == "UNet2DConditionModel" and config.get("addition_embed_type") != "text_time":
        if (
            config.get("addition_embed_type") is not None
            or config.get("cross_attention_dim") != 768
        ):
            raise SpecError(
                "frozen_on_gpu",
                f"{which}: the pipeline's components are known for SDXL's UNet "
                "(addition_embed_type text_time) and SD 1.x's (cross_attention_dim 768, no "
                "added conditions) only; use none",
            )
        name = SD1_UNET
    if name not in FROZEN_COMPONENTS:
        raise SpecError(
            "frozen_on_gpu",
            f"{which}: the pipeline's components are known for {', '.join(FROZEN_COMPONENTS)} "
            f"only, not {name[:80]}; use none",
        )
    kinds: tuple[str, ...] = ("vae", "text-encoder")
    if which != "all":
        kinds = (which.removesuffix("s"),)
    if training.train_text_encoder:  # trained: part of the model, not resident beside it
        kinds = tuple(k for k in kinds if k != "text-encoder")
    return [c for c in FROZEN_COMPONENTS[name] if c.kind in kinds]
