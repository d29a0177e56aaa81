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

import pytest

from trainmem.analytic.tensor_states import flat_parameter_grads, state_layout
from trainmem.breakdown import MemoryCategory
from trainmem.estimate import estimate
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

torch = pytest.importorskip("torch")

LAYER = 4 * 4096 * 4096 + 3 * 4096 * 11008 + 2 * 4096 + 4 * 8 * 4096
assert LAYER == 202_514_432


def _litgpt(gradient_accumulation_steps: int, **kw: object) -> TrainingConfig:
    base: dict[str, object] = {
        "framework": "litgpt",
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


def _run_fsdp1_lora() -> list[tuple[str, bool, int, int | None]]:
    """(iteration, flat param requires grad, its unsharded numel, its gradient's numel) of
    every FSDP unit after each of three micro-batches (two under ``no_sync()``)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel, MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.testing._internal.distributed.fake_pg import FakeStore

    h, r = 64, 4

    class LoRALinear(nn.Linear):
        def __init__(self) -> None:
            super().__init__(h, h, bias=False)
            self.lora_A = nn.Parameter(torch.zeros(r, h))
            self.lora_B = nn.Parameter(torch.zeros(h, r))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) + (x @ self.lora_A.T) @ self.lora_B.T

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = LoRALinear()
            self.fc = nn.Linear(h, 4 * h, bias=False)
            self.proj = nn.Linear(4 * h, h, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.q(x)
            return x + self.proj(torch.relu(self.fc(x)))

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(100, h)
            self.h = nn.ModuleList([Block() for _ in range(3)])
            self.head = nn.Linear(h, 100, bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.wte(idx)
            for block in self.h:
                x = block(x)
            return self.head(x)

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = GPT().to(torch.bfloat16)
        for name, p in model.named_parameters():  # lit-gpt mark_only_lora_as_trainable
            p.requires_grad = "lora_" in name
        bf16 = torch.bfloat16
        fsdp = FullyShardedDataParallel(
            model,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=True,
            device_id=torch.device("cpu"),
            mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, buffer_dtype=bf16),
            limit_all_gathers=True,
        )
        opt = torch.optim.AdamW([p for p in fsdp.parameters() if p.requires_grad])
        x = torch.randint(0, 100, (2, 8))
        seen: list[tuple[str, bool, int, int | None]] = []
        for it in (1, 2, 3):  # gradient_accumulation_iters = 3: the third one syncs
            accumulating = it % 3 != 0
            with fsdp.no_sync() if accumulating else torch.enable_grad():
                fsdp(x).float().sum().backward()
            for unit in FullyShardedDataParallel.fsdp_modules(fsdp):
                flat = unit._handle.flat_param
                grad = flat.grad
                seen.append(
                    (
                        f"{it}:{type(unit.module).__name__}",
                        flat.requires_grad,
                        flat._unpadded_unsharded_size.numel(),
                        None if grad is None else grad.numel(),
                    )
                )
            if not accumulating:
                opt.step()
                opt.zero_grad()
        return seen
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore")
def test_real_fsdp1_keeps_whole_unsharded_layer_gradients_under_no_sync() -> None:
    # by hand: a Block holds q (64 x 64), fc (256 x 64), proj (64 x 256) frozen and lora_A
    # (4 x 64), lora_B (64 x 4) trainable: 4096 + 16384 + 16384 + 256 + 256 = 37,376 elements;
    # the root (embedding 100 x 64, head 100 x 64) 12,800, all frozen
    block, root = 37_376, 12_800
    seen = _run_fsdp1_lora()
    for tag, requires_grad, numel, grad in seen:
        it, unit = tag.split(":")
        if unit == "GPT":  # the root unit: nothing trainable, no gradient
            assert (requires_grad, numel, grad) == (False, root, None)
            continue
        assert requires_grad and numel == block
        # under no_sync the whole unsharded flat gradient, frozen weights included, is kept
        # between micro-batches; the synced one leaves this rank's shard (37,376 / 2)
        assert grad == (block if it in ("1", "2") else block // 2)
    assert sum(1 for tag, *_ in seen if tag.endswith("Block")) == 9


# -- the analytic rule ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama() -> object:
    return load_model_spec("llama-2-7b")


def test_flat_parameter_rule_applies_to_litgpt_fsdp_lora_only() -> None:
    assert flat_parameter_grads(_litgpt(1))
    assert not flat_parameter_grads(_litgpt(1, data_parallel_size=1, zero_stage=0))
    assert not flat_parameter_grads(_litgpt(1, framework="fsdp2"))  # per-parameter sharding
    assert not flat_parameter_grads(_litgpt(1, lora_rank=0, lora_targets=()))


def test_every_tensor_of_a_lora_layer_gets_a_gradient(llama: object) -> None:
    layout = state_layout(llama, _litgpt(1))  # type: ignore[arg-type]
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


def test_no_sync_keeps_every_layer_unsharded_until_the_last_micro_batch(llama: object) -> None:
    # no accumulation: each layer's 405,028,864-byte unsharded gradient (a temporary) is
    # reduce-scattered at once, so 32 shards of 202,514,432 bytes stay
    assert _gradient_peak(llama, _litgpt(1)) == 32 * 202_514_432
    # 4 micro-batches, the first three under no_sync: all 32 layers' unsharded gradients at once;
    # the last micro-batch's first reduce-scatter writes its shard while its input still exists
    peak = _gradient_peak(llama, _litgpt(4))
    assert peak == 32 * 405_028_864 + 202_514_432 == 13_163_438_080
    # FSDP2 (torchtitan) shards per parameter: the frozen base weights get no gradient
    fsdp2 = _litgpt(4, framework="fsdp2")
    assert _gradient_peak(llama, fsdp2) < 32 * 131_072 * 4
