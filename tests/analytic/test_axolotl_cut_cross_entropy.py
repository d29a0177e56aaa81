"""axolotl's Cut Cross Entropy plugin (issue 24): the setting, its reading from an axolotl
config, and its bytes, by hand from axolotl-ai-cloud/ml-cross-entropy 5f0c7a7 (the fork
axolotl v0.18.0 pins): cce.py ``LinearCrossEntropyFunction`` and cce_backward.py
``cce_backward_kernel`` (Note [axolotl's Cut Cross Entropy] in trainmem/analytic/loss.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainmem.analytic.head import head_activation_bytes
from trainmem.analytic.loss import (
    loss_backward_transient_bytes,
    loss_forward_transient_bytes,
)
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.trainer_configs import read_axolotl_config
from trainmem.specs.training import TrainingConfig

ALL_LINEAR = ("q", "k", "v", "o", "gate", "up", "down")
PLUGIN = "plugins: [axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin]\n"


def _axolotl(**kw: object) -> TrainingConfig:
    base: dict[str, object] = {
        "framework": "axolotl",
        "precision": "bf16-true",
        "micro_batch_size": 2,
        "seq_len": 2048,
        "lora_rank": 16,
        "lora_targets": ALL_LINEAR,
    }
    return TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_the_fork_saves_no_logits_and_makes_no_classifier_gradient() -> None:
    # llama-2-7b: h 4096, V 32000; t = 2 x 2048 = 4096 tokens, bf16 (2 B).
    # forward: ctx.save_for_backward(e, c, bias, lse, targets, valids, logit_avg): e the final
    # norm's output (2 h per token), lse fp32 per token, logit_avg fp32 per vocabulary entry
    # (filter_eps "auto"); no (t x V) tensor; backward: de = zeros_like(e) (2 h per token),
    # dc = zeros_like(c) only if c.requires_grad: a frozen head has none (Unsloth's older
    # Cut Cross Entropy made it anyway)
    llama = load_model_spec("llama-2-7b")
    t = 4096
    cut = _axolotl(cut_cross_entropy=True)
    head = head_activation_bytes(llama, cut)
    assert head["lm_head_input"] == 2 * 4096 * t
    assert (head["cut_ce_lse"], head["cut_ce_logit_avg"]) == (4 * t, 4 * 32000)
    assert "log_softmax" not in head
    assert loss_forward_transient_bytes(llama, cut) == 0
    assert loss_backward_transient_bytes(llama, cut) == 2 * 4096 * t
    # without the plugin: the fp32 log-softmax (4 V per token) and no head input (frozen)
    plain = head_activation_bytes(llama, _axolotl())
    assert plain["log_softmax"] == 4 * 32000 * t and "lm_head_input" not in plain
    # the whole step: the peak is no longer the loss's
    with_cut = estimate(llama, cut, simulate_allocator=False)
    without = estimate(llama, _axolotl(), simulate_allocator=False)
    assert with_cut.breakdown.allocated_bytes < without.breakdown.allocated_bytes
    assert "loss" not in with_cut.peak_reason


def test_the_reader_takes_the_plugin_and_its_key(tmp_path: Path) -> None:
    def read(text: str) -> tuple[dict[str, object], list[str]]:
        path = tmp_path / "a.yml"
        path.write_text(text)
        notes: list[str] = []
        return read_axolotl_config(str(path), notes), notes

    # args.py CutCrossEntropyArgs.cut_cross_entropy: default True once the plugin is listed
    out, notes = read(PLUGIN)
    assert out["cut_cross_entropy"] is True
    assert not any("CutCrossEntropyPlugin" in n for n in notes if "ignored" in n)
    out, _ = read(PLUGIN + "cut_cross_entropy: false\n")
    assert out["cut_cross_entropy"] is False
    # the key without the plugin is not axolotl's: ignored, said
    out, notes = read("cut_cross_entropy: true\n")
    assert "cut_cross_entropy" not in out
    assert any("cut_cross_entropy (no CutCrossEntropyPlugin" in n for n in notes)
    # another plugin is still listed as ignored
    out, notes = read("plugins: [axolotl.integrations.liger.LigerPlugin]\n")
    assert "cut_cross_entropy" not in out
    assert any("plugins LigerPlugin" in n for n in notes)
    with pytest.raises(SpecError, match="plugins"):
        read("plugins: CutCrossEntropyPlugin\n")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        # args.py check_chunked_cross_entropy_not_set
        ({"chunked_cross_entropy": 8}, "cut_cross_entropy"),
        ({"loss": "logits-sum"}, "cut_cross_entropy"),
        ({"framework": "litgpt", "lora_targets": None}, "cut_cross_entropy"),
        ({"framework": "unsloth"}, "cut_cross_entropy"),
        ({"tensor_parallel_size": 2}, "cut_cross_entropy"),
    ],
)
def test_refused_where_the_plugin_does_not_run(changes: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError) as info:
        _axolotl(cut_cross_entropy=True, **changes)
    assert info.value.field == field


def test_refused_on_a_model_without_a_causal_lm_head() -> None:
    from trainmem.specs.training import check_training_for_model

    bert = load_model_spec("bert-base-uncased")
    with pytest.raises(SpecError) as info:
        check_training_for_model(bert, TrainingConfig(cut_cross_entropy=True))
    assert info.value.field == "cut_cross_entropy"
