"""Softmax and log-softmax on a torch release before 1.11 (Note [Softmax saving its input
before torch 1.11] in trainmem/trace/older_softmax.py): autograd keeps the input beside the
output, as tools/autograd/derivatives.yaml's ``_softmax_backward_data(grad, result, dim,
self)`` made it (pytorch/pytorch issue #64000), with the gradients of the installed ops."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import Invoke, InvokeJson

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _saved_bytes(fn: object, x: object) -> int:
    """Bytes of the distinct storages autograd saves while ``fn(x)`` runs."""
    seen: dict[int, int] = {}

    def pack(t: object) -> object:
        storage = t.untyped_storage()  # type: ignore[attr-defined]
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(x)  # type: ignore[operator]
    return sum(seen.values())


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_the_input_is_kept_beside_the_output(name: str) -> None:
    from trainmem.trace.older_softmax import older_softmax_backward

    x = torch.randn(3, 5, 7, requires_grad=True)
    fn = getattr(F, name)
    # the installed torch (>= 1.11): the output only, 3 x 5 x 7 fp32
    assert _saved_bytes(lambda t: fn(t * 1, dim=-1), x) == 105 * 4
    with older_softmax_backward():
        # before 1.11: the input (t * 1) too
        assert _saved_bytes(lambda t: getattr(F, name)(t * 1, dim=-1), x) == 2 * 105 * 4
        # with dtype=: the float32 copy the kernel read, and the float32 output
        half = torch.randn(3, 5, 7, dtype=torch.bfloat16, requires_grad=True)
        saved = _saved_bytes(lambda t: getattr(F, name)(t * 1, dim=-1, dtype=torch.float32), half)
        assert saved == 2 * 105 * 4


def test_cross_entropy_keeps_its_logits() -> None:
    from trainmem.trace.older_softmax import older_softmax_backward

    logits = torch.randn(4, 10, 6, 6, requires_grad=True)  # a [b, classes, h, w] head
    target = torch.randint(0, 10, (4, 6, 6))
    n = 4 * 10 * 6 * 6
    # log_softmax's output (fp32) and nll_loss's target (int64) and total weight (0-d fp32)
    now = _saved_bytes(lambda t: F.cross_entropy(t * 1, target, ignore_index=255), logits)
    with older_softmax_backward():
        then = _saved_bytes(lambda t: F.cross_entropy(t * 1, target, ignore_index=255), logits)
    assert then - now == n * 4  # the logits, kept by log_softmax


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
def test_the_gradients_are_the_installed_ops(name: str) -> None:
    from trainmem.trace.older_softmax import older_softmax_backward

    x = torch.randn(2, 3, 9, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(2, 3, 9)
    (getattr(F, name)(x, dim=-1, dtype=torch.float32) * weight).sum().backward()
    expected = x.grad.clone()
    x.grad = None
    with older_softmax_backward():
        (getattr(F, name)(x, dim=-1, dtype=torch.float32) * weight).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad, expected)
    target = torch.randint(0, 9, (2, 3))
    y = torch.randn(2, 9, 3, requires_grad=True)
    F.cross_entropy(y, target, ignore_index=1).backward()
    plain = y.grad.clone()
    y.grad = None
    with older_softmax_backward():
        F.cross_entropy(y, target, ignore_index=1).backward()
    assert torch.allclose(y.grad, plain)


def test_the_generic_path_runs_an_older_torch(invoke_json: InvokeJson, invoke: Invoke) -> None:
    """It was refused ("the generic path does not model torch_version=1.10 (its softmax saves
    its input)"); now the trace keeps the scores and the logits, so the peak grows."""
    pytest.importorskip("transformers")
    config = str(Path(__file__).parents[1] / "models" / "heads" / "segformer_segmentation.json")
    json.loads(Path(config).read_text())  # a shipped config, read offline
    args = (
        "estimate", config, "-b", "2", "--resolution", "64", "-p", "32-true",
        "--attention", "eager", "--engine", "generic",
    )  # fmt: skip
    older = invoke_json(*args, "--torch-version", "1.10")["peak"]["allocated_bytes"]
    newer = invoke_json(*args, "--torch-version", "1.11")["peak"]["allocated_bytes"]
    # at least the 19-class fp32 logits upsampled to 64 x 64 that log_softmax keeps
    assert older - newer >= 2 * 19 * 64 * 64 * 4, (older, newer)
