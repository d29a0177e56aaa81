"""Gemma-3's sliding and full-attention layers under full activation checkpointing (issue 26:
tiny-gemma3-text was +1.29 % over the trace engine): the boolean sliding mask the checkpoints
keep (Note [The sliding mask is one s x s tensor], analytic/attention.py) and each layer's own
recompute (Note [Layer bodies per attention kind], analytic/transforms/checkpointing.py).

Hand derivation on tests/analytic/configs/tiny-gemma3-text.json (h 128, a 4 query heads,
k 2 kv heads, head_dim d 32, layer_types [sliding, full], sliding_window 32), b 8 x s 1024,
bf16 autocast (c = 2), SDPA:
- transformers 5.24 masking_utils.py ``sdpa_mask``: the sliding mask function reads only the
  q (1, 1, s, 1) and kv (1, 1, 1, s) indices, and ``.expand(batch_size, ...)`` is a view, so
  the boolean mask is s * s = 1,048,576 B; with a padded batch's 2D ``attention_mask``
  ``padding_mask_function`` indexes the batch: b * s * s = 8,388,608 B;
- a sliding layer's SDPA call (s >= window: the mask is explicit) saves the additive bias
  c * b * s * s = 16,777,216 B and k, v repeated to the 4 query heads (``repeat_kv``), 2 c
  (a - k) d b s = 2,097,152 B more than a full layer's: 18,874,368 B its recompute makes,
  and a full layer's none (modeling_gemma3.py ``Gemma3Attention``: ``self.sliding_window``
  only for ``layer_types[i] == "sliding_attention"``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainmem.analytic.activations import embedding_activation_bytes
from trainmem.analytic.engine import estimate_analytic
from trainmem.schedule import Repeat
from trainmem.specs.hf import load_model_spec, model_spec_from_hf
from trainmem.specs.training import TrainingConfig

CONFIG = Path(__file__).parent / "configs" / "tiny-gemma3-text.json"
B, S = 8, 1024
SLIDING_BIAS = 2 * B * S * S + 2 * 2 * (4 - 2) * 32 * B * S


def _training(**changes: object) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=B,
        seq_len=S,
        precision="bf16-mixed",
        **changes,  # type: ignore[arg-type]
    )


def test_the_checkpoints_keep_one_s_by_s_sliding_mask() -> None:
    spec = load_model_spec(str(CONFIG))
    full = _training(activation_checkpointing="full")
    assert embedding_activation_bytes(spec, full)["sliding_mask"] == S * S == 1_048_576
    padded = _training(activation_checkpointing="full", padding_mask=True)
    assert embedding_activation_bytes(spec, padded)["sliding_mask"] == B * S * S
    # without checkpointing no checkpoint keeps it
    assert "sliding_mask" not in embedding_activation_bytes(spec, _training())


def _recomputed_by_layer(items: Any) -> dict[int, int]:
    """Per layer index, the bytes of the recomputed blocks (keys ``re/``) its backward
    body allocates (the bodies holding the MLP's backward transients)."""
    out: dict[int, int] = {}
    for item in items:
        if not isinstance(item, Repeat):
            continue
        if any(getattr(op, "key", None) == "mlp_tmp" for op in item.body):
            made = sum(
                op.size_bytes
                for op in item.body
                if not isinstance(op, Repeat) and op.action == "alloc" and op.key.startswith("re/")
            )
            for k in range(item.count):
                out[item.index(k)] = made
        out.update(_recomputed_by_layer(item.body))
    return out


def test_each_layer_recomputes_its_own_bias() -> None:
    spec = load_model_spec(str(CONFIG))
    assert spec.sliding_layers == (True, False)
    schedule = estimate_analytic(spec, _training(activation_checkpointing="full")).schedules[0]
    made = _recomputed_by_layer(schedule.step)
    assert set(made) == {0, 1}
    assert made[0] - made[1] == SLIDING_BIAS == 18_874_368
    # with both layers full-attention (no sliding window) the full layer's body is unchanged
    plain = model_spec_from_hf(
        {**_config(), "layer_types": ["full_attention", "full_attention"]}, name="x"
    )
    assert plain.sliding_layers == ()
    plain_made = _recomputed_by_layer(
        estimate_analytic(plain, _training(activation_checkpointing="full")).schedules[0].step
    )
    assert plain_made[0] == plain_made[1] == made[1]


def _config() -> dict[str, object]:
    from trainmem.specs.hf import load_hf_config

    return load_hf_config(str(CONFIG))


def test_the_pattern_follows_the_config() -> None:
    # Gemma3TextConfig: every sliding_window_pattern-th layer full (configuration_gemma3.py)
    config = {k: v for k, v in _config().items() if k != "layer_types"}
    spec = model_spec_from_hf({**config, "num_hidden_layers": 7}, name="x")
    assert spec.sliding_layers == (True, True, True, True, True, False, True)
    # Qwen2Config: sliding from layer max_window_layers on (configuration_qwen2.py)
    qwen = {
        "model_type": "qwen2",
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 128,
        "sliding_window": 64,
        "use_sliding_window": True,
        "max_window_layers": 1,
    }
    assert model_spec_from_hf(qwen, name="x").sliding_layers == (False, True, True)
    # every layer of one kind: no pattern (Mistral slides everywhere)
    mistral = {**qwen, "model_type": "mistral"}
    assert model_spec_from_hf(mistral, name="x").sliding_layers == ()
