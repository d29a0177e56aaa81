"""``--framework llama-factory`` and ``--framework axolotl``: the HF Trainer + peft with the
defaults their YAML training path changes (``FRAMEWORK_CONVENTIONS`` rows; sources there).

LLaMA-Factory v0.9.5: gradient checkpointing on (``disable_gradient_checkpointing`` False,
src/llamafactory/hparams/model_args.py:145-146), reentrant (``use_reentrant_gc`` True,
model_args.py:149-150; model_utils/checkpointing.py:174-175), LoRA on every linear but the head
(``lora_target: "all"``, hparams/finetuning_args.py:81-82). axolotl v0.18.0: checkpointing off
by default (utils/schemas/config.py:600-601) and reentrant when on (utils/config/__init__.py:
377-383), ``optimizer`` ``adamw_torch_fused`` whatever the torch (utils/schemas/training.py:
122-123).

Bytes by hand, ``tiny-llama-test`` (2 layers, h 64, 4 heads and 2 key/value heads of 16,
intermediate 176) at LoRA rank 4: r (in + out) per targeted linear per layer, q 512, k = v 384,
o 512, gate = up = down 960; all seven 9,344 trainable parameters, peft's q, v 1,792. Under
``bf16-mixed`` on the HF Trainer the adapters are fp32 with fp32 gradients (4 bytes each) and
AdamW's two fp32 moments (8 bytes each): LLaMA-Factory's default targets add (9,344 - 1,792) x
4 = 30,208 gradient bytes and x 8 = 60,416 optimizer-state bytes over hf-trainer's."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import InvokeJson
from trainmem.specs.training import TrainingConfig
from trainmem.web.form import CHOICES

MODEL = "tiny-llama-test"
BASE = ["--lora-rank", "4", "--seq-len", "64"]
SEVEN = ("q", "k", "v", "o", "gate", "up", "down")
EXTRA_TRAINABLE = 2 * (512 + 384 + 384 + 512 + 3 * 960) - 2 * (512 + 384)  # 7,552


def test_llama_factory_defaults_and_explicit_settings_win() -> None:
    lf = TrainingConfig(framework="llama-factory", lora_rank=4)
    assert lf.activation_checkpointing == "full"
    assert lf.lora_targets == SEVEN
    assert lf.layer_checkpoint_reentrant  # use_reentrant_gc True
    # every default given by the user stays the user's, the equal ones too
    given = TrainingConfig(
        framework="llama-factory",
        lora_rank=4,
        activation_checkpointing="none",
        lora_targets=("q", "v"),
        checkpoint_reentrant=False,
    )
    assert given.activation_checkpointing == "none"
    assert given.lora_targets == ("q", "v")
    assert not given.layer_checkpoint_reentrant
    same = TrainingConfig(framework="llama-factory", lora_rank=4, checkpoint_reentrant=True)
    assert same.checkpoint_reentrant is True and same.layer_checkpoint_reentrant


def test_axolotl_reentrant_when_on_and_fused_adamw_on_any_torch() -> None:
    ax = TrainingConfig(framework="axolotl", activation_checkpointing="full", torch_version="2.7")
    hf = TrainingConfig(
        framework="hf-trainer",
        activation_checkpointing="full",
        torch_version="2.7",
        transformers_version="5.24",
    )
    assert ax.activation_checkpointing == "full"
    assert ax.layer_checkpoint_reentrant  # axolotl's {"use_reentrant": True}
    assert not hf.layer_checkpoint_reentrant  # transformers 5.x: non-reentrant
    assert ax.step_implementation == "fused"  # adamw_torch_fused, its schema default
    assert hf.step_implementation == "foreach"  # the Trainer's adamw_torch before torch 2.8
    assert TrainingConfig(framework="axolotl").activation_checkpointing == "none"
    off = TrainingConfig(
        framework="axolotl", activation_checkpointing="full", checkpoint_reentrant=False
    )
    assert not off.layer_checkpoint_reentrant


def test_llama_factory_lora_bytes_over_hf_trainer(invoke_json: InvokeJson) -> None:
    lf = invoke_json("estimate", MODEL, "--framework", "llama-factory", *BASE)
    hf = invoke_json("estimate", MODEL, "--framework", "hf-trainer", *BASE)
    states_lf, states_hf = lf["model_states_bytes"], hf["model_states_bytes"]
    assert states_lf["gradients"] - states_hf["gradients"] == EXTRA_TRAINABLE * 4 == 30_208
    assert (
        states_lf["optimizer_states"] - states_hf["optimizer_states"]
        == EXTRA_TRAINABLE * 8
        == 60_416
    )
    assert lf["config"]["activation_checkpointing"] == "full"
    # hf-trainer given LLaMA-Factory's three defaults is the same step, byte for byte
    spelled = invoke_json(
        "estimate", MODEL, "--framework", "hf-trainer", *BASE,
        "--activation-checkpointing", "full", "--set", "checkpoint-reentrant=true",
        "--lora-targets", ",".join(SEVEN),
    )  # fmt: skip
    assert spelled["peak"]["allocated_bytes"] == lf["peak"]["allocated_bytes"]
    assumed = lf["details"]["assumed"]
    assert assumed["framework"] == "llama-factory"
    assert "0.9.5" in assumed["framework_means"]


@pytest.mark.parametrize("framework", ["llama-factory", "axolotl"])
def test_cli_and_page_offer_the_presets(invoke_json: InvokeJson, framework: str) -> None:
    out = invoke_json("estimate", MODEL, "--framework", framework, *BASE)
    assert out["config"]["framework"] == framework
    assert out["details"]["assumed"]["framework"] == framework
    assert framework in CHOICES["framework"]


def test_bad_framework_lists_the_presets() -> None:
    from trainmem.errors import SpecError

    with pytest.raises(SpecError) as err:
        TrainingConfig(framework="llama_factory")
    text = str(err.value)
    assert "framework" in text and "llama-factory" in text and "axolotl" in text


@pytest.mark.parametrize("framework", ["llama-factory", "axolotl", "trl"])
def test_a_diffusers_model_is_not_applicable_under_the_llm_stacks(framework: str) -> None:
    # found by benchmarks/generic_options.py (session 19): on PixArt llama-factory's LoRA
    # targets named a 'gate' linear it has not, and axolotl's reentrant checkpoint failed inside
    # the trace; neither stack loads a diffusers model (transformers Auto classes only); TRL's
    # SFTTrainer neither (trl v0.26.0 trainer/sft_trainer.py: AutoModelForCausalLM or the
    # image-text-to-text class; session 24: it had run on PixArt as the HF Trainer)
    pytest.importorskip("diffusers")
    from trainmem.errors import NotApplicableError
    from trainmem.estimate import estimate

    pixart = str(Path(__file__).parents[1] / "models" / "diffusers" / "tiny-pixart.json")
    training = TrainingConfig(micro_batch_size=2, seq_len=64, framework=framework, lora_rank=16)
    with pytest.raises(NotApplicableError, match=f"framework={framework}: .* use --framework"):
        estimate(pixart, training, engine="generic", simulate_allocator=False)


@pytest.mark.parametrize("model", ["diffusers/tiny-pixart.json", "timm:test_vit"])
def test_modules_to_save_is_not_applicable_on_a_diffusers_or_timm_model(model: str) -> None:
    # session 25 (generic_options.py "lora r16 + modules to save"): PixArt ran as if the option
    # were not given (diffusers' add_adapter path takes no modules_to_save), timm's ViT failed
    # as unsupported; neither has the token embedding / LM head the names stand for
    from trainmem.errors import NotApplicableError
    from trainmem.estimate import estimate

    if model.startswith("diffusers"):
        pytest.importorskip("diffusers")
        model = str(Path(__file__).parents[1] / "models" / model)
    else:
        pytest.importorskip("timm")
    length = {"seq_len": 64} if model.endswith(".json") else {}  # timm: its image size
    training = TrainingConfig(
        micro_batch_size=2,
        lora_rank=16,
        lora_modules_to_save=("embed_tokens", "lm_head"),
        **length,  # type: ignore[arg-type]
    )
    with pytest.raises(NotApplicableError, match="lora_modules_to_save=embed_tokens,lm_head"):
        estimate(model, training, engine="generic", simulate_allocator=False)
