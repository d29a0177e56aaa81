"""Host (CPU) RAM of an offloaded run: what lands in each GPU process's host memory, pinned
(page-locked) or pageable, and the node total.

# P = trainable elements of this rank's tensor-parallel slice, N = sharding ranks,
# part = ceil(P / N) = this rank's ZeRO partition, d16 = bytes of the model's 16-bit dtype

Note [Host memory of offloaded states]
    Which host tensors each offload implementation allocates, per GPU process:

    * DeepSpeed ZeRO-Offload / ZeRO-Infinity (``--framework deepspeed``, ZeRO stage >= 1,
      ``offload_optimizer.device: cpu``). The pinned ones follow ``offload_optimizer.pin_memory``,
      False by default (deepspeed/runtime/zero/offload_config.py
      ``DeepSpeedZeroOffloadOptimizerConfig.pin_memory``), so by default they are pageable.

      - every stage: the fp32 master partition, 4 * part; the CPU optimizer's states,
        ``torch.zeros_like(p, dtype=float32)`` per state (ops/adam/cpu_adam.py
        ``DeepSpeedCPUAdam.step``: 2 states, 8 * part; never pinned); the fp32 gradient
        partition, 4 * part. These three are the 16 B/param of DeepSpeed's own estimator.
      - ZeRO-1/2 (runtime/zero/stage_1_and_2.py ``__init__``): a 16-bit copy of the partition,
        d16 * part (``param_buffer_of_bit16_for_cpu_offload_groups``); a staging buffer of the
        largest parameter, d16 * numel (``temp_grad_buffer_for_cpu_offload``); with gradient
        accumulation, each partition parameter's gradient, d16 * part
        (``async_accumulate_grad_in_cpu_via_gpu``, ``accumulated_grads_in_cpu``). The master
        partition and the gradient partition follow ``pin_memory``.
      - ZeRO-3 (runtime/zero/stage3.py): the master partition is a plain ``.to(cpu).clone()``
        (pageable whatever ``pin_memory`` says); the fp32 gradient partition
        (``initialize_optimizer_states``) and the flat gradient-partition buffer in the
        accumulation dtype, ``grad_partitions_flat_buffer`` (on the CPU, ``self.device``, under
        optimizer offload) follow ``pin_memory``. With ``offload_param`` (``--offload
        optimizer+params``) the 16-bit parameter partition, d16 * part, lives in
        ``param_groups_fp16_flat_cpu_memory``, always pinned
        (``_create_param_groups_fp16_flat_cpu_memory``): with the fp32 16 B that is the
        estimator's 18 B/param; frozen parameters' partitions (LoRA) stay in their
        ``ds_tensor`` (runtime/zero/partition_parameters.py), pinned per
        ``offload_param.pin_memory`` (False by default).

      DeepSpeed's estimators (stage_1_and_2.py ``estimate_zero2_model_states_mem_needs``,
      stage3.py ``estimate_zero3_model_states_mem_needs``) count 16 (18 with parameter offload)
      B per parameter per node share and multiply by ``additional_buffer_factor`` = 1.5; this
      module lists the buffers instead of a factor.
    * FSDP ``CPUOffload(offload_params=True)`` / FSDP2 ``CPUOffloadPolicy()`` (ZeRO stage 3
      outside DeepSpeed, ``--offload optimizer+params``): the sharded parameters and the sharded
      gradients are pinned (torch distributed/fsdp/_flat_param.py ``init_flat_param_attributes``:
      ``_local_shard.pin_memory()``, ``_cpu_grad = torch.zeros_like(...).pin_memory()``;
      FSDP2 _fully_shard/_fsdp_api.py ``CPUOffloadPolicy.pin_memory = True``, _fsdp_param.py
      ``padded_sharded_param.pin_memory()``, _fsdp_collectives.py ``new_sharded_grad.to(cpu,
      non_blocking=True)``, a pinned copy); the optimizer steps on the CPU parameters, so its
      states are ordinary (pageable) CPU tensors.
    * torchao ``CPUOffloadOptimizer`` (``--offload optimizer[+gradients]`` outside DeepSpeed /
      FSDP, :attr:`~trainmem.specs.training.TrainingConfig.torchao_cpu_offload`): for every
      trainable tensor of at least ``minimal_size`` elements a pinned parameter copy and a pinned
      gradient of the same dtype (torchao/optim/cpu_offload.py ``CPUOffloadOptimizer.__init__``:
      ``torch.empty_like(p, device="cpu", pin_memory=True)``, ``p_host.grad = torch.empty_like(
      p_host, pin_memory=True)``), and the base optimizer's states on that copy (pageable).
    * Any other offload the formulas take (ZeRO-1/2 outside DeepSpeed, Megatron, ZeRO-3 optimizer
      offload outside DeepSpeed): the model states the GPU no longer holds
      (:func:`~trainmem.analytic.tensor_states.build_state_layout` with and without offload),
      counted as pageable CPU tensors.

    Node total = per-process bytes x GPU processes per node (``processes_per_node``, default
    min(ranks of the job, 8)).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from trainmem.analytic.model_states import optimizer_state_bytes_per_parameter
from trainmem.analytic.tensor_states import StateLayout, TensorState, state_layout
from trainmem.errors import SpecError
from trainmem.specs.frameworks import TORCHAO_OFFLOAD_MINIMAL_SIZE
from trainmem.specs.model import ModelSpec
from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.specs.training import GPUS_PER_NODE, TrainingConfig
from trainmem.units import dtype_bytes

DEEPSPEED_PIN_MEMORY_DEFAULT = False
"""deepspeed/runtime/zero/offload_config.py: ``DeepSpeedZeroOffloadOptimizerConfig.pin_memory``
and ``DeepSpeedZeroOffloadParamConfig.pin_memory`` default to False."""


@dataclass(frozen=True, slots=True)
class HostMemory:
    """Host RAM of one GPU process and of one node, in bytes.

    Attributes:
        pinned_terms: page-locked host tensors by name, bytes per process.
        pageable_terms: ordinary host tensors by name, bytes per process.
        processes_per_node: GPU processes sharing one host.
        source: which implementation's rule applied.
    """

    pinned_terms: dict[str, int] = field(default_factory=dict)
    pageable_terms: dict[str, int] = field(default_factory=dict)
    processes_per_node: int = 1
    source: str = "no offload"

    @property
    def pinned_bytes(self) -> int:
        """Page-locked bytes per process."""
        return sum(self.pinned_terms.values())

    @property
    def pageable_bytes(self) -> int:
        """Pageable bytes per process."""
        return sum(self.pageable_terms.values())

    @property
    def per_process_bytes(self) -> int:
        """Host bytes of one GPU process (pinned + pageable)."""
        return self.pinned_bytes + self.pageable_bytes

    @property
    def per_node_bytes(self) -> int:
        """Host bytes of one node: per-process bytes x processes per node."""
        return self.per_process_bytes * self.processes_per_node

    def on_node(self, processes_per_node: int) -> HostMemory:
        """The same per-process bytes with another number of GPU processes per node.

        Raises:
            SpecError: ``processes_per_node`` is not a positive integer.
        """
        _check_processes(processes_per_node)
        return replace(self, processes_per_node=processes_per_node)

    def as_details(self) -> dict[str, object]:
        """The ``MemoryEstimate.details["host_memory"]`` entry; bytes throughout."""
        return {
            "pinned_bytes": self.pinned_bytes,
            "pageable_bytes": self.pageable_bytes,
            "per_process_bytes": self.per_process_bytes,
            "processes_per_node": self.processes_per_node,
            "per_node_bytes": self.per_node_bytes,
            "source": self.source,
            "pinned_terms_bytes": dict(self.pinned_terms),
            "pageable_terms_bytes": dict(self.pageable_terms),
        }

    @classmethod
    def from_details(cls, details: dict[str, object]) -> HostMemory:
        """Inverse of :meth:`as_details`."""
        pinned = details.get("pinned_terms_bytes", {})
        pageable = details.get("pageable_terms_bytes", {})
        ppn = details.get("processes_per_node", 1)
        assert isinstance(pinned, dict) and isinstance(pageable, dict) and isinstance(ppn, int)
        return cls(dict(pinned), dict(pageable), ppn, str(details.get("source", "")))


def _check_processes(n: object) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise SpecError("gpus_per_node", f"must be a positive integer, got {n!r}")


def default_processes_per_node(training: TrainingConfig) -> int:
    """GPU processes per node when none is given: every rank of the job (data x tensor x
    pipeline x context parallel), at most :data:`~trainmem.specs.training.GPUS_PER_NODE`."""
    world = (
        training.data_parallel_size
        * training.tensor_parallel_size
        * training.pipeline_parallel_size
        * training.context_parallel_size
    )
    return min(world, GPUS_PER_NODE)


def _tensors(layout: StateLayout) -> list[tuple[int, TensorState]]:
    """(count, tensor) over the compact layout: each layer tensor stands for every layer."""
    return [(1, s) for s in layout.embedding + layout.head] + [
        (layout.num_layers, s) for s in layout.layer
    ]


def host_memory(
    model: ModelSpec,
    training: TrainingConfig,
    *,
    processes_per_node: int | None = None,
    deepspeed_pin_memory: bool = DEEPSPEED_PIN_MEMORY_DEFAULT,
) -> HostMemory:
    """Host RAM per GPU process of an offloaded run, split pinned / pageable, and per node.

    Args:
        model: the transformer's shape.
        training: framework, ZeRO stage / FSDP, offload mode, precision, optimizer.
        processes_per_node: GPU processes per node; None for
            :func:`default_processes_per_node`.
        deepspeed_pin_memory: DeepSpeed's ``offload_optimizer.pin_memory`` /
            ``offload_param.pin_memory`` (both default False).

    Returns:
        The host tensors by name; all zero without offload.

    Raises:
        SpecError: ``processes_per_node`` is not a positive integer.

    Source: Note [Host memory of offloaded states] (DeepSpeed runtime/zero/stage_1_and_2.py,
    stage3.py, offload_config.py, ops/adam/cpu_adam.py; torch distributed/fsdp/_flat_param.py,
    _fully_shard/_fsdp_param.py; torchao optim/cpu_offload.py).

    Known limitations: one pipeline stage is counted as the whole model (an upper bound with
    pipeline parallelism); DeepSpeed's per-group alignment padding, torch's 4-byte ``step``
    scalars and the fp32 copy DeepSpeed's CPU Adam may keep for its fp16 parameter update are
    left out; NVMe offload is not modelled.
    """
    if processes_per_node is None:
        processes_per_node = default_processes_per_node(training)
    _check_processes(processes_per_node)
    if training.offload == "none":
        return HostMemory(processes_per_node=processes_per_node)
    if training.conventions.deepspeed_optimizer_wrappers and training.zero_stage >= 1:
        return _deepspeed(model, training, processes_per_node, deepspeed_pin_memory)
    before = state_layout(model, replace(training, offload="none"))
    if training.torchao_cpu_offload:
        return _torchao(before, processes_per_node)
    sharded = training.zero_stage == 3 and training.sharding_degree > 1
    if sharded and training.offload == "optimizer+params":
        return _fsdp(before, processes_per_node)
    after = state_layout(model, training)
    moved = {"parameters": 0, "gradients": 0, "optimizer states": 0}
    for (n, b), (_, a) in zip(_tensors(before), _tensors(after), strict=True):
        moved["parameters"] += n * (b.param_bytes - a.param_bytes)
        moved["gradients"] += n * (b.grad_bytes - a.grad_bytes)
        moved["optimizer states"] += n * (b.state_bytes - a.state_bytes)
    return HostMemory(
        pageable_terms={k: v for k, v in moved.items() if v},
        processes_per_node=processes_per_node,
        source=f"{training.framework}: the model states taken off the GPU, as pageable CPU tensors",
    )


def _torchao(before: StateLayout, processes_per_node: int) -> HostMemory:
    """torchao ``CPUOffloadOptimizer``; see Note [Host memory of offloaded states]."""
    copies = states = 0
    for n, s in _tensors(before):
        if s.trainable and s.local_numel >= TORCHAO_OFFLOAD_MINIMAL_SIZE:
            copies += n * s.param_bytes  # p_host, and p_host.grad = empty_like(p_host)
            states += n * s.state_bytes
    return HostMemory(
        pinned_terms={"parameter copies": copies, "gradients": copies},
        pageable_terms={"optimizer states": states},
        processes_per_node=processes_per_node,
        source="torchao CPUOffloadOptimizer (optim/cpu_offload.py)",
    )


def _fsdp(before: StateLayout, processes_per_node: int) -> HostMemory:
    """FSDP ``CPUOffload(offload_params=True)``; see Note [Host memory of offloaded states]."""
    return HostMemory(
        pinned_terms={
            "sharded parameters": before.total("param_bytes"),
            "sharded gradients": before.total("grad_bytes"),
        },
        pageable_terms={"optimizer states": before.total("state_bytes")},
        processes_per_node=processes_per_node,
        source="FSDP CPUOffload(offload_params=True) (torch distributed/fsdp)",
    )


def _deepspeed(
    model: ModelSpec, training: TrainingConfig, processes_per_node: int, pin: bool
) -> HostMemory:
    """DeepSpeed ZeRO-Offload / ZeRO-Infinity (CPU); see Note [Host memory of offloaded
    states]."""
    layout = state_layout(model, replace(training, offload="none"))
    N = training.sharding_degree
    P = sum(n * s.local_numel for n, s in _tensors(layout) if s.trainable)
    part = -(-P // N)
    largest = max((s.local_numel for _, s in _tensors(layout) if s.trainable), default=0)
    d16 = dtype_bytes(training.compute_dtype if training.master_weights else "float32")
    row = OPTIMIZER_TABLE[training.optimizer]
    if not row.deepspeed_cpu:  # no DeepSpeed CPU optimizer: the optimizer's own per-element bytes
        per = optimizer_state_bytes_per_parameter(training)
        moments = int(-(-(per - (4.0 if training.fp32_master_copy else 0.0)) * part // 1))
    else:  # fp32 states per element (ops/adam/cpu_adam.py, ops/lion/cpu_lion.py; SGD: torch.optim)
        moments = 4 * row.num_states * part
    pinned: dict[str, int] = {}
    pageable: dict[str, int] = {"optimizer states (fp32)": moments}
    follows = pinned if pin else pageable
    if training.zero_stage == 3:
        pageable["fp32 master weights partition"] = 4 * part
        follows["fp32 gradient partition"] = 4 * part
        acc = dtype_bytes(training.deepspeed_grad_accum_dtype)
        follows["gradient partition buffer"] = acc * part
        if training.offload == "optimizer+params":
            pinned["16-bit parameter partition"] = d16 * part
            frozen = sum(n * s.param_bytes for n, s in _tensors(layout) if not s.trainable)
            if frozen:
                follows["frozen parameter partitions"] = frozen
        source = "DeepSpeed ZeRO-3 offload (runtime/zero/stage3.py)"
    else:
        follows["fp32 master weights partition"] = 4 * part
        follows["fp32 gradient partition"] = 4 * part
        follows["16-bit parameter buffer"] = d16 * part
        follows["gradient staging buffer"] = d16 * largest
        if training.gradient_accumulation_steps > 1:
            follows["accumulated gradients"] = d16 * part
        source = f"DeepSpeed ZeRO-{training.zero_stage} offload (runtime/zero/stage_1_and_2.py)"
    pin_text = "pinned" if pin else "pageable, DeepSpeed's default"
    return HostMemory(
        pinned_terms=pinned,
        pageable_terms=pageable,
        processes_per_node=processes_per_node,
        source=f"{source}; pin_memory={pin} ({pin_text})",
    )
