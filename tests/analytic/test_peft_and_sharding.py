"""Per-GPU model states under ZeRO / FSDP and LoRA, against the papers and peft itself."""

from __future__ import annotations

import pytest

from trainmem.analytic.tensor_states import tensor_states
from trainmem.specs.hf import load_hf_config, load_model_spec
from trainmem.specs.training import TrainingConfig


def per_gpu(training: TrainingConfig, preset: str = "llama-2-7b") -> tuple[int, int, int, int]:
    states = tensor_states(load_model_spec(preset), training)
    return (
        sum(s.param_bytes for s in states),
        sum(s.grad_bytes for s in states),
        sum(s.state_bytes for s in states),
        len(states),
    )


def test_zero_stage_3_over_64_gpus_is_16_psi_over_64() -> None:
    # ZeRO paper Figure 1 / Table 1: stage 3 (P_os+g+p) keeps 16 * Psi / N_d bytes per GPU.
    psi = 6_738_415_616  # llama-2-7b
    p, g, o, n = per_gpu(TrainingConfig(data_parallel_size=64, zero_stage=3))
    # each tensor's shard is rounded up to whole bytes: at most 3 bytes per tensor of slack
    assert 16 * psi / 64 <= p + g + o <= 16 * psi / 64 + 3 * n


def test_zero_stage_1_and_2_shard_states_then_gradients() -> None:
    psi = 6_738_415_616
    p, g, o, n = per_gpu(TrainingConfig(data_parallel_size=8, zero_stage=1))
    assert (p, g) == (4 * psi, 4 * psi) and 8 * psi / 8 <= o <= 8 * psi / 8 + n
    p, g, o, n = per_gpu(TrainingConfig(data_parallel_size=8, zero_stage=2))
    assert p == 4 * psi and 4 * psi / 8 <= g <= 4 * psi / 8 + n


def test_offload_moves_optimizer_states_off_the_gpu() -> None:
    _, _, o, _ = per_gpu(TrainingConfig(data_parallel_size=8, zero_stage=2, offload="optimizer"))
    assert o == 0


def test_lora_trainable_parameters_equal_peft() -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = dict(load_hf_config("llama-3.2-1b"))
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    expected = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    training = TrainingConfig(lora_rank=16, lora_targets=("q", "k", "v", "o"))
    states = tensor_states(load_model_spec("llama-3.2-1b"), training)
    assert sum(s.numel for s in states if s.trainable) == expected
    # frozen base: no gradients or optimizer states except for the adapters
    assert all(s.grad_bytes == 0 and s.state_bytes == 0 for s in states if not s.trainable)


def test_qlora_nf4_double_quant_bytes_per_value() -> None:
    # Dettmers et al. 2023 sec. 3: 4 bits per value + 8-bit absmax per 64 values + fp32 per
    # 64*256 values = 0.5 + 1/64 + 4/16384 bytes per value, for a 4096 x 4096 weight.
    training = TrainingConfig(lora_rank=8, quantize_base="nf4-dq")
    q = next(s for s in tensor_states(load_model_spec("llama-2-7b"), training) if s.name == "q")
    n = 4096 * 4096
    assert q.param_bytes == n // 2 + n // 64 + 4 * (n // 64 // 256)


def test_tensor_parallel_layer_terms_are_korthikanti_eq_2_and_3() -> None:
    # Korthikanti et al. 2022: with tensor parallelism t, sbh(10 + 24/t + 5as/(ht)) (Eq. 2);
    # with sequence parallelism too, sbh(34/t + 5as/(ht)) (Eq. 3). 16-bit, eager, dropout,
    # one-kernel GELU; our sum exceeds them by the LayerNorm statistics only (8 B per token per
    # norm, replicated without sequence parallelism, split with it).
    from dataclasses import replace

    from trainmem.analytic.activations import layer_activation_terms

    model = replace(load_model_spec("gpt2-xl"), hidden_act="gelu", model_type="megatron-gpt")
    s, b, h, a, t = 1024, 2, 1600, 25, 5
    base = TrainingConfig(
        micro_batch_size=b,
        seq_len=s,
        precision="16-true",
        attention="eager",
        tensor_parallel_size=t,
        framework="megatron",  # Megatron's sequence parallelism (torch's DTensor SP differs)
    )
    eq2 = s * b * h * 10 + s * b * h * 24 // t + 5 * a * s * s * b // t
    assert sum(layer_activation_terms(model, base).values()) == eq2 + 2 * 8 * s * b
    sp = replace(base, sequence_parallel=True)
    eq3 = s * b * h * 34 // t + 5 * a * s * s * b // t
    ours = sum(layer_activation_terms(model, sp).values())
    # each split term is rounded up to whole bytes: the two norm terms are not multiples of t
    assert 0 <= ours - (eq3 + 2 * 8 * s * b / t) <= 2


def test_first_1f1b_stage_holds_p_micro_batches() -> None:
    # Korthikanti et al. 2022 sec. 4.2.3: with 1F1B the first stage keeps the activations of p
    # micro-batches for its L/p layers, i.e. as many as one micro-batch through all L layers.
    from trainmem.estimate import estimate as estimate_analytic

    model = load_model_spec("llama-2-7b")
    t = TrainingConfig(
        seq_len=2048,
        pipeline_parallel_size=4,
        gradient_accumulation_steps=8,
        activation_checkpointing="full",
    )
    est = estimate_analytic(model, t, simulate_allocator=False)
    first, last = est.details["per_rank"]
    assert first["micro_batches_in_flight"] == 4 and last["micro_batches_in_flight"] == 1
    assert first["num_layers"] == last["num_layers"] == 8


def test_tensor_parallel_splits_linears_and_vocabulary() -> None:
    model = load_model_spec("llama-2-7b")
    one = tensor_states(model, TrainingConfig())
    eight = tensor_states(model, TrainingConfig(tensor_parallel_size=8))
    for a, b in zip(one, eight, strict=True):
        if a.name in ("q", "k", "v", "o", "gate", "up", "down", "embedding/tokens", "lm_head"):
            assert b.param_bytes * 8 == a.param_bytes
        else:  # norms are replicated
            assert b.param_bytes == a.param_bytes


def test_gptq_int4_storage() -> None:
    # GPTQ (auto-gptq QuantLinear), 4096 x 4096, group size 128: int32 qweight = n/2 bytes,
    # fp16 scales 32 groups x 4096 x 2, 4-bit qzeros 32 x 4096 / 2, int32 g_idx 4096 x 4.
    training = TrainingConfig(lora_rank=8, quantize_base="gptq-int4")
    q = next(s for s in tensor_states(load_model_spec("llama-2-7b"), training) if s.name == "q")
    n = 4096 * 4096
    assert q.param_bytes == n // 2 + 32 * 4096 * 2 + 32 * 4096 // 2 + 4096 * 4


def test_fp8_keeps_bf16_activations_and_gathers_float8() -> None:
    # torchao Float8Linear saves its high-precision input, so per-layer activations equal those
    # of bf16 without autocast (FSDP2's policy); only the FSDP2 all-gather shrinks: one byte per
    # gathered linear weight instead of two.
    from trainmem.estimate import estimate as estimate_analytic

    model = load_model_spec("llama-3.2-1b")
    base = dict(seq_len=2048, framework="fsdp2", zero_stage=3, data_parallel_size=8)
    bf16 = estimate_analytic(
        model, TrainingConfig(precision="bf16-mixed", **base), simulate_allocator=False
    )
    fp8 = estimate_analytic(
        model, TrainingConfig(precision="fp8-mixed", **base), simulate_allocator=False
    )
    assert fp8.details["activations_per_layer_bytes"] == bf16.details["activations_per_layer_bytes"]
    assert fp8.breakdown.parameters == bf16.breakdown.parameters
    assert fp8.breakdown.allocated_bytes < bf16.breakdown.allocated_bytes


@pytest.mark.parametrize("targets", [("q", "v"), ("q", "k", "v", "o", "gate", "up", "down")])
def test_bf16_true_lora_layer_saves_the_fp32_input_casts_not_the_inputs(
    targets: tuple[str, ...],
) -> None:
    """bf16-true with peft LoRA, no autocast: peft's adapters are fp32
    (``autocast_adapter_dtype=True``) and each targeted linear's forward casts its input to
    them (tuners/lora/layer.py ``Linear.forward``: ``x = self._cast_input_dtype(x,
    lora_A.weight.dtype)``); ``lora_A`` saves that fp32 copy, and the frozen base linear saves
    no input (derivatives.yaml ``mm``: ``self`` only when ``mat2`` requires grad). So the
    16-bit inputs of the targeted linears are not kept. Expected: the real peft model traced on
    fake tensors, the middle layer's saved bytes (layer 1 of 3: layer 0's pre-norm saves
    nothing when the frozen embedding's output needs no gradient)."""
    pytest.importorskip("peft")
    from trainmem.analytic.activations import layer_activation_terms
    from trainmem.specs.hf import model_spec_from_hf
    from trainmem.trace.engine import run_trace
    from trainmem.trace.hf_model import build_hf_training_model, make_hf_batch

    raw = {**load_hf_config("tiny-llama-test"), "num_hidden_layers": 3}
    training = TrainingConfig(
        micro_batch_size=2, seq_len=64, precision="bf16-true", lora_rank=8, lora_targets=targets
    )
    analytic = sum(layer_activation_terms(model_spec_from_hf(raw, name="x"), training).values())
    holder = {}

    def build():
        holder["m"] = build_hf_training_model(raw, training)
        return holder["m"]

    _, report = run_trace(build, lambda: make_hf_batch(holder["m"], 2, 64), training)
    traced = sum(v for k, v in report.activation_bytes_by_module.items() if ".layers.1." in f"{k}.")
    assert 0 <= traced - analytic <= 512  # the trace's few host-scalar bytes per layer


def test_bf16_mixed_lora_layer_saves_the_adapter_casts() -> None:
    """bf16-mixed (autocast) with peft LoRA on every linear: each adapter's fp32 A and B are
    cast to bf16 for their matmuls and saved (derivatives.yaml ``mm`` saves ``mat2``), c r
    (fan_in + fan_out) per adapter; and the 16-bit attention output reaching o_proj goes through
    peft's fp32 cast and back through autocast's, a copy of its own that A saves. Expected: the
    real peft model traced on fake tensors, the middle layer's saved bytes."""
    pytest.importorskip("peft")
    from trainmem.analytic.activations import layer_activation_terms
    from trainmem.specs.hf import model_spec_from_hf
    from trainmem.trace.engine import run_trace
    from trainmem.trace.hf_model import build_hf_training_model, make_hf_batch

    raw = {**load_hf_config("tiny-llama-test"), "num_hidden_layers": 3}
    training = TrainingConfig(
        micro_batch_size=2,
        seq_len=64,
        precision="bf16-mixed",
        lora_rank=8,
        lora_targets=("q", "k", "v", "o", "gate", "up", "down"),
    )
    analytic = sum(layer_activation_terms(model_spec_from_hf(raw, name="x"), training).values())
    holder = {}

    def build():
        holder["m"] = build_hf_training_model(raw, training)
        return holder["m"]

    _, report = run_trace(build, lambda: make_hf_batch(holder["m"], 2, 64), training)
    traced = sum(v for k, v in report.activation_bytes_by_module.items() if ".layers.1." in f"{k}.")
    assert 0 <= traced - analytic <= 512  # the trace's few host-scalar bytes per layer
