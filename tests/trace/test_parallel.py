"""One rank of a device mesh (trainmem.trace.parallel): layout, what tensor parallelism shards,
and the refusals. Byte-exactness against real runs: test_real_cpu.py / test_real_cpu_parallel.py.
"""

from __future__ import annotations

import pytest

from trainmem.errors import UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig
from trainmem.trace.parallel import mesh_coordinates, mesh_dims, mesh_size


def test_mesh_follows_torchtitan_order_tp_fastest() -> None:
    t = TrainingConfig(tensor_parallel_size=4, data_parallel_size=2, zero_stage=3)
    assert mesh_dims(t) == {"dp_shard": 2, "tp": 4}
    assert mesh_size(t) == 8
    assert mesh_coordinates(t, rank=6) == {"dp_shard": 1, "tp": 2}  # 6 = 1 * 4 + 2
    assert mesh_dims(TrainingConfig(data_parallel_size=2)) == {}  # DDP: not a traced mesh
    t = TrainingConfig(tensor_parallel_size=2, context_parallel_size=4, data_parallel_size=2,
                       zero_stage=3)  # fmt: skip
    assert list(mesh_dims(t).items()) == [("dp_shard", 2), ("cp", 4), ("tp", 2)]
    assert mesh_coordinates(t, rank=13) == {"dp_shard": 1, "cp": 2, "tp": 1}


def test_tensor_parallel_rank_holds_its_shards_of_every_linear() -> None:
    # tiny-llama-test: h=64, 4 heads of 16 (kv 2 heads -> 32), ffn 176, vocab 512, 2 layers.
    # TP=2 splits embedding and lm_head rows, q/k/v/gate/up rows, o/down columns; the two
    # norms of a layer and the final norm are replicated (sequence parallel or not).
    h, kv, ffn, vocab = 64, 32, 176, 512
    layer = (h * h + 2 * h * kv + h * h + 3 * h * ffn) // 2 + 2 * h
    expected = (vocab * h // 2 + 2 * layer + h + vocab * h // 2) * 4  # fp32
    for sp in (False, True):
        t = TrainingConfig(micro_batch_size=1, seq_len=32, precision="32-true",
                           tensor_parallel_size=2, sequence_parallel=sp)  # fmt: skip
        est = estimate("tiny-llama-test", t, engine="trace")
        assert est.details["peak_by_category_bytes"]["parameters"] == expected
        assert est.details["per_rank"][0]["rank"] == 0
        assert est.details["per_rank"][0]["ranks_alike"] == 2
        assert est.details["traced_mesh"] == {"tp": 2}


def test_tensor_parallel_refuses_models_without_the_llama_plan() -> None:
    t = TrainingConfig(micro_batch_size=1, seq_len=32, tensor_parallel_size=2)
    with pytest.raises(UnsupportedError, match="tensor_parallel_size"):
        estimate("tiny-gpt2-test", t, engine="trace")  # fused c_attn Conv1D


def test_tensor_parallel_refuses_heads_that_do_not_divide() -> None:
    t = TrainingConfig(micro_batch_size=1, seq_len=32, tensor_parallel_size=4)  # 2 kv heads
    with pytest.raises(UnsupportedError, match="num_key_value_heads=2"):
        estimate("tiny-llama-test", t, engine="trace")


def test_context_parallel_rank_holds_its_sequence_shard() -> None:
    # cp=2, s=64: input_ids, labels and the explicit position_ids are sharded to [b, s/2] in
    # place by context_parallel (``buffer.resize_(shard.shape)``), and resize_ never shrinks a
    # storage, so the rank still holds the full [b, s] int64 storages: 3 * 2 * 64 * 8 B. The
    # parameters are FSDP2-sharded over the 2 cp ranks with no data parallelism (torchtitan's
    # dp_shard_cp; ZeRO-3, the only stage CP runs with): ceil(rows / 2) rows of every fp32
    # parameter.
    t = TrainingConfig(micro_batch_size=2, seq_len=64, precision="32-true",
                       context_parallel_size=2, zero_stage=3)  # fmt: skip
    est = estimate("tiny-llama-test", t, engine="trace")
    cats = est.details["peak_by_category_bytes"]
    assert cats["inputs"] == 3 * 2 * 64 * 8
    h, kv, ffn, vocab = 64, 32, 176, 512
    rows = (vocab * h + 2 * (h * h + 2 * kv * h + h * h + 2 * ffn * h + h * ffn + 2 * h)
            + h + vocab * h)  # fmt: skip
    assert cats["parameters"] == rows * 4 // 2  # every dim 0 here is even
    # the formulas shard the same way (issue 26: before ZeRO-3 was required with CP, the
    # formulas kept whole states at ZeRO-0 while the trace sharded: llama-3.2-1b -39.7 %)
    formulas = estimate("tiny-llama-test", t, engine="analytic", simulate_allocator=False)
    assert formulas.breakdown.allocated_bytes == pytest.approx(
        est.breakdown.allocated_bytes, rel=0.01
    )
    assert est.details["traced_mesh"] == {"cp": 2}


def test_lora_adapters_are_sharded_as_peft_shards_them_under_tensor_parallelism() -> None:
    # Note [LoRA under tensor parallelism] (peft #3079 / #3614): beside a column-parallel base
    # lora_A whole, lora_B split by its output; beside a row-parallel base lora_A split by
    # its input, lora_B whole. tiny-llama-test (h 64, q 64, k / v 32, ffn 176), rank 8 on
    # every linear, fp32 adapters, TP 2: per layer, columns q, k, v, gate, up:
    # 8 in + out / 2 x 8; rows o, down: in / 2 x 8 + 8 out
    pytest.importorskip("peft")
    h, kv, ffn, r = 64, 32, 176, 8
    columns = [(h, h), (h, kv), (h, kv), (h, ffn), (h, ffn)]
    rows = [(h, h), (ffn, h)]
    per_layer = sum(r * i + o // 2 * r for i, o in columns)
    per_layer += sum(i // 2 * r + r * o for i, o in rows)
    targets = ("q", "k", "v", "o", "gate", "up", "down")
    t = TrainingConfig(micro_batch_size=1, seq_len=32, lora_rank=r, lora_targets=targets,
                       tensor_parallel_size=2)  # fmt: skip
    est = estimate("tiny-llama-test", t, engine="trace", simulate_allocator=False)
    # Adam's two fp32 moments of this rank's adapters, 2 layers
    assert est.details["peak_by_category_bytes"]["optimizer_states"] == 2 * 4 * 2 * per_layer
    with pytest.raises(UnsupportedError, match="lora_rank with tensor_parallel_size=2 and seq"):
        estimate("tiny-llama-test", TrainingConfig(lora_rank=8, tensor_parallel_size=2,
                 sequence_parallel=True), engine="trace")  # fmt: skip


def test_lora_under_tensor_parallelism_agrees_with_the_formulas() -> None:
    # the agreement model (2 Llama layers of 2048) at 2 x 256 tokens, TP 2, LoRA on q / v
    pytest.importorskip("peft")
    from conftest import MODELS_DIR

    agreement = str(MODELS_DIR / "agreement" / "llama_h2048.json")
    t = TrainingConfig(micro_batch_size=2, seq_len=256, lora_rank=16, tensor_parallel_size=2)
    g = estimate(agreement, t, engine="generic", simulate_allocator=False)
    a = estimate(agreement, t, engine="analytic", simulate_allocator=False)
    ratio = g.breakdown.allocated_bytes / a.breakdown.allocated_bytes
    assert abs(ratio - 1) < 0.01, ratio


def test_tensor_parallel_of_a_vision_language_model_shards_its_text_layers() -> None:
    """The Llama TP plan on a vision-language model (the tiny LLaVA): its decoder layers, not
    the longest list (before, the vision tower's was taken and refused: no ``self_attn``).
    By hand, TP 2 halves the text layers' linears (2 layers x (4 x 64 x 64 + 3 x 64 x 128)),
    the token embedding and the head (2 x 256 x 64), fp32 weights under autocast:
    (2 x 40,960 + 32,768) / 2 x 4 B = 229,376 B fewer parameter bytes; the vision tower,
    the projector and the norms stay whole."""
    from conftest import MODELS_DIR
    from trainmem.estimate import estimate
    from trainmem.specs.training import TrainingConfig

    llava = str(MODELS_DIR / "vlm" / "llava.json")
    whole, split = (
        estimate(llava, TrainingConfig(tensor_parallel_size=tp, seq_len=64)) for tp in (1, 2)
    )
    assert whole.engine == split.engine == "generic"
    assert whole.breakdown.parameters - split.breakdown.parameters == 229_376
