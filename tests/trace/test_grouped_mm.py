"""Note [Traced grouped matmul of frozen experts] (trainmem/trace/grouped_mm.py): the fake
step's stand-in for torch's grouped_mm on non-bf16 expert weights keeps what torch's own
autograd node keeps, checked by a real CPU run of both (torch's ``grouped_mm`` runs on CPU in
bf16 and fp32; transformers' fallback op runs on CPU too)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import transformers.integrations.moe  # noqa: E402, F401  (registers transformers' ops)

from trainmem.trace.grouped_mm import guarded_grouped_mm  # noqa: E402


def _saved(fn: Any, inputs: Any, weight: Any, offs: Any) -> tuple[Any, list[tuple[int, ...]]]:
    shapes: list[tuple[int, ...]] = []

    def pack(tensor: Any) -> Any:
        if tensor.is_floating_point():  # (torch keeps the int32 offsets as a tensor too)
            shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn(inputs, weight, offs)
    return out, sorted(shapes)


@pytest.mark.parametrize("weight_trains", [False, True], ids=["frozen", "trained"])
def test_saves_what_torch_grouped_mm_saves(weight_trains: bool) -> None:
    # 4 experts, 16 routed tokens of 64 features to 32 (a frozen expert under LoRA)
    offs = torch.tensor([4, 8, 12, 16], dtype=torch.int32)
    inputs = torch.randn(16, 64, requires_grad=True)
    weight = torch.randn(4, 64, 32, requires_grad=weight_trains)

    def torch_grouped_mm(a: Any, b: Any, offs: Any) -> Any:
        return torch.nn.functional.grouped_mm(a, b, offs=offs)

    reference, torch_saved = _saved(torch_grouped_mm, inputs, weight, offs)
    out, saved = _saved(guarded_grouped_mm(torch), inputs, weight, offs)
    # frozen: the weight only, for the input's gradient; trained: the input too
    expected = [(4, 64, 32)] if not weight_trains else [(4, 64, 32), (16, 64)]
    assert torch_saved == sorted(expected)
    assert saved == torch_saved
    grad = torch.randn(16, 32)
    want = torch.autograd.grad(reference, [inputs], grad)[0]
    got = torch.autograd.grad(out, [inputs], grad)[0]
    assert torch.allclose(got, want, atol=1e-4)
