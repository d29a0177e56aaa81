"""What a change to a run costs, as numbers: recomputed FLOPs, the step's compute ratio, bytes
communicated between GPUs and bytes over PCIe, per GPU and optimizer step.

Note [Cost figures]
    Forward FLOPs per token are ``2 N + 2 L s d`` (Kaplan et al. 2020, arXiv:2001.08361,
    Table 1: ``C_forward``, N non-embedding parameters, L layers, s context, d width; the second
    term is the attention scores and their product with the values) and the backward costs
    twice the forward, half of it weight gradients (Table 1's ``C = 6N`` per token for
    training). Hence:

    - full activation checkpointing recomputes one forward: ``+F`` FLOPs, ``+1/3`` of the step
      (Chen et al. 2016, arXiv:1604.06174, sec. 4);
    - selective checkpointing recomputes the attention core only: ``2 L s d`` per token
      (Korthikanti et al. 2022, arXiv:2205.05198, sec. 5);
    - LoRA on a frozen base drops the base's weight gradients: ``-2 N`` per token (Hu et al.
      2021, arXiv:2106.09685, sec. 4.2: no gradients for the frozen weights);
    - data parallelism all-reduces the gradients: a ring all-reduce sends
      ``2 (n - 1) / n`` times their bytes per GPU; ZeRO-1 and ZeRO-2 reduce-scatter and
      all-gather the same volume, ZeRO-3 / FSDP full-shard adds an all-gather of the
      parameters in the backward, 1.5x in all (Rajbhandari et al. 2020, arXiv:1910.02054,
      sec. 7.2);
    - optimizer offload moves the gradients to the host and the updated parameters back each
      step (Ren et al. 2021, arXiv:2101.06840, sec. 4.1: "2M" each way for M parameters in
      fp16).

    The figures are for the trainable transformer stack (embeddings excluded, as Kaplan's N);
    the micro-batch change keeps the FLOPs and adds optimizer-free micro-steps (not timed).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmem.analytic.params import parameter_counts
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes


@dataclass(frozen=True, slots=True)
class CostFigures:
    """Per GPU and optimizer step. ``compute_ratio``: the step's FLOPs after / before (1.33 is
    a third more compute); bytes and FLOPs are ints (0: no change)."""

    recomputed_flops: int
    compute_ratio: float
    extra_communication_bytes: int
    pcie_bytes: int

    def text(self) -> str:
        """``"+33% compute (1.2 PFLOP recomputed)"``-style summary, or ``"no extra compute or
        traffic"``."""
        parts = []
        if abs(self.compute_ratio - 1.0) >= 0.005:
            parts.append(f"{100 * (self.compute_ratio - 1):+.0f}% compute")
        if self.recomputed_flops:
            parts.append(f"{_si(self.recomputed_flops)}FLOP recomputed")
        if self.extra_communication_bytes:
            parts.append(f"+{_si(self.extra_communication_bytes)}B sent between GPUs")
        if self.pcie_bytes:
            parts.append(f"{_si(self.pcie_bytes)}B over PCIe")
        return ", ".join(parts) + " per step" if parts else "no extra compute or traffic"


def _si(n: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} "


def _non_embedding_parameters(model: ModelSpec) -> int:
    counts = parameter_counts(model)
    return sum(v for k, v in counts.items() if not k.startswith(("embedding", "lm_head", "head")))


def _step_flops(model: ModelSpec, t: TrainingConfig) -> tuple[int, int, int]:
    """(forward FLOPs, attention-core FLOPs, weight-gradient FLOPs) per GPU per optimizer
    step, Note [Cost figures]."""
    tokens = t.micro_batch_size * t.seq_len * t.gradient_accumulation_steps
    n = _non_embedding_parameters(model)
    attention = 2 * model.num_layers * t.seq_len * model.hidden_size * tokens
    return 2 * n * tokens + attention, attention, 2 * n * tokens


def _total(model: ModelSpec, t: TrainingConfig) -> int:
    forward, attention, weight_grads = _step_flops(model, t)
    recompute = {"none": 0, "selective": attention, "full": forward}[t.activation_checkpointing]
    frozen = weight_grads if t.lora_rank > 0 else 0
    return 3 * forward + recompute - frozen


def _recomputed(model: ModelSpec, t: TrainingConfig) -> int:
    forward, attention, _ = _step_flops(model, t)
    return {"none": 0, "selective": attention, "full": forward}[t.activation_checkpointing]


def _communication(model: ModelSpec, t: TrainingConfig) -> int:
    n = t.data_parallel_size
    if n <= 1:
        return 0
    trainable = _non_embedding_parameters(model) if t.lora_rank == 0 else 0
    grads = trainable * dtype_bytes(t.grad_dtype)
    volume = 2 * grads * (n - 1) // n
    if t.zero_stage >= 3:
        volume += trainable * dtype_bytes(t.weight_dtype) * (n - 1) // n
    return volume


def _pcie(model: ModelSpec, t: TrainingConfig) -> int:
    if t.offload == "none" or t.lora_rank > 0:
        return 0
    shard = max(t.data_parallel_size if t.zero_stage > 0 else 1, 1)
    trainable = _non_embedding_parameters(model) // shard
    return trainable * (dtype_bytes(t.grad_dtype) + dtype_bytes(t.weight_dtype))


def cost_figures(model: ModelSpec, before: TrainingConfig, after: TrainingConfig) -> CostFigures:
    """What changing ``before`` into ``after`` costs per GPU and optimizer step (Note [Cost
    figures]); the global batch is kept as each configuration states it."""
    base = _total(model, before)
    return CostFigures(
        recomputed_flops=max(_recomputed(model, after) - _recomputed(model, before), 0),
        compute_ratio=_total(model, after) / base if base else 1.0,
        extra_communication_bytes=max(
            _communication(model, after) - _communication(model, before), 0
        ),
        pcie_bytes=max(_pcie(model, after) - _pcie(model, before), 0),
    )
