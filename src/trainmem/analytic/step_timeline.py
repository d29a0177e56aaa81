"""The analytic engine's allocation timeline: one event per tensor the closed-form model counts,
in the order a PyTorch training step allocates and frees them, for the allocator simulator.

Note [Analytic timeline]
    The closed form (``engine.py``) gives the bytes alive at each candidate peak; the caching
    allocator needs the order and the sizes of the blocks as well, because reserved memory depends
    on which freed blocks a later request can reuse. The timeline replays, from an empty device:

    * ``init``: every parameter tensor (:func:`~trainmem.analytic.tensor_states.tensor_states`);
    * ``steps`` training steps (3 by default: the first step's lazy optimizer-state
      allocation lands after the backward has filled the cache, as in a real run, and the cache
      reaches its fixed point by the third step; e.g. BERT-large b=4 fp32 reserves 9.29, 12.81,
      12.96, 12.96 GB after 1, 2, 3, 5 steps);
    * per micro-batch, ``forward``: the inputs and embedding terms, then per layer the saved
      terms of :func:`~trainmem.analytic.activations.layer_activation_terms` (under checkpointing
      the layer input is saved and the rest is allocated and freed), autocast weight copies, the
      head terms; the cuBLAS workspace at the first matmul of each thread (forward, backward);
    * ``backward``: the two fp32 (tokens x vocab) loss gradients, then layer by layer in reverse:
      recomputed terms, the layer's gradient transients, its parameter gradients (first
      micro-batch only: they accumulate afterwards), and the frees of its saved terms;
    * ``optimizer``: optimizer states (first step only, torch's lazy ``_init_group``), the step's
      temporaries (``foreach``: one list of per-parameter tensors alive together, as
      ``torch._foreach_sqrt``; ``for-loop``: one per parameter, freed before the next);
    * ``zero_grad``: gradients freed (``set_to_none=True``, the default since PyTorch 2.0), or
      kept zeroed for the next step (``zero_grad_set_to_none=False``).

    Each term is split into the single tensors it is made of (the largest natural tensor size
    that divides it: ``mlp/gated`` is four (t, i) tensors); a term that is not a multiple of one
    (LayerNorm input + statistics) stays one block.

Source: the step order of ``torch.optim.Optimizer.step`` / ``zero_grad`` (torch/optim/optimizer.py,
adam.py ``_init_group``, ``_multi_tensor_adam``), autograd's reverse-order layer backward, and
``getCurrentCUDABlasHandle`` creating one cuBLAS handle + workspace per thread
(aten/src/ATen/cuda/CublasHandlePool.cpp).
"""

from __future__ import annotations

from trainmem.analytic.activations import (
    activation_profile,
    autocast_cached_weight_bytes,
    autocast_weight_copy_bytes,
    backward_layer_transient_bytes,
    compute_and_residual_bytes,
    layer_is_checkpointed,
    loss_backward_transient_bytes,
    loss_forward_transient_bytes,
    tokens_per_sequence,
)
from trainmem.analytic.temporaries import optimizer_step_temporary_bytes
from trainmem.analytic.tensor_states import tensor_states
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import AllocEvent, Phase, Timeline


class _Recorder:
    """Appends alloc/free events with fresh block ids."""

    def __init__(self) -> None:
        self.events: list[AllocEvent] = []
        self.sizes: dict[int, tuple[int, Cat, str]] = {}
        self.next_id = 0
        self.phase: Phase = "init"

    def alloc(self, size: int, category: Cat, module: str = "") -> int:
        size = max(int(size), 0)
        block = self.next_id
        self.next_id += 1
        if size == 0:
            return -1
        self.sizes[block] = (size, category, module)
        self.events.append(AllocEvent("alloc", block, size, category, self.phase, module))
        return block

    def free(self, block: int) -> None:
        if block < 0:
            return
        size, category, module = self.sizes.pop(block)
        self.events.append(AllocEvent("free", block, size, category, self.phase, module))


def analytic_timeline(
    model: ModelSpec,
    training: TrainingConfig,
    *,
    cublas_workspace_bytes: int,
    steps: int = 3,
) -> Timeline:
    """Allocation timeline of ``steps`` training steps from an empty device.

    Args:
        model: the transformer's shape.
        training: the step's settings.
        cublas_workspace_bytes: workspace of one cuBLAS handle (one per thread that runs a
            matmul: the forward thread and autograd's backward thread).
        steps: training steps to replay (>= 1); see Note [Analytic timeline].

    Returns:
        The timeline; requested sizes in bytes.
    """
    rec = _Recorder()
    c, _ = compute_and_residual_bytes(training)
    states = tensor_states(model, training)
    for s in states:
        rec.alloc(s.param_bytes, Cat.PARAMETER, s.owner)

    prof = activation_profile(model, training)
    mode = training.activation_checkpointing
    if mode == "none":
        saved_terms = dict(prof.terms)
    elif mode == "selective" and training.attention == "eager":
        saved_terms = {k: v for k, v in prof.terms.items() if not k.startswith("scores/")}
    elif mode == "selective":  # op-level: matmul / SDPA outputs kept, the rest recomputed
        saved_terms = {"op_selective_saved": prof.per_layer}
    else:
        saved_terms = {"layer_input": prof.per_layer}
    if mode == "selective" and training.attention != "eager":
        dropped_terms = {"recomputed": prof.recompute}
    else:
        dropped_terms = {k: v for k, v in prof.terms.items() if k not in saved_terms}
    pieces = _tensor_sizes(model, training)
    saved_blocks = [size for v in saved_terms.values() for size in _split(v, pieces)]
    dropped_blocks = [size for v in dropped_terms.values() for size in _split(v, pieces)]
    weight_copy = autocast_weight_copy_bytes(model, training)
    cached_copy = autocast_cached_weight_bytes(model, training)  # issue 12: trainable leaves only
    loss_tmp = loss_backward_transient_bytes(model, training)
    loss_fwd = loss_forward_transient_bytes(model, training)
    layer_tmp = backward_layer_transient_bytes(model, training)
    trainable = [s for s in states if s.trainable]
    n_trainable = sum(s.numel for s in trainable)
    dp = training.sharding_degree  # issue 12: HYBRID_SHARD shards within its group
    sharded_states = training.zero_stage >= 1 and dp > 1
    opt_tmp_total = 0
    if training.offload == "none" and trainable:
        opt_tmp_total = optimizer_step_temporary_bytes(
            training,
            num_trainable_parameters=-(-n_trainable // dp) if sharded_states else n_trainable,
            largest_parameter=max(s.numel for s in trainable),
        )
    grad_sizes: dict[str, list[int]] = {}
    for s in states:
        if s.grad_bytes:
            # a tied input embedding first receives its gradient from the LM head's backward
            tied = model.tie_word_embeddings and s.name == "embedding/tokens"
            grad_sizes.setdefault("head" if tied else s.owner, []).append(s.grad_bytes)
    opt_tensors = [(s.owner, -(-s.numel // dp) if sharded_states else s.numel) for s in trainable]

    grads: dict[str, list[int]] = {}
    workspaces: list[int] = []
    steady_state_start = 0
    for step in range(steps):
        steady_state_start = len(rec.events)
        for _micro in range(training.gradient_accumulation_steps):
            rec.phase = "forward"
            if not workspaces:
                workspaces.append(rec.alloc(cublas_workspace_bytes, Cat.TEMPORARY, "cublas"))
            emb = [
                rec.alloc(v, Cat.ACTIVATION, "embedding")
                for k, v in prof.head_terms.items()
                if k in _EMBEDDING_TERMS
            ]
            layer_blocks: list[list[int]] = []
            copies: list[int] = []
            for layer in range(model.num_layers):
                name = f"layers.{layer}"
                if cached_copy and layer_is_checkpointed(training):
                    copies.append(rec.alloc(cached_copy, Cat.ACTIVATION, name))
                kept = [rec.alloc(v, Cat.ACTIVATION, name) for v in saved_blocks]
                dropped = [rec.alloc(v, Cat.TEMPORARY, name) for v in dropped_blocks]
                for b in dropped:
                    rec.free(b)
                layer_blocks.append(kept)
            logits = rec.alloc(loss_fwd, Cat.TEMPORARY, "head")
            head = [
                rec.alloc(v, Cat.ACTIVATION, "head")
                for k, v in prof.head_terms.items()
                if k not in _EMBEDDING_TERMS
            ]
            rec.free(logits)
            for b in copies:  # autocast's weight cache is cleared when the forward region exits
                rec.free(b)

            rec.phase = "backward"
            if len(workspaces) < 2:
                workspaces.append(rec.alloc(cublas_workspace_bytes, Cat.TEMPORARY, "cublas"))
            g1 = rec.alloc(loss_tmp // 2, Cat.TEMPORARY, "loss")
            g2 = rec.alloc(loss_tmp - loss_tmp // 2, Cat.TEMPORARY, "loss")
            rec.free(g1)
            for b in head:
                rec.free(b)
            if "head" not in grads:
                grads["head"] = [
                    rec.alloc(g, Cat.GRADIENT, "head") for g in grad_sizes.get("head", [])
                ]
            rec.free(g2)
            for layer in reversed(range(model.num_layers)):
                name = f"layers.{layer}"
                recomputed = [rec.alloc(v, Cat.ACTIVATION, name) for v in dropped_blocks]
                if weight_copy and layer_is_checkpointed(training):
                    recomputed.append(rec.alloc(weight_copy, Cat.ACTIVATION, name))
                tmp = rec.alloc(layer_tmp, Cat.TEMPORARY, name)
                if name not in grads:
                    grads[name] = [
                        rec.alloc(g, Cat.GRADIENT, name) for g in grad_sizes.get(name, [])
                    ]
                rec.free(tmp)
                for b in recomputed + layer_blocks[layer]:
                    rec.free(b)
            if "embedding" not in grads:
                grads["embedding"] = [
                    rec.alloc(g, Cat.GRADIENT, "embedding") for g in grad_sizes.get("embedding", [])
                ]
            for b in emb:
                rec.free(b)

        rec.phase = "optimizer"
        if step == 0:
            for s in states:
                rec.alloc(s.state_bytes, Cat.OPTIMIZER_STATE, s.owner)
        _optimizer_temporaries(rec, training, opt_tensors, opt_tmp_total)
        rec.phase = "zero_grad"
        if training.zero_grad_set_to_none:
            for blocks in grads.values():
                for b in blocks:
                    rec.free(b)
            grads = {}
    return Timeline(
        events=rec.events, name=f"{model.name} (analytic)", steady_state_start=steady_state_start
    )


def _tensor_sizes(model: ModelSpec, training: TrainingConfig) -> list[int]:
    """Sizes of the single tensors a layer's terms are made of, largest first: (t, i) and
    (t, h) activations in the compute, residual and fp32 dtypes, (b, a, s, s) scores, masks."""
    t = training.micro_batch_size * tokens_per_sequence(model, training)
    s, b = tokens_per_sequence(model, training), training.micro_batch_size
    c, r = compute_and_residual_bytes(training)
    k_top = model.num_experts_per_tok if model.num_experts > 1 else 1
    i, h = model.intermediate_size * k_top, model.hidden_size
    kv = model.num_kv_heads * model.head_dim
    sizes = {n * t for n in (4 * i, c * i, i, 4 * h, r * h, c * h, h, c * kv)}
    sizes |= {n * model.num_heads * s * s * b for n in (4, c, 1)}
    return sorted((x for x in sizes if x > 0), reverse=True)


def _split(term_bytes: int, sizes: list[int]) -> list[int]:
    """A term as the tensors it is made of: the largest single-tensor size that divides it,
    repeated; the term as one block if none does (e.g. LayerNorm input + statistics)."""
    for size in sizes:
        if term_bytes >= size and term_bytes % size == 0:
            return [size] * (term_bytes // size)
    return [term_bytes]


_EMBEDDING_TERMS = frozenset(
    {
        "inputs/token_ids_and_labels",
        "inputs/pixel_values",
        "rotary_cos_sin",
        "embedding_norm",
        "embedding_dropout_mask",
    }
)


def _optimizer_temporaries(
    rec: _Recorder,
    training: TrainingConfig,
    tensors: list[tuple[str, int]],
    total: int,
) -> None:
    """Temporaries of the optimizer step: all at once for ``foreach``, one at a time for the
    per-parameter loop, none for ``fused``. See :mod:`trainmem.analytic.temporaries`."""
    n_params = sum(n for _, n in tensors)
    if total <= 0 or n_params == 0:
        return
    if training.step_implementation == "foreach":
        per = total / n_params
        blocks = [rec.alloc(round(per * n), Cat.TEMPORARY, owner) for owner, n in tensors]
        for b in blocks:
            rec.free(b)
        return
    largest = max(n for _, n in tensors)
    for owner, n in tensors:
        rec.free(rec.alloc(round(total * n / largest), Cat.TEMPORARY, owner))
