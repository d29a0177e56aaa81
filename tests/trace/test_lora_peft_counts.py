"""The generic path's LoRA targets against real peft (issue 26): for each model, peft itself
(``get_peft_model`` on the model built on CPU) is given the module names a user of that family
writes for the same linears, or none at all where peft has a default for the ``model_type``
(peft 0.21.2 utils/constants.py ``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``: t5
``q, v``; bart ``q_proj, v_proj``; bert ``query, value``; not mixtral's ``q_proj, v_proj``,
which peft 0.21.2 loses on a transformers 5 MoE: "No `target_modules` passed"), and the
adapters it makes are counted; the generic path's peft model for trainmem's target names must
hold the same adapters. peft adapts every module whose name ends with a target (peft
tuners/tuners_utils.py ``check_target_module_exists``): an encoder-decoder's decoder and its
cross-attention too."""

from __future__ import annotations

import warnings
from typing import Any

import peft
import pytest

from trainmem.specs.hf import load_hf_config
from trainmem.specs.training import TrainingConfig
from trainmem.trace.hf_model import build_hf_model, build_hf_training_model

QV = ("q", "v")
ALL_SEVEN = ("q", "k", "v", "o", "gate", "up", "down")
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"]
LANGUAGE_MODEL_QV = r".*language_model\..*\.(q_proj|v_proj)"
"""A vision-language model's q, v in its language model only, as peft's own default for
Gemma 4 writes it (peft 0.21.2 utils/constants.py, ``"gemma4"``)."""

CASES: list[tuple[str, tuple[str, ...], Any]] = [
    # (config under tests/models, trainmem --lora-targets, peft target_modules; None: peft's)
    ("t5.json", QV, None),
    ("t5.json", ("q", "k", "v", "o", "up", "down"), ["q", "k", "v", "o", "wi", "wo"]),
    ("seq2seq/bart.json", QV, None),
    ("seq2seq/bart.json", ("q", "k", "v", "o", "up", "down"),
     ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"]),
    ("whisper.json", QV, ["q_proj", "v_proj"]),
    ("whisper.json", ("k", "o", "up"), ["k_proj", "out_proj", "fc1"]),
    ("formula/bert.json", QV, None),
    ("heads/wav2vec2.json", QV, ["q_proj", "v_proj"]),
    ("heads/wav2vec2.json", ("q", "k", "v", "o", "up", "down"),
     ["q_proj", "k_proj", "v_proj", "out_proj", "intermediate_dense", "output_dense"]),
    ("heads/parakeet_ctc.json", QV, ["q_proj", "v_proj"]),
    ("heads/parakeet_ctc.json", ("q", "k", "v", "o", "up", "down"),
     ["q_proj", "k_proj", "v_proj", "o_proj", "linear1", "linear2"]),
    ("deepseek_v3.json", QV, MLA),
    ("deepseek_v3.json", ALL_SEVEN, [*MLA, "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("formula/mixtral.json", QV, ["q_proj", "v_proj"]),
    ("qwen3_moe.json", ("q", "k", "v", "o"), ["q_proj", "k_proj", "v_proj", "o_proj"]),
    # a transformers 5 MoE's fused experts, as peft adapts them for the transformers 4 names
    ("formula/mixtral.json", ("q", "v", "gate", "up", "down"),
     ["q_proj", "v_proj", "w1", "w3", "w2"]),
    ("qwen3_moe.json", ALL_SEVEN,
     ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ("vlm/llava.json", QV, LANGUAGE_MODEL_QV),
    ("seq2seq/vision_encoder_decoder.json", QV, ["q_proj", "v_proj", "query", "value"]),
    ("seq2seq/speech_encoder_decoder.json", QV, ["q_proj", "v_proj", "query", "value"]),
]  # fmt: skip


def _peft_adapters(raw: dict[str, Any], target_modules: Any) -> tuple[set[str], int]:
    """The modules real peft adapts on the CPU-built model, and its trainable count."""
    model = build_hf_model(raw, dropout=False, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=target_modules))
    names = {
        n.removeprefix("base_model.model.").removesuffix(".lora_A.default")
        for n, _ in wrapped.named_modules()
        if n.endswith(".lora_A.default")
    }
    return names, sum(p.numel() for p in wrapped.parameters() if p.requires_grad)


@pytest.mark.parametrize(("config", "targets", "peft_targets"), CASES)
def test_adapters_are_the_ones_peft_makes_for_the_family_names(
    config: str, targets: tuple[str, ...], peft_targets: Any
) -> None:
    from conftest import MODELS_DIR

    raw = dict(load_hf_config(str(MODELS_DIR / config)))
    expected_names, expected = _peft_adapters(raw, peft_targets)
    assert expected > 0
    model = build_hf_training_model(raw, TrainingConfig(lora_rank=4, lora_targets=targets))
    names = {
        n.removeprefix("base_model.model.").removesuffix(".lora_A.default")
        for n, _ in model.named_modules()
        if n.endswith(".lora_A.default")
    }
    assert names == expected_names
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == expected


def test_mla_roles_by_hand() -> None:
    # tests/models/deepseek_v3.json: hidden 64, 4 heads, q_lora_rank 32, kv_lora_rank 16,
    # qk_nope 16 + qk_rope 8 per head, v_head_dim 16. At rank 4 an adapter is 4 x (in + out):
    # q_a 64 -> 32: 384; q_b 32 -> 4 x 24 = 96: 512; kv_a 64 -> 16 + 8: 352;
    # kv_b 16 -> 4 x (16 + 16) = 128: 576. q, v target all four (v: both kv linears),
    # 1,824 a layer, 2 layers: 3,648 (the analytic engine counted none before)
    from conftest import MODELS_DIR
    from trainmem.estimate import estimate

    path = str(MODELS_DIR / "deepseek_v3.json")
    training = TrainingConfig(micro_batch_size=1, seq_len=32, lora_rank=4)
    est = estimate(path, training, engine="analytic", simulate_allocator=False)
    assert est.num_trainable_parameters == 2 * (384 + 512 + 352 + 576)


def test_all_linear_on_a_generic_only_family_is_its_own_linears(invoke_json) -> None:
    # Found checking issue 26: --lora-targets all-linear on a family without formulas became
    # all seven names, and Whisper has no gate: "lora target 'gate': ... has no such linear".
    # tests/models/whisper.json (d_model 64, ffn 128, 2 + 2 layers) at rank 8: an encoder
    # layer's q, k, v, out_proj 4 x 8 x (64 + 64) = 4,096 and fc1, fc2 2 x 8 x (64 + 128) =
    # 3,072; a decoder layer adds its cross-attention's 4,096: 2 x 7,168 + 2 x 11,264
    from conftest import MODELS_DIR

    out = invoke_json(
        "estimate", MODELS_DIR / "whisper.json", "--lora-rank", "8", "--lora-targets",
        "all-linear", "-b", "1", "-s", "32",
    )  # fmt: skip
    assert out["config"]["lora_targets"] == ["q", "k", "v", "o", "up", "down"]
    assert out["num_trainable_parameters"] == 2 * 7168 + 2 * 11264


def test_up_without_gate_on_a_transformers_5_moe_names_the_field() -> None:
    # Found fuzzing the web page (issue 26): DeepSeek-V3 with q,k,v,o,up,down crashed on
    # peft's ValueError ("Cannot convert PEFT target(s) up_proj without also targeting
    # gate_proj because they are fused into gate_up_proj", peft 0.21.2
    # utils/transformers_weight_conversion.py); real peft refuses it on CPU too
    from conftest import MODELS_DIR
    from trainmem.errors import SpecError

    raw = dict(load_hf_config(str(MODELS_DIR / "deepseek_v3.json")))
    with pytest.raises(ValueError, match="fused into gate_up_proj"):
        _peft_adapters(raw, ["q_a_proj", "up_proj", "down_proj"])
    training = TrainingConfig(lora_rank=4, lora_targets=("q", "up", "down"))
    with pytest.raises(SpecError, match="lora_targets.*gate and up together"):
        build_hf_training_model(raw, training)


@pytest.mark.parametrize("variant", ["dora", "adalora", "lokr", "loha"])
def test_other_variants_on_fused_experts_name_the_field(variant: str) -> None:
    # peft 0.21.2 converts the transformers 4 expert names for LoRA only (AdaLoRA and LoKr
    # left the experts silently unadapted: 1,808 / 448 trainable on this Mixtral) and
    # lora.ParamWrapper refuses use_dora
    from conftest import MODELS_DIR
    from trainmem.errors import SpecError

    raw = dict(load_hf_config(str(MODELS_DIR / "formula" / "mixtral.json")))
    training = TrainingConfig(lora_rank=4, lora_targets=("q", "gate", "up"), lora_variant=variant)
    with pytest.raises(SpecError, match="lora_variant"):
        build_hf_training_model(raw, training)
