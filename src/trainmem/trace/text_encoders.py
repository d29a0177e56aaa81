"""Text-encoder training (``TrainingConfig.train_text_encoder``): the pipeline's CLIP text
encoders run inside the step on the prompt's token ids and train with the UNet, traced for real
on fake tensors.

Note [Text-encoder training step]
    diffusers v0.42 ``examples/dreambooth/train_dreambooth.py --train_text_encoder`` (SD 1.x):
    ``text_encoder.train()``, its parameters in the optimizer with the UNet's, and each step
    ``encoder_hidden_states = text_encoder(input_ids, attention_mask=None,
    return_dict=False)[0]`` before ``unet(noisy_latents, timesteps, encoder_hidden_states)``.
    ``train_dreambooth_lora_sdxl.py --train_text_encoder`` (SDXL): LoRA adapters on both
    encoders (``LoraConfig(r=rank, use_dora=..., lora_alpha=rank, init_lora_weights=
    "gaussian", target_modules=["q_proj", "k_proj", "v_proj", "out_proj"])``, added with
    ``add_adapter``), and ``encode_prompt``: per encoder ``out = text_encoder(input_ids,
    output_hidden_states=True, return_dict=False)``, the penultimate hidden states
    ``out[-1][-2]`` concatenated over the encoders into ``encoder_hidden_states``, the last
    encoder's projection ``out[0]`` as the ``text_embeds`` condition. The encoders are built by
    transformers from :data:`trainmem.specs.diffusers.TEXT_ENCODERS`: trained whole in the
    weights' dtype (``train_dreambooth.py`` leaves a trained text encoder fp32), or under
    ``lora_rank`` frozen in the compute dtype (``text_encoder.to(dtype=weight_dtype)``) with
    adapters in that dtype (fp32 for fp16: ``cast_training_params``); the batch is the UNet's
    without ``encoder_hidden_states`` (and SDXL's ``text_embeds``), with ``input_ids`` [b,
    text_seq_len] (77 by default).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from trainmem.specs.diffusers import TextEncoder, trained_text_encoders
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = ["TEXT_LORA_MODULES", "TextEncoderStep", "build_text_encoder_step", "make_text_batch"]

TEXT_LORA_MODULES: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "out_proj")
"""``target_modules`` of the scripts' text-encoder LoRA (Note [Text-encoder training step])."""


class TextEncoderStep(torch.nn.Module):  # type: ignore[misc,name-defined]
    """The trained text encoders and the UNet they condition (Note [Text-encoder training
    step]).

    Args:
        encoders: the transformers CLIP text models, in the pipeline's order.
        unet: the diffusers UNet.
        pooled: whether the last encoder's projection is the UNet's ``text_embeds`` (SDXL).
    """

    def __init__(self, encoders: Sequence[Any], unet: Any, *, pooled: bool) -> None:
        super().__init__()
        self.text_encoders = torch.nn.ModuleList(encoders)
        self.unet = unet
        self.pooled = pooled

    def forward(self, input_ids: Any, **batch: Any) -> Any:
        """The UNet's prediction with the encoders' states (``return_dict=False``).

        Args:
            input_ids: [b, t] int64 prompt tokens.
            batch: the UNet's other arguments (``sample``, ``timestep``, SDXL's
                ``added_cond_kwargs`` without ``text_embeds``).
        """
        if not self.pooled:  # train_dreambooth.py encode_prompt
            batch["encoder_hidden_states"] = self.text_encoders[0](
                input_ids, attention_mask=None, return_dict=False
            )[0]
            return self.unet(**batch)
        states, pooled = [], None
        for encoder in self.text_encoders:  # train_dreambooth_lora_sdxl.py encode_prompt
            out = encoder(input_ids, output_hidden_states=True, return_dict=False)
            pooled = out[0]
            states.append(out[-1][-2])
        batch["encoder_hidden_states"] = torch.concat(states, dim=-1)
        batch["added_cond_kwargs"] = {**batch["added_cond_kwargs"], "text_embeds": pooled}
        return self.unet(**batch)


def _build_encoder(encoder: TextEncoder, training: TrainingConfig) -> Any:
    import transformers

    config = transformers.CLIPTextConfig(**encoder.config)
    if not training.dropout:
        config.attention_dropout = config.dropout = 0.0
    with torch.device("meta"):
        model = getattr(transformers, encoder.model_class)(config)
    if not training.is_lora:  # trained whole: fp32 under mixed precision, like the UNet
        model = torch.nn.Module.to(model, getattr(torch, training.weight_dtype))
    else:
        import peft

        # frozen: text_encoder.to(dtype=weight_dtype), the scripts' 16-bit dtype under mixed
        # precision; the adapters take it, fp32 for fp16 (cast_training_params)
        model = torch.nn.Module.to(model, getattr(torch, training.compute_dtype))
        model.requires_grad_(False)
        from trainmem.trace.lora import adapter_config, lokr_module_dropout_off

        gaussian = (
            {} if training.lora_variant in ("lokr", "loha") else {"init_lora_weights": "gaussian"}
        )
        lora = adapter_config(
            training, list(TEXT_LORA_MODULES), lora_alpha=training.lora_rank, **gaussian
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            model = peft.inject_adapter_in_model(lora, model)
        lokr_module_dropout_off(model)
        adapters = getattr(torch, "float32" if training.compute_dtype == "float16" else
                           training.compute_dtype)  # fmt: skip
        for p in model.parameters():
            if p.requires_grad:
                p.data = p.data.to(adapters)
    model.train()
    return model


def build_text_encoder_step(
    raw_config: Mapping[str, Any], unet: Any, training: TrainingConfig
) -> Any:
    """The pipeline's text encoders built for training beside ``unet`` (Note [Text-encoder
    training step]).

    Args:
        raw_config: the UNet's diffusers ``config.json``.
        unet: the UNet as :func:`~trainmem.trace.diffusers_model.build_diffusers_model` builds
            it (trainable, or with LoRA adapters).
        training: ``train_text_encoder`` set; precision, LoRA, dropout.

    Returns:
        A :class:`TextEncoderStep` in train mode, on ``meta``.

    Raises:
        SpecError: not an SD 1.x / SDXL UNet
            (:func:`~trainmem.specs.diffusers.trained_text_encoders`).
    """
    encoders = trained_text_encoders(raw_config, training)
    built = [_build_encoder(e, training) for e in encoders]
    step = TextEncoderStep(built, unet, pooled=len(encoders) > 1)
    step.train()
    return step


def make_text_batch(step: Any, training: TrainingConfig) -> dict[str, Any]:
    """The UNet's micro-batch (:func:`~trainmem.trace.diffusers_inputs.forward_inputs`) with
    ``input_ids`` [b, text tokens] int64 in place of the prompt embeddings; call inside the
    fake mode."""
    from trainmem.specs.diffusers import image_batch
    from trainmem.trace.diffusers_inputs import forward_inputs

    batch = forward_inputs(step.unet, training)
    batch.pop("encoder_hidden_states", None)
    if step.pooled:
        batch["added_cond_kwargs"] = {
            k: v for k, v in batch["added_cond_kwargs"].items() if k != "text_embeds"
        }
    tokens = image_batch(dict(step.unet.config), training).text_seq_len
    vocab = int(step.text_encoders[0].config.vocab_size)
    batch["input_ids"] = torch.randint(0, vocab, (training.micro_batch_size, tokens))
    return batch
