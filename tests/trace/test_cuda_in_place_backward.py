"""The trace's emulation of what autograd does in place on a GPU but out of place under a
dispatch mode or on fake tensors (``trainmem.trace.cuda_accumulate``,
``trainmem.trace.cuda_scatter``).

Expected behaviour: PyTorch's own, read off a real CPU run with no dispatch mode active (the
profiler records which ATen ops the engine ran: ``aten::add_`` is an in-place accumulation in
``InputBuffer::accumulate``, ``aten::scatter_`` the in-place branch of
``value_selecting_reduction_backward``); both branches depend on ``isTensorSubclassLike`` and
reference counts only, not on the device, so the real CPU run shows what a GPU runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.profiler import profile  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from trainmem.trace.cuda_accumulate import cuda_grad_accumulation  # noqa: E402
from trainmem.trace.cuda_scatter import cuda_scatter_backward  # noqa: E402


def _leaf() -> Any:
    return torch.randn(4, 8, requires_grad=True) * 1.0  # a non-leaf h that takes two gradients


def _unique(h: Any) -> Any:  # two fresh gradients reach h: summed in place
    return (h * 2).sum() + (h * 3).sum()


def _same_tensor(h: Any) -> Any:  # AddBackward0 sends one tensor to both inputs: out of place
    return (h + h).sum()


def _passed_through(h: Any) -> Any:  # the buffer's gradient is also held elsewhere
    g = h + 1
    return (g * 2 + g).sum()


def _views(h: Any) -> Any:  # cat's backward returns views of one tensor: the first sum out of
    # place, the second in place
    return (torch.cat([h, h * 2]).chunk(2)[0] * 3 + h).sum()


def _expanded(h: Any) -> Any:  # sum's backward expands a scalar; the dense one arrives first
    return h.sum() + (h * 2).sum()


GRAPHS: list[Callable[[Any], Any]] = [_unique, _same_tensor, _passed_through, _views, _expanded]


def _real_accumulations(graph: Callable[[Any], Any]) -> list[bool]:
    """For each gradient sum of the engine, in order: in place (``aten::add_``) or not."""
    loss = graph(_leaf())
    with profile() as prof:
        loss.backward()
    return [e.name == "aten::add_" for e in prof.events() if e.name in ("aten::add", "aten::add_")]


@pytest.mark.parametrize("graph", GRAPHS, ids=lambda g: g.__name__.strip("_"))
def test_gradient_sums_in_place_as_the_engine_does(graph: Callable[[Any], Any]) -> None:
    expected = _real_accumulations(graph)
    assert expected  # every graph sums at least one pair of gradients
    with FakeTensorMode():
        loss = graph(_leaf())
        with cuda_grad_accumulation() as mode:
            loss.backward()
    assert mode.decisions == expected


class _Passthrough(TorchDispatchMode):  # type: ignore[misc]
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def test_without_the_emulation_a_trace_sums_out_of_place() -> None:
    # the reason for the emulation: any dispatch mode makes the engine's sum out of place
    # (ATen/TensorSubclassLikeUtils.h, dispatch_mode_enabled)
    assert _real_accumulations(_unique) == [True]
    loss = _unique(_leaf())
    with _Passthrough(), profile() as prof:
        loss.backward()
    names = {e.name for e in prof.events() if e.name.startswith("aten::add")}
    assert names == {"aten::add"}  # (recorded twice: at the mode and at the kernel)


def _scatter_ops(run: Callable[[], None]) -> list[str]:
    names: list[str] = []

    class Log(TorchDispatchMode):  # type: ignore[misc]
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if "scatter" in str(func):
                names.append(str(func))
            return func(*args, **(kwargs or {}))

    with FakeTensorMode(), Log(), cuda_scatter_backward():
        run()
    return names


def test_max_backward_scatters_in_place_as_the_engine_does() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    with profile() as prof:
        torch.max(x, dim=-1, keepdim=True)[0].sum().backward()
    real = [e.name for e in prof.events() if e.name.startswith("aten::scatter")]
    assert real == ["aten::scatter_"]

    def run() -> None:
        y = torch.randn(4, 8, requires_grad=True)
        torch.max(y, dim=-1, keepdim=True)[0].sum().backward()

    assert _scatter_ops(run) == ["aten.scatter_.src"]


def test_gather_backward_scatters_in_place_as_the_engine_does() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    index = torch.zeros(4, 1, dtype=torch.long)
    with profile() as prof:
        torch.gather(x, 1, index).sum().backward()
    real = [e.name for e in prof.events() if e.name.startswith("aten::scatter")]
    assert real == ["aten::scatter_add_"]

    def run() -> None:
        y = torch.randn(4, 8, requires_grad=True)
        torch.gather(y, 1, torch.zeros(4, 1, dtype=torch.long)).sum().backward()

    assert _scatter_ops(run) == ["aten.scatter_add_.default"]


def test_tensor_subclasses_sum_out_of_place_as_on_a_gpu() -> None:
    # a subclass gradient (DTensor under tensor parallelism, float8...) is isTensorSubclassLike
    # on a GPU too: the engine sums it out of place, and so does the emulation
    from torch.testing._internal.two_tensor import TwoTensor

    def graph(x: Any) -> Any:
        h = x * 1.0
        return (h * 2).sum() + (h * 3).sum()

    x = TwoTensor(torch.randn(4, 8), torch.randn(4, 8)).requires_grad_()
    with profile() as prof:
        graph(x).backward()
    assert "aten::add_" not in {e.name for e in prof.events()}
    y = TwoTensor(torch.randn(4, 8), torch.randn(4, 8)).requires_grad_()
    loss = graph(y)
    with cuda_grad_accumulation() as mode:
        loss.backward()
    assert mode.decisions == [False]
