"""peft's prompt learning in the formulas (Note [Prompt learning in the formulas] in
trainmem/analytic/prompt_encoder.py): prefix tuning's p cached keys / values, p-tuning's and
prompt tuning's p + s tokens, the prompt encoder's saved tensors, over a frozen base.

Expected values by hand from peft 0.21.2 (peft_model.py ``get_prompt``,
``PeftModelForCausalLM.forward``; tuners/p_tuning/model.py ``PromptEncoder``) and transformers
5.24 (cache_utils.py ``DynamicLayer.update``, masking_utils.py ``_ignore_causal_mask_sdpa``,
integrations/sdpa_attention.py ``repeat_kv``), for the 1024-wide agreement Llama
(tests/models/agreement/llama_h1024.json: h 1024, 8 heads of 128, 8 kv heads, i 2816, 2
layers) at b = 2, s = 256, p = 16. The same tensors, one by one, are in the generic path's
trace of peft on the transformers model (session 29: its live storages at each phase's peak);
the agreement cells compare both engines' peaks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.activations import embedding_activation_bytes, layer_activation_terms
from trainmem.analytic.attention import forward_kv_cache_bytes
from trainmem.analytic.head import final_hidden_transient_bytes
from trainmem.analytic.lora import first_layer_unsaved
from trainmem.analytic.prompt_encoder import prompted_inputs_held_bytes
from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.hf import load_hf_config, load_model_spec
from trainmem.specs.training import TrainingConfig

LLAMA = str(MODELS_DIR / "agreement" / "llama_h1024.json")
B, S, P = 2, 256, 16
H, A, D, INNER, L = 1024, 8, 128, 2816, 2


def _training(**kw: Any) -> TrainingConfig:
    settings: dict[str, Any] = {"micro_batch_size": B, "seq_len": S, "num_virtual_tokens": P}
    return TrainingConfig(**{**settings, **kw})


def test_prefix_keys_values_and_mask_by_hand() -> None:
    model = load_model_spec(LLAMA)
    terms = layer_activation_terms(model, _training(precision="bf16-true"))
    # SDPA saves the cache's keys and values, p + s rows: 2 c kv d b p beyond the sequence's
    assert terms["attention/prefix_kv"] == 2 * 2 * A * D * B * P == 131_072
    # the p cached keys make the key length differ from the query's: an explicit (1, 1, s,
    # p + s) boolean mask, which SDPA turns into a (b, 1, s, p + s) bias of the query's dtype
    assert terms["attention/mask_bias"] == 2 * B * S * (S + P) == 278_528
    plain = layer_activation_terms(model, TrainingConfig(micro_batch_size=B, seq_len=S))
    assert "attention/prefix_kv" not in plain and "attention/mask_bias" not in plain


def test_prefix_cache_under_autocast_by_hand() -> None:
    # bf16-mixed: peft casts the prefix to the base's dtype (fp32), so ``torch.cat`` promotes
    # each layer's keys (fp32 already: the rotary tables) and values (16-bit v_proj output) to
    # fp32; SDPA saves its own 16-bit casts, so the cache's (b, kv, p + s, d) fp32 tensors are
    # held beside them to the end of the forward
    model = load_model_spec(LLAMA)
    cache = forward_kv_cache_bytes(model, _training(precision="bf16-mixed"), L)
    assert cache == 2 * 4 * A * D * B * (S + P) * L == 8_912_896
    # bf16-true: the cache's tensors are the ones SDPA saves: none extra
    assert forward_kv_cache_bytes(model, _training(precision="bf16-true"), L) == 0


def test_prefix_first_layer_by_hand() -> None:
    # nothing requires grad in layer 0 before the prefix's concatenation: its input norm
    # records nothing; under autocast q / k / v keep no 16-bit weight copy
    model = load_model_spec(LLAMA)
    got = first_layer_unsaved(model, _training(precision="bf16-mixed"))
    assert got is not None
    assert got.whole == ("attention/norm",)
    assert got.less == {"autocast_weight_copies": 2 * 3 * H * A * D}
    true16 = first_layer_unsaved(model, _training(precision="bf16-true"))
    assert true16 is not None and true16.less == {}
    # p-tuning's first layer reads the prompts, which need a gradient: no rule
    assert first_layer_unsaved(model, _training(prompt_learning="p-tuning")) is None


def test_prompt_tuning_lengthens_every_layer_and_holds_its_inputs() -> None:
    model = load_model_spec(LLAMA)
    prompt = layer_activation_terms(model, _training(prompt_learning="prompt-tuning"))
    # p + s tokens through the MLP: gate, act and up outputs, c i b (p + s) each
    assert prompt["mlp/gated"] == 3 * 2 * INNER * B * (S + P)
    # peft's forward holds ``prompts`` (r b p h) to the end of the loss; bf16-mixed: the
    # prompted embeddings are the fp32 residual the first norm saves itself
    held = prompted_inputs_held_bytes(model, _training(prompt_learning="prompt-tuning"))
    assert held == 4 * B * P * H
    # bf16-true: the prompted embeddings (r b (p + s) h) too, the norm saving its fp32 cast
    true16 = _training(prompt_learning="prompt-tuning", precision="bf16-true")
    assert prompted_inputs_held_bytes(model, true16) == 2 * B * P * H + 2 * B * (S + P) * H


def test_p_tuning_encoder_saves_by_hand() -> None:
    # peft runs the encoder on one row of p tokens (``prompt_tokens[:1]``) and repeats it;
    # under autocast its fp32 Linear(h, h) x 3 keep 16-bit weight copies and the first
    # input's cast, the two ReLU outputs 16-bit: c p (h + 2 h)
    model = load_model_spec(LLAMA)
    mixed = embedding_activation_bytes(model, _training(prompt_learning="p-tuning"))
    assert mixed["prompt_encoder/weight_copies"] == 2 * 3 * H * H == 6_291_456
    assert mixed["prompt_encoder/activations"] == 2 * P * 3 * H == 98_304
    # bf16-true: the encoder runs in its own fp32, no copies
    true16 = embedding_activation_bytes(
        model, _training(prompt_learning="p-tuning", precision="bf16-true")
    )
    assert "prompt_encoder/weight_copies" not in true16
    assert true16["prompt_encoder/activations"] == 4 * P * 3 * H


def test_a_frozen_head_leaves_the_final_hidden_states_held() -> None:
    # bf16-true (r = c): a trained LM head saves its input; a frozen one does not, and the
    # causal-LM forward holds it through the loss: c h b s (p + s under p-tuning)
    model = load_model_spec(LLAMA)
    full = TrainingConfig(micro_batch_size=B, seq_len=S, precision="bf16-true")
    assert final_hidden_transient_bytes(model, full) == 0
    lora = TrainingConfig(micro_batch_size=B, seq_len=S, precision="bf16-true", lora_rank=16)
    assert final_hidden_transient_bytes(model, lora) == 2 * H * B * S
    prefix = _training(precision="bf16-true")
    assert final_hidden_transient_bytes(model, prefix) == 2 * H * B * S


def test_what_the_formulas_refuse() -> None:
    with pytest.raises(UnsupportedError, match="activation_checkpointing=full"):
        estimate(LLAMA, _training(activation_checkpointing="full"), engine="analytic")
    with pytest.raises(UnsupportedError, match="sliding-window layers"):
        estimate("gemma-3-1b", _training(), engine="analytic")
    with pytest.raises(UnsupportedError, match="--engine generic"):
        estimate("flan-t5-xl", _training(), engine="analytic")
    # sharded weights: the generic path is 1.4 % (ZeRO-3) / 8.8 % (FSDP2) off the formulas
    sharded = _training(framework="fsdp2", zero_stage=3, data_parallel_size=4)
    with pytest.raises(UnsupportedError, match="sharded weights"):
        estimate(LLAMA, sharded, engine="analytic")
    # multi-query Falcon: peft's prefix has every head (no num_key_value_heads in its config),
    # the step fails; the generic path refuses it with the same reason
    falcon = str(MODELS_DIR / "formula" / "falcon.json")
    for engine in ("analytic", "generic"):
        with pytest.raises(UnsupportedError, match="Falcon with 1 key/value heads of 4"):
            estimate(falcon, _training(seq_len=64), engine=engine, simulate_allocator=False)


def _peak(model: str, training: TrainingConfig, engine: str) -> int:
    est = estimate(model, training, engine=engine, simulate_allocator=False)
    return max(est.details["phase_peaks_bytes"].values())


def _variant(tmp_path: Path, base: str, **fields: Any) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**load_hf_config(base), **fields}))
    return str(path)


AGREEMENT = [
    pytest.param(None, dict(precision="bf16-mixed"), id="mha-prefix-mixed"),
    pytest.param(
        dict(num_key_value_heads=2), dict(precision="bf16-true", prompt_learning="p-tuning"),
        id="gqa-p-tuning-true",
    ),
    pytest.param(
        dict(num_key_value_heads=2), dict(precision="bf16-mixed"),
        id="gqa-prefix-mixed", marks=pytest.mark.slow,
    ),
    pytest.param(
        dict(num_key_value_heads=2), dict(precision="bf16-true", prefix_projection=True),
        id="gqa-prefix-projection-true", marks=pytest.mark.slow,
    ),
    pytest.param(
        None, dict(precision="bf16-true", prompt_learning="prompt-tuning"),
        id="mha-prompt-tuning-true", marks=pytest.mark.slow,
    ),
    pytest.param(
        dict(num_key_value_heads=2),
        dict(precision="bf16-mixed", prompt_learning="p-tuning", activation_checkpointing="full"),
        id="gqa-p-tuning-checkpointed", marks=pytest.mark.slow,
    ),
    pytest.param(
        dict(num_key_value_heads=2),
        dict(precision="bf16-mixed", framework="deepspeed", zero_stage=2, data_parallel_size=4),
        id="gqa-prefix-zero2", marks=pytest.mark.slow,
    ),
    # CPU offload beside prompt learning (accepted since session 29)
    pytest.param(
        dict(num_key_value_heads=2),
        dict(precision="bf16-mixed", framework="deepspeed", zero_stage=2, data_parallel_size=4,
             offload="optimizer"),
        id="gqa-prefix-zero2-offload", marks=pytest.mark.slow,
    ),
    pytest.param(
        dict(num_key_value_heads=2),
        dict(precision="bf16-mixed", prompt_learning="p-tuning", offload="optimizer"),
        id="gqa-p-tuning-offload", marks=pytest.mark.slow,
    ),
]  # fmt: skip


@pytest.mark.parametrize(("config", "settings"), AGREEMENT)
def test_generic_and_formulas_agree(
    tmp_path: Path, config: dict[str, Any] | None, settings: dict[str, Any]
) -> None:
    """Both engines' step peaks within 0.1 % (issue 26's bar is 1 %): the generic path traces
    peft 0.21.2 on transformers 5.24 (session 29: all within 0.01 %; before, the formulas
    refused prompt learning, and without its rules they were +2.8 % / -2.0 % / +8 %)."""
    pytest.importorskip("peft")
    model = _variant(tmp_path, LLAMA, **config) if config else LLAMA
    training = _training(**settings)
    analytic, generic = _peak(model, training, "analytic"), _peak(model, training, "generic")
    assert abs(analytic / generic - 1) < 1e-3, (analytic, generic)


@pytest.mark.slow
def test_one_kv_head_under_autocast_agrees(tmp_path: Path) -> None:
    """Gemma with one kv head under bf16-mixed: ``repeat_kv`` is a view, autocast's cast of it
    writes every head (attention.py ``prefix_view_cast``): -1.7 % -> -0.01 %."""
    pytest.importorskip("peft")
    model = _variant(
        tmp_path,
        str(MODELS_DIR / "formula" / "gemma.json"),
        hidden_size=1024,
        intermediate_size=2816,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=128,
        vocab_size=4096,
    )
    training = _training(precision="bf16-mixed")
    analytic, generic = _peak(model, training, "analytic"), _peak(model, training, "generic")
    assert abs(analytic / generic - 1) < 1e-3, (analytic, generic)
