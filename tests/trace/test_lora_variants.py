"""peft's LoRA variants traced for real (issue 26, ``--lora-variant``): peft's own DoRA code runs
on fake tensors on the generic path; its bytes are checked by hand (tiny-llama-test) and
against the analytic formulas (Note [DoRA] in ``analytic/lora_variants.py``) on
tests/models/lora_variants/llama_h1024.json (2 layers, h 1024, MLP 2816), b 2 x s 256, r 16,
bf16-mixed (slow: the all-linear run peaks in the forward, at down_proj's weight norm)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from trainmem.breakdown import MemoryEstimate
from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

pytest.importorskip("torch")
pytest.importorskip("peft")

MODEL = str(Path(__file__).resolve().parents[1] / "models" / "lora_variants" / "llama_h1024.json")
LORA = TrainingConfig(micro_batch_size=2, seq_len=256, lora_rank=16, lora_targets=("q", "v"))
ALL = ("q", "k", "v", "o", "gate", "up", "down")


def _run(training: TrainingConfig, engine: str = "generic") -> MemoryEstimate:
    return estimate(MODEL, training, engine=engine, simulate_allocator=False)


def test_traced_dora_adds_what_peft_saves() -> None:
    # tiny-llama-test: 2 layers, h 64, 4 heads of 16, 2 KV heads -> q out 64, v out 32;
    # b 2 x s 64 = 128 tokens, r 8
    small = TrainingConfig(micro_batch_size=2, seq_len=64, lora_rank=8, lora_targets=("q", "v"))
    runs = [
        estimate("tiny-llama-test", dataclasses.replace(small, lora_variant=v), engine="generic",
                 simulate_allocator=False).breakdown
        for v in ("lora", "dora")
    ]  # fmt: skip
    lora, dora = runs
    outs, t = 64 + 32, 128
    magnitude = 2 * outs  # 2 layers: lora_magnitude_vector [out] fp32
    assert dora.parameters - lora.parameters == 4 * magnitude
    assert dora.optimizer_states - lora.optimizer_states == 8 * magnitude
    # base_result and lora_result [t, out] bf16 and three fp32 [out] vectors per linear and
    # layer, but mag_norm_scale - 1 is not saved in layer 0 (its input needs no grad)
    saved = 2 * (4 * t * outs + 12 * outs) - 4 * outs
    assert dora.allocated_bytes - lora.allocated_bytes == saved + 12 * magnitude


@pytest.mark.parametrize(
    "changes",
    [
        {},
        pytest.param({"lora_dropout": 0.1}, marks=pytest.mark.slow),
        pytest.param({"lora_targets": ALL}, marks=pytest.mark.slow),
        pytest.param({"lora_targets": ALL, "precision": "bf16-true"}, marks=pytest.mark.slow),
    ],
    ids=["q,v", "q,v-dropout", "all-linear", "all-linear-bf16-true"],
)
def test_dora_step_agrees_with_the_formulas(changes: dict[str, object]) -> None:
    # the whole step within 1 % (q,v: the peak in the backward; all-linear: in the forward, at
    # down_proj's weight norm, Note [DoRA forward transients])
    dora = dataclasses.replace(LORA, lora_variant="dora", **changes)  # type: ignore[arg-type]
    g, a = _run(dora), _run(dora, "analytic")
    assert a.peak_phase == g.peak_phase
    gap = a.breakdown.allocated_bytes - g.breakdown.allocated_bytes
    assert abs(gap) <= 0.01 * g.breakdown.allocated_bytes


@pytest.mark.slow
def test_diffusers_dora_trains_a_magnitude_per_targeted_linear() -> None:
    pytest.importorskip("diffusers")
    import diffusers
    import torch

    unet = str(Path(__file__).parent / "diffusers_configs" / "tiny-sdxl-unet.json")
    base = TrainingConfig(
        precision="bf16-true", resolution=64, text_seq_len=16, lora_rank=4,
        lora_targets=("q", "k", "v", "o"),
    )  # fmt: skip
    lora = estimate(unet, base, engine="generic", simulate_allocator=False)
    dora = estimate(
        unet, dataclasses.replace(base, lora_variant="dora"), engine="generic",
        simulate_allocator=False,
    )  # fmt: skip
    # counted from diffusers' own module tree: out_features of to_q / to_k / to_v / to_out.0
    config = diffusers.UNet2DConditionModel.load_config(unet)
    with torch.device("meta"):
        model = diffusers.UNet2DConditionModel.from_config(config)
    suffixes = ("to_q", "to_k", "to_v", "to_out.0")
    outs = sum(
        m.out_features
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and n.endswith(suffixes)
    )
    assert dora.num_trainable_parameters - lora.num_trainable_parameters == outs


SMALL = TrainingConfig(micro_batch_size=2, seq_len=64, lora_rank=8, lora_targets=("q", "v"))
"""tiny-llama-test (2 layers; q 64 -> 64, v 64 -> 32), r 8."""


def _small(variant: str) -> MemoryEstimate:
    training = dataclasses.replace(SMALL, lora_variant=variant)
    return estimate("tiny-llama-test", training, engine="generic", simulate_allocator=False)


def test_adalora_runs_peft_svd_adapters_at_init_r() -> None:
    # peft tuners/adalora/layer.py update_layer: lora_A [r, in], lora_B [out, r], lora_E [r, 1]
    # trainable; ranknum a 1-element fp32 parameter without grad; r = init_r = --lora-rank
    est = _small("adalora")
    per_layer = (8 * 64 + 64 * 8 + 8) + (8 * 64 + 32 * 8 + 8)
    assert est.num_trainable_parameters == 2 * per_layer
    lora = _small("lora")
    assert est.breakdown.parameters - lora.breakdown.parameters == 4 * (2 * 2 * 8) + 4 * 4


def test_lokr_runs_peft_kronecker_factors() -> None:
    # peft tuners/lokr/layer.py update_layer with decompose_factor -1: out = a * c, in = b * d
    # from factorization() (64 = 8 x 8, 32 = 4 x 8); w1 [a, b] whole, w2 [c, d] whole since
    # r 8 >= max(c, d) / 2: q 8*8 + 8*8, v 4*8 + 8*8 per layer
    # (engine auto: the formulas refuse LoKr, the generic path runs it)
    est = estimate("tiny-llama-test", dataclasses.replace(SMALL, lora_variant="lokr"))
    assert est.engine == "generic"
    assert "lora_variant lokr is not modelled by the formulas" in est.notes[0]
    assert est.num_trainable_parameters == 2 * ((8 * 8 + 8 * 8) + (4 * 8 + 8 * 8))


def test_loha_runs_peft_hadamard_pairs() -> None:
    # peft tuners/loha/layer.py create_adapter_parameters on a Linear: hada_w1_a / hada_w2_a
    # [out, r], hada_w1_b / hada_w2_b [r, in], all four trainable: 2 r (out + in) per linear,
    # q 2*8*(64+64), v 2*8*(32+64) per layer (engine auto: the formulas refuse LoHa)
    est = estimate("tiny-llama-test", dataclasses.replace(SMALL, lora_variant="loha"))
    assert est.engine == "generic"
    assert "lora_variant loha is not modelled by the formulas" in est.notes[0]
    assert est.num_trainable_parameters == 2 * (2 * 8 * (64 + 64) + 2 * 8 * (32 + 64))
    # its update rebuilt to full size in the forward (HadaWeight: (w1a @ w1b) * (w2a @ w2b)),
    # so the step holds more than LoRA's at the same rank
    assert est.breakdown.allocated_bytes > _small("lora").breakdown.allocated_bytes


def test_adalora_and_lokr_are_refused_by_the_formulas_and_lokr_dropout_by_the_spec() -> None:
    with pytest.raises(UnsupportedError, match="lora_variant adalora is not modelled .* generic"):
        estimate("tiny-llama-test", dataclasses.replace(SMALL, lora_variant="adalora"),
                 engine="analytic")  # fmt: skip
    with pytest.raises(SpecError, match="lora_dropout: 0.1: peft's LoKr has no input dropout"):
        TrainingConfig(lora_rank=8, lora_variant="lokr", lora_dropout=0.1)
    with pytest.raises(SpecError, match="lora_dropout: 0.1: peft's LoHa has no input dropout"):
        TrainingConfig(lora_rank=8, lora_variant="loha", lora_dropout=0.1)


def test_lokr_on_conv1d_linears_is_refused_naming_what_runs() -> None:
    # Found by fuzzing (session 17): GPT-2's linears are transformers Conv1D, which peft's
    # LoKr does not adapt (peft tuners/lycoris_utils.py raised TypeError, a traceback)
    with pytest.raises(SpecError, match=r"lora_variant: lokr: peft's LoKr .* allowed: lora, dora"):
        estimate("tiny-gpt2-test", TrainingConfig(seq_len=16, lora_rank=4, lora_variant="lokr"),
                 engine="generic", simulate_allocator=False)  # fmt: skip


@pytest.mark.parametrize(
    ("framework", "variant"),
    [("fsdp-qlora", "lokr"), ("accelerate-fsdp", "adalora"), ("accelerate-fsdp", "loha")],
)
def test_fsdp1_refuses_adapters_it_cannot_flatten(framework: str, variant: str) -> None:
    # Found by fuzzing (session 17): FSDP1 with use_orig_params=False raised torch's
    # "Must flatten tensors with uniform requires_grad" on the generic path (a traceback)
    with pytest.raises(SpecError, match=rf"lora_variant: {variant} with --framework {framework}"):
        TrainingConfig(lora_rank=4, lora_variant=variant, framework=framework)
    if framework == "fsdp-qlora":  # its DoRA is its own BNBDORA layer (helper dora2)
        with pytest.raises(SpecError, match=r"lora_variant: dora under --framework fsdp-qlora"):
            TrainingConfig(lora_rank=4, lora_variant="dora", framework=framework)
    else:  # DoRA's magnitude is a trainable parameter of its own: the wrap policy's
        TrainingConfig(lora_rank=4, lora_variant="dora", framework=framework)
