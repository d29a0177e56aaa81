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

from trainmem.errors import UnsupportedError
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch, require_transformers

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
    return transformers.AutoModelForCausalLM


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
    if not dropout:
        for k, v in list(raw.items()):
            if isinstance(v, float) and any(p in k for p in _DROPOUT_KEY_PARTS):
                raw[k] = 0.0
    model_type = raw.get("model_type")
    try:
        config = transformers.AutoConfig.for_model(
            model_type, **{k: v for k, v in raw.items() if k != "model_type"}
        )
    except (ValueError, KeyError) as exc:
        raise UnsupportedError(
            f"transformers {transformers.__version__} cannot build model_type={model_type!r} "
            "for tracing; use --engine analytic"
        ) from exc
    config._attn_implementation = "eager" if attention == "eager" else "sdpa"
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
    model.train()
    return model


def build_hf_training_model(
    raw_config: Mapping[str, Any], training: TrainingConfig, *, device: str = "meta"
) -> Any:
    """The model a training run of ``training`` steps: built, cast, wrapped in peft LoRA if asked.

    Args:
        raw_config: the parsed ``config.json``.
        training: dropout, attention, weight dtype and the LoRA settings.
        device: ``meta`` for the trace, ``cpu`` for the real-run proof.

    Returns:
        The ``nn.Module`` (a ``PeftModel`` with LoRA), in train mode.
    """
    from trainmem.trace.lora import apply_lora

    dtype = None if training.weight_dtype == "float32" else getattr(torch, training.weight_dtype)
    model = build_hf_model(
        raw_config,
        dropout=training.dropout,
        attention=training.attention,
        dtype=dtype,
        device=device,
    )
    if raw_config.get("model_type") in VISION_TOWER_TYPES:
        attach_pooled_loss(model)
    model = apply_lora(model, training)
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


def make_hf_batch(
    model: Any, micro_batch_size: int, seq_len: int, target_seq_len: int = 0
) -> dict[str, Any]:
    """One unpadded training batch for a HF model (call inside the fake mode for fake tensors).

    The input follows the model's ``main_input_name`` (``transformers/modeling_utils.py``):
    ``input_ids`` [b, s] int64 with ``labels`` = the same ids (causal and masked LM, T5/BART:
    the decoder reads the labels shifted right; T5's ``labels`` are [b, target] with
    ``target_seq_len``; Mamba);
    ``pixel_values`` [b, c, height, width] in the parameter dtype (ViT, DINOv2, CLIP / SigLIP
    vision towers) with class ``labels`` [b] when the model takes labels; ``input_features``
    [b, mel bins, 2 * max_source_positions] (Whisper's 30 s log-mel window: two frames per
    encoder position after its stride-2 convolution, ``modeling_whisper.py``) with decoder
    ``labels`` [b, min(s, max_target_positions)]. A ``*ForSequenceClassification`` head takes
    class ``labels`` [b], a ``*ForTokenClassification`` head [b, s], in ``range(num_labels)``
    (``modeling_bert.py`` ``BertForSequenceClassification.forward``: ``labels.view(-1)``
    against ``logits.view(-1, num_labels)``).

    Args:
        model: the HF model (its ``config`` decides the inputs).
        micro_batch_size: b.
        seq_len: s (tokens; the decoder's for Whisper).
        target_seq_len: the decoder's length for T5; 0 means ``seq_len``.

    Returns:
        Keyword arguments of ``model(**batch)``, with ``labels`` when the model takes them (a
        headless model's loss is :func:`hf_loss`'s stand-in).
    """
    cfg = model.config
    b, s = micro_batch_size, seq_len
    main = getattr(model, "main_input_name", "input_ids")
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    takes_labels = "labels" in inspect.signature(base.forward).parameters
    dtype = next(model.parameters()).dtype
    batch: dict[str, Any]
    if main == "pixel_values":
        size = cfg.image_size  # an int, or [height, width] (ViT's non-square images)
        height, width = size if isinstance(size, (list, tuple)) else (size, size)
        batch = {"pixel_values": torch.randn(b, cfg.num_channels, height, width, dtype=dtype)}
        if takes_labels:
            batch["labels"] = torch.randint(0, max(getattr(cfg, "num_labels", 1), 1), (b,))
        return batch
    if main == "input_features":
        frames = 2 * cfg.max_source_positions
        batch = {"input_features": torch.randn(b, cfg.num_mel_bins, frames, dtype=dtype)}
        s = min(s, getattr(cfg, "max_target_positions", s))
    else:
        batch = {}
    ids = torch.randint(0, cfg.vocab_size, (b, s))
    if main != "input_features":
        batch["input_ids"] = ids
    if takes_labels:
        target = target_seq_len or s
        same = target == s or cfg.model_type != "t5"
        batch["labels"] = ids.clone() if same else torch.randint(0, cfg.vocab_size, (b, target))
        classes = max(getattr(cfg, "num_labels", 1), 1)
        head = type(base).__name__
        if head.endswith("ForSequenceClassification"):  # one class per sequence
            batch["labels"] = torch.randint(0, classes, (b,))
        elif head.endswith("ForTokenClassification"):  # one class per token
            batch["labels"] = torch.randint(0, classes, (b, s))
    return batch


def hf_loss(output: Any, batch: Any) -> Any:
    """The model's own loss (``output.loss``), or for a headless model (``CLIPVisionModel``,
    ``SiglipVisionModel``, a bare ``XModel``) a stand-in: the mean of its last hidden state,
    whose backward allocates one gradient of that shape, as a head's first matmul would."""
    loss = getattr(output, "loss", None)
    if loss is not None:
        return loss
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

    mu.is_tracing = is_tracing
    mu.find_packed_sequence_indices = find_packed_sequence_indices
    if orig_fast_all is not None:
        mu.fast_all = fast_all
    # MoE experts (transformers/integrations/moe.py): the fake CPU device would pick
    # torch's grouped_mm, whose meta kernel accepts bf16 only; fp32 expert weights (AMP) take
    # transformers' own grouped-mm fallback op instead, which saves the same input and weight.
    moe: Any
    try:
        import transformers.integrations.moe as moe
    except ImportError:  # pragma: no cover - older transformers
        moe = None
    orig_can_use = getattr(moe, "_can_use_grouped_mm", None)
    if moe is not None and orig_can_use is not None:

        def can_use_grouped_mm(inputs: Any, weight: Any, offs: Any) -> bool:
            return bool(weight.dtype == torch.bfloat16 and orig_can_use(inputs, weight, offs))

        moe._can_use_grouped_mm = can_use_grouped_mm
    try:
        yield
    finally:
        mu.is_tracing = orig_is_tracing
        mu.find_packed_sequence_indices = orig_find_packed
        if orig_fast_all is not None:
            mu.fast_all = orig_fast_all
        if moe is not None and orig_can_use is not None:
            moe._can_use_grouped_mm = orig_can_use
