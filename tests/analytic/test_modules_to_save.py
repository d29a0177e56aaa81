"""peft ``modules_to_save`` on the formulas (``--lora-modules-to-save``, Note [peft
modules_to_save] in ``analytic/tensor_states.py``): bytes by hand from peft 0.21.2
utils/other.py ``ModulesToSaveWrapper.update`` (``copy.deepcopy(self.original_module)``, the
original ``requires_grad_(False)``) and torch 2.13's AdamW (``_init_group``: ``exp_avg`` and
``exp_avg_sq`` are ``torch.zeros_like(p)``, the parameter's dtype), on the 2-layer 2048-wide
agreement Llama with a 32,000-token vocabulary: one V x h weight is 32,000 x 2,048 =
65,536,000 elements, LoRA r 16 on q, v."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import MODELS_DIR, Invoke, InvokeJson
from trainmem.analytic.engine import model_as_built
from trainmem.analytic.head import head_activation_bytes
from trainmem.analytic.tensor_states import tensor_states
from trainmem.errors import SpecError
from trainmem.specs.hf import load_model_spec
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

VH = 32_000 * 2_048  # elements of the embedding's (and the head's) weight
CONFIG = {
    **json.loads((MODELS_DIR / "agreement" / "llama_h2048.json").read_text()),
    "vocab_size": 32_000,
}
LORA = TrainingConfig(micro_batch_size=2, seq_len=256, lora_rank=16, lora_targets=("q", "v"))
BOTH = ("embed_tokens", "lm_head")


def _model(tmp_path: Path, tied: bool = False) -> ModelSpec:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "tie_word_embeddings": tied}))
    return load_model_spec(str(path))


def _totals(model: ModelSpec, training: TrainingConfig) -> tuple[int, int, int, int]:
    """(weight, gradient, optimizer-state bytes, trainable elements) over the model as the
    engine builds it."""
    states = tensor_states(model_as_built(model, training), training)
    return (
        sum(s.param_bytes for s in states),
        sum(s.grad_bytes for s in states),
        sum(s.state_bytes for s in states),
        sum(s.numel for s in states if s.trainable),
    )


@pytest.mark.parametrize(
    ("saved", "copies"), [(BOTH, 2), (("embed_tokens",), 1), (("lm_head",), 1)]
)
def test_each_saved_module_adds_a_trained_copy_beside_its_frozen_original(
    tmp_path: Path, saved: tuple[str, ...], copies: int
) -> None:
    """fp32 weights (bf16-mixed): per saved module, a copy of 4 VH B, its fp32 gradient 4 VH B
    and AdamW's two fp32 moments 8 VH B; the original stays (frozen: no gradient, no state)."""
    model = _model(tmp_path)
    w0, g0, s0, n0 = _totals(model, LORA)
    w, g, s, n = _totals(model, dataclasses.replace(LORA, lora_modules_to_save=saved))
    assert w - w0 == copies * 4 * VH
    assert g - g0 == copies * 4 * VH
    assert s - s0 == copies * 8 * VH
    assert n - n0 == copies * VH


def test_the_copy_keeps_a_bf16_model_in_bf16(tmp_path: Path) -> None:
    """Loaded in bf16 (Qwen-1's finetune.py): peft's ``cast_adapter_dtype`` upcasts only
    ``BaseTunerLayer`` adapters, so the deep copies stay bf16: 2 VH B of weight, 2 VH B of
    gradient and 4 VH B of AdamW moments each."""
    bf16 = dataclasses.replace(
        LORA, framework="hf-trainer", precision="bf16-mixed", load_dtype="bfloat16"
    )
    model = _model(tmp_path)
    w0, g0, s0, _ = _totals(model, bf16)
    w, g, s, _ = _totals(model, dataclasses.replace(bf16, lora_modules_to_save=BOTH))
    assert (w - w0, g - g0, s - s0) == (2 * 2 * VH, 2 * 2 * VH, 2 * 4 * VH)


def test_trls_bf16_cast_reaches_the_copies_over_a_4bit_base(tmp_path: Path) -> None:
    """TRL 0.20's SFTTrainer casts every module named like ``lm_head`` / ``embed_tokens`` to
    bf16 after ``get_peft_model`` (``peft_module_casting_to_bf16``), the saved copies too:
    2 B weights, 2 B gradients and two 2 B AdamW moments a copy, over peft's fp32 upcast."""
    trl = dataclasses.replace(LORA, framework="trl", quantize_base="nf4-dq", trl_version="0.20.0")
    assert trl.trl_bf16_embeddings
    model = _model(tmp_path)
    w0, g0, s0, _ = _totals(model, trl)
    w, g, s, _ = _totals(model, dataclasses.replace(trl, lora_modules_to_save=BOTH))
    assert (w - w0, g - g0, s - s0) == (2 * 2 * VH, 2 * 2 * VH, 2 * 4 * VH)


@pytest.mark.parametrize(
    ("saved", "weights"), [(BOTH, 3), (("embed_tokens",), 2), (("lm_head",), 2)]
)
def test_tied_weights_are_copied_apart_and_the_original_counted_once(
    tmp_path: Path, saved: tuple[str, ...], weights: int
) -> None:
    """Tied in the config: peft deep-copies the embedding module and the head module (whose
    weight is the embedding's) each on its own, so both saved: the shared frozen original and
    two trained copies (3 V x h weights); one saved: the original, which the other module still
    reads, and one copy (2)."""
    model = _model(tmp_path, tied=True)
    training = dataclasses.replace(LORA, lora_modules_to_save=saved)
    states = tensor_states(model_as_built(model, training), training)
    vocab = [s for s in states if s.name.startswith(("embedding/tokens", "lm_head"))]
    assert sum(s.numel for s in vocab) == weights * VH
    assert sum(s.numel for s in vocab if s.trainable) == len(saved) * VH


def test_a_trained_head_saves_its_input(tmp_path: Path) -> None:
    """A frozen head keeps no input for a weight gradient; a trained copy's matmul keeps its
    bf16 input: c h t = 2 x 2,048 x 512 B (the ``lm_head_input`` term)."""
    model = _model(tmp_path)
    frozen = head_activation_bytes(model, LORA)
    trained = head_activation_bytes(model, dataclasses.replace(LORA, lora_modules_to_save=BOTH))
    assert "lm_head_input" not in frozen
    assert trained["lm_head_input"] == 2 * 2_048 * 2 * 256


def test_names_of_other_families_are_read_as_trainmems() -> None:
    saved = dataclasses.replace(LORA, lora_modules_to_save=("wte", "lm_head", "wte"))
    assert saved.lora_modules_to_save == BOTH
    assert dataclasses.replace(LORA, lora_modules_to_save=("embed_in",)).trains_embedding


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"lora_modules_to_save": ("norm",)}, "allowed: embed_tokens, lm_head"),
        ({"lora_modules_to_save": BOTH, "lora_rank": 0}, "lora_rank > 0"),
        ({"lora_modules_to_save": ("lm_head",), "lora_targets": ("q", "lm_head")}, "lm_head"),
        ({"lora_modules_to_save": BOTH, "framework": "litgpt"}, "not modelled"),
        ({"lora_modules_to_save": BOTH, "framework": "unsloth"}, "not modelled"),
        (
            {
                "lora_modules_to_save": BOTH,
                "framework": "deepspeed",
                "zero_stage": 3,
                "data_parallel_size": 4,
            },
            "ZeRO-3",
        ),
        ({"lora_modules_to_save": BOTH, "tensor_parallel_size": 2}, "tensor or pipeline"),
        (
            {
                "lora_modules_to_save": BOTH,
                "quantize_base": "nf4",
                "framework": "hf-trainer",
                "prepare_kbit_training": False,
            },
            "16 bits",
        ),
    ],
)
def test_settings_peft_does_not_run_or_trainmem_does_not_model_are_refused(
    settings: dict[str, Any], words: str
) -> None:
    with pytest.raises(SpecError) as info:
        dataclasses.replace(LORA, **settings)
    assert info.value.field == "lora_modules_to_save"
    assert words in str(info.value)


def test_the_cli_reads_a_comma_separated_list(invoke_json: InvokeJson, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    common = ["estimate", str(path), "-s", "256", "--lora-rank", "16"]
    out = invoke_json(*common, "--lora-modules-to-save", "wte,lm_head")
    assert out["config"]["lora_modules_to_save"] == list(BOTH)


def test_the_cli_names_the_field_and_the_allowed_modules(invoke: Invoke, tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    result = invoke(
        "estimate", str(path), "--lora-rank", "16", "--lora-modules-to-save", "norm", exit_code=None
    )
    assert result.exit_code != 0
    assert "lora_modules_to_save" in result.stderr
    assert "embed_tokens, lm_head" in result.stderr


def test_the_web_page_ticks_modules_as_the_cli_names_them() -> None:
    """The page's checkbox group (``multi``: the setting's choices) -> the config, and the
    same page's ``trainmem estimate`` command; an unticked group is none saved."""
    from trainmem.web.form import cli_command, coerce, default_values, field, training_config

    assert field("lora_modules_to_save").choices == BOTH
    values = {**default_values(), "lora_rank": 16}
    assert training_config(values, 256).lora_modules_to_save == ()
    values["lora_modules_to_save"] = coerce("lora_modules_to_save", ["embed_tokens", "lm_head"])
    assert training_config(values, 256).lora_modules_to_save == BOTH
    assert cli_command(values).endswith("--lora-modules-to-save embed_tokens,lm_head")


def test_counts_are_the_configs_parameters_and_peft_trainable_ones(tmp_path: Path) -> None:
    """Tied: the config's parameters unchanged; trainable = two V x h copies + the adapters
    (q: 16 x (2,048 + 2,048), v: 16 x (2,048 + 512), two layers = 212,992), as peft's
    ``print_trainable_parameters`` counts the copies' ``requires_grad`` parameters."""
    from trainmem.estimate import estimate

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "tie_word_embeddings": True}))
    plain = estimate(str(path), LORA, engine="analytic", simulate_allocator=False)
    saved = dataclasses.replace(LORA, lora_modules_to_save=BOTH)
    both = estimate(str(path), saved, engine="analytic", simulate_allocator=False)
    assert both.num_parameters == plain.num_parameters
    assert plain.num_trainable_parameters == 212_992
    assert both.num_trainable_parameters == 2 * VH + 212_992
