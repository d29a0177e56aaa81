"""Note [bitsandbytes statistics under sharding]: a bitsandbytes 4-bit weight's ``QuantState``
(absmax, double-quantized absmax) is not a parameter, so FSDP / ZeRO-3 neither shard nor
offload it (bitsandbytes 0.43.0 nn/modules.py ``Params4bit._quantize``: ``self.module.
quant_state = quant_state``; Answer.AI fsdp_qlora train.py ``load_and_quantize`` moves only the
codes off the GPU). Bytes derived by hand for Llama-2-70B's gate projection, 8192 x 28672."""

from __future__ import annotations

from trainmem.analytic.tensor_states import tensor_states
from trainmem.specs.hf import load_model_spec
from trainmem.specs.quantization import bnb_4bit_statistics_bytes
from trainmem.specs.training import TrainingConfig

N = 8192 * 28672  # llama-2-70b gate_proj elements
BLOCKS = N // 64  # 3,670,016 absmax values
CODES = N // 2  # 117,440,512 bytes of 4-bit codes


def _gate(**kw: object) -> tuple[int, int]:
    """(param_bytes, full_param_bytes) of layer 0's gate projection."""
    base = {"lora_rank": 64, "precision": "bf16-true", "data_parallel_size": 2}
    training = TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]
    llama = load_model_spec("llama-2-70b")
    states = [s for s in tensor_states(llama, training) if s.owner == "layers.0"]
    gate = next(s for s in states if s.name == "gate")
    return gate.param_bytes, gate.full_param_bytes


def test_statistics_bytes_by_hand() -> None:
    # nf4: one fp32 absmax per 64 values
    assert bnb_4bit_statistics_bytes(N, "nf4") == 4 * BLOCKS == 14_680_064
    # nf4-dq: one uint8 absmax per block + one fp32 absmax per 256 blocks
    assert bnb_4bit_statistics_bytes(N, "nf4-dq") == BLOCKS + 4 * (BLOCKS // 256) == 3_727_360
    assert bnb_4bit_statistics_bytes(N, "int8") == 0
    assert bnb_4bit_statistics_bytes(N, "gptq-int4") == 0


def test_full_shard_shards_the_codes_and_keeps_the_statistics_whole() -> None:
    stats = BLOCKS + 4 * (BLOCKS // 256)
    param, full = _gate(quantize_base="nf4-dq", zero_stage=3, framework="fsdp-qlora")
    assert full == CODES  # what FSDP flattens, gathers and moves
    assert param == CODES // 2 + stats  # this rank's half of the codes + all statistics
    # without parameter sharding nothing changes: codes and statistics on the one GPU
    param0, full0 = _gate(quantize_base="nf4-dq", zero_stage=0, data_parallel_size=1)
    assert param0 == full0 == CODES + stats


def test_parameter_offload_leaves_only_the_statistics() -> None:
    param, full = _gate(
        quantize_base="nf4", zero_stage=3, offload="optimizer+params", framework="fsdp-qlora"
    )
    assert full == CODES
    assert param == 4 * BLOCKS  # the fp32 absmax of every block stays on the GPU


def test_torchao_nf4_shards_its_scalers() -> None:
    # torchtune's NF4Tensor holds its scalers inside the parameter: sharded with it
    param, full = _gate(quantize_base="nf4-dq", zero_stage=3, framework="torchtune")
    assert param == -(-full // 2)


def test_fms_gptq_under_fsdp1_shards_qweight_and_qzeros_only() -> None:
    # fms-acceleration's AutoGPTQ plugin under accelerate's FSDP1 views qweight and qzeros as
    # Parameters (sharded), scales and g_idx stay buffers (whole). gate_proj in = 8192, out =
    # 28672, group 128: 64 groups; qweight N / 2 = 117,440,512 B, qzeros 64 x 28672 / 2 =
    # 917,504 B; scales 2 x 64 x 28672 = 3,670,016 B, g_idx 4 x 8192 = 32,768 B
    gptq = {"quantize_base": "gptq-int4", "precision": "16-mixed", "zero_stage": 3}
    param, full = _gate(framework="accelerate-fsdp", **gptq)
    assert full == CODES + 917_504
    assert param == (CODES + 917_504) // 2 + 3_670_016 + 32_768
    # elsewhere GPTQ is the formulas' one parameter of all four (sharded whole)
    param, full = _gate(framework="fsdp2", **gptq)
    assert param == full // 2 and full == CODES + 917_504 + 3_670_016 + 32_768
