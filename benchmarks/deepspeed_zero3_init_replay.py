"""DeepSpeed ZeRO-3's initialisation replayed on trainmem's allocator before a run's own
timeline: what its flat buffers and init transients leave reserved, and how far they move the
run's ``max_memory_reserved``. A measurement for issue 24 (the Qwen-1 README's full fine-tuning
of Qwen-1.8B with ZeRO-3 on one GPU, 43.5 G flat from 256 to 2,048 tokens), not a rule: the
analytic engine allocates DeepSpeed's model states per tensor at the first step and models no
init phase for DeepSpeed (analytic/load.py has rules for torchtune and FSDP1 only).

What ``deepspeed.initialize`` allocates on the GPU with ZeRO-3 and nothing offloaded
(deepspeed/runtime/zero/stage3.py v0.12.3, the release of the README's 1.8B rows, 2023-11-30;
the same order at v0.16.4):

* ``_create_fp16_partitions_with_defragmentation`` -> ``defragment``: every trainable
  parameter's partition copied to one CPU buffer, ``empty_cache()``, then ``cpu_buffer.to(
  device)``: one flat 16-bit block of all trainable partitions (frozen ones keep their own);
* ``_setup_for_real_optimizer`` -> ``_create_fp32_partitions``: per optimizer sub-group
  (``_create_fp16_sub_groups``: partitions in order until ``sub_group_size``, 1e9),
  ``self.fp16_partitioned_groups_flat[i].to(self.device).clone().float().detach()``: a 16-bit
  clone (freed once ``.float()`` returns) and the fp32 partition (kept);
* ``initialize_optimizer_states``: ``gradient_buffer = torch.zeros(largest_numel, fp32)`` set
  as each sub-group's ``.grad``, then ``_optimizer_step(i)`` per sub-group: FusedAdam's
  ``exp_avg`` / ``exp_avg_sq`` (``torch.zeros_like(p.data)``, fp32, kept); the buffer freed
  when the function returns (``group.grad = None``);
* then the IPG bucket (``torch.empty(self.reduce_bucket_size, dtype=self.dtype)``, with
  ``contiguous_gradients``) and ``grad_partitions_flat_buffer = torch.zeros(sum of
  partitions, dtype=self.gradient_accumulation_dtype)``, both kept.

The replay allocates these (``load``), then the run's timeline, which adopts them: its
trainable parameters, optimizer states, gradient partitions (ZeRO-3's, from init) and the
persistent bucket get no block of their own (the same bytes, already in the flat blocks).

Run: ``PYTHONPATH=src python benchmarks/deepspeed_zero3_init_replay.py`` (about a minute).

Output (session 25, helper zero3fixed, on 6813dc4; the timeline adopts 29.40 GB, 16 B x
1,836,828,672 trainable elements, every model state; sub-groups of 1,008,349,184 and
828,479,488 elements)::

    | seq  | README G | device total GB | with the init replay |
    |  256 |   43.5   | 36.90 (-15.2%)  | 38.86 (-10.7%)       |
    |  512 |   43.5   | 36.83 (-15.3%)  | 38.83 (-10.7%)       |
    | 1024 |   43.5   | 36.94 (-15.1%)  | 38.83 (-10.7%)       |
    | 2048 |   43.5   | 37.27 (-14.3%)  | 39.45 (-9.3%)        |
    | 4096 |   47.1   | 37.71 (-19.9%)  | 43.81 (-7.0%)        |
    | 8192 |   48.3   | 42.78 (-11.4%)  | 43.81 (-9.3%)        |

The init's blocks (the clones' 2 GB segment split by the IPG bucket, the 4 GB gradient buffer
split by the 3.67 GB gradient partitions) leave about 2 GB more reserved, and the README's
shape (flat to 2,048 tokens, then up) appears; about 4.5 GB stay unexplained. Modelling it
needs DeepSpeed's flat blocks in the schedule (the trainable partitions, the fp32 partition and
each Adam moment per sub-group, the gradient partitions), allocated at init in this order,
where the analytic engine has per-tensor blocks from the first step.
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainmem.allocator.replay as replay_module  # noqa: E402
from trainmem.allocator.caching import CachingAllocatorSim  # noqa: E402
from trainmem.analytic.buffers import deepspeed_zero3_sub_group_elements  # noqa: E402
from trainmem.analytic.tensor_states import state_layout  # noqa: E402
from trainmem.specs.hf import load_model_spec  # noqa: E402
from trainmem.specs.training import TrainingConfig  # noqa: E402

#: the README's full fine-tuning row of Qwen-1.8B (one A100-80G), G per sequence length
README_CELLS = {256: 43.5, 512: 43.5, 1024: 43.5, 2048: 43.5, 4096: 47.1, 8192: 48.3}


def trainable_partitions(config_path: str) -> list[int]:
    """Every parameter's elements in the optimizer's order (embedding, layers, final norm and
    head): the model's ``parameters()``, one rank, full fine-tuning."""
    model = load_model_spec(config_path)
    t = TrainingConfig(framework="deepspeed", zero_stage=3, precision="bf16-mixed")
    lay = state_layout(model, t)
    layer = [s.numel for s in lay.layer]
    return [s.numel for s in lay.embedding] + layer * model.num_layers + [s.numel for s in lay.head]


def init_ops(partitions: list[int], bucket_elements: int) -> list[tuple[str, str, int]]:
    """stage3.py v0.12.3's init allocations (the module docstring), bf16 weights and
    gradients."""
    total = sum(partitions)
    groups: list[int] = []
    current = 0
    for n in partitions:  # _create_fp16_sub_groups
        current += n
        if current >= 10**9:
            groups.append(current)
            current = 0
    groups += [current] if current else []
    assert max(groups) == deepspeed_zero3_sub_group_elements(partitions)
    ops = [("a", "flat16", 2 * total)]
    for i, g in enumerate(groups):
        ops += [("a", "clone", 2 * g), ("a", f"fp32/{i}", 4 * g), ("f", "clone", 0)]
    ops.append(("a", "gradient_buffer", 4 * max(groups)))
    for i, g in enumerate(groups):
        ops += [("a", f"exp_avg/{i}", 4 * g), ("a", f"exp_avg_sq/{i}", 4 * g)]
    ops.append(("f", "gradient_buffer", 0))
    ops += [("a", "ipg_bucket", 2 * bucket_elements), ("a", "grad_partitions", 2 * total)]
    return ops


@contextmanager
def initialised_first(
    partitions: list[int], bucket_elements: int
) -> Iterator[list[CachingAllocatorSim]]:
    """Every replay inside starts from the init; the timeline's trainable parameters,
    optimizer states, kept gradients (one per trainable tensor) and persistent bucket are
    adopted (a null handle: their bytes are in the init's flat blocks)."""
    sims: list[CachingAllocatorSim] = []
    grads = sorted(2 * n for n in partitions)
    bucket = 2 * bucket_elements

    class Sim(CachingAllocatorSim):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            live: dict[str, int] = {}
            for action, key, size in init_ops(partitions, bucket_elements):
                if action == "a":
                    live[key] = super().malloc(size)
                else:
                    super().free(live.pop(key))
            self.grads_left = list(grads)
            self.bucket_left = 1
            self.adopted = 0
            sims.append(self)

        def malloc(self, size_bytes: int, stream: int = 0, **kw: Any) -> int:
            category = kw.get("category")
            adopt = category in ("parameters", "optimizer_states")
            if category == "gradients" and size_bytes in self.grads_left:
                self.grads_left.remove(size_bytes)
                adopt = True
            if category == "temporary" and size_bytes == bucket and self.bucket_left:
                self.bucket_left = 0
                adopt = True
            if adopt:
                self.adopted += size_bytes
                return 0
            return super().malloc(size_bytes, stream, **kw)

    # the replay builds its simulator by this module-level name (allocator/replay.py _replay)
    setattr(replay_module, "CachingAllocatorSim", Sim)  # noqa: B010
    try:
        yield sims
    finally:
        setattr(replay_module, "CachingAllocatorSim", CachingAllocatorSim)  # noqa: B010


def main() -> int:
    import published_probe as probe
    from validate import _invoke_estimate

    warnings.filterwarnings("ignore")
    with tempfile.TemporaryDirectory() as tmp:
        paths = probe.write_inputs(Path(tmp))
        partitions = trainable_partitions(paths["qwen-1.8b"])
        bucket = 2048 * 2048  # reduce_bucket_size "auto": hidden_size^2 (the HF Trainer)
        print(f"trainable elements {sum(partitions):,}; init ops:")
        for action, key, size in init_ops(partitions, bucket):
            print(f"  {action} {key} {size:,}")
        print("| seq | README G | device total GB | with the init replay | adopted GB |")
        print("|---:|---:|---:|---:|---:|")
        for seq, cell in README_CELLS.items():
            args = probe.row_args("Full, ZeRO-3", "qwen-1.8b", seq, paths)
            base, _ = _invoke_estimate(args)
            with initialised_first(partitions, bucket) as sims:
                after, _ = _invoke_estimate(args)
            assert base is not None and after is not None
            before_gb = base["peak"]["device_total_bytes"] / 1e9
            after_gb = after["peak"]["device_total_bytes"] / 1e9
            print(
                f"| {seq} | {cell} | {before_gb:.2f} ({100 * (before_gb / cell - 1):+.1f}%) "
                f"| {after_gb:.2f} ({100 * (after_gb / cell - 1):+.1f}%) "
                f"| {sims[0].adopted / 1e9:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
