"""Pipeline parallelism of a diffusers denoiser: what it feeds torch's pipeline frontend.

Note [Tracing pipeline parallelism of a denoiser]
    A denoiser's blocks take more than the residual stream (the projected caption, the adaLN
    timestep embedding, rotary tables) and its output layers read tensors made before the
    blocks (PixArt's and FLUX's embedded timestep), so no fixed boundary fits every class: the
    stages are cut by torch's pipeline frontend (Note [Pipeline stages cut by torch's
    frontend], trainmem/trace/frontend_pipeline.py). The blocks are the model's repeated
    blocks in model order (:func:`trainmem.trace.lora.wrapped_blocks`, ``"compile"``:
    ``_repeated_blocks``, else the longest block list; FLUX's double- then single-stream
    blocks). The first stage holds the patch embedding, timestep and caption embedders, the
    last norm_out and proj_out. The inputs are the forward's arguments
    (:func:`~trainmem.trace.diffusers_model.make_diffusers_batch`) with ``return_dict=False``;
    tensors without a batch dimension (FLUX's ``img_ids`` / ``txt_ids``) are replicated to
    every micro-batch; the loss is the class's diffusers training loss on the last stage's
    prediction, the noisy latents' stand-in target (``sample`` / ``hidden_states``) chunked
    with the inputs. No diffusers or accelerate training script pipelines a denoiser; this is
    what torch's pipelining runs on one, the split any class gets.

    Refused beside it besides the frontend's own refusals: a ControlNet or text-encoder step
    and frozen components kept on the GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainmem.specs.training import TrainingConfig
from trainmem.trace.frontend_pipeline import FrontendInputs

__all__ = ["denoiser_inputs"]


def denoiser_inputs(recipe: Any) -> FrontendInputs:
    """How a denoiser is fed to torch's pipeline frontend (Note [Tracing pipeline parallelism
    of a denoiser]).

    Args:
        recipe: the generic path's diffusers recipe (its loss, its frozen components).

    Returns:
        The :class:`~trainmem.trace.frontend_pipeline.FrontendInputs`.
    """
    from trainmem.trace.diffusers_model import make_diffusers_batch
    from trainmem.trace.lora import wrapped_blocks

    def beside(t: TrainingConfig) -> list[tuple[str, bool]]:
        return [
            ("controlnet", t.controlnet),
            ("train_text_encoder", t.train_text_encoder),
            (f"frozen_on_gpu={t.frozen_on_gpu}", bool(recipe.resident)),
        ]

    def target_key(batch: Mapping[str, Any]) -> str:
        return "sample" if "sample" in batch else "hidden_states"

    return FrontendInputs(
        kind="a diffusers model",
        blocks=lambda model: wrapped_blocks(model, "compile"),
        make_batch=make_diffusers_batch,
        forward_kwargs=lambda batch: {**batch, "return_dict": False},
        target_key=target_key,
        loss_fn=recipe.loss_fn,
        beside=beside,
    )
