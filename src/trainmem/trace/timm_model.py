"""timm vision models on the generic path (issue 26): ``timm:<name>`` or a timm ``config.json``
(``architecture``, ``num_classes``), built by timm itself on ``meta`` and trained as timm's own
training script trains it.

Note [timm training step]
    timm's ``train.py`` (``train_one_epoch``) runs ``output = model(input)`` and ``loss =
    loss_fn(output, target)``: ``nn.CrossEntropyLoss`` (or its label-smoothing variants, the
    same tensors) on the [b, num_classes] logits against class ids [b], under ``autocast``
    for AMP. The input is [b, 3, height, width] at the model's ``pretrained_cfg["input_size"]``
    (``--resolution`` overrides it); ``drop_rate`` / ``drop_path_rate`` are the model's
    defaults (0 unless the config names them), as ``timm.create_model`` builds it. Mixup, the
    EMA copy (``--ema``) and channels-last are options of the script, not of the model.

Source: pytorch-image-models train.py ``train_one_epoch``, timm/models/_builder.py
``build_model_with_cfg`` (``pretrained_cfg``), timm/_hub.py ``save_config_for_hf`` (the hub
``config.json``). timm imports torchvision (timm 1.0.31 timm/layers/create_norm.py:29), which
:func:`trainmem.trace._torch.require_torch` has imported first (Note [torchvision without its C
ops]).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainmem.errors import NotApplicableError, UnsupportedError
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch
from trainmem.trace.quantized import parameter_dtype, quantize_base

torch = require_torch()

__all__ = [
    "build_timm_model",
    "check_timm_settings",
    "import_timm",
    "make_timm_batch",
    "timm_forward_loss",
    "timm_input_size",
    "timm_loss",
]

VISION_INSTALL = "pip install 'trainmem[vision]' (timm)"


def import_timm() -> Any:
    """The ``timm`` module, after torchvision (Note [torchvision without its C ops]).

    Returns:
        The ``timm`` module.

    Raises:
        UnsupportedError: timm is not installed, or torchvision does not import under this
            torch (naming both versions).
    """
    try:
        import timm  # imports torchvision, which require_torch imported first
    except ImportError as exc:
        raise UnsupportedError(
            f"timm models need the timm library ({exc}): {VISION_INSTALL}"
        ) from exc
    except RuntimeError as exc:
        reason = " ".join(str(exc).split())[:200]
        raise UnsupportedError(
            f"timm needs torchvision, which does not import under torch {torch.__version__} "
            f"({reason}); install the torchvision built for this torch"
        ) from exc
    return timm


def check_timm_settings(training: TrainingConfig) -> None:
    """Refuse the settings a timm model's trace does not run, each with what is traced instead.

    Traced: data parallelism, ZeRO / FSDP, full checkpointing (timm's
    ``set_grad_checkpointing``), and on ViT-style blocks selective checkpointing, tensor /
    sequence parallelism, context parallelism of the patch tokens and pipeline stages (Note
    [timm's transformer blocks], Note [Context parallelism of a ViT's tokens],
    trainmem/trace/timm_parallel.py; Note [Pipeline stages of a timm ViT],
    trainmem/trace/timm_pipeline.py; a CNN refuses those when its blocks are looked at).
    Refused: context parallelism beside sequence parallelism (both would split the same
    blocks' tokens).

    Raises:
        NotApplicableError: Cut Cross Entropy or a chunked cross-entropy (a timm model has
            no token logits).
        UnsupportedError: the settings above, named with the reason.
    """
    if training.cut_cross_entropy:
        raise NotApplicableError(
            "cut_cross_entropy: Cut Cross Entropy replaces a causal language model's LM head "
            "and token cross-entropy, and a timm model's loss is one cross-entropy on "
            "[b, num_classes] class logits: leave it false"
        )
    if training.chunked_cross_entropy > 0:
        raise NotApplicableError(
            f"chunked_cross_entropy={training.chunked_cross_entropy}: a chunked cross-entropy "
            "splits a language model's token logits, and a timm model's loss is one "
            "cross-entropy on [b, num_classes] class logits: leave it 0"
        )
    traced = (
        "traced: data parallelism, ZeRO / FSDP (--zero-stage, --data-parallel-size), full "
        "checkpointing (timm's --grad-checkpointing), and on ViT blocks selective "
        "checkpointing, tensor / sequence, context and pipeline parallelism "
        "(--tensor-parallel-size, --sequence-parallel, --context-parallel-size, "
        "--pipeline-parallel-size)"
    )
    why = {
        "context_parallel_size": (
            training.context_parallel_size > 1 and training.sequence_parallel,
            "the tokens sharded over the context ranks would be split again over the tensor "
            "ranks at the same blocks; context parallelism runs beside tensor parallelism "
            "without --sequence-parallel",
        ),
    }
    refused = [f"{k}={getattr(training, k)} ({reason})" for k, (on, reason) in why.items() if on]
    if refused:
        raise UnsupportedError(f"a timm model's trace does not run {'; '.join(refused)}; {traced}")


def build_timm_model(raw: Mapping[str, Any], training: TrainingConfig) -> Any:
    """The timm model ``raw["architecture"]`` names, on the current device (the generic path
    builds it under ``torch.device("meta")``), in the weight dtype, LoRA applied, in train mode.

    Args:
        raw: a timm config (``architecture``; optional ``num_classes``, ``in_chans``,
            ``drop_rate``, ``drop_path_rate``, ``model_args``).
        training: the weight dtype, dropout and LoRA settings.

    Returns:
        The ``nn.Module``.

    Raises:
        UnsupportedError: timm is missing or does not know the name (with close names).
    """
    from trainmem.trace.lora import apply_lora

    timm = import_timm()
    name = str(raw["architecture"])
    if not timm.is_model(name):
        close = timm.list_models(f"*{name.split('.')[0][:40]}*")[:5]
        hint = f"; close names: {', '.join(close)}" if close else ""
        raise UnsupportedError(
            f"timm {timm.__version__} has no model {name[:80]!r}{hint}; list them with "
            "timm.list_models()"
        )
    kwargs: dict[str, Any] = dict(raw.get("model_args") or {})
    for key in ("num_classes", "in_chans", "drop_rate", "drop_path_rate", "img_size"):
        if key in raw:
            kwargs[key] = raw[key]
    if not training.dropout:
        kwargs["drop_rate"] = kwargs["drop_path_rate"] = 0.0
    if training.image_size is not None and "img_size" in _create_args(timm, name):
        kwargs["img_size"] = training.image_size  # ViT-style models size their position table
    try:
        model = timm.create_model(name, pretrained=False, **kwargs)
    except (TypeError, ValueError, RuntimeError, AssertionError) as exc:
        reason = " ".join(str(exc).split())[:200]
        raise UnsupportedError(
            f"timm {timm.__version__} cannot build {name[:80]!r} ({type(exc).__name__}: "
            f"{reason}); check the config, or name another model"
        ) from exc
    if training.weight_dtype != "float32":
        model = model.to(getattr(torch, training.weight_dtype))
    model = apply_lora(model, training)
    quantize_base(model, training)  # Note [Traced quantized base]
    model.train()
    return model


def _create_args(timm: Any, name: str) -> set[str]:
    """The keyword arguments the model's class takes (``img_size`` for ViT-style models)."""
    import inspect

    entry = timm.models.model_entrypoint(name)  # timm/models/_registry.py
    cls = getattr(inspect.getmodule(entry), "VisionTransformer", None)
    if cls is None:
        return set()
    return set(inspect.signature(cls.__init__).parameters)


def timm_input_size(model: Any, training: TrainingConfig) -> tuple[int, int, int]:
    """(channels, height, width) of the training images: ``--resolution`` if given, else the
    model's ``pretrained_cfg["input_size"]`` (timm/models/_builder.py), else 3 x 224 x 224."""
    cfg = getattr(model, "pretrained_cfg", None) or {}
    base = getattr(model, "get_base_model", lambda: model)()  # peft
    cfg = cfg or getattr(base, "pretrained_cfg", None) or {}
    channels, height, width = tuple(cfg.get("input_size") or (3, 224, 224))
    if training.image_size is not None:
        height, width = training.image_size
    return int(channels), int(height), int(width)


def timm_image_size(raw: Mapping[str, Any], training: TrainingConfig) -> tuple[int, int]:
    """(height, width) of the images :func:`make_timm_batch` feeds the model of the timm config
    ``raw``, without building it: ``--resolution`` if given, else the ``input_size`` of the
    pretrained config the model is built with (timm/models/_registry.py ``get_pretrained_cfg``,
    what ``create_model`` sets as ``model.pretrained_cfg``; :func:`timm_input_size`)."""
    if training.image_size is not None:
        height, width = training.image_size
        return int(height), int(width)
    timm = import_timm()
    cfg = timm.models.get_pretrained_cfg(str(raw["architecture"]))
    _, height, width = tuple(getattr(cfg, "input_size", None) or (3, 224, 224))
    return int(height), int(width)


def make_timm_batch(
    model: Any, training: TrainingConfig, said: list[str] | None = None
) -> dict[str, Any]:
    """One batch (call inside the fake mode): ``input`` [b, channels, height, width] in the
    parameter dtype and ``target`` class ids [b] (Note [timm training step]); ``said`` gets
    what the step assumes of the batch's tokens (their padding over the context ranks, Note
    [Context parallelism of a ViT's tokens])."""
    if said is not None and training.context_parallel_size > 1:
        from trainmem.trace.timm_parallel import context_parallel_note

        note = context_parallel_note(model, training.context_parallel_size)
        if note:
            said.append(note)
    b = training.micro_batch_size
    channels, height, width = timm_input_size(model, training)
    dtype = parameter_dtype(model)
    base = getattr(model, "get_base_model", lambda: model)()
    classes = max(int(getattr(base, "num_classes", 1) or 1), 1)
    return {
        "input": torch.randn(b, channels, height, width, dtype=dtype),
        "target": torch.randint(0, classes, (b,)),
    }


def timm_forward_loss(model: Any, batch: Mapping[str, Any]) -> tuple[Any, Any]:
    """``cross_entropy(model(input), target)``, timm train.py's step (:func:`timm_loss`), as
    ``(loss, output)`` so that a loop binding the output (``run_step``'s ``hold_output``) holds
    it (Note [The previous output of a model without a ModelSpec]). A head that
    batch-normalises pooled features at micro-batch 1 is refused by the engine
    (:func:`trainmem.trace.model_errors.refusal_of`)."""
    output = model(batch["input"])
    return timm_loss(output, batch), output


def timm_loss(output: Any, batch: Mapping[str, Any]) -> Any:
    """timm train.py's ``loss_fn(output, target)``: the cross-entropy of the class logits
    against ``batch["target"]`` (a headless model, ``num_classes=0``, returns pooled features:
    their mean stands in for a head)."""
    if output.dim() == 2 and output.shape[-1] > 1:
        return torch.nn.functional.cross_entropy(output, batch["target"])
    return output.float().mean()
