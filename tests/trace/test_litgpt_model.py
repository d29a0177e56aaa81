"""litgpt's own GPT on the generic path (trainmem.trace.litgpt_model; issue 26).

The config mapping and the refusals need no litgpt; the traced steps need litgpt (beside
transformers 5: ``pip install 'trainmem[litgpt]' && pip install --no-deps litgpt==0.5.13``, as
README's test command installs it, so CI runs them; litgpt 0.5.13 pins huggingface-hub<1.4,
which transformers 5.24 cannot install beside: pyproject.toml) and skip without it.

The agreement tests compare the traced step of litgpt's own code with the formulas' litgpt rows
(issue 26's bar: within 1 %; an independent derivation of the same run, each of its litgpt rules
found by this trace and cited in docs/formulas.md).

Expected sizes of the 2-layer Qwen2 formula config (h 64, MLP 128, 4 heads of 16, 2 key/value
groups, V 512, qkv biased), derived by hand: per layer the fused qkv 64 x (4 + 2 x 2) x 16 =
8,192 + its bias 128, the output projection 64 x 64 = 4,096, the MLP 3 x 64 x 128 = 24,576,
two norms 128: 37,120; two layers, the embedding and litgpt's own head 2 x 512 x 64, the final
norm 64: 139,840.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

pytest.importorskip("transformers")

from trainmem.trace.litgpt_model import (  # noqa: E402
    litgpt_available,
    litgpt_config_kwargs,
)

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
PARAMETERS = 139_840
needs_litgpt = pytest.mark.skipif(
    not litgpt_available(),
    reason="litgpt is not installed (beside transformers 5: pip install 'trainmem[litgpt]' && "
    "pip install --no-deps litgpt==0.5.13)",
)


def _training(**changes: Any) -> TrainingConfig:
    settings: dict[str, Any] = {"micro_batch_size": 2, "seq_len": 64, **changes}
    return TrainingConfig(framework="litgpt", **settings)


def test_the_config_maps_onto_litgpt_config_fields() -> None:
    kwargs = litgpt_config_kwargs(load_model_spec(QWEN2), _training())
    expected = {
        "n_layer": 2, "n_embd": 64, "n_head": 4, "n_query_groups": 2, "head_size": 16,
        "intermediate_size": 128, "vocab_size": 512, "padded_vocab_size": 512,
        "attn_bias": True, "bias": False, "norm_class_name": "RMSNorm",
        "mlp_class_name": "LLaMAMLP", "parallel_residual": False, "rotary_percentage": 1.0,
    }  # fmt: skip
    assert {k: kwargs[k] for k in expected} == expected
    assert "lora_r" not in kwargs


def test_lora_targets_become_litgpt_flags() -> None:
    kwargs = litgpt_config_kwargs(load_model_spec(QWEN2), _training(lora_rank=8))
    flags = ("lora_query", "lora_key", "lora_value", "lora_projection", "lora_mlp", "lora_head")
    # trainmem's default targets are q and v, as litgpt's finetune/lora.py defaults
    assert [kwargs[f] for f in flags] == [True, False, True, False, False, False]
    assert kwargs["lora_r"] == 8


def test_half_an_mlp_as_lora_target_is_refused() -> None:
    # litgpt's one lora_mlp flag adapts fc_1, fc_2 and proj together
    with pytest.raises(UnsupportedError, match="gate\\+up\\+down"):
        litgpt_config_kwargs(load_model_spec(QWEN2), _training(lora_rank=8, lora_targets=("up",)))


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        # Phi: one shared LayerNorm feeding attention and MLP, tanh GELU, biased everywhere
        ("phi", {"parallel_residual": True, "shared_attention_norm": True, "bias": True,
                 "gelu_approximate": "tanh", "rotary_percentage": 0.5, "lm_head_bias": True}),
        # Pythia (GPT-NeoX): a parallel block with two norms, exact GELU, a quarter rotary
        ("gpt_neox", {"parallel_residual": True, "shared_attention_norm": False, "bias": True,
                      "gelu_approximate": "none", "rotary_percentage": 0.25}),
        # Falcon-7B: multi-query, one shared norm, no linear biases
        ("falcon", {"parallel_residual": True, "shared_attention_norm": True, "bias": False,
                    "attn_bias": False, "n_query_groups": 1}),
    ],
)  # fmt: skip
def test_parallel_block_families_map_onto_gptneox_mlp(config: str, expected: Any) -> None:
    spec = load_model_spec(str(MODELS_DIR / "formula" / f"{config}.json"))
    kwargs = litgpt_config_kwargs(spec, _training())
    assert (kwargs["norm_class_name"], kwargs["mlp_class_name"]) == ("LayerNorm", "GptNeoxMLP")
    assert {k: kwargs[k] for k in expected} == expected


def test_a_model_without_a_litgpt_mapping_is_refused() -> None:
    # Gemma: a gated GELU MLP over RMSNorm (litgpt's GemmaMLP, embeddings scaled): not mapped
    gemma = load_model_spec(str(MODELS_DIR / "formula" / "gemma.json"))
    with pytest.raises(UnsupportedError, match="--engine analytic"):
        litgpt_config_kwargs(gemma, _training())


def test_without_litgpt_the_refusal_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("litgpt", "litgpt.config", "litgpt.model", "litgpt.lora"):
        monkeypatch.setitem(sys.modules, name, None)  # import litgpt raises ImportError
    with pytest.raises(UnsupportedError, match=r"pip install 'trainmem\[litgpt\]'"):
        estimate(QWEN2, _training(), engine="generic", simulate_allocator=False)


def test_litgpt_on_a_diffusers_model_is_refused() -> None:
    pixart = str(MODELS_DIR / "diffusers" / "tiny-pixart.json")
    with pytest.raises(UnsupportedError, match="litgpt trains its own GPT language models"):
        estimate(pixart, _training(), engine="generic", simulate_allocator=False)


def test_litgpt_beside_tensor_parallelism_stays_refused() -> None:
    with pytest.raises(UnsupportedError, match="framework=litgpt"):
        estimate(QWEN2, _training(tensor_parallel_size=2), engine="generic")


@needs_litgpt
def test_litgpt_gpt_parameters_and_rotary_tables_by_hand() -> None:
    est = estimate(QWEN2, _training(), engine="generic", simulate_allocator=False)
    assert est.engine == "generic"
    assert (est.num_parameters, est.num_trainable_parameters) == (PARAMETERS, PARAMETERS)
    # fp32 weights under bf16-mixed, and the cos / sin tables model.max_seq_length = 64 rows
    # of the 16-wide head rebuild in fp32 (litgpt/model.py ``rope_cache``)
    states = est.schedules[0].model_states()
    assert states["parameters"] == 4 * PARAMETERS + 2 * 64 * 16 * 4


@needs_litgpt
def test_litgpt_lora_adapters_by_hand() -> None:
    # LoRAQKVLinear on q and v (litgpt/lora.py): lora_A (2 r, h) = 16 x 64, lora_B of the q and
    # v widths (64 + 32) x r = 96 x 8, per layer; in bf16 under bf16-true (fabric.init_module)
    est = estimate(
        QWEN2, _training(lora_rank=8, precision="bf16-true"), engine="generic",
        simulate_allocator=False,
    )  # fmt: skip
    trainable = 2 * (16 * 64 + 96 * 8)
    assert est.num_trainable_parameters == trainable
    assert est.schedules[0].model_states()["gradients"] == 2 * trainable


def test_a_litgpt_release_other_than_the_installed_one_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainmem.trace import litgpt_model

    monkeypatch.setattr(litgpt_model, "installed_version", lambda _name: (0, 4, 0))
    with pytest.raises(UnsupportedError, match="--litgpt-version 0.4.0"):
        litgpt_model.check_litgpt_release(_training())  # the default asks for 0.5.13
    litgpt_model.check_litgpt_release(_training(litgpt_version="0.4"))


LLAMA_H1024 = str(MODELS_DIR / "lora_variants" / "llama_h1024.json")  # 2 layers, h 1024


def _agreement(model: str = LLAMA_H1024, **changes: Any) -> float:
    # 2 x 256 tokens: the activations (~50 MB on LLAMA_H1024) outweigh the cuBLAS workspace
    training = replace(_training(**changes), seq_len=256)
    g, a = (
        estimate(model, training, engine=engine, simulate_allocator=False).breakdown
        for engine in ("generic", "analytic")
    )
    return g.allocated_bytes / a.allocated_bytes - 1


@needs_litgpt
def test_litgpt_recipe_agrees_with_the_formulas() -> None:
    # litgpt's LoRA recipe: bf16-true, a chunked head, gradient accumulation, the previous loop
    changes = {"lora_rank": 8, "precision": "bf16-true", "chunked_cross_entropy": 4}
    assert abs(_agreement(**changes, gradient_accumulation_steps=3)) <= 0.01


_GENERIC_GAP = pytest.mark.xfail(
    strict=True,
    reason="a gap of the formulas on this model for transformers' model too: LoRA + full "
    "checkpointing under autocast, the formulas 1.3 % over the trace (their MLP backward "
    "transients of the recomputed layer; -5.8 % before the frozen weights' recomputed copies "
    "and adamw-8bit's -9.7 % closed by Note [Gradients where their linear's backward runs], "
    "session 15); not litgpt's",
)
_QUANTIZED_HEAD = pytest.mark.xfail(
    strict=True,
    reason="the formulas quantize litgpt's head, count Lightning's fp16 dequantization and run "
    "the head's backward after the loss's (session 15): -1.85 % here, unchunked: the last fp32 "
    "loss gradient (4 V t) the formulas keep to the head's end is freed by the cast's backward "
    "in the trace before the head's MatMul4Bit backward (+0.05 % with chunked_cross_entropy 4)",
)


@needs_litgpt
@pytest.mark.slow
@pytest.mark.parametrize(
    "changes",
    [
        pytest.param({}, id="mixed"),
        pytest.param({"precision": "bf16-true"}, id="bf16-true"),
        pytest.param({"precision": "32-true"}, id="32-true"),
        pytest.param({"data_parallel_size": 4}, id="ddp"),
        pytest.param({"lora_rank": 8}, id="lora"),
        pytest.param(
            {"lora_rank": 8, "activation_checkpointing": "full"},
            marks=_GENERIC_GAP,
            id="lora-ckpt",
        ),
        pytest.param({"optimizer": "adamw-8bit"}, id="adamw-8bit"),
        pytest.param(
            {"lora_rank": 8, "quantize_base": "nf4", "precision": "bf16-true"},
            marks=_QUANTIZED_HEAD,
            id="qlora",
        ),
    ],
)
def test_litgpt_agrees_with_the_formulas(changes: dict[str, Any]) -> None:
    assert abs(_agreement(**changes)) <= 0.01


@needs_litgpt
@pytest.mark.slow
@pytest.mark.parametrize("config", ["phi", "gpt_neox", "falcon"])
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_parallel_block_families_agree_with_the_formulas(config: str, precision: str) -> None:
    model = str(MODELS_DIR / "formula" / f"{config}.json")
    assert abs(_agreement(model, precision=precision, micro_batch_size=8)) <= 0.01
