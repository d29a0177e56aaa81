"""lit-gpt's FSDP + LoRA: flat-parameter gradients and ``no_sync`` accumulation (issue 17).

First the real thing: torch's FSDP1 (``FullyShardedDataParallel``), wrapped as Lightning Fabric
2.1's ``FSDPStrategy`` wraps lit-gpt (``auto_wrap_policy={Block}``, FULL_SHARD,
``use_orig_params=True``, bf16 ``MixedPrecision``), run on the CPU under torch's ``"fake"``
process group (2 ranks), with gradient accumulation under ``no_sync()`` as lit-gpt's
``fabric.no_backward_sync`` does. Then the analytic rule, with expected bytes derived by hand.

llama-2-7b: h = 4096, i = 11008, L = 32. One layer: 4 h^2 + 3 h i = 202,375,168 linear weights
plus two RMSNorm vectors (8,192) = 202,383,360; LoRA r = 8 on q and v (k/v are h x h in
llama-2-7b): 4 x (8 x 4096) = 131,072 adapter elements; one layer 202,514,432 elements.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from trainmem.analytic.tensor_states import flat_parameter_grads, state_layout
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig

torch = pytest.importorskip("torch")

LAYER = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096 + 4 * 8 * 4096
assert LAYER == 202_514_432


def _litgpt(gradient_accumulation_steps: int, **kw: object) -> TrainingConfig:
    base: dict[str, object] = {
        "framework": "litgpt",
        "litgpt_version": "0.1.0",  # lit-gpt @8641822 (setup.py): one FSDP1 unit per Block
        "precision": "bf16-true",
        "lora_rank": 8,
        "lora_targets": ("q", "v"),
        "data_parallel_size": 2,
        "zero_stage": 3,
        "activation_checkpointing": "full",
        "micro_batch_size": 1,
        "seq_len": 512,
        "gradient_accumulation_steps": gradient_accumulation_steps,
    }
    return TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]


# -- the real FSDP1 -------------------------------------------------------------------------


def _fsdp1_lora(h: int, vocab: int) -> tuple[Any, int]:
    """A 3-layer LoRA model wrapped as Lightning Fabric 2.1 wraps lit-gpt, rank 0 of a fake
    2-rank group; returns (the FSDP root, one Block's bytes in bf16). ``vocab`` 0: no embedding
    and head (the model maps hidden states to hidden states)."""
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    r = 4

    class LoRALinear(nn.Linear):
        def __init__(self) -> None:
            super().__init__(h, h, bias=False)
            self.lora_A = nn.Parameter(torch.zeros(r, h))
            self.lora_B = nn.Parameter(torch.zeros(h, r))

        def forward(self, x: Any) -> Any:
            return super().forward(x) + (x @ self.lora_A.T) @ self.lora_B.T

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = LoRALinear()
            self.fc = nn.Linear(h, 4 * h, bias=False)
            self.proj = nn.Linear(4 * h, h, bias=False)

        def forward(self, x: Any) -> Any:
            x = x + self.q(x)
            return x + self.proj(torch.relu(self.fc(x)))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(vocab, h) if vocab else nn.Identity()
            self.h = nn.ModuleList([Block() for _ in range(3)])
            self.head = nn.Linear(h, vocab, bias=False) if vocab else nn.Identity()

        def forward(self, x: Any) -> Any:
            x = self.wte(x)
            for block in self.h:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    model = GPT().to(torch.bfloat16)
    for name, p in model.named_parameters():  # lit-gpt mark_only_lora_as_trainable
        p.requires_grad = "lora_" in name
    block = 2 * sum(p.numel() for p in model.h[0].parameters())
    bf16 = torch.bfloat16
    fsdp = FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=True,
        device_id=torch.device("cpu"),
        mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16),
        limit_all_gathers=True,
    )
    return fsdp, block


def _micro_batch(fsdp: Any, x: Any, *, sync: bool) -> None:
    """lit-gpt: ``with fabric.no_backward_sync(model, enabled=is_accumulating)`` ->
    ``module.no_sync()`` on the accumulating micro-batches."""
    with torch.enable_grad() if sync else fsdp.no_sync():
        fsdp(x).float().sum().backward()


@pytest.mark.filterwarnings("ignore")
def test_real_fsdp1_keeps_whole_unsharded_layer_gradients_under_no_sync(fake_group: None) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel

    fsdp, _ = _fsdp1_lora(64, 100)
    opt = torch.optim.AdamW([p for p in fsdp.parameters() if p.requires_grad])
    x = torch.randint(0, 100, (2, 8))
    seen: list[tuple[int, str, bool, int, int | None]] = []
    for it in (1, 2, 3):  # gradient_accumulation_iters = 3: the third micro-batch syncs
        _micro_batch(fsdp, x, sync=it == 3)
        for unit in FullyShardedDataParallel.fsdp_modules(fsdp):
            flat = unit._handle.flat_param
            grad = None if flat.grad is None else flat.grad.numel()
            size = flat._unpadded_unsharded_size.numel()
            seen.append((it, type(unit.module).__name__, flat.requires_grad, size, grad))
        if it == 3:
            opt.step()
            opt.zero_grad()
    # by hand: a Block holds q (64 x 64), fc (256 x 64), proj (64 x 256) frozen and lora_A
    # (4 x 64), lora_B (64 x 4) trainable: 4096 + 16384 + 16384 + 256 + 256 = 37,376 elements;
    # the root (embedding 100 x 64, head 100 x 64) 12,800, all frozen
    block, root = 37_376, 12_800
    assert sum(1 for _, unit, *_ in seen if unit == "Block") == 9
    for it, unit, requires_grad, numel, grad in seen:
        if unit == "GPT":  # the root unit: nothing trainable, no gradient
            assert (requires_grad, numel, grad) == (False, root, None)
            continue
        assert requires_grad and numel == block
        # under no_sync the whole unsharded flat gradient, frozen weights included, is kept
        # between micro-batches; the synced one leaves this rank's shard (37,376 / 2)
        assert grad == (block if it < 3 else block // 2)


def _live_bytes(fn: Any) -> tuple[int, int]:
    """(highest, final) live CPU bytes during ``fn`` relative to its start: the running sum of
    torch.profiler's allocation events (frees carry negative sizes; tests/trace/trace_realcpu.py
    reads the same events)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()

    def walk(nodes: Any) -> Iterator[Any]:
        for n in nodes:
            yield n
            yield from walk(n.children)

    tree = prof.profiler.kineto_results.experimental_event_tree()  # type: ignore[union-attr]
    events = sorted(
        (e for e in walk(tree) if e.tag == _EventType.Allocation), key=lambda e: e.start_time_ns
    )
    live = list(itertools.accumulate(e.extra_fields.alloc_size for e in events))
    return max(live), live[-1]


@pytest.mark.filterwarnings("ignore")
def test_real_fsdp1_layer_backward_holds_view_gradients_and_their_concatenation(
    fake_group: None,
) -> None:
    # h = 256, one token: activations are a few KB, the layers' weights dominate. One Block:
    # 65,536 + 262,144 + 262,144 + 1,024 + 1,024 = 591,872 elements, 1,183,744 bytes in bf16
    fsdp, block = _fsdp1_lora(256, 0)
    assert block == 1_183_744
    x = torch.randn(1, 1, 256, dtype=torch.bfloat16)
    _, kept = _live_bytes(lambda: _micro_batch(fsdp, x, sync=False))
    assert kept == 3 * block  # three unsharded flat gradients kept after the first micro-batch
    high, kept = _live_bytes(lambda: _micro_batch(fsdp, x, sync=False))
    assert kept == 0  # the later ones add into them
    # at a layer's backward: its gathered weights and the prefetched next layer's (2 blocks),
    # the per-parameter gradients and their concatenation (2 blocks), over the kept gradients
    assert 4 * block <= high <= 4 * block + 64 * 1024
    _, kept = _live_bytes(lambda: _micro_batch(fsdp, x, sync=True))
    assert kept == -3 * block // 2  # three unsharded gradients out, three half shards in


# -- the analytic rule ----------------------------------------------------------------------


def test_flat_parameter_rule_applies_to_litgpt_fsdp_lora_only() -> None:
    assert flat_parameter_grads(_litgpt(1))
    assert not flat_parameter_grads(_litgpt(1, data_parallel_size=1, zero_stage=0))
    assert not flat_parameter_grads(_litgpt(1, framework="fsdp2"))  # per-parameter sharding
    assert not flat_parameter_grads(_litgpt(1, lora_rank=0, lora_targets=()))
    # litgpt 0.5.8 wraps each Linear (281510ab), 0.5.11 shards with FSDP2 (5ac69b06): the
    # frozen base weights are no longer in the adapters' flat parameter
    assert flat_parameter_grads(_litgpt(1, litgpt_version="0.5.7"))
    assert not flat_parameter_grads(_litgpt(1, litgpt_version="0.5.8"))
    assert not flat_parameter_grads(_litgpt(1, litgpt_version="0.5.13"))


def test_every_tensor_of_a_lora_layer_gets_a_gradient(llama_2_7b: ModelSpec) -> None:
    layout = state_layout(llama_2_7b, _litgpt(1))  # type: ignore[arg-type]
    # unsharded: 2 bytes (bf16) for each of the layer's 202,514,432 elements
    assert sum(s.full_grad_bytes for s in layout.layer) == 2 * LAYER == 405_028_864
    # after the reduce-scatter this rank's half (every tensor has an even size)
    assert sum(s.grad_bytes for s in layout.layer) == LAYER == 202_514_432
    # optimizer states stay on the adapters only
    assert all(s.state_bytes == 0 for s in layout.layer if not s.name.startswith("lora_"))
    # the root unit (embedding, final norm, LM head) holds nothing trainable: no gradient
    assert all(s.grad_bytes == 0 for s in layout.embedding + layout.head)


def _gradient_peak(model: object, training: TrainingConfig) -> int:
    est = estimate(model, training, simulate_allocator=False)  # type: ignore[arg-type]
    return est.schedules[0].category_peak(MemoryCategory.GRADIENT)


def test_no_sync_keeps_every_layer_unsharded_until_the_last_micro_batch(
    llama_2_7b: ModelSpec,
) -> None:
    # no accumulation: each layer's 405,028,864-byte unsharded gradient (a temporary) is
    # reduce-scattered at once, so 32 shards of 202,514,432 bytes stay
    assert _gradient_peak(llama_2_7b, _litgpt(1)) == 32 * 202_514_432
    # 4 micro-batches, the first three under no_sync: all 32 layers' unsharded gradients at once;
    # the last micro-batch's first reduce-scatter writes its shard while its input still exists
    peak = _gradient_peak(llama_2_7b, _litgpt(4))
    assert peak == 32 * 405_028_864 + 202_514_432 == 13_163_438_080
    # FSDP2 (torchtitan) shards per parameter: the frozen base weights get no gradient
    fsdp2 = _litgpt(4, framework="fsdp2")
    assert _gradient_peak(llama_2_7b, fsdp2) < 32 * 131_072 * 4


def _alloc_sizes(items: Any, label: str) -> set[int]:
    """Sizes of the allocations labelled ``label`` anywhere in a schedule's items."""
    from trainmem.schedule import Repeat

    out: set[int] = set()
    for item in items:
        if isinstance(item, Repeat):
            out |= _alloc_sizes(item.body, label)
        elif item.action == "alloc" and item.label == label and item.size_bytes:
            out.add(item.size_bytes)
    return out


def test_layer_backward_holds_view_gradients_and_the_new_flat_gradient(
    llama_2_7b: ModelSpec,
) -> None:
    est = estimate(llama_2_7b, _litgpt(4), simulate_allocator=False)  # type: ignore[arg-type]
    schedule = est.schedules[0]
    # both transients are one unsharded layer in bf16: 2 x 202,514,432 bytes
    views = "the layer's per-parameter gradients before autograd concatenates them"
    fresh = "the layer's new flat gradient before it is added to the accumulated one"
    assert _alloc_sizes(schedule.step, views) == {405_028_864}
    assert _alloc_sizes(schedule.step, fresh) == {405_028_864}
    # the step's peak: a layer's backward in an accumulating micro-batch, every layer's
    # unsharded gradient alive
    peak = schedule.peak()
    assert peak.phase == "backward" and peak.label == fresh
    assert peak.by_category[MemoryCategory.GRADIENT] == 32 * 405_028_864
    # without the flat-parameter rule (FSDP2) neither transient exists
    fsdp2 = estimate(llama_2_7b, _litgpt(4, framework="fsdp2"), simulate_allocator=False)  # type: ignore[arg-type]
    assert not _alloc_sizes(fsdp2.schedules[0].step, views)
    assert not _alloc_sizes(fsdp2.schedules[0].step, fresh)
