"""diffusers models in the trace engine: build from ``config.json``, feed the real inputs,
take the training loss of diffusers' own example scripts.

Entry points (the per-block generic path calls them too):

- :func:`build_diffusers_model`: ``diffusers.<_class_name>.from_config`` on ``meta``, cast to
  the weight dtype, LoRA adapters as diffusers' LoRA scripts add them;
- :func:`make_diffusers_batch`: one micro-batch of the model's forward arguments for a
  resolution, frame count and text length (:func:`trainmem.specs.diffusers.image_batch`);
- :func:`diffusers_loss`: MSE between the prediction and a target of its shape.

Note [diffusers training step]
    What the step runs mirrors diffusers' examples (v0.42): ``examples/dreambooth/
    train_dreambooth_flux.py`` and ``train_dreambooth_sd3.py`` (flow matching: the transformer
    predicts ``noise - latents``; loss ``mean((w.float() * (pred.float() - target.float()) ** 2)
    .reshape(b, -1), 1).mean()`` with ``w = compute_loss_weighting_for_sd3("none") = 1``), and
    ``examples/text_to_image/train_text_to_image_sdxl.py`` (epsilon prediction:
    ``F.mse_loss(pred.float(), target.float())``). The VAE and text encoders are frozen and
    run before the step (or their outputs are cached), so the batch is their outputs: latents,
    prompt embeddings, pooled embeddings. By default (``frozen_on_gpu="none"``) they hold no
    GPU memory; ``vae`` / ``text-encoders`` / ``all`` keep them there as the scripts do without
    cached latents / precomputed embeddings (their weights only, as parameters from setup;
    :data:`trainmem.specs.diffusers.FROZEN_COMPONENTS`); a kept VAE encodes the batch's pixels
    inside the step (Note [The frozen VAE encodes inside the step], trace/frozen_encode.py),
    the text encoders' forwards are not traced.
    Differences from the scripts, all a few latent-sized tensors: the target is drawn inside
    the loss (``noise - latents`` there: one tensor of the latent shape; SDXL's ``target =
    noise`` exists before the forward there), FLUX's prediction is not unpacked back to
    [b, c, h, w] (a copy of the prediction there). SD3's default ``--precondition_outputs 1``
    is applied (``pred * (-sigmas) + noisy_input``, target the clean latents).

    Inputs are in the parameter dtype (the scripts cast latents and embeddings to
    ``weight_dtype``); timesteps are fp32 (FLUX / SD3 / Wan: scheduler sigmas) or int64 (SDXL:
    ``torch.randint``).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainmem.breakdown import MemoryEstimate
from trainmem.errors import NotApplicableError, UnsupportedError
from trainmem.specs.diffusers import (
    check_diffusers_config,
    diffusers_class,
    frozen_components,
    image_batch,
    trained_text_encoders,
)
from trainmem.specs.hardware import GPUSpec
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch
from trainmem.trace.diffusers_eager import use_eager_attention
from trainmem.trace.diffusers_inputs import forward_inputs
from trainmem.trace.layerwise_casting import apply_layerwise_casting
from trainmem.trace.quantized import quantize_base
from trainmem.units import dtype_bytes

torch = require_torch()

__all__ = [
    "DIFFUSERS_LORA_MODULES",
    "apply_diffusers_lora",
    "build_diffusers_model",
    "check_diffusers_settings",
    "describe_diffusers_batch",
    "diffusers_loss",
    "diffusers_loss_for",
    "estimate_diffusers_trace",
    "make_diffusers_batch",
]

DIFFUSERS_LORA_MODULES: dict[str, tuple[str, ...]] = {
    "q": ("to_q", "add_q_proj"),
    "k": ("to_k", "add_k_proj"),
    "v": ("to_v", "add_v_proj"),
    "o": ("to_out.0", "to_add_out"),
    "up": ("net.0.proj",),
    "down": ("net.2",),
}
"""trainmem LoRA target -> diffusers module-name suffixes. diffusers' attention names its
projections ``to_q`` / ``to_k`` / ``to_v`` / ``to_out.0`` and, in joint (MMDiT) attention, the
text stream's ``add_q_proj`` / ``add_k_proj`` / ``add_v_proj`` / ``to_add_out``; its
``FeedForward`` is ``net.0.proj`` (GELU / GEGLU input projection) and ``net.2``. The default
target lists of ``train_dreambooth_lora_flux.py`` / ``_sd3.py`` (attention and, for FLUX, the
feed-forwards) and ``train_dreambooth_lora_sdxl.py`` (``to_q``, ``to_k``, ``to_v``,
``to_out.0``) are combinations of these rows."""

_DROPOUT_KEYS = ("dropout", "attention_dropout")


def _require_diffusers() -> Any:
    try:
        import diffusers
    except ImportError as exc:  # pragma: no cover - diffusers is optional
        raise UnsupportedError(
            "tracing a diffusers model needs diffusers: pip install diffusers"
        ) from exc
    return diffusers


def build_diffusers_model(
    raw_config: Mapping[str, Any], training: TrainingConfig, *, device: str = "meta"
) -> Any:
    """The diffusers model a ``config.json`` describes, as ``training`` trains it.

    Built with ``diffusers.<_class_name>.from_config`` under ``torch.device(device)`` (on
    ``meta`` no weight is initialised), cast to ``training.weight_dtype``, dropout zeroed when
    ``training.dropout`` is off, LoRA adapters added (:func:`apply_diffusers_lora`), the frozen
    layers cast for storage (``layerwise_casting``: Note [diffusers' layerwise casting]).

    Args:
        raw_config: the parsed ``config.json`` (with ``_class_name``).
        training: weight dtype, dropout, attention, LoRA settings.
        device: ``meta`` for the trace, ``cpu`` for the real-run proof.

    Returns:
        The ``nn.Module`` in train mode.

    Raises:
        UnsupportedError: diffusers missing, an unknown class, or ``--attention eager`` on a
            model diffusers has no eager processor for (Note [diffusers' eager attention]).
    """
    diffusers = _require_diffusers()
    name = diffusers_class(raw_config)
    check_diffusers_config(raw_config)
    cls = getattr(diffusers, name)
    raw = dict(raw_config)
    if not training.dropout:
        for key in _DROPOUT_KEYS:
            if isinstance(raw.get(key), float):
                raw[key] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            with torch.device(device):
                model = cls.from_config(raw)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            reason = " ".join(str(exc).split())[:200]
            raise UnsupportedError(
                f"diffusers {diffusers.__version__} cannot build {name} from this config "
                f"({type(exc).__name__}: {reason}); check the config"
            ) from exc
    if device == "meta":
        _tensor_attributes_as_buffers(model)
    if training.attention == "eager":
        use_eager_attention(model)  # Note [diffusers' eager attention]
    if training.weight_dtype != "float32":
        # every parameter, as the scripts' ``transformer.to(device, dtype=weight_dtype)`` casts
        # (ModelMixin.to only adds a log line about ``_keep_in_fp32_modules`` before this)
        model = torch.nn.Module.to(model, getattr(torch, training.weight_dtype))
    apply_diffusers_lora(model, training)
    quantize_base(model, training, diffusers=True)  # Note [Traced quantized base]
    # Note [diffusers' layerwise casting]: after the adapters, as enable_layerwise_casting
    apply_layerwise_casting(model, training, real=device != "meta")
    model.train()
    return model


class _BufferSequence(Sequence[Any]):
    """A list attribute of tensors read from its module's buffers ``<name>_0``, ``<name>_1``...
    (so that the fake mode's conversion of the buffers reaches the list): indexing, ``len`` and
    iteration as the list it replaces; the model may assign a plain list over it."""

    def __init__(self, module: Any, names: list[str]) -> None:
        self._module = weakref.ref(module)
        self._names = names

    def __getitem__(self, i: Any) -> Any:
        buffers = self._module()._buffers  # type: ignore[union-attr]
        return [buffers[n] for n in self._names][i]

    def __len__(self) -> int:
        return len(self._names)


def _tensor_attributes_as_buffers(model: Any) -> None:
    """Register the plain tensor attributes of ``model``'s modules (rotary tables some classes
    keep outside ``register_buffer``: QwenImage's ``pos_freqs``, Kandinsky 5's...) as
    non-persistent buffers, and lists of tensors (Lumina2's per-axis ``freqs_cis``) as a
    :class:`_BufferSequence`, so that the fake mode converts them with the buffers."""
    for module in list(model.modules()):
        for key, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                delattr(module, key)
                module.register_buffer(key, value, persistent=False)
            elif (
                isinstance(value, list | tuple)
                and value
                and all(
                    isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)
                    for v in value
                )
            ):
                names = [f"{key}_{i}" for i in range(len(value))]
                for n, v in zip(names, value, strict=True):
                    module.register_buffer(n, v, persistent=False)
                setattr(module, key, _BufferSequence(module, names))


def apply_diffusers_lora(model: Any, training: TrainingConfig) -> None:
    """Add LoRA adapters in place as diffusers' LoRA scripts do (no-op without LoRA).

    ``train_dreambooth_lora_flux.py``: ``transformer.requires_grad_(False)``, then
    ``transformer.add_adapter(LoraConfig(r, lora_alpha, lora_dropout, init_lora_weights=
    "gaussian", target_modules=...))`` (peft ``inject_adapter_in_model``: the adapters take the
    base layer's dtype), then ``cast_training_params(transformer, torch.float32)`` for fp16
    weights only. Targets: :data:`DIFFUSERS_LORA_MODULES`.

    Args:
        model: the diffusers model (a ``PeftAdapterMixin``).
        training: ``lora_rank``, ``lora_targets``, ``lora_dropout``.

    Note [LoRA on a model without add_adapter]
        A class without diffusers' ``PeftAdapterMixin`` (PixArt's ``PixArtTransformer2DModel``
        in diffusers 0.42) gets the same adapters from peft's ``inject_adapter_in_model``, the
        call ``add_adapter`` makes (``diffusers/loaders/peft.py``: ``inject_adapter_in_model(
        adapter_config, self, adapter_name)`` then ``set_adapter``, which only marks the
        adapter active); PixArt's own LoRA recipe (PixArt-sigma ``asset/docs/pixart_lora.md``,
        ``train_scripts/train_pixart_lora_hf.py``) trains the transformer through peft, whose
        injection adds the same layers.

    Raises:
        UnsupportedError: a target the model has no linear for.
    """
    if not training.is_lora:
        return
    from trainmem.trace.lora import adapter_config, cast_adapters, lokr_module_dropout_off

    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    names: list[str] = []
    for target in training.lora_targets:
        # a diffusers module name (DIFFUSERS_LORA_TARGETS, "to_out.0") matches itself alone
        found = _matching(linears, DIFFUSERS_LORA_MODULES.get(target, (target,)))
        if not found:
            have = [t for t, s in DIFFUSERS_LORA_MODULES.items() if _matching(linears, s)]
            raise UnsupportedError(
                f"lora target {target!r}: {type(model).__name__} has no such linear (it has "
                f"{', '.join(have)}); drop it from --lora-targets"
            )
        names.extend(n for n in found if n not in names)
    model.requires_grad_(False)
    gaussian = (
        {} if training.lora_variant in ("lokr", "loha") else {"init_lora_weights": "gaussian"}
    )
    config = adapter_config(  # train_dreambooth_lora_*.py --use_dora: lora_variant dora
        training, names, lora_alpha=training.lora_rank, **gaussian
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if hasattr(model, "add_adapter"):
            model.add_adapter(config)
        else:  # Note [LoRA on a model without add_adapter]
            from peft import inject_adapter_in_model

            inject_adapter_in_model(config, model)
    lokr_module_dropout_off(model)
    _adapters_in_base_dtype(model, training)  # Note [diffusers' adapters take the base dtype]
    cast_adapters(model, training)  # DeepSpeed's cast of the wrapped module
    if training.weight_dtype == "float16" and training.lora_adapter_dtype is None:
        # diffusers.training_utils.cast_training_params (an explicit dtype: cast_adapters)
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.to(torch.float32)


def _adapters_in_base_dtype(model: Any, training: TrainingConfig) -> None:
    """Cast the adapters ``add_adapter`` made to their base layer's floating dtype, in place.

    Note [diffusers' adapters take the base dtype]
        diffusers' ``add_adapter`` calls peft's ``inject_adapter_in_model``, never
        ``PeftModel``: each new LoRA layer is moved to its base layer's device and floating
        dtype (peft 0.21.2 tuners/tuners_utils.py ``_move_adapter_to_device_of_base_layer``)
        and nothing upcasts it (``_cast_adapter_dtype``, peft's ``autocast_adapter_dtype``,
        runs in ``PeftModel.__init__`` only). So over a bf16 transformer (the LoRA scripts'
        ``transformer.to(accelerator.device, dtype=weight_dtype)``; finetrainers' trainer.py
        ``self.transformer.to(dtype=weight_dtype)``) the adapters, their gradients and AdamW's
        states are bf16; the scripts upcast them (``cast_training_params``) for fp16 only. A
        real CPU execution (diffusers 0.42.1, peft 0.21.2: a bf16 LTXVideoTransformer3DModel,
        ``add_adapter(LoraConfig(r=4, target_modules=["to_q", ...]))``) gives bf16 adapters.
        On ``meta`` peft skips the move (its adapters are on ``meta`` too), leaving fp32: this
        restores the dtype the real call gives. A quantized base (added after this) keeps
        fp32 adapters: peft casts to a floating base dtype only, and a bitsandbytes weight is
        uint8."""
    if training.quantize_base != "none":
        return
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        weight = getattr(base, "weight", None)
        if weight is None or not weight.is_floating_point():
            continue
        for name, param in module.named_parameters():  # the adapters: all but the base's
            if not name.startswith("base_layer.") and param.is_floating_point():
                param.data = param.data.to(weight.dtype)


def _matching(names: list[str], suffixes: tuple[str, ...]) -> list[str]:
    """The module names peft's ``target_modules`` suffixes match (a name equal to a suffix or
    ending in ``.suffix``: peft ``check_target_module_exists``)."""
    return [n for n in names if any(n == s or n.endswith("." + s) for s in suffixes)]


def make_diffusers_batch(model: Any, training: TrainingConfig) -> dict[str, Any]:
    """One micro-batch of the model's forward arguments (call inside the fake mode).

    Each argument of ``type(model).forward`` is sized by its rule in :data:`INPUT_RULES` from
    the config and the resolved geometry (:func:`trainmem.specs.diffusers.image_batch`), in the
    signature's order; Note [Inputs from the forward signature]. Shapes of the classes the
    rules were first written for (b = micro-batch, h, w = latent height / width = pixels / 8,
    t = text tokens):

    - FLUX (``pipeline_flux.py``): ``hidden_states`` [b, (h/2)(w/2), in_channels] (16 latent
      channels packed 2x2 into 64), ``encoder_hidden_states`` [b, t, joint_attention_dim],
      ``pooled_projections`` [b, pooled_projection_dim], ``timestep`` [b], ``guidance`` [b] when
      ``guidance_embeds``, ``img_ids`` [(h/2)(w/2), 3], ``txt_ids`` [t, 3];
    - SD3: ``hidden_states`` [b, in_channels, h, w], ``encoder_hidden_states`` [b, t,
      joint_attention_dim], ``pooled_projections`` [b, pooled_projection_dim], ``timestep`` [b];
    - UNet2DCondition (SDXL): ``sample`` [b, in_channels, h, w], ``timestep`` [b] int64,
      ``encoder_hidden_states`` [b, t, cross_attention_dim]; with ``addition_embed_type
      "text_time"`` ``added_cond_kwargs`` ``text_embeds`` [b, projection_class_embeddings_
      input_dim - 6 * addition_time_embed_dim] and ``time_ids`` [b, 6]
      (``train_text_to_image_sdxl.py``);
    - Wan: ``hidden_states`` [b, in_channels, f, h, w] with f = (frames - 1) / 4 + 1,
      ``timestep`` [b], ``encoder_hidden_states`` [b, t, text_dim].

    Args:
        model: the diffusers model (its ``config`` and ``forward`` decide the inputs).
        training: ``micro_batch_size``, ``resolution``, ``frames``, ``text_seq_len``.

    Returns:
        Keyword arguments of ``model(**batch)`` (``return_dict=False``).

    Raises:
        UnsupportedError: a required forward argument without a rule, or a rule that cannot
            size it from this config (names the argument and the config field).
    """
    return forward_inputs(model, training)


def diffusers_loss(
    output: Any, batch: Mapping[str, Any], *, precondition: bool = False, mse: bool = False
) -> Any:
    """The training loss of diffusers' example scripts on the model's prediction.

    UNets (``sample`` in the batch; ``train_text_to_image.py``, ``train_text_to_image_sdxl.py``,
    epsilon prediction): ``F.mse_loss(pred.float(), target.float(), reduction="mean")``. The
    transformers (flow matching, ``train_dreambooth_flux.py`` / ``train_dreambooth_sd3.py``):
    ``torch.mean((w.float() * (pred.float() - target.float()) ** 2).reshape(b, -1), 1).mean()``
    with the weighting ``w`` of scheme ``"none"`` (ones [b, 1, ...]); with ``precondition``
    (SD3, :func:`diffusers_loss_for`) the prediction is first preconditioned (``pred *
    (-sigmas) + noisy_input``, ``train_dreambooth_sd3.py``). The target is a tensor of the
    prediction's shape and dtype (epsilon and flow-matching targets hold the same memory); see
    Note [diffusers training step].

    Args:
        output: the model's output (a tuple with ``return_dict=False``, or an output object).
        batch: the micro-batch (``sample`` in it marks a UNet).
        precondition: SD3's output preconditioning.
        mse: the UNets' plain MSE on a transformer's prediction (``train_controlnet_flux.py``:
            ``F.mse_loss(noise_pred.float(), (noise - pixel_latents).float(), reduction=
            "mean")``).

    Returns:
        The scalar loss.
    """
    if isinstance(output, torch.Tensor):  # Kandinsky 5 returns the prediction itself
        pred = output
    else:
        pred = output[0] if isinstance(output, tuple | list) else output.sample
    if isinstance(pred, list):  # Z-Image: one prediction per sample
        pred = torch.stack(pred)
    target = torch.randn_like(pred)
    if "sample" in batch or mse:
        return torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="mean")
    b = pred.shape[0]
    if precondition:
        # SD3 (train_dreambooth_sd3.py, --precondition_outputs 1 by default, EDM sec. 5):
        # model_pred = model_pred * (-sigmas) + noisy_model_input; target = model_input
        noisy = batch["hidden_states"]
        sigmas = torch.rand((b,) + (1,) * (pred.dim() - 1), dtype=noisy.dtype)
        pred = pred * (-sigmas) + noisy
    weighting = torch.ones((b,) + (1,) * (pred.dim() - 1), dtype=pred.dtype)
    per_sample = torch.mean(
        (weighting.float() * (pred.float() - target.float()) ** 2).reshape(b, -1), 1
    )
    return per_sample.mean()


PRECONDITIONED = frozenset({"SD3Transformer2DModel"})
"""Classes whose training script preconditions the prediction (``train_dreambooth_sd3.py``'s
``--precondition_outputs``, default 1)."""


def diffusers_loss_for(raw_config: Mapping[str, Any]) -> Callable[[Any, Any], Any]:
    """:func:`diffusers_loss` as the config's class trains: preconditioned for
    :data:`PRECONDITIONED`."""
    if diffusers_class(raw_config) in PRECONDITIONED:
        return functools.partial(diffusers_loss, precondition=True)
    return diffusers_loss


def pipeline_loss(raw_config: Mapping[str, Any], training: TrainingConfig) -> Any:
    """The loss of a step with more of the pipeline in it (``controlnet`` /
    ``train_text_encoder``): the UNet scripts' MSE; a FLUX ControlNet's plain MSE
    (``train_controlnet_flux.py``), an SD3 ControlNet's preconditioned flow-matching loss
    (``train_controlnet_sd3.py``, ``--precondition_outputs`` 1 by default; diffusers v0.40)."""
    if training.controlnet and diffusers_class(raw_config) == "FluxTransformer2DModel":
        return functools.partial(diffusers_loss, mse=True)
    return diffusers_loss_for(raw_config)


def check_diffusers_settings(training: TrainingConfig, *, generic: bool = False) -> None:
    """Refuse the settings a diffusers trace does not run (whole model or generic path).

    Traced for real under torch's fake process group: FSDP2 (``zero_stage=3`` over
    ``data_parallel_size`` ranks, the blocks the model declares sharded one by one,
    ``trainmem.trace.fsdp``), tensor and sequence parallelism of the blocks
    (``trainmem.trace.diffusers_parallel``); and ``compile`` (each block compiled, as
    diffusers' ``ModelMixin.compile_repeated_blocks`` does; ``trainmem.trace.compile``).
    Pipeline and context parallelism on the generic path (``generic``;
    trainmem.trace.diffusers_pipeline, trainmem.trace.diffusers_parallel). Refused, each with
    what runs instead: both in the whole-model trace; not applicable: a chunked loss (a
    diffusers model has no token logits).

    Args:
        training: the settings.
        generic: the generic path's check (pipeline parallelism traced there).

    Raises:
        NotApplicableError: Cut Cross Entropy or a chunked cross-entropy.
        UnsupportedError: the parallelisms above, named with the reason.
    """
    if training.cut_cross_entropy:
        raise NotApplicableError(
            "cut_cross_entropy: Cut Cross Entropy replaces a causal language model's LM head "
            "and token cross-entropy, and a diffusers model's loss is an MSE on its "
            "prediction: leave it false"
        )
    if training.chunked_cross_entropy > 0:
        raise NotApplicableError(
            f"chunked_cross_entropy={training.chunked_cross_entropy}: a chunked cross-entropy "
            "splits a language model's token logits, and a diffusers model's loss is an MSE on "
            "its prediction: leave it 0"
        )
    why = {
        "context_parallel_size": (
            training.context_parallel_size > 1 and not generic,
            "the whole-model trace does not shard a denoiser's latents; traced: --engine "
            "generic (torch's context parallelism over the latents' rows, Note [Context "
            "parallelism of a denoiser])",
        ),
        "pipeline_parallel_size": (
            training.pipeline_parallel_size > 1 and not generic,
            "the whole-model trace does not split a denoiser into stages; traced: "
            "--engine generic (torch's pipeline frontend cuts the stages, Note [Tracing "
            "pipeline parallelism of a denoiser])",
        ),
    }
    refused = [f"{k}={getattr(training, k)} ({reason})" for k, (on, reason) in why.items() if on]
    if refused:
        raise UnsupportedError(f"a diffusers model's trace does not run {'; '.join(refused)}")


def describe_diffusers_batch(
    est: MemoryEstimate, raw: Mapping[str, Any], training: TrainingConfig
) -> None:
    """The resolved image batch in ``est``: ``details["diffusers"]``, the config line (no token
    ``seq_len``) and a note (whole model or generic path)."""
    cls = diffusers_class(raw)
    g = image_batch(raw, training)
    est.details["diffusers"] = {
        "class": cls,
        "height": g.height,
        "width": g.width,
        "frames": g.frames,
        "text_seq_len": g.text_seq_len,
        "latent_shape": [g.latent_frames, g.latent_height, g.latent_width]
        if g.frames
        else [g.latent_height, g.latent_width],
    }
    # the batch as resolved (a diffusers step has no token sequence length)
    est.config.pop("seq_len", None)
    est.config.update(
        resolution=g.height if g.height == g.width else f"{g.height}x{g.width}",
        frames=g.frames or None,
        text_seq_len=g.text_seq_len,
    )
    what = f"{g.height}x{g.width} px" + (f", {g.frames} frames" if g.frames else "")
    kept = frozen_components(raw, training)
    if kept:
        held = ", ".join(f"{name} {n:,} x {dtype_bytes(dtype)} B" for name, n, dtype in kept)
        frozen = f"frozen on the GPU as parameters, --frozen-on-gpu {training.frozen_on_gpu}: "
        frozen += held
    else:
        frozen = "VAE and text encoders frozen, outside the step; latents and prompt embeddings "
        frozen += "precomputed: --frozen-on-gpu none"
    est.notes.append(
        f"diffusers {cls}: micro-batch of {what}, {g.text_seq_len} text tokens ({frozen})"
    )
    trained = trained_text_encoders(raw, training)
    if trained:
        est.details["diffusers"]["trained_text_encoders"] = [e.attribute for e in trained]
        how = "LoRA on their q/k/v/out_proj" if training.is_lora else "all their weights"
        est.notes.append(
            f"--train-text-encoder: {', '.join(e.attribute for e in trained)} "
            f"({', '.join(e.model_class for e in trained)}) run on the prompt's "
            f"{g.text_seq_len} token ids inside the step and train ({how}), as diffusers' "
            "DreamBooth scripts do"
        )
    if training.controlnet:
        est.details["diffusers"]["controlnet"] = True
        est.notes.append(controlnet_note(cls, training))


def controlnet_note(cls: str, training: TrainingConfig) -> str:
    """The estimate's line on ``--controlnet`` for a denoiser of class ``cls`` (Note
    [ControlNet training step], Note [FLUX and SD3 ControlNet training steps])."""
    from trainmem.trace.controlnet import SD3_CONTROLNET_LAYERS, flux_controlnet_layers

    dtypes = f"trained in {training.weight_dtype} beside this {{}}, frozen in "
    dtypes += f"{training.compute_dtype} and fed its residuals"
    if cls == "UNet2DConditionModel":
        return (
            f"--controlnet: a ControlNet (ControlNetModel.from_unet) {dtypes.format('UNet')}; "
            "the conditioning image is the batch's pixels (examples/controlnet/"
            "train_controlnet.py)"
        )
    if cls == "FluxTransformer2DModel":
        made = "FluxControlNetModel.from_transformer, {} double- and {} single-stream blocks"
        made = made.format(*flux_controlnet_layers(training))
        script = "train_controlnet_flux.py"
    else:
        made = f"SD3ControlNetModel.from_transformer, {SD3_CONTROLNET_LAYERS} blocks"
        script = "train_controlnet_sd3.py"
    return (
        f"--controlnet: a ControlNet ({made}) {dtypes.format('transformer')}; the "
        "conditioning image enters as VAE latents of the noisy input's shape (examples/"
        f"controlnet/{script}; its VAE encodes are in the step with --frozen-on-gpu vae)"
    )


def estimate_diffusers_trace(
    name: str, training: TrainingConfig, *, gpu: GPUSpec | None = None
) -> MemoryEstimate:
    """Trace one training step of a diffusers model (whole model, fake tensors).

    Args:
        name: a preset name, ``config.json`` path or hub id of a diffusers config.
        training: micro-batch, precision, optimizer, checkpointing, LoRA, ``resolution``,
            ``frames``, ``text_seq_len``.
        gpu: the GPU for the verdict and the cuBLAS workspace size.

    Returns:
        The :class:`~trainmem.breakdown.MemoryEstimate` (``engine="trace"``), with the batch
        geometry in ``details["diffusers"]``.

    Raises:
        UnsupportedError: settings the diffusers trace does not run (parallelism, compile,
            chunked cross-entropy).
        TraceError: the step failed under fake tensors.
    """
    from trainmem.specs.hardware import DEFAULT_CUBLAS_WORKSPACE_BYTES
    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.engine import _estimate, run_trace

    check_diffusers_settings(training)
    raw = load_hf_config(name)
    diffusers_class(raw)  # a class that is not a denoiser is refused before the build
    image_batch(raw, training)
    holder: dict[str, Any] = {}

    from trainmem.trace import controlnet as cn
    from trainmem.trace import text_encoders as te

    def build() -> Any:
        holder["model"] = build_diffusers_model(raw, training)
        if training.controlnet:  # Note [ControlNet training step]
            holder["model"] = cn.build_controlnet_step(raw, holder["model"], training)
        elif training.train_text_encoder:  # Note [Text-encoder training step]
            holder["model"] = te.build_text_encoder_step(raw, holder["model"], training)
        return holder["model"]

    def batch() -> Any:
        if training.controlnet:
            return cn.make_controlnet_batch(holder["model"], training)
        if training.train_text_encoder:
            return te.make_text_batch(holder["model"], training)
        return make_diffusers_batch(holder["model"], training)

    ws = gpu.cublas_workspace_bytes if gpu else DEFAULT_CUBLAS_WORKSPACE_BYTES
    resident = frozen_components(raw, training)
    loss = pipeline_loss(raw, training)
    from trainmem.trace.frozen_encode import encode_in_step

    encode = None if training.train_text_encoder else encode_in_step(raw, training, loss)
    capture, report = run_trace(
        build, batch, training, loss_fn=loss, workspace_bytes=ws, resident=resident,
        forward_loss=encode,  # Note [The frozen VAE encodes inside the step]
    )  # fmt: skip
    est = _estimate(name, capture, report, training, gpu, ws)
    describe_diffusers_batch(est, raw, training)
    return est
