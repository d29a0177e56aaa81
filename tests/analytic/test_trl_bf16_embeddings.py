"""TRL's ``SFTTrainer`` (0.9.3 .. 0.25) after peft's k-bit preparation: the embeddings and LM
head back to bf16 (``TrainingConfig.trl_bf16_embeddings``, ``--trl-version``).

Hand derivation from trl v0.13.0 (the fms-acceleration rows' pin, refs/requirements.txt
@24bdadb): ``SFTTrainer.__init__`` with a ``peft_config`` and an unsharded 4-bit base runs
``prepare_model_for_kbit_training`` (peft: every non-``Params4bit`` 16-bit parameter to fp32),
``get_peft_model``, then under ``args.bf16`` ``peft_module_casting_to_bf16`` (trl/trainer/
utils.py): modules named ``*norm*`` to fp32, ``lm_head`` / ``embed_tokens`` / ``wte`` / ``wpe``
from fp32 to bf16. Mistral-7B (vocabulary V = 32,000, hidden h = 4,096): the embedding and the
untied head are 2 x V x h = 262,144,000 B each instead of 524,288,000; the final RMSNorm stays
4 x h = 16,384 B; and autocast no longer casts the head weight for its matmul (``cached_cast``
casts only another dtype; aten/src/ATen/autocast_mode.cpp), so the 2 x V x h = 262,144,000 B
copy the head's matmul saved is gone.
"""

from __future__ import annotations

import pytest

from trainmem.analytic.head import head_activation_bytes
from trainmem.analytic.tensor_states import tensor_states
from trainmem.errors import SpecError
from trainmem.specs.frameworks import trl_bf16_tensors
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

V, H = 32000, 4096
# GT146's configuration (fms-acceleration baseline-peft-bnb, one GPU)
QLORA = {
    "framework": "hf-trainer",
    "quantize_base": "nf4-dq",
    "lora_rank": 16,
    "lora_targets": ("q", "k", "v", "o"),
    "precision": "bf16-mixed",
    "micro_batch_size": 4,
    "seq_len": 4096,
    "activation_checkpointing": "full",
}


def _training(**changes: object) -> TrainingConfig:
    return TrainingConfig(**{**QLORA, **changes})  # type: ignore[arg-type]


def _states(training: TrainingConfig) -> dict[str, int]:
    model = load_model_spec("mistral-7b-v0.1")
    return {s.name: s.full_param_bytes for s in tensor_states(model, training)}


def test_trl_casts_the_embeddings_and_head_back_to_bf16() -> None:
    trl, peft = _training(trl_version="0.13.0"), _training()
    assert trl.kbit_fp32_upcast and trl.trl_bf16_embeddings
    assert peft.kbit_fp32_upcast and not peft.trl_bf16_embeddings
    ours, theirs = _states(trl), _states(peft)
    assert ours["embedding/tokens"] == ours["lm_head"] == 2 * V * H == 262_144_000
    assert theirs["embedding/tokens"] == theirs["lm_head"] == 4 * V * H == 524_288_000
    assert ours["final_norm"] == theirs["final_norm"] == 4 * H  # "norm" stays fp32


def test_no_autocast_copy_of_a_bf16_head_weight() -> None:
    model = load_model_spec("mistral-7b-v0.1")
    ours = head_activation_bytes(model, _training(trl_version="0.13.0"))
    theirs = head_activation_bytes(model, _training())
    assert theirs["autocast_weight_copies"] == 2 * V * H == 262_144_000
    assert "autocast_weight_copies" not in ours


@pytest.mark.parametrize(
    "changes",
    [
        {"trl_version": "0.7.4"},  # before peft_module_casting_to_bf16 (PR #1110)
        {"trl_version": "0.13.0", "precision": "16-mixed"},  # args.fp16: no bf16 cast
        {"trl_version": "0.13.0", "quantize_base": "int8"},  # is_loaded_in_8bit: prepared only
        {"trl_version": "0.13.0", "prepare_kbit_training": False},  # no preparation, no cast
        # FSDP's sharded base (is_sharded_qlora): neither, whatever the release
        {"trl_version": "0.26.0", "data_parallel_size": 2, "fsdp": "full-shard"},
    ],
)
def test_where_trl_does_not_cast(changes: dict[str, object]) -> None:
    fsdp = changes.pop("fsdp", None)
    if fsdp:
        changes.update(framework="accelerate-fsdp", zero_stage=3)
    training = _training(**changes)
    assert not training.trl_bf16_embeddings


def test_releases_whose_preparation_is_not_modelled_are_refused() -> None:
    # 0.7.5 .. 0.8.6 cast the LoRA layers to bf16 too (PR #1644 stopped it); from 0.26 the
    # preparation is gone and is modelled (tests/analytic/test_trl_releases.py)
    with pytest.raises(SpecError) as err:
        _training(trl_version="0.8.6")
    assert err.value.field == "trl_version" and "0.7.5 .. 0.8.6" in str(err.value)
    assert "allowed:" in str(err.value) and "from 0.26" in str(err.value)


def test_the_module_names_trl_matches_per_family() -> None:
    # transformers' module names: model.embed_tokens / lm_head (Llama, Mistral, Qwen2...),
    # transformer.wte / wpe (GPT-2), gpt_neox.embed_in / embed_out (transformers 4), BLOOM's
    # and Falcon's transformer.word_embeddings tied to lm_head (cast with it)
    assert trl_bf16_tensors("mistral", tied=False) == ("embedding/tokens", "lm_head")
    assert "embedding/positions" in trl_bf16_tensors("gpt2", tied=True)
    assert trl_bf16_tensors("gpt_neox", tied=False) == ()
    assert trl_bf16_tensors("falcon", tied=True) == ("embedding/tokens", "lm_head")
    assert trl_bf16_tensors("falcon", tied=False) == ("lm_head",)
