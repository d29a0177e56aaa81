"""FSDP1's side streams (FrameworkConventions.fsdp_collective_streams): torch/distributed/fsdp/
_runtime_utils.py (torch 2.2 .. 2.5) allocates the unsharded flat parameter in ``_unshard`` under
``stream(unshard_stream)`` and the reduce-scatter output, kept as the sharded gradient, in
``_post_backward_hook`` under ``stream(state._post_backward_stream)``; the caching allocator
pools blocks per stream, so those bytes are reserved apart from the default stream's."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from trainmem.analytic.schedule import ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM
from trainmem.analytic.transforms.base import PRE_UNSHARD_STREAM
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

torch = pytest.importorskip("torch")

# Llama-2-7B: one decoder layer = 4 * 4096^2 (q, k, v, o) + 3 * 4096 * 11008 (gate, up, down)
# + 2 * 4096 (norms) = 202,383,360 parameters; the model 6,738,415,616
LAYER = 4 * 4096**2 + 3 * 4096 * 11008 + 2 * 4096
MODEL = 6_738_415_616


def _allocs(framework: str) -> list[object]:
    training = TrainingConfig(
        framework=framework,
        zero_stage=3,
        data_parallel_size=4,
        precision="bf16-true",
        seq_len=512,
        micro_batch_size=2,
        activation_checkpointing="full",
    )
    sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]
    return [ev for ev in sched.events() if ev.action == "alloc"]


@pytest.mark.parametrize("framework", ["torchtune", "litgpt"])
def test_fsdp1_gradients_on_the_post_backward_stream(framework: str) -> None:
    step = _allocs(framework)
    rs = [ev for ev in step if ev.stream == REDUCE_SCATTER_STREAM]  # type: ignore[attr-defined]
    assert {ev.category for ev in rs} == {MemoryCategory.GRADIENT}  # type: ignore[attr-defined]
    # bf16 sharded gradients of every parameter over 4 ranks: 2 * 6,738,415,616 / 4 bytes per
    # step (the warm-up step and the measured one), + padding of each flat parameter under 1%
    per_step = sum(ev.size_bytes for ev in rs) / 2  # type: ignore[attr-defined]
    assert 2 * MODEL / 4 <= per_step < 2 * MODEL / 4 * 1.01
    # the prefetched unit's unsharded flat parameter on the unshard stream: 2 B * 202,383,360
    ag = {ev.size_bytes for ev in step if ev.stream == ALL_GATHER_STREAM}  # type: ignore[attr-defined]
    assert ag == {2 * LAYER}


def test_frameworks_without_fsdp_streams_stay_on_the_default_stream() -> None:
    assert {ev.stream for ev in _allocs("hf-trainer")} == {0}  # type: ignore[attr-defined]


def test_fsdp_qlora_runs_the_same_fsdp1_streams() -> None:
    # Answer.AI fsdp_qlora's train.py wraps with torch's FSDP1 (torch 2.2 _runtime_utils.py): the
    # same unshard and post-backward streams as torchtune's FSDP1 recipes (commit 60e975b)
    streams = {ev.stream for ev in _allocs("fsdp-qlora")}  # type: ignore[attr-defined]
    assert streams == {0, ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM}


def test_fsdp_qlora_cpu_offload_copies_the_largest_shard_on_the_pre_unshard_stream() -> None:
    # Note [FSDP1 offloaded shard copy]: torch 2.2 _flat_param.py ``pre_unshard`` copies an
    # offloaded unit's local shard to the GPU (``flat_param_to(self.device)``) under
    # ``stream(pre_unshard_stream)`` (_runtime_utils.py ``_unshard``). Llama-2-7B's root unit
    # (embedding and head 32000 x 4096 each, final norm 4096; bf16, no mixed precision) is the
    # largest: 2 B * (2 * 32000 * 4096 + 4096) / 2 ranks = 262,148,096 bytes per micro-batch;
    # a layer's frozen NF4 weights are 101,203,968 B unsharded, less.
    def allocs(offload: str) -> list[object]:
        training = TrainingConfig(
            framework="fsdp-qlora",
            zero_stage=3,
            data_parallel_size=2,
            precision="bf16-true",
            seq_len=256,
            micro_batch_size=1,
            activation_checkpointing="full",
            offload=offload,
            quantize_base="nf4-dq",
            lora_rank=8,
        )
        sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]
        return [ev for ev in sched.events() if ev.action == "alloc"]

    copies = [ev for ev in allocs("optimizer+params") if ev.stream == PRE_UNSHARD_STREAM]  # type: ignore[attr-defined]
    assert [ev.size_bytes for ev in copies] == [262_148_096] * 2  # type: ignore[attr-defined]
    assert not [ev for ev in allocs("none") if ev.stream == PRE_UNSHARD_STREAM]  # type: ignore[attr-defined]


# -- Note [FSDP1 unshard stream pool] -----------------------------------------------------------

# Llama-2-7B's root unit: embedding and head 32000 x 4096 each, the final norm 4096, bf16
ROOT = 2 * (2 * 32000 * 4096 + 4096)


def _unshard_stream_pool(**kw: object) -> int:
    """The most bytes the schedule holds at once on the unshard stream (the all-gather stream's
    id)."""
    base: dict[str, object] = {
        "zero_stage": 3,
        "data_parallel_size": 4,
        "precision": "bf16-true",
        "seq_len": 512,
        "micro_batch_size": 2,
        "activation_checkpointing": "full",
    }
    training = TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]
    sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]
    live = peak = 0
    for ev in sched.events():
        if ev.stream != ALL_GATHER_STREAM:  # type: ignore[attr-defined]
            continue
        live += ev.size_bytes if ev.action == "alloc" else -ev.size_bytes  # type: ignore[attr-defined]
        peak = max(peak, live)
    return peak


def test_torchtune_fsdp1_full_finetune_holds_root_and_three_layers_on_the_unshard_stream() -> None:
    # torchtune 0.1.0's full_finetune_distributed wraps with torch 2.2's FSDP1 (trainable layer
    # units): the root's 524,296,192 B, the current and the prefetched layer and the freed
    # previous layer not yet reusable: R + 3 L, L = 2 B * 202,383,360
    peak = _unshard_stream_pool(framework="torchtune", torchtune_version="0.1.0")
    assert peak == ROOT + 3 * 2 * LAYER == 1_738_596_352


def test_torchtune_fsdp2_keeps_only_the_prefetched_layer_there() -> None:
    # from torchtune 0.3 (FSDP2, 6deeda92) the rule does not apply: one layer, as before
    assert _unshard_stream_pool(framework="torchtune", torchtune_version="0.3.0") == 2 * LAYER


def test_fsdp1_with_adapter_units_holds_root_and_two_layers() -> None:
    # torchtune 0.1.0's LoRA recipe (each LoRA leaf its own unit, the layer frozen): the layer
    # i's gather is issued by layer i + 1's first adapter unit's pre-backward hook: R + 2 L.
    # LoRA rank 8 on q and v: L = 2 B * (202,383,360 + 2 * 8 * (4096 + 4096))
    lora = {"lora_rank": 8, "lora_targets": ("q", "v")}
    peak = _unshard_stream_pool(framework="torchtune", torchtune_version="0.1.0", **lora)
    assert peak == ROOT + 2 * 2 * (LAYER + 2 * 8 * 8192)
    # fsdp_qlora's units are the same kind: the layer's NF4 codes (0.5 B each of its 202,375,168
    # linear weights), its two bf16 norms and the bf16 adapters; the statistics stay unsharded,
    # outside the flat parameter (Note [bitsandbytes statistics under sharding])
    layer = 202_375_168 // 2 + 2 * 4096 * 2 + 2 * 2 * 8 * 8192
    peak = _unshard_stream_pool(framework="fsdp-qlora", quantize_base="nf4-dq", **lora)
    assert peak == ROOT + 2 * layer


def test_accelerate_fsdp1_holds_the_same_pool() -> None:
    # accelerate's FSDP1 (accelerate-fsdp; the HF Trainer's --fsdp) with the settings of the
    # rows' configs: limit_all_gathers=True (the plugin's default), BACKWARD_PRE (their
    # fsdp_backward_prefetch), use_orig_params=False. Trainable layer units: R + 3 L, the same
    # bytes as torchtune 0.1's full fine-tune above
    assert _unshard_stream_pool(framework="accelerate-fsdp") == ROOT + 3 * 2 * LAYER
    # LoRA rank 8 on q and v, each adapter leaf a unit (peft's fsdp_auto_wrap_policy): R + 2 L,
    # L = 2 B * 202,383,360 + 4 B * 2 * 8 * (4096 + 4096) (peft's fp32 adapters) = 405,291,008
    lora = {"lora_rank": 8, "lora_targets": ("q", "v")}
    layer = 2 * LAYER + 4 * 2 * 8 * 8192
    assert layer == 405_291_008
    assert _unshard_stream_pool(framework="accelerate-fsdp", **lora) == ROOT + 2 * layer


def _backward_prefetches(**kw: object) -> list[tuple[str, int]]:
    """The (action, size) of the blocks the backward allocates on the unshard stream (the
    prefetched layers; the current layer's and the root's gathers are made in the forward) for
    Llama-2-7B under LoRA rank 8 on q and v, 4 ranks, full checkpointing."""
    base: dict[str, object] = {
        "zero_stage": 3,
        "data_parallel_size": 4,
        "precision": "bf16-true",
        "seq_len": 512,
        "micro_batch_size": 2,
        "activation_checkpointing": "full",
        "lora_rank": 8,
        "lora_targets": ("q", "v"),
    }
    training = TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]
    sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]
    out: list[tuple[str, int]] = []
    made: set[int] = set()  # blocks allocated in the backward (the forward's freed there too)
    for ev in sched.events():
        if ev.stream != ALL_GATHER_STREAM or ev.phase != "backward":  # type: ignore[attr-defined]
            continue
        if ev.action == "alloc":  # type: ignore[attr-defined]
            made.add(ev.block_id)  # type: ignore[attr-defined]
        if ev.block_id in made:  # type: ignore[attr-defined]
            out.append((ev.action, ev.size_bytes))  # type: ignore[attr-defined]
    return out


def test_accelerate_fsdp1_prefetches_each_layer_from_the_attention_backward() -> None:
    # Note [FSDP1 backward prefetch under adapter units]: layer i is gathered by layer i + 1's
    # first adapter unit (in its attention's backward) and held to that layer's end, so the
    # 32-layer stack's backward gathers 31 layers one at a time (none after layer 0), and the
    # MLP's backward runs with the current layer only; in the schedule's two steps (warm-up
    # and measured), 62 gathers, each freed before the next
    ops = _backward_prefetches(framework="accelerate-fsdp")
    layer = 2 * LAYER + 4 * 2 * 8 * 8192
    assert ops == [("alloc", layer), ("free", layer)] * 62
    # torchtune 0.1's FSDP1 LoRA recipe is not under the rule: one prefetched layer over the
    # stack (Note [FSDP1 unshard stream pool]), once a micro-batch
    ops = _backward_prefetches(framework="torchtune", torchtune_version="0.1.0")
    assert [a for a, _ in ops] == ["alloc", "free"] * 2


def test_fsdp_qlora_prefetches_from_the_attention_backward() -> None:
    # the same units as accelerate's (each LoRA leaf and each layer, train.py 50efa1e), so the
    # same prefetch order (Note [FSDP1 backward prefetch under adapter units]); seen in torch's
    # FSDP1 traced on fake tensors (benchmarks/generic_options.py 'fsdp-qlora 4': one layer
    # gathered at the first layer's MLP backward, -7.9 -> -0.2 % against the formulas)
    kw = {"framework": "fsdp-qlora", "quantize_base": "nf4", "activation_checkpointing": "none"}
    ops = _backward_prefetches(**kw)
    assert len({size for _, size in ops}) == 1
    assert [a for a, _ in ops] == ["alloc", "free"] * 62
    # under its reentrant checkpointing inside the units the same order (checked on torch's
    # FSDP1, tests/analytic/test_fsdp_qlora_prefetch.py); its non-reentrant checkpointing is not
    # checked and keeps one prefetched layer over the stack, once a micro-batch
    ops = _backward_prefetches(**{**kw, "activation_checkpointing": "full"})
    assert [a for a, _ in ops] == ["alloc", "free"] * 62
    ops = _backward_prefetches(
        **{**kw, "activation_checkpointing": "full", "checkpoint_reentrant": False}
    )
    assert [a for a, _ in ops] == ["alloc", "free"] * 2


def test_adapter_units_release_the_previous_layer_early_in_the_forward() -> None:
    # Note [FSDP1 backward prefetch under adapter units], forward: layer i's free is
    # synchronised at the second unshard after layer i + 1's (its first adapter units), so the
    # unshard stream holds R + 2 L only at a layer's start and R + L while it saves its tensors
    # (layer 0: nothing pending before it); L: Llama-2-7B's bf16 layer with rank-8 q / v
    # adapters, R: the root's bf16 embedding, norm and head
    layer = 2 * LAYER + 4 * 2 * 8 * 8192
    training = TrainingConfig(
        framework="accelerate-fsdp", zero_stage=3, data_parallel_size=4, precision="bf16-true",
        seq_len=512, micro_batch_size=2, lora_rank=8, lora_targets=("q", "v"),
    )  # fmt: skip
    sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]
    live, at_saved, most = 0, set(), 0
    for ev in sched.events():
        if ev.stream == ALL_GATHER_STREAM:  # type: ignore[attr-defined]
            live += ev.size_bytes if ev.action == "alloc" else -ev.size_bytes  # type: ignore[attr-defined]
            most = max(most, live) if ev.phase == "forward" else most  # type: ignore[attr-defined]
        elif ev.phase == "forward" and ev.category == MemoryCategory.ACTIVATION:  # type: ignore[attr-defined]
            if ev.module.startswith("layers."):  # type: ignore[attr-defined]
                at_saved.add(live)
    assert most == ROOT + 2 * layer
    assert at_saved == {ROOT + layer}


def _toy_fsdp1(*, adapters: bool) -> tuple[Any, set[int]]:
    """A 4-layer model wrapped in torch's FSDP1 (FULL_SHARD, BACKWARD_PRE, limit_all_gathers,
    use_orig_params=False) on the CPU, each layer a unit: with ``adapters`` each LoRA leaf a unit
    and the layers frozen under reentrant checkpointing inside the units (fsdp_qlora train.py),
    else trainable layers under non-reentrant checkpointing (torchtune's full recipe). Returns
    the root module and the ids of the layer units' handles."""
    from torch import nn
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )
    from torch.distributed.fsdp import BackwardPrefetch
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import (
        _or_policy,
        lambda_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    h = 32

    class Lora(nn.Module):
        def __init__(self, i: int, o: int) -> None:
            super().__init__()
            self.base = nn.Linear(i, o, bias=False)
            self.lora_A = nn.Linear(i, 4, bias=False)
            self.lora_B = nn.Linear(4, o, bias=False)

        def forward(self, x: Any) -> Any:
            return self.base(x) + self.lora_B(self.lora_A(x))

    def lin(i: int, o: int) -> nn.Module:
        return Lora(i, o) if adapters else nn.Linear(i, o, bias=False)

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.up, self.down = lin(h, h), lin(h, 4 * h), lin(4 * h, h)
            self.norm = nn.Parameter(torch.ones(h))

        def forward(self, x: Any) -> Any:
            x = x + self.q(x * self.norm)
            return x + self.down(torch.relu(self.up(x)))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, h)
            self.layers = nn.ModuleList([Layer() for _ in range(4)])
            self.head = nn.Linear(h, 50, bias=False)

        def forward(self, ids: Any) -> Any:
            x = self.emb(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Model()
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name if adapters else True
    if adapters:  # enable_input_require_grads (fsdp_qlora under reentrant checkpointing)
        model.emb.register_forward_hook(lambda m, a, out: out.requires_grad_(True))

    def leaf(m: Any) -> bool:
        w = getattr(m, "weight", None)
        return not list(m.children()) and w is not None and w.requires_grad

    policies: list[Any] = [
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer})
    ]
    if adapters:
        policies.insert(0, functools.partial(lambda_auto_wrap_policy, lambda_fn=leaf))
    net = FSDP(
        model,
        auto_wrap_policy=functools.partial(_or_policy, policies=policies),
        use_orig_params=False,
        device_id=torch.device("cpu"),
        limit_all_gathers=True,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
    )
    impl = CheckpointImpl.REENTRANT if adapters else CheckpointImpl.NO_REENTRANT
    apply_activation_checkpointing(
        net,
        checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
        check_fn=lambda m: isinstance(m, Layer),
    )
    layer_handles = {
        id(m._handle)
        for m in net.modules()
        if isinstance(m, FSDP)
        and isinstance(getattr(m.module, "_checkpoint_wrapped_module", m.module), Layer)
    }
    assert len(layer_handles) == 4
    return net, layer_handles


def _gathers_and_frees(net: Any) -> list[tuple[str, int]]:
    """The units' gathers (``_unshard`` of a sharded flat parameter) and frees (``_reshard``
    freeing it) in the second step, the steady state: (``"alloc"`` | ``"free"``, handle id)."""
    from torch.distributed.fsdp import _runtime_utils as ru

    log: list[tuple[str, int]] = []
    unshard, reshard = ru._unshard, ru._reshard

    def logged_unshard(state: Any, handle: Any, *a: Any) -> Any:
        if handle is not None and handle.needs_unshard():
            log.append(("alloc", id(handle)))
        return unshard(state, handle, *a)

    def logged_reshard(state: Any, handle: Any, free_unsharded: bool) -> Any:
        out = reshard(state, handle, free_unsharded)
        if free_unsharded:
            log.append(("free", id(handle)))
        return out

    ids = torch.randint(0, 50, (1, 8))
    ru._unshard, ru._reshard = logged_unshard, logged_reshard
    try:
        for _ in range(2):  # the second step is the steady state
            log.clear()
            net(ids).sum().backward()
    finally:
        ru._unshard, ru._reshard = unshard, reshard
    return log


def _layer_blocks(log: list[tuple[str, int]], layer_handles: set[int]) -> tuple[int, int]:
    """(most layer units gathered at once, most layer-unit blocks in the unshard stream's pool):
    the pool replays the rate limiter's queue (two in flight): a freed layer block stays pending
    until the limiter synchronises on its free or a later one."""
    queue: list[int] = []
    pending: dict[int, int] = {}  # free event -> its layer block
    live: set[int] = set()
    synced, event, most_live, most_blocks = -1, 0, 0, 0
    for kind, handle in log:
        if kind == "alloc":
            if len(queue) >= 2:  # _FreeEventQueue.dequeue_if_needed, then event.synchronize()
                synced = max(synced, queue.pop(0))
            pending = {e: b for e, b in pending.items() if e > synced}
            if handle in layer_handles:
                live.add(handle)
                most_live = max(most_live, len(live))
                most_blocks = max(most_blocks, len(live) + len(pending))
        else:
            queue.append(event)
            if handle in layer_handles:
                live.discard(handle)
                pending[event] = handle
            event += 1
    return most_live, most_blocks


def _fsdp1_layer_blocks(*, adapters: bool) -> tuple[int, int]:
    """:func:`_layer_blocks` of :func:`_toy_fsdp1`'s steady step."""
    net, layer_handles = _toy_fsdp1(adapters=adapters)
    return _layer_blocks(_gathers_and_frees(net), layer_handles)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_real_fsdp1_unshard_pool_counts(fake_group: None) -> None:
    # Note [FSDP1 unshard stream pool]: at most two layer units gathered at once either way; the
    # pool holds two layer blocks with adapter units (the layer prefetched by the next layer's
    # first adapter unit), three with trainable layer units (one freed block still pending)
    assert _fsdp1_layer_blocks(adapters=True) == (2, 2)
    assert _fsdp1_layer_blocks(adapters=False) == (2, 3)


def test_accelerate_fsdp1_mixed_casts_each_shard_on_the_pre_unshard_stream() -> None:
    # Note [FSDP1 16-bit shard on the pre-unshard stream]: under bf16-mixed each unit's fp32
    # shard is cast to a bf16 one on the pre-unshard stream before its all-gather. Llama-2-7B
    # over 4 ranks: the root's (embedding and head 32000 x 4096 each, final norm 4096)
    # 2 B x (2 x 32000 x 4096 + 4096) / 4 = 131,074,048 B and a layer's 2 B x LAYER / 4 =
    # 101,191,680 B, once a micro-batch (the schedule's two steps); none under bf16-true
    training = TrainingConfig(
        framework="accelerate-fsdp",
        zero_stage=3,
        data_parallel_size=4,
        precision="bf16-mixed",
        seq_len=512,
        micro_batch_size=2,
    )
    sched = estimate("llama-2-7b", training, simulate_allocator=False).schedules[0]
    shards = [
        ev.size_bytes  # type: ignore[attr-defined]
        for ev in sched.events()
        if ev.action == "alloc" and ev.stream == PRE_UNSHARD_STREAM  # type: ignore[attr-defined]
    ]
    assert shards == [131_074_048, 2 * LAYER // 4] * 2
    assert not [ev for ev in _allocs("accelerate-fsdp") if ev.stream == PRE_UNSHARD_STREAM]  # type: ignore[attr-defined]
