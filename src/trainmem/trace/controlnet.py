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
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.specs.diffusers import check_controlnet, image_batch
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["ControlNetStep", "build_controlnet_step", "make_controlnet_batch"]


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


def build_controlnet_step(
    raw_config: Mapping[str, Any], unet: Any, training: TrainingConfig
) -> Any:
    """``unet`` frozen in the compute dtype and a ControlNet made from it in the weights'
    dtype, as one module (Note [ControlNet training step]).

    Args:
        raw_config: the UNet's diffusers ``config.json`` (a ``UNet2DConditionModel``).
        unet: that UNet as :func:`~trainmem.trace.diffusers_model.build_diffusers_model`
            builds it (on ``meta``).
        training: ``controlnet`` set; precision.

    Returns:
        A :class:`ControlNetStep` in train mode, on ``meta``.

    Raises:
        SpecError: not a UNet, or with LoRA (:func:`~trainmem.specs.diffusers.check_controlnet`).
        UnsupportedError: diffusers cannot build the ControlNet from this UNet.
    """
    import diffusers

    check_controlnet(raw_config, training)
    unet = torch.nn.Module.to(unet, getattr(torch, training.compute_dtype))
    unet.requires_grad_(False)
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore", FutureWarning)
        try:
            controlnet = diffusers.ControlNetModel.from_unet(unet, load_weights_from_unet=False)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            reason = " ".join(str(exc).split())[:200]
            raise UnsupportedError(
                f"diffusers {diffusers.__version__} cannot make a ControlNet from this UNet "
                f"({type(exc).__name__}: {reason})"
            ) from exc
    controlnet = torch.nn.Module.to(controlnet, getattr(torch, training.weight_dtype))
    step = ControlNetStep(unet, controlnet)
    step.train()
    return step


def make_controlnet_batch(step: Any, training: TrainingConfig) -> dict[str, Any]:
    """The UNet's micro-batch (:func:`~trainmem.trace.diffusers_inputs.forward_inputs`) and
    the conditioning image ``controlnet_cond`` [b, conditioning_channels, height, width] in the
    UNet's dtype (the scripts' ``conditioning_pixel_values.to(dtype=weight_dtype)``); call
    inside the fake mode."""
    from trainmem.trace.diffusers_inputs import forward_inputs

    batch = forward_inputs(step.unet, training)
    g = image_batch(dict(step.unet.config), training)
    channels = int(step.controlnet.config.conditioning_channels)
    batch["controlnet_cond"] = torch.randn(
        training.micro_batch_size, channels, g.height, g.width, dtype=step.unet.dtype
    )
    return batch
