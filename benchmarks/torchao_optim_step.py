"""torchao's low-bit AdamW step, run on the CPU, against the optimizer table's step bytes.

Note [torchao low-bit AdamW step] (specs/optimizers.py): torchao (optim/adam.py, the version
installed) steps each parameter through ``torch.compile(single_param_adam)``. For one
parameter of n elements this script

1. has Inductor write the wrapper the GPU's scheduler would run (the SIMD / Triton scheduling,
   ``torch._inductor.config.cpu_backend = "triton"``; the wrapper is captured before any
   Triton compiler is needed), then runs that wrapper's Python ``call`` on real CPU tensors
   with every kernel a no-op and measures what it allocates (torch.profiler memory events):
   the buffers the GPU step holds;
2. measures the real CPU step (the C++ backend) compiled and eager, for comparison: that is
   not what a GPU runs.

It prints bytes per element beside ``largest_bytes_per_256 / 256`` of the table's row. Nothing
is fitted: the table's numbers are derived by hand from the wrapper (see the Note).

Run: ``python benchmarks/torchao_optim_step.py`` (about two minutes; needs torchao).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch._inductor import config as inductor_config
from torch._inductor import graph as inductor_graph
from torch.profiler import ProfilerActivity, profile

from trainmem.specs.optimizers import OPTIMIZER_TABLE

ROWS, COLS = 1024, 1024  # n = 2**20 elements: 4096 blocks of 256, 8192 of 128
TORCHAO = {"ao-adamw-8bit": "AdamW8bit", "adamw-4bit": "AdamW4bit", "adamw-fp8": "AdamWFp8"}


def _peak_bytes(fn: Callable[[], object]) -> int:
    """The highest sum of CPU allocations minus frees while ``fn`` runs (profiler events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def _optimizer(name: str, dtype: torch.dtype) -> tuple[Any, torch.nn.Parameter]:
    import torchao.optim as ao  # noqa: PLC0415 (optional dependency)

    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(ROWS, COLS, dtype=dtype))
    p.grad = torch.randn_like(p)
    return getattr(ao, TORCHAO[name])([p], lr=1e-3), p


def gpu_wrapper_source(name: str, dtype: torch.dtype) -> str:
    """The Python wrapper Inductor's SIMD (GPU) scheduler writes for the step."""
    torch._dynamo.reset()
    original = inductor_graph.GraphLowering.codegen
    captured: list[str] = []

    def capture(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(self, *args, **kwargs)
        code = out[0] if isinstance(out, tuple) else out
        captured.append(str(getattr(code, "value", code)))
        raise RuntimeError("wrapper captured")  # stop before the Triton compiler is needed

    opt, _ = _optimizer(name, dtype)
    inductor_graph.GraphLowering.codegen = capture  # type: ignore[method-assign]
    try:
        with inductor_config.patch(cpu_backend="triton"):
            import torch.utils._triton as triton_utils  # noqa: PLC0415

            saved = triton_utils.triton_hash_with_backend
            triton_utils.triton_hash_with_backend = lambda: "cpu"  # no Triton installed
            try:
                opt.step()
            except Exception:
                if not captured:
                    raise
                return captured[0]
            finally:
                triton_utils.triton_hash_with_backend = saved
    finally:
        inductor_graph.GraphLowering.codegen = original  # type: ignore[method-assign]
        torch._dynamo.reset()
    raise RuntimeError("Inductor wrote no wrapper")


class _NoKernel:
    def run(self, *args: object, **kwargs: object) -> None:
        pass


def wrapper_step_bytes(source: str) -> int:
    """Peak bytes the wrapper's ``call`` allocates on real CPU tensors, kernels as no-ops."""
    kernels = re.findall(r"^(\w+) = async_compile\.triton\(", source, flags=re.M)
    start = source.index("class Runner:")
    body = source[start : source.index("def get_args():")]
    inputs_src = source[source.index("def get_args():") : source.index("def benchmark_compiled")]
    names: dict[str, Any] = {k: _NoKernel() for k in kernels}
    guards = torch._C._dynamo.guards
    names.update(
        torch=torch,
        get_raw_stream=lambda _: 0,
        assert_size_stride=guards.assert_size_stride,
        assert_alignment=guards.assert_alignment,
        empty_strided_cpu=guards._empty_strided_cpu,
        reinterpret_tensor=guards._reinterpret_tensor,
        aten=torch.ops.aten,
    )
    exec("from torch._dynamo.testing import rand_strided\n" + inputs_src + body, names)  # noqa: S102
    args = names["get_args"]()
    keep = list(args)  # the parameter, gradient and states outlive the step
    call = names["Runner"](partitions=[]).call
    peak = _peak_bytes(lambda: call(args))
    del keep
    return peak


def cpu_step_bytes(name: str, dtype: torch.dtype, *, compiled: bool) -> int:
    """Peak bytes of the second real CPU step (states exist), compiled or eager."""
    torch._dynamo.reset()
    opt, _ = _optimizer(name, dtype)
    if compiled:
        opt.step()
        return _peak_bytes(opt.step)
    real_compile = torch.compile
    torch.compile = lambda fn, **_: fn  # type: ignore[assignment]  # torchao calls it per step
    try:
        opt.step()
        return _peak_bytes(opt.step)
    finally:
        torch.compile = real_compile


def main() -> None:
    n = ROWS * COLS
    print(f"one parameter of {ROWS} x {COLS}; bytes per element at the step's peak")
    print("optimizer      dtype     table  GPU wrapper  CPU compiled  CPU eager")
    for name in TORCHAO:
        table = OPTIMIZER_TABLE[name].step_temporaries("foreach").largest_bytes_per_256 / 256
        for dtype in (torch.bfloat16, torch.float32):
            gpu = wrapper_step_bytes(gpu_wrapper_source(name, dtype)) / n
            compiled = cpu_step_bytes(name, dtype, compiled=True) / n
            eager = cpu_step_bytes(name, dtype, compiled=False) / n
            label = str(dtype).removeprefix("torch.")
            print(f"{name:14s} {label:9s} {table:6.3f} {gpu:12.3f} {compiled:13.3f} {eager:10.3f}")


if __name__ == "__main__":
    main()
