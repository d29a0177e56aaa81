"""TRL releases as an input with a default (issue 24 item 1): ``--framework trl`` /
``--trl-version`` (``TrainingConfig.trl_release``), each rule against a hand derivation from
TRL's source.

From trl v0.26.0 trl/trainer/sft_trainer.py:703-718 (and 1.16.0, ``if _is_quantized_model:``)
``SFTTrainer`` calls ``get_peft_model`` alone (no ``prepare_model_for_kbit_training``) and then
casts every trainable parameter of a bitsandbytes model to bf16. On GT146's configuration
(Mistral-7B: V = 32,000, h = 4,096, 8 kv heads of 128 so k / v are 1,024 wide; LoRA r = 16 on
q, k, v, o over 32 layers):

- adapters per layer: q r (h + h) = 131,072, k r (h + 1,024) = 81,920, v 81,920, o 131,072:
  425,984; all layers 13,631,488 elements. bf16: 27,262,976 B of weights, as many of
  gradients, 2 x 27,262,976 = 54,525,952 B of AdamW states (``torch.zeros_like``), where peft's
  fp32 adapters take twice each (54,525,952 / 54,525,952 / 109,051,904);
- embeddings and LM head stay as loaded, 2 V h = 262,144,000 B each (peft's upcast: 4 V h =
  524,288,000), the final RMSNorm 2 h = 8,192 B (upcast: 16,384).

Checkpointing: ``SFTConfig.gradient_checkpointing`` defaults to True from 0.22.0
(sft_config.py:111-112; 0.21.0 has no such field), 0.27.0's ``SFTConfig.__post_init__``
(sft_config.py:281-287) sets ``use_reentrant=False`` under transformers < 5, 0.28.0's
``SFTTrainer.__init__`` (sft_trainer.py:728-742) forces it True for PEFT under ZeRO-3.
"""

from __future__ import annotations

import pytest

from trainmem.analytic.tensor_states import tensor_states
from trainmem.errors import SpecError
from trainmem.specs import assumptions as assumptions_module
from trainmem.specs import frameworks
from trainmem.specs.assumptions import assumptions
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig, trainer_sharding

V, H = 32000, 4096
ADAPTERS = 32 * (16 * (H + H) + 2 * 16 * (H + 1024) + 16 * (H + H))
QLORA = {
    "quantize_base": "nf4-dq",
    "lora_rank": 16,
    "lora_targets": ("q", "k", "v", "o"),
    "precision": "bf16-mixed",
    "micro_batch_size": 4,
    "seq_len": 4096,
    "activation_checkpointing": "full",
}


@pytest.fixture
def no_trl(monkeypatch: pytest.MonkeyPatch) -> None:
    """No TRL installed: the default is the newest release modelled."""
    for module in (frameworks, assumptions_module):
        monkeypatch.setattr(module, "installed_version", lambda _name: None)


def _installed(monkeypatch: pytest.MonkeyPatch, release: tuple[int, ...]) -> None:
    for module in (frameworks, assumptions_module):
        monkeypatch.setattr(
            module, "installed_version", lambda name: release if name == "trl" else None
        )


def _training(**changes: object) -> TrainingConfig:
    return TrainingConfig(**{**QLORA, **changes})  # type: ignore[arg-type]


def _bytes(training: TrainingConfig) -> dict[str, tuple[int, int, int]]:
    """Each tensor's (weights, gradients, optimizer states) bytes, summed over the model."""
    model = load_model_spec("mistral-7b-v0.1")
    out: dict[str, tuple[int, int, int]] = {}
    for s in tensor_states(model, training):
        key = "lora" if s.name.startswith("lora_") else s.name
        w, g, o = out.get(key, (0, 0, 0))
        out[key] = (w + s.full_param_bytes, g + s.grad_bytes, o + s.state_bytes)
    return out


@pytest.mark.usefixtures("no_trl")
def test_from_026_no_kbit_preparation_and_bf16_adapters() -> None:
    for training in (_training(framework="trl"), _training(trl_version="0.26.0")):
        assert training.trl_bf16_adapters and not training.kbit_fp32_upcast
        assert not training.trl_bf16_embeddings
        ours = _bytes(training)
        assert ours["lora"] == (2 * ADAPTERS, 2 * ADAPTERS, 4 * ADAPTERS)
        assert ours["lora"] == (27_262_976, 27_262_976, 54_525_952)
        assert ours["embedding/tokens"][0] == ours["lm_head"][0] == 2 * V * H == 262_144_000
        assert ours["final_norm"][0] == 2 * H
    peft = _bytes(_training(framework="hf-trainer"))  # a plain Trainer + peft's preparation
    assert peft["lora"] == (4 * ADAPTERS, 4 * ADAPTERS, 8 * ADAPTERS)
    assert peft["embedding/tokens"][0] == 4 * V * H and peft["final_norm"][0] == 4 * H


def test_default_is_the_installed_trl(monkeypatch: pytest.MonkeyPatch) -> None:
    _installed(monkeypatch, (0, 13, 0))
    training = _training(framework="trl")
    assert training.trl_release == (0, 13, 0)
    assert training.trl_bf16_embeddings and not training.trl_bf16_adapters
    assert assumptions({"framework": "trl", **QLORA})["trl"] == "0.13.0 (installed)"
    # an explicit release always wins, even the installed one's or the default's
    given = _training(framework="trl", trl_version="1.16.0")
    assert given.trl_release == (1, 16, 0) and given.trl_bf16_adapters
    config = {"framework": "trl", "trl_version": "0.13.0", **QLORA}
    assert assumptions(config)["trl"] == "0.13.0"


@pytest.mark.usefixtures("no_trl")
def test_default_without_trl_installed_is_the_newest_modelled() -> None:
    assert _training(framework="trl").trl_release == (1, 16, 0)
    said = assumptions({"framework": "trl", **QLORA})["trl"]
    assert said == "1.16.0 (default: none installed, the newest modelled)"
    # no SFTTrainer elsewhere unless a release is given: nothing to say
    assert "trl" not in assumptions({"framework": "hf-trainer", **QLORA})
    assert _training(framework="hf-trainer").trl_release is None


@pytest.mark.parametrize(
    ("changes", "cast"),
    [
        ({"framework": "unsloth"}, False),  # unsloth/models/rl.py rewrites the cast to if False
        ({"quantize_base": "gptq-int4"}, False),  # no is_loaded_in_4bit on a GPTQ model
        ({"quantize_base": "int8"}, True),  # is_loaded_in_8bit
        ({"precision": "16-mixed"}, True),  # bf16 whatever fp16 says
    ],
)
def test_where_trl_casts_the_adapters(changes: dict[str, object], cast: bool) -> None:
    training = _training(trl_version="1.16.0", **changes)
    assert training.trl_bf16_adapters is cast


@pytest.mark.parametrize(
    ("release", "checkpointing"), [("0.21.0", "none"), ("0.22.0", "full"), ("1.16.0", "full")]
)
def test_sft_config_checkpointing_default_by_release(release: str, checkpointing: str) -> None:
    training = TrainingConfig(framework="trl", trl_version=release)
    assert training.activation_checkpointing == checkpointing
    # an explicit value always wins
    given = TrainingConfig(framework="trl", trl_version=release, activation_checkpointing="none")
    assert given.activation_checkpointing == "none"


def test_use_reentrant_by_release() -> None:
    # transformers 4.57: its own default is reentrant (4.37 .. 5.0)
    def reentrant(**changes: object) -> bool:
        settings = {"framework": "trl", "transformers_version": "4.57.6", **changes}
        return TrainingConfig(**settings).hf_checkpoint_reentrant  # type: ignore[arg-type]

    assert reentrant(trl_version="0.26.2") is True
    assert reentrant(trl_version="0.27.0") is False  # setdefault("use_reentrant", False)
    assert reentrant(trl_version="0.27.0", checkpoint_reentrant=True) is True  # explicit wins
    zero3 = {"framework": "deepspeed", "zero_stage": 3, "data_parallel_size": 2, "lora_rank": 8}
    assert reentrant(**{**zero3, "trl_version": "0.28.0"}) is True  # forced for PEFT + ZeRO-3
    assert reentrant(**{**zero3, "trl_version": "0.27.2"}) is False


@pytest.mark.usefixtures("no_trl")
def test_sharded_trl_keeps_its_release() -> None:
    # --framework trl --zero-stage 3 runs DeepSpeed under SFTTrainer: its release carries over
    settings: dict[str, object] = {"framework": "trl", "zero_stage": 3, "data_parallel_size": 2}
    assert trainer_sharding(settings, None) == "trl"
    assert settings["framework"] == "deepspeed" and settings["trl_version"] == "1.16.0"
    assert settings["activation_checkpointing"] == "full"


@pytest.mark.parametrize("bad", ["latest", "0.x", "v1.16"])
def test_a_bad_release_names_the_field_and_the_ranges(bad: str) -> None:
    with pytest.raises(SpecError) as err:
        TrainingConfig(framework="trl", trl_version=bad)
    text = str(err.value)
    assert err.value.field == "trl_version" and "allowed:" in text
    assert "0.9.3 .. 0.25" in text and "from 0.26" in text
