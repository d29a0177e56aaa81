"""FSDP1 frozen units under transformers' reentrant checkpointing (issue 24): each layer's input
and its gradient kept until the backward ends (Note [FSDP1 frozen units under reentrant
checkpointing], trainmem/analytic/transforms/fsdp1_reentrant.py).

First the real thing: torch's FSDP1 on the CPU under the ``"fake"`` process group (2 ranks),
wrapped as accelerate wraps a peft model for the HF Trainer (decoder layers as units, each LoRA
leaf a unit of its own: peft ``fsdp_auto_wrap_policy``), each layer called through
``torch.utils.checkpoint.checkpoint(layer.__call__, x, use_reentrant=...)`` as transformers 4.x
does, the embedding output made to require grad (``enable_input_require_grads``). Then the
analytic rule, with bytes derived by hand.
"""

from __future__ import annotations

import functools
import gc
from typing import Any

import pytest

from conftest import keyed_schedule_ops
from trainmem.analytic.checkpointing import fsdp1_kept_input_bytes
from trainmem.estimate import estimate, resolve_model
from trainmem.specs.training import TrainingConfig

torch = pytest.importorskip("torch")

H, T, LAYERS = 64, 8, 3


def _alive_at_backward_end(
    *, reentrant: bool, frozen_unit: bool, fsdp: bool, inside: bool = False
) -> int:
    """Residual-stream-sized (1, T, H) tensors alive when the layers' backward has ended (the
    embedding output's gradient hook: before FSDP's final callback). ``inside``: the layer
    checkpoints itself in its own ``__call__`` (transformers >= 4.52 modeling_layers.py
    ``GradientCheckpointingLayer``), inside the FSDP1 unit that wraps it."""
    from torch import nn
    from torch.distributed.fsdp import BackwardPrefetch, MixedPrecision
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import (
        _or_policy,
        lambda_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )
    from torch.utils.checkpoint import checkpoint

    class LoraLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(H, H, bias=False)
            self.lora_A = nn.Linear(H, 4, bias=False)
            self.lora_B = nn.Linear(4, H, bias=False)

        def forward(self, x: Any) -> Any:
            return self.base(x) + self.lora_B(self.lora_A(x))

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = LoraLinear()
            self.fc = nn.Linear(H, 4 * H, bias=False)
            self.proj = nn.Linear(4 * H, H, bias=False)
            self.norm = nn.Parameter(torch.ones(H))

        def forward(self, x: Any) -> Any:
            x = x + self.q(x * self.norm)
            return x + self.proj(torch.relu(self.fc(x)))

        def __call__(self, x: Any) -> Any:
            if inside:
                return checkpoint(super().__call__, x, use_reentrant=reentrant)
            return super().__call__(x)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(50, H)
            self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
            self.head = nn.Linear(H, 50, bias=False)

        def forward(self, ids: Any) -> Any:
            x = self.emb(ids)
            for layer in self.layers:
                x = layer(x) if inside else checkpoint(layer.__call__, x, use_reentrant=reentrant)
            return self.head(x)

    torch.manual_seed(0)
    model = Model().to(torch.float16)
    for name, p in model.named_parameters():
        # LoRA; "a trainable unit": the layer's own norm trains too
        p.requires_grad = "lora_" in name or (not frozen_unit and name.endswith("norm"))
    seen: dict[str, int] = {}

    def at_end(grad: Any) -> None:
        if not seen.get("steady"):
            return
        gc.collect()
        objs = gc.get_objects()
        seen["n"] = sum(1 for o in objs if torch.is_tensor(o) and tuple(o.shape) == (1, T, H))

    def require_grad(module: Any, args: Any, out: Any) -> Any:  # enable_input_require_grads
        out.requires_grad_(True)
        out.register_hook(at_end)
        return out

    model.emb.register_forward_hook(require_grad)
    net: Any = model
    if fsdp:

        def lora_leaf(m: Any) -> bool:  # peft utils/other.py fsdp_auto_wrap_policy
            w = getattr(m, "weight", None)
            return not list(m.children()) and w is not None and w.requires_grad

        policy = functools.partial(
            _or_policy,
            policies=[
                functools.partial(lambda_auto_wrap_policy, lambda_fn=lora_leaf),
                functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Layer}),
            ],
        )
        f16 = torch.float16
        net = FSDP(
            model,
            auto_wrap_policy=policy,
            use_orig_params=True,
            device_id=torch.device("cpu"),
            mixed_precision=MixedPrecision(param_dtype=f16, reduce_dtype=f16, buffer_dtype=f16),
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        )
    ids = torch.randint(0, 50, (1, T))
    net(ids).float().sum().backward()
    seen["steady"] = 1  # the second step is the steady state
    net(ids).float().sum().backward()
    return seen["n"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_real_fsdp1_keeps_each_reentrant_layer_input_and_gradient(fake_group: None) -> None:
    # L layers: each layer's checkpointed input (the first one's is the embedding output) and
    # the gradient its recomputation's backward accumulated into the detached input, plus the
    # embedding output's own .grad: 2 L + 1
    assert _alive_at_backward_end(reentrant=True, frozen_unit=True, fsdp=True) == 2 * LAYERS + 1


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_real_fsdp1_keeps_nothing_more_otherwise(fake_group: None) -> None:
    # no reshard-only hook (a trainable unit), no detached leaf (non-reentrant), no FSDP: the
    # embedding output and its gradient only
    assert _alive_at_backward_end(reentrant=True, frozen_unit=False, fsdp=True) == 2
    assert _alive_at_backward_end(reentrant=False, frozen_unit=True, fsdp=True) == 2
    assert _alive_at_backward_end(reentrant=True, frozen_unit=True, fsdp=False) == 2


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_real_fsdp1_keeps_nothing_when_the_layer_checkpoints_itself(fake_group: None) -> None:
    # transformers >= 4.52: the checkpoint inside the unit; FSDP1's pre-forward sees the layer's
    # input once, grad enabled, as the previous checkpoint's non-leaf output: no detached leaf
    # input in the unit, so the embedding output and its gradient only
    assert _alive_at_backward_end(reentrant=True, frozen_unit=True, fsdp=True, inside=True) == 2


# -- the analytic rule --------------------------------------------------------------------------


def _fms(**kw: object) -> TrainingConfig:
    """fms-acceleration's FSDP QLoRA row on llama-2-70b (GT154): HF Trainer, accelerate FSDP1,
    transformers 4.48.1, two micro-sequences of 4096 tokens, full checkpointing."""
    base: dict[str, object] = {
        "framework": "accelerate-fsdp",
        "transformers_version": "4.48.1",
        "precision": "bf16-mixed",
        "micro_batch_size": 2,
        "seq_len": 4096,
        "activation_checkpointing": "full",
        "attention": "flash",
        "data_parallel_size": 2,
        "zero_stage": 3,
        "lora_rank": 16,
        "lora_targets": ("q", "k", "v", "o"),
    }
    return TrainingConfig(**{**base, **kw})  # type: ignore[arg-type]


def test_kept_input_is_one_residual_tensor_where_the_rule_applies() -> None:
    model = resolve_model("llama-2-70b")
    # b s h bf16: 2 x 4096 x 8192 x 2 B
    assert fsdp1_kept_input_bytes(model, _fms()) == 134_217_728
    # transformers 5 checkpoints non-reentrant; an explicit value wins
    assert fsdp1_kept_input_bytes(model, _fms(transformers_version="5.0")) == 0
    assert fsdp1_kept_input_bytes(model, _fms(checkpoint_reentrant=False)) == 0
    # reentrant, the checkpoint outside the unit: the model's loop checkpoints the FSDP1 wrapper
    # up to transformers 4.51 (4.51.3 modeling_llama.py LlamaModel.forward); from 4.52 the
    # layer's own GradientCheckpointingLayer.__call__ does, inside the unit: nothing kept
    assert fsdp1_kept_input_bytes(model, _fms(transformers_version="4.51.3")) == 134_217_728
    for inside in ("4.52.0", "5.0"):
        given = _fms(transformers_version=inside, checkpoint_reentrant=True)
        assert fsdp1_kept_input_bytes(model, given) == 0
    # fsdp_qlora checkpoints inside its units; a full fine-tune's units train; no checkpointing
    assert fsdp1_kept_input_bytes(model, _fms(framework="fsdp-qlora")) == 0
    assert fsdp1_kept_input_bytes(model, _fms(lora_rank=0, lora_targets=())) == 0
    assert fsdp1_kept_input_bytes(model, _fms(activation_checkpointing="none")) == 0


def test_schedule_keeps_two_tensors_per_layer_until_the_backward_ends() -> None:
    # llama-2-7b, one sequence of 512 tokens: u = 512 x 4096 x 2 B = 4,194,304 per tensor;
    # layers 31 .. 1 keep 2 u each, layer 0 u (the input-embedding hook keeps its input): 63 u
    training = _fms(micro_batch_size=1, seq_len=512)
    est = estimate("llama-2-7b", training, simulate_allocator=False)
    ops = list(keyed_schedule_ops(list(est.schedules[0].step), "fsdp1_kept/"))
    u = 4_194_304
    allocs = [(key, size) for action, key, size in ops if action == "alloc"]
    assert allocs == [(f"fsdp1_kept/{i}", 2 * u) for i in range(31, 0, -1)] + [("fsdp1_kept/0", u)]
    frees = [(key, size) for action, key, size in ops if action == "free"]
    assert sorted(frees) == sorted(allocs)  # all at the root's post-backward
    assert sum(size for _, size in allocs) == 63 * u
    # the peak rises by about those bytes against non-reentrant checkpointing
    plain_training = _fms(micro_batch_size=1, seq_len=512, checkpoint_reentrant=False)
    plain = estimate("llama-2-7b", plain_training, simulate_allocator=False)
    rise = est.breakdown.allocated_bytes - plain.breakdown.allocated_bytes
    assert 0 < rise <= 63 * u
