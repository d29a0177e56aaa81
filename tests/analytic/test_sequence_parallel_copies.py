"""DTensor sequence parallelism's transient copies around the linears (Note [Sequence-parallel
collectives' copies], analytic/activation_parallelism.py), bytes derived by hand from
torch/distributed/_functional_collectives.py ``all_gather_single`` (gather into dimension 0,
then ``torch.cat`` along the sequence, a view only when dimension 0 is the group size) and
``reduce_scatter_single`` (``torch.cat(torch.chunk(...))`` of the partial sum first)."""

from __future__ import annotations

from dataclasses import replace

from trainmem.analytic.activation_parallelism import (
    SequenceParallelCopies,
    sequence_parallel_copies,
)
from trainmem.estimate import estimate, resolve_model
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.training import TrainingConfig

SP = dict(
    tensor_parallel_size=8,
    sequence_parallel=True,
    data_parallel_size=32,
    zero_stage=3,
    framework="fsdp2",
    activation_checkpointing="full",
    attention="sdpa",
)


def test_bytes_of_the_copies_by_hand() -> None:
    model = resolve_model("llama-3.1-70b")  # h = 8192
    # b = 16 sequences of 8192 tokens: each rank gathers the whole [16, 8192, 8192]
    tokens, h = 16 * 8192, 8192
    bf16 = TrainingConfig(micro_batch_size=16, seq_len=8192, precision="bf16-mixed", **SP)
    assert sequence_parallel_copies(model, bf16) == SequenceParallelCopies(
        gathered=2 * h * tokens, partial=2 * h * tokens, head_gathered=2 * h * tokens
    )
    # torchao's float8 styles gather the float8 cast (1 byte a value); the partial sums of the
    # row-parallel float8 matmuls are bf16, and the output layer is no float8 linear
    fp8 = TrainingConfig(micro_batch_size=16, seq_len=8192, precision="fp8-mixed", **SP)
    assert sequence_parallel_copies(model, fp8) == SequenceParallelCopies(
        gathered=1 * h * tokens, partial=2 * h * tokens, head_gathered=2 * h * tokens
    )
    # one sequence: the gathered [8, 1024, h] re-read as [1, 8192, h] is a view (no cat)
    one = TrainingConfig(micro_batch_size=1, seq_len=8192, precision="bf16-mixed", **SP)
    assert sequence_parallel_copies(model, one) == SequenceParallelCopies(0, 2 * h * 8192, 0)


def test_no_copies_without_dtensor_sequence_parallelism() -> None:
    model = resolve_model("llama-3.1-70b")
    base = dict(micro_batch_size=4, seq_len=4096, precision="bf16-mixed")
    # Megatron's sequence parallelism gathers and reduce-scatters along dimension 0 (its
    # [s, b, h] layout): no chunk-and-cat
    megatron = TrainingConfig(
        tensor_parallel_size=8, sequence_parallel=True, framework="megatron", **base
    )
    no_sp = TrainingConfig(tensor_parallel_size=8, framework="fsdp2", **base)
    for training in (megatron, no_sp):
        assert sequence_parallel_copies(model, training) == SequenceParallelCopies(0, 0)


def _forward_layer_ops(training: TrainingConfig) -> list[Op]:
    """The ops of a middle layer's forward in the steady-state step."""
    sched = estimate("llama-3.2-1b", training, engine="analytic").schedules[0]

    def ops(items: tuple[Item, ...]) -> list[Op]:
        out: list[Op] = []
        for item in items:
            out += ops(item.body) if isinstance(item, Repeat) else [item]
        return out

    def layers(items: tuple[Item, ...]) -> list[Repeat]:
        out: list[Repeat] = []
        for item in items:
            if isinstance(item, Repeat):
                out += [item] if item.count > 2 and not item.reverse else []
                out += layers(item.body)
        return out

    layer = next(r for r in layers(sched.step) if any(op.phase == "forward" for op in ops(r.body)))
    return [op for op in ops(layer.body) if op.phase == "forward"]


def test_the_forward_makes_them_where_the_collectives_run() -> None:
    # llama-3.2-1b, h = 2048, b = 2, s = 1024, TP 2 + SP, bf16: per layer two gathers of
    # 2 * 2048 * 2 * 1024 B (8 MiB) and two pairs of partial sums of the same size
    training = TrainingConfig(
        micro_batch_size=2, seq_len=1024, precision="bf16-mixed",
        **{**SP, "tensor_parallel_size": 2, "data_parallel_size": 2},
    )  # fmt: skip
    ops = _forward_layer_ops(training)
    size = 2 * 2048 * 2 * 1024
    copies = [(op.action, op.key, op.size_bytes) for op in ops if op.key.startswith("sp/")]
    assert copies == [
        # the attention: the gather's first output around the gathered q/k/v input ...
        ("alloc", "sp/o/gather", size),
        ("free", "sp/o/gather", size),
        # ... and, after the attention, the o projection's partial sum and its cat copy
        ("alloc", "sp/o/partial", size),
        ("alloc", "sp/o/cat", size),
        ("free", "sp/o/partial", size),
        ("free", "sp/o/cat", size),
        # the MLP likewise around gate/up's input and after the down projection
        ("alloc", "sp/down/gather", size),
        ("free", "sp/down/gather", size),
        ("alloc", "sp/down/partial", size),
        ("alloc", "sp/down/cat", size),
        ("free", "sp/down/partial", size),
        ("free", "sp/down/cat", size),
    ]
    keys = [op.key for op in ops]
    gathered = [k for k, op in enumerate(ops) if op.label == "activations dropped by checkpointing"]
    assert keys.index("sp/o/gather") < gathered[1]  # before q/k/v's input, after the norm
    # without sequence parallelism (or at b = 1 for the gathers) nothing is added
    plain = _forward_layer_ops(replace(training, sequence_parallel=False))
    assert not [op for op in plain if op.key.startswith("sp/")]


def test_the_head_keeps_its_tensors_as_they_are() -> None:
    # llama-3.2-1b (h = 2048, V = 128256, tied), bf16 autocast, b = 4, s = 1024: t = 4096
    # tokens. After the logits the head holds, as separate tensors (not one block): the final
    # RMSNorm's fp32 input, its normalised output (fp32 under autocast) and fp32 rstd
    # (modeling_llama.py LlamaRMSNorm), the LM head's 16-bit input (autocast's cast), the fp32
    # log-softmax the cross-entropy saves, and autocast's bf16 copy of the tied head weight
    training = TrainingConfig(micro_batch_size=4, seq_len=1024, precision="bf16-mixed")
    sched = estimate("llama-3.2-1b", training, engine="analytic").schedules[0]
    timeline = sched.expand()
    step = timeline.events[timeline.steady_state_start :]
    saved = [
        e.size_bytes
        for e in step
        if e.module == "head" and e.phase == "forward" and e.action == "alloc"
        and e.category.value == "activations"
    ]  # fmt: skip
    t, h, v = 4096, 2048, 128256
    assert saved == [(4 * h + 4 * h + 4) * t, 2 * h * t, 4 * v * t, 2 * v * h]
