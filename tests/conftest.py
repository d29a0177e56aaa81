"""Fixtures shared by the test files: the command-line runner and the folders tests read
(as fixtures in a test's body, as the constants below where a module needs them at collection).

``trainmem`` is imported inside the fixtures only, so collecting the tests loads nothing of it
(tests/test_no_torch.py checks in fresh interpreters what the package imports by itself).
One exception, at the session's start: where torch and a torchvision built for another torch
are installed (the test install: PyPI's torchvision is a CUDA build), torchvision is imported
as trainmem imports it (Note [torchvision without its C ops]), so that a test importing
transformers directly (transformers 5.24 imports torchvision for every model) runs as it would
after trainmem did, whatever test ran first in its worker.
"""

from __future__ import annotations

import json
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import pytest
from click.testing import Result
from typer.testing import CliRunner

if TYPE_CHECKING:
    from trainmem.specs.model import ModelSpec

TESTS_DIR = Path(__file__).resolve().parent
REPO_DIR = TESTS_DIR.parent
MODELS_DIR = TESTS_DIR / "models"

TINY_LLAMA: dict[str, object] = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}
"""A 2-layer Llama config.json (head_dim 16) for tests that write it where they need a
``model_type`` the formula configs lack."""
"""``tests/models``: the small ``config.json`` files the tests load."""
EXAMPLES_DIR = REPO_DIR / "examples"
SHARED_DIR = REPO_DIR.parent / "shared"
"""The project's shared data (``../shared``), never copied into the repository."""


def layer_bodies(items: Iterable[object], marker: str = "mlp_tmp") -> list[list[Any]]:
    """The bodies of a schedule's repeated blocks (``trainmem.schedule.Repeat``, found among
    ``items`` at any depth) that hold an op keyed ``marker`` (by default the layers' backward:
    the MLP's transients), each as its ops only, in schedule order."""
    bodies: list[list[Any]] = []
    for item in items:
        body = getattr(item, "body", None)
        if body is None:
            continue
        if any(getattr(op, "key", None) == marker for op in body):
            bodies.append([op for op in body if not hasattr(op, "body")])
        bodies += layer_bodies(body, marker)
    return bodies


def live_at(ops: Iterable[Any], key: str, nth: int = 0) -> dict[str, int]:
    """The keys live (with their bytes) at the ``nth`` allocation of ``key`` in a flat list of
    schedule ops (``trainmem.schedule.Op``), itself included."""
    live: dict[str, int] = {}
    seen = 0
    for op in ops:
        if op.action == "alloc":
            live[op.key] = op.size_bytes
            if op.key == key:
                if seen == nth:
                    return live
                seen += 1
        else:
            live.pop(op.key, None)
    raise AssertionError(f"{key} allocated {seen} times")


PEFT_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 256,
    "intermediate_size": 1024,
    "max_position_embeddings": 512,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "vocab_size": 256,
}
"""A small Llama whose step peaks in its last layer's recompute or right after it (the real
CPU executions of :func:`peft_llama_step_peak`)."""


def peft_llama_step_peak(
    peft_config: Any, checkpointing: Callable[[Any], None], seq_len: int
) -> int:
    """:func:`storage_peak` of one forward + backward of transformers' Llama
    (:data:`PEFT_LLAMA`) wrapped by peft with ``peft_config``, ``checkpointing(model)`` applied,
    at 2 x ``seq_len`` tokens under bf16 autocast."""
    import torch
    from peft import get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**{k: v for k, v in PEFT_LLAMA.items() if k != "architectures"})
    model = get_peft_model(LlamaForCausalLM(cfg), peft_config)
    checkpointing(model)
    model.train()
    ids = torch.randint(0, cfg.vocab_size, (2, seq_len))

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    return storage_peak(step)


def step_made_at_peak(est: Any) -> int:
    """The bytes an estimate (``trainmem.estimate`` result) made during the step and holds at
    its step peak: the forward's and the backward's (activations, temporaries, gradients),
    not the weights, the optimizer states or the cuBLAS workspaces; what
    :func:`storage_peak` counts of a real step."""
    timeline = est.schedules[est.reported_rank].expand()
    live: dict[int, Any] = {}
    total, best, made = 0, -1, 0
    for n, ev in enumerate(timeline.events):
        if ev.action == "alloc":
            live[ev.block_id] = ev
            total += ev.size_bytes
        else:
            total -= live.pop(ev.block_id).size_bytes
        if n >= timeline.steady_state_start and total > best:
            best = total
            made = sum(
                e.size_bytes
                for e in live.values()
                if e.phase in ("forward", "backward") and e.module != "cublas"
            )
    return made


def storage_peak(step: Callable[[], None]) -> int:
    """Peak bytes of the storages made while ``step`` runs on the CPU (a dispatch-mode counter:
    each op's new output storages, alive until their last reference goes), under CUDA's
    autocast cast lists and CUDA's fused dropout (trainmem.trace.cuda_autocast /
    cuda_dropout): a real execution of the code ``step`` calls."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from trainmem.trace.cuda_autocast import cuda_autocast_policy
    from trainmem.trace.cuda_dropout import cuda_dropout

    class Counter(TorchDispatchMode):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.live: dict[int, tuple[Any, int]] = {}
            self.peak = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            out = func(*args, **(kwargs or {}))
            for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
                del self.live[key]
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if st.nbytes() and st.data_ptr() not in self.live:
                        self.live[st.data_ptr()] = (StorageWeakRef(st), st.nbytes())
            self.peak = max(self.peak, sum(size for _, size in self.live.values()))
            return out

    counter = Counter()
    with cuda_autocast_policy(), cuda_dropout(), counter:
        step()
    return counter.peak


def other_values(field: Any) -> Iterator[object]:
    """The values a TrainingConfig setting (a ``dataclasses.Field``) is varied over by the
    tests that vary every setting: its choices, both flags, a few counts."""
    from trainmem.specs.settings import setting_of

    s = setting_of(field)
    if s.choices and not isinstance(field.default, tuple):
        yield from s.choices
    elif isinstance(field.default, bool) or str(field.type) == "bool | None":
        yield from (True, False)
    elif isinstance(field.default, int) or str(field.type) == "int | None":
        yield from (2, 4)


class Invoke(Protocol):
    """The :func:`invoke` fixture's call."""

    def __call__(
        self,
        *args: str | Path,
        exit_code: int | None = 0,
        env: Mapping[str, str] | None = None,
        input: str | None = None,  # noqa: A002 (CliRunner's name)
    ) -> Result: ...


InvokeJson = Callable[..., Any]
"""The :func:`invoke_json` fixture's call: ``(*args, env=None) -> the parsed JSON``."""


@pytest.fixture(scope="session")
def cli_runner() -> CliRunner:
    """typer's ``CliRunner`` (stdout and stderr kept apart, as click 8.2+ does)."""
    return CliRunner()


@pytest.fixture(scope="session")
def invoke(cli_runner: CliRunner) -> Invoke:
    """Run ``trainmem ARGS...`` in-process and return the click ``Result``.

    ``exit_code`` (default 0) is checked, failing with the command, both streams and the
    traceback of an unexpected exception; None checks nothing.
    """
    from trainmem.cli import app

    def run(
        *args: str | Path,
        exit_code: int | None = 0,
        env: Mapping[str, str] | None = None,
        input: str | None = None,  # noqa: A002
    ) -> Result:
        words = [str(a) for a in args]
        result = cli_runner.invoke(app, words, env=env, input=input)
        if exit_code is not None and result.exit_code != exit_code:
            pytest.fail(_failure(words, result, exit_code), pytrace=False)
        return result

    return run


@pytest.fixture(scope="session")
def invoke_json(invoke: Invoke) -> InvokeJson:
    """``invoke(*args, "--json")`` (exit code 0) and its stdout parsed."""

    def run(*args: str | Path, env: Mapping[str, str] | None = None) -> Any:
        return json.loads(invoke(*args, "--json", env=env).stdout)

    return run


def _failure(words: list[str], result: Result, expected: int) -> str:
    lines = [
        f"trainmem {' '.join(words)}",
        f"exited {result.exit_code}, expected {expected}",
        "--- stdout ---",
        result.stdout,
        "--- stderr ---",
        result.stderr,
    ]
    if result.exc_info is not None and not isinstance(result.exception, SystemExit):
        lines += ["--- exception ---", "".join(traceback.format_exception(*result.exc_info))]
    return "\n".join(lines)


@pytest.fixture(scope="session")
def llama_2_7b() -> ModelSpec:
    """The ``llama-2-7b`` preset's :class:`~trainmem.specs.model.ModelSpec` (6,738,415,616
    parameters)."""
    from trainmem.specs.hf import load_model_spec

    return load_model_spec("llama-2-7b")


@pytest.fixture
def models_dir() -> Path:
    """``tests/models``: the small ``config.json`` files the tests load."""
    return MODELS_DIR


@pytest.fixture
def examples_dir() -> Path:
    """``examples/`` of the repository."""
    return EXAMPLES_DIR


@pytest.fixture
def shared_dir() -> Path:
    """``../shared`` (the project's data beside the repository); skips the test when absent."""
    if not SHARED_DIR.is_dir():
        pytest.skip(f"{SHARED_DIR} is not here (the project's shared data)")
    return SHARED_DIR


@pytest.fixture
def fake_group() -> Iterator[None]:
    """Rank 0 of a 2-rank ``"fake"`` process group (torch's testing store): collectives return
    at once, so FSDP runs its real hooks and allocations on the CPU."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def pytest_configure(config: pytest.Config) -> None:
    """torchvision imported the way trainmem imports it (see the module docstring)."""
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch

        from trainmem.trace._torch import import_torchvision

        import_torchvision(torch)


def keyed_schedule_ops(items: list[Any], prefix: str, i: int = 0) -> Iterator[tuple[str, str, int]]:
    """(action, key with its layer index, bytes) of every op of a schedule whose key starts
    with ``prefix``, the repeats unrolled."""
    from trainmem.schedule import Repeat, _format_index

    for item in items:
        if isinstance(item, Repeat):
            for k in range(item.count):
                yield from keyed_schedule_ops(list(item.body), prefix, item.index(k))
        elif item.key.startswith(prefix):
            yield item.action, _format_index(item.key, i), item.size_bytes
