"""Cells of issue 26's "the generic path agrees with the formulas within 1 % where both run"
that were outside it, each checked after the mechanism that closed it (generic / formulas - 1
on the 2-layer 2048-wide agreement Llama, tests/models/agreement/llama_h2048.json, at
2 x 256 tokens; the mechanism's bytes by hand in the analytic test named per cell).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import MODELS_DIR, TESTS_DIR
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

pytest.importorskip("transformers")

TOLERANCE = 0.01
AGREEMENT = json.loads((MODELS_DIR / "agreement" / "llama_h2048.json").read_text())


def _gap(
    tmp_path: Path, config: dict[str, Any], base: dict[str, Any] = AGREEMENT, **settings: Any
) -> float:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, **config}))
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **settings)
    g = estimate(str(path), training, engine="generic", simulate_allocator=False)
    a = estimate(str(path), training, engine="analytic", simulate_allocator=False)
    return g.breakdown.allocated_bytes / a.breakdown.allocated_bytes - 1


def test_tied_head_under_autocast_and_accumulation(tmp_path: Path) -> None:
    """Vocabulary 32,000, tied, bf16 autocast, accumulation 4: the peak is the head weight's
    fp32 gradient cast beside its bf16 form (Note [The LM head's matmul backward];
    tests/analytic/test_head_matmul_backward.py). +2.09 % before it."""
    tied = {"vocab_size": 32_000, "tie_word_embeddings": True}
    gap = _gap(tmp_path, tied, gradient_accumulation_steps=4, framework="hf-trainer")
    assert abs(gap) <= TOLERANCE, f"{gap:+.2%}"


def test_tied_head_under_deepspeed_zero2_and_accumulation(tmp_path: Path) -> None:
    """Vocabulary 32,000, tied, DeepSpeed ZeRO-2 over 4 ranks, accumulation 4: the peak is the
    tied weight's out-of-place sum beside the head's whole new gradient (Note [A tied gradient
    under DeepSpeed ZeRO-2/3]; tests/analytic/test_head_embedding_new_gradients.py). +4.37 %
    before it."""
    tied = {"vocab_size": 32_000, "tie_word_embeddings": True}
    zero2 = {"zero_stage": 2, "framework": "deepspeed", "data_parallel_size": 4}
    gap = _gap(tmp_path, tied, gradient_accumulation_steps=4, **zero2)
    assert abs(gap) <= TOLERANCE, f"{gap:+.2%}"


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_deepspeed_zero3_gathers_at_the_traced_modules(tmp_path: Path, tied: bool) -> None:
    """Vocabulary 32,000, DeepSpeed ZeRO-3 over 4 ranks, accumulation 4: the traced step's
    gathers placed at its modules as the formulas place them (Note [Traced ZeRO-3]; sizes by
    hand in tests/trace/test_traced_transforms.py ``test_zero3_of_a_traced_qwen2_by_hand``).
    Tied +2.98 % (after Note [A tied gradient under DeepSpeed ZeRO-2/3]; +4.35 % before it),
    untied -4.96 % before it."""
    config = {"vocab_size": 32_000, "tie_word_embeddings": tied}
    zero3 = {"zero_stage": 3, "framework": "deepspeed", "data_parallel_size": 4}
    gap = _gap(tmp_path, config, gradient_accumulation_steps=4, **zero3)
    assert abs(gap) <= TOLERANCE, f"{gap:+.2%}"


DEEPSEEK = json.loads(
    (TESTS_DIR / "analytic" / "hard_configs" / "tiny-deepseek-v3.json").read_text()
)


@pytest.mark.parametrize(
    ("dense", "targets"),
    [(1, "q,k,v,o"), (1, "o"), (0, "q,k,v,o"), (2, "q,k,v,o")],
    ids=["dense+moe q,k,v,o", "dense+moe o", "moe q,k,v,o", "dense q,k,v,o"],
)
def test_deepseek_v3_lora_on_latent_attention(tmp_path: Path, dense: int, targets: str) -> None:
    """tiny-deepseek-v3 (first_k_dense_replace of its 2 layers as given), LoRA r8 at 2 x 256
    tokens: the MLA adapters' own input copies and out width, the first layer's unsaved
    tensors (Note [MLA under LoRA]; bytes by hand in tests/analytic/test_mla_lora.py) and an
    all-dense model without experts (tests/analytic/test_hard_families.py). Before: q,k,v,o
    -1.21 %, o -3.74 %, all MoE -1.06 %, all dense -7.08 %."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**DEEPSEEK, "first_k_dense_replace": dense}))
    training = TrainingConfig(
        micro_batch_size=2, seq_len=256, lora_rank=8, lora_targets=tuple(targets.split(","))
    )
    g = estimate(str(path), training, engine="generic", simulate_allocator=False)
    a = estimate(str(path), training, engine="analytic", simulate_allocator=False)
    gap = g.breakdown.allocated_bytes / a.breakdown.allocated_bytes - 1
    assert abs(gap) <= TOLERANCE, f"{gap:+.2%}"


@pytest.mark.parametrize("name", ["formula/mixtral.json", "qwen3_moe.json"])
def test_transformers5_moe_lora(name: str) -> None:
    """LoRA q,v r8 at 2 x 256 tokens over frozen experts: the router, the grouped matmuls
    and a shared expert's down projection keep no input (``_frozen_grouped_experts``,
    tests/analytic/test_moe_lora.py), and the traced grouped matmul keeps what torch's does
    (Note [Traced grouped matmul of frozen experts], tests/trace/test_grouped_mm.py).
    Before: Mixtral +3.41 %, Qwen3-MoE +0.22 % (two errors cancelling)."""
    training = TrainingConfig(micro_batch_size=2, seq_len=256, lora_rank=8, lora_targets=("q", "v"))
    path = str(MODELS_DIR / name)
    g = estimate(path, training, engine="generic", simulate_allocator=False)
    a = estimate(path, training, engine="analytic", simulate_allocator=False)
    gap = g.breakdown.allocated_bytes / a.breakdown.allocated_bytes - 1
    assert abs(gap) <= TOLERANCE, f"{gap:+.2%}"


def test_dora_q_v_under_full_checkpointing(tmp_path: Path) -> None:
    """DoRA r 16 on q / v, full checkpointing: the peak is layer 1's recompute at the frozen
    down projection, holding what LoRA's recompute holds there (Note [The recompute's tensors
    held at an autocast down projection]; ``recompute_holds_down_copy`` now admits DoRA that
    leaves down bare). -0.87 % before it (-1.20 % on the 1024-wide model)."""
    dora = {"lora_rank": 16, "lora_targets": ("q", "v"), "lora_variant": "dora"}
    gap = _gap(tmp_path, {}, activation_checkpointing="full", **dora)
    assert abs(gap) <= TOLERANCE, f"{gap:+.2%}"


_DORA_TARGETS = {
    "q,v": ("q", "v"),
    "o": ("o",),
    "q,k,v,o": ("q", "k", "v", "o"),
    "gate,up": ("gate", "up"),
    "all seven": ("q", "k", "v", "o", "gate", "up", "down"),
    "down": ("down",),
}


@pytest.mark.parametrize(
    ("targets", "checkpointing"),
    [(name, ac) for ac in ("full", "selective", "none") for name in _DORA_TARGETS],
)
def test_dora_targets_and_checkpointing(tmp_path: Path, targets: str, checkpointing: str) -> None:
    """DoRA r 16 on each target set under each checkpointing mode (issue 26). Before session
    22 (full / selective / none): o -8.18 / -8.35 / -4.00 %, q,k,v,o -7.98 / -6.21 / -2.13 %,
    gate,up -4.83 / -1.34 / -10.85 % (Note [DoRA's moment at each linear], Note [LoRA's first
    layer]; bytes by hand in tests/analytic/test_dora_moments.py). Selective before session
    23: q,v +1.70 %, q,k,v,o +1.69 %, gate,up +4.13 %, all seven +7.24 %, down +2.73 %
    (Note [The adapters' matmuls under op-level selective checkpointing]; the cached set by
    hand in tests/analytic/test_selective_adapter_matmuls.py)."""
    dora = {"lora_rank": 16, "lora_targets": _DORA_TARGETS[targets], "lora_variant": "dora"}
    g, a = _breakdowns(tmp_path, AGREEMENT, activation_checkpointing=checkpointing, **dora)
    fields = ["allocated_bytes"]
    if checkpointing != "none" and (targets, checkpointing) not in _CATEGORIES_LEFT:
        # by category too (Note [A recompute's unwound tensors], Note [DoRA's base output in
        # the recompute]): before session 27 activations +5.77 MB (c t i), all seven / down
        # full +83.0 MB, temporaries as much less
        fields += ["activations", "temporary"]
    for field in fields:
        gap = getattr(g, field) / getattr(a, field) - 1
        assert abs(gap) <= TOLERANCE, f"{field} {gap:+.2%}"


_CATEGORIES_LEFT = {
    ("gate,up", "full"),
    ("gate,up", "selective"),
    ("all seven", "selective"),
    ("down", "selective"),
}
"""DoRA cells whose total agrees but not each category (session 27, left): up's base output
(DoRA's ``base_result``, saved after up's norm) counted as a moment temporary by the formulas,
an activation block in the trace; under selective, up's / down's cached outputs (up's base
output, down's eye product) popped before the moment by the formulas, the cached activation
block in the trace."""


def _breakdowns(tmp_path: Path, base: dict[str, Any], **settings: Any) -> tuple[Any, Any]:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(base))
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **settings)
    g = estimate(str(path), training, engine="generic", simulate_allocator=False)
    a = estimate(str(path), training, engine="analytic", simulate_allocator=False)
    return g.breakdown, a.breakdown


_LORA_DROPOUT_TARGETS = {
    "q,v": ("q", "v"),
    "all seven": ("q", "k", "v", "o", "gate", "up", "down"),
}


@pytest.mark.parametrize(
    ("targets", "checkpointing"),
    [(name, ac) for ac in ("selective", "full") for name in _LORA_DROPOUT_TARGETS],
)
def test_lora_dropout_under_checkpointing(tmp_path: Path, targets: str, checkpointing: str) -> None:
    """LoRA r 16 with ``lora_dropout`` 0.1 under op-level selective / full checkpointing: the
    peak is layer 1's recompute at the down projection, holding what it holds without dropout
    and, with an adapter on down, peft's fp32 dropout output at lora_A's matmul (Note [The
    recompute's tensors held at an autocast down projection]; bytes by hand and a real CPU
    execution in tests/analytic/test_recompute_down_held.py). Before session 24 (the moment
    not modelled with dropout), selective / full: all seven +3.08 / +3.38 %, q,v -0.85 /
    -0.87 %."""
    lora = {"lora_rank": 16, "lora_targets": _LORA_DROPOUT_TARGETS[targets], "lora_dropout": 0.1}
    gap = _gap(tmp_path, {}, activation_checkpointing=checkpointing, **lora)
    assert abs(gap) <= TOLERANCE, f"{gap:+.2%}"


def test_dora_gate_up_under_selective_at_1024_wide(tmp_path: Path) -> None:
    """DoRA r 16 on gate / up, op-level selective checkpointing, the 1024-wide agreement Llama
    at 2 x 256 tokens: -1.09 % before session 25 (formulas 264,655,872 B, trace 261,758,520 B),
    a strict xfail diagnosed in session 24. Both peak at layer 1's recomputed up projection,
    in DoRA's weight norm (three fp32 [out, in] tensors, peft 0.21.2 tuners/lora/dora.py
    ``get_weight_norm``). With t = 512, h = 1,024, c = 2, r = a = 4, the formulas held there,
    against the trace, and now (bytes by hand in tests/analytic/test_dora_recompute_moments.py
    and test_dora_moments.py ``test_up_moment_by_hand``):

    * the cached q output (c t h = 1,048,576 B), which the recompute frees once RoPE has read
      it, and the cached v output beside a recomputed ``attention/v`` (SDPA saves the cached
      tensor): +2,097,152 B (Note [The cached q and v outputs in the recompute]);
    * the up moment's input as c t in + a t in with ``mlp/input`` holding up's lora_A 16-bit
      copy, made only after the norm; peft's cast of the fp32 norm output is the tensor itself:
      +2,097,152 B (Note [DoRA's input at a norm's reader]; up's copy a block of its own,
      ``mlp_input_copies``);
    * not the incoming gradient's bf16 cast (c t h, made before the non-reentrant recompute,
      Note [The gradient's cast through the recompute]) nor gate's / up's adapter weight
      copies (245,760 B, made at their matmuls before up's norm): -1,294,336 B.
    Now -2,616 B (+0.00 %)."""
    width = json.loads((MODELS_DIR / "agreement" / "llama_h1024.json").read_text())
    dora = {"lora_rank": 16, "lora_targets": ("gate", "up"), "lora_variant": "dora"}
    gap = _gap(tmp_path, {}, width, activation_checkpointing="selective", **dora)
    assert abs(gap) <= TOLERANCE, f"{gap:+.2%}"


@pytest.mark.parametrize(
    ("targets", "checkpointing"),
    [("all seven", "full"), ("all seven", "selective"), ("down", "full"), ("down", "selective")],
)
def test_dora_on_down_with_dropout(tmp_path: Path, targets: str, checkpointing: str) -> None:
    """DoRA r 16 with ``lora_dropout`` 0.1 on down (alone or with the six other linears), full
    / op-level selective checkpointing: the peak is layer 1's recomputed down DoRA moment,
    beside what the layer's backward made before the recompute (Note [DoRA's output gradient
    before the recompute]), peft's fp32 dropout output, and without ``lora_A``'s 16-bit copy
    of it or DoRA's saved tensors, made after (Note [What down's DoRA moment precedes]; a real
    CPU execution in tests/analytic/test_dora_recompute_moments.py). Before session 25, all
    seven full / selective -1.12 / -0.80 %, down -1.30 / -1.30 %."""
    dora = {
        "lora_rank": 16,
        "lora_targets": _DORA_TARGETS[targets],
        "lora_variant": "dora",
        "lora_dropout": 0.1,
    }
    gap = _gap(tmp_path, {}, activation_checkpointing=checkpointing, **dora)
    assert abs(gap) <= TOLERANCE, f"{gap:+.2%}"


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_dora_gate_up_output_combination_with_dropout(tmp_path: Path, checkpointing: str) -> None:
    """DoRA r 16 on gate / up with ``lora_dropout`` 0.1, the 1024-wide agreement Llama at
    2 x 256 tokens, full / op-level selective checkpointing: the trace peaks at layer 1's
    recomputed up projection in DoRA's output combination (three fp32 [t, out] tensors beside
    ``lora_weight``, the dropout output, the unsaved base output and up's blocks made after
    the norm: Note [DoRA's output combination], peft 0.21.2 tuners/lora/dora.py
    ``DoraLinearLayer.forward``; a real CPU execution in tests/analytic/
    test_dora_recompute_moments.py). Before session 26 (the norm the only moment at up, and
    gate's dropout blocks put after up's moment) +4.43 / +2.91 %. Under full checkpointing
    activations and temporaries agree each, as the total does; under selective the total
    only: the trace's up base output is the op-level cache's tensor (an activation), which
    the formulas free at up and hold as a temporary there (2,883,584 B moved between the two,
    as at up's norm before)."""
    width = json.loads((MODELS_DIR / "agreement" / "llama_h1024.json").read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps(width))
    training = TrainingConfig(micro_batch_size=2, seq_len=256, lora_rank=16,
                              lora_targets=("gate", "up"), lora_variant="dora",
                              lora_dropout=0.1, activation_checkpointing=checkpointing)  # fmt: skip
    g, a = (
        estimate(str(path), training, engine=e, simulate_allocator=False).breakdown
        for e in ("generic", "analytic")
    )
    fields = ("allocated_bytes", "activations", "temporary")
    for field in fields if checkpointing == "full" else fields[:1]:
        gap = getattr(g, field) / getattr(a, field) - 1
        assert abs(gap) <= TOLERANCE, f"{field} {gap:+.2%}"


@pytest.mark.parametrize("width", ["llama_h1024.json", "llama_h2048.json"])
def test_dora_o_with_dropout_under_selective(tmp_path: Path, width: str) -> None:
    """DoRA r 16 on o with ``lora_dropout`` 0.1, op-level selective checkpointing: DoRA's
    re-linear on the dropout output is a fifth matmul of o's adapters, so torchtitan's policy
    caches up's output instead of gate's, and the recompute hands it to ``act(gate) * up``,
    which saves it (Note [An unadapted up's cached output in the recompute]; the cached set by
    hand and a real CPU execution in tests/analytic/test_dora_recompute_moments.py). Before
    session 27 the formulas counted it twice: -1.29 / -0.93 % (1024 / 2048 wide)."""
    base = json.loads((MODELS_DIR / "agreement" / width).read_text())
    dora = {"lora_rank": 16, "lora_targets": ("o",), "lora_variant": "dora", "lora_dropout": 0.1}
    g, a = _breakdowns(tmp_path, base, activation_checkpointing="selective", **dora)
    for field in ("allocated_bytes", "activations", "temporary"):
        gap = getattr(g, field) / getattr(a, field) - 1
        assert abs(gap) <= TOLERANCE, f"{field} {gap:+.2%}"
