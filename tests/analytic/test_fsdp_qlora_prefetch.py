"""Note [FSDP1 backward prefetch under adapter units] under fsdp_qlora's reentrant checkpointing
inside the units (train.py 50efa1e: FSDP wraps each LoRA leaf and each decoder layer, then
``apply_activation_checkpointing(..., CheckpointImpl.REENTRANT)`` wraps each layer's module
inside its unit): the layer's MLP backward runs with that layer alone gathered; the layer below
is prefetched from the first adapter unit's pre-backward, in the attention's backward. Checked
on torch's FSDP1 on the CPU under the fake process group, and on the schedule."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest

from trainmem.estimate import estimate
from trainmem.schedule import Item, Repeat, _format_index
from trainmem.specs.training import TrainingConfig

torch = pytest.importorskip("torch")

H, T, LAYERS = 64, 8, 3


def _gathered_layers() -> dict[str, list[int]]:
    """Which layer units are unsharded (their padded full parameter has storage) when the
    last layer's MLP backward and its attention's backward run, the second step."""
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

    class LoraLinear(nn.Module):
        def __init__(self, n_in: int, n_out: int) -> None:
            super().__init__()
            self.base = nn.Linear(n_in, n_out, bias=False)
            self.lora_A = nn.Linear(n_in, 4, bias=False)
            self.lora_B = nn.Linear(4, n_out, bias=False)

        def forward(self, x: Any) -> Any:
            return self.base(x) + self.lora_B(self.lora_A(x))

    seen: dict[str, list[int]] = {}
    units: list[Any] = []

    def gathered() -> list[int]:
        return [
            k
            for k, unit in enumerate(units)
            if unit._handle.flat_param._full_param_padded.untyped_storage().size() > 0
        ]

    class Layer(nn.Module):
        def __init__(self, last: bool) -> None:
            super().__init__()
            self.q = LoraLinear(H, H)
            self.up = LoraLinear(H, 4 * H)
            self.down = LoraLinear(4 * H, H)
            self.last = last

        def forward(self, x: Any) -> Any:
            if self.last and torch.is_grad_enabled() and seen.get("steady"):
                # the layer input's gradient: made once q's backward (its adapters') has run
                x.register_hook(lambda g: seen.__setitem__("attention", gathered()))
            x = x + self.q(x)
            m = torch.relu(self.up(x))
            if self.last and torch.is_grad_enabled() and seen.get("steady"):
                m.register_hook(lambda g: seen.__setitem__("mlp", gathered()))
            return x + self.down(m)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, H)
            self.layers = nn.ModuleList([Layer(k == LAYERS - 1) for k in range(LAYERS)])
            self.head = nn.Linear(H, 50, bias=False)

        def forward(self, ids: Any) -> Any:
            x = self.emb(ids)
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    torch.manual_seed(0)
    model = Model()
    for name, p in model.named_parameters():
        p.requires_grad = "lora_" in name

    def lora_leaf(m: Any) -> bool:  # train.py get_wrapping_policy's lambda_policy_fn
        w = getattr(m, "weight", None)
        return not list(m.children()) and w is not None and w.requires_grad

    policy = functools.partial(
        _or_policy,
        policies=[
            functools.partial(lambda_auto_wrap_policy, lambda_fn=lora_leaf),
            functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer}),
        ],
    )
    net = FSDP(
        model,
        auto_wrap_policy=policy,
        use_orig_params=False,
        device_id=torch.device("cpu"),
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        limit_all_gathers=True,
    )
    units.extend(m for m in net.modules() if isinstance(m, FSDP) and isinstance(m.module, Layer))
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT)
    # train.py: after wrapping, each layer's module inside its unit (the units stay the same)
    apply_activation_checkpointing(
        net, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Layer)
    )
    model.emb.register_forward_hook(lambda m, a, out: out.requires_grad_(True))
    ids = torch.randint(0, 50, (1, T))
    net(ids).float().sum().backward()
    seen["steady"] = [1]
    net(ids).float().sum().backward()
    return seen


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_real_fsdp1_gathers_one_layer_at_the_mlp_backward(fake_group: None) -> None:
    got = _gathered_layers()
    # the last layer's MLP backward: that layer alone; once q's backward has run (its first
    # adapter's pre-backward hook), the layer below prefetched too
    assert got["mlp"] == [LAYERS - 1]
    assert got["attention"] == [LAYERS - 2, LAYERS - 1]


def _gathers(items: list[Item], i: int = 0) -> Iterator[tuple[str, str]]:
    for item in items:
        if isinstance(item, Repeat):
            for k in range(item.count):
                yield from _gathers(list(item.body), item.index(k))
        elif item.key.startswith("gather/") or item.key == "mlp_tmp":
            yield item.action, _format_index(item.key, i)


def test_schedule_holds_one_layer_at_the_mlp_backward() -> None:
    # GT118's setup (train.py LoRA, llama-2-7b, 2 ranks, full checkpointing): while the first
    # backward layer's MLP transients are alive, one layer's gathered parameters and the root's
    training = TrainingConfig(
        framework="fsdp-qlora",
        precision="bf16-true",
        micro_batch_size=1,
        seq_len=512,
        activation_checkpointing="full",
        data_parallel_size=2,
        zero_stage=3,
        lora_rank=64,
    )
    est = estimate("llama-2-7b", training, simulate_allocator=False)
    live: set[str] = set()
    at_mlp: list[set[str]] = []
    for action, key in _gathers(list(est.schedules[0].step)):
        if action == "alloc":
            live.add(key)
        else:
            live.discard(key)
        if action == "alloc" and key == "mlp_tmp":
            at_mlp.append({k for k in live if k.startswith("gather/")})
    assert len(at_mlp) == 32
    assert all(len(gathers) == 2 for gathers in at_mlp), at_mlp[:3]  # a layer and the root
