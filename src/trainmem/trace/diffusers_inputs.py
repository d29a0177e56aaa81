"""The training batch of any diffusers transformer or UNet, from its forward signature.

:func:`forward_inputs` walks ``type(model).forward``'s parameters and sizes each from its rule
in :data:`INPUT_RULES` (keyed by the argument's name) with the config fields the rule names and
the batch geometry of :func:`trainmem.specs.diffusers.image_batch`.

Note [Inputs from the forward signature]
    diffusers names a denoiser's inputs consistently across classes: the noisy latent is
    ``hidden_states`` (transformers) or ``sample`` (UNets), the noise level ``timestep``, the
    text-encoder states ``encoder_hidden_states`` (width ``joint_attention_dim``,
    ``caption_channels``, ``text_dim``, ``cross_attention_dim``... by class), the pooled text
    embedding ``pooled_projections``, FLUX-style position ids ``img_ids`` / ``txt_ids``. So one
    rule per argument name, reading the config field that sizes it, builds the batch of every
    class that uses these names; a class's own geometry (VAE factor, packing, text length,
    frames) is its row in :data:`trainmem.specs.diffusers.DIFFUSERS_FAMILIES` or the defaults
    there. A required argument (no default) without a rule, or whose rule finds no config
    field to size it, is refused with its name; an optional one is fed when its rule is marked
    ``optional`` and applies (``guidance`` only with ``guidance_embeds``, SDXL's
    ``added_cond_kwargs`` only with ``addition_embed_type "text_time"``...), else left at its
    default as the pipelines leave it.

    Conventions, from diffusers' training scripts (v0.42): inputs in the parameter dtype (the
    scripts cast latents and embeddings to ``weight_dtype``); UNet timesteps int64
    ``torch.randint(0, 1000, (b,))`` (``examples/text_to_image/train_text_to_image.py``);
    flow-matching transformers fp32 scheduler timesteps in [0, 1000) (``train_dreambooth_sd3.py``),
    FLUX-style packed models the sigmas ``timesteps / 1000`` (``train_dreambooth_flux.py``);
    masks all ones (unpadded prompts); ids zeros (their values never size memory).
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs.diffusers import LAYOUTS, diffusers_family, image_batch
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch
from trainmem.trace.known_values import known
from trainmem.trace.quantized import parameter_dtype

torch = require_torch()

__all__ = ["INPUT_RULES", "InputRule", "Sizes", "forward_inputs"]

ABSENT: Any = object()
"""A rule's answer when the argument does not apply to this config (left at its default)."""


@dataclass(frozen=True)
class Sizes:
    """What the rules size an argument from."""

    model: Any
    """The built model (its ``config``, and attributes such as ``use_additional_conditions``)."""
    cfg: dict[str, Any]
    """``dict(model.config)``."""
    name: str
    """The class name."""
    b: int
    """Micro-batch."""
    t: int
    """Text tokens."""
    f: int
    """Latent frames (0 for an image model)."""
    frames: int
    """Pixel frames (0 for an image model)."""
    h: int
    """Latent height (pixels for a pixel-space model)."""
    w: int
    """Latent width."""
    height: int
    """Pixels."""
    width: int
    """Pixels."""
    layout: str
    """The latent's layout (:data:`trainmem.specs.diffusers.LAYOUTS`)."""
    unet: bool
    """A UNet (its latent argument is ``sample``): int64 timesteps."""
    dtype: Any
    """The parameters' dtype."""

    def randn(self, *shape: int) -> Any:
        return torch.randn(*shape, dtype=self.dtype)

    def field(self, *keys: str) -> int | None:
        """The first of ``keys`` the config sets to a positive integer."""
        for key in keys:
            value = self.cfg.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
        return None

    @property
    def tokens(self) -> int:
        """Image tokens of a 2x2-packed latent (FLUX's ``_pack_latents``)."""
        return (self.h // 2) * (self.w // 2)


IN_CHANNEL_KEYS = (
    "audio_acoustic_hidden_dim",
    "in_channels",
    "in_dim",
    "in_visual_dim",
    "num_channels",
    "latent_dim",
    "embedding_dim",
)
TEXT_WIDTH_KEYS = (
    "encoder_hid_dim",
    "caption_channels",
    "joint_attention_dim",
    "text_dim",
    "text_embed_dim",
    "cap_feat_dim",
    "text_hidden_dim",
    "in_text_dim",
    "text_in_dim",
    "context_dim",
    "context_in_dim",
    "condition_dim",
    "llm_features_dim",
    "dit_text_dim",
    "text_states_dim",
    "cross_attention_dim",
    "clip_embed_dim",
    "embedding_dim",
    "encoder_hidden_size",
    "hidden_size",
)
"""Config fields giving the text-encoder width of ``encoder_hidden_states``, first match wins:
a projection's input (``encoder_hid_dim`` of IF's UNet, ``caption_channels`` of PixArt / Sana)
before the attention width it projects to (``cross_attention_dim``)."""
POOLED_KEYS = ("pooled_projection_dim", "pooled_embed_dim", "in_text_dim2")


CONDITIONED_VIDEO = frozenset({"Kandinsky6SRTransformer3DModel"})
"""Classes whose latent always carries the condition video and a mask (``2 c + 1`` channels,
``transformer_kandinsky6_sr.py``)."""


def _in_channels(s: Sizes) -> int:
    """The latent's channels: the first of :data:`IN_CHANNEL_KEYS` (else the input
    convolution's ``in_channels``); with Kandinsky's
    ``visual_cond`` the noisy latent, the condition video's and a mask channel (``2 c + 1``,
    ``transformer_kandinsky6.py``)."""
    c = s.field(*IN_CHANNEL_KEYS)
    for conv in ("conv_in", "base_conv_in"):  # ControlNet-XS: a fixed 4-channel conv_in
        if c is None and isinstance(getattr(s.model, conv, None), torch.nn.Conv2d):
            c = getattr(s.model, conv).in_channels
    if c is None:
        raise UnsupportedError(
            f"{s.name}: no input channel count in the config (looked for "
            f"{', '.join(IN_CHANNEL_KEYS)})"
        )
    conditioned = s.cfg.get("visual_cond") is True or s.name in CONDITIONED_VIDEO
    return 2 * c + 1 if conditioned else c


def latent(s: Sizes) -> Any:
    """The noisy latent in the class's layout; c = ``in_channels``."""
    c = _in_channels(s)
    shapes: dict[str, tuple[int, ...]] = {
        "image": (s.b, c, s.h, s.w),
        "video": (s.b, c, s.f, s.h, s.w),
        "video-fc": (s.b, s.f, c, s.h, s.w),
        "tokens": (s.b, s.tokens, c),
        "joint-tokens": (s.b, s.t + s.tokens, c),
        "video-tokens": (s.b, s.f * s.h * s.w, c),
        "video-hwc": (s.b, s.f, s.h, s.w, c),
        "sequence": (s.b, c, s.h),
        "sequence-tokens": (s.b, s.h, c),
        "vector": (s.b, c),
    }
    if s.layout == "per-sample":
        return per_sample(s)
    if s.layout == "patches":
        pt, ph, pw = _patch(s)
        return s.randn(s.b, (s.h // ph) * (s.w // pw), c, pt, ph, pw)
    return s.randn(*shapes[s.layout])


def _patch(s: Sizes) -> tuple[int, int, int]:
    """``patch_size`` as (time, height, width) patches."""
    value = s.cfg.get("patch_size")
    if isinstance(value, list | tuple) and len(value) == 3:
        return int(value[0]), int(value[1]), int(value[2])
    p = value if isinstance(value, int) else 1
    return 1, p, p


def patch_shapes(s: Sizes) -> Any:
    """One (1, h / ph, w / pw) per sample: the target image's patch grid, no reference image
    (JoyImage Edit Plus's ``shape_list``, ``pipeline_joyimage_edit_plus.py``
    ``prepare_latents``)."""
    if s.layout != "patches":
        return ABSENT
    _, ph, pw = _patch(s)
    return [[(1, s.h // ph, s.w // pw)] for _ in range(s.b)]


PER_FRAME_TIMESTEP = frozenset({"AnyFlowTransformer3DModel", "AnyFlowFARTransformer3DModel"})
"""Classes that take one noise level per latent frame ([b, f]: AnyFlow's flow map,
``transformer_anyflow.py`` ``forward_timestep``)."""


CHANNEL_FRAME_TIMESTEP = frozenset({"SanaWMTransformer3DModel"})
"""Classes that take one noise level per latent frame as [b, 1, f] (SANA-WM's LTX-style
timesteps, ``transformer_sana_wm.py``) and the prompt as [b, 1, t, width]."""


def timestep(s: Sizes) -> Any:
    """[b]: int64 for UNets, fp32 sigmas for packed (FLUX-style) models, fp32 in [0, 1000)
    otherwise (Note [Inputs from the forward signature]); [b, f] for
    :data:`PER_FRAME_TIMESTEP`, [b, 1, f] for :data:`CHANNEL_FRAME_TIMESTEP`."""
    if s.name in PER_FRAME_TIMESTEP:
        return torch.rand(s.b, max(s.f, 1)) * 1000
    if s.name in CHANNEL_FRAME_TIMESTEP:
        return torch.rand(s.b, 1, max(s.f, 1)) * 1000
    if s.unet:
        return torch.randint(0, 1000, (s.b,))
    if s.layout == "tokens":
        return torch.rand(s.b)
    return torch.rand(s.b) * 1000


ALIGNED_TEXT = frozenset({"MiniMaxMusic3Transformer1DModel"})
"""Classes whose condition is aligned to the latent timeline, one vector per latent frame
(``transformer_minimax_music3.py``: ``encoder_hidden_states`` (batch, length, condition_dim))."""


FRAME_TEXT = frozenset({"UNetMotionModel"})
"""Classes fed the prompt once per latent frame ([b f, t, width]: AnimateDiff's
``prompt_embeds.repeat_interleave(repeats=num_frames, dim=0)``, ``pipeline_animatediff.py``;
the UNet folds the frames into the batch)."""


BUNDLED_TEXT = frozenset({"BriaFibo2Transformer2DModel"})
"""Classes fed one bundle of text-encoder states for their Perceiver and one per injection block
([b, 1 + len(``injection_layer_ids``), t, width], ``transformer_bria_fibo2.py``)."""


LAYERED_TEXT = frozenset({"Krea2Transformer2DModel"})
"""Classes fed a stack of text-encoder layers per token ([b, t, ``num_text_layers``,
``text_hidden_dim``], ``transformer_krea2.py``)."""


def text_states(s: Sizes) -> Any:
    """[b, t, width]; width from :data:`TEXT_WIDTH_KEYS` (per-block lists of equal widths read
    as one); [b, latent length, width] for :data:`ALIGNED_TEXT`; [b f, t, width] for
    :data:`FRAME_TEXT`; [b, bundles, t, width] for :data:`BUNDLED_TEXT`; [b, 1, t, width] for
    :data:`CHANNEL_FRAME_TIMESTEP`; [b, t, layers, width] for :data:`LAYERED_TEXT`."""
    width = s.field(*TEXT_WIDTH_KEYS)
    cross = s.cfg.get("cross_attention_dim")
    if width is None and isinstance(cross, list | tuple) and len(set(cross)) == 1:
        width = cross[0]
    if width is not None and s.name in ALIGNED_TEXT:
        return s.randn(s.b, s.h, width)
    if width is not None and s.name in BUNDLED_TEXT:
        bundles = 1 + len(s.cfg.get("injection_layer_ids") or ())
        return s.randn(s.b, bundles, s.t, width)
    if width is not None and s.name in CHANNEL_FRAME_TIMESTEP:
        return s.randn(s.b, 1, s.t, width)
    if width is not None and s.name in FRAME_TEXT:
        return s.randn(s.b * max(s.f, 1), s.t, width)
    if width is not None and s.layout == "joint-tokens":
        return s.randn(s.b, s.t + s.tokens, width)
    layers = s.field("num_text_layers")
    if layers is not None and s.name in LAYERED_TEXT:
        return s.randn(s.b, s.t, layers, s.field("text_hidden_dim") or 0)
    if width is None:
        if isinstance(cross, list | tuple):
            raise UnsupportedError(
                f"cross_attention_dim: per-block widths {cross!r:.80} are not supported; "
                "give one integer"
            )
        return ABSENT
    return s.randn(s.b, s.t, width)


def pooled(s: Sizes) -> Any:
    """[b, ``pooled_projection_dim``]: the pooled CLIP embedding."""
    width = s.field(*POOLED_KEYS)
    return ABSENT if width is None else s.randn(s.b, width)


def _id_width(s: Sizes) -> int:
    axes = s.cfg.get("axes_dims_rope")
    return len(axes) if isinstance(axes, list | tuple) and axes else 3


def img_ids(s: Sizes) -> Any:
    """[(h/2)(w/2), axes]: one position per packed token (``pipeline_flux.py``)."""
    return torch.zeros(s.tokens, _id_width(s), dtype=s.dtype)


def txt_ids(s: Sizes) -> Any:
    """[t, axes]."""
    return torch.zeros(s.t, _id_width(s), dtype=s.dtype)


def guidance(s: Sizes) -> Any:
    """[b] guidance scale, only with ``guidance_embeds`` (FLUX.1-dev)."""
    return torch.full((s.b,), 3.5) if s.cfg.get("guidance_embeds") else ABSENT


def added_cond(s: Sizes) -> Any:
    """SDXL's micro-conditions (``addition_embed_type "text_time"``: ``text_embeds`` [b,
    ``projection_class_embeddings_input_dim - 6 * addition_time_embed_dim``], ``time_ids``
    [b, 6], ``train_text_to_image_sdxl.py``); PixArt-alpha's (``use_additional_conditions``:
    ``resolution`` [b, 2], ``aspect_ratio`` [b, 1], ``pipeline_pixart_alpha.py``)."""
    if s.cfg.get("addition_embed_type") == "text_time":
        time_dim = 6 * s.cfg["addition_time_embed_dim"]  # six micro-conditions
        pooled_dim = s.cfg["projection_class_embeddings_input_dim"] - time_dim
        return {"text_embeds": s.randn(s.b, pooled_dim), "time_ids": s.randn(s.b, 6)}
    if getattr(s.model, "use_additional_conditions", False):
        return {"resolution": s.randn(s.b, 2), "aspect_ratio": s.randn(s.b, 1)}
    if s.layout == "image" and not s.unet:
        return {"resolution": None, "aspect_ratio": None}
    return ABSENT


def class_labels(s: Sizes) -> Any:
    """[b] int64 class ids: ``num_class_embeds`` classes, or ``num_embeds_ada_norm`` for DiT's
    class-conditioned ``ada_norm_zero``."""
    n = s.field("num_class_embeds")
    if n is None and s.cfg.get("norm_type") == "ada_norm_zero":
        n = s.field("num_embeds_ada_norm")
    return ABSENT if n is None else torch.randint(0, n, (s.b,))


def text_mask(s: Sizes) -> Any:
    """[b, t] ones: unpadded prompts; its value is known to the forward (Note [Known values
    of a synthetic batch])."""
    return known(lambda: torch.ones(s.b, s.t, dtype=torch.bool))


def sizes_2(s: Sizes) -> Any:
    """[b, 2] pixel (height, width) or crop offsets (CogView3 / 4 micro-conditions)."""
    return s.randn(s.b, 2)


def img_shapes(s: Sizes) -> Any:
    """One (frames, h/2, w/2) per sample (``pipeline_qwenimage.py``)."""
    return [[(1, s.h // 2, s.w // 2)] for _ in range(s.b)]


IMAGE_SLOT_TOKENS = 4
"""Packed latent tokens per vision-language image slot (a 2x2 group, QwenImage 2.1's
``_IMG_TOKENS_PER_SLOT``)."""


def image_slot_mask(s: Sizes) -> Any:
    """[b, t + (h/2)(w/2) / 4] bool: False at the t prompt tokens, True at the target image's
    slots, one per 2x2 group of packed latent tokens (``pipeline_qwenimage21.py``
    ``append_target_slots``; text to image: no condition image). Its value is known to the
    forward, which places the latent tokens by it."""
    slots = s.tokens // IMAGE_SLOT_TOKENS
    return known(
        lambda: torch.cat(
            [torch.zeros(s.b, s.t, dtype=torch.bool), torch.ones(s.b, slots, dtype=torch.bool)], 1
        )
    )


def _patch_tokens(s: Sizes) -> int:
    _, ph, pw = _patch(s)
    return (s.h // ph) * (s.w // pw)


def prior_tokens(s: Sizes) -> Any:
    """[b, (h / p)(w / p)] int64 zeros: one prior (autoregressive stage's VQ) token id per
    image patch (``pipeline_glm_image.py``: the prior's ids upsampled to the patch grid); its
    value is known."""
    return known(lambda: torch.zeros(s.b, _patch_tokens(s), dtype=torch.int64))


def prior_drop(s: Sizes) -> Any:
    """[b, (h / p)(w / p)] bool False: no prior token dropped (the conditional branch,
    ``prior_token_drop_cond``); its value is known (the forward indexes by it)."""
    return known(lambda: torch.zeros(s.b, _patch_tokens(s), dtype=torch.bool))


FRAMEPACK_HISTORY = {"latents_clean": 2, "latents_history_2x": 2, "latents_history_4x": 16}
"""FramePack's clean context, in latent frames: the first frame and the last generated one,
then 2 and 16 frames of history at 2x and 4x compression (``pipeline_hunyuan_video_framepack.py``
``history_sizes = [1, 2, 16]``)."""


def history_latents(key: str) -> Callable[[Sizes], Any]:
    """FramePack's ``latents_clean`` / ``latents_history_2x`` / ``latents_history_4x`` [b, c,
    frames, h, w] (:data:`FRAMEPACK_HISTORY`), only with ``has_clean_x_embedder``."""

    def make(s: Sizes) -> Any:
        if not s.cfg.get("has_clean_x_embedder"):
            return ABSENT
        return s.randn(s.b, _in_channels(s), FRAMEPACK_HISTORY[key], s.h, s.w)

    make.__doc__ = history_latents.__doc__
    return make


def history_indices(key: str | None) -> Callable[[Sizes], Any]:
    """[frames] int64 ``arange``: the frame positions of FramePack's noisy window (``key``
    None: ``indices_latents``, the latent's frames) or of a clean context (one dimension, as the
    pipeline passes them); known values."""

    def make(s: Sizes) -> Any:
        if key is not None and not s.cfg.get("has_clean_x_embedder"):
            return ABSENT
        n = max(s.f, 1) if key is None else FRAMEPACK_HISTORY[key]
        return known(lambda: torch.arange(n))

    make.__doc__ = history_indices.__doc__
    return make


AUDIO_FPS = 24.0
"""The video frame rate LTX-2-style pipelines assume by default (``pipeline_ltx2.py``
``frame_rate=24.0``): it sets how many audio latents the clip spans and the temporal RoPE."""


def audio_frames(s: Sizes) -> int | None:
    """Audio latents of the clip: ``round(frames / 24 * audio_sampling_rate / audio_hop_length /
    audio_scale_factor)`` (``pipeline_ltx2.py``: the clip's seconds times the audio VAE's latents
    per second); None without an audio branch."""
    rate, hop = s.field("audio_sampling_rate"), s.field("audio_hop_length")
    scale = s.field("audio_scale_factor")
    if rate is None or hop is None or scale is None or not s.field("audio_in_channels"):
        return None
    return max(round(s.frames / AUDIO_FPS * rate / hop / scale), 1)


def audio_latent(s: Sizes) -> Any:
    """[b, audio latents, ``audio_in_channels``]: the patchified audio latent (mel bins folded
    into channels, ``pipeline_ltx2.py`` ``_pack_audio_latents``)."""
    n = audio_frames(s)
    return ABSENT if n is None else s.randn(s.b, n, s.field("audio_in_channels") or 0)


def audio_length(s: Sizes) -> Any:
    """``audio_num_frames``: the audio latents' length (for the audio RoPE coordinates)."""
    n = audio_frames(s)
    return ABSENT if n is None else n


def chunk_partition(s: Sizes) -> Any:
    """AnyFlow FAR's frames per chunk: the config's ``chunk_partition`` (the pipeline's default,
    ``pipeline_anyflow_far.py``), when it sums to the latent frames (81 frames: 21)."""
    parts = s.cfg.get("chunk_partition")
    if not isinstance(parts, list | tuple) or sum(parts) != max(s.f, 1):
        return ABSENT
    return list(parts)


def video_rope(s: Sizes) -> Any:
    """The (cos, sin) video RoPE of the latent's frames, built by the model's own
    ``build_rotary_emb_for_absolute_positions`` as the SANA-WM refiner pipeline builds it
    (``pipelines/sana_wm/refiner.py``: frames 0 .. f - 1 of the window, 24 fps)."""
    build = getattr(s.model, "build_rotary_emb_for_absolute_positions", None)
    if build is None:
        return ABSENT
    return build(batch_size=s.b, frame_positions=list(range(max(s.f, 1))), height=s.h,
                 width=s.w, device=torch.device("cpu"), fps=AUDIO_FPS)  # fmt: skip


ANIMATE = frozenset({"WanAnimateTransformer3DModel"})
"""Classes driven by a pose video and a face video beside a reference image (Wan-Animate,
``pipeline_wan_animate.py``): the latent's f frames are the reference image's latent frame and
a segment of f - 1 latent frames."""

CLIP_IMAGE_TOKENS = 257
"""CLIP ViT-H/14's penultimate hidden states at 224 px: 16 x 16 patches + the class token
(``pipeline_wan_i2v.py`` ``encode_image``: ``hidden_states[-2]``)."""


def animate_pose(s: Sizes) -> Any:
    """[b, ``latent_channels``, f - 1, h, w]: the pose video's latents, one per segment frame."""
    c = s.field("latent_channels")
    if s.name not in ANIMATE or c is None:
        return ABSENT
    return s.randn(s.b, c, max(s.f - 1, 1), s.h, s.w)


def animate_face(s: Sizes) -> Any:
    """[b, 3, segment frames, ``motion_encoder_size``, same]: the face video in pixels; the
    segment's (f - 2) * 4 + 1 frames (77 by default)."""
    size = s.field("motion_encoder_size")
    if s.name not in ANIMATE or size is None:
        return ABSENT
    return s.randn(s.b, 3, max((s.f - 2) * 4 + 1, 1), size, size)


def clip_image_states(s: Sizes) -> Any:
    """[b, 257, ``image_dim``]: the reference image's CLIP states (:data:`CLIP_IMAGE_TOKENS`),
    fed to :data:`ANIMATE` classes, whose pipeline always passes them."""
    width = s.field("image_dim")
    return ABSENT if width is None else s.randn(s.b, CLIP_IMAGE_TOKENS, width)


def vace_context(s: Sizes) -> Any:
    """[b, ``vace_in_channels``, f, h, w]: VACE's conditioning latents (the control video's
    latents and its mask folded into channels, ``pipeline_wan_vace.py`` ``conditioning_latents``);
    the per-layer scales are left at the model's default of ones."""
    c = s.field("vace_in_channels")
    return ABSENT if c is None else s.randn(s.b, c, max(s.f, 1), s.h, s.w)


def padding_mask(s: Sizes) -> Any:
    """[1, 1, height, width] zeros, concatenated to the latent with ``concat_padding_mask``
    (``pipeline_cosmos_text2world.py``).

    Raises:
        UnsupportedError: torchvision missing (the forward resizes the mask with it)."""
    if not s.cfg.get("concat_padding_mask"):
        return ABSENT
    if importlib.util.find_spec("torchvision") is None:
        raise UnsupportedError(
            f"{s.name}: with concat_padding_mask its forward resizes the padding mask with "
            "torchvision.transforms, which is not installed (pip install torchvision, the build "
            "matching your torch)"
        )
    return torch.zeros(1, 1, s.height, s.width, dtype=s.dtype)


def latent_size(axis: str) -> Callable[[Sizes], Any]:
    """LTX-Video's ``num_frames`` / ``height`` / ``width`` of its token sequence (latent
    units, ``pipeline_ltx.py``); only for the ``video-tokens`` layout."""

    def size(s: Sizes) -> Any:
        return getattr(s, axis) if s.layout == "video-tokens" else ABSENT

    size.__doc__ = latent_size.__doc__
    return size


def added_time_ids(s: Sizes) -> Any:
    """[b, 3]: fps, motion bucket, noise augmentation (``pipeline_stable_video_diffusion.py``
    ``_get_add_time_ids``)."""
    return s.randn(s.b, 3)


def fps(s: Sizes) -> Any:
    """[b] frame rate (``pipeline_i2vgen_xl.py``)."""
    return torch.full((s.b,), 8)


def image_latents(s: Sizes) -> Any:
    """[b, in_channels, f, h, w]: the conditioning image's latents (``pipeline_i2vgen_xl.py``)."""
    return s.randn(s.b, _in_channels(s), max(s.f, 1), s.h, s.w)


def image_embeds(s: Sizes) -> Any:
    """[b, 729, ``image_embed_dim``]: SigLIP's 27 x 27 semantic tokens, zeros for text-to-video
    (``pipeline_hunyuan_video1_5.py``); FramePack's SigLIP image states [b, 729,
    ``image_proj_dim``] with ``has_image_proj`` (``pipeline_hunyuan_video_framepack.py``)."""
    width = s.field("image_embed_dim")
    if width is None and s.cfg.get("has_image_proj"):
        width = s.field("image_proj_dim")
    if width is None:
        return ABSENT
    return known(lambda: torch.zeros(s.b, 729, width, dtype=s.dtype))


def rope_positions(s: Sizes) -> Any:
    """Kandinsky 5's ``visual_rope_pos``: aranges over latent frames, h / 2, w / 2
    (``pipeline_kandinsky.py``)."""
    return [torch.arange(max(s.f, 1)), torch.arange(s.h // 2), torch.arange(s.w // 2)]


def second_text_states(s: Sizes) -> Any:
    """[b, t, ``text_embed_2_dim``]: the second text encoder's states (HunyuanVideo 1.5's
    ByT5, ``pipeline_hunyuan_video1_5.py``)."""
    width = s.field("text_embed_2_dim")
    return ABSENT if width is None else s.randn(s.b, s.t, width)


def second_text_mask(s: Sizes) -> Any:
    """[b, t] ones beside ``encoder_hidden_states_2``."""
    return ABSENT if s.field("text_embed_2_dim") is None else text_mask(s)


def image_embeddings(s: Sizes) -> Any:
    """[b, ``cross_attention_dim``]: the CLIP image embedding (``pipeline_i2vgen_xl.py``)."""
    width = s.field("cross_attention_dim")
    return ABSENT if width is None else s.randn(s.b, width)


def text_encoder_layers(s: Sizes) -> Any:
    """One [b, t, ``text_encoder_dim``] per caption projection (Bria FIBO feeds every block its
    own text-encoder layer, ``pipeline_bria_fibo.py``)."""
    width, layers = s.field("text_encoder_dim"), getattr(s.model, "caption_projection", None)
    if width is None or layers is None:
        return ABSENT
    return [s.randn(s.b, s.t, width) for _ in range(len(layers))]


MASKED_TEXT = frozenset({"Kandinsky3UNet"})
"""Classes whose pipeline always passes the prompt mask (``pipeline_kandinsky3.py``: the UNet
reads ``encoder_attention_mask`` unconditionally)."""


def per_sample(s: Sizes) -> Any:
    """Z-Image's ``x``: one [in_channels, 1, h, w] latent per sample (a list,
    ``pipeline_z_image.py``)."""
    return [s.randn(_in_channels(s), 1, s.h, s.w) for _ in range(s.b)]


def per_sample_text(s: Sizes) -> Any:
    """Z-Image's ``cap_feats``: one [t, ``cap_feat_dim``] per sample (a list)."""
    width = s.field("cap_feat_dim")
    return ABSENT if width is None else [s.randn(s.t, width) for _ in range(s.b)]


def clip_input(key: str, tokens: int | None) -> Callable[[Sizes], Any]:
    """Stable Cascade's CLIP conditions ``clip_text_pooled`` [b, 1, ``clip_text_pooled_in_
    channels``], ``clip_text`` [b, t, ``clip_text_in_channels``], ``clip_img`` [b, 1,
    ``clip_image_in_channels``] (``pipeline_stable_cascade_prior.py``); None tokens: t."""

    def make(s: Sizes) -> Any:
        width = s.field(key)
        return ABSENT if width is None else s.randn(s.b, tokens or s.t, width)

    make.__doc__ = clip_input.__doc__
    return make


def prior_embedding(s: Sizes) -> Any:
    """[b, ``embedding_proj_dim`` or ``embedding_dim``]: the CLIP text embedding a prior
    (Kandinsky / unCLIP ``PriorTransformer``) conditions on (``pipeline_kandinsky_prior.py``)."""
    width = s.field("embedding_proj_dim", "embedding_dim")
    return ABSENT if width is None else s.randn(s.b, width)


def control_image(s: Sizes) -> Any:
    """[b, ``ctrl_conditioning_channels``, height, width]: ControlNet-XS's conditioning image in
    pixels (``pipeline_controlnet_xs.py``)."""
    c = s.field("ctrl_conditioning_channels")
    return ABSENT if c is None else s.randn(s.b, c, s.height, s.width)


def context_latents(s: Sizes) -> Any:
    """[b, length, ``in_channels - audio_acoustic_hidden_dim``]: ACE-Step's source latents and
    chunk masks, concatenated to the noisy latent's channels (``ace_step_transformer.py``)."""
    total, noisy = s.field("in_channels"), s.field("audio_acoustic_hidden_dim")
    if total is None or noisy is None or total <= noisy:
        return ABSENT
    return s.randn(s.b, s.h, total - noisy)


def joint_positions(s: Sizes) -> Any:
    """[t + (h/2)(w/2), 3] zeros: one (axis) position per text and packed image token
    (``transformer_krea2.py``) for the packed ``tokens`` layout; [b, t + (h/2)(w/2), 3] for
    the ``joint-tokens`` one (``transformer_ideogram4.py``)."""
    if s.layout == "joint-tokens":
        return torch.zeros(s.b, s.t + s.tokens, 3, dtype=torch.int64)
    if s.layout != "tokens":
        return ABSENT
    return torch.zeros(s.t + s.tokens, 3, dtype=torch.int64)


def joint_ids(s: Sizes) -> Any:
    """[b, t + (h/2)(w/2)] int64 zeros: Ideogram 4's per-token sample id and role of a packed
    text-and-image sequence (``segment_ids``, ``indicator``: ``transformer_ideogram4.py``)."""
    if s.layout != "joint-tokens":
        return ABSENT
    return torch.zeros(s.b, s.t + s.tokens, dtype=torch.int64)


@dataclass(frozen=True)
class InputRule:
    """How one forward argument is sized."""

    make: Callable[[Sizes], Any]
    """Returns the value, or :data:`ABSENT` when the config does not use the argument."""
    optional: bool | Callable[[Sizes], bool] = False
    """Fed also when the signature gives it a default (the model needs it in training); a
    callable decides per model."""


INPUT_RULES: dict[str, InputRule] = {
    "hidden_states": InputRule(latent),
    "sample": InputRule(latent),
    "x": InputRule(latent),
    "timestep": InputRule(timestep, optional=True),
    "timesteps": InputRule(timestep, optional=True),
    "t": InputRule(timestep),
    "timestep_ratio": InputRule(lambda s: torch.rand(s.b)),
    "encoder_hidden_states": InputRule(text_states, optional=True),
    "cap_feats": InputRule(
        lambda s: per_sample_text(s) if s.layout == "per-sample" else text_states(s)
    ),
    "pooled_projections": InputRule(pooled, optional=True),
    "img_ids": InputRule(img_ids, optional=True),
    "txt_ids": InputRule(txt_ids, optional=True),
    "guidance": InputRule(guidance, optional=True),
    "added_cond_kwargs": InputRule(added_cond, optional=True),
    "class_labels": InputRule(class_labels, optional=True),
    "encoder_attention_mask": InputRule(text_mask, optional=lambda s: s.name in MASKED_TEXT),
    "encoder_hidden_states_mask": InputRule(text_mask),
    "mask": InputRule(text_mask, optional=True),
    "original_size": InputRule(sizes_2),
    "target_size": InputRule(sizes_2),
    "crop_coords": InputRule(sizes_2),
    "img_shapes": InputRule(img_shapes, optional=True),
    "img_mask": InputRule(image_slot_mask),
    "shape_list": InputRule(patch_shapes, optional=True),
    "prior_token_id": InputRule(prior_tokens),
    "chunk_partition": InputRule(chunk_partition),
    "control_hidden_states": InputRule(vace_context, optional=True),
    "pose_hidden_states": InputRule(animate_pose, optional=lambda s: s.name in ANIMATE),
    "face_pixel_values": InputRule(animate_face, optional=lambda s: s.name in ANIMATE),
    "encoder_hidden_states_image": InputRule(
        clip_image_states, optional=lambda s: s.name in ANIMATE
    ),
    "video_rotary_emb": InputRule(video_rope),
    "audio_hidden_states": InputRule(audio_latent),
    "audio_encoder_hidden_states": InputRule(text_states),
    "audio_num_frames": InputRule(audio_length, optional=True),
    "indices_latents": InputRule(history_indices(None)),
    "latents_clean": InputRule(history_latents("latents_clean"), optional=True),
    "indices_latents_clean": InputRule(history_indices("latents_clean"), optional=True),
    "latents_history_2x": InputRule(history_latents("latents_history_2x"), optional=True),
    "indices_latents_history_2x": InputRule(history_indices("latents_history_2x"), optional=True),
    "latents_history_4x": InputRule(history_latents("latents_history_4x"), optional=True),
    "indices_latents_history_4x": InputRule(history_indices("latents_history_4x"), optional=True),
    "prior_token_drop": InputRule(prior_drop),
    "timestep_r": InputRule(timestep),
    "r_timestep": InputRule(timestep),
    "padding_mask": InputRule(padding_mask, optional=True),
    "num_frames": InputRule(latent_size("f"), optional=True),
    "height": InputRule(latent_size("h"), optional=True),
    "width": InputRule(latent_size("w"), optional=True),
    "added_time_ids": InputRule(added_time_ids),
    "fps": InputRule(fps),
    "image_latents": InputRule(image_latents),
    "image_embeds": InputRule(image_embeds, optional=True),
    "visual_rope_pos": InputRule(rope_positions),
    "text_rope_pos": InputRule(lambda s: torch.arange(s.t)),
    "encoder_hidden_states_2": InputRule(second_text_states, optional=True),
    "encoder_attention_mask_2": InputRule(second_text_mask, optional=True),
    "image_embeddings": InputRule(image_embeddings, optional=True),
    "text_encoder_layers": InputRule(text_encoder_layers, optional=True),
    "clip_text_pooled": InputRule(clip_input("clip_text_pooled_in_channels", 1)),
    "clip_text": InputRule(clip_input("clip_text_in_channels", None), optional=True),
    "clip_img": InputRule(clip_input("clip_image_in_channels", 1), optional=True),
    "proj_embedding": InputRule(prior_embedding),
    "controlnet_cond": InputRule(control_image, optional=True),
    "context_latents": InputRule(context_latents),
    "text_bth": InputRule(text_states),
    "position_ids": InputRule(joint_positions),
    "segment_ids": InputRule(joint_ids),
    "indicator": InputRule(joint_ids),
    "text_lens": InputRule(lambda s: torch.full((s.b,), s.t)),
}
"""Forward argument name -> its rule; see Note [Inputs from the forward signature]."""


def _layout(name: str, row_layout: str, params: Any, frames: int) -> str:
    if row_layout:
        return row_layout
    if "img_ids" in params or "img_shapes" in params:
        return "tokens"
    return "video" if frames else "image"


def _feeds_optional(rule: InputRule, s: Sizes) -> bool:
    return rule.optional(s) if callable(rule.optional) else rule.optional


def forward_inputs(model: Any, training: TrainingConfig) -> dict[str, Any]:
    """``model(**batch)``'s keyword arguments from :data:`INPUT_RULES` (call inside the fake
    mode).

    Raises:
        UnsupportedError: a required argument without a rule, or one its rule cannot size.
    """
    cfg = dict(model.config)
    name, fam = diffusers_family(cfg)
    g = image_batch(cfg, training)
    params = {
        k: p
        for k, p in inspect.signature(type(model).forward).parameters.items()
        if k != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    layout = _layout(name, fam.layout, params, g.frames)
    assert layout in LAYOUTS, layout
    s = Sizes(
        model=model,
        cfg=cfg,
        name=name,
        b=training.micro_batch_size,
        t=g.text_seq_len,
        f=g.latent_frames,
        frames=g.frames,
        h=g.latent_height,
        w=g.latent_width,
        height=g.height,
        width=g.width,
        layout=layout,
        unet="sample" in params,
        dtype=parameter_dtype(model),
    )
    batch: dict[str, Any] = {}
    for arg, p in params.items():
        required = p.default is inspect.Parameter.empty
        rule = INPUT_RULES.get(arg)
        if rule is None or not (required or _feeds_optional(rule, s)):
            if required:
                raise UnsupportedError(
                    f"{name}.forward needs {arg!r}, which trainmem has no input rule for "
                    "(trainmem.trace.diffusers_inputs.INPUT_RULES)"
                )
            continue
        value = rule.make(s)
        if value is ABSENT:
            if required:
                sized = " ".join((rule.make.__doc__ or "").split())[:160]
                raise UnsupportedError(
                    f"{name}.forward needs {arg!r}, but its rule finds no config field to "
                    f"size it (the rule: {sized})"
                )
            continue
        batch[arg] = value
    batch["return_dict"] = False
    return batch
