"""The frozen VAE's encode inside a diffusers training step (issue 26, helper vaeenc).

Note [The frozen VAE encodes inside the step]
    Without cached latents the training scripts encode each batch's pixels with the frozen VAE
    at the top of the step, before the denoiser's forward: finetrainers (e5df80c, Jan 2025)
    ``finetrainers/trainer.py`` ``train`` (``if not self.args.precompute_conditions``:
    ``prepare_latents(vae=self.vae, image_or_video=videos, ...)``, which in
    ``finetrainers/ltx_video/ltx_video_lora.py`` moves the clip to the VAE's dtype, permutes it
    to ``[B, C, F, H, W]`` and runs ``vae.encode(...).latent_dist.sample(generator)``), diffusers
    (v0.42) ``examples/dreambooth/train_dreambooth_lora_flux.py`` / ``_sdxl.py`` /
    ``examples/text_to_image/train_text_to_image*.py`` without ``--cache_latents``
    (``vae.encode(pixel_values).latent_dist.sample()``). The VAE is frozen
    (``requires_grad_(False)``), so the encode keeps no graph: its activations are transients,
    freed as its forward goes, and its output, the latents, stays bound through the step.

    Traced here when ``frozen_on_gpu`` keeps the VAE on the GPU (``vae`` / ``all``: the
    setting already says the latents are not precomputed; ``none`` is the scripts'
    ``--cache_latents`` / precomputation): the pipeline's own diffusers class
    (:attr:`trainmem.specs.diffusers.FrozenComponent.build`) on fake tensors of its dtype,
    under ``no_grad`` and outside autocast (the scripts call it outside
    ``accelerator.autocast``; its weights and input are in its dtype), on one micro-batch of
    pixels at the resolution (and frames) of the run, made inside the step and freed after the
    encode; ``latent_dist.sample()`` is kept until the next micro-batch's encode (the loop's
    binding). Its weights are ``frozen_on_gpu``'s resident tensor (not counted again: the
    module's fake weights are made before the recorded step). So the encode's transient peak
    sits in the one step schedule at the forward's start, above the weights, optimizer states
    and inputs, and its latents below the denoiser's forward. Untiled, unsliced: the scripts'
    default (finetrainers ``--enable_tiling`` / ``--enable_slicing`` off). The text encoders'
    forwards on the prompt (a few MB at 128-256 tokens) are not traced.

    A ControlNet step (``--controlnet``) encodes too: ``train_controlnet.py`` the pixels
    (``vae.encode(batch["pixel_values"].to(dtype=weight_dtype))``, its conditioning image
    stays pixels), ``train_controlnet_flux.py`` / ``train_controlnet_sd3.py`` the pixels and
    then the conditioning image (``control_latents = vae.encode(control_values)...``), the
    first latents bound while the second encode runs (diffusers v0.40; Note [FLUX and SD3
    ControlNet training steps]): two encodes, both latents kept to the next micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from trainmem.specs.diffusers import diffusers_class, image_batch, kept_components
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch
from trainmem.trace.step import forward_and_loss

torch = require_torch()

__all__ = ["encode_in_step"]


def _build_vae(cls_name: str, kwargs: Mapping[str, Any], dtype: Any) -> Any:
    """The VAE on ``meta``, then fake tensors of the active fake mode (the step's)."""
    import diffusers

    with torch.device("meta"):
        vae = getattr(diffusers, cls_name)(**kwargs)
    vae.eval()
    for m in vae.modules():
        for group in (m._parameters, m._buffers):
            for n, t in list(group.items()):
                if t is not None:  # ``.to(dtype)``: floating tensors in the VAE's dtype
                    d = dtype if t.is_floating_point() else t.dtype
                    e = torch.empty_strided(t.shape, t.stride(), dtype=d, device="cpu")
                    group[n] = torch.nn.Parameter(e, False) if n in m._parameters else e
    return vae


def encode_in_step(
    raw: Mapping[str, Any],
    training: TrainingConfig,
    loss_fn: Callable[[Any, Any], Any] | None,
) -> Callable[[Any, Any], Any] | None:
    """The step's forward + loss with the frozen VAE's encode (two for a FLUX / SD3
    ControlNet's step) before the denoiser's forward (Note [The frozen VAE encodes inside the
    step]), or None when the VAE is not kept on the GPU.

    Args:
        raw: the denoiser's diffusers ``config.json``.
        training: resolution, frames, micro-batch, ``frozen_on_gpu``.
        loss_fn: the denoiser's loss (``forward_and_loss``'s).

    Returns:
        ``forward_loss(model, batch)`` for :func:`trainmem.trace.engine.run_trace`, or None.
    """
    vae = next((c for c in kept_components(raw, training) if c.build is not None), None)
    if vae is None or vae.build is None:
        return None
    cls_name, kwargs = vae.build
    g = image_batch(raw, training)
    frames = (g.frames,) if g.frames else ()
    shape = (training.micro_batch_size, int(kwargs.get("in_channels", 3)), *frames)
    shape += (g.height, g.width)
    dtype = getattr(torch, vae.dtype or training.compute_dtype)
    built: dict[str, Any] = {}

    def encode() -> Any:
        mode = torch._guards.detect_fake_mode()  # one module per traced step's fake mode
        if built.get("mode", object()) is not mode:
            built.update(mode=mode, vae=_build_vae(cls_name, kwargs, dtype))
        with torch.autocast("cpu", enabled=False), torch.no_grad():  # (the trace's autocast)
            pixels = torch.empty(shape, dtype=dtype)
            return built["vae"].encode(pixels).latent_dist.sample()

    held: list[Any] = []
    # the pixels, and a FLUX / SD3 ControlNet's conditioning image
    encodes = 2 if training.controlnet and diffusers_class(raw) != "UNet2DConditionModel" else 1

    def forward_loss(model: Any, batch: Any) -> Any:
        held.clear()  # the previous micro-batch's latents, rebound by the loop
        for _ in range(encodes):
            held.append(encode())
        return forward_and_loss(model, batch, loss_fn)

    return forward_loss
