"""Model coverage of the generic path (issue 26): how many of the models a user can name are
built, traced and estimated end to end, with the reason for each one that is not.

Groups:

* ``transformers``: every ``model_type`` in one of transformers' training-head task mappings
  (``trainmem.trace.hf_model.TRAINING_HEADS``), its default config (``AutoConfig.for_model``)
  shrunk to 2 layers (a hybrid keeps the first layer of each kind, at most 4: ``shrink``). A
  type whose default config transformers itself cannot build into that head (on ``meta``, no
  trainmem involved) is listed apart, with transformers' error, and is not counted; default
  configs that transformers' own forward cannot run take a released config's fields
  (:data:`CONFIG_FIXES`: two hybrids with no attention layer, four GLM-4V rotary layouts);
* ``diffusers``: every diffusers ``ModelMixin`` transformer and UNet class
  (:func:`diffusers_group`; two default configs that diffusers' own forward cannot run take
  the fields of diffusers' own model test, :data:`DIFFUSERS_CONFIG_FIXES`);
* ``timm``: the most used timm models (:func:`timm_group`; needs the optional ``timm``).

Each model runs ``trainmem.estimate(..., engine="generic")`` at micro-batch 1, sequence
length 64 (an image model without one, as the CLI runs it without ``--seq-len``: images at the
config's size), bf16-mixed AdamW, allocator replay off.

    PYTHONPATH=src python benchmarks/coverage.py                 # every group
    PYTHONPATH=src python benchmarks/coverage.py transformers --limit 40
    PYTHONPATH=src python benchmarks/coverage.py transformers --only glm4v,jetmoe
    PYTHONPATH=src python benchmarks/coverage.py --json coverage.json

It prints one line per model and a summary per group: built and estimated / counted, and the
refusals grouped by reason. README's coverage table is its output.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.estimate import default_attention_of, estimate, image_sequence
from trainmem.specs.training import TrainingConfig

LAYER_KEYS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
)
"""Config fields that count a model's layers (transformers' and diffusers' spellings)."""

ALIAS_KEYS = ("num_blocks",)
"""Fields that count the layers in some configs only, cut where they equal a count of
:data:`LAYER_KEYS` (xLSTM's ``num_blocks``, which configuration_xlstm.py sets to
``num_hidden_layers`` and modeling_xlstm.py builds its blocks from; elsewhere ``num_blocks``
counts other things: EoMT's query blocks, Perceiver's cross-attention blocks)."""

STACK_KEYS = ("num_layers_per_stack",)
"""Fields holding the real layer count of a model whose ``num_hidden_layers`` counts cache slots,
a multiple of it: HRM's ``num_layers_per_stack`` blocks per stack, run ``H_cycles * (L_cycles +
1)`` times, each run its own cache slot (transformers 5.24 configuration_hrm_text.py
``__post_init__``: ``num_hidden_layers = num_layers_per_stack * H_cycles * (L_cycles + 1)``;
modeling_hrm_text.py builds ``num_layers_per_stack`` layers and indexes the cache at
``layer_idx + cycle_offset``). The cut keeps the multiple: cutting the slots alone left 16
blocks writing up to slot 127 of a 2-slot cache (IndexError)."""

PATTERN_KEYS = ("block_types",)
"""Config fields holding a repeating pattern of layer kinds, shorter than the model
(RecurrentGemma's ``block_types``: layer i is ``block_types[i % len]``)."""

TRAINING = TrainingConfig(micro_batch_size=1, seq_len=64)

_GLM4V_ROPE = {
    "rope_type": "default",
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "mrope_section": [8, 12, 12],
}
"""The released GLM-4.1V / GLM-4.5V text rotary layout: half of each 128-wide head rotated (64
dims, 32 frequencies), split 8 / 12 / 12 over time, height and width (zai-org/GLM-4.1V-9B-Thinking
and zai-org/GLM-4.5V config.json ``text_config``; GLM-4's partial rotary, which transformers'
own ``Glm4Config`` and ``Glm4vMoeTextConfig`` default to, ``kwargs.setdefault(
"partial_rotary_factor", 0.5)``)."""

CONFIG_FIXES: dict[str, dict[str, Any]] = {
    # The default configs are all Mamba (Bamba's attn_layer_indices None, GraniteMoeHybrid's
    # layer_types all "linear_attention"), which transformers 5.24's own forward cannot run with the
    # config's use_cache: the model makes a DynamicCache and create_causal_mask asks it for an
    # attention layer's length (cache_utils.py get_seq_length: "can only be called on Attention
    # layers"), on a GPU as here. The released models interleave attention layers (Bamba-9B,
    # the granite-4.0-h models, 1 in about 10), so the cut keeps one Mamba layer and one
    # attention layer, as it keeps them from a released config.
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {
        "layer_types": ["full_attention" if i == 1 else "linear_attention" for i in range(32)]
    },
    # transformers 5.24's default Glm4vTextConfig has no partial_rotary_factor (1.0: 128 dims,
    # 64 frequencies) while its rotary embedding splits them by the default mrope_section
    # [8, 12, 12] (32): modeling_glm4v.py Glm4vTextRotaryEmbedding.recomposition_frequencies
    # fails in transformers' own forward. GLM-4.6V (Flash) and Glmga (GLM-4.6V's model,
    # modular_glmga.py: GlmgaConfig(Glm46VConfig)) take the same text config.
    "glm4v": {"text_config": {"rope_parameters": _GLM4V_ROPE}},
    "glm46v": {"text_config": {"rope_parameters": _GLM4V_ROPE}},
    "glmga": {"text_config": {"rope_parameters": _GLM4V_ROPE}},
    # GLM-4.5V: 96 heads of 128 (released head_dim), not hidden_size // heads = 42
    "glm4v_moe": {"text_config": {"head_dim": 128, "rope_parameters": _GLM4V_ROPE}},
    # Step3p7's text model builds a sliding-window mask for every forward (modeling_step3p7.py:
    # create_sliding_window_causal_mask), which raises without a sliding_window, and the
    # default config has none (every layer full attention); transformers' own model test
    # (tests/models/step3p7/test_modeling_step3p7.py: "sliding_window required by
    # create_sliding_window_causal_mask even when no sliding layers are used") sets 64. No
    # layer slides, so the window changes no layer's attention.
    "step3p7": {"text_config": {"sliding_window": 64}},
}
"""transformers default configs that no user trains as they stand (transformers' own forward
cannot run them), with the fields a released config has (cited per row; merged field by field
into sub-configs, :func:`_merged`)."""


def shrink(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` cut to 2 layers, in place and in every sub-config: each layer-count field set
    to the number of layers kept and every per-layer field cut to those layers.

    The layers kept are the first of each kind in the config's per-layer lists (a hybrid's
    ``layer_types``: attention and linear-attention or Mamba layers; MoE or dense MLPs;
    full or shared indexers), at least 2 and at most 4, the same layers in every list, so the
    cut model still has every kind of layer and the lists agree; a repeating pattern shorter
    than the model (RecurrentGemma's ``block_types``) keeps the leading layers up to its last
    new kind; the layers a neck reads one feature map each (DPT's ``backbone_out_indices``, a
    backbone's ``out_features``) are kept when the cut would merge two of them and there is
    room (:func:`_feature_layers`). Fields that point at layers follow them: index lists
    (``out_indices``, ``backbone_out_indices``, ``out_features``' ``stageN``) point at the
    last kept layer at or before the one they named, a per-layer dict (``per_layer_config``)
    keeps its kept layers' entries, an attention period / offset pair (Jamba's
    ``attn_layer_period``) puts its first such layer inside the cut; DeepSeek's leading dense
    layers (``first_k_dense_replace``) become one; a count of cache slots that is a multiple of
    the real layer count (HRM, :data:`STACK_KEYS`) stays that multiple of the cut layers."""
    counts = {v for k in LAYER_KEYS if isinstance(v := config.get(k), int) and v > 2}
    slots = _slots_per_layer(config)
    if counts:
        kept = _kept_layers(config, counts)
        _cut_layers(config, counts, kept)
    for k, per_layer in slots.items():
        config[k] = min(config[k], 2)
        config["num_hidden_layers"] = config[k] * per_layer
    for v in config.values():
        if isinstance(v, dict):
            shrink(v)
    return config


def _slots_per_layer(config: dict[str, Any]) -> dict[str, int]:
    """Each :data:`STACK_KEYS` field of ``config`` and the cache slots per layer it counts
    (``num_hidden_layers`` over it)."""
    slots = config.get("num_hidden_layers")
    return {
        k: slots // v
        for k in STACK_KEYS
        if isinstance(v := config.get(k), int) and isinstance(slots, int) and v and not slots % v
    }


_INDEX_SUFFIXES = ("_indices", "_ids", "_idxs", "_layers")


def _is_index_list(key: str, value: Any, counts: set[int]) -> bool:
    """A list of layer indices (Llama 4's ``moe_layers``, DPT's ``backbone_out_indices``,
    LFM2's ``full_attn_idxs``): strictly increasing ints below the layer count."""
    return (
        key.endswith(_INDEX_SUFFIXES)
        and isinstance(value, list)
        and bool(value)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        and all(a < b for a, b in zip(value, value[1:], strict=False))
        and max(value) < max(counts)
    )


def _per_layer(config: dict[str, Any], counts: set[int]) -> list[str]:
    return [
        k
        for k, v in config.items()
        if isinstance(v, list)
        and len(v) in counts
        and k != "architectures"
        and not _is_index_list(k, v, counts)
    ]


def _kept_layers(config: dict[str, Any], counts: set[int]) -> list[int]:
    """The original indices of the layers the cut keeps (see :func:`shrink`)."""
    firsts: set[int] = set()
    for k in _per_layer(config, counts):
        if not all(isinstance(x, (str, bool)) or x in (0, 1) for x in config[k]):
            continue  # sizes per stage (Swin's num_heads), not kinds of layer
        seen: dict[str, int] = {}
        for i, x in enumerate(config[k]):
            seen.setdefault(str(x), i)
        if len(seen) > 1:
            firsts.update(seen.values())
    prefix = 0  # a repeating pattern shorter than the model: keep its leading layers
    for k in PATTERN_KEYS:
        v = config.get(k)
        if isinstance(v, list) and 1 < len(v) < max(counts) and len(set(map(str, v))) > 1:
            prefix = max(prefix, max(v.index(x) for x in v) + 1)
    kept = sorted(firsts)[:4] if not prefix else list(range(min(prefix, 4)))
    named = _feature_layers(config, counts)
    if len({_position(kept or [0], i) for i in named}) < len(named) <= 4 - len(set(kept) - named):
        kept = sorted(set(kept) | named)  # the cut would merge two feature maps: keep them
    for i in range(max(counts)):
        if len(kept) >= 2:
            break
        if i not in kept:
            kept = sorted([*kept, i])
    return kept


def _feature_layers(config: dict[str, Any], counts: set[int]) -> set[int]:
    """The layers whose outputs a neck reads one feature map each, which must stay distinct
    after the cut: DPT's ``backbone_out_indices`` (modeling_dpt.py keeps hidden state ``idx``
    ``if idx in config.backbone_out_indices``: two entries at one layer give one map, and the
    neck's ``neck_hidden_sizes`` count refuses it) and a backbone's ``out_features`` ``stageN``
    (layer N - 1; transformers' ``BackboneConfigMixin`` refuses duplicates)."""
    v = config.get("backbone_out_indices")
    if isinstance(v, list) and _is_index_list("backbone_out_indices", v, counts):
        return set(v)
    f = config.get("out_features")
    stages = [_stage_number(x) for x in f] if isinstance(f, list) else []
    return {n - 1 for n in stages if n} if stages and None not in stages else set()


def _stage_number(name: Any) -> int | None:
    ok = isinstance(name, str) and name.startswith("stage") and name[5:].isdigit()
    return int(name[5:]) if ok else None


def _position(kept: list[int], layer: int) -> int:
    """The cut's index of the last kept layer at or before original ``layer``."""
    return max([p for p, i in enumerate(kept) if i <= layer] or [0])


def _cut_layers(config: dict[str, Any], counts: set[int], kept: list[int]) -> None:
    keep = len(kept)
    for k in LAYER_KEYS:
        if isinstance(config.get(k), int) and config[k] > keep:
            config[k] = keep
    for k in ALIAS_KEYS:  # the same count under another name
        if isinstance(config.get(k), int) and config[k] in counts:
            config[k] = keep
    for k in _per_layer(config, counts):
        config[k] = [config[k][i] for i in kept]
    for k, v in list(config.items()):
        if k == "out_indices" and _layer_ints(v, counts):  # stage numbers: 0 is the stem
            config[k] = [i and _position(kept, i - 1) + 1 for i in v]
        elif _is_index_list(k, v, counts):  # one entry per feature map: same length
            positions = [_position(kept, i) for i in v]
            config[k] = positions if k.endswith("_indices") else sorted(set(positions))
        elif k == "out_features" and isinstance(v, list):
            config[k] = [_stage(x, kept) for x in v]
        elif "layer" in k and isinstance(v, dict) and v and all(str(x).isdigit() for x in v):
            if max(int(x) for x in v) < max(counts):  # a per-layer dict (per_layer_config)
                width = len(str(next(iter(v))))
                config[k] = {
                    f"{kept.index(int(x)):0{width}d}": e for x, e in v.items() if int(x) in kept
                }
        elif k.endswith("_offset") and isinstance(v, int) and v >= keep:
            period = k.removesuffix("_offset") + "_period"
            if isinstance(config.get(period), int):
                config[k], config[period] = keep - 1, keep
    if (
        isinstance(config.get("first_k_dense_replace"), int)
        and config["first_k_dense_replace"] >= keep
    ):
        config["first_k_dense_replace"] = 1  # DeepSeek: dense layers before the MoE ones


def _layer_ints(value: Any, counts: set[int]) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        and max(value) <= max(counts)
    )


def _stage(name: Any, kept: list[int]) -> Any:
    """A backbone's ``stageN`` (layer N - 1; ``stem`` is 0) renamed after the cut."""
    n = _stage_number(name)
    return name if n is None else f"stage{_position(kept, n - 1) + 1}"


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"


def _estimate(config: dict[str, Any]) -> int:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(config, default=str))
        # the attention a run uses when none is given, as the CLI and the page choose it
        training = replace(TRAINING, attention=default_attention_of(str(path)))
        # an image model takes no --seq-len (refused when given, since 48c6e37): its sequence
        # is what the CLI reads without one, the patches of its config's image size
        training = image_sequence(str(path), training, given=False)
        est = estimate(str(path), training, engine="generic", simulate_allocator=False)
    return est.breakdown.allocated_bytes


def _merged(config: dict[str, Any], fix: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``fix``'s fields set, in place, sub-config dicts merged field by field."""
    for k, v in fix.items():
        if isinstance(v, dict) and isinstance(config.get(k), dict):
            _merged(config[k], v)
        else:
            config[k] = v
    return config


def transformers_group(
    limit: int | None = None, only: frozenset[str] = frozenset()
) -> Iterator[tuple[str, str, str]]:
    """(model type, outcome, detail) per transformers ``model_type``; outcome ``ok``,
    ``refused`` (trainmem's reason) or ``excluded`` (transformers cannot build its own default
    config into the head)."""
    import torch
    import transformers
    from transformers.models.auto import modeling_auto

    from trainmem.trace.hf_model import TRAINING_HEADS, _head_class

    types: dict[str, None] = {}
    for mapping, _ in TRAINING_HEADS:
        types.update(dict.fromkeys(getattr(modeling_auto, mapping, {})))
    for model_type in [t for t in sorted(types) if not only or t in only][:limit]:
        try:
            config = transformers.AutoConfig.for_model(model_type)
            raw = shrink(_merged(config.to_dict(), CONFIG_FIXES.get(model_type, {})))
            raw["model_type"] = model_type
            config = transformers.AutoConfig.for_model(
                model_type, **{k: v for k, v in raw.items() if k != "model_type"}
            )
            cls = _head_class(transformers, config, raw)
            with torch.device("meta"):
                cls.from_config(config) if hasattr(cls, "from_config") else cls(config)
        except Exception as exc:  # noqa: BLE001 - transformers' own failure, reported
            yield model_type, "excluded", _one_line(exc)
            continue
        try:
            yield model_type, "ok", f"{_estimate(raw):,} B"
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            yield model_type, "refused", _one_line(exc)


DIFFUSERS_CONFIG_FIXES: dict[str, dict[str, Any]] = {
    # the default (no time MLP, Fourier features concatenated to the input) has
    # extra_in_channels=0 although the features add 2 * block_out_channels[0] channels;
    # diffusers' tests/models/unets/test_models_unet_1d.py builds this one
    "UNet1DModel": {
        "block_out_channels": [8, 8, 16, 16],
        "in_channels": 14,
        "out_channels": 14,
        "time_embedding_type": "positional",
        "use_timestep_embedding": True,
        "flip_sin_to_cos": False,
        "freq_shift": 1.0,
        "out_block_type": "OutConv1DBlock",
        "mid_block_type": "MidResTemporalBlock1D",
        "down_block_types": ["DownResnetBlock1D"] * 4,
        "up_block_types": ["UpResnetBlock1D"] * 3,
        "act_fn": "swish",
    },
    # the default has no image projection, which forward calls unconditionally; diffusers'
    # tests/models/transformers/test_models_transformer_hunyuan_video_framepack.py (and the
    # FramePack checkpoint) set both
    "HunyuanVideoFramepackTransformer3DModel": {
        "has_image_proj": True,
        "has_clean_x_embedder": True,
    },
    # a face adapter every 5 blocks leaves none in the 2-layer cut, which forward indexes;
    # diffusers' tests/models/transformers/test_models_transformer_wan_animate.py (2 layers)
    # injects every 2
    "WanAnimateTransformer3DModel": {"inject_face_latents_blocks": 2},
}
"""Classes whose default config (or its 2-layer cut) diffusers' own forward cannot run, and the
fields of the config diffusers' own model test uses instead (cited per row)."""


def diffusers_group(
    limit: int | None = None, only: frozenset[str] = frozenset()
) -> Iterator[tuple[str, str, str]]:
    """(class name, outcome, detail) per diffusers transformer / UNet class: its default
    ``register_to_config`` arguments as the config (with :data:`DIFFUSERS_CONFIG_FIXES` for the
    classes whose default diffusers' own forward cannot run), shrunk to 2 layers; ``excluded``
    when diffusers itself cannot build that config (on ``meta``, no trainmem involved)."""
    import inspect

    import diffusers
    import torch

    names = sorted(
        n
        for n in dir(diffusers)
        if (n.endswith("Model") or "Transformer" in n or "UNet" in n)
        and ("Transformer" in n or "UNet" in n)
    )
    for name in [n for n in names if not only or n in only][:limit]:
        try:
            cls = getattr(diffusers, name)
            if not (isinstance(cls, type) and issubclass(cls, diffusers.ModelMixin)):
                continue
            params = inspect.signature(cls.__init__).parameters
            raw: dict[str, Any] = {
                k: p.default
                for k, p in params.items()
                if k != "self" and p.default is not inspect.Parameter.empty
            }
            raw.update(DIFFUSERS_CONFIG_FIXES.get(name, {}))
            raw = shrink(json.loads(json.dumps(raw, default=list)))
            raw["_class_name"] = name
            with torch.device("meta"):  # diffusers' own build of that config, no trainmem
                cls.from_config(raw)
        except Exception as exc:  # noqa: BLE001 - diffusers' own failure, reported
            yield name, "excluded", _one_line(exc)
            continue
        try:
            yield name, "ok", f"{_estimate(raw):,} B"
        except Exception as exc:  # noqa: BLE001
            yield name, "refused", _one_line(exc)


TIMM_MODELS: tuple[str, ...] = tuple(
    """
    resnet50 resnet18 resnet34 resnet101 resnet152 wide_resnet50_2 resnext50_32x4d
    seresnext50_32x4d resnetv2_50x1_bit regnety_040 regnetx_032 efficientnet_b0 efficientnet_b3
    efficientnetv2_rw_s tf_efficientnetv2_s mobilenetv3_large_100 mobilenetv3_small_100
    mobilenetv2_100 mobilenetv4_conv_small ghostnet_100 densenet121 inception_v3
    inception_resnet_v2 xception65 vgg16 convnext_tiny convnext_base convnextv2_tiny
    vit_base_patch16_224 vit_small_patch16_224 vit_large_patch16_224 vit_tiny_patch16_224
    vit_base_patch14_dinov2 deit_base_patch16_224 deit3_base_patch16_224
    swin_base_patch4_window7_224 swin_tiny_patch4_window7_224 swinv2_tiny_window8_256
    beit_base_patch16_224 eva02_base_patch14_224 caformer_s18 maxvit_tiny_tf_224
    coatnet_0_rw_224 efficientformer_l1 levit_128 mixer_b16_224 hrnet_w18 dla34 cspdarknet53
    fastvit_t8
    """.split()
)
"""50 widely used timm architectures: the families of timm's README and results tables
(ResNet / ResNeXt / RegNet, EfficientNet, MobileNet, ConvNeXt, ViT / DeiT / BEiT / EVA-02 /
DINOv2, Swin, MaxViT / CoAtNet, LeViT, MLP-Mixer, HRNet...) at the sizes whose hub checkpoints
are downloaded most. Fixed here (no network at run time), each name checked by
``timm.is_model``."""


def timm_group(
    limit: int | None = None, only: frozenset[str] = frozenset()
) -> Iterator[tuple[str, str, str]]:
    """(model name, outcome, detail) per timm model of :data:`TIMM_MODELS`, at its own input
    size (``pretrained_cfg["input_size"]``)."""
    try:
        from trainmem.trace.timm_model import import_timm

        timm = import_timm()
    except (ImportError, UnsupportedError) as exc:  # no torch, no timm, or no torchvision
        yield "timm", "excluded", _one_line(exc)
        return
    for name in [n for n in TIMM_MODELS if not only or n in only][:limit]:
        if not timm.is_model(name):
            yield name, "excluded", f"timm {timm.__version__} has no model {name}"
            continue
        try:
            # an image model takes no seq_len: TRAINING's 64 would be refused (image_sequence)
            training = image_sequence(f"timm:{name}", TRAINING, given=False)
            est = estimate(f"timm:{name}", training, engine="generic", simulate_allocator=False)
            yield name, "ok", f"{est.breakdown.allocated_bytes:,} B"
        except Exception as exc:  # noqa: BLE001 - the refusal is the result
            yield name, "refused", _one_line(exc)


GROUPS: dict[str, Callable[[int | None, frozenset[str]], Iterator[tuple[str, str, str]]]] = {
    "transformers": transformers_group,
    "diffusers": diffusers_group,
    "timm": timm_group,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("groups", nargs="*", default=list(GROUPS), choices=list(GROUPS))
    parser.add_argument("--limit", type=int, default=None, help="first N models per group")
    parser.add_argument(
        "--only", default="", help="comma-separated model types / class / model names to run"
    )
    parser.add_argument("--json", type=Path, default=None, help="write every outcome here")
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")
    only = frozenset(n for n in args.only.split(",") if n)
    # torch and torchvision as trainmem imports them (Note [torchvision without its C ops]):
    # the groups import transformers / diffusers directly, which import torchvision when installed
    from trainmem.trace._torch import require_torch

    require_torch()
    results: dict[str, list[dict[str, str]]] = {}
    for group in args.groups:
        rows = results.setdefault(group, [])
        for name, outcome, detail in GROUPS[group](args.limit, only):
            rows.append({"model": name, "outcome": outcome, "detail": detail})
            print(f"{group:12} {name:40} {outcome:8} {detail}", flush=True)
        counted = [r for r in rows if r["outcome"] != "excluded"]
        ok = sum(r["outcome"] == "ok" for r in counted)
        share = 100 * ok / len(counted) if counted else 0.0
        print(
            f"== {group}: {ok} / {len(counted)} built, traced and estimated ({share:.0f}%); "
            f"{len(rows) - len(counted)} excluded (transformers / diffusers cannot build "
            "their own default config)"
        )
        reasons = Counter(r["detail"][:70] for r in counted if r["outcome"] == "refused")
        for reason, n in reasons.most_common(12):
            print(f"   {n:3}  {reason}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
