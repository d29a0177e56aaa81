"""Framework buffers of one training step, in bytes: what ZeRO / FSDP gather and reduce, the
gradient buffers a framework allocates up front, and memory held outside the caching allocator.

Each function names the phases in which its bytes are alive (forward / backward / optimizer)
and the framework source it mirrors; the conventions it reads are
:class:`trainmem.specs.frameworks.FrameworkConventions` fields.

Legend: L = layers on the rank, N = ``TrainingConfig.sharding_degree``, c = bytes of the
compute dtype, t = tensor-parallel size.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.tensor_states import TensorState
from trainmem.specs.frameworks import parse_version
from trainmem.specs.hardware import GPUSpec, default_cuda_context_bytes
from trainmem.specs.model import ModelSpec
from trainmem.specs.quantization import NF4_BLOCK
from trainmem.specs.ranks import fsdp1_no_shard
from trainmem.specs.training import TrainingConfig
from trainmem.units import MiB, dtype_bytes

ROPE_BUFFERS_KEY = "buffers/{i}"
"""The schedule's key of a layer's rotary buffers (:func:`layer_rope_cache_bytes`)."""


def layer_rope_cache_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """Bytes of the rotary cos / sin tables one decoder layer keeps as buffers under an older
    transformers release (``ModelSpec.layer_rope_cache_values``, :data:`~trainmem.specs.model.
    LAYER_ROPE_CACHE_UNTIL`), on the GPU for the whole run (buffers are never sharded or
    offloaded), in the default dtype the model was built in. ``from_pretrained(torch_dtype=X)``
    sets it to X while the modules are made: the compute dtype for a quantized base (the QLoRA
    scripts load with the 16-bit compute / quant-storage dtype, e.g. philschmid
    scripts/run_fsdp_qlora.py ``torch_dtype=quant_storage_dtype``; peft's fp32 upcast of
    ``prepare_model_for_kbit_training`` casts parameters only), else the weights' dtype. Answer.AI
    fsdp_qlora's train.py builds its quantized model with ``AutoModelForCausalLM.from_config(cfg)``
    under ``init_empty_weights()``, whose buffers are real tensors in the fp32 default dtype
    (``include_buffers=False``), and casts none of them (precision bf16: ``mp_policy = None``).
    0 for a model code other than transformers'.

    Llama-2-70B (4096 positions, head_dim 128) under fsdp_qlora's QLoRA on transformers 4.39:
    2 x 4096 x 128 x 4 B = 4 MiB a layer, 320 MiB over its 80 layers.

    Source: transformers 4.39.3 models/llama/modeling_llama.py ``LlamaRotaryEmbedding``,
    modeling_utils.py ``from_pretrained`` (``_set_default_torch_dtype``); fsdp_qlora train.py
    50efa1e (the qlora branch of its model creation)."""
    if not training.conventions.hf_model_code:
        return 0
    values = model.layer_rope_cache_values(training.transformers_release)
    if training.quantize_base == "none":
        return dtype_bytes(training.weight_dtype) * values
    if training.framework == "fsdp-qlora":
        return 4 * values
    return dtype_bytes(training.compute_dtype) * values


def gathered_layer_bytes(layer: Sequence[TensorState], training: TrainingConfig) -> int:
    """Bytes of one layer's weights once ZeRO-3 / FSDP has all-gathered them: the stored bytes
    (``full_param_bytes``), or ``c`` per element when an FSDP mixed-precision policy gathers in
    the compute dtype (``fsdp_param_dtype_follows_precision``; LoRA adapters are cast too).

    Alive: forward and backward, two layers at a time with prefetching (Rajbhandari et al.
    2020, sec. 5.3; FSDP ``forward_prefetch`` / ``BACKWARD_PRE``).

    Source: torch distributed/fsdp/_flat_param.py ``_use_unsharded_flat_param`` (the
    ``_mp_shard`` all-gathered in ``param_dtype``); accelerate utils/dataclasses.py
    ``FullyShardedDataParallelPlugin.set_mixed_precision`` (``param_dtype=bf16`` under
    ``mixed_precision="bf16"``); torch FSDP2 ``MixedPrecisionPolicy``.
    """
    if training.gathered_weight_dtype == training.weight_dtype:
        return sum(s.full_param_bytes for s in layer)
    c = dtype_bytes(training.gathered_weight_dtype)
    # a quantized frozen base travels as stored (4-bit / int8); everything else is cast to c
    quantized = [
        s
        for s in layer
        if training.quantize_base != "none" and not s.trainable and s.name != "vector"
    ]
    cast = sum(s.numel for s in layer if s not in quantized)
    return c * cast // training.tensor_parallel_size + sum(s.full_param_bytes for s in quantized)


def dequantized_weight_bytes(layer: Sequence[TensorState], training: TrainingConfig) -> int:
    """Bytes of the dequantized weight a quantized base linear builds for its matmul: the
    layer's largest frozen linear (its tensor-parallel slice) in the compute dtype ``c``, or,
    for torchtune's torchao ``NF4Tensor`` in eager mode, the peak of its dequantization
    (:func:`torchao_nf4_dequantize_bytes`); 0 without a quantized base.

    Alive: one at a time, for each base matmul in the forward and again for its input gradient
    in the backward.

    Source: bitsandbytes autograd/_functions.py ``MatMul4Bit.forward`` (``F.dequantize_4bit(B,
    quant_state).to(A.dtype).t()`` into ``torch.nn.functional.linear``) and ``backward``
    (``torch.matmul(grad_output, F.dequantize_4bit(B, ctx.state).to(grad_output.dtype).t())``);
    ``MatMul8bitLt`` likewise dequantizes for the input gradient; torchao dtypes/nf4tensor.py
    ``LinearNF4`` (``weight.to(input.dtype)`` in forward and backward).
    """
    if training.quantize_base == "none":
        return 0
    largest = largest_base_numel(layer, training)
    if training.torchao_nf4_decode:
        return torchao_nf4_dequantize_bytes(largest)
    return dtype_bytes(training.compute_dtype) * largest


def largest_base_numel(layer: Sequence[TensorState], training: TrainingConfig) -> int:
    """Elements of the layer's largest frozen linear (its tensor-parallel slice)."""
    base = [s.numel for s in layer if not s.trainable and s.name != "vector"]
    return max(base, default=0) // training.tensor_parallel_size


def dequantize_cast_bytes(numel: int, training: TrainingConfig) -> int:
    """Bytes of the fp16 weight bitsandbytes' ``MatMul4Bit`` dequantizes before casting it to
    the compute dtype, for a 4-bit weight of ``numel`` elements quantized from fp16 (by
    Lightning, ``FrameworkConventions.bnb_4bit_quantized_from_fp16``, or by bitsandbytes
    before 0.43.0: ``TrainingConfig.dequantizes_through_fp16``): 2 x numel, alive beside the
    cast copy (:func:`dequantized_weight_bytes`) while ``.to(A.dtype)`` runs, then freed before
    the matmul; 0 when the compute dtype is fp16 itself (the cast returns the same tensor) or
    the weight is not quantized from fp16.

    Alive: in each quantized linear's forward and again in its input gradient's backward.

    Source: bitsandbytes 0.42.0 autograd/_functions.py ``MatMul4Bit.forward``
    (``torch.nn.functional.linear(A, F.dequantize_4bit(B, quant_state).to(A.dtype).t(),
    bias)``) and ``backward`` (``F.dequantize_4bit(B, ctx.state).to(grad_output.dtype)``);
    functional.py ``dequantize_4bit`` (``out = torch.empty(quant_state.shape,
    dtype=quant_state.dtype)``); lightning fabric/plugins/precision/bitsandbytes.py
    ``_Linear4bit.quantize`` (``.to(device=device, dtype=torch.half)``, 2.2.1 / 2.3.0).
    """
    return 2 * numel if training.dequantizes_through_fp16 else 0


def torchao_nf4_dequantize_bytes(numel: int) -> int:
    """Peak bytes of torchao's ``NF4Tensor.get_original_weight`` on a weight of ``numel`` (n)
    elements, the bf16 result included: the two nibble halves widened to int64 (``(self.
    quantized_data >> 4).to(torch.long)`` and ``& 0b1111``: 2 x 8 x n / 2), their bf16 NF4
    lookups (``nf4[value]``: 2 x n), the dequantized scalers (bf16, n / 64 of them), the two
    halves scaled (2 x n; each ``repeated.flatten()`` copy, n bytes, is freed before the next
    one is made), and ``torch.stack`` of the halves (2 n): all locals of the function, alive
    until it returns the stacked weight, so 14 n + n / 32 bytes at the stack. Eager only (a
    compiled graph fuses the chain). Source: torchao v0.1 dtypes/nf4tensor.py
    ``get_original_weight``, ``dequantize_scalers``, ``_to_copy`` / ``to_dtype`` (unchanged
    in v0.12.0)."""
    half = numel // 2
    return 2 * 8 * half + 2 * 2 * half + 2 * (numel // NF4_BLOCK) + 2 * 2 * half + 2 * numel


def root_gathered_bytes(outer: Sequence[TensorState], training: TrainingConfig) -> int:
    """Bytes of the root FSDP unit's gathered weights (embeddings, final norm, LM head; LoRA
    adapters excluded): the stored bytes of the tensor-parallel slice, or ``c`` per element under
    an FSDP mixed-precision policy. The all-gather writes a new buffer, so the rank's own shard
    stays allocated beside it (nothing is subtracted).

    Alive: forward and backward (the root is not resharded after forward: FSDP2 ``fully_shard``
    on the root, FSDP (v1) ``_post_forward_reshard`` skips the root).

    Source: torch distributed/fsdp/_fully_shard/_fsdp_param_group.py (``reshard_after_forward``
    False for the root), _fsdp_collectives.py ``foreach_all_gather`` (a new output buffer);
    checked against the trace engine on tiny-llama-test (FSDP2 bf16, 2 vs 4 ranks: the analytic
    peak moves by the trace's 474,048 B only without the subtraction).
    """
    root = [s for s in outer if not s.name.startswith("lora_")]
    if training.gathered_weight_dtype != training.weight_dtype:
        c = dtype_bytes(training.gathered_weight_dtype)
        return c * sum(s.numel for s in root) // training.tensor_parallel_size
    return sum(s.full_param_bytes for s in root)


def kept_gathered_layer_bytes(layer: Sequence[TensorState], training: TrainingConfig) -> int:
    """Bytes of one layer's gathered weights that stay from its forward to its backward: the
    whole :func:`gathered_layer_bytes` when the weights are not resharded after forward
    (FSDP ``SHARD_GRAD_OP`` / ``reshard_after_forward=False`` at stage 3), or the 16-bit copy
    FSDP2's mixed-precision policy makes without sharding; 0 otherwise, FSDP1's ``NO_SHARD``
    included (Note [FSDP1 NO_SHARD's 16-bit copy]: its copy is freed after each unit's forward).

    Alive: forward (it accumulates: after layer j's forward, j + 1 layers are held) and backward
    (freed by each layer's post-backward reshard); never at the optimizer step, which sees the
    sharded fp32 weights.

    Source: torch distributed/fsdp/api.py ``ShardingStrategy.SHARD_GRAD_OP`` ("Parameters are
    sharded outside of computation ... not resharded after the forward"),
    _runtime_utils.py ``_post_forward_reshard`` / ``_post_backward_reshard``.
    """
    dp = training.sharding_degree  # torchtitan shards over dp x cp: FSDP 1 x CP 8 shards
    if training.zero_stage == 3 and dp > 1 and not training.reshard_after_forward:
        return gathered_layer_bytes(layer, training)
    if fsdp1_no_shard(training):  # See Note [FSDP1 NO_SHARD's 16-bit copy]: made per unit
        return 0
    unsharded = training.zero_stage < 3 or dp == 1
    if unsharded and training.is_mixed and training.conventions.fsdp_param_dtype_follows_precision:
        return gathered_layer_bytes(layer, training)
    return 0


def reduce_scatter_layer_bytes(layer: Sequence[TensorState], training: TrainingConfig) -> int:
    """Bytes of one layer's unsharded gradients before ZeRO-2/3 / FSDP reduce-scatters them:
    the stored gradient bytes (``full_grad_bytes``), or ``c`` per trainable element when FSDP
    reduces in the compute dtype (accelerate: ``reduce_dtype=bf16``,
    ``fsdp_reduce_in_compute_dtype``).

    Alive: backward, one layer at a time (the layer being reduced).

    Source: torch distributed/fsdp/_runtime_utils.py ``_post_backward_hook`` (``unsharded_grad``
    in ``reduce_dtype``, cast to the parameter dtype after the reduce-scatter).
    """
    conv = training.conventions
    if training.is_mixed and conv.fsdp_reduce_in_compute_dtype:
        c = dtype_bytes(training.compute_dtype)
        return c * sum(s.numel for s in layer if s.trainable) // training.tensor_parallel_size
    return sum(s.full_grad_bytes for s in layer)


def gradients_alive_in_forward(training: TrainingConfig) -> bool:
    """Whether every gradient already exists during the forward pass: gradient accumulation
    over > 1 micro-batches, ``zero_grad(set_to_none=False)``, or a gradient buffer the
    framework allocates once at wrap time (``grad_buffer_from_init``: Megatron's fp32
    ``grad_data``; ``zero3_grad_partition_from_init``: DeepSpeed ZeRO-3's gradient partition).

    Alive: forward, backward and optimizer (the whole step).

    Source: Megatron-LM megatron/core/distributed/param_and_grad_buffer.py
    ``_ParamAndGradBuffer.__init__`` (``self.grad_data = torch.zeros(self.numel,
    dtype=self.grad_dtype, ...)``; ``param.main_grad`` are views into it); DeepSpeed
    runtime/zero/stage3.py ``grad_partitions_flat_buffer``;
    torch/optim/optimizer.py ``zero_grad``.
    """
    return (
        training.gradient_accumulation_steps > 1
        or not training.zero_grad_set_to_none
        or gradient_buffer_from_init(training)
        or training.bf16_optimizer_grads_released in ("backward", "never")
    )


def gradient_buffer_from_init(training: TrainingConfig) -> bool:
    """The framework allocates the gradients once at wrap time and never frees them: Megatron's
    fp32 ``grad_data`` (``grad_buffer_from_init`` with master weights), DeepSpeed ZeRO-3's
    gradient partition (``zero3_grad_partition_from_init``). Not DeepSpeed ``BF16_Optimizer``,
    whose parameters' ``.grad`` are autograd's bf16 ones and whose buffer from init is a second
    tensor (:func:`deepspeed_bf16_grad_buffer_bytes`, Note [BF16_Optimizer's two gradients]).
    Sources: see :func:`gradients_alive_in_forward`."""
    conv = training.conventions
    return (conv.grad_buffer_from_init and training.master_weights) or (
        conv.zero3_grad_partition_from_init and training.zero_stage == 3
    )


def deepspeed_bf16_grad_buffer_bytes(trainable_elements: int, training: TrainingConfig) -> int:
    """Bytes of DeepSpeed ``BF16_Optimizer``'s flat gradient buffer on one rank: every trainable
    element (not partitioned), padded to a multiple of 2 x N, in the accumulation dtype; 0
    without ``BF16_Optimizer``.

    Note [BF16_Optimizer's two gradients]
        ``BF16_Optimizer`` (deepspeed/runtime/bf16_optimizer.py, v0.16.4 to v0.19.5; chosen by
        engine.py ``_do_optimizer_sanity_check`` for bf16 weights with fp32 accumulation at ZeRO
        0, or at ZeRO 1 without optimizer offload, and for bf16 accumulation under pipeline
        parallelism) keeps two gradients of every parameter:
        - ``_setup_for_real_optimizer`` (at ``deepspeed.initialize``): ``fp32_flat_buffer =
          torch.zeros_like(self.bf16_groups_flat[i], dtype=self.grad_acc_dtype)``, the whole
          flat group (``_flatten_dense_tensors_aligned(..., nccl_start_alignment_factor *
          real_dp_world_size)``, alignment 2 x N), never freed (``clear_hp_grads`` zeroes it
          after each step); the fp32 master weights and the optimizer states cover this rank's
          1/N partition only;
        - the parameters' own bf16 ``.grad``, made by autograd in ``loss.backward()``, which
          the wrapper only reads: ``_update_hp_grad`` does ``hp_grad.data.add_(lp.grad.data.
          to(hp_grad.dtype).view(hp_grad.shape))`` per parameter (``update_hp_grads`` after the
          backward, from engine.py ``backward``; or in a grad-accumulator hook with
          ``bf16.immediate_grad_update``), a transient fp32 copy of one parameter's gradient
          at a time, and ``clear_lp_grads=False``. When they are freed depends on the release
          (:func:`~trainmem.specs.frameworks.deepspeed_bf16_grads_released`): up to 0.16.4 by
          ``clear_lp_grads()`` at the start of the next ``backward`` (they live through the next
          forward); from 0.16.5 by ``zero_grad`` after the step under ZeRO-1, never without
          ZeRO.
        The step sets ``param_partition.grad = grad_partition``, a view of the buffer, when it
        is fp32 (no copy; :func:`deepspeed_step_gradient_copies`).

    Alive: the whole step, from ``deepspeed.initialize``.
    """
    if not training.bf16_optimizer:
        return 0
    dp = training.sharding_degree
    padded = deepspeed_partition_elements(trainable_elements, training) * dp
    return dtype_bytes(training.deepspeed_grad_accum_dtype) * padded


DEEPSPEED_REDUCE_BUCKET_SIZE = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size``, elements (runtime/zero/config.py
``reduce_bucket_size: int = Field(pp_int(5e8), ge=0)``)."""


def deepspeed_reduce_bucket_elements(model: ModelSpec, training: TrainingConfig) -> int:
    """Elements of one DeepSpeed gradient bucket: ``reduce_bucket_size``, ``"auto"`` =
    hidden_size^2 (the HF Trainer's fill-in, transformers integrations/deepspeed.py
    ``trainer_config_finalize``), default :data:`DEEPSPEED_REDUCE_BUCKET_SIZE`."""
    size = training.reduce_bucket_size
    if size == "auto":
        return model.hidden_size * model.hidden_size
    return DEEPSPEED_REDUCE_BUCKET_SIZE if size is None else int(size)


DEEPSPEED_PREFETCH_BUCKET_SIZE = 50_000_000
"""DeepSpeed's default ``stage3_prefetch_bucket_size``, elements (runtime/zero/config.py
``prefetch_bucket_size: int = Field(pp_int(5e7), ge=0, alias="stage3_prefetch_bucket_size")``)."""


DEEPSPEED_MAX_LIVE_PARAMETERS = 1_000_000_000
"""DeepSpeed's default ``stage3_max_live_parameters``, elements (runtime/zero/config.py
``max_live_parameters: int = Field(pp_int(1e9), ge=0, alias="stage3_max_live_parameters")``)."""


def deepspeed_backward_bucket_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """DeepSpeed ZeRO-1/2 gradient buckets: ``reduce_bucket_size`` elements of the 16-bit model
    dtype, twice with ``overlap_comm`` (default False below stage 3); 0 for other frameworks.

    Alive: backward (allocated in ``backward()`` before ``loss.backward``).

    Source: DeepSpeed runtime/zero/stage_1_and_2.py ``backward``: ``buf_0 = torch.empty(int(
    self.reduce_bucket_size), dtype=self.dtype, ...)``, ``if self.overlap_comm: buf_1 = ...``.
    """
    if not training.conventions.zero_ipg_buckets or training.zero_stage not in (1, 2):
        return 0
    if training.deepspeed_optimizer not in (None, "zero"):  # BF16_Optimizer has no IPG bucket
        return 0
    c = dtype_bytes(training.weight_dtype)
    overlap = bool(training.overlap_comm)  # None: False below stage 3
    return c * deepspeed_reduce_bucket_elements(model, training) * (2 if overlap else 1)


def deepspeed_persistent_bucket_bytes(model: ModelSpec, training: TrainingConfig) -> int:
    """DeepSpeed ZeRO-3's gradient bucket: ``reduce_bucket_size`` elements of the 16-bit model
    dtype, allocated when the optimizer is built; 0 for other frameworks and stages.

    Alive: the whole step (forward, backward and optimizer).

    Source: DeepSpeed runtime/zero/stage3.py ``DeepSpeedZeroOptimizer_Stage3.__init__``: ``if
    self.contiguous_gradients: self.__ipg_bucket_flat_buffer = torch.empty(self.
    reduce_bucket_size, dtype=self.dtype, ...)``.
    """
    if not training.conventions.zero_ipg_buckets or training.zero_stage != 3:
        return 0
    return dtype_bytes(training.weight_dtype) * deepspeed_reduce_bucket_elements(model, training)


def outside_allocator_bytes(
    training: TrainingConfig, paged_state_bytes: int = 0, gpu: GPUSpec | None = None
) -> dict[str, int]:
    """Device memory of the step that the caching allocator does not hold, by kind: the states
    of a bitsandbytes paged optimizer (CUDA managed memory, ``paged_state_bytes``: the
    analytic engine's :func:`~trainmem.analytic.tensor_states.paged_state_bytes`) and the NCCL
    communicators (:func:`nccl_communicator_bytes`). nvidia-smi counts them (paged states while
    resident); ``max_memory_allocated`` / ``max_memory_reserved`` never do.

    Alive: the whole step (forward, backward and optimizer).

    Returns:
        Kind -> bytes; kinds with 0 bytes are left out.
    """
    out = {"paged_optimizer_states": paged_state_bytes}
    for group, size in nccl_communicator_bytes(training, gpu).items():
        out[f"nccl_communicator/{group}"] = size
    return {k: v for k, v in out.items() if v}


NCCL_SOURCE = "NCCL cudaMalloc; the size measured on 4 x A100 in NVIDIA/nccl #964, not a default"
"""How the notes name a communicator's size: a measurement, which NCCL's channel count (link
bandwidth) moves (see :data:`NCCL_COMMUNICATOR_BYTES`)."""
NCCL_HOPPER_SOURCE = "NCCL cudaMalloc; the size measured on 8 x H100 in NVIDIA/nccl #1685"
NCCL_GIVEN_SOURCE = "NCCL cudaMalloc; the size given by --nccl-buffer-bytes"


def nccl_source(training: TrainingConfig, gpu: GPUSpec | None) -> str:
    """Where the communicator size of :func:`nccl_communicator_bytes` comes from, for a note."""
    if training.nccl_buffer_bytes is not None:
        return NCCL_GIVEN_SOURCE
    return NCCL_HOPPER_SOURCE if _is_hopper(gpu) else NCCL_SOURCE


def device_context(
    training: TrainingConfig,
    cuda_context_bytes: int | None,
    paged_state_bytes: int = 0,
    gpu: GPUSpec | None = None,
) -> tuple[int, dict[str, int], list[str]]:
    """The device memory beside the caching allocator's, for every engine: the CUDA context
    (``cuda_context_bytes``, the user's figure, else the default for ``torch_version``,
    :func:`~trainmem.specs.hardware.default_cuda_context_bytes`) plus
    :func:`outside_allocator_bytes`. The driver replays the step on the GPU's capacity minus
    it and counts it in the device total (nvidia-smi), never in ``max_memory_allocated``.

    Returns:
        (bytes, :func:`outside_allocator_bytes`, one note per outside kind).
    """
    outside = outside_allocator_bytes(training, paged_state_bytes, gpu)
    if cuda_context_bytes is None:  # the user's figure always wins
        base = default_cuda_context_bytes(parse_version("torch_version", training.torch_version))
    else:
        base = cuda_context_bytes
    source = nccl_source(training, gpu)
    notes = [
        f"{kind.replace('_', ' ')}: {size:,} bytes outside the caching allocator "
        f"({'CUDA managed memory' if kind.startswith('paged') else source}): counted "
        "in the device total (with the CUDA context), not in max_memory_allocated"
        for kind, size in outside.items()
    ]
    if gpu is not None and not gpu.peer_access and nccl_communicator_bytes(training):
        notes.append(f"NCCL: {NCCL_SHM_NOTE}")
    return base + sum(outside.values()), outside, notes


NCCL_COMMUNICATOR_BYTES = 688 * MiB
"""Device memory of one NCCL communicator of more than two ranks after its first collective,
measured on 4 x A100 with NVLink (NVIDIA/nccl issue #964: "for group with more than 2 devices,
it requires 688 MB", nvidia-smi MiB). NCCL's own buffers (``NCCL_BUFFSIZE`` = 4 MiB per channel
per peer for the Simple protocol, plus LL / LL128) scale with the number of channels, which NCCL
raises with the link bandwidth (NVIDIA/nccl issue #986, maintainer's answer), so faster
interconnects use more (NVIDIA/nccl issue #864 reports about 1.6 GB)."""
NCCL_PAIR_COMMUNICATOR_BYTES = 544 * MiB
"""The same measurement for a two-rank communicator (NVIDIA/nccl issue #964: 544 MB)."""
NCCL_HOPPER_COMMUNICATOR_BYTES = 1_060_000_000
"""Device memory of one NCCL communicator on Hopper (compute capability 9.x: H100, H200,
H800, GH200): 1.06 GB per GPU on 8 x H100 after the communicator's first collective, PyTorch's
own memory excluded (NVIDIA/nccl issue #1685, "[0] before 1st all_to_all_single / NV 1.06
GB"); NVLink 4 gets more channels, so more buffers, than A100's 688 MiB (issue #986). No
two-rank figure is published for Hopper: pairs take the same size (an upper side; issue #864's
1.6 GB is higher still). Other generations keep the A100 measurement; a measured figure of
one's own goes in ``nccl_buffer_bytes`` (``--nccl-buffer-bytes``)."""


NCCL_SHM_NOTE = (
    "the GPUs have no peer access (GeForce boards over PCIe), so NCCL connects them through "
    "host shared memory (src/transport/shm.cc): its communicators' buffers are host memory, "
    "not counted on the device; pass --nccl-buffer-bytes for an NVLink-bridged pair"
)
"""The note of a parallel run on boards without peer access. Note [NCCL without peer access]:

    NCCL tries its transports in order, p2p first, then shm (src/transport.cc
    ``ncclTransports``). ``p2pCanConnect`` (src/transport/p2p.cc, v2.19.3, the NCCL of torch
    2.2) refuses when ``cudaDeviceCanAccessPeer`` says no, which NVIDIA's driver does for
    GeForce boards over PCIe (``GPUSpec.peer_access``); then ``shmSendSetup`` /
    ``shmRecvSetup`` (src/transport/shm.cc) put each connection's buffers of every protocol
    (``comm->buffSizes``: Simple 4 MiB, LL128 ~4.7 MiB, LL 0.5 MiB per channel) in a
    ``/dev/shm`` segment mapped into the device's address space (``ncclShmOpen``), host memory.
    Only with ``NCCL_SHM_USE_CUDA_MEMCPY=1`` (default 0) is a ``devFifo`` of the Simple
    buffer's size taken with ``ncclCudaCalloc``. What stays on the device (the ``ncclDevComm``
    and channel structures) is a few KiB. So a communicator of such boards holds no device
    memory beside the caching allocator, where the A100 measurement (NVIDIA/nccl #964, P2P
    over NVLink: the receive buffers on the GPU) is 544-688 MiB."""


def _is_hopper(gpu: GPUSpec | None) -> bool:
    return gpu is not None and gpu.vendor == "nvidia" and gpu.compute_capability.startswith("9.")


def nccl_communicator_bytes(training: TrainingConfig, gpu: GPUSpec | None = None) -> dict[str, int]:
    """Device memory of the NCCL communicators one rank holds, by process group: one per
    parallel dimension of size > 1 (data, tensor, pipeline, context; HYBRID_SHARD's shard and
    replicate groups are two), each :data:`NCCL_COMMUNICATOR_BYTES` (two ranks:
    :data:`NCCL_PAIR_COMMUNICATOR_BYTES`; pipeline send / recv between neighbouring stages are
    pairs). NCCL allocates them with ``cudaMalloc`` outside the caching allocator.

    Alive: the whole step (from the first collective on the group to the end of the process).

    Source: NVIDIA/nccl issues #964 (measured sizes), #986 ("more communicators = more memory
    used"); fairscale utils/parallel.py ``get_process_group_cached`` ("the NCCL buffers are not
    allocated through the PyTorch caching allocator").

    The size of one: ``training.nccl_buffer_bytes`` when given (explicit wins), else
    :data:`NCCL_HOPPER_COMMUNICATOR_BYTES` on a Hopper GPU, else the A100 measurements.

    On a GPU without peer access (``GPUSpec.peer_access`` False: the GeForce boards) the
    communicators take no device memory: Note [NCCL without peer access].

    Known limitations: one measured size per GPU generation (A100, H100), whatever the
    interconnect and NCCL version; a communicator across machines on boards without peer
    access (the network transport) is counted as none too.
    """
    given = training.nccl_buffer_bytes
    hopper = _is_hopper(gpu)
    if given is None and gpu is not None and not gpu.peer_access:
        return {}

    def one(ranks: int) -> int:
        if given is not None:
            return given
        if hopper:
            return NCCL_HOPPER_COMMUNICATOR_BYTES
        return NCCL_PAIR_COMMUNICATOR_BYTES if ranks == 2 else NCCL_COMMUNICATOR_BYTES

    dp, shard = training.data_parallel_size, training.sharding_degree
    out: dict[str, int] = {}
    if shard < dp:  # HYBRID_SHARD: reduce-scatter within the node, all-reduce across nodes
        out["shard"] = one(shard) if shard > 1 else 0
        out["replicate"] = one(-(-dp // shard))
    elif dp > 1:
        out["data"] = one(dp)
    if training.tensor_parallel_size > 1:
        out["tensor"] = one(training.tensor_parallel_size)
    if training.context_parallel_size > 1:
        out["context"] = one(training.context_parallel_size)
    if training.pipeline_parallel_size > 1:
        out["pipeline"] = one(2)
    return {k: v for k, v in out.items() if v}


def deepspeed_partition_elements(trainable_elements: int, training: TrainingConfig) -> int:
    """Elements of this rank's partition of DeepSpeed's flat parameter group: the group
    flattened and padded to a multiple of 2 x N (``nccl_start_alignment_factor`` x the
    data-parallel size), split in N equal parts (N = 1 without sharding).

    Source: DeepSpeed runtime/zero/stage_1_and_2.py ``__init__``
    (``flatten_dense_tensors_aligned(..., self.nccl_start_alignment_factor * dp)``,
    ``partition_size = len(self.bit16_groups_flat[i]) / dp``).
    """
    dp = training.sharding_degree if training.zero_stage > 0 or training.bf16_optimizer else 1
    align = 2 * dp
    return -(-trainable_elements // align) * align // dp


DEEPSPEED_SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed ZeRO-3's default ``sub_group_size``, elements of this rank's partition stepped at
once (runtime/zero/config.py ``sub_group_size: int = Field(pp_int(1e9), ge=0)``)."""


def deepspeed_zero3_sub_groups(
    partitions: Sequence[int], sub_group_size: int = DEEPSPEED_SUB_GROUP_SIZE
) -> list[int]:
    """Elements of each of ZeRO-3's optimizer sub-groups, in order: this rank's parameter
    partitions, in order, gathered until a group reaches ``sub_group_size``.

    Source: DeepSpeed runtime/zero/stage3.py ``_create_fp16_sub_groups`` (``if sub_group_size
    is None or sub_group_size >= params_group_numel: return [params_group]``; else ``if
    local_sub_group_size >= sub_group_size or id(param) == id(params_group[-1])``: close the
    group), the same at v0.8.0, v0.12.3 and v0.19.5.

    Args:
        partitions: per trainable parameter, its partition's elements on this rank.
        sub_group_size: DeepSpeed's ``sub_group_size``.

    Returns:
        Elements per sub-group (empty without partitions).
    """
    total = sum(partitions)
    if sub_group_size >= total:
        return [total] if partitions else []
    groups: list[int] = []
    current = 0
    for n in partitions:
        current += n
        if current >= sub_group_size:
            groups.append(current)
            current = 0
    return groups + [current] if current else groups


def deepspeed_zero3_sub_group_elements(
    partitions: Sequence[int], sub_group_size: int = DEEPSPEED_SUB_GROUP_SIZE
) -> int:
    """Elements of ZeRO-3's largest optimizer sub-group (:func:`deepspeed_zero3_sub_groups`;
    0 without partitions)."""
    return max(deepspeed_zero3_sub_groups(partitions, sub_group_size), default=0)


def deepspeed_zero3_norm_copy_bytes(partitions: Sequence[int], training: TrainingConfig) -> int:
    """Bytes of the largest fp64 copy DeepSpeed ZeRO-3 makes to take the gradients' norm at the
    step: 8 per element of the largest gradient partition on this rank; 0 with the optimizer
    offloaded (its norms are taken in the backward) and for other frameworks and stages.

    Alive: inside the step, before the sub-groups' gradient copies (one partition at a time).

    Source: DeepSpeed runtime/zero/stage3.py ``step`` -> ``_get_norm_groups`` ->
    ``get_grad_norm_direct(self.averaged_gradients[i], ...)``: ``grad_norms.append(g.to(
    device, non_blocking=True).double().norm(2))`` per gradient partition (each a view of the
    flat gradient-partition buffer), the fp64 copy freed once its 0-dim norm exists; the same
    line at v0.9.0, v0.12.3, v0.16.4 and v0.19.5.

    Args:
        partitions: per trainable parameter, its gradient partition's elements on this rank.
        training: framework, ZeRO stage, offload.
    """
    if training.deepspeed_optimizer != "zero" or training.zero_stage != 3:
        return 0
    if training.offload != "none" or not partitions:
        return 0
    return 8 * max(partitions)


def deepspeed_zero12_norm_copy_bytes(tensors: Sequence[int], training: TrainingConfig) -> int:
    """Bytes of the largest fp64 copy DeepSpeed ZeRO-1/2 makes to take the gradients' norm at
    the step: 8 per element of the largest piece a trainable tensor has in one rank's
    partition of the flat group (the tensors flattened in order, padded and split in N equal
    partitions, :func:`deepspeed_partition_elements`; the pieces differ between ranks and the
    largest on any rank is taken); 0 with the optimizer offloaded (the norms are taken per
    parameter in the backward, ``complete_grad_norm_calculation_for_cpu_offload``; not
    modelled) and for other frameworks and stages.

    Alive: inside the step, before the step's gradient copies (one piece at a time).

    Source: DeepSpeed runtime/zero/stage_1_and_2.py ``step`` -> ``scaled_global_norm`` ->
    ``get_grad_norm_direct(self.averaged_gradients[i], self.params_in_partition[i])``, one
    ``g.data.double()`` per piece (``averaged_gradients[i]`` is ``get_flat_partition(...,
    return_tensor_list=True)``: each tensor's part in this rank's partition), freed once its
    0-dim norm exists: ``g.data.double().norm(2)`` at v0.9.0 and v0.12.3,
    ``torch.linalg.vector_norm(g.data.double().detach(), ...)`` at v0.16.4 and v0.19.5.

    Args:
        tensors: elements of each trainable tensor on this rank (its tensor-parallel slice),
            in the optimizer's order.
        training: framework, ZeRO stage, data-parallel size, offload.
    """
    if training.deepspeed_optimizer != "zero" or training.zero_stage not in (1, 2):
        return 0
    if training.offload != "none" or not tensors:
        return 0
    size = deepspeed_partition_elements(sum(tensors), training)
    largest, start = 0, 0
    for n in tensors:
        end = start + n
        cut = (start // size + 1) * size  # the end of the partition the tensor starts in
        piece = n if end <= cut else max(cut - start, min(size, end - cut))
        largest = max(largest, piece)
        start = end
    return 8 * largest


def deepspeed_step_gradient_copies(
    trainable_elements: int, training: TrainingConfig, *, largest_sub_group: int | None = None
) -> tuple[int, int]:
    """Bytes of the gradient copies DeepSpeed's optimizer wrapper builds when it steps, as
    (transient, kept): the transient is freed as soon as the kept copy exists; the kept one is
    the fp32 partition's ``.grad`` through ``optimizer.step()``. One parameter group assumed
    (the HF Trainer's second, no-decay group of norms and biases is small).

    * ZeRO-1/2 (``stage_1_and_2.py`` ``step``, no CPU offload): ``single_grad_partition =
      self.flatten(self.averaged_gradients[i]).to(fp32)`` (``flatten_dense_tensors_aligned``
      on the last rank): a flat copy of this rank's gradient partition in the gradient dtype
      (transient), then its fp32 copy (kept); with fp32 gradients ``.to`` returns the flat
      copy itself, which is then the kept one.
    * ZeRO-3 (``stage3.py`` ``_prepare_fp32_grad_for_sub_group``, no optimizer offload): the
      same per optimizer sub-group (``largest_sub_group`` elements,
      :func:`deepspeed_zero3_sub_group_elements`), the fp32 copy freed by
      ``_release_sub_group`` before the next one.
    * ``FP16_Optimizer`` (``fp16/fused_optimizer.py`` ``step``, DeepSpeed's ``FusedAdam`` from
      the config's ``optimizer`` section): ``_flatten_dense_tensors([p.grad.to(fp32) for p in
      group])``: an fp32 copy of every gradient, all alive until ``torch.cat`` has built the
      flat fp32 gradient (kept). Known limitation: a client optimizer that is not
      ``FusedAdam`` (the HF Trainer's own AdamW without an ``optimizer`` section) runs
      ``FP16_UnfusedOptimizer`` instead (``fp16/unfused_optimizer.py``: ``fp32_param.grad =
      fp16_param.grad.to(fp32)`` per parameter, 4 B kept, nothing transient); not modelled.
    * ``BF16_Optimizer`` (``bf16_optimizer.py`` ``step``): ``grad_partition.to(fp32)`` only
      when it accumulates in another dtype than fp32 (kept); none otherwise.
    * CPU offload: none here (the gradients go to host buffers).

    Alive: the optimizer step.

    Args:
        trainable_elements: trainable elements on this rank (its tensor-parallel slice).
        training: framework, precision, ZeRO stage, sharding, offload.
        largest_sub_group: ZeRO-3's largest sub-group, elements; None: this rank's whole
            partition.

    Returns:
        (transient bytes, kept bytes); (0, 0) for other frameworks.
    """
    wrapper = training.deepspeed_optimizer
    if wrapper is None or training.offload != "none":
        return 0, 0
    g = dtype_bytes(training.grad_dtype)
    if wrapper == "zero":
        n = deepspeed_partition_elements(trainable_elements, training)
        if training.zero_stage == 3 and largest_sub_group is not None:
            n = largest_sub_group
        return (g * n, 4 * n) if g != 4 else (0, 4 * n)
    if wrapper == "fp16":
        return 4 * trainable_elements, 4 * trainable_elements
    if wrapper == "bf16" and training.deepspeed_grad_accum_dtype != "float32":
        return 0, 4 * deepspeed_partition_elements(trainable_elements, training)
    return 0, 0
