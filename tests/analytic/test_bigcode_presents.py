"""GPT-BigCode's returned presents under activation checkpointing (transformers < 4.54): each
layer's ``present`` is a view of its whole ``c_attn`` output, kept in the model's
``past_key_values`` until the output is dropped after the loss.

Source: transformers 4.48.1 modeling_gpt_bigcode.py ``GPTBigCodeAttention.forward`` (``query,
key_value = self.c_attn(hidden_states).split((self.embed_dim, 2 * self.kv_dim), dim=2)``,
``present = key_value if use_cache else None``) and ``GPTBigCodeModel.forward``
(``presents.append(outputs[1])`` for the checkpointed blocks too); 4.54.0 stores copies in an
``EncoderDecoderCache``.

santacoder: 24 layers, 16 query heads and one key/value head of 128; b = 8, s = 2048 (T = 16384
tokens), bf16 (c = 2 B): per layer 2 x (16 + 2) x 128 x 16384 = 75,497,472 B.
"""

from __future__ import annotations

from dataclasses import replace

from trainmem.analytic.attention import returned_presents_bytes
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

BIGCODE = load_model_spec("santacoder")
PER_LAYER = 2 * (16 + 2) * 128 * 16384


def _training(version: str, **kw: object) -> TrainingConfig:
    settings: dict[str, object] = {
        "framework": "hf-trainer",
        "micro_batch_size": 8,
        "seq_len": 2048,
        "precision": "bf16-true",
        "attention": "flash",
        "activation_checkpointing": "full",
        "transformers_version": version,
        **kw,
    }
    return TrainingConfig(**settings)  # type: ignore[arg-type]


def test_presents_keep_every_layers_fused_output() -> None:
    assert PER_LAYER == 75_497_472
    assert returned_presents_bytes(BIGCODE, _training("4.48.1"), 24) == 24 * PER_LAYER
    assert returned_presents_bytes(BIGCODE, _training("4.53.0"), 24) == 24 * PER_LAYER


def test_no_presents_from_4_54_without_checkpointing_or_cache() -> None:
    assert returned_presents_bytes(BIGCODE, _training("4.54.0"), 24) == 0
    # without checkpointing the attention's own saved views keep the output (not this term)
    none = _training("4.48.1", activation_checkpointing="none")
    assert returned_presents_bytes(BIGCODE, none, 24) == 0
    assert returned_presents_bytes(replace(BIGCODE, use_cache=False), _training("4.48.1"), 24) == 0


def test_presents_alive_at_the_loss() -> None:
    # 4.53 and 4.54 run the same loss (self.loss_function since 4.49): the forward's peak, at
    # the loss, differs by the 24 layers' fused outputs
    def forward_peak(version: str) -> int:
        est = estimate(BIGCODE, _training(version), simulate_allocator=False)
        return int(est.details["phase_peaks_bytes"]["forward"])  # type: ignore[index]

    assert forward_peak("4.53.0") - forward_peak("4.54.0") == 24 * PER_LAYER
