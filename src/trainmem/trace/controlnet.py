"""A ControlNet trained beside its frozen UNet (``TrainingConfig.controlnet``), as diffusers'
example scripts train it, traced for real on fake tensors.

Note [ControlNet training step]
    diffusers v0.42 ``examples/controlnet/train_controlnet.py`` (and ``_sdxl.py``) without
    ``--controlnet_model_name_or_path``: ``controlnet = ControlNetModel.from_unet(unet)``;
    ``unet.requires_grad_(False)`` and ``unet.to(device, dtype=weight_dtype)`` (fp16 / bf16
    under mixed precision, fp32 otherwise), the ControlNet left in fp32 and trained
    (``controlnet.train()``, its parameters to the optimizer). Each step::

        down, mid = controlnet(noisy_latents, timesteps, encoder_hidden_states=...,
                               controlnet_cond=controlnet_image, return_dict=False)
        model_pred = unet(noisy_latents, timesteps, encoder_hidden_states=...,
                          down_block_additional_residuals=[s.to(dtype=weight_dtype)
                                                           for s in down],
                          mid_block_additional_residual=mid.to(dtype=weight_dtype),
                          return_dict=False)[0]
        loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")

    with ``controlnet_image = batch["conditioning_pixel_values"].to(dtype=weight_dtype)``,
    [b, 3, height, width] pixels (the SDXL script adds ``added_cond_kwargs`` to both calls).
    Here the UNet is built by :func:`~trainmem.trace.diffusers_model.build_diffusers_model`
    and cast to the compute dtype, the ControlNet by ``from_unet(unet,
    load_weights_from_unet=False)`` on ``meta`` (no weights to copy) in the weights' dtype, and
    :class:`ControlNetStep` runs the two calls above; the UNet's activations that the
    ControlNet's gradient needs are saved by autograd as in the script (the residuals enter
    the UNet's skip connections). The VAE and text encoders are ``--frozen-on-gpu``'s.

Note [FLUX and SD3 ControlNet training steps]
    diffusers v0.40 ``examples/controlnet/train_controlnet_flux.py`` without
    ``--controlnet_model_name_or_path``: ``FluxControlNetModel.from_transformer(
    flux_transformer, attention_head_dim=..., num_attention_heads=... (the transformer's),
    num_layers=args.num_double_layers, num_single_layers=args.num_single_layers)``, both
    flags 4 by default (:data:`FLUX_CONTROLNET_LAYERS`; ``controlnet_double_layers`` /
    ``controlnet_single_layers`` set them); ``train_controlnet_sd3.py``:
    ``SD3ControlNetModel.from_transformer(transformer, num_extra_conditioning_channels=
    args.num_extra_conditioning_channels)`` (the flag 0, ``num_layers`` the method's 12:
    :data:`SD3_CONTROLNET_LAYERS`). The transformer and the VAE are frozen and moved with
    ``.to(accelerator.device, dtype=weight_dtype)``, the ControlNet left in fp32 and trained.
    Each step (FLUX; SD3 the same with ``block_controlnet_hidden_states``)::

        control_latents = vae.encode(conditioning_pixel_values).latent_dist.sample() ...
        block, single = flux_controlnet(hidden_states=noisy_model_input,
                                        controlnet_cond=control_image, ..., return_dict=False)
        noise_pred = flux_transformer(hidden_states=noisy_model_input, ...,
            controlnet_block_samples=[s.to(dtype=weight_dtype) for s in block],
            controlnet_single_block_samples=[s.to(dtype=weight_dtype) for s in single],
            return_dict=False)[0]

    The conditioning image enters as VAE latents (FLUX: packed 2x2 like the noisy input, SD3:
    [b, 16, h, w]), so ``controlnet_cond`` has the shape and dtype of the transformer's
    ``hidden_states``; both scripts encode it with the VAE inside the step, a second encode
    beside the pixels' when the VAE is kept on the GPU (``--frozen-on-gpu vae``; Note [The
    frozen VAE encodes inside the step]; the text encoders' prompt embeddings are precomputed
    and the encoders moved to the CPU / deleted, ``--frozen-on-gpu vae`` is the scripts'
    setting). Here :class:`TransformerControlNetStep` runs the two calls; the ControlNet is
    built by ``from_transformer(..., load_weights_from_transformer=False)`` on ``meta`` in the
    weights' dtype. Not modelled: ``--num_extra_conditioning_channels`` other than 0, a union
    ControlNet
    (``num_mode``) or one with an ``input_hint_block`` (``conditioning_embedding_channels``).
"""

from __future__ import annotations

import inspect
import types
import warnings
from collections.abc import Mapping
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs.diffusers import check_controlnet, image_batch
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = [
    "FLUX_CONTROLNET_LAYERS",
    "SD3_CONTROLNET_LAYERS",
    "ControlNetStep",
    "TransformerControlNetStep",
    "build_controlnet_step",
    "flux_controlnet_layers",
    "make_controlnet_batch",
]

FLUX_CONTROLNET_LAYERS = (4, 4)
"""(double-stream, single-stream) blocks of a FLUX ControlNet: ``train_controlnet_flux.py``'s
``--num_double_layers`` / ``--num_single_layers`` defaults (diffusers v0.40)."""
SD3_CONTROLNET_LAYERS = 12
"""Joint blocks of an SD3 ControlNet: ``SD3ControlNetModel.from_transformer``'s ``num_layers``
default, which ``train_controlnet_sd3.py`` does not pass (diffusers v0.40)."""


class ControlNetStep(torch.nn.Module):  # type: ignore[misc,name-defined]
    """The trained ControlNet and the frozen UNet it feeds, called as the training scripts do
    (Note [ControlNet training step]).

    Args:
        unet: the frozen ``UNet2DConditionModel`` (in the compute dtype).
        controlnet: the trained ``ControlNetModel``.
    """

    def __init__(self, unet: Any, controlnet: Any) -> None:
        super().__init__()
        self.unet = unet
        self.controlnet = controlnet

    def forward(
        self,
        sample: Any,
        timestep: Any,
        encoder_hidden_states: Any,
        controlnet_cond: Any,
        added_cond_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        """``model_pred`` of the UNet given the ControlNet's residuals, as a 1-tuple.

        Args:
            sample: noisy latents [b, c, h, w] in the UNet's dtype.
            timestep: [b] int64.
            encoder_hidden_states: [b, text tokens, cross_attention_dim].
            controlnet_cond: the conditioning image [b, 3, 8h, 8w].
            added_cond_kwargs: SDXL's ``text_embeds`` / ``time_ids``.
            kwargs: any other UNet argument of the batch.
        """
        extra = {"added_cond_kwargs": added_cond_kwargs} if added_cond_kwargs else {}
        kwargs.pop("return_dict", None)  # the scripts' return_dict=False, below
        down, mid = self.controlnet(
            sample,
            timestep,
            encoder_hidden_states=encoder_hidden_states,
            controlnet_cond=controlnet_cond,
            return_dict=False,
            **extra,
        )
        dtype = self.unet.dtype
        return self.unet(
            sample,
            timestep,
            encoder_hidden_states=encoder_hidden_states,
            down_block_additional_residuals=[s.to(dtype=dtype) for s in down],
            mid_block_additional_residual=mid.to(dtype=dtype),
            return_dict=False,
            **extra,
            **kwargs,
        )


class TransformerControlNetStep(torch.nn.Module):  # type: ignore[misc,name-defined]
    """The trained FLUX / SD3 ControlNet and the frozen transformer it feeds, called as
    ``train_controlnet_flux.py`` / ``train_controlnet_sd3.py`` do (Note [FLUX and SD3
    ControlNet training steps]).

    Args:
        transformer: the frozen ``FluxTransformer2DModel`` / ``SD3Transformer2DModel`` (in the
            compute dtype).
        controlnet: the trained ``FluxControlNetModel`` / ``SD3ControlNetModel``.
    """

    def __init__(self, transformer: Any, controlnet: Any) -> None:
        super().__init__()
        self.transformer = transformer
        self.controlnet = controlnet
        params = inspect.signature(type(controlnet).forward).parameters
        self._to_controlnet = frozenset(params) - {"self", "return_dict"}

    def forward(self, controlnet_cond: Any, **kwargs: Any) -> Any:
        """The transformer's prediction given the ControlNet's residuals, as a 1-tuple.

        Args:
            controlnet_cond: the conditioning image's latents (the shape and dtype of
                ``hidden_states``).
            kwargs: the transformer's inputs (:func:`~trainmem.trace.diffusers_inputs.
                forward_inputs`); those the ControlNet's forward names go to it too.
        """
        kwargs.pop("return_dict", None)  # the scripts' return_dict=False, below
        shared = {k: v for k, v in kwargs.items() if k in self._to_controlnet}
        out = self.controlnet(controlnet_cond=controlnet_cond, return_dict=False, **shared)
        dtype = self.transformer.dtype
        if len(out) == 2:  # FLUX: double- and single-stream residuals
            block, single = out
            residuals = {
                "controlnet_block_samples": _cast(block, dtype),
                "controlnet_single_block_samples": _cast(single, dtype),
            }
        else:  # SD3
            residuals = {"block_controlnet_hidden_states": _cast(out[0], dtype)}
        return self.transformer(**kwargs, **residuals, return_dict=False)


def flux_controlnet_layers(training: TrainingConfig) -> tuple[int, int]:
    """(double-stream, single-stream) blocks of the FLUX ControlNet: the settings
    (``controlnet_double_layers`` / ``controlnet_single_layers``), else
    :data:`FLUX_CONTROLNET_LAYERS`."""
    double, single = FLUX_CONTROLNET_LAYERS
    if training.controlnet_double_layers is not None:
        double = training.controlnet_double_layers
    if training.controlnet_single_layers is not None:
        single = training.controlnet_single_layers
    return double, single


def _cast(samples: Any, dtype: Any) -> Any:
    """The scripts' ``[sample.to(dtype=weight_dtype) for sample in ...]`` (None stays)."""
    return None if samples is None else [t.to(dtype=dtype) for t in samples]


def _transformer_controlnet(transformer: Any, training: TrainingConfig) -> Any:
    """The FLUX / SD3 ControlNet the scripts make from ``transformer`` (Note [FLUX and SD3
    ControlNet training steps]), on ``meta``, no weights copied."""
    import diffusers

    if type(transformer).__name__ == "FluxTransformer2DModel":
        double, single = flux_controlnet_layers(training)
        return diffusers.FluxControlNetModel.from_transformer(
            transformer,
            attention_head_dim=transformer.config["attention_head_dim"],
            num_attention_heads=transformer.config["num_attention_heads"],
            num_layers=double,
            num_single_layers=single,
            load_weights_from_transformer=False,
        )
    from diffusers.configuration_utils import FrozenDict

    # from_transformer writes num_layers into the config it is given: a copy (no weights read)
    copy = types.SimpleNamespace(config=FrozenDict(transformer.config))
    return diffusers.SD3ControlNetModel.from_transformer(
        copy,
        num_layers=SD3_CONTROLNET_LAYERS,
        num_extra_conditioning_channels=0,
        load_weights_from_transformer=False,
    )


def build_controlnet_step(
    raw_config: Mapping[str, Any], unet: Any, training: TrainingConfig
) -> Any:
    """``unet`` frozen in the compute dtype and a ControlNet made from it in the weights'
    dtype, as one module (Note [ControlNet training step]; a FLUX / SD3 transformer: Note
    [FLUX and SD3 ControlNet training steps]).

    Args:
        raw_config: the denoiser's diffusers ``config.json`` (a ``UNet2DConditionModel``,
            ``FluxTransformer2DModel`` or ``SD3Transformer2DModel``).
        unet: that denoiser as :func:`~trainmem.trace.diffusers_model.build_diffusers_model`
            builds it (on ``meta``).
        training: ``controlnet`` set; precision.

    Returns:
        A :class:`ControlNetStep` / :class:`TransformerControlNetStep` in train mode, on
        ``meta``.

    Raises:
        SpecError: another class, or with LoRA
            (:func:`~trainmem.specs.diffusers.check_controlnet`).
        UnsupportedError: diffusers cannot build the ControlNet from this denoiser.
    """
    import diffusers

    check_controlnet(raw_config, training)
    unet = torch.nn.Module.to(unet, getattr(torch, training.compute_dtype))
    unet.requires_grad_(False)
    transformer = str(raw_config.get("_class_name")) != "UNet2DConditionModel"
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore", FutureWarning)
        try:
            if transformer:
                controlnet = _transformer_controlnet(unet, training)
            else:
                controlnet = diffusers.ControlNetModel.from_unet(unet, load_weights_from_unet=False)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            reason = " ".join(str(exc).split())[:200]
            raise UnsupportedError(
                f"diffusers {diffusers.__version__} cannot make a ControlNet from this "
                f"{'transformer' if transformer else 'UNet'} "
                f"({type(exc).__name__}: {reason})"
            ) from exc
    controlnet = torch.nn.Module.to(controlnet, getattr(torch, training.weight_dtype))
    if training.attention == "eager":  # as the denoiser's (Note [diffusers' eager attention])
        from trainmem.trace.diffusers_eager import use_eager_attention

        use_eager_attention(controlnet)
    step = (TransformerControlNetStep if transformer else ControlNetStep)(unet, controlnet)
    step.train()
    return step


def make_controlnet_batch(step: Any, training: TrainingConfig) -> dict[str, Any]:
    """The UNet's micro-batch (:func:`~trainmem.trace.diffusers_inputs.forward_inputs`) and
    the conditioning image ``controlnet_cond`` [b, conditioning_channels, height, width] in the
    UNet's dtype (the scripts' ``conditioning_pixel_values.to(dtype=weight_dtype)``); call
    inside the fake mode. A FLUX / SD3 step's: the transformer's micro-batch and the
    conditioning image's latents, of ``hidden_states``' shape and dtype (Note [FLUX and SD3
    ControlNet training steps])."""
    from trainmem.trace.diffusers_inputs import forward_inputs

    if isinstance(step, TransformerControlNetStep):
        batch = forward_inputs(step.transformer, training)
        batch["controlnet_cond"] = torch.randn_like(batch["hidden_states"])
        return batch
    batch = forward_inputs(step.unet, training)
    g = image_batch(dict(step.unet.config), training)
    channels = int(step.controlnet.config.conditioning_channels)
    batch["controlnet_cond"] = torch.randn(
        training.micro_batch_size, channels, g.height, g.width, dtype=step.unet.dtype
    )
    return batch
