"""diffusers' layerwise casting (``--layerwise-casting float8_e4m3fn``; Note [diffusers'
layerwise casting] in ``trace/layerwise_casting.py``): the trace's stand-in against a real CPU
execution of diffusers' own ``enable_layerwise_casting`` hooks.

The real run: the toy FLUX (tests/trace/diffusers_configs/tiny-flux.json) built on CPU with real
weights, bf16, peft LoRA r 4 on the attention and feed-forwards, then diffusers 0.42's
``ModelMixin.enable_layerwise_casting(storage_dtype=float8_e4m3fn, compute_dtype=bfloat16)``;
its second step measured by a dispatch-mode counter that also holds the storages made before the
step (the hooks free the stored weights and make new ones inside the step, which a counter of
the step's own storages, or torch.profiler, which misses frees of blocks allocated before it
started, cannot see). No code is shared with the recorder or the stand-in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainmem.errors import NotApplicableError, SpecError
from trainmem.specs.hf import load_hf_config
from trainmem.specs.training import TrainingConfig

pytest.importorskip("diffusers")
import torch  # noqa: E402

from trainmem.trace.diffusers_model import (  # noqa: E402
    build_diffusers_model,
    diffusers_loss,
    make_diffusers_batch,
)
from trainmem.trace.engine import (  # noqa: E402
    _autocast_factory,
    _emulation,
    apply_activation_checkpointing,
)
from trainmem.trace.optimizers import build_optimizer  # noqa: E402
from trainmem.trace.step import run_step  # noqa: E402

FLUX = Path(__file__).parent / "diffusers_configs" / "tiny-flux.json"


def _training(checkpointing: str, casting: str) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=1, precision="bf16-mixed", load_dtype="bfloat16", lora_rank=4,
        lora_targets=("q", "k", "v", "o", "up", "down"), activation_checkpointing=checkpointing,
        resolution=64, text_seq_len=16, layerwise_casting=casting,
    )  # fmt: skip


def _real_peak(training: TrainingConfig) -> tuple[int, dict[Any, int]]:
    """(peak live bytes of the second step, parameter elements by dtype) of a real CPU run."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Counter(TorchDispatchMode):  # type: ignore[misc]
        def __init__(self, held: list[Any]) -> None:
            super().__init__()
            self.live: dict[int, tuple[Any, int]] = {}
            self.peak = 0
            for t in held:
                self.add(t)

        def add(self, t: Any) -> None:
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in self.live:
                self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
            out = func(*args, **(kwargs or {}))
            for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
                del self.live[key]
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.add(t)
            self.peak = max(self.peak, sum(size for _, size in self.live.values()))
            return out

    torch.manual_seed(0)
    model = build_diffusers_model(load_hf_config(str(FLUX)), training, device="cpu")
    assert any(hasattr(m, "_diffusers_hook") for m in model.modules()) == (
        training.layerwise_casting != "none"
    )  # diffusers' own hooks, not the stand-in
    apply_activation_checkpointing(model, training.activation_checkpointing)
    batches = [make_diffusers_batch(model, training)]
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], training)
    kwargs = dict(loss_fn=diffusers_loss, autocast=_autocast_factory(training), set_to_none=True)
    with _emulation(training, emulate_cuda=False):
        run_step(model, batches, opt, **kwargs)  # warm-up: the optimizer states
        held = [*model.parameters(), *model.buffers()]
        held += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        held += [t for b in batches for t in tree_leaves(b) if isinstance(t, torch.Tensor)]
        counter = Counter(held)
        with counter:
            run_step(model, batches, opt, **kwargs)
    elements: dict[Any, int] = {}
    for p in model.parameters():
        elements[p.dtype] = elements.get(p.dtype, 0) + p.numel()
    return counter.peak, elements


def _fake_peak(training: TrainingConfig) -> tuple[int, int]:
    """(peak, parameter bytes at the end of the recorded step) of the trace."""
    from test_diffusers_real_cpu import fake_report

    report = fake_report(FLUX.name, training)
    live: dict[int, int] = {}
    for ev in report.timeline.events:
        if ev.category.value != "parameters":
            continue
        if ev.action == "alloc":
            live[ev.block_id] = ev.size_bytes
        else:
            live.pop(ev.block_id, None)
    return report.peak_bytes, sum(live.values())


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_stand_in_matches_diffusers_hooks_on_a_real_cpu_step(checkpointing: str) -> None:
    cast = _training(checkpointing, "float8_e4m3fn")
    real, elements = _real_peak(cast)
    fake, parameter_bytes = _fake_peak(cast)
    assert fake == real
    # every parameter the step ends with is labelled a parameter: the cast layers' new stored
    # copies (1 B) and the layers diffusers skips (norms, pos_embed, proj_out, the adapters; 2 B)
    f8, bf16 = elements[torch.float8_e4m3fn], elements[torch.bfloat16]
    assert f8 > 0 and set(elements) == {torch.float8_e4m3fn, torch.bfloat16}
    assert parameter_bytes == f8 + 2 * bf16


@pytest.mark.slow  # four more real CPU steps
def test_casting_saves_memory_under_checkpointing_and_costs_without() -> None:
    """Without checkpointing every cast layer's bf16 copy is saved for its backward beside its
    float8 storage, so the peak rises; under full checkpointing it falls (real CPU runs)."""
    none_plain, _ = _real_peak(_training("none", "none"))
    none_cast, _ = _real_peak(_training("none", "float8_e4m3fn"))
    full_plain, _ = _real_peak(_training("full", "none"))
    full_cast, _ = _real_peak(_training("full", "float8_e4m3fn"))
    assert none_cast > none_plain and full_cast < full_plain
    assert _fake_peak(_training("full", "none"))[0] == full_plain


@pytest.mark.parametrize(
    ("changes", "said"),
    [
        (dict(lora_rank=0), "set lora_rank"),
        (dict(quantize_base="nf4"), "pick one"),
        (dict(zero_stage=3, data_parallel_size=2), "zero_stage 0"),
    ],
)
def test_refusals_name_the_field(changes: dict[str, Any], said: str) -> None:
    from trainmem.specs.diffusers import check_layerwise_casting

    training = TrainingConfig(
        **{
            "lora_rank": 4,
            "precision": "bf16-mixed",
            "layerwise_casting": "float8_e5m2",
            **changes,
        }
    )
    with pytest.raises(SpecError, match=f"layerwise_casting.*{said}"):
        check_layerwise_casting(load_hf_config(str(FLUX)), training)
    with pytest.raises(NotApplicableError, match="layerwise_casting.*not one"):
        check_layerwise_casting({"model_type": "llama"}, training)
