"""The CS336 course model (``model_type: "cs336_basics"``) and its training-loop settings.

Expected bytes are derived by hand from the course code (stanford-cs336 cs336_basics/model.py,
nn_utils.py, optimizer.py; PyTorch's tools/autograd/derivatives.yaml for what each op saves),
written out term by term in each test, for a tiny config: b = 2 sequences of s = 8 tokens
(t = 16), d_model h = 8, a = 2 heads of d = 4, d_ff i = 16, vocabulary V = 32, L = 2 layers,
so n = a * s * s * b = 256 attention scores per layer. The per-layer total is also checked
against a real execution on CPU in tests/benchmarks/test_snapshot_analytic_step.py.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import Invoke
from trainmem.analytic.activations import activation_profile
from trainmem.analytic.attention import (
    eager_scores_forward_bytes,
    written_out_scores_forward_tensors,
)
from trainmem.analytic.backward_transients import backward_layer_transients
from trainmem.analytic.head import head_activation_bytes
from trainmem.analytic.loss import loss_backward_transient_bytes, loss_forward_transient_bytes
from trainmem.analytic.params import num_parameters
from trainmem.analytic.temporaries import optimizer_step_temporary_bytes
from trainmem.errors import SpecError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

TINY = str(Path(__file__).parent / "course" / "cs336-tiny.json")
b, s, h, a, d, i, V, L = 2, 8, 8, 2, 4, 16, 32, 2
t, n = b * s, a * s * s * b


def _training(**changes: object) -> TrainingConfig:
    base = TrainingConfig(
        micro_batch_size=b, seq_len=s, precision="32-true", attention="eager", dropout=False
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_config_reads_the_course_constructor_arguments() -> None:
    m = load_model_spec(TINY)
    assert (m.num_layers, m.hidden_size, m.num_heads, m.head_dim) == (L, h, a, d)
    assert (m.intermediate_size, m.vocab_size, m.max_position_embeddings) == (i, V, 8)
    assert m.attention_written_out and m.activation_written_out
    assert m.rotary_buffer and m.loss_written_out and not m.tie_word_embeddings


def test_parameter_count_by_hand() -> None:
    # BasicsTransformerLM: token_embeddings (V, h), per layer q/k/v/output_proj (h, h), w1/w3
    # (i, h), w2 (h, i), ln1 / ln2 (h); ln_final (h); untied lm_head (V, h)
    layer = 4 * h * h + 3 * h * i + 2 * h
    assert layer == 656
    assert num_parameters(load_model_spec(TINY)) == V * h + L * layer + h + V * h == 1832
    # cs336-small (768 / 3072 / 12 layers / 12 heads, V 10,000)
    small = 4 * 768 * 768 + 3 * 768 * 3072 + 2 * 768
    assert num_parameters(load_model_spec("cs336-small")) == 2 * 10_000 * 768 + 12 * small + 768


def test_layer_terms_fp32_by_hand() -> None:
    prof = activation_profile(load_model_spec(TINY), _training())
    # ln1: RMSNorm saves its input (x.pow(2)), rsqrt's result and x * rms: 4h + 4 + 4h per token
    norm = (4 * h + 4 + 4 * h) * t
    qkv_input = 4 * h * t  # the normed input, read by q/k/v_proj's einsums (one fp32 tensor)
    q_k = 4 * 2 * a * d * t  # rotated Q and K (torch.concat), saved by the scores einsum
    v = 4 * a * d * t  # V, saved by the value einsum
    # softmax: exp's output (saved by exp and the division), the quotient (value einsum),
    # max's int64 indices, the row sums (division), the (s, s) bool mask (torch.where)
    scores = 4 * n + 4 * n + 8 * a * s * b + 4 * a * s * b + s * s
    out_proj = 4 * a * d * t  # rearrange(...).contiguous(), saved by output_proj
    mlp_input = 4 * h * t  # ln2's output, read by w1 and w3
    # w1 output (sigmoid's input and the product's), sigmoid's output, silu, w3 output, and
    # silu * w3 saved by w2: five (t, i) tensors
    mlp = 5 * 4 * i * t
    expected = norm + qkv_input + q_k + v + scores + out_proj + norm + mlp_input + mlp
    assert expected == 12_864
    assert prof.per_layer == sum(prof.terms.values()) == expected


def test_layer_scores_under_bf16_autocast_by_hand() -> None:
    terms = activation_profile(load_model_spec(TINY), _training(precision="bf16-mixed")).terms
    # exp is on autocast's fp32 list: fp32 output; the value einsum saves its bf16 cast
    assert terms["scores/softmax_exp"] == 4 * n
    assert terms["scores/probs_for_values"] == 2 * n
    assert "scores/softmax" not in terms  # no torch.softmax output
    # silu = x * sigmoid(x) in bf16 (matmul outputs): five (t, i) tensors of 2 bytes
    assert terms["mlp/gated"] + terms["mlp/down_input"] == 5 * 2 * i * t


def test_written_out_softmax_backward_holds_five_fp32_score_tensors() -> None:
    # Note [Backward of a written-out softmax]: grad, -grad, e / S, (e / S) / S, their product
    for precision in ("32-true", "bf16-mixed"):
        _, attention, _ = backward_layer_transients(
            load_model_spec(TINY), _training(precision=precision)
        )
        assert attention == 5 * 4 * n


def test_written_out_softmax_forward_transients_by_hand() -> None:
    m = load_model_spec(TINY)
    # at exp: the masked scores and x - x_max (c * n each) beside exp's saved output; under
    # autocast also exp's fp32 copy of its bf16 input
    assert written_out_scores_forward_tensors(m, _training()) == [4 * n, 4 * n]
    bf16 = _training(precision="bf16-mixed")
    assert written_out_scores_forward_tensors(m, bf16) == [2 * n, 2 * n, 4 * n]
    assert eager_scores_forward_bytes(m, bf16) == (8 * n, 0)


def test_rope_is_a_buffer_not_per_step_tables() -> None:
    m = load_model_spec(TINY)
    # (2, context_length, d / 2) fp32
    assert m.module_buffer_bytes == 4 * 2 * 8 * (d // 2) == 128
    assert "rotary_cos_sin" not in activation_profile(m, _training()).head_terms


def test_course_cross_entropy_by_hand() -> None:
    m = load_model_spec(TINY)
    fp32, bf16 = _training(), _training(precision="bf16-mixed")
    # saved: exp's output and the negated log-softmax gather saves (4 per logit each), max's
    # int64 indices and log's fp32 input per token
    assert head_activation_bytes(m, fp32)["log_softmax"] == 2 * 4 * V * t + (8 + 4) * t
    # fp32: logits, x - x_max twice and exp's output at once: 16 bytes per logit, less the two
    # saved tensors; bf16 autocast: at the negation 2 (logits) + 3 * 4 = 14, less 8
    assert loss_forward_transient_bytes(m, fp32) == (16 - 8) * V * t
    assert loss_forward_transient_bytes(m, bf16) == (14 - 8) * V * t
    # one fp32 (t, V) gradient beside the saved tensors (gather's in-place scatter_add_, then
    # each op's); under autocast at x - log(S) two fp32 ones and the cast to bf16 x, with
    # gather's input gone: 4 + 2 beside the saved 8
    assert loss_backward_transient_bytes(m, fp32) == 4 * V * t
    assert loss_backward_transient_bytes(m, bf16) == (4 + 2) * V * t
    # F.cross_entropy on the same model (S026's script): torch's log-softmax rules
    torch_ce = _training(loss="cross-entropy")
    assert head_activation_bytes(m, torch_ce)["log_softmax"] == 4 * V * t
    assert loss_forward_transient_bytes(m, torch_ce) == 4 * V * t


def test_logits_sum_loss_by_hand() -> None:
    m = load_model_spec(TINY)
    for loss in ("logits-sum", "logits-mean"):
        tr = _training(loss=loss, precision="bf16-mixed")
        assert "log_softmax" not in head_activation_bytes(m, tr)  # sum / mean save nothing
        assert loss_forward_transient_bytes(m, tr) == 2 * V * t  # the bf16 logits
        assert loss_backward_transient_bytes(m, tr) == 2 * V * t  # one materialised gradient


def test_course_adamw_holds_five_temporaries_of_the_largest_parameter() -> None:
    largest = V * h
    # m_t, v_t, alpha_t * m_t, sqrt(v_t) + eps, the quotient: five fp32 tensors
    tr = _training(optimizer_implementation="cs336")
    assert optimizer_step_temporary_bytes(
        tr, num_trainable_parameters=1832, largest_parameter=largest
    ) == (5 * 4 * largest)
    sched = estimate(TINY, tr, engine="analytic").schedules[0]
    plain = estimate(TINY, _training(optimizer_implementation="for-loop"), engine="analytic")
    # the optimizer phase peaks at the largest parameter's update: 5 against the torch
    # for-loop's 2 (sqrt and denom)
    diff = sched.phase_peaks()["optimizer"] - plain.schedules[0].phase_peaks()["optimizer"]
    assert diff == 3 * 4 * largest


def test_zero_grad_before_backward_keeps_last_steps_gradients_through_the_forward() -> None:
    grads = 4 * 1832  # every fp32 gradient
    after = estimate(TINY, _training(), engine="analytic").schedules[0].phase_peaks()
    before = estimate(TINY, _training(zero_grad_before_backward=True), engine="analytic").schedules[
        0
    ]
    assert before.phase_peaks()["forward"] - after["forward"] == grads
    # freed before the backward, which rebuilds them as after-step zeroing does
    assert before.phase_peaks()["backward"] == after["backward"]


def test_keep_logits_holds_the_logits_to_the_end_of_the_step() -> None:
    after = estimate(TINY, _training(), engine="analytic").schedules[0].phase_peaks()
    kept = estimate(TINY, _training(keep_logits=True), engine="analytic").schedules[0]
    # the fp32 logits (4 V t) are alive in the optimizer step
    assert kept.phase_peaks()["optimizer"] - after["optimizer"] == 4 * V * t
    # and already counted at the loss: the forward peak does not move
    assert kept.phase_peaks()["forward"] == after["forward"]


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(optimizer="sgd", optimizer_implementation="cs336"), "optimizer_implementation"),
        (dict(keep_logits=True, gradient_accumulation_steps=2), "keep_logits"),
        (dict(zero_grad_before_backward=True, gradient_accumulation_steps=4), "zero_grad_"),
        (dict(loss="logits-sum", chunked_cross_entropy=8), "loss"),
        (dict(loss="softmax"), "loss"),
        (dict(keep_logits=True, pipeline_parallel_size=2), "keep_logits"),
    ],
)
def test_bad_settings_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(SpecError, match=field):
        _training(**changes)


def test_engines_refuse_what_they_cannot_run() -> None:
    with pytest.raises(SpecError, match="attention"):
        estimate(TINY, _training(attention="sdpa"), engine="analytic")
    with pytest.raises(SpecError, match="seq_len"):  # beyond the RoPE buffer's 8 positions
        estimate(TINY, _training(seq_len=16), engine="analytic")
    # the generic path builds transformers models; the trace engine builds the course model
    with pytest.raises(UnsupportedError, match="not a transformers model"):
        estimate(TINY, _training(), engine="generic")
    # the trace engine runs a transformers model's own cross-entropy from the labels (the
    # generic path computes --loss on the logits: tests/trace/test_traced_options.py)
    pytest.importorskip("torch")
    with pytest.raises(UnsupportedError, match="loss=logits-sum"):
        estimate("gpt2", TrainingConfig(seq_len=8, loss="logits-sum"), engine="trace")


def test_cli_estimate_on_a_cs336_config(invoke: Invoke) -> None:
    r = invoke("estimate", TINY, "-b", "2", "-s", "8", "-p", "32-true", "--json")
    out = json.loads(r.stdout)
    assert out["engine"] == "analytic" and out["num_parameters"] == 1832
    # the model's own attention (written out, eager) and loss (the course's cross-entropy)
    assert out["config"]["attention"] == "eager"
    assert out["config"]["loss"] == "cs336-cross-entropy"
    # + the RoPE buffer: 2 x 8 positions x 2 fp32 values
    assert out["breakdown_bytes"]["parameters"] == 4 * 1832 + 128
    api = estimate(TINY, _training(), engine="auto")
    assert out["peak"]["allocated_bytes"] == api.breakdown.allocated_bytes


def test_cli_trace_engine_builds_the_course_model(invoke: Invoke) -> None:
    pytest.importorskip("torch")
    args = ["estimate", TINY, "-b", "2", "-s", "8", "-p", "32-true", "--json"]
    r = invoke(*args, "--engine", "trace", "--loss", "logits-mean")
    out = json.loads(r.stdout)
    assert out["engine"] == "trace" and out["num_parameters"] == 1832
    assert out["config"]["loss"] == "logits-mean"


def test_cli_loop_flags(invoke: Invoke) -> None:
    args = ["estimate", "cs336-small", "-b", "4", "-s", "128", "-p", "32-true", "--json"]
    flags = [
        "--optimizer-implementation",
        "cs336",
        "--loss",
        "logits-sum",
        "--keep-logits",
        "--zero-grad-before-backward",
    ]
    r = invoke(*args, *flags)
    config = json.loads(r.stdout)["config"]
    assert config["optimizer_implementation"] == "cs336" and config["loss"] == "logits-sum"
    assert config["keep_logits"] and config["zero_grad_before_backward"]
    bad = invoke(*args, "--attention", "sdpa", exit_code=None)
    assert bad.exit_code != 0 and "allowed: eager" in bad.output
    generic = invoke(*args, "--engine", "generic", exit_code=None)
    assert generic.exit_code != 0 and "--engine trace" in generic.output
