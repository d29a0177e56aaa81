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
    default (finetrainers ``--enable_tiling`` / ``--enable_slicing`` off). With ``vae_tiling``
    the VAE's ``enable_tiling()`` is called after the build (finetrainers ``--enable_tiling``:
    ``vae.enable_tiling()`` in its model loaders), and the trace runs diffusers' own tiled path
    (diffusers 0.42.1 ``AutoencoderKL._encode``: an image wider or taller than
    ``tile_sample_min_size``, the VAE config's ``sample_size``, goes through
    ``_tiled_encode``: tiles of that size every ``0.75 x`` of it, each through ``encoder`` and
    ``quant_conv``, every tile's moments kept, then blended (``blend_v`` / ``blend_h``) and
    concatenated), so the encode's transient peak is one tile's encoder activations beside the
    tiles' moments instead of the whole image's activations; an image within one tile encodes
    as before. The text encoders' forwards: Note [The frozen text encoders encode inside the
    step].

    A ControlNet step (``--controlnet``) encodes too: ``train_controlnet.py`` the pixels
    (``vae.encode(batch["pixel_values"].to(dtype=weight_dtype))``, its conditioning image
    stays pixels), ``train_controlnet_flux.py`` / ``train_controlnet_sd3.py`` the pixels and
    then the conditioning image (``control_latents = vae.encode(control_values)...``), the
    first latents bound while the second encode runs (diffusers v0.40; Note [FLUX and SD3
    ControlNet training steps]): two encodes, both latents kept to the next micro-batch.

Note [The frozen text encoders encode inside the step]
    A text encoder kept on the GPU (``frozen_on_gpu`` ``text-encoders`` / ``all``) encodes
    each batch's prompts at the top of the step: diffusers v0.40
    ``examples/dreambooth/train_dreambooth_lora_flux.py`` keeps its encoders only with
    per-image captions (``custom_instance_prompts``; otherwise it encodes the one instance
    prompt before training and deletes them), and then calls ``compute_text_embeddings(
    prompts, text_encoders, tokenizers)`` under ``torch.no_grad()`` each step before the VAE's
    encode (``_encode_prompt_with_clip``: ``text_encoder(ids, output_hidden_states=False)``'s
    pooled output on 77 tokens; ``_encode_prompt_with_t5``: ``text_encoder(ids)[0]`` on
    ``--max_sequence_length`` tokens); ``train_dreambooth_lora_sd3.py`` /
    ``_sdxl.py`` the same (CLIP's 77, SD3's T5 on ``text_seq_len - 77``: the
    ``after-clip`` tokens of :data:`trainmem.specs.diffusers.PROMPT_TOKENS`). Traced here for
    every kept encoder with a config (:attr:`trainmem.specs.diffusers.FrozenComponent.text`:
    CLIP-L, bigG, T5-XXL), in the pipeline's order, each built by transformers on fake
    tensors of its dtype (its weights are ``frozen_on_gpu``'s resident tensors, not counted
    again), under ``no_grad`` outside autocast, on [micro-batch, tokens] int64 ids; its
    output (last hidden states, the pooled / projected embedding) is kept to the next
    micro-batch as the loop binds ``prompt_embeds`` / ``pooled_prompt_embeds``. Not traced:
    SD3's / SDXL's ``output_hidden_states=True`` (every layer's states live until the
    penultimate is taken; 77 tokens each), Wan's umT5 and HunyuanVideo's Llama (no config
    here), ``--controlnet`` (its scripts precompute the embeddings and move the encoders to the
    CPU) and ``train_text_encoder`` (Note [Text-encoder training step]).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

from trainmem.specs.diffusers import diffusers_class, image_batch, kept_components
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch
from trainmem.trace.step import forward_and_loss

torch = require_torch()

__all__ = ["encode_in_step"]


def _build_vae(cls_name: str, kwargs: Mapping[str, Any], dtype: Any, tiling: bool = False) -> Any:
    """The VAE on ``meta``, then fake tensors of the active fake mode (the step's); with
    ``tiling``, ``vae.enable_tiling()`` (Note [The frozen VAE encodes inside the step])."""
    import diffusers

    with torch.device("meta"):
        vae = getattr(diffusers, cls_name)(**kwargs)
    _fake_in_dtype(vae, dtype)
    if tiling:
        vae.enable_tiling()
    return vae


def _fake_in_dtype(model: Any, dtype: Any) -> None:
    """``model``'s tensors as tensors of the active fake mode, the floating ones in ``dtype``
    (the scripts' ``.to(dtype)``), frozen, in eval mode."""
    model.eval()
    for m in model.modules():
        for group in (m._parameters, m._buffers):
            for n, t in list(group.items()):
                if t is not None:
                    d = dtype if t.is_floating_point() else t.dtype
                    e = torch.empty_strided(t.shape, t.stride(), dtype=d, device="cpu")
                    group[n] = torch.nn.Parameter(e, False) if n in m._parameters else e


def _build_text_encoder(cls_name: str, kwargs: Mapping[str, Any], dtype: Any) -> Any:
    """A transformers text encoder on ``meta``, then fake tensors of the active fake mode."""
    import transformers

    model_cls = getattr(transformers, cls_name)
    config_cls = transformers.T5Config if cls_name.startswith("T5") else transformers.CLIPTextConfig
    with torch.device("meta"):
        model = model_cls(config_cls(**kwargs))
    _fake_in_dtype(model, dtype)
    return model


def _text_tokens(rule: str, text_seq_len: int) -> int:
    """The prompt tokens an encoder reads (:data:`trainmem.specs.diffusers.PROMPT_TOKENS`)."""
    from trainmem.specs.diffusers import TEXT_ENCODER_MAX_TOKENS as clip

    if rule == "clip":
        return min(clip, text_seq_len)
    if rule == "after-clip":
        return max(text_seq_len - clip, 1)
    return text_seq_len


def _vae_call(vae: Any, shape: Any, dtype: Any) -> Any:
    """``vae.encode(pixels).latent_dist.sample()`` on pixels made inside the step."""
    return vae.encode(torch.empty(shape, dtype=dtype)).latent_dist.sample()


def _text_call(encoder: Any, shape: Any, dtype: Any) -> Any:
    """``text_encoder(ids)``'s output (hidden states, the pooled / projected embedding) on
    token ids made inside the step."""
    out = encoder(torch.zeros(shape, dtype=dtype), output_hidden_states=False)
    return tuple(t for t in out.values() if isinstance(t, torch.Tensor))


def encode_in_step(
    raw: Mapping[str, Any],
    training: TrainingConfig,
    loss_fn: Callable[[Any, Any], Any] | None,
) -> Callable[[Any, Any], Any] | None:
    """The step's forward + loss with the frozen text encoders' forwards (Note [The frozen
    text encoders encode inside the step]) and the frozen VAE's encode (two for a FLUX / SD3
    ControlNet's step) before the denoiser's forward (Note [The frozen VAE encodes inside the
    step]), or None when neither is kept on the GPU.

    Args:
        raw: the denoiser's diffusers ``config.json``.
        training: resolution, frames, micro-batch, ``frozen_on_gpu``.
        loss_fn: the denoiser's loss (``forward_and_loss``'s).

    Returns:
        ``forward_loss(model, batch)`` for :func:`trainmem.trace.engine.run_trace`, or None.
    """
    kept = kept_components(raw, training)
    g = image_batch(raw, training)
    b = training.micro_batch_size
    # (name, build, input shape, input dtype, call) per encode, in the step's order
    calls: list[tuple[str, Callable[[], Any], tuple[int, ...], Any, Any]] = []
    if not training.controlnet:  # Note [The frozen text encoders encode inside the step]
        for c in kept:
            if c.text is None:
                continue
            cls_name, kwargs, rule = c.text
            dtype = getattr(torch, c.dtype or training.compute_dtype)
            ids = (b, _text_tokens(rule, g.text_seq_len))
            make = functools.partial(_build_text_encoder, cls_name, kwargs, dtype)
            calls.append((c.attribute, make, ids, torch.int64, _text_call))
    vae = next((c for c in kept if c.build is not None), None)
    if vae is not None and vae.build is not None:
        cls_name, vae_kwargs = vae.build
        frames = (g.frames,) if g.frames else ()
        shape = (b, int(vae_kwargs.get("in_channels", 3)), *frames, g.height, g.width)
        dtype = getattr(torch, vae.dtype or training.compute_dtype)
        make = functools.partial(_build_vae, cls_name, vae_kwargs, dtype, training.vae_tiling)
        # the pixels, and a FLUX / SD3 ControlNet's conditioning image
        n = 2 if training.controlnet and diffusers_class(raw) != "UNet2DConditionModel" else 1
        calls += [(vae.attribute, make, shape, dtype, _vae_call)] * n
    if not calls:
        return None
    built: dict[str, Any] = {}

    def encode(name: str, make: Callable[[], Any], shape: Any, dtype: Any, call: Any) -> Any:
        mode = torch._guards.detect_fake_mode()  # one module per traced step's fake mode
        if built.get("mode", object()) is not mode:
            built.clear()
            built["mode"] = mode
        if name not in built:
            built[name] = make()
        with torch.autocast("cpu", enabled=False), torch.no_grad():  # (the trace's autocast)
            return call(built[name], shape, dtype)

    held: list[Any] = []

    def forward_loss(model: Any, batch: Any) -> Any:
        held.clear()  # the previous micro-batch's embeddings and latents, rebound by the loop
        for args in calls:
            held.append(encode(*args))
        return forward_and_loss(model, batch, loss_fn)

    return forward_loss
