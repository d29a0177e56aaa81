"""Build a transformers model from a HF config dict with fake (data-less) storage, and patch the
transformers heuristics that misread fake tensors.

Recipe (shared/notes/tracing-without-a-gpu.md, sec. 1): build on ``meta`` outside fake mode so no
weight init runs, then give every parameter and buffer a fake CPU storage of the same
shape/stride/dtype inside ``FakeTensorMode``, keeping tied weights tied (one memo per tensor id).
``module._apply`` / ``to_empty`` would untie GPT-2's ``lm_head`` (163M params instead of 124M).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from typing import Any

from trainmem.errors import SpecError, UnsupportedError
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch, require_transformers
from trainmem.trace.grouped_mm import guarded_grouped_mm
from trainmem.trace.hf_inputs import (
    flattened_patch_batch,
    patch_sequence_batch,
    perceiver_text_batch,
    text_side_inputs,
    token_ids,
    vision_language_batch,
)
from trainmem.trace.quantized import parameter_dtype, quantize_base
from trainmem.trace.remote_code import REMOTE_CODE_TYPES, fuse_projections, stand_in_config

torch = require_torch()

__all__ = [
    "build_hf_model",
    "build_hf_training_model",
    "hf_loss",
    "hf_mask_patches",
    "make_hf_batch",
    "materialize_fake",
]

#: HF config keys that hold a dropout probability (zeroed when ``TrainingConfig.dropout`` is off).
_DROPOUT_KEY_PARTS = ("dropout", "pdrop")


def _head_class(transformers: Any, config: Any, raw: Mapping[str, Any]) -> Any:
    archs = raw.get("architectures") or []
    if not isinstance(archs, list):
        archs = []
    for arch in archs:
        cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
        if cls is None:
            continue
        if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
            raise UnsupportedError(
                f"architectures: {arch!r:.80} is not a transformers model class (a "
                "PreTrainedModel); name one such as "
                f"{type(config).__name__.removesuffix('Config')}ForCausalLM, or remove the field"
            )
        return cls
    if config.model_type in ("bert", "roberta"):
        return transformers.AutoModelForMaskedLM
    if config.model_type == "vit":
        return transformers.AutoModelForImageClassification
    if config.model_type in VISION_TOWER_TYPES:
        return transformers.AutoModel
    if config.model_type == "t5":
        return transformers.T5ForConditionalGeneration
    from transformers.models.auto import modeling_auto

    for mapping, auto in TRAINING_HEADS:
        if config.model_type in getattr(modeling_auto, mapping, {}):
            return getattr(transformers, auto)
    return transformers.AutoModel


TRAINING_HEADS: tuple[tuple[str, str], ...] = (
    ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
    ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
    ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
    ("MODEL_FOR_CTC_MAPPING_NAMES", "AutoModelForCTC"),
    ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "AutoModelForImageTextToText"),
    ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
    ("MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES", "AutoModelForSemanticSegmentation"),
    ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES", "AutoModelForAudioClassification"),
    ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification"),
)
"""The training head of a config without ``architectures``: the first of transformers' own
task mappings (``transformers/models/auto/modeling_auto.py``, ``MODEL_FOR_*_MAPPING_NAMES``)
that has the ``model_type``, in the order a training run most often uses it (language
modelling first, then encoder-decoder, speech, masked LM, CTC, vision-language, vision and
audio classification, segmentation, sequence classification); a type in none of them is built
bare (``AutoModel``) and trained on :func:`hf_loss`'s stand-in."""


VISION_TOWER_TYPES = frozenset({"clip_vision_model", "siglip_vision_model", "dinov2"})
"""Bare vision towers (``CLIPVisionModel``, ``SiglipVisionModel``, ``Dinov2Model``): they take
``pixel_values`` and return no loss (:func:`attach_pooled_loss`)."""


def attach_pooled_loss(model: Any) -> None:
    """Give a bare vision tower a training loss, in place: ``output.loss =
    output.pooler_output.float().mean()``, the mean of the pooled output in fp32 (CLIP: the
    [CLS] row after ``post_layernorm``; SigLIP: the attention-pooling head's output; DINOv2: the
    [CLS] row of the final ``layernorm``; the modeling files' ``pooler_output``). A tower has no
    loss of its own; what a real recipe puts on top (a contrastive or distillation loss on the
    pooled embedding) holds a few (b, h) tensors, as this one does.
    """
    forward = model.forward

    def forward_with_loss(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        pooled = getattr(out, "pooler_output", None)
        if getattr(out, "loss", None) is None and pooled is not None:
            out.loss = pooled.float().mean()  # a task head (``...ForImageClassification``)
        return out  # keeps its own loss

    model.forward = forward_with_loss


def build_hf_model(
    raw_config: Mapping[str, Any],
    *,
    dropout: bool = True,
    attention: str = "sdpa",
    dtype: Any = None,
    device: str = "meta",
) -> Any:
    """Build the model a HF ``config.json`` describes, on the ``meta`` device.

    Args:
        raw_config: the parsed ``config.json`` (``trainmem.specs.hf.load_hf_config``).
        dropout: keep the config's dropout probabilities; False sets every ``*dropout*`` /
            ``*pdrop*`` float field to 0.
        attention: ``sdpa`` / ``flash`` (both SDPA in transformers; the kernel is chosen by
            ``trainmem.trace.cuda_sdpa``) or ``eager``.
        dtype: parameter dtype (None keeps fp32).
        device: ``meta`` (no weights initialised) or ``cpu`` (real weights, for the proof).

    Returns:
        The ``nn.Module`` on ``device``, in train mode.

    Raises:
        UnsupportedError: transformers does not know the ``model_type``.
    """
    transformers = require_transformers()
    raw = dict(raw_config)
    if raw.get("model_type") in REMOTE_CODE_TYPES:  # Note [Remote-code stand-ins]
        raw = {**stand_in_config(raw), **{k: v for k, v in raw.items() if "dropout" in k}}
    raw = _training_switches(raw, dropout)
    config = hf_config_of(raw)
    config._attn_implementation = "eager" if attention == "eager" else "sdpa"
    _no_layerdrop(config)
    _pin_dtype(config, dtype or torch.float32)
    _check_routing(config)
    cls = _head_class(transformers, config, raw)
    try:
        with torch.device(device):
            if hasattr(cls, "_from_config"):
                model = cls._from_config(config, dtype=dtype) if dtype is not None else cls(config)
            else:  # Auto classes
                model = cls.from_config(config)
                if dtype is not None:
                    model = model.to(dtype)
    except (ValueError, TypeError, AttributeError, KeyError, IndexError) as exc:
        # transformers' own refusals (an attention kernel the class lacks, an inconsistent
        # config) as one line that says what to do
        reason = " ".join(str(exc).split())[:200]
        hint = (
            "try --attention eager"
            if "attention" in reason.lower() and attention != "eager"
            else "check the config, or use --engine analytic"
        )
        raise UnsupportedError(
            f"transformers {transformers.__version__} cannot build {getattr(cls, '__name__', cls)}"
            f" from this config ({type(exc).__name__}: {reason}); {hint}"
        ) from exc
    _no_spec_augment(model.config)
    _decoder_start(model.config)
    model.train()
    return model


def _sub_configs(config: Any) -> Iterator[Any]:
    """``config`` and its sub-configs (``PretrainedConfig.sub_configs``: an encoder-decoder's
    ``encoder`` / ``decoder``, a speech model's ``encoder_config``, a VLM's ``text_config``)."""
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            yield from _sub_configs(sub)


def _no_layerdrop(config: Any) -> None:
    """LayerDrop off (see :func:`_training_switches`) in the built config and its sub-configs,
    in place, also where the probability is the config class's default (Parakeet's encoder
    ``layerdrop``, not in a config.json that does not set it)."""
    for c in _sub_configs(config):
        for key, value in c.to_dict().items():
            if key.endswith("layerdrop") and isinstance(value, (int, float)) and value:
                setattr(c, key, 0.0)


_EXPERT_COUNTS = ("n_routed_experts", "num_experts", "num_local_experts")
"""Config fields holding a MoE layer's number of routed experts."""
_TOPK_METHODS = ("greedy", "group_limited_greedy")
"""The routings of DeepSeek-V2's router (``topk_method``, a field of the config classes whose
router reads it: DeepSeek-V2's and its copies'; DeepSeek-V3's config keeps a released config's
``"noaux_tc"`` as an extra attribute its router never reads)."""


def _field(config: Any, name: str) -> Any:
    """``config.name``, or None when it is missing or transformers refuses a global read (a
    per-layer attribute of a config with ``per_layer_config``, dots3's
    ``AmbiguousGlobalPerLayerAttributeError``: its layers are checked one by one instead)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' own refusal of a global read
        return None


def _check_routing(config: Any) -> None:
    """Refuse a MoE config whose router cannot pick its experts, as the training run's first
    forward would fail (Note [A router without its top-k]).

    Raises:
        SpecError: naming the field: ``num_experts_per_tok`` unset while a layer routes among
            experts; ``topk_method`` other than greedy / group_limited_greedy, or
            ``group_limited_greedy`` without ``n_group`` / ``topk_group``.
    """
    # Note [A router without its top-k]: transformers 5.24's DeepseekV2Config defaults
    # num_experts_per_tok, n_group and topk_group to None (configuration_deepseek_v2.py), so
    # AutoConfig.for_model("deepseek_v2") saved as it is describes no routing:
    # DeepseekV2TopkRouter.forward (modeling_deepseek_v2.py; deepseek_ocr2's and
    # unlimited_ocr's routers are copies) runs torch.topk(scores, k=self.top_k) with
    # top_k = num_experts_per_tok ("greedy"), after scores.view(-1, n_group, ...) and
    # torch.topk(group_scores, k=topk_group) ("group_limited_greedy"), and leaves topk_weights
    # unbound for any other topk_method. A GPU run of that config fails in its first forward
    # as the trace does; there is no value to assume (the experts' activations scale with
    # it), so the field is named with the released configs' values.
    for c in _sub_configs(config):
        try:
            _check_router(c)
        except SpecError:
            raise
        except Exception:  # noqa: BLE001 - a per-layer field transformers will not read globally
            continue


def _check_router(c: Any) -> None:
    """:func:`_check_routing` of one (sub-)config."""
    experts = next((_field(c, k) for k in _EXPERT_COUNTS if _field(c, k) is not None), None)
    layers = _field(c, "num_hidden_layers")
    dense_first = _field(c, "first_k_dense_replace")  # layers before the first MoE
    if not isinstance(experts, int) or experts < 1 or not hasattr(c, "num_experts_per_tok"):
        return
    if isinstance(layers, int) and isinstance(dense_first, int) and dense_first >= layers:
        return  # every layer a dense MLP: no router is built
    if c.num_experts_per_tok is None:
        raise SpecError(
            "num_experts_per_tok",
            f"is null in this {c.model_type} config (transformers' default), and its "
            f"{experts} routed experts need it: the router takes the top num_experts_per_tok "
            "experts per token, and a training run of this config fails in its first forward; "
            "set num_experts_per_tok in config.json (the released DeepSeek-V2 and "
            "DeepSeek-V2-Lite configs: 6)",
        )
    if not hasattr(type(c), "topk_method"):  # a config class whose router reads it
        return
    method = c.topk_method
    if method not in _TOPK_METHODS:
        raise SpecError(
            "topk_method",
            f"{method!r} is not a routing this {c.model_type} router runs; use one of "
            + " | ".join(_TOPK_METHODS),
        )
    for key in ("n_group", "topk_group"):
        if method == "group_limited_greedy" and getattr(c, key, None) is None:
            raise SpecError(
                key,
                "is null, and topk_method='group_limited_greedy' routes among n_group "
                "groups of experts, keeping the top topk_group; set both in config.json "
                "(DeepSeek-V2: n_group 8, topk_group 3), or use topk_method='greedy'",
            )


def _no_spec_augment(config: Any) -> None:
    """SpecAugment off in ``config`` and its sub-configs (a speech encoder-decoder's
    ``encoder``), in place, also where the config class has no ``apply_spec_augment`` field
    (Data2VecAudio: ``_mask_hidden_states`` reads ``getattr(config, "apply_spec_augment",
    True)`` and masks whenever ``mask_time_prob > 0``): set on the built config, so the model
    keeps its ``masked_spec_embed`` parameter (:func:`_training_switches` says why it is off).
    """
    for c in _sub_configs(config):
        if getattr(c, "mask_time_prob", 0) or getattr(c, "mask_feature_prob", 0):
            c.apply_spec_augment = False


def _decoder_start(config: Any) -> None:
    """Give an encoder-decoder config without them the ids its training forward reads, in
    place: the decoder reads the labels shifted right, starting with ``decoder_start_token_id``
    and with -100 replaced by ``pad_token_id`` (``modeling_t5.py`` ``_shift_right``,
    ``modeling_encoder_decoder.py`` ``shift_tokens_right``). Released T5 configs set the start to
    the pad id (0); transformers' default ``T5Config`` / ``EncoderDecoderConfig`` leave them
    unset and the forward fails. An unset pad id is the decoder sub-config's; an unset start
    the pad id. Only ids change, never a shape."""
    if not getattr(config, "is_encoder_decoder", False):
        return
    decoder = getattr(config, "decoder", None)
    if getattr(config, "pad_token_id", None) is None:
        pad = getattr(decoder, "pad_token_id", None)
        config.pad_token_id = pad if pad is not None else 0
    if getattr(config, "decoder_start_token_id", None) is None:
        config.decoder_start_token_id = config.pad_token_id


def _training_switches(raw: dict[str, Any], dropout: bool) -> dict[str, Any]:
    """``raw`` with the per-step random switches set as the reported step runs them, in it and
    in every sub-config (an encoder-decoder's ``encoder`` / ``decoder``, a VLM's
    ``text_config``): dropout probabilities 0 unless ``dropout``; LayerDrop and SpecAugment
    off."""
    raw = dict(raw)
    for k, v in list(raw.items()):
        if not isinstance(k, str):  # (id2label's ids)
            continue
        if isinstance(v, dict):
            raw[k] = _training_switches(v, dropout)
        elif not dropout and isinstance(v, float) and any(p in k for p in _DROPOUT_KEY_PARTS):
            raw[k] = 0.0
        elif k.endswith("layerdrop") and isinstance(v, (int, float)) and v:
            # LayerDrop (Fan et al. 2019) skips each layer with probability ``layerdrop`` per
            # step (modeling_wav2vec2.py: ``if self.training and dropout_probability <
            # self.config.layerdrop``); the run's max_memory_allocated is a step that keeps
            # every layer, and the draw is data the fake tensors do not have
            raw[k] = 0.0
    if raw.get("apply_spec_augment"):
        # SpecAugment (wav2vec2, HuBERT, WavLM...: ``_mask_hidden_states``) fills positions
        # drawn with numpy, in place (``hidden_states[mask_time_indices] = masked_spec_embed``):
        # a [b, frames] bool mask beside the hidden states, and a data-dependent index that fake
        # tensors cannot run
        raw["apply_spec_augment"] = False
    return raw


def build_hf_training_model(
    raw_config: Mapping[str, Any], training: TrainingConfig, *, device: str = "meta"
) -> Any:
    """The model a training run of ``training`` steps: built, cast, wrapped in peft LoRA or
    prefix tuning if asked.

    Args:
        raw_config: the parsed ``config.json``.
        training: dropout, attention, weight dtype and the LoRA settings.
        device: ``meta`` for the trace, ``cpu`` for the real-run proof.

    Returns:
        The ``nn.Module`` (a ``PeftModel`` with LoRA), in train mode.
    """
    from trainmem.trace.lora import apply_lora
    from trainmem.trace.prefix import apply_prefix_tuning

    dtype = None if training.weight_dtype == "float32" else getattr(torch, training.weight_dtype)
    model = build_hf_model(
        raw_config,
        dropout=training.dropout,
        attention=training.attention,
        dtype=dtype,
        device=device,
    )
    if raw_config.get("model_type") in REMOTE_CODE_TYPES:  # Note [Fused stand-in projections]
        fuse_projections(model, raw_config)
    if raw_config.get("model_type") in VISION_TOWER_TYPES:
        attach_pooled_loss(model)
    if training.conventions.fused_rms_norm:  # Note [Megatron's fused RMSNorm]
        from trainmem.trace.fused_norm import fuse_rms_norms

        fuse_rms_norms(model)
    model = apply_lora(model, training)
    model = apply_prefix_tuning(model, training, raw_config.get("model_type"))
    model_type = str(raw_config.get("model_type") or "")
    quantize_base(model, training, model_type=model_type)  # Note [Traced quantized base]
    model.train()
    return model


def materialize_fake(model: Any, fake_mode: Any) -> None:
    """Replace every meta parameter/buffer with a fake CPU tensor, in place, keeping ties.

    Args:
        model: ``nn.Module`` with ``meta`` (or real) tensors.
        fake_mode: the ``FakeTensorMode`` the step will run in.
    """
    memo: dict[int, Any] = {}

    def conv(t: Any) -> Any:
        if id(t) not in memo:
            with fake_mode:
                e = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            memo[id(t)] = (
                torch.nn.Parameter(e, t.requires_grad) if isinstance(t, torch.nn.Parameter) else e
            )
        return memo[id(t)]

    for m in model.modules():
        for n, p in list(m._parameters.items()):
            if p is not None:
                m._parameters[n] = conv(p)
        for n, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[n] = conv(b)


def _pin_dtype(config: Any, dtype: Any) -> None:
    """Set ``dtype`` on ``config`` and every sub-config it holds (``sub_configs``: a
    vision-language model's ``text_config`` / ``vision_config``, an encoder-decoder's parts).

    A hub ``config.json`` names the checkpoint's dtype (``"torch_dtype": "bfloat16"``), and
    transformers builds each sub-model of a composite in its sub-config's dtype
    (``modeling_utils.py`` ``_from_config``: ``dtype = kwargs.pop("dtype", config.dtype)``;
    Qwen2-VL's and LLaVA's ``__init__`` build their language model with
    ``AutoModel.from_config(config.text_config)``). Left alone, a bf16-mixed run would hold a
    composite's language model in bf16 and the rest in fp32; the weights' dtype is the run's
    (``TrainingConfig.weight_dtype``), for every part.
    """
    for c in _sub_configs(config):
        c.dtype = dtype


def make_hf_batch(
    model: Any,
    micro_batch_size: int,
    seq_len: int,
    target_seq_len: int = 0,
    image_size: tuple[int, int] | None = None,
    notes: list[str] | None = None,
    images: bool = True,
) -> dict[str, Any]:
    """One unpadded training batch for a HF model (call inside the fake mode for fake tensors).

    The input follows the model's ``main_input_name`` (``transformers/modeling_utils.py``):
    ``input_ids`` [b, s] int64 with ``labels`` = the same ids (causal and masked LM, T5/BART:
    the decoder reads the labels shifted right; a text encoder-decoder's ``labels`` are
    [b, target] with ``target_seq_len``, :func:`reads_target_seq_len`; Mamba);
    ``pixel_values`` [b, c, height, width] in the parameter dtype (ViT, DINOv2, CLIP / SigLIP
    vision towers) with class ``labels`` [b] when the model takes labels; ``input_features``
    [b, mel bins, 2 * max_source_positions] (Whisper's 30 s log-mel window: two frames per
    encoder position after its stride-2 convolution, ``modeling_whisper.py``) with decoder
    ``labels`` [b, min(s, max_target_positions)]; Pix2Struct's ``flattened_patches``
    (:func:`trainmem.trace.hf_inputs.flattened_patch_batch`). A
    ``*ForSequenceClassification`` head, or an image classifier on tokens (ImageGPT's
    colour-cluster ids, ``modeling_imagegpt.py`` ``ImageGPTForImageClassification``:
    ``labels`` of shape ``(batch_size,)``), takes class ``labels`` [b], a
    ``*ForTokenClassification`` head [b, s], in ``range(num_labels)``
    (``modeling_bert.py`` ``BertForSequenceClassification.forward``: ``labels.view(-1)``
    against ``logits.view(-1, num_labels)``).

    Args:
        model: the HF model (its ``config`` decides the inputs).
        micro_batch_size: b.
        seq_len: s (tokens; the decoder's for Whisper).
        target_seq_len: the decoder's length of a text encoder-decoder (T5, mT5, UMT5, BART,
            Pegasus, Marian...: :func:`reads_target_seq_len`); 0 means ``seq_len``.
        image_size: (height, width) pixels of an image model's ``pixel_values`` (``--resolution``);
            None: the config's ``image_size``; a vision-language model's one image per sample
            (:func:`trainmem.trace.hf_inputs.vision_language_batch`).
        notes: where a vision-language model's batch description goes.
        images: False: a vision-language model's batch is text only.

    Returns:
        Keyword arguments of ``model(**batch)``, with ``labels`` when the model takes them (a
        headless model's loss is :func:`hf_loss`'s stand-in).
    """
    cfg = model.config
    b, s = micro_batch_size, seq_len
    main = getattr(model, "main_input_name", "input_ids")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    params = inspect.signature(base.forward).parameters
    takes_labels = "labels" in params
    dtype = parameter_dtype(model)  # not a quantized base's packed weights
    head = type(base).__name__
    if images and {"input_ids", "pixel_values"} <= params.keys():  # a vision-language model
        pictured = vision_language_batch(base, _vocab_size(cfg), b, s, dtype, image_size, notes)
        if pictured is not None:
            return pictured
    if main == "flattened_patches":  # Pix2Struct
        patches, said = flattened_patch_batch(base, _vocab_size(cfg), b, s, dtype, image_size)
        if notes is not None:
            notes.append(said)
        return patches
    if main == "inputs" and hasattr(base, "perceiver"):  # its preprocessor takes the inputs
        return perceiver_text_batch(base, b, s, takes_labels)
    if main in ("pixel_values", "input_values", "inputs"):
        return _encoder_input_batch(base, b, s, dtype, head if takes_labels else "", image_size)
    batch: dict[str, Any] = {}
    if main == "input_features":
        batch, s = _feature_batch(cfg, b, s, dtype)
    vocab = _vocab_size(cfg)
    ids = token_ids(cfg, vocab, (b, s))  # values known to the forward (XLM's length assert)
    if main != "input_features":
        batch["input_ids"] = ids
        batch.update(text_side_inputs(base, b, s))
    if takes_labels and not (main == "input_features" and head.endswith("ForCTC")):
        # (a CTC head's labels: see _waveform_batch)
        target = target_seq_len or s if reads_target_seq_len(cfg) else s
        batch["labels"] = token_ids(cfg, vocab, (b, target))  # = the ids when target == s
        classes = max(getattr(cfg, "num_labels", 1), 1)
        if head.endswith(("ForSequenceClassification", "ForImageClassification")):
            # one class per sequence; ImageGPT's image classifier reads pixel tokens
            batch["labels"] = torch.randint(0, classes, (b,))
        elif head.endswith("ForTokenClassification"):  # one class per token
            batch["labels"] = torch.randint(0, classes, (b, s))
    codebooks = getattr(getattr(cfg, "decoder_config", None), "num_channels", None)
    if isinstance(codebooks, int) and "decoder_input_ids" in params:
        batch.update(_audio_code_batch(cfg.decoder_config, b, s, codebooks, takes_labels))
    return batch


def reads_target_seq_len(cfg: Any) -> bool:
    """Whether ``cfg``'s labels are a decoder's own sequence, ``target_seq_len`` long: an
    encoder-decoder (``is_encoder_decoder``) of transformers' text-to-text table
    (``MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES``, transformers 5.24
    models/auto/modeling_auto.py: T5, mT5, UMT5, BART, Pegasus, Marian, mBART, LED...), whose
    ``*ForConditionalGeneration`` shifts the labels right into the decoder's input, of any
    length (modeling_t5.py / modeling_bart.py ``shift_tokens_right``). Whisper's decoder length
    is ``seq_len`` itself, a vision / speech encoder-decoder's labels are the text it writes
    (``seq_len``); the audio language models of that table are no encoder-decoders."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    return bool(getattr(cfg, "is_encoder_decoder", False)) and (
        cfg.model_type in MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES
    )


def _audio_code_batch(
    decoder_cfg: Any, b: int, s: int, codebooks: int, takes_labels: bool
) -> dict[str, Any]:
    """A text-to-speech decoder's audio codes (Dia: ``decoder_config.num_channels`` codebooks
    of ``decoder_config.vocab_size`` codes per frame), as transformers 5.24's
    ``models/dia/processing_dia.py`` ``DiaProcessor.__call__(..., output_labels=True)`` lays
    them out for training: ``decoder_input_ids`` [b, frames, codebooks] and ``labels``
    [b * codebooks, frames] (codebook-major: ``labels.transpose(1, 2).reshape(b * C, -1)``,
    the layout ``DiaForConditionalGeneration.forward`` flattens its logits to). ``s`` frames
    (the text takes ``s`` tokens too), codes avoiding the decoder's special ids."""
    vocab = _vocab_size(decoder_cfg)
    batch = {"decoder_input_ids": token_ids(decoder_cfg, vocab, (b, s, codebooks))}
    if takes_labels:
        batch["labels"] = token_ids(decoder_cfg, vocab, (b * codebooks, s))
    return batch


def _encoder_input_batch(
    model: Any, b: int, s: int, dtype: Any, head: str, image_size: tuple[int, int] | None = None
) -> dict[str, Any]:
    """The batch of a model whose input is an image or a waveform (:func:`_image_batch`,
    :func:`_waveform_batch`). A vision / speech encoder-decoder (``VisionEncoderDecoderModel``,
    ``SpeechEncoderDecoderModel``, whose ``inputs`` is its encoder's input) sizes the input from
    its encoder's config and takes decoder ``labels`` [b, s] (the text it learns to write),
    not class labels."""
    cfg = model.config
    seq2seq = bool(getattr(cfg, "is_encoder_decoder", False))
    encoder_cfg = getattr(cfg, "encoder", None) if seq2seq else None
    encoder_cfg = encoder_cfg if hasattr(encoder_cfg, "to_dict") else cfg
    main = model.main_input_name
    name = getattr(model.encoder, "main_input_name", "input_values") if main == "inputs" else main
    label_head = "" if seq2seq else head
    if name == "pixel_values" and "spatial_shapes" in _forward_parameters(model):
        vision_cfg = getattr(encoder_cfg, "vision_config", encoder_cfg)
        size = image_size_of(vision_cfg, image_size)
        batch = patch_sequence_batch(vision_cfg, b, dtype, size)  # SigLIP 2's patches
        if label_head:
            classes = max(getattr(cfg, "num_labels", 1), 1)
            batch["labels"] = torch.randint(0, classes, (b,))
    elif name == "pixel_values":
        batch = _image_batch(encoder_cfg, b, dtype, label_head, image_size)
        if image_size is not None and "interpolate_pos_encoding" in _forward_parameters(model):
            batch["interpolate_pos_encoding"] = True  # Note [Vision encoders at another resolution]
    else:
        batch = _waveform_batch(encoder_cfg, b, s, dtype, label_head)
    if seq2seq and head:
        decoder_cfg = getattr(cfg, "decoder", cfg)
        batch["labels"] = token_ids(decoder_cfg, _vocab_size(decoder_cfg), (b, s))
    if main == "inputs":
        batch["inputs"] = batch.pop(name)
    return batch


CODE_POINT_VOCABULARY = 1_114_112
"""Unicode's code points, the ids of a character-level model's tokenizer (transformers 5.24
models/canine/tokenization_canine.py ``UNICODE_VOCAB_SIZE``: CanineTokenizer turns each
character into its code point; the model hashes them into ``num_hash_buckets``)."""

CODE_POINT_MODELS = frozenset({"canine"})
"""Model types whose ``input_ids`` are code points (:data:`CODE_POINT_VOCABULARY`)."""


def _vocab_size(cfg: Any) -> int:
    """The token vocabulary of a config, or of its text config (vision-language models keep it
    in ``text_config``: ``PretrainedConfig.get_text_config``); CANINE's, which reads Unicode
    code points and names no vocabulary, every code point (:data:`CODE_POINT_VOCABULARY`)."""
    vocab = getattr(cfg, "vocab_size", None)
    if not vocab and hasattr(cfg, "get_text_config"):
        vocab = getattr(cfg.get_text_config(), "vocab_size", None)
    if not vocab and cfg.model_type in CODE_POINT_MODELS:
        vocab = CODE_POINT_VOCABULARY
    if not vocab:
        raise UnsupportedError(
            f"model_type={cfg.model_type!r} takes input_ids but its config names no vocab_size; "
            "add vocab_size to the config, or use --engine analytic"
        )
    return int(vocab)


def _forward_parameters(model: Any) -> Any:
    """The names the model class's ``forward`` takes (the instance's may be wrapped by the
    trace's hooks, whose signature is ``(*args, **kwargs)``)."""
    return inspect.signature(type(model).forward).parameters


def hf_config_of(raw: Mapping[str, Any]) -> Any:
    """The transformers config object of a ``config.json`` dict (``AutoConfig.for_model``:
    its class's defaults filled in).

    Raises:
        UnsupportedError: transformers cannot build ``model_type``.
    """
    transformers = require_transformers()
    model_type = raw.get("model_type")
    try:
        return transformers.AutoConfig.for_model(
            model_type, **{k: v for k, v in raw.items() if k != "model_type"}
        )
    except (ValueError, KeyError) as exc:
        raise UnsupportedError(
            f"transformers {transformers.__version__} cannot build model_type={model_type!r} "
            "for tracing; use --engine analytic"
        ) from exc


def image_size_of(cfg: Any, image_size: tuple[int, int] | None = None) -> tuple[int, int]:
    """(height, width) in pixels of the images a pixel model trains on: ``image_size``
    (``--resolution``), else the config's ``image_size``, an int or [height, width] (ViT's
    non-square images), 224 where the config has none (the ImageNet crop of the image
    processors)."""
    size = image_size or getattr(cfg, "image_size", None) or 224
    height, width = size if isinstance(size, (list, tuple)) else (size, size)
    return int(height), int(width)


def pixel_input_size(
    raw_config: Mapping[str, Any], image_size: tuple[int, int] | None = None
) -> tuple[int, int]:
    """:func:`image_size_of` the transformers config ``raw_config`` makes (its class's defaults
    filled in, as :func:`build_hf_model` builds it): the images :func:`make_hf_batch` feeds.

    Raises:
        UnsupportedError: transformers cannot build the config.
    """
    return image_size_of(hf_config_of(raw_config), image_size)


def _image_batch(
    cfg: Any, b: int, dtype: Any, head: str, image_size: tuple[int, int] | None = None
) -> dict[str, Any]:
    """``pixel_values`` [b, num_channels, height, width] in the parameter dtype; ``image_size``
    (``--resolution``), else the config's ``image_size``, an int or [height, width] (ViT's
    non-square images), 224 where the config has none (the ImageNet crop of the image
    processors); class ``labels`` [b] for a classification head, per-pixel ``labels``
    [b, height, width] for a ``*ForSemanticSegmentation`` head (SegFormer, UperNet, DPT:
    ``modeling_segformer.py`` upsamples its logits to the labels' size)."""
    height, width = image_size_of(cfg, image_size)
    channels = getattr(cfg, "num_channels", None) or 3
    batch = {"pixel_values": torch.randn(b, channels, height, width, dtype=dtype)}
    classes = max(getattr(cfg, "num_labels", 1), 1)
    if head.endswith("ForSemanticSegmentation"):
        batch["labels"] = torch.randint(0, classes, (b, height, width))
    elif head:
        batch["labels"] = torch.randint(0, classes, (b,))
    return batch


CHANNEL_WAVEFORM_TYPES = frozenset({"omniasr_ctc"})
"""Model types whose waveform has a channel dimension, [b, 1, samples]: OmniASR's feature
extractor adds it (transformers 5.24 models/omniasr/feature_extraction_omniasr.py: "add channel
dimension", ``input_values[:, None, :]``) and its convolutions read it
(modeling_omniasr.py ``OmniASREncoderSubsamplingConv1D``)."""


def _waveform_batch(cfg: Any, b: int, s: int, dtype: Any, head: str) -> dict[str, Any]:
    """``input_values`` [b, samples], a raw waveform (wav2vec2, HuBERT, WavLM), with ``s`` its
    length in encoder frames: samples = s x the feature encoder's total stride (the product of
    ``conv_stride``, 320 for wav2vec2-base's 5,2,2,2,2,2,2: 20 ms per frame at 16 kHz,
    ``modeling_wav2vec2.py`` ``_get_feat_extract_output_lengths``). An audio-classification
    head takes class ``labels`` [b]; a CTC head none (:func:`hf_loss` stands in: its
    ``labels.max()`` check and label masking depend on the labels' values, which fake tensors
    do not have). A config with ``num_mel_bins`` and ``max_length`` (the Audio Spectrogram
    Transformer) takes a log-mel spectrogram [b, max_length, num_mel_bins] instead. The stride
    is the audio sub-config's where the model has one (OmniASR's ``audio_config``), and
    :data:`CHANNEL_WAVEFORM_TYPES` take [b, 1, samples]."""
    if hasattr(cfg, "num_mel_bins") and hasattr(cfg, "max_length"):
        # a spectrogram, not a waveform (Audio Spectrogram Transformer: [b, max_length,
        # num_mel_bins], modeling_audio_spectrogram_transformer.py)
        frames = torch.randn(b, cfg.max_length, cfg.num_mel_bins, dtype=dtype)
        batch = {"input_values": frames}
        if head:
            batch["labels"] = torch.randint(0, max(getattr(cfg, "num_labels", 1), 1), (b,))
        return batch
    audio = getattr(cfg, "audio_config", None) or cfg  # OmniASR: its audio tower's convolutions
    stride = 1
    for k in getattr(audio, "conv_stride", None) or (320,):
        stride *= int(k)
    shape = (b, 1, s * stride) if cfg.model_type in CHANNEL_WAVEFORM_TYPES else (b, s * stride)
    batch = {"input_values": torch.randn(*shape, dtype=dtype)}
    if head and not head.endswith("ForCTC"):
        batch["labels"] = torch.randint(0, max(getattr(cfg, "num_labels", 1), 1), (b,))
    return batch


def _feature_batch(cfg: Any, b: int, s: int, dtype: Any) -> tuple[dict[str, Any], int]:
    """``input_features`` and the decoder's length. Whisper-like configs (``num_mel_bins``,
    ``max_source_positions``): [b, mel bins, 2 * max_source_positions], the 30 s log-mel window
    (two frames per encoder position after the stride-2 convolution, ``modeling_whisper.py``),
    the decoder [b, min(s, max_target_positions)]; Speech2Text-like (``input_feat_per_channel``):
    [b, s, features x channels] filterbank frames (``modeling_speech_to_text.py``), the decoder
    s // 4 tokens (its two stride-2 convolutions)."""
    if hasattr(cfg, "num_mel_bins") and hasattr(cfg, "max_source_positions"):
        frames = 2 * cfg.max_source_positions
        features = torch.randn(b, cfg.num_mel_bins, frames, dtype=dtype)
        return {"input_features": features}, min(s, getattr(cfg, "max_target_positions", s))
    if hasattr(cfg, "input_feat_per_channel"):
        width = cfg.input_feat_per_channel * getattr(cfg, "input_channels", 1)
        return {"input_features": torch.randn(b, s, width, dtype=dtype)}, max(s // 4, 1)
    encoder = getattr(cfg, "encoder_config", None) or cfg
    if hasattr(encoder, "num_mel_bins") and hasattr(encoder, "subsampling_conv_stride"):
        # FastConformer encoders (Parakeet, Canary, Cohere ASR, LASR): [b, frames, mel bins]
        # log-mel frames (``feature_extraction_parakeet.py``), ``subsampling_factor`` frames
        # per encoder position (``modeling_parakeet.py`` ``ParakeetEncoderSubsampling``; 4,
        # two stride-2 convolutions, where the config names no factor)
        factor = int(getattr(encoder, "subsampling_factor", None) or 4)
        frames = torch.randn(b, s * factor, encoder.num_mel_bins, dtype=dtype)
        return {"input_features": frames}, s
    raise UnsupportedError(
        f"model_type={cfg.model_type!r} takes input_features of a layout trainmem does not build "
        "(known: Whisper's num_mel_bins x 2 * max_source_positions, Speech2Text's "
        "input_feat_per_channel); use --engine analytic"
    )


def hf_loss(output: Any, batch: Any) -> Any:
    """The model's own loss (``output.loss``); for a CTC head run without labels the mean of its
    fp32 log-softmax, the tensor its ``ctc_loss`` reads; for a headless model
    (``CLIPVisionModel``, ``SiglipVisionModel``, a bare ``XModel``) a stand-in: the mean of its
    last hidden state, whose backward allocates one gradient of that shape, as a head's first
    matmul would."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
    logits = getattr(output, "logits", None)
    if logits is not None:  # a CTC head (``*ForCTC``) run without labels
        # modeling_wav2vec2.py: ``log_softmax(logits, dim=-1, dtype=torch.float32)`` feeds
        # ``ctc_loss``; its alignment (b x frames x (2 x target + 1) fp32) is not traced
        return torch.log_softmax(logits, dim=-1, dtype=torch.float32).mean()
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None:
        hidden = output[0]
    return hidden.mean()


@contextlib.contextmanager
def hf_mask_patches() -> Iterator[None]:
    """Make transformers take the unpadded fast path a real run takes.

    Under fake tensors ``transformers.utils.import_utils.is_tracing`` is True for any fake
    tensor, so ``masking_utils`` refuses the SDPA ``is_causal`` skip (``_ignore_causal_mask_sdpa``)
    and ``find_packed_sequence_indices`` reports possible packing; the model then builds a
    [b, 1, s, s] bool mask that a real unpadded run never builds (+b*s*s bytes, and no flash
    kernel). The patch answers as a real run with ``attention_mask=None`` and ``position_ids =
    arange(s)`` does: not tracing, no packing (``transformers/masking_utils.py``, v5).

    Yields:
        None.
    """
    require_transformers()
    try:
        import transformers.masking_utils as mu
    except ImportError:  # pragma: no cover - transformers 4.x layout
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensor

    orig_is_tracing = mu.is_tracing
    orig_find_packed = mu.find_packed_sequence_indices
    orig_fast_all = getattr(mu, "fast_all", None)

    def is_tracing(tensor: Any = None) -> bool:
        return bool(orig_is_tracing(None if isinstance(tensor, FakeTensor) else tensor))

    def find_packed_sequence_indices(position_ids: Any) -> Any:
        # Same ops as the original (diff, cumsum) so transient bytes match; the answer of an
        # unpadded batch of arange positions is "no packing".
        first = position_ids[:, :1] - 1
        diff = torch.diff(position_ids, prepend=first, dim=-1)
        packed = (diff != 1).cumsum(-1)
        _ = (packed[:, -1] == 0).all()
        return None

    def fast_all(tensor: Any) -> Any:
        if isinstance(tensor, FakeTensor):
            return True
        return orig_fast_all(tensor)  # type: ignore[misc]

    orig_ignore_bidirectional = getattr(mu, "_ignore_bidirectional_mask_sdpa", None)

    def ignore_bidirectional(padding_mask: Any, *args: Any, **kwargs: Any) -> bool:
        # the model's own all-ones mask of an unpadded batch (BigBird, RoFormer...): no token
        # is masked, the answer a real run gets from ``padding_mask.all()``
        if isinstance(padding_mask, FakeTensor):
            padding_mask = None
        return bool(orig_ignore_bidirectional(padding_mask, *args, **kwargs))  # type: ignore[misc]

    mu.is_tracing = is_tracing
    mu.find_packed_sequence_indices = find_packed_sequence_indices
    if orig_ignore_bidirectional is not None:
        mu._ignore_bidirectional_mask_sdpa = ignore_bidirectional
    if orig_fast_all is not None:
        mu.fast_all = fast_all
    # MoE experts (transformers/integrations/moe.py): torch's grouped_mm, whose meta kernel
    # accepts bf16 only; fp32 expert weights (AMP) take transformers' own grouped-mm fallback
    # op, saving what torch's grouped_mm saves (Note [Traced grouped matmul of frozen experts])
    moe: Any
    try:
        import transformers.integrations.moe as moe
    except ImportError:  # pragma: no cover - older transformers
        moe = None
    orig_can_use = getattr(moe, "_can_use_grouped_mm", None)
    orig_grouped_mm = getattr(moe, "_grouped_mm", None)
    if moe is not None and orig_can_use is not None and orig_grouped_mm is not None:
        guarded = guarded_grouped_mm(torch)

        def grouped_mm(inputs: Any, weight: Any, offs: Any) -> Any:
            if weight.dtype == torch.bfloat16 and orig_can_use(inputs, weight, offs):
                return orig_grouped_mm(inputs, weight, offs)
            return guarded(inputs, weight, offs)

        moe._grouped_mm = grouped_mm
    try:
        yield
    finally:
        mu.is_tracing = orig_is_tracing
        mu.find_packed_sequence_indices = orig_find_packed
        if orig_ignore_bidirectional is not None:
            mu._ignore_bidirectional_mask_sdpa = orig_ignore_bidirectional
        if orig_fast_all is not None:
            mu.fast_all = orig_fast_all
        if moe is not None and orig_can_use is not None and orig_grouped_mm is not None:
            moe._grouped_mm = orig_grouped_mm
