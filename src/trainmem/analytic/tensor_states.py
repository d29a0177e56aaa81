"""Per-tensor model states on one GPU: weight, gradient and optimizer-state bytes of every
parameter tensor, after LoRA / quantized bases, ZeRO / FSDP sharding and CPU offload.

Both the closed form (``engine.py``) and the allocation timeline (``step_timeline.py``) read this
one table, so the two can never disagree about model states.

Note [Model states with PEFT and sharding]
    * LoRA (Hu et al. 2021, arXiv:2106.09685, sec. 4.1): each targeted linear W (in x out) gets
      trainable A (r x in) and B (out x r) in the weight dtype; the base weights are frozen: no
      gradient, no optimizer state (peft ``LoraLayer.update_layer``). peft on a fused q/k/v module
      (GPT-2 ``c_attn``) adapts the fused matrix.
    * QLoRA (Dettmers et al. 2023, arXiv:2305.14314, sec. 3): the frozen linear weights of the
      layers are 4-bit (NF4 or FP4), 0.5 byte per value, with one fp32 absmax per block of 64
      values, or after double quantization one 8-bit absmax per block plus one fp32 absmax per
      256 blocks (bitsandbytes ``Linear4bit``, ``quantize_4bit(blocksize=64,
      compress_statistics=...)``); embeddings, norms and the LM head stay in the weight dtype
      (transformers keeps the output embedding unquantized, ``get_keys_to_not_convert``;
      lit-gpt's head is quantized with the rest, :func:`quantized_lm_head`).
      ``int8`` (LLM.int8(), bitsandbytes
      ``Linear8bitLt``): 1 byte per value plus one fp32 scale per output row.
    * ZeRO (Rajbhandari et al. 2020, arXiv:1910.02054, sec. 5.1-5.3, Figure 1): stage 1 shards the
      optimizer states over the data-parallel ranks, stage 2 also the gradients, stage 3 also the
      parameters; FSDP's SHARD_GRAD_OP / FULL_SHARD shard like stages 2 / 3. Each tensor's shard
      is ``ceil(bytes / data_parallel_size)`` (FSDP pads flat parameters to a multiple of the
      world size).
    * Offload (ZeRO-Offload, Ren et al. 2021, arXiv:2101.06840): ``optimizer`` keeps the optimizer
      states (and runs the step) on the CPU; ``optimizer+params`` also keeps the parameter shards
      there (ZeRO-Infinity).
    * FSDP1 flat parameters (:func:`flat_parameter_grads`): under a framework whose FSDP puts
      frozen and trainable parameters into one ``FlatParameter`` (``use_orig_params=True``), every
      tensor of a wrapped unit that holds a trainable tensor gets a gradient (not an optimizer
      state): the frozen base weights of a LoRA layer included.

Note [bitsandbytes statistics under sharding]
    A bitsandbytes 4-bit weight is a ``Params4bit`` holding the packed codes (in
    ``quant_storage``, bf16 for FSDP); its absmax values (and, double-quantized, their own
    absmax) live in a ``QuantState`` that is not a parameter or a buffer: bitsandbytes 0.43.0
    nn/modules.py ``Params4bit._quantize`` stores it in ``self.quant_state`` and on the
    ``Linear4bit`` (``self.module.quant_state = quant_state``), and ``Linear4bit.forward`` gives
    it back to the weight once FSDP has replaced the weight by a view of its flat parameter
    (``fix_4bit_weight_quant_state_from_module``). FSDP and DeepSpeed ZeRO-3 flatten, shard,
    gather and offload parameters only, so on every rank the statistics stay whole on the GPU
    where they were quantized: Answer.AI fsdp_qlora train.py (50efa1e, Mar 2024)
    ``load_and_quantize`` quantizes each weight on the rank's GPU (``.cuda(device)``) and then
    moves only its data to the CPU or the meta device (``type(param)(value.data.to("cpu"),
    **value.__dict__)``: the ``quant_state`` stays). Hence, under ZeRO-3 / FULL_SHARD over
    more than one rank: a weight's ``param_bytes`` are its codes' shard (none with parameter
    offload) plus the whole statistics, and ``full_param_bytes`` (what is gathered, flattened,
    moved) the codes alone. torchao's ``NF4Tensor`` (torchtune) keeps its scalers inside the
    parameter and shards them with it.

Note [peft modules_to_save]
    ``LoraConfig(modules_to_save=["embed_tokens", "lm_head"])`` trains the token embedding and
    the LM head whole beside the adapters (Qwen-1's "LoRA (emb)", axolotl
    ``lora_modules_to_save``, LLaMA-Factory ``additional_target``). peft 0.21.2
    utils/other.py ``ModulesToSaveWrapper.update``: ``self.modules_to_save[adapter_name] =
    copy.deepcopy(self.original_module)``, then ``self.original_module.requires_grad_(False)``
    and the copy's ``requires_grad`` True (so since peft 0.6.0; peft 0.5.0's ``_set_trainable``
    set the original's ``requires_grad`` True before copying it and never froze it, but the
    wrapper's forward runs the copy only, so the original gets no gradient and torch's
    optimizers, which skip a parameter whose ``grad`` is None, make no state for it: the same
    bytes). So each saved module holds two V x h weights on the GPU: the frozen original (no
    gradient, no optimizer state) and the trained copy, a
    deep copy in the original's dtype: peft's ``cast_adapter_dtype`` upcasts only the
    ``BaseTunerLayer`` adapters, not an ``AuxiliaryTrainingWrapper`` (peft 0.21.2
    tuners/tuners_utils.py), so the copy is bf16 on a bf16-loaded model, fp32 after
    ``prepare_model_for_kbit_training``. The copy gets a gradient and optimizer states like a
    fully fine-tuned module's, in the weight dtype (``TensorState`` name ``embedding/tokens``
    / ``lm_head``, trainable; the original is ``<name>.original``, frozen), and the step's
    activations are those of a trained embedding (its dense V x h ``embedding_dense_backward``
    gradient) and a trained head (its saved input, its V x h weight gradient): every reader
    of :attr:`~trainmem.specs.training.TrainingConfig.trains_embedding` /
    ``trains_lm_head``. TRL's SFTTrainer before 0.26 casts every module named like the
    embedding or the head back to bf16 after ``get_peft_model`` (``peft_module_casting_to_bf16``:
    ``lm_head.modules_to_save.default`` matches ``lm_head``), so over a k-bit base the copy is
    bf16 with a bf16 gradient and bf16 AdamW moments. Weights tied in the config
    (``tie_word_embeddings``): both modules copy the one shared weight independently (peft's
    ``_set_trainable`` matches the ``lm_head`` module, whose ``weight`` is the embedding's, and
    deep-copies it), so the copies are untied; the frozen original stays shared
    (:func:`~trainmem.analytic.engine.model_as_built`). peft's ``ensure_weight_tying=True``
    (0.18+), which ties the head's copy to the embedding's, is not modelled.

Note [EMA weights]
    diffusers' training scripts keep an exponential moving average of the trained weights
    (diffusers 0.42.1 src/diffusers/training_utils.py ``EMAModel.__init__``: ``self.shadow_params
    = [p.clone().detach() for p in parameters]``, in each parameter's dtype unless the script
    calls ``ema.to(dtype=...)``). The copy is made before training and lives the whole run, so it
    is counted as a persistent PARAMETER (a copy of the weights, allocated at setup with them;
    not an optimizer state, which torch allocates lazily at the first step): ``param_bytes``
    holds ``ema_dtype`` bytes x the elements of every trainable tensor on top of the weight
    (``TrainingConfig.ema_device="cuda"``). With ``ema_device="cpu"`` (the examples'
    ``--offload_ema``: ``ema_unet.to(device="cuda")`` before ``ema_unet.step`` and back to the
    CPU after it, examples/text_to_image/train_text_to_image.py) it is not held on the GPU; its
    transient copy at the step is a temporary (``analytic/temporaries.py``, Note
    [Optimizer-step temporaries]). The copy is of the whole unsharded module (the scripts build
    it from their own ``from_pretrained``), so ZeRO-3 / FSDP parameter sharding, tensor and
    pipeline parallelism and offload are refused with it (``TrainingConfig``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from operator import attrgetter
from typing import Any

from trainmem.analytic.lora import lora_adapter_dtype
from trainmem.analytic.model_states import flat_state_bytes, optimizer_state_bytes
from trainmem.analytic.params import (
    adapted_linears,
    linear_shapes,
    lora_targeted,
    parameter_counts,
)
from trainmem.analytic.prompt_encoder import PROMPT_ENCODER, prompt_encoder_tensors
from trainmem.memo import Identity, by_value
from trainmem.specs.frameworks import (
    LITGPT_LORA_LINEAR_UNITS_SINCE,
    TORCHAO_NF4_FACTOR_CONTIGUOUS_SINCE,
    TORCHAO_OFFLOAD_MINIMAL_SIZE,
    trl_bf16_tensors,
)
from trainmem.specs.model import ModelSpec
from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.specs.quantization import (
    NF4_BLOCK,
    NF4_DOUBLE_QUANT_BLOCK,
    quantized_weight_bytes,
    unflattened_quantized_bytes,
)
from trainmem.specs.ranks import flat_optimizer_tensors, fsdp1_framework
from trainmem.specs.training import TrainingConfig
from trainmem.units import dtype_bytes


@dataclass(frozen=True, slots=True)
class TensorState:
    """One parameter tensor on one GPU, in bytes.

    Attributes:
        owner: ``embedding``, ``layers.<i>`` or ``head``.
        name: linear name (``q``, ``up``...), ``lora_A.q``, or ``vector`` / the component key.
        numel: elements of the whole tensor (before tensor parallelism and sharding).
        trainable: gets a gradient and optimizer states.
        param_bytes: weight bytes held on this GPU (after quantization, sharding, offload).
        grad_bytes: gradient bytes held between backward and the optimizer step.
        state_bytes: optimizer-state bytes held on this GPU.
        full_param_bytes: weight bytes of this rank's tensor-parallel slice before ZeRO / FSDP
            sharding (what ZeRO-3 gathers).
        full_grad_bytes: gradient bytes of that slice before it is reduce-scattered.
        paged_state_bytes: optimizer-state bytes in CUDA managed memory (bitsandbytes paged
            optimizers), outside the caching allocator and not in ``state_bytes``.
        local_numel: elements of this rank's tensor-parallel slice before ZeRO / FSDP sharding
            (what torchao's ``minimal_size`` and DeepSpeed's partitions count).
    """

    owner: str
    name: str
    numel: int
    trainable: bool
    param_bytes: int
    grad_bytes: int
    state_bytes: int
    full_param_bytes: int
    full_grad_bytes: int
    paged_state_bytes: int = 0
    local_numel: int = 0


BNB_PAGED_MIN_NUMEL = 100_000
"""bitsandbytes pages an optimizer state only for tensors of at least 1e5 elements
(bitsandbytes/optim/optimizer.py ``get_state_buffer``: ``if not self.is_paged or p.numel() <
1e5: return torch.zeros_like(...)``, else ``F.get_paged(...)``, i.e. ``cudaMallocManaged``)."""


def paged_state_bytes(training: TrainingConfig, numel: int, shards: int = 1) -> int:
    """Optimizer-state bytes of one tensor that a bitsandbytes paged optimizer keeps in CUDA
    managed memory: both fp32 states (8 B per element, ``paged-adamw``) or both uint8 states
    (2 B per element, ``paged-adamw-8bit``; the fp32 absmax stays in the allocator), for tensors
    of at least :data:`BNB_PAGED_MIN_NUMEL` elements; 0 otherwise.

    Alive: the whole step (forward, backward and optimizer); counted in the device total, not
    in ``max_memory_allocated`` / ``max_memory_reserved``.

    Source: bitsandbytes/optim/optimizer.py ``Optimizer2State.init_state`` /
    ``get_state_buffer``; bitsandbytes/functional.py ``get_paged`` (``cudaMallocManaged``).
    """
    per_element = OPTIMIZER_TABLE[training.optimizer].paged_bytes_per_element()
    if not per_element or numel < BNB_PAGED_MIN_NUMEL:
        return 0
    return -(-per_element * numel // shards)


def ema_bytes_per_element(training: TrainingConfig, weight_bytes: int) -> int:
    """Bytes per element of the EMA copy of a trainable tensor stored in ``weight_bytes`` bytes
    per element: ``ema_dtype``'s, or the tensor's own (``p.clone()``); see Note [EMA weights].

    Source: diffusers 0.42.1 src/diffusers/training_utils.py ``EMAModel.__init__``
    (``shadow_params = [p.clone().detach() for p in parameters]``) and ``EMAModel.to(dtype=...)``.
    """
    return dtype_bytes(training.ema_dtype) if training.ema_dtype else weight_bytes


def flat_parameter_grads(training: TrainingConfig) -> bool:
    """Whether the frozen tensors of a wrapped unit holding a trainable tensor get a gradient.

    FSDP1 with ``use_orig_params=True`` flattens a unit's frozen and trainable parameters into
    one ``FlatParameter`` that requires grad if any of them does (torch 2.1
    distributed/fsdp/flat_param.py ``FlatParamHandle._validate_tensors_to_flatten``:
    ``flat_param_requires_grad = flat_param_requires_grad or tensor.requires_grad``); autograd
    then computes the gradient of the whole flat parameter, one flat tensor per unit
    (``FlatParameter.grad``: unsharded before the reduce-scatter, this rank's padded shard
    after it). Checked by running FSDP1 on the CPU under the fake process group
    (``tests/analytic/test_fsdp_flat_parameter.py``).

    Args:
        training: framework conventions (``fsdp_flat_parameter_grads``), sharding, LoRA,
            quantized base.

    Returns:
        True for FSDP (``zero_stage`` 2 / 3 over more than one rank) with LoRA on an unquantized
        base (a flat parameter holds one dtype: a 4-bit base cannot share it) under such a
        framework; for litgpt only before 0.5.8
        (:data:`~trainmem.specs.frameworks.LITGPT_LORA_LINEAR_UNITS_SINCE`: then each Linear
        is a unit, and from 0.5.11 FSDP2 shards per parameter; 0.5.8-0.5.10's root unit, whose
        flat parameter holds the embedding beside the adapters, is not modelled).
    """
    if training.framework == "litgpt" and training.litgpt_release >= LITGPT_LORA_LINEAR_UNITS_SINCE:
        return False  # Linear units (0.5.8), then FSDP2 (0.5.11): no frozen flat gradient
    return (
        training.conventions.fsdp_flat_parameter_grads
        and training.sharding_degree > 1
        and training.zero_stage >= 2
        and training.is_lora
        and training.quantize_base == "none"
    )


def _adapters(
    adapted: dict[str, tuple[int, int, int]], name: str, training: TrainingConfig
) -> list[tuple[str, int, int, bool]]:
    """(name, numel, out_features, trainable) of the adapters of the linear ``name`` of
    :func:`~trainmem.analytic.params.linear_shapes` when it is targeted: its own, or, for the
    last part of a fused module (``up`` of ``gate_up``), the fused module's (one A and one B,
    :func:`~trainmem.analytic.params.adapted_linears`)."""
    fused = "gate_up" if name == "up" and "gate_up" in adapted else name
    if fused not in adapted or fused == "router" or not lora_targeted(fused, training.lora_targets):
        return []
    i, o, n = adapted[fused]
    r = training.lora_rank
    out: list[tuple[str, int, int, bool]] = []
    for _ in range(n):
        out.append((f"lora_A.{fused}", r * i, r, True))
        out.append((f"lora_B.{fused}", o * r, o, True))
        if training.lora_variant == "dora":  # Note [DoRA] in analytic/lora_variants.py
            out.append((f"lora_magnitude.{fused}", o, o, True))
    return out


def _layer_tensors(model: ModelSpec, training: TrainingConfig) -> list[tuple[str, int, int, bool]]:
    """(name, numel, out_features, trainable) of one layer's tensors, LoRA adapters included.

    A model with blocks of several kinds (:meth:`ModelSpec.layer_kinds`: DeepSeek-V3's dense
    and MoE blocks, T5's encoder and decoder blocks) is held as identical *mean* blocks: every
    kind's tensors, each scaled by (blocks of that kind) / (all blocks). Totals over the model
    are exact to within one element per tensor and block; single tensor sizes are not.
    """
    kinds = model.layer_kinds()
    if len(kinds) > 1:
        total = model.num_blocks
        return [
            (name, numel * count // total, out_features, trainable)
            for count, block in kinds
            for name, numel, out_features, trainable in _layer_tensors(block, training)
            if numel * count // total
        ]
    counts = parameter_counts(model)
    layer_total = sum(n for k, n in counts.items() if k.startswith("layers/")) // model.num_layers
    out: list[tuple[str, int, int, bool]] = []
    lora = training.is_lora
    frozen = _frozen_base(training)
    weights = 0
    # transformers 5 holds a MoE layer's routed experts as two 3-D parameters, gate_up_proj
    # [E, 2i, h] and down_proj [E, h, i] (modeling_qwen3_moe.py ``Qwen3MoeExperts``; Mixtral,
    # Qwen2-MoE, DeepSeek-V3 alike), not one linear per expert: per-tensor optimizer temporaries,
    # FSDP's per-parameter shards and the allocator see two large tensors
    fused_experts = model.num_experts > 1 and training.conventions.hf_model_code
    experts: dict[str, tuple[int, int]] = {}
    adapted = adapted_linears(model)
    for name, (i, o, n) in linear_shapes(model).items():
        expert = fused_experts and name in ("gate", "up", "down") and n == model.num_experts
        for _ in range(1 if expert else n):
            if expert:
                key = "experts_down" if name == "down" else "experts_gate_up"
                numel, width = experts.get(key, (0, 0))
                experts[key] = (numel + n * i * o, width + o)
            else:
                out.append((name, i * o, o, not frozen))
            weights += i * o * (n if expert else 1)
        if lora:  # a linear's adapters after it (a fused gate / up's after up)
            out += _adapters(adapted, name, training)
    out.extend((key, numel, width, not frozen) for key, (numel, width) in experts.items())
    vectors = layer_total - weights
    h = model.hidden_size
    out.extend(("vector", h, h, not frozen) for _ in range(vectors // h))
    if vectors % h:
        out.append(("vector", vectors % h, vectors % h, not frozen))
    return out


LAYOUT_INDEPENDENT_FIELDS: tuple[str, ...] = (
    "micro_batch_size",
    "seq_len",
    "gradient_accumulation_steps",
    "activation_checkpointing",
    "attention",
    "dropout",
)
"""TrainingConfig fields the state layout does not depend on (a sweep over them reuses it)."""

_layout_key = attrgetter(
    *(f.name for f in fields(TrainingConfig) if f.name not in LAYOUT_INDEPENDENT_FIELDS)
)
_LAYOUTS: dict[tuple[Identity, object], StateLayout] = {}
_MAX_LAYOUTS = 256


def state_layout(model: ModelSpec, training: TrainingConfig) -> StateLayout:
    """Cached :func:`build_state_layout`: the layout does not depend on the micro-batch, the
    sequence length or the activation settings (:data:`LAYOUT_INDEPENDENT_FIELDS`), so sweeps
    over those reuse it. The key is the other fields' values, read without building (and
    validating) a TrainingConfig: this runs once per configuration the planner evaluates."""
    key = (by_value(model), _layout_key(training))
    layout = _LAYOUTS.get(key)
    if layout is None:
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            del _LAYOUTS[next(iter(_LAYOUTS))]  # the oldest
        layout = _LAYOUTS[key] = build_state_layout(
            model,
            replace(
                training,
                micro_batch_size=1,
                seq_len=training.context_parallel_size,  # the shortest sequence accepted
                gradient_accumulation_steps=1,
                activation_checkpointing="none",
                # flash whenever a quantized base's rest is in the other 16-bit dtype
                # (TrainingConfig._check_load_dtype accepts no other attention there)
                attention="flash" if training.kbit_dense_cast else "sdpa",
                dropout=True,
            ),
        )
    return layout


def build_state_layout(model: ModelSpec, training: TrainingConfig) -> StateLayout:
    """Every parameter tensor of the model with its bytes on one GPU, in compact form.

    Args:
        model: the transformer's shape.
        training: precision, optimizer, LoRA / quantization, ZeRO stage, data-parallel size,
            offload.

    Returns:
        The embedding tensors, one layer's tensors, the head tensors.

    Source: Note [Model states with PEFT and sharding]; optimizer states per tensor from
    :func:`trainmem.analytic.model_states.optimizer_state_bytes`.
    """
    make = _TensorMaker(training)
    if training.trl_bf16_embeddings:  # TRL's SFTTrainer before 0.26: back to bf16
        make.bf16 = frozenset(trl_bf16_tensors(model.model_type, model.tie_word_embeddings))
    frozen = _frozen_base(training)
    counts = parameter_counts(model)
    h = model.hidden_size
    # FSDP units: one per layer, the root holds the embedding and the head (auto-wrapping the
    # layer class, as lit-gpt / accelerate / torchtitan do)
    layer_tensors = _layer_tensors(model, training)
    layer_unit = any(trainable for *_, trainable in layer_tensors)
    root_unit = not frozen or "lm_head" in training.lora_targets or bool(saved_modules(training))
    out: list[TensorState] = []
    for key, n in counts.items():
        if key.startswith("embedding/"):
            tokens = key == "embedding/tokens"
            trainable = training.trains_embedding if tokens else not frozen
            out.append(make("embedding", key, n, h, trainable, root_unit))
            if tokens and "embed_tokens" in frozen_originals(model, training):
                # See Note [peft modules_to_save]: the frozen original beside the trained copy
                out.append(make("embedding", key + ORIGINAL, n, h, False, root_unit))
    # Note [Prompt encoder tensors]: peft's prompt encoder, the only trained tensors over the
    # frozen base (a unit of its own: peft's fsdp_auto_wrap_policy wraps it)
    for name, n, o in prompt_encoder_tensors(model, training):
        out.append(make("embedding", name, n, o, True, True))
    layer = [
        make("layers.0", name, n, o, trainable, layer_unit)
        for name, n, o, trainable in layer_tensors
    ]
    head: list[TensorState] = []
    for key, n in counts.items():
        if not key.startswith(("embedding/", "layers/")):
            head.extend(_head_tensor(make, key, n, h, root_unit, frozen_originals(model, training)))
    return StateLayout(embedding=out, layer=layer, head=head, num_layers=model.num_blocks)


def _head_tensor(
    make: _TensorMaker, key: str, n: int, h: int, root_unit: bool, originals: tuple[str, ...]
) -> list[TensorState]:
    """A tensor after the layers (final norm, LM head, pooler...), with its LoRA adapters when
    ``lm_head`` is a LoRA target and its frozen original when ``originals`` has it."""
    training = make.training
    lora = training.is_lora
    # the LM head's output rows are the vocabulary (an int8 head's row scales count them)
    rows = n // h if key == "lm_head" else h
    trainable = training.trains_lm_head if key == "lm_head" else not _frozen_base(training)
    out = [make("head", key, n, rows, trainable, root_unit)]
    if key == "lm_head" and "lm_head" in originals:
        # See Note [peft modules_to_save]: the frozen original beside the trained copy
        out.append(make("head", key + ORIGINAL, n, rows, False, root_unit))
    if lora and key == "lm_head" and "lm_head" in training.lora_targets:
        r = training.lora_rank
        out.append(make("head", "lora_A.lm_head", r * h, r, True))
        out.append(make("head", "lora_B.lm_head", n // h * r, n // h, True))
    return out


ORIGINAL = ".original"
"""Suffix of the frozen original of a module peft trains a copy of (Note [peft
modules_to_save]): ``embedding/tokens.original``, ``lm_head.original``."""


def _frozen_base(training: TrainingConfig) -> bool:
    """The base's own tensors are frozen (:attr:`~trainmem.specs.training.TrainingConfig.
    frozen_base`: LoRA, or prompt learning's encoder, Note [Prompt encoder tensors])."""
    return training.frozen_base


def saved_modules(training: TrainingConfig) -> tuple[str, ...]:
    """The modules peft trains whole beside LoRA (``TrainingConfig.lora_modules_to_save``),
    each a trained copy beside its frozen original; () without LoRA."""
    return training.lora_modules_to_save if training.is_lora else ()


def frozen_originals(model: ModelSpec, training: TrainingConfig) -> tuple[str, ...]:
    """The saved modules (:func:`saved_modules`) whose frozen original is a tensor of its own:
    each, except where the config tied the two (``ModelSpec.untied_from_config``): their one
    original is then the frozen module not saved (``embed_tokens`` alone: the head still
    reads it), or counted once with the embedding when both are saved. See Note [peft
    modules_to_save]."""
    saved = saved_modules(training)
    if not model.untied_from_config:
        return saved
    return ("embed_tokens",) if set(saved) == {"embed_tokens", "lm_head"} else ()


_ADAPTERS = ("lora_", PROMPT_ENCODER)
"""Name prefixes of the tensors a PEFT method adds beside the base, in their own dtype
(:func:`~trainmem.analytic.lora.lora_adapter_dtype`): LoRA's adapters, peft's prompt encoder
(Note [Prompt encoder tensors])."""

_NOT_LINEAR = (
    *_ADAPTERS,
    "vector",
    "embedding",
    "head",
    "lm_head",
    "final_norm",
    "pooler",
    "router",
)
"""Name prefixes of the tensors that are not layer linears (not quantized, not split by tensor
parallelism, upcast by peft's k-bit preparation)."""


def torchao_factor_view_bytes(numel: int, training: TrainingConfig) -> int:
    """Bytes a torchao NF4 weight of ``numel`` elements keeps beyond its contiguous scalers
    before torchao 0.3 (torchtune's QLoRA): its quantization factor is a view of a (n / 64 /
    256, 256) bf16 tensor, so 2 x (n / 64) bytes stay alive instead of 2 x (n / 64 / 256)
    (:data:`~trainmem.specs.frameworks.TORCHAO_NF4_FACTOR_CONTIGUOUS_SINCE`; torchao v0.1
    dtypes/nf4tensor.py ``double_quantize_scalers``: ``256 / (2 * scaler_absmax)`` over the
    expanded view, then ``quantization_factor[:, 0]``). 0 for any other run."""
    if (
        training.framework != "torchtune"
        or training.quantize_base not in ("nf4", "nf4-dq")
        or training.torchao_release >= TORCHAO_NF4_FACTOR_CONTIGUOUS_SINCE
    ):
        return 0
    blocks = numel // NF4_BLOCK
    return 2 * (blocks - blocks // NF4_DOUBLE_QUANT_BLOCK)


def unsharded_statistics_bytes(
    local: int, local_out: int, training: TrainingConfig, stage: int
) -> int:
    """Bytes of a quantized base weight of ``local`` elements and ``local_out`` rows that stay
    whole on every rank under ZeRO-3 / FSDP (``stage`` 3 over more than one rank) and with
    parameter offload (:func:`~trainmem.specs.quantization.unflattened_quantized_bytes`): a
    bitsandbytes 4-bit weight's statistics, a GPTQ weight's ``scales`` and ``g_idx`` under
    fms-acceleration's FSDP1 patch; 0 otherwise (no parameter sharding; torchtune's torchao
    ``NF4Tensor``, whose scalers are inner tensors of the parameter and shard with it; int8).
    See Note [bitsandbytes statistics under sharding]."""
    if stage < 3 or training.framework == "torchtune":
        return 0
    return unflattened_quantized_bytes(local, local_out, training)


def quantized_lm_head(training: TrainingConfig) -> bool:
    """The LM head is quantized with the rest of the base: lit-gpt's ``--quantize bnb.*``
    replaces every ``nn.Linear``, the LM head too (Lightning Fabric
    plugins/precision/bitsandbytes.py ``BitsandbytesPrecision.convert_module`` ->
    ``_convert_layers(module, linear_cls, ignore_modules)``, lightning 2.2.1 / 2.3.0, with
    litgpt finetune/lora.py @43c44323 passing no ``ignore_modules``); HF / peft keep
    ``lm_head`` unquantized (``llm_int8_skip_modules`` defaults to the output embedding)."""
    return training.conventions.own_model_code and training.quantize_base != "none"


def _stored_quantized(name: str, trainable: bool, training: TrainingConfig) -> bool:
    """A frozen layer linear (or a frozen LM head that :func:`quantized_lm_head` quantizes)
    stored in ``quantize_base``'s format."""
    if training.quantize_base == "none" or trainable:
        return False
    if name == "lm_head":
        return quantized_lm_head(training)
    return not name.startswith(_NOT_LINEAR)


def is_quantized_base(state: TensorState, training: TrainingConfig) -> bool:
    """Whether ``state`` is a frozen linear stored quantized (``quantize_base``), as
    :class:`_TensorMaker` sizes it: a layer linear, or lit-gpt's LM head
    (:func:`quantized_lm_head`)."""
    return _stored_quantized(state.name, state.trainable, training)


class _TensorMaker:
    """Builds :class:`TensorState` rows for one training configuration, one per distinct
    (name, size, trainable, gradient) and copied per owner."""

    def __init__(self, training: TrainingConfig) -> None:
        self.training = training
        self.tp = training.tensor_parallel_size
        self.dp = training.sharding_degree  # HYBRID_SHARD: the shard group, not every rank
        self.stage = training.zero_stage if self.dp > 1 else 0
        self.cache: dict[tuple[str, int, int, bool, bool], TensorState] = {}
        # LoRA adapters may have their own dtype (peft: fp32 on a 16-bit base)
        # read for its dtypes only; context parallelism off, which pytorch-amp refuses below
        # ZeRO-3 (Note [Context parallelism needs FSDP over its ranks], specs/training.py)
        self.adapter_training = replace(
            training,
            precision="32-true",
            framework="pytorch-amp",
            grad_accum_dtype=None,
            context_parallel_size=1,
            load_dtype=None,
        )
        adapters = lora_adapter_dtype(training)
        if adapters == training.weight_dtype:
            self.adapter_training = training
        elif adapters == "bfloat16":  # TRL's cast (TrainingConfig.trl_bf16_adapters)
            self.adapter_training = replace(self.adapter_training, precision="bf16-true")
        # a trained copy TRL's cast left in bf16 (Note [peft modules_to_save]): its gradient
        # and AdamW moments in bf16 too (autograd and ``zeros_like(p)`` follow the parameter)
        self.bf16_training = self.adapter_training
        if training.trl_bf16_embeddings and saved_modules(training):
            self.bf16_training = replace(self.adapter_training, precision="bf16-true")
        self.flat = flat_parameter_grads(training)
        self.bf16: frozenset[str] = frozenset()
        """Tensors kept fp32 by peft's k-bit preparation but cast back to bf16
        (:func:`~trainmem.specs.frameworks.trl_bf16_tensors`)."""

    def __call__(
        self,
        owner: str,
        name: str,
        numel: int,
        out_features: int,
        trainable: bool,
        unit: bool = False,
    ) -> TensorState:
        """``unit``: the tensor's wrapped unit holds a trainable tensor (flat-parameter grads)."""
        with_grad = trainable or (self.flat and unit)
        key = (name, numel, out_features, trainable, with_grad)
        proto = self.cache.get(key)
        if proto is None:
            proto = self.cache[key] = self._build(name, numel, out_features, trainable, with_grad)
        return replace(proto, owner=owner)

    def _build(
        self, name: str, numel: int, out_features: int, trainable: bool, with_grad: bool
    ) -> TensorState:
        training = self.training
        adapter = name.startswith(_ADAPTERS)
        tr = self.adapter_training if adapter else training
        is_linear = not name.startswith(_NOT_LINEAR)
        w = dtype_bytes(tr.weight_dtype)
        if training.kbit_fp32_upcast and not is_linear and not adapter:
            # peft prepare_model_for_kbit_training: non-quantized params in fp32, but those
            # TRL's SFTTrainer casts back (TrainingConfig.trl_bf16_embeddings)
            w = 2 if name.removesuffix(ORIGINAL) in self.bf16 else 4
            if trainable and w == 2:  # a saved module's trained copy, cast back to bf16
                tr = self.bf16_training
        elif training.kbit_16bit_dense and not trainable and not adapter:
            w = dtype_bytes(training.kbit_dense_dtype)  # loaded in 16 bits, never upcast
        # Megatron tensor parallelism splits every layer linear (column / row parallel) and
        # the vocabulary (VocabParallelEmbedding, the output layer); norms are replicated.
        tp_split = is_linear or name in ("embedding/tokens", "lm_head")
        tp = self.tp
        local = -(-numel // tp) if tp_split else numel
        local_out = -(-out_features // tp) if tp_split and out_features > 1 else out_features
        stats = 0
        if _stored_quantized(name, trainable, training):  # is_quantized_base
            full_param = quantized_weight_bytes(local, local_out, training.quantize_base)
            full_param += torchao_factor_view_bytes(local, training)
            stats = unsharded_statistics_bytes(local, local_out, training, self.stage)
            full_param -= stats  # Note [bitsandbytes statistics under sharding]
        else:
            full_param = w * local
        full_grad = dtype_bytes(tr.grad_dtype) * local if with_grad else 0
        state = 0
        if trainable:
            # Note [Factored states of flat parameters]
            #     accelerate's and fsdp_qlora's FSDP1 (use_orig_params=False) hand the optimizer
            #     each unit's 1-D FlatParameter (shard), so Adafactor keeps a full second moment
            #     of it, not row and column vectors (transformers/optimization.py
            #     ``_get_options``: ``factored = len(param_shape) >= 2``; torch.optim.Adafactor
            #     likewise for a vector): one state element per trainable element. Seen in the
            #     trace of transformers' Adafactor under FSDP1 (1024-wide Llama). DeepSpeed's
            #     flat fp32 partitions likewise, and bitsandbytes quantizes every flat tensor
            #     (Note [Optimizer states of flat tensors] in analytic/model_states.py).
            if flat_optimizer_tensors(training):
                state = flat_state_bytes(tr, local, flat_numel=self._flat_numel(name, local))
            elif local_out > 1 and local % local_out == 0 and local > local_out:
                shape = [(local // local_out, local_out, 1)]
                state = optimizer_state_bytes(tr, shape, 0)
            else:
                state = optimizer_state_bytes(tr, [], local)
        param, grad, state = self._place(full_param, full_grad, state, local)
        param += stats
        if trainable and training.ema and training.ema_device == "cuda":
            param += ema_bytes_per_element(training, w) * local  # Note [EMA weights]
        paged = 0
        if trainable and state and OPTIMIZER_TABLE[training.optimizer].paged:
            shards = self.dp if training.optimizer_states_partitioned else 1
            paged = min(paged_state_bytes(training, local, shards), state)
            state -= paged
        return TensorState(
            "", name, numel, trainable, param, grad, state, full_param, full_grad, paged, local
        )

    def _flat_numel(self, name: str, local: int) -> int | None:
        """Elements of the flat tensor holding trainable ``name`` on this rank, when it is
        that tensor alone: a LoRA adapter under FSDP1, a unit of its own (peft's
        ``fsdp_auto_wrap_policy``), its shard; None for a flat tensor taken as large (Note
        [Optimizer states of flat tensors])."""
        if not (fsdp1_framework(self.training) and name.startswith("lora_")):
            return None
        return -(-local // self.dp) if self.training.optimizer_states_partitioned else local

    def _place(
        self, full_param: int, full_grad: int, state: int, local: int
    ) -> tuple[int, int, int]:
        """(param, grad, state) bytes left on this GPU after ZeRO / FSDP sharding and offload."""
        training, dp, stage = self.training, self.dp, self.stage
        param = -(-full_param // dp) if stage >= 3 else full_param
        grad = -(-full_grad // dp) if stage >= 2 else full_grad
        if training.optimizer_states_partitioned:  # ZeRO >= 1, DeepSpeed BF16_Optimizer
            state = -(-state // dp)
        off = offloaded(training, local)
        if off.state:
            state = 0
        if off.grad:
            grad = 0  # each layer's gradient leaves once reduced (the engine's reduce term)
        if off.param:
            param = 0
        return param, grad, state


@dataclass(frozen=True, slots=True)
class Offloaded:
    """Which of a tensor's model states ``--offload`` moves to the CPU (True: not on the GPU)."""

    param: bool
    grad: bool
    state: bool


def offloaded(training: TrainingConfig, local: int) -> Offloaded:
    """What CPU offload takes off the GPU for a tensor of ``local`` elements on this rank:
    optimizer states for every mode, the gradients with ``optimizer+gradients`` /
    ``optimizer+params``, the weights with ``optimizer+params``. torchao's
    ``CPUOffloadOptimizer`` keeps tensors under ``minimal_size`` (4096 elements) on the GPU
    (:data:`~trainmem.specs.frameworks.TORCHAO_OFFLOAD_MINIMAL_SIZE`; torchao
    optim/cpu_offload.py)."""
    on_gpu = training.torchao_cpu_offload and local < TORCHAO_OFFLOAD_MINIMAL_SIZE
    mode = "none" if on_gpu else training.offload
    return Offloaded(
        param=mode == "optimizer+params",
        grad=mode in ("optimizer+gradients", "optimizer+params"),
        state=mode != "none",
    )


@dataclass(frozen=True, slots=True)
class StateLayout:
    """The per-tensor table in compact form: the tensors before the layers, one layer's (owner
    ``layers.0``; every layer is the same), and the tensors after them. Bytes as TensorState."""

    embedding: list[TensorState]
    layer: list[TensorState]
    head: list[TensorState]
    num_layers: int
    #: schedule pieces that depend only on these states (built once per cached layout)
    cache: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def total(self, field: str) -> int:
        """Sum of one TensorState field (``param_bytes``, ``numel``...) over the whole model
        (cached: the engine asks for the same sums of every configuration sharing the layout)."""
        cached = self.cache.get(("total", field))
        if cached is None:
            outer: int = sum(getattr(s, field) for s in self.embedding + self.head)
            layer: int = sum(getattr(s, field) for s in self.layer)
            cached = self.cache[("total", field)] = outer + self.num_layers * layer
        return int(cached)

    def expand(self) -> list[TensorState]:
        """Every tensor, layer by layer, in module order."""
        out = list(self.embedding)
        for index in range(self.num_layers):
            owner = f"layers.{index}"
            out.extend(replace(s, owner=owner) for s in self.layer)
        return out + self.head


def tensor_states(model: ModelSpec, training: TrainingConfig) -> list[TensorState]:
    """Every parameter tensor of the model with its bytes on one GPU, in module order; see
    :func:`state_layout`."""
    return state_layout(model, training).expand()
