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
