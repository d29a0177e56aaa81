"""Megatron's sequence-parallel column-parallel linears save the sequence shard (Note
[Megatron's column-parallel linears save the shard], trainmem/trace/sequence_shard.py).

Expected values from megatron-core core_v0.9.0 megatron/core/tensor_parallel/layers.py
(``LinearWithGradAccumulationAndAsyncCommunication``: ``ctx.save_for_backward(input, weight)``
on the shard, ``_all_gather_base`` of it again in ``backward``) and from torch's DTensor plan
(the gathered input saved by the linear's ``mm``), by hand:

- a column-parallel linear on a [b, s, h] input sharded over t ranks: DTensor keeps the
  gathered [b, s, h] tensor for the backward, Megatron the [b, s / t, h] shard and gathers one
  [b, s, h] tensor in the linear's backward;
- the agreement Llama (h = 2048, 2 layers) at b = 2, s = 256, bf16 (c = 2), t = 2: DTensor's
  plan saves two gathered inputs per layer in the forward (the attention's and the MLP's),
  b s h c = 2,097,152 B each, and the output layer's; Megatron saves none of them, and the
  norms' outputs, b s / t h c = 1,048,576 B, stay alive instead.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate
from trainmem.schedule import Item, Op
from trainmem.specs.training import TrainingConfig

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")


def _ops(items: Any) -> list[Op]:
    out: list[Op] = []
    for item in items:
        out += [item] if isinstance(item, Op) else _ops(item.body)
    return out


def _storage_uses(t: Any) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


@pytest.mark.parametrize("megatron", [False, True], ids=["dtensor", "megatron"])
def test_the_column_parallel_linear_saves_the_shard_and_gathers_it_in_backward(
    megatron: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One ``ColwiseParallel(input_layouts=Shard(1))`` linear over a 2-rank fake mesh: after
    the forward only DTensor's plan keeps the gathered [2, 6, 8] input (the test's reference
    and the saved ``mm`` operand); Megatron's gathers the [2, 3, 8] shard into one [2, 6, 8]
    tensor when the backward runs."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from trainmem.trace import sequence_shard
    from trainmem.trace.parallel import trace_mesh

    gathers: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    gather = sequence_shard._gather

    def counted(shard: Any, mesh: Any, shape: tuple[int, ...]) -> Any:
        out = gather(shard, mesh, shape)
        gathers.append((tuple(shard.shape), tuple(out.shape)))
        return out

    monkeypatch.setattr(sequence_shard, "_gather", counted)
    training = TrainingConfig(micro_batch_size=2, seq_len=6, tensor_parallel_size=2)
    with trace_mesh(training) as mesh:
        tp = mesh["tp"] if mesh.mesh_dim_names else mesh
        linear = torch.nn.Linear(8, 4, bias=False)
        parallelize_module(linear, tp, ColwiseParallel(input_layouts=Shard(1)))
        if megatron:
            sequence_shard.save_sequence_shard(linear, tp)
        inputs: list[Any] = []
        linear.register_forward_pre_hook(lambda _m, args: inputs.append(args[0]))
        local = torch.randn(2, 3, 8, requires_grad=True)
        x = DTensor.from_local(local, tp, [Shard(1)], run_check=False)
        out = linear(x)
        (gathered,) = inputs
        assert tuple(gathered.shape) == (2, 6, 8)
        # this test's reference, plus the saved mm operand (a view) under DTensor's plan
        assert (_storage_uses(gathered._local_tensor) > 2) is not megatron
        assert gathers == []
        out.sum().backward()
    assert gathers == ([((2, 3, 8), (2, 6, 8))] if megatron else [])


def test_megatron_saves_the_norms_shards_not_the_gathered_inputs() -> None:
    """On the old trace (DTensor's saves) the attention, the MLP and the output layer each
    kept a b s h c gathered input here (the +1.77 % cell's 2 x 8 MiB per layer at s = 1024)."""
    cfg = json.loads((MODELS_DIR / "agreement" / "llama_h2048.json").read_text())
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    b, s, t, c = 2, 256, 2, 2
    training = TrainingConfig(
        micro_batch_size=b,
        seq_len=s,
        framework="megatron",
        tensor_parallel_size=t,
        sequence_parallel=True,
    )
    schedule = estimate(AGREEMENT, training, engine="generic", simulate_allocator=False)
    items: list[Item] = list(schedule.schedules[0].step)
    saved = [
        op
        for op in _ops(items)
        if op.action == "alloc" and op.phase == "forward"
        and op.category is MemoryCategory.ACTIVATION
    ]  # fmt: skip
    gathering = {"lm_head"}
    gathering |= {f"model.layers.{i}.{m}" for i in range(layers) for m in ("self_attn", "mlp")}
    assert [op for op in saved if op.module in gathering and op.size_bytes == b * s * h * c] == []
    norms = [
        op
        for op in saved
        if op.module.endswith(("input_layernorm", "post_attention_layernorm"))
        and op.size_bytes == b * s // t * h * c
    ]
    assert len(norms) == 2 * layers
