"""Op-level selective checkpointing under torch.compile: the min-cut partitioner keeps a
MUST_SAVE output only if the backward reads it, so the output projections' results (o_proj,
down_proj: read only by the residual add) are not kept. Expected numbers by hand."""

from __future__ import annotations

from trainmem.analytic.op_selective import op_selective_saved_bytes
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig


def test_compile_drops_the_saved_down_projection_output() -> None:
    # llama-3.2-1b, b=2, s=2048, bf16: torchtitan's policy saves q (1st mm), v (3rd),
    # gate (5th) and down (7th); compiled, down's output (2 B x 4096 tokens x h=2048 = 16 MiB)
    # is read by no backward op; o (4th mm) was not saved anyway
    model = load_model_spec("llama-3.2-1b")
    settings = {
        "micro_batch_size": 2,
        "seq_len": 2048,
        "activation_checkpointing": "selective",
        "framework": "fsdp2",
    }
    eager = op_selective_saved_bytes(model, TrainingConfig(**settings))  # type: ignore[arg-type]
    compiled = op_selective_saved_bytes(model, TrainingConfig(compile=True, **settings))  # type: ignore[arg-type]
    assert eager - compiled == 2 * 4096 * 2048


def test_eager_selective_keeps_the_layer_input_attention_and_alternate_matmuls() -> None:
    # by hand, fsdp2 bf16 (residual 2 B): layer input 2*4096*2048, SDPA output 2*4096*2048
    # (32 heads x 64), logsumexp 4*32*4096, q 2*4096*2048, v 2*4096*512, gate and down
    # 2*4096*8192 and 2*4096*2048
    model = load_model_spec("llama-3.2-1b")
    t = 4096
    expected = (
        (2 * t * 2048 + 2 * t * 2048 + 4 * 32 * t + 2 * t * 2048 + 2 * t * 512)
        + 2 * t * 8192
        + 2 * t * 2048
    )
    training = TrainingConfig(
        micro_batch_size=2, seq_len=2048, activation_checkpointing="selective", framework="fsdp2"
    )
    assert op_selective_saved_bytes(model, training) == expected
