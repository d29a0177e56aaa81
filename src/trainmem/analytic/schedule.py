"""The analytic engine's step schedule: every tensor the cited formulas count, in the order a
PyTorch training step allocates and frees it, for one rank.

This module is the base order (issue 25): the plain autograd order of one layer and of the
head (forward, loss, backward, optimizer step, ``zero_grad``), which at each named point
(:mod:`~trainmem.analytic.transforms.points`) emits the ops of the rank's active transforms,
one per mechanism (:mod:`trainmem.analytic.transforms`: ZeRO / FSDP, FSDP2's gradient release,
FSDP under pipelining, DeepSpeed, pipelining, activation offloading, quantized bases, the
optimizer, the loop's conventions).

Note [Analytic step schedule]
    One :class:`~trainmem.schedule.StepSchedule` per distinct rank (Note [One description of
    the step]); its ``peak()`` is the analytic estimate and its expansion is what the allocator
    simulator replays. Identical layers are one ``Repeat``; identical micro-batches another.

    * setup: every parameter tensor (:mod:`~trainmem.analytic.tensor_states`), then warm-up
      steps (the first step allocates the optimizer states lazily after its backward, torch's
      ``_init_group``, and the cuBLAS workspaces at the first matmul of each thread; the caching
      allocator's cache reaches its fixed point by the third step: BERT-large b=4 fp32 reserves
      9.29, 12.81, 12.96, 12.96 GB after 1, 2, 3, 5 steps);
    * per micro-batch, ``forward``: ZeRO-3 / FSDP gathered parameters (the current and the
      prefetched layer, Rajbhandari et al. 2020 sec. 5.3; FSDP ``forward_prefetch``; the root
      module's stay gathered, ``reshard_after_forward=False`` on the root), the activations of
      the other micro-batches a pipeline stage holds (Korthikanti et al. 2022 sec. 4.2.3), the
      embedding terms, per layer the saved terms of
      :func:`~trainmem.analytic.activations.layer_activation_terms` (under checkpointing the
      layer input is saved and the rest allocated and freed), autocast's cached 16-bit weight
      copies (held until the autocast region exits), the dequantized weight of a quantized base
      (bitsandbytes ``MatMul4Bit``, one at a time), the logits while the loss runs, the head
      terms; with activation offloading the layer before the current one leaves for the CPU
      (torchtune ``OffloadActivations``: the current and the prefetched layer stay);
    * ``backward``: the two fp32 (tokens x vocab) log-softmax gradients, the residual-stream
      gradient, then layer by layer in reverse: recomputed terms, the MLP's backward
      transients, the MLP's saved tensors freed, eager attention's backward transients, the
      layer's gradients (first micro-batch of the step; later ones accumulate into them), the
      unsharded gradient bucket before its reduce-scatter (ZeRO-2/3, gradient offload), the rest
      of the layer's saved tensors freed; with ``optimizer_in_backward`` each layer's gradients
      are stepped and freed at once;
    * ``optimizer``: the step's temporaries (``foreach``: one per-parameter list alive together,
      ``torch._foreach_*``; ``for-loop``: one parameter at a time; ``fused``: none);
    * ``zero_grad``: gradients freed (``set_to_none=True``, the default since PyTorch 2.0) or
      kept for the next step.

    Each term is split into the single tensors it is made of (the largest natural tensor size
    that divides it), so the allocator sees realistic block sizes; the head's saved tensors are
    one block per term (the final norm's, the LM head's input, the loss's saved log-softmax,
    autocast's copy of the head weight), not their sum: one (tokens x vocab) block larger than
    any other would take a segment of its own that no later tensor fits.

Note [Tied embedding gradient under DTensor]
    With the token embedding vocabulary-sharded by DTensor and tied to the LM head
    (``dtensor_vocab_parallel_embedding``; torchtitan's ``RowwiseParallel`` on the embedding,
    ``ColwiseParallel`` on the head), the lookup's weight gradient is computed for the whole
    vocabulary ([V, h] in the dtype of the weight it reads, as untied: bf16 gathered under
    torchtitan's policy, the fp32 weight under autocast, which does not cast embeddings); to add
    it to the head's gradient, sharded ``Shard(0)`` over the vocabulary, DTensor redistributes
    it to that placement, a local chunk cloned (torch/distributed/tensor/placement_types.py
    ``Shard._replicate_to_shard``: ``clone=True``), and autograd adds the two out of place,
    since a tensor subclass is never accumulated in place (torch/csrc/autograd/input_buffer.cpp
    ``accumulate``: ``can_accumulate_inplace`` is false for ``isTensorSubclassLike``). At that
    moment the whole-vocabulary gradient, the clone and the sum, each [V / t, h], and the
    head's gradient are alive; the sum then replaces the head's gradient (Note [FSDP2 root
    group]). Seen in the trace of llama-3.2-1b (tied) FSDP 2 x TP 2 + SP with full activation
    checkpointing, whose peak it is.

Source: torch/optim/optimizer.py, adam.py ``_init_group`` / ``_multi_tensor_adam``; autograd's
reverse-order backward; ATen/cuda/CublasHandlePool.cpp (one workspace per handle); the papers
cited per term in :mod:`trainmem.analytic.activations` and :mod:`trainmem.analytic.engine`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import lru_cache

from trainmem.analytic.activation_parallelism import (
    GATHERED_INPUT_TERMS,
    sequence_parallel_copies,
)
from trainmem.analytic.activations import ActivationProfile
from trainmem.analytic.attention import (
    eager_scores_forward_bytes,
    written_out_scores_forward_tensors,
)
from trainmem.analytic.backward_transients import (
    WRITTEN_OUT_SOFTMAX_BACKWARD_TENSORS,
    backward_layer_transients,
    down_backward_before_recompute,
    mlp_backward_parts,
    recompute_holds_down_copy,
    recompute_runs_down_forward,
    reentrant_recompute_runs_down,
)
from trainmem.analytic.buffers import ROPE_BUFFERS_KEY, layer_rope_cache_bytes
from trainmem.analytic.checkpointing import input_grad_hook_bytes, layer_is_checkpointed
from trainmem.analytic.float8 import float8_linears_save_input
from trainmem.analytic.forward_transients import (
    down_projection_held_bytes,
    recompute_down_held_bytes,
    recompute_gradient_cast_bytes,
    recompute_up_held_bytes,
)
from trainmem.analytic.head import (
    FINAL_RMSNORM_BACKWARD_TENSORS,
    final_hidden_transient_bytes,
    final_norm_backward_bytes,
    head_matmul_backward_parts,
    layer_norm_backward_bytes,
)
from trainmem.analytic.load import load_items, load_rule
from trainmem.analytic.lora import lora_adapter_dtype
from trainmem.analytic.lora_variants import (
    INPUT_PROJECTIONS,
    O_LINEARS,
    UP_LINEARS,
    UP_OWN_TERMS,
    dora_down_after_moment,
    dora_down_moment_in_forward,
    dora_moments_per_linear,
    dora_up_combination_bytes,
)
from trainmem.analytic.loss import (
    accelerate_output_bytes,
    chunked_head_weight_grad_bytes,
    chunked_loss_gradient_bytes,
    loss_backward_tensors,
    loss_backward_transient_bytes,
    loss_forward_transient_bytes,
    model_upcast_logits_bytes,
    shifted_copy_bytes,
    upcast_logits_bytes,
)
from trainmem.analytic.pipeline import logits_bytes
from trainmem.analytic.prompt_encoder import prompted_inputs_held_bytes
from trainmem.analytic.tensor_states import StateLayout
from trainmem.analytic.transforms import active
from trainmem.analytic.transforms.base import (
    ALL_GATHER_STREAM,
    REDUCE_SCATTER_STREAM,
    Emitter,
    Group,
    PipelineRank,
    RankContext,
    Transform,
    Where,
    alloc,
    embedding_gradients,
    free,
    gradient_ops,
    gradient_places,
    head_reads_embedding,
    layer_parameter_ops,
    outer_parameter_ops,
    point_table,
    tied_sum_op,
    unit_states,
)
from trainmem.analytic.transforms.checkpointing import (
    DORA_DOWN,
    DOWN_DROPOUT,
    WEIGHT_COPIES,
    LayerPlan,
    adapter_copy_blocks,
    cache_release_places,
    cached_down_output,
    dropped_per_layer_kind,
    first_norm_saves_its_input,
    layer_plan,
    saved_ops,
    saved_per_stack_block,
    split,
    tensor_sizes,
    weight_blocks,
)
from trainmem.analytic.transforms.deepspeed_init import deepspeed_flat_buffers
from trainmem.analytic.transforms.loop import (
    layer_kv_cache_bytes,
    returned_presents_bytes_of,
    zero_grad_policy,
)
from trainmem.analytic.transforms.reentrant import KEY as REENTRANT_OUTPUT_KEY
from trainmem.analytic.transforms.sharding import group_states
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Item, Op, Repeat, StepSchedule
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes

__all__ = ["ALL_GATHER_STREAM", "REDUCE_SCATTER_STREAM", "PipelineRank", "rank_schedule"]

_tensor_sizes = tensor_sizes  # the tests' name for it
_split = split

RELEASED_BEFORE_SOFTMAX_BACKWARD = frozenset(
    {
        "attention/out_proj_input",
        "scores/probs_for_values",
        "scores/dropout_mask",
        "attention/v",
        "attention/output_norm",
    }
)
"""Eager attention terms whose saving op runs its backward before the softmax's.

Note [Eager attention's backward order]
    Eager attention is ``o_proj(matmul(dropout(softmax(q k^T).to(c)), v))`` (transformers
    modeling_llama.py ``eager_attention_forward``). Backward runs o_proj's, the value matmul's,
    dropout's and the cast's nodes before the softmax's, and autograd releases a node's saved
    tensors as soon as it has run (torch/csrc/autograd/engine.cpp ``call_function``:
    ``fn.release_variables()`` when the graph is not retained). So the o_proj input, the
    probabilities fed to the value matmul, the dropout mask and v are gone when the softmax
    backward's two score-sized transients are live; q and k (the score matmul's) and the
    softmax output stay. A norm on the attention's output (Gemma-2/3
    ``post_attention_layernorm``) runs its backward before all of them. Checked against the
    trace engine (tiny-llama-test, bf16-mixed, eager, b=2, s=2048: the backward peak fell from
    10.6 % over the trace to 0.0 %) and a real GPU's snapshot (S003 of
    ../shared/validation/snapshots, benchmarks/snapshot_analytic_step.py)."""

WARMUP_STEPS = 1
"""Steps replayed before the measured one (Note [Analytic step schedule])."""


class _Transforms:
    """The rank's active transforms and the answers the base order asks of them."""

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx
        self.all: list[Transform] = active(ctx)
        self.in_backward = any(t.steps_in_backward for t in self.all)
        self.held_logits = sum(t.held_logits for t in self.all)
        self.held_cache = sum(t.held_cache for t in self.all)
        self.balanced = all(t.balanced_micro_batches for t in self.all)
        self.reduces_last = any(t.reduces_last_micro_batch for t in self.all)
        self.keeps_root = any(t.keeps_root_gradients for t in self.all)
        self.layer_position = frozenset().union(*(t.layer_position for t in self.all))
        vocab = embedding_gradients(ctx).vocab
        for t in self.all:
            vocab = t.vocab_gradient_bytes(vocab)
        self.vocab_grad = vocab
        tied = embedding_gradients(ctx).tied_sum
        for t in self.all:
            tied = t.tied_sum_bytes(tied)
        self.tied_sum = tied
        self.table = point_table(self.all)

    def emitter(self) -> Emitter:
        return Emitter(self.all, self.table)

    def gradients(self, group: Group, where: Where) -> list[Op]:
        """The ops that make ``group``'s gradients: the first transform's that answers, else
        this rank's gradients on the first micro-batch of the step, and on a later one each
        new gradient made, added into the kept one and freed (:func:`_accumulated`).

        Note [New gradients of the head and the embedding]
            Every parameter's ``AccumulateGrad`` runs in every micro-batch, and with ``.grad``
            defined it adds the incoming gradient into it in place and drops it (torch 2.13
            torch/csrc/autograd/functions/accumulate_grad.h ``accumulateGrad``: ``variable_grad
            += new_grad``), so a later micro-batch makes the output layer's and the token
            embedding's new gradients as it makes the layers' (before, only the layers' and,
            Megatron's, those two were made: Note [Megatron's new 16-bit gradients]). A
            weight the head and the lookup share has one ``AccumulateGrad``, run once both
            gradients are in its input buffer (torch/csrc/autograd/input_buffer.cpp
            ``accumulate``): the head's new gradient waits there from the head's backward to
            the embedding's (:meth:`_tied_places`), and the lookup's gradient
            (``embedding_dense_backward``, the weight's dtype) is a transient of every
            micro-batch, added in place into the head's when that is a fresh contiguous
            tensor (``can_accumulate_inplace``: the fp32 cast of an autocast head's 16-bit
            gradient, a chunked head's out-of-place sum of its chunks' gradients: Note
            [Chunked head's first weight-gradient sum]), else summed out of place (the
            transposed output of the head's matmul backward: bf16-true, 32-true), the sum
            becoming the gradient
            (:func:`~trainmem.analytic.transforms.base.embedding_gradients`). Checked on torch
            2.13 CPU with the profiler's memory (a tied 4096 x 256 embedding, two backwards):
            ``embedding_dense_backward`` allocates the weight's bytes and ``aten::add``
            another weight's bytes under bf16-true, ``aten::add_`` nothing under bf16 autocast.
            A classification head never reads the word embedding (transformers
            ``BertForSequenceClassification``), though the layout puts a tied one with the head
            (``RankContext.build``): its new gradient is made by the lookup alone, at the
            embedding's backward. Generic vs formulas (generic / analytic - 1), a 2-layer
            2048-wide Llama, vocabulary 32,000, 2 x 256 tokens, accumulation 4, tied:
            bf16-true +5.2 -> -0.01 %, Megatron +4.5 -> -0.01 %, ZeRO-1 +4.1 -> -0.01 %
            (docs/formulas.md for the others); Llama-3.2-1B (tied), bf16 autocast, fused AdamW,
            2 x 256, no accumulation: +5.1 -> +0.02 % (the lookup's 1.05 GB fp32 gradient at
            the embedding's backward beside every gradient)."""
        made = self._answered(group, where)
        if made is not None:
            return made
        if where.new_grads:
            return self._base_gradients(group)
        # Note [New gradients of the head and the embedding]
        training = self.ctx.training
        tied = self._tied_places(where)
        if group == "embedding":  # the tied weight's, held since the head's backward, or made here
            news = [_accumulated(g, training) for g in self._waiting(tied)]
            made = [op for g in self._base_gradients(group) for op in _accumulated(g, training)]
            return made + [op for pair, k in zip(news, tied, strict=True) for op in pair[2 - k :]]
        if group == "head":
            news = [_accumulated(g, training) for g in self._waiting(tied)]
            return [op for pair, k in zip(news, tied, strict=True) for op in pair[: 2 - k]]
        news = [_accumulated(g, training) for g in self._base_gradients(group)]
        return [op for pair in news for op in pair]

    def _waiting(self, tied: list[int]) -> list[Op]:
        """The head's gradient ops, a tied weight's that waits in autograd's input buffer
        (``tied`` 1: :meth:`_tied_places`) as autograd makes it, this rank's whole
        tensor-parallel slice (``TensorState.full_grad_bytes``), not the partition ZeRO-2
        keeps.

        Note [A tied gradient under DeepSpeed ZeRO-2/3]
            DeepSpeed partitions a gradient in a hook that runs after the parameter's
            ``AccumulateGrad`` (v0.16.4 runtime/zero/stage_1_and_2.py
            ``create_reduce_and_remove_grad_hooks``: ``grad_acc.register_hook``; stage3.py
            through utils/torch.py ``register_grad_hook``:
            ``param.register_post_accumulate_grad_hook``), and a tied weight's
            ``AccumulateGrad`` runs once the lookup's gradient has joined the head's in its
            input buffer (torch/csrc/autograd/input_buffer.cpp ``accumulate``). So the head's
            gradient waits there whole, [V, h] in the gradient dtype, from the head's backward
            to the embedding's, beside the lookup's gradient and their out-of-place sum, on
            ZeRO-3 as on ZeRO-2 (whose formulas sized it as the partition, and on ZeRO-3 had
            neither the lookup's gradient nor the sum). Traced (the generic path) on the 2-layer
            2048-wide Llama, vocabulary 32,000, tied, bf16, 2 x 256, accumulation 4, ZeRO over 4
            ranks: three 125 MiB gradients at the sum, ZeRO-2 and ZeRO-3 alike.
        """
        ops = self._base_gradients("head")
        states = self.ctx.head_grad_states
        return [
            op._replace(size_bytes=s.full_grad_bytes) if k == 1 and op.size_bytes else op
            for op, s, k in zip(ops, states, tied, strict=False)
        ]

    def _tied_places(self, where: Where) -> list[int]:
        """Per head gradient op, how many of a later micro-batch's new gradient's two ops (its
        alloc, its free) the embedding's backward makes instead of the head's (Note [New
        gradients of the head and the embedding]): 1, the free, for a weight the head and the
        lookup on this rank share (it waits for the lookup's gradient); 2, both, for the token
        embedding the layout puts with a head that does not read it (a classification head
        over ``tie_word_embeddings``: only the lookup makes its gradient); 0 otherwise, and
        unless the base order makes both groups' gradients."""
        ctx = self.ctx
        states = ctx.head_grad_states
        ops = self._base_gradients("head")
        if (
            not embedding_gradients(ctx).tied_lookup
            or len(ops) != len(states)
            or self._answered("head", where) is not None
            or self._answered("embedding", where) is not None
        ):
            return [0] * len(ops)
        k = 1 if head_reads_embedding(ctx) else 2
        return [k if s.name == "embedding/tokens" else 0 for s in states]

    def layer_gradients(self, where: Where) -> tuple[list[Op], list[Op], list[Op], list[Op]]:
        """The layer's gradient ops in the four places its backward makes them (Note
        [Gradients where their linear's backward runs]): the MLP's output projection's, the
        rest of the MLP's, the attention's output projection's, the rest (attention, norms,
        biases). A transform that answers for the layer makes all of them at the first, or,
        when it says so (``places_layer_gradients``: the same number of ops per layer tensor,
        in the tensors' order), each tensor's at its place."""
        names = [s.name for s in self.ctx.layer_states]
        for t in self.all:
            made = t.gradients("layer", where)
            if made is None:
                continue
            if not t.places_layer_gradients:
                return list(made), [], [], []
            # the same number of ops per layer tensor, in the tensors' order
            per = len(made) // max(len(names), 1)
            return _placed(list(made), gradient_places(_repeated(names, per)))
        ops = self._base_gradients("layer")
        # Note [FSDP1 flat blocks of a layer unit]: one sharded gradient for the whole unit,
        # made by its reduce-scatter at the layer's end
        flat = len(ops) < len(self.ctx.layer_states)
        if not where.new_grads:  # a later micro-batch's, added in place into the kept ones
            ops = [op for g in ops for op in _accumulated(g, self.ctx.training)]
        if flat:
            return [], [], [], ops
        return _placed(ops, gradient_places(_repeated(names, 1 if where.new_grads else 2)))

    def _answered(self, group: Group, where: Where) -> list[Op] | None:
        for t in self.all:
            made = t.gradients(group, where)
            if made is not None:
                return list(made)
        return None

    def _base_gradients(self, group: Group) -> list[Op]:
        # the same ops for every configuration of these model states (the shared pieces)
        cached = self.ctx.shared.get(("gradients", group))
        if cached is None:
            states, key, module = group_states(self.ctx, group)
            made = gradient_ops(self.ctx, states, "backward", key, module)
            cached = self.ctx.shared[("gradients", group)] = tuple(made)
        return list(cached)


_Places = tuple[list[Op], list[Op], list[Op], list[Op]]


def _placed(ops: list[Op], places: tuple[int, ...]) -> _Places:
    """``ops`` split into the four places of a layer's backward (``places[n]`` is ``ops[n]``'s:
    :func:`~trainmem.analytic.transforms.base.gradient_places`)."""
    out: _Places = ([], [], [], [])
    for op, place in zip(ops, places, strict=True):
        out[place].append(op)
    return out


def megatron_new_gradients(training: TrainingConfig) -> bool:
    """Every micro-batch's new gradients are 16-bit temporaries added into Megatron's fp32
    buffer (Note [Megatron's new 16-bit gradients])."""
    t = training
    return t.master_weights and t.conventions.fp32_grad_buffer and not t.is_lora


def _accumulated(grad: Op, training: TrainingConfig) -> tuple[Op, Op]:
    """A later micro-batch's new gradient of ``grad``'s tensor: made as the first one is, then
    added into the kept ``.grad`` in place and freed (accumulate_grad.h ``accumulateGrad``: a
    defined ``variable_grad`` takes ``variable_grad += new_grad``; Note [Gradients where their
    linear's backward runs]).

    Note [Megatron's new 16-bit gradients]
        Under Megatron the kept gradient is the fp32 ``main_grad`` (a view into the gradient
        buffer), but autograd makes each new gradient in its parameter's dtype, 16-bit
        (``AccumulateGrad`` sets ``param.grad``; megatron-core 0.9.0 megatron/core/distributed/
        distributed_data_parallel.py ``_make_backward_post_hook``: ``param.main_grad.add_(
        param.grad.data)``, then ``param.grad = None``), so the temporary is the weight's
        bytes, not the fp32 gradient's (``FrameworkConventions.fp32_grad_buffer`` with master
        weights; LoRA runs, whose adapters keep their own dtype, are left as they were). The
        embedding's and the output layer's are made and dropped the same way in every
        micro-batch (:meth:`gradients`; other frameworks' later micro-batches leave them out
        still). Seen on the generic path's traced step (trainmem/traced_megatron.py): the down
        projection's new gradient is 22 MiB in bf16 on the 2048-wide agreement Llama, where
        the formulas had 44 MiB, and Qwen-7B's output layer's 1.16 GiB bf16 gradient, after
        the loss's backward, set the traced peak (+1.2 % above the formulas without it)."""
    size = grad.size_bytes
    if megatron_new_gradients(training):
        size = size * dtype_bytes(training.weight_dtype) // dtype_bytes(training.grad_dtype)
    new = grad._replace(
        size_bytes=size,
        category=Cat.TEMPORARY,
        key=grad.key.replace("grad/", "new_grad/", 1),
        label="a later micro-batch's new gradient before it is added into the kept one",
    )
    return new, free(new, "backward")


def _repeated(names: list[str], k: int) -> tuple[str, ...]:
    """Each of ``names`` ``k`` times in turn (the names of ``k`` ops per tensor)."""
    return tuple(name for name in names for _ in range(k))


def _layer_loop(
    body: Callable[[Where, int], tuple[Item, ...]],
    n: int,
    *,
    reverse: bool,
    position: frozenset[str],
    kinds: Sequence[int] = (),
) -> list[Item]:
    """``n`` layers in execution order (down from ``n - 1`` when ``reverse``), each run of
    consecutive layers whose bodies are the same as one ``Repeat``: a body differs only at the
    first and the last layer run (``Where.first_layer`` / ``last_layer``), where a transform's
    ``position`` says so, and by the layer's kind (``kinds[index]``, an index into the
    layer's bodies; () for one kind: Note [Layer bodies per attention kind])."""
    if n <= 0:
        return []
    if not position and not kinds:
        return [Repeat(body(Where(), 0), n, reverse=reverse)]
    made: dict[tuple[bool, bool, int], tuple[Item, ...]] = {}
    # (body, count, lowest index) per run of equal bodies in execution order
    runs: list[tuple[tuple[Item, ...], int, int]] = []
    for k in range(n):  # k: the execution position
        index = n - 1 - k if reverse else k
        key = ("first" in position and k == 0, "last" in position and k == n - 1,
               kinds[index] if kinds else 0)  # fmt: skip
        if key not in made:
            made[key] = body(Where(first_layer=key[0], last_layer=key[1]), key[2])
        same = made[key]
        if runs and (runs[-1][0] is same or runs[-1][0] == same):
            runs[-1] = (same, runs[-1][1] + 1, min(runs[-1][2], index))
        else:
            runs.append((same, 1, index))
    return [
        Repeat(same, count, reverse=reverse and count > 1, start=start)
        for same, count, start in runs
    ]


@lru_cache(maxsize=1024)
def _release_groups(
    terms: tuple[str, ...], eager: bool, pre_norm: bool = False, autocast: bool = True
) -> tuple[int, ...]:
    """Per block term of a layer, the group its backward frees it in: 0, the MLP's down projection
    input (its backward runs first) and a Qwen2-MoE block's sigmoid gate path (Note [Qwen2-MoE's
    shared expert around the routed experts' backward]); 1, the rest of the MLP's before the MLP's
    other weight gradients are made; 4, after them (Note [Gradients where their linear's backward
    runs]: a pre-norm block's MLP norm, whose backward follows the MLP's, and without autocast the
    MLP's input, saved by its linears and released only when their backward, which makes their
    weight gradients, has run); 2, those released before eager attention's softmax backward (Note
    [Eager attention's backward order]); 3, the others (cached: the same names for every
    configuration of a model and setting)."""
    out = []
    for term in terms:
        if term in ("mlp/down_input", "mlp/shared_expert_gate"):
            # Note [Qwen2-MoE's shared expert around the routed experts' backward]
            out.append(0)
        elif (pre_norm and term == "mlp/norm") or (not autocast and term == "mlp/input"):
            out.append(4)
        elif term.startswith("mlp/"):
            out.append(1)
        elif eager and term in RELEASED_BEFORE_SOFTMAX_BACKWARD:
            out.append(2)
        else:
            out.append(3)
    return tuple(out)


@lru_cache(maxsize=1024)
def _norm_keys(names: tuple[str, ...], term: str, prefix: str) -> frozenset[str]:
    """The keys (``prefix`` + index) of the blocks of ``term`` among a layer's blocks
    ``names`` (cached: the same names for every configuration of a model and setting)."""
    return frozenset(f"{prefix}{n}" for n, name in enumerate(names) if name == term)


def _weight_copy_places(model: ModelSpec, n: int) -> tuple[int, ...]:
    """The release groups (:func:`_release_groups`) of a layer's ``n`` saved 16-bit weight
    copies (autocast's, :func:`~trainmem.analytic.transforms.checkpointing.weight_blocks`'
    order: q, k, v, o, the MLP's linears per expert, the router): each is saved by its linear
    and released when that linear's backward has run (Note [Gradients where their linear's
    backward runs]): the down projections' with the MLP's first group, the rest of the MLP's
    with its second, o's before the attention's core backward, q, k and v's last (LoRA's
    first layer keeps none of q, k and v's: Note [LoRA's first layer]). Copies not split per
    linear (one block) are released last, as before."""
    e = model.num_experts
    n_mlp = (3 if model.mlp_kind == "gated" else 2) * e
    router = 1 if e > 1 else 0
    mlp = (1,) * (n_mlp - e) + (0,) * e + (1,) * router
    for attention in ((3, 3, 3, 2), (2,)):  # q, k, v, o; o alone (LoRA's first layer)
        if n == len(attention) + n_mlp + router:
            return attention + mlp
        if n == len(attention) + n_mlp + router + 1:  # LoRA's adapters' copies, released last
            return (*attention, *mlp, 3)
    return (3,) * n


AFTER_DOWN_MOMENT = frozenset({"lora/down", "dora/down", "mlp/down_input"})
"""The terms of a layer with DoRA on its down projection that the recompute makes after down's
DoRA moment.

Note [What down's DoRA moment precedes]
    Down's DoRA moment (its weight norm, peft 0.21.2 tuners/lora/dora.py
    ``DoraLinearLayer.forward``: ``get_lora_weight`` and ``get_weight_norm``) comes before
    ``lora_result = lora_B(lora_A(x))``, and so before ``lora_A``'s saved 16-bit copy of its
    input (``mlp/down_input``), ``lora_A``'s output (``lora/down``) and DoRA's saved tensors
    (``dora/down``: ``lora_result``, ``mag_norm_scale``, ``mag_norm_scale - 1``; the norm is
    taken there; ``base_result``, down's base output, is held at the moment by
    :func:`~trainmem.analytic.lora_variants.dora_recompute_down_held_bytes` unless the
    selective cache keeps it). Under Note [DoRA's moment at each linear] the recompute makes
    them after that moment, and so does the forward without checkpointing (Note [DoRA's down
    moment in the forward], where the terms are :func:`~trainmem.analytic.lora_variants.
    dora_down_after_moment`'s). Traced on the 1024-wide
    agreement Llama (2 x 256 tokens, DoRA r 16 on down): at layer 1's recomputed down moment
    the trace holds down's input ``act(gate) * up`` and peft's fp32 cast of it, not the 16-bit
    copy; with these blocks made before it and the gradients of Note [DoRA's output gradient
    before the recompute] the formulas were -1.80 % (full) / -1.00 % (selective), after it
    +0.00 % / +0.00 %.
"""


def _copy_groups(n: int, up_combine: bool = False) -> list[int]:
    """Per weight copy of a layer (:func:`~trainmem.analytic.transforms.checkpointing.
    weight_blocks`' order: q, k, v, o, gate, up, down, then the adapters' block; without q, k
    and v in LoRA's first layer) whether it is made before o's DoRA moment (0), between o's and
    up's (1) or after up's (2); one unsplit block goes first."""
    attention = {7: 4, 8: 4, 4: 1, 5: 1}.get(n)
    if attention is None:
        return [0] * n
    late = 4 if up_combine else 2  # after up's output combination (down's copy)
    return [0] * attention + [1, 1] + [late] * (n - attention - 2)


def _linear_groups(
    names: Sequence[str],
    up_input: bool = False,
    down_after: bool = False,
    after: frozenset[str] = AFTER_DOWN_MOMENT,
    up_combine: bool = False,
) -> list[int]:
    """Per block of a layer (its term names, in the plan's order) whether the layer makes it
    before o's DoRA moment (0), between o's and up's (1) or after up's (2) (Note [DoRA's moment
    at each linear]): the attention's blocks, q / k / v's adapters' and the attention's weight
    copies first; o's and gate's own blocks (adapters', a selective policy's saved matmul
    outputs), the MLP's blocks but its last (up's output, saved by the product) and the gate /
    up copies between; up's and down's own blocks, the MLP's last block and down's copy after.
    ``up_input``: the last ``mlp/input`` block is up's ``lora_A`` 16-bit input copy
    (:func:`~trainmem.analytic.transforms.checkpointing.mlp_input_copies`), made after up's
    DoRA moment. ``down_after``: down's own blocks (``after``, by default
    :data:`AFTER_DOWN_MOMENT`) are made after its DoRA moment (3; Note [What down's DoRA
    moment precedes]), but for down's base output where ``dora/down`` is split (Note [DoRA's
    down moment in the forward]). ``up_combine``: of the blocks after up's moment only up's
    own (:data:`~trainmem.analytic.lora_variants.UP_OWN_TERMS`, its input copy) precede its
    output combination, the others come after it (4; Note [DoRA's output combination])."""
    out = []
    for term in names:
        # lora/<linear>_dropout and lora/<linear>_input_copy are made at <linear> too
        linear = term.rsplit("/", 1)[-1].removesuffix("_dropout").removesuffix("_input_copy")
        if term.startswith(("lora/", "dora/", "op_selective/mm/")):
            out.append(0 if linear in INPUT_PROJECTIONS else 1 if linear in ("o", "gate") else 2)
        else:
            out.append(1 if term.startswith("mlp/") else 0)
    mlp = [k for k, term in enumerate(names) if term.startswith("mlp/")]
    if mlp:
        out[mlp[-1]] = 2
    inputs = [k for k, term in enumerate(names) if term == "mlp/input"]
    if up_input and inputs:
        out[inputs[-1]] = 2
    if down_after:
        out = [3 if term in after else g for g, term in zip(out, names, strict=True)]
        # lora_A's 16-bit copy of the dropout output, the term's first block (the mask after)
        dropped = [k for k, term in enumerate(names) if term == DOWN_DROPOUT]
        if dropped:
            out[dropped[0]] = 3
    # o's / up's dropout mask, the second block of its split term, made before their moment
    for term, before in (("lora/o_dropout", 0), ("lora/up_dropout", 1)):
        masks = [k for k, name in enumerate(names) if name == term]
        if len(masks) == 2:
            out[masks[1]] = before
        # down's base output, the first of a split dora/down (lora_result and the rest after)
        based = [k for k, term in enumerate(names) if term == DORA_DOWN]
        if len(based) == 2:
            out[based[0]] = 2
    if up_combine:
        own = set(inputs[-1:]) if up_input else set()
        out = [
            4 if g == 2 and term not in UP_OWN_TERMS and k not in own else g
            for k, (g, term) in enumerate(zip(out, names, strict=True))
        ]
    copies = [k for k, term in enumerate(names) if term == WEIGHT_COPIES]
    for k, g in zip(copies, _copy_groups(len(copies), up_combine), strict=True):
        out[k] = g
    return out


class _Layers:
    """One layer's forward and backward in autograd order (Note [Analytic step schedule]),
    with the transforms' ops at the layer points."""

    def __init__(self, ctx: RankContext, transforms: _Transforms) -> None:
        self.ctx, self.tr = ctx, transforms
        self.model, self.training = ctx.model, ctx.training
        self.plan: LayerPlan = layer_plan(ctx)
        # the saved blocks' allocations (the forward's; the backward frees them)
        self.saved = saved_ops(self.plan, "forward", "{i}")
        self.first_plan = self.plan  # the stack's first layer's (Transform.first_layer_saved)
        for t in transforms.all:
            first = t.first_layer_saved(self.plan.saved)
            if first is not None:
                self.first_plan = self.plan._replace(saved=list(first))
                break
        self.first_saved = (
            self.saved
            if self.first_plan is self.plan
            else saved_ops(self.first_plan, "forward", "{i}")
        )
        # per layer its kind, an index into the dropped blocks of each kind of body
        self.kinds, self.dropped = dropped_per_layer_kind(ctx)
        # an encoder-decoder's saved blocks per kind too (Note [Layer bodies per stack and
        # block 0]): (blocks, their allocations) per kind, () for the mean layer's
        per_kind = saved_per_stack_block(ctx) if self.first_plan is self.plan else None
        self.saved_kinds = tuple(
            (blocks, saved_ops(self.plan._replace(saved=blocks), "forward", "{i}"))
            for blocks in per_kind or ()
        )
        # the term names of a list of blocks (the plans' few lists, asked by every body)
        self._names: dict[int, tuple[list[tuple[str, int]], tuple[str, ...]]] = {}
        # where the recompute frees each saved block, per list of saved terms
        self._places: dict[tuple[str, ...], tuple[str, ...]] = {}
        transients = backward_layer_transients(ctx.model, ctx.training)
        self.mlp_tmp, self.attention_tmp, self.residual_tmp = transients
        self.mlp_parts = mlp_backward_parts(ctx.model, ctx.training)
        # Note [A frozen 4-bit down projection before the recompute]
        self.down_first = self.mlp_parts is not None and down_backward_before_recompute(
            ctx.training
        )
        # Note [Frozen float8 linears save their input]: down's input freed after its backward
        self.down_input_late = (
            self.mlp_parts is not None
            and not self.down_first
            and float8_linears_save_input(ctx.model, ctx.training)
        )
        # Note [Final RMSNorm's backward], the layers' norms: each one's fp32 transients
        self.norm_tmp = layer_norm_backward_bytes(ctx.model, ctx.training)
        # Note [DoRA's moment at each linear] (no sequence-parallel copies: DoRA refuses TP)
        self.dora_order = dora_moments_per_linear(ctx.model, ctx.training)
        # Note [DoRA's down moment in the forward]
        self.forward_down = dora_down_moment_in_forward(ctx.model, ctx.training)
        self.forward_after = dora_down_after_moment(ctx.training)
        # Note [DoRA's output combination]
        self.up_combine = dora_up_combination_bytes(
            ctx.model, ctx.training, adapter_bytes=dtype_bytes(lora_adapter_dtype(ctx.training))
        )
        # up's lora_A input copy, a block of its own (checkpointing.mlp_input_copies)
        self.up_input = self.dora_order and "up" in ctx.training.lora_targets
        # Note [What down's DoRA moment precedes]
        self.down_after = self.dora_order and "down" in ctx.training.lora_targets
        self.scores_tmp, self.mask_tmp = eager_scores_forward_bytes(ctx.model, ctx.training)
        self.copies = sequence_parallel_copies(ctx.model, ctx.training)
        # Note [The training KV cache's copies]: each layer's copies from its attention on,
        # freed with the model output (_Ends.head_forward); the loop's held cache is one block
        self.kv_cache = 0 if transforms.held_cache else layer_kv_cache_bytes(ctx)
        # Note [Forward tensors held at the down projection], per first layer or not
        self.inner_unsaved = layer_is_checkpointed(ctx.training)
        saves_input = first_norm_saves_its_input(ctx.model, ctx.training)
        self.down_held = {
            first: down_projection_held_bytes(
                ctx.model,
                ctx.training,
                ctx.profile.terms,
                input_saved=saves_input,
                first_layer=first,
                has_embedding=ctx.rank.has_embedding,
                base_output_saved=self.forward_down and ctx.training.lora_dropout == 0,
            )
            for first in (False, True)
        }
        # Note [The recompute's tensors held at the up projection]
        self.up_held = (
            recompute_up_held_bytes(
                ctx.model, ctx.training, ctx.profile.terms, input_saved=saves_input
            )
            if self.down_first
            else []
        )
        # Note [The recompute's tensors held at the down projection]
        if recompute_runs_down_forward(ctx.model, ctx.training):
            self.up_held = self.down_held[False]
        self.reentrant_down = reentrant_recompute_runs_down(ctx.training)
        if self.reentrant_down:  # the recompute saves the layer's blocks, the norms' inputs too
            self.up_held = down_projection_held_bytes(
                ctx.model,
                replace(ctx.training, activation_checkpointing="none"),
                ctx.profile.terms,
                input_saved=saves_input,
                first_layer=True,  # the layer's input (and layer 0's embeddings) is saved
                has_embedding=ctx.rank.has_embedding,
                input_kept=True,  # the checkpoint's saved input, on a 16-bit stream too
            )
        # Note [The recompute's tensors held at an autocast down projection]: made and freed
        # before the transforms' ops at layer.backward (the reentrant output is made after)
        self.recompute_down = recompute_holds_down_copy(ctx.model, ctx.training)
        # Note [The gradient's cast through the recompute]: one of them, from its start
        self.grad_cast = 0
        if self.recompute_down:
            self.up_held = recompute_down_held_bytes(
                ctx.model,
                ctx.training,
                ctx.profile.terms,
                input_saved=saves_input,
                base_output_cached=cached_down_output(ctx),
            )
            self.grad_cast = recompute_gradient_cast_bytes(ctx.model, ctx.training)
            if self.grad_cast:
                self.up_held.remove(self.grad_cast)
        copies, frozen = self.plan.weight_copy, self.plan.frozen_copy
        self.recomputed_copies = weight_blocks(ctx, copies) if copies else []
        # Note [DoRA's moment at each linear]: the adapters' copies made at their linears
        self.recomputed_groups = [2] * len(self.recomputed_copies)
        per_linear = adapter_copy_blocks(ctx, copies) if self.dora_order and copies else None
        if per_linear is not None:
            self.recomputed_copies = [size for _, size in per_linear]
            self.recomputed_groups = [
                0 if linear in INPUT_PROJECTIONS | O_LINEARS else 1 if linear in UP_LINEARS else 2
                for linear, _ in per_linear
            ]
        self.frozen_copies = weight_blocks(ctx, frozen) if frozen else []
        # where the backward frees the recomputed copies (the frozen ones first)
        self.copy_places = _weight_copy_places(ctx.model, len(self.frozen_copies))
        self.copy_places += (
            (3,) * len(per_linear)  # released last, as their one block was
            if per_linear is not None
            else _weight_copy_places(ctx.model, len(self.recomputed_copies))
        )

    def weight_copy_ops(self, phase: Phase, key: str, label: str) -> list[Op]:
        """Autocast's cached 16-bit weight copies of the layer (under checkpointing)."""
        if not self.plan.weight_copy:
            return []
        return [
            alloc(size, Cat.ACTIVATION, phase, f"{key}/{n}", "layers.{i}", label)
            for n, size in enumerate(weight_blocks(self.ctx, self.plan.weight_copy))
        ]

    def forward(self) -> list[Item]:
        n, position = self.ctx.num_layers, self.tr.layer_position
        return _layer_loop(
            self._forward_body, n, reverse=False, position=position, kinds=self.kinds
        )

    def backward(self, where: Where) -> list[Item]:
        def body(at: Where, kind: int) -> tuple[Item, ...]:
            at = where._replace(first_layer=at.first_layer, last_layer=at.last_layer)
            return self._backward_body(at, kind)

        n, position = self.ctx.num_layers, self.tr.layer_position
        return _layer_loop(body, n, reverse=True, position=position, kinds=self.kinds)

    def _forward_body(self, where: Where, kind: int) -> tuple[Item, ...]:
        f: Phase = "forward"
        em = self.tr.emitter()
        body = em.at("layer.pre_forward", where)
        body += self.weight_copy_ops(f, "wcopy/{i}", "autocast's cached 16-bit weight copies")
        body += em.at("layer.forward", where)
        plan = self.first_plan if where.first_layer else self.plan
        saved = self.first_saved if where.first_layer else self.saved
        if self.saved_kinds:
            plan = plan._replace(saved=self.saved_kinds[kind][0])
            saved = self.saved_kinds[kind][1]
        dropped_blocks = self.dropped[kind]
        dropped = [
            alloc(
                size,
                Cat.TEMPORARY,
                f,
                f"drop/{n}",
                "layers.{i}",
                "activations dropped by checkpointing",
            )
            for n, (_, size) in enumerate(dropped_blocks)
        ]
        # what the attention holds at its end beyond what it saves, before the MLP's terms
        scores = [
            alloc(
                size,
                Cat.TEMPORARY,
                f,
                f"scores_tmp/{k}",
                "layers.{i}",
                "the eager attention's scores and locals",
            )
            for k, size in enumerate(self._scores_tmp_tensors())
        ]
        if self.dora_order:  # Note [DoRA's moment at each linear]
            names = [term for term, _ in plan.saved + dropped_blocks]
            groups = _linear_groups(
                names,
                self.up_input,
                self.forward_down,
                after=self.forward_after,
                up_combine=bool(self.up_combine),
            )
            blocks = saved + dropped
            body += [op for op, g in zip(blocks, groups, strict=True) if g == 0]
            body += self._kv_cache() + scores
            body += [free(op, f) for op in scores]
            body += em.at("layer.o.forward", where)
            body += [op for op, g in zip(blocks, groups, strict=True) if g == 1]
            body += em.at("layer.mlp.up.forward", where)
            body += [op for op, g in zip(blocks, groups, strict=True) if g == 2]
            body += self._up_combination(f)  # Note [DoRA's output combination]
            body += [op for op, g in zip(blocks, groups, strict=True) if g == 4]
            # Note [DoRA's down moment in the forward]: down's own blocks after its moment
            after_down = [op for op, g in zip(blocks, groups, strict=True) if g == 3]
            return self._forward_end(body, em, where, dropped, after_down)
        n_saved = sum(not term.startswith("mlp/") for term, _ in plan.saved)
        n_dropped = sum(not term.startswith("mlp/") for term, _ in dropped_blocks)
        names = [term for term, _ in plan.saved[:n_saved] + dropped_blocks[:n_dropped]]
        attention, partial = self._collectives(saved[:n_saved] + dropped[:n_dropped], names, "o")
        body += attention + self._kv_cache() + scores
        body += [free(op, f) for op in scores]
        body += partial
        names = [term for term, _ in plan.saved[n_saved:] + dropped_blocks[n_dropped:]]
        mlp, partial = self._collectives(saved[n_saved:] + dropped[n_dropped:], names, "down")
        body += mlp + partial
        return self._forward_end(body, em, where, dropped)

    def _up_combination(self, phase: Phase) -> list[Op]:
        """Up's DoRA output combination, made and freed after up's own blocks (Note [DoRA's
        output combination]); nothing without it or in a backward without a recompute."""
        if not self.up_combine or (
            phase == "backward" and self.training.activation_checkpointing == "none"
        ):
            return []
        label = "DoRA's output combination at up (peft tuners/lora/dora.py)"
        op = alloc(self.up_combine, Cat.TEMPORARY, phase, "dora_combine", "layers.{i}", label)
        return [op, free(op, phase)]

    def _kv_cache(self) -> list[Op]:
        """The layer's KV cache copies, made at its attention (Note [The training KV cache's
        copies]), freed with the model output (``_Ends.head_forward``)."""
        if not self.kv_cache:
            return []
        label = "the KV cache transformers builds in training, until the loss"
        return [alloc(self.kv_cache, Cat.TEMPORARY, "forward", "kv_cache/{i}", "layers.{i}", label)]

    def _forward_end(
        self,
        body: list[Item],
        em: Emitter,
        where: Where,
        dropped: list[Op],
        after_down: Sequence[Op] = (),
    ) -> tuple[Item, ...]:
        """``body`` (the layer's forward up to its blocks) with the down projection's point,
        the blocks made ``after_down`` it, the frees of the ``dropped`` blocks and
        ``layer.post_forward``."""
        f: Phase = "forward"
        # Note [Forward tensors held at the down projection]: a checkpointed layer's inner
        # tensors are gone by then
        down = [*self._down_projection(em, where), *after_down]
        dropped_frees: list[Item] = [free(op, f) for op in dropped]
        body += [*dropped_frees, *down] if self.inner_unsaved else [*down, *dropped_frees]
        body += em.at("layer.post_forward", where)
        em.check()
        return tuple(body)

    def _down_projection(self, em: Emitter, where: Where) -> list[Item]:
        """The transforms' ops at the MLP's down projection (``layer.mlp.forward``) with the
        tensors the forward holds there besides the saved blocks (Note [Forward tensors held
        at the down projection]), made before them and freed after; nothing without ops."""
        ops = em.at("layer.mlp.forward", where)
        # autocast's 16-bit copy of a frozen down projection's weight (LoRA's base), saved by
        # its matmul, is made there as a quantized base's dequantized weight is
        copies = any(term == WEIGHT_COPIES and size for term, size in self.plan.saved)
        if not ops and not (copies and self.training.frozen_base):
            return ops
        f: Phase = "forward"
        label = "what the forward holds at the down projection"
        held = [
            alloc(size, Cat.TEMPORARY, f, f"down_held/{k}", "layers.{i}", label)
            for k, size in enumerate(self.down_held[where.first_layer])
        ]
        return [*held, *ops, *(free(op, f) for op in held)]

    def _recompute_up(self, em: Emitter, where: Where) -> list[Item]:
        """The transforms' ops at ``layer.backward`` (the recompute's dequantization) with
        the tensors the recompute holds at the up projection besides its blocks (Note [The
        recompute's tensors held at the up projection]), made before them and freed after."""
        ops = em.at("layer.backward", where)
        if not self.up_held or not (ops or self.recompute_down):
            return ops
        b: Phase = "backward"
        where_ = "up" if self.down_first else "down"  # Note [... held at the down projection]
        label = f"what the recompute holds at the {where_} projection"
        held = [
            alloc(size, Cat.TEMPORARY, b, f"up_held/{k}", "layers.{i}", label)
            for k, size in enumerate(self.up_held)
        ]
        if self.recompute_down:  # Note [... held at an autocast down projection]
            return [*held, *(free(op, b) for op in held), *ops]
        if self.reentrant_down:  # the recomputed output is made after down's matmul
            out = [op for op in ops if isinstance(op, Op) and op.key == REENTRANT_OUTPUT_KEY]
            rest = [op for op in ops if op not in out]
            return [*held, *rest, *(free(op, b) for op in held), *out]
        return [*held, *ops, *(free(op, b) for op in held)]

    def _collectives(
        self, ops: list[Op], names: list[str], linear: str
    ) -> tuple[list[Op], list[Op]]:
        """One half of the layer's forward (the attention's or the MLP's ops, ``names`` their
        terms) with DTensor sequence parallelism's transient copies (Note [Sequence-parallel
        collectives' copies]): the all-gather's first output alive until its cat, the gathered
        input (``attention/qkv_input`` / ``mlp/input``; the half's start without one), is
        made; and, to follow the half, the row-parallel ``linear``'s partial sum and its
        chunk-and-cat copy before the reduce-scatter. ``(ops, [])`` without them."""
        copies = self.copies
        if not copies.partial:
            return ops, []
        f: Phase = "forward"
        out = list(ops)
        if copies.gathered:
            at = [k for k, term in enumerate(names) if term in GATHERED_INPUT_TERMS]
            first, last = (at[0], at[-1] + 1) if at else (0, 0)
            label = "the sequence-parallel all-gather's output before its cat"
            gather = alloc(copies.gathered, Cat.TEMPORARY, f, f"sp/{linear}/gather",
                           "layers.{i}", label)  # fmt: skip
            out = [*out[:first], gather, *out[first:last], free(gather, f), *out[last:]]
        label = f"the {linear} projection's partial sum and its copy before the reduce-scatter"
        pair = [
            alloc(copies.partial, Cat.TEMPORARY, f, f"sp/{linear}/{n}", "layers.{i}", label)
            for n in ("partial", "cat")
        ]
        return out, [*pair, *(free(op, f) for op in pair)]

    def _recomputed(self, b: Phase, kind: int) -> list[Op]:
        """The dropped blocks of a layer of ``kind`` made again (and autocast's weight copies
        with them: the frozen weights' copies, saved by their linears, then the cached
        ones)."""
        ops = [
            alloc(size, Cat.ACTIVATION, b, f"re/{n}", "layers.{i}", "recomputed activations")
            for n, (_, size) in enumerate(self.dropped[kind])
        ]
        label = "recomputed 16-bit copies of the frozen weights"
        ops += [
            alloc(size, Cat.ACTIVATION, b, f"wcopy/frozen/{n}", "layers.{i}", label)
            for n, size in enumerate(self.frozen_copies)
        ]
        label = "recomputed 16-bit weight copies"
        ops += [
            alloc(size, Cat.ACTIVATION, b, f"wcopy/re/{n}", "layers.{i}", label)
            for n, size in enumerate(self.recomputed_copies)
        ]
        return ops

    def _backward_body(self, where: Where, kind: int) -> tuple[Item, ...]:
        b: Phase = "backward"
        em = self.tr.emitter()
        # layer 0 runs last; the layer's own dropped blocks (Note [Layer bodies per
        # attention kind])
        plan = self.first_plan if where.last_layer else self.plan
        plan = plan._replace(dropped=self.dropped[kind])
        saved = self.first_saved if where.last_layer else self.saved
        if self.saved_kinds:
            plan = plan._replace(saved=self.saved_kinds[kind][0])
            saved = self.saved_kinds[kind][1]
        # Note [The adapters' matmuls under op-level selective checkpointing]: cached outputs
        # the recompute frees where their linear replays them
        saved_names = self.names(plan.saved)
        places = self._places.get(saved_names)
        if places is None:
            places = self._places[saved_names] = cache_release_places(self.ctx, saved_names)
        popped = {
            place: [free(op, b) for op, at in zip(saved, places, strict=True) if at == place]
            for place in ("pre_backward", "o", "up", "backward", "after")
        }
        # Note [The gradient's cast through the recompute]
        label = "the incoming gradient's 16-bit cast, through the recompute"
        cast = (
            [alloc(self.grad_cast, Cat.TEMPORARY, b, "grad_cast", "layers.{i}", label)]
            if self.grad_cast
            else []
        )
        body: list[Item] = [*cast, *popped["pre_backward"]]
        body += em.at("layer.pre_backward", where)
        if self.down_first:  # Note [A frozen 4-bit down projection before the recompute]
            body += self._down_backward(em, where)
        recomputed = self._recomputed(b, kind)
        if self.dora_order:  # Note [DoRA's moment at each linear]
            names = [term for term, _ in self.dropped[kind]]
            combine = bool(self.up_combine)
            groups = _linear_groups(names, self.up_input, self.down_after, up_combine=combine)
            groups += _copy_groups(len(self.frozen_copies), combine)
            groups += [4 if combine and g == 2 else g for g in self.recomputed_groups]
            body += [op for op, g in zip(recomputed, groups, strict=True) if g == 0]
            body += popped["o"]
            body += em.at("layer.o.recompute", where)
            body += [op for op, g in zip(recomputed, groups, strict=True) if g == 1]
            body += popped["up"]
            body += em.at("layer.mlp.up.recompute", where)
            body += [op for op, g in zip(recomputed, groups, strict=True) if g == 2]
            body += self._up_combination(b)  # Note [DoRA's output combination]
            body += [op for op, g in zip(recomputed, groups, strict=True) if g == 4]
        else:
            body += recomputed
        body += popped["backward"]
        body += self._recompute_up(em, where)
        body += [free(op, b) for op in cast]
        body += popped["after"]
        if self.dora_order:  # Note [What down's DoRA moment precedes]
            body += [op for op, g in zip(recomputed, groups, strict=True) if g == 3]
        # the frees of the saved and the recomputed blocks, in the order autograd releases them
        if any(places):
            plan = plan._replace(
                saved=[blk for blk, at in zip(plan.saved, places, strict=True) if not at]
            )
            saved = [op for op, at in zip(saved, places, strict=True) if not at]
        down, mlp, early, rest, after = self._released(saved, plan.saved)
        re_down, re_mlp, re_early, re_rest, re_after = self._released(
            recomputed, plan.dropped, self.copy_places
        )
        late = down + re_down if self.down_input_late else []
        if not late:
            body += down + re_down
        mlp_items, (_, mlp_grads, o_grads, rest_grads) = self._mlp_backward(em, where, late)
        body += mlp_items
        body += mlp + re_mlp + mlp_grads
        body += self._norm_backward(after + re_after, plan, "mlp/norm")
        body += early + re_early + o_grads
        body += em.at("layer.attention.pre_backward", where)
        attention = [
            alloc(
                size,
                Cat.TEMPORARY,
                b,
                f"attention_tmp/{k}",
                "layers.{i}",
                "eager attention's backward transients",
            )
            for k, size in enumerate(self._attention_tmp_tensors())
        ]
        body += [*attention, *(free(op, b) for op in attention)]
        body += rest_grads
        body += em.at("layer.attention.post_backward", where)
        body += self._norm_backward(rest + re_rest, plan, "attention/norm")
        body += em.at("layer.post_backward", where)
        em.check()
        return tuple(body)

    def _mlp_backward(
        self, em: Emitter, where: Where, late: Sequence[Op] = ()
    ) -> tuple[list[Item], tuple[list[Op], list[Op], list[Op], list[Op]]]:
        """The MLP's backward transients around its down projection's gradients (Note [An
        MLP's backward, linear by linear]; one block where the parts are not known), up to
        the frees of the MLP's other saved blocks; and the layer's four gradient groups
        (:meth:`_Transforms.layer_gradients`). ``late``: the frees of down's saved input when
        its backward releases it after the weight gradient (Note [Frozen float8 linears save
        their input])."""
        b: Phase = "backward"
        parts, made = self.mlp_parts, self._down_made()
        items: list[Item] = em.at("layer.mlp.pre_backward", where)
        if not self.down_first:
            items += self._down_backward(em, where)
        grads = self.tr.layer_gradients(where)
        items += grads[0]
        items += em.at("layer.mlp.post_backward", where)
        if parts is None:
            return [*items, free(made[0], b)], grads
        label = "the MLP activation's backward gradients"
        act = alloc(parts.activation, Cat.TEMPORARY, b, "mlp_tmp/act", "layers.{i}", label)
        items += [free(op, b) for op in made[1:]]
        items += late
        return [*items, act, free(made[0], b), free(act, b)], grads

    def _down_made(self) -> list[Op]:
        """The down projection's backward transients: its input gradient and (under
        autocast, trainable) its 16-bit weight gradient, or the MLP's one block."""
        b: Phase = "backward"
        label = "the MLP's backward transients"
        parts = self.mlp_parts
        if parts is None:
            return [alloc(self.mlp_tmp, Cat.TEMPORARY, b, "mlp_tmp", "layers.{i}", label)]
        keys = ("mlp_tmp", "mlp_tmp/weight")
        sizes = [parts.down_input] + ([parts.down_weight] if parts.down_weight else [])
        return [alloc(size, Cat.TEMPORARY, b, key, "layers.{i}", label)
                for key, size in zip(keys, sizes, strict=False)]  # fmt: skip

    def _down_backward(self, em: Emitter, where: Where) -> list[Item]:
        """The transforms' ops at ``layer.mlp.down_backward`` with the down projection's
        transients (:meth:`_down_made`) made before the free of their last allocation (a
        quantized base's dequantized weight beside the input gradient)."""
        ops, parts = em.at("layer.mlp.down_backward", where), self._down_made()
        # the transforms' ops between the input gradient and the weight gradient
        made = [parts[0], *em.at("layer.mlp.down_weight_backward", where), *parts[1:]]
        allocs = [op.key for op in ops if isinstance(op, Op) and op.action == "alloc"]
        if not allocs:
            return [*ops, *made]
        k = next(
            n
            for n, op in enumerate(ops)
            if isinstance(op, Op) and op.action == "free" and op.key == allocs[-1]
        )
        return [*ops[:k], *made, *ops[k:]]

    def _norm_backward(self, frees: list[Op], plan: LayerPlan, term: str) -> list[Op]:
        """``frees`` (a group of the backward's frees of saved / recomputed blocks) with the
        ``term`` norm's backward where it runs: after the group's other frees (their ops'
        backward ran before it), its fp32 transients made and freed, then its own saved block
        freed (Note [Final RMSNorm's backward], the layers' norms; the trace frees the saved
        fp32 input after the transients). Unchanged without the norm's block or transients."""
        if not self.norm_tmp:
            return frees
        keys = _norm_keys(self.names(plan.saved), term, "act/{i}/")
        keys |= _norm_keys(self.names(plan.dropped), term, "re/")
        own = [op for op in frees if op.key in keys]
        if not own:
            return frees
        b: Phase = "backward"
        n = FINAL_RMSNORM_BACKWARD_TENSORS
        label = "an RMSNorm's fp32 backward transients"
        tmp = [
            alloc(self.norm_tmp // n, Cat.TEMPORARY, b, f"{term}_tmp/{k}", "layers.{i}", label)
            for k in range(n)
        ]
        others = [op for op in frees if op.key not in keys]
        return [*others, *tmp, *(free(op, b) for op in tmp), *own]

    def _released(
        self, ops: list[Op], blocks: list[tuple[str, int]], past: tuple[int, ...] = ()
    ) -> tuple[list[Op], list[Op], list[Op], list[Op], list[Op]]:
        """The backward's frees of a layer's blocks (``ops[n]`` holds ``blocks[n]``; the ops
        past the blocks, the recomputed weight copies, in groups ``past``) in the five groups
        autograd releases them in (:func:`_release_groups`; autocast's weight copies saved by
        their linears: :func:`_weight_copy_places`)."""
        groups: tuple[list[Op], ...] = ([], [], [], [], [])
        names = self.names(blocks)
        t = self.training
        order = list(
            _release_groups(names, t.attention == "eager", self.model.pre_norms, t.uses_autocast)
        )
        copies = [n for n, term in enumerate(names) if term == WEIGHT_COPIES]
        for n, place in zip(copies, _weight_copy_places(self.model, len(copies)), strict=True):
            order[n] = place
        order += past
        for n, op in enumerate(ops):
            groups[order[n]].append(free(op, "backward"))
        return groups[0], groups[1], groups[2], groups[3], groups[4]

    def names(self, blocks: list[tuple[str, int]]) -> tuple[str, ...]:
        """The term names of ``blocks`` (one of the plans' lists; cached by the list)."""
        known = self._names.get(id(blocks))
        if known is None or known[0] is not blocks:
            known = self._names[id(blocks)] = (blocks, tuple(term for term, _ in blocks))
        return known[1]

    def _scores_tmp_tensors(self) -> list[int]:
        """What the eager attention holds in the forward beyond what it saves, as the tensors
        it is made of where they are known (a written-out softmax:
        :func:`~trainmem.analytic.activations.written_out_scores_forward_tensors`)."""
        if self.model.attention_written_out and self.training.attention == "eager":
            return written_out_scores_forward_tensors(self.model, self.training)
        return [self.scores_tmp]

    def _attention_tmp_tensors(self) -> list[int]:
        """Eager attention's backward transients as the tensors they are: the five fp32
        score-sized tensors of a written-out softmax (Note [Backward of a written-out
        softmax]); one block otherwise."""
        n = WRITTEN_OUT_SOFTMAX_BACKWARD_TENSORS
        if self.model.attention_written_out and self.attention_tmp % n == 0:
            return [self.attention_tmp // n] * n
        return [self.attention_tmp]


_SAVED_BY_THE_HEAD_MATMUL = frozenset({"lm_head_input", "autocast_weight_copies"})
"""The head terms the LM head's matmul saves and frees when its backward has run (Note [The LM
head's matmul backward]): its input and autocast's 16-bit copy of its weight."""

_SAVED_BEFORE_THE_CAST = frozenset({"final_norm", "lm_head_input", "logits_fp32_output"})
"""The head terms saved before Fabric casts litgpt's output (Note [litgpt's cast output]): the
final norm's tensors, the output head's input and the fp32 copy itself."""


class _Ends:
    """The embedding and the head around the layers, in autograd order (the loss, the logits,
    the embedding's gradient transients), with the transforms' ops at their points."""

    def __init__(self, ctx: RankContext, transforms: _Transforms) -> None:
        self.ctx, self.tr = ctx, transforms
        model, training, rank = ctx.model, ctx.training, ctx.rank
        head = rank.has_head
        self.loss_tmp = loss_backward_transient_bytes(model, training) if head else 0
        self.chunk_grads = chunked_loss_gradient_bytes(model, training) if head else 0
        self.chunk_wgrad = chunked_head_weight_grad_bytes(model, training) if head else 0
        # transformers' KV cache in training, or the presents that keep each layer's fused
        # QKV output (transformers < 4.54 GPT-BigCode under checkpointing), until the loss
        self.kv_cache = 0 if transforms.held_cache else returned_presents_bytes_of(ctx)
        # each layer's KV cache copies (_Layers), freed with the model output
        self.layer_cache = 0 if transforms.held_cache else layer_kv_cache_bytes(ctx)
        self.layer_caches = ctx.num_layers if self.layer_cache else 0
        self.final_hidden = final_hidden_transient_bytes(model, training) if head else 0
        # peft's prompted input embeddings, held to the end of its forward (the loss)
        self.prompted = prompted_inputs_held_bytes(model, training) if rank.stage == 0 else 0
        self.input_grad_hook = input_grad_hook_bytes(model, training) if rank.stage == 0 else 0
        self.emb_acts = ctx.profile.embedding if rank.stage == 0 else 0
        self.head_acts = ctx.profile.head if head else 0
        # the head's saved tensors as the tensors they are (the final norm's, the LM head's
        # input, the loss's), not one block
        parts = [(k, v) for k, v in ctx.profile.head_parts.items() if v > 0]
        if sum(v for _, v in parts) != self.head_acts:
            parts = [("head", self.head_acts)]
        self.head_blocks = [v for _, v in parts]
        # Note [Final RMSNorm's backward]: its transients, its saved tensors alive beside them
        self.final_norm_tmp = final_norm_backward_bytes(model, training) if head else 0
        names_ = [n for n, _ in parts]
        self.final_norm_block = names_.index("final_norm") if "final_norm" in names_ else -1
        self.head_input_block = names_.index("lm_head_input") if "lm_head_input" in names_ else -1
        # Note [The LM head's matmul backward]: its transients, and the saved blocks it frees
        self.head_mm = head_matmul_backward_parts(model, training) if head else None
        self.mm_saved = [n for n, k in enumerate(names_) if k in _SAVED_BY_THE_HEAD_MATMUL]
        self.chunks = training.chunked_cross_entropy
        # See Note [litgpt's cast output]: the blocks saved before the head's output is cast
        # (the final norm's, the head's input, the fp32 copy) before the loop rebinds
        names = [n for n, _ in parts]
        cast_first = training.conventions.own_model_code and "logits_fp32_output" in names
        self.before_rebind = (
            [k for k, n in enumerate(names) if n in _SAVED_BEFORE_THE_CAST] if cast_first else []
        )
        if training.training_loop == "previous" and accelerate_output_bytes(model, training):
            # Note [accelerate's fp32 outputs]: the loop rebinds its output when the wrapped
            # forward returns, after the model's loss saved its tensors
            self.before_rebind = list(range(len(names)))
        # Note [litgpt's bound logits]: the fp32 copy outlives the head's backward
        one_stage = rank.stage == 0 and head
        self.bound = names.index("logits_fp32_output") if cast_first and one_stage else None
        # Note [Sequence-parallel collectives' copies]: the LM head's all-gather output
        copies = sequence_parallel_copies(model, training)
        self.head_gather = copies.head_gathered if head and model.head == "causal-lm" else 0
        self.tied_sum = transforms.tied_sum
        # Note [Tied embedding gradient under DTensor]: the lookup's gradient redistributed
        self.tied_shard = self.tied_sum if embedding_gradients(ctx).vocab_factor > 1 else 0
        # the logits a transform holds (the pipeline's output chunk, the loop's kept logits)
        # are the kept part of the loss's forward transients
        loss_fwd = loss_forward_transient_bytes(model, training) if head else 0
        self.loss_fwd = max(loss_fwd - transforms.held_logits, 0)
        # the 16-bit logits and their fp32 copy are two tensors (the copy freed first)
        self.logits16 = 0
        if not transforms.held_logits and head:
            part = logits_bytes(model, training)
            if 0 < part < self.loss_fwd:
                self.logits16 = part
                self.loss_fwd -= part
        # Note [The upcast 16-bit logits]: the model code's own upcast frees them in any loop
        self.logits16_at_upcast = bool(self.logits16 and model_upcast_logits_bytes(model, training))
        # and the loss's shifted copy of the fp32 logits a third (transformers before 4.49)
        shifted = shifted_copy_bytes(model, training) if head else 0
        self.shifted = shifted if 0 < shifted < self.loss_fwd else 0
        self.loss_fwd -= self.shifted
        # Note [The upcast 16-bit logits]: freed at the upcast when the loop holds the fp32 ones
        self.upcast16 = upcast_logits_bytes(model, training) if transforms.held_logits else 0
        self.upcast16 = min(self.upcast16, self.loss_fwd) if head else 0
        self.loss_fwd -= self.upcast16

    def embedding_activations(self) -> Op:
        """The embedding's activations, from its forward to the end of its backward."""
        label = "embedding activations"
        return alloc(self.emb_acts, Cat.ACTIVATION, "forward", "act/embedding", "embedding", label)

    def prompted_inputs(self) -> Op:
        """peft's prompts and prompted input embeddings under p-tuning / prompt tuning, held by
        its forward from the embedding to the loss (Note [Prompt learning in the formulas])."""
        label = "peft's prompted input embeddings, held until the loss"
        return alloc(self.prompted, Cat.TEMPORARY, "forward", "prompted_inputs", "embedding", label)

    def head_forward(self, em: Emitter, where: Where) -> list[Item]:
        f: Phase = "forward"
        logits = alloc(
            self.loss_fwd,
            Cat.TEMPORARY,
            f,
            "logits",
            "head",
            "logits (and their fp32 copy) while the loss runs",
        )
        logits16 = alloc(self.logits16, Cat.TEMPORARY, f, "logits16", "head", "logits")
        label = "the loss's shifted copy of the fp32 logits"
        shifted = alloc(self.shifted, Cat.TEMPORARY, f, "logits/shifted", "head", label)
        head_act = [
            alloc(size, Cat.ACTIVATION, f, f"act/head/{n}", "head", "head activations")
            for n, size in enumerate(self.head_blocks)
        ]
        cache = alloc(
            self.kv_cache,
            Cat.TEMPORARY,
            f,
            "kv_cache",
            "layers",
            "the KV cache transformers builds in training, until the loss",
        )
        hidden = alloc(
            self.final_hidden,
            Cat.TEMPORARY,
            f,
            "final_hidden",
            "head",
            "the final hidden states, held by the model output until the loss",
        )
        upcast = alloc(self.upcast16, Cat.TEMPORARY, f, "logits16/upcast", "head", "logits")
        held = em.at("head.forward", where)  # the loop's kept logits, the fp32 upcast among them
        held = [upcast, *held, free(upcast, f)] if self.upcast16 else held
        items: list[Item] = [cache, hidden, *held]
        if self.head_gather:
            label = "the sequence-parallel all-gather's output before its cat"
            gather = alloc(self.head_gather, Cat.TEMPORARY, f, "sp/head/gather", "head", label)
            items += [gather, free(gather, f)]
        if not self.tr.held_logits:
            items.append(logits16)
        # the 16-bit logits freed at ``logits = logits.float()`` (the fp32 copy's allocation)
        rebound = [free(logits16, f)] if self.logits16_at_upcast else []
        if self.shifted:  # made after the upcast, freed with it when the loss returns
            items += [logits, *rebound, shifted, *em.at("head.post_forward", where), *head_act]
            items += [free(shifted, f), free(logits, f)]
        elif self.before_rebind:  # Note [litgpt's cast output]
            first = [head_act[k] for k in self.before_rebind]
            rest = [op for k, op in enumerate(head_act) if k not in self.before_rebind]
            items += [logits, *rebound, *first, *em.at("head.post_forward", where)]
            items += [free(logits, f), *rest]
        else:
            items += [logits, *rebound, *em.at("head.post_forward", where), *head_act]
            items.append(free(logits, f))
        if not self.tr.held_logits and not rebound:
            items.append(free(logits16, f))
        # each layer's cache freed, layer by layer: one repeated free (the index formats its
        # key and module as the layer's own allocation has them), not a free per layer
        layer_cache = alloc(self.layer_cache, Cat.TEMPORARY, f, "kv_cache/{i}", "layers.{i}")
        caches = [Repeat((free(layer_cache, f),), self.layer_caches)] if self.layer_caches else []
        return [*items, free(hidden, f), free(cache, f), free(self.prompted_inputs(), f), *caches]

    def _loss_gradients(self) -> tuple[list[Op], Op]:
        """The loss's (tokens x vocab) gradients, two for a cross-entropy, three under DTensor's
        loss parallel (:func:`~trainmem.analytic.activations.loss_backward_tensors`): the ops
        up to the free of all but the last, and the last."""
        b: Phase = "backward"
        n = loss_backward_tensors(self.ctx.model, self.ctx.training)
        label = "the (tokens x vocab) loss gradients"
        g1 = alloc(self.loss_tmp * (n - 1) // n, Cat.TEMPORARY, b, "loss/1", "loss", label)
        g2 = alloc(self.loss_tmp - g1.size_bytes, Cat.TEMPORARY, b, "loss/2", "loss", label)
        firsts = [
            alloc(g1.size_bytes // (n - 1), Cat.TEMPORARY, b, f"loss/1/{k}", "loss", label)
            for k in range(n - 2)
        ]
        if firsts:  # g1 as the n - 1 tensors it is
            rest = g1.size_bytes - sum(x.size_bytes for x in firsts)
            g1 = alloc(rest, Cat.TEMPORARY, b, "loss/1", "loss", label)
        return [*firsts, g1, g2, *(free(x, b) for x in firsts), free(g1, b)], g2

    def head_backward(self, em: Emitter, where: Where) -> list[Item]:
        """``loss.backward()`` through the loss and the head.

        Note [Chunked head's first weight-gradient sum]
            Under a chunked loss with a trained head the backward's peak can be the first sum
            of the N output projections' weight gradients (InputBuffer::add, out of place:
            :func:`~trainmem.analytic.loss.chunked_head_weight_grad_bytes`). By then autograd
            has run two chunks' MmBackward, and each released its saved input and its logits
            gradient as it finished (torch/csrc/autograd/engine.cpp ``evaluate_function``: the
            node's inputs and, after ``release_variables``, its saved tensors go before the
            next node; input_buffer.cpp holds only the weight gradients): N - 2 chunks'
            logits gradients are alive, not N - 1. The remaining N - 2 chunks' head inputs
            are alive too, and the two processed chunks' input gradients wait in the chunk
            node's input buffer until all N arrive, as many bytes as the two freed inputs: the
            head's whole input block is alive through the sum. The final norm runs eager
            beside a compiled loss (torchtune 0.4 ``compile_model`` compiles the layers only,
            training/_compile.py; the trace engine compiles the loss only), so its weight
            saves the 16-bit normalised tensor (analytic/head.py). Traced:
            tests/trace/test_chunked_loss_compiled.py, 46,870,528 B vs 46,872,328 (-0.004 %).
        """
        b: Phase = "backward"
        items = em.at("backward.begin", where)
        loss, g2 = self._loss_gradients()
        items += [*loss, *em.at("head.backward", where)]
        label = "head activations"
        held = self.final_norm_block if self.final_norm_tmp else -1
        # Note [Chunked head's first weight-gradient sum]: the head's input, freed after it
        held_input = self.head_input_block if self.chunk_wgrad and self.chunk_grads else -1
        mm = self.head_mm
        saved = [
            free(alloc(size, Cat.ACTIVATION, "forward", f"act/head/{n}", "head", label), b)
            for n, size in enumerate(self.head_blocks)
            # the final norm's and (Note [litgpt's bound logits]) the fp32 copy: freed later
            if n not in (held, self.bound, held_input)
        ]
        # Note [The LM head's matmul backward]: what the head's matmul saved goes after it
        mm_saved = {f"act/head/{n}" for n in self.mm_saved} if mm else set()
        items += [op for op in saved if op.key not in mm_saved]
        saved = [op for op in saved if op.key in mm_saved]
        # a chunked loss: the other chunks' logits gradients, alive through the head's
        # backward (Note [Compiled chunked cross-entropy]); the next chunk's apart (Note
        # [Chunked head's first weight-gradient sum])
        one = self.chunk_grads // (self.chunks - 1) if self.chunk_wgrad and self.chunk_grads else 0
        what = "the other chunks' logits gradients"
        chunk_grads = alloc(self.chunk_grads - one, Cat.TEMPORARY, b, "loss/chunks", "loss", what)
        next_grad = alloc(one, Cat.TEMPORARY, b, "loss/chunks/next", "loss", what)
        grads = [chunk_grads, next_grad, *self.tr.gradients("head", where)]
        input_grad: Op | None = None
        if mm is None:
            items += [*saved, *grads]
        else:
            what = "the logits gradient cast back to the head's dtype"
            logits_grad = alloc(mm.logits_grad, Cat.TEMPORARY, b, "head_tmp/logits", "head", what)
            what = "the LM head's input gradient"
            input_grad = alloc(mm.input_grad, Cat.TEMPORARY, b, "head_tmp/input", "head", what)
            items += [logits_grad, free(g2, b)]
            if mm.weight_grad:  # autocast: the 16-bit gradient, then its fp32 cast
                what = "the head weight's 16-bit gradient before its fp32 cast"
                weight = alloc(mm.weight_grad, Cat.TEMPORARY, b, "head_tmp/weight", "head", what)
                items += [weight, input_grad, free(logits_grad, b), *saved, *grads]
                items.append(free(weight, b))
            else:  # the matmul makes the gradient itself
                items += [*grads, input_grad, free(logits_grad, b), *saved]
        if self.chunk_wgrad:
            # the next chunk's head weight gradient and the out-of-place sum, beside the sum so
            # far, after the first chunk's logits gradient is freed
            # (:func:`~trainmem.analytic.activations.chunked_head_weight_grad_bytes`)
            wgrad = alloc(
                self.chunk_wgrad,
                Cat.TEMPORARY,
                b,
                "loss/chunk_wgrad",
                "head",
                "the next chunk's head weight gradient and its sum with the others",
            )
            items += [free(g2, b), free(next_grad, b), wgrad, free(wgrad, b)]
        else:
            items.append(free(next_grad, b))
        if held_input >= 0:
            size = self.head_blocks[held_input]
            name = f"act/head/{held_input}"
            items.append(free(alloc(size, Cat.ACTIVATION, "forward", name, "head", label), b))
        items += [*em.at("head.post_backward", where), free(chunk_grads, b)]
        if not self.chunk_wgrad and mm is None:
            items.append(free(g2, b))
        if self.final_norm_tmp:  # Note [Final RMSNorm's backward], as the tensors they are
            n = FINAL_RMSNORM_BACKWARD_TENSORS
            norm_tmp = [
                alloc(
                    self.final_norm_tmp // n,
                    Cat.TEMPORARY,
                    b,
                    f"final_norm_tmp/{k}",
                    "head",
                    "the final RMSNorm's fp32 backward transients",
                )
                for k in range(n)
            ]
            size = self.head_blocks[held] if held >= 0 else 0
            kept = alloc(size, Cat.ACTIVATION, "forward", f"act/head/{held}", "head", label)
            # the input gradient goes once the norm's first fp32 tensor (its cast) exists
            items += [norm_tmp[0], *([free(input_grad, b)] if input_grad else [])]
            items += [*norm_tmp[1:], *(free(op, b) for op in norm_tmp)]
            items += [free(kept, b)] if held >= 0 else []
        elif input_grad:
            items.append(free(input_grad, b))
        return items

    def embedding_backward(self, em: Emitter, where: Where) -> list[Item]:
        """The embedding's backward (Note [Tied embedding gradient under DTensor]) to the end
        of ``loss.backward()``."""
        b: Phase = "backward"
        items = em.at("embedding.pre_backward", where)
        vocab_grad = alloc(
            self.tr.vocab_grad,
            Cat.TEMPORARY,
            b,
            "grad/embedding/vocab",
            "embedding",
            (
                "the token embedding's full-vocabulary partial gradient (DTensor)"
                if self.tied_shard
                else "the token embedding's weight gradient (vocabulary x hidden)"
            ),
        )
        items.append(vocab_grad)
        tied_sum = tied_sum_op(self.tied_sum)
        if self.tied_sum:
            tied_shard = alloc(
                self.tied_shard,
                Cat.TEMPORARY,
                b,
                "grad/embedding/tied_shard",
                "embedding",
                "the lookup's gradient redistributed to the head gradient's vocabulary shard",
            )
            items += [tied_shard, tied_sum, free(tied_shard, b)]
        items += em.at("embedding.backward", where)
        hook = alloc(
            self.input_grad_hook,
            Cat.ACTIVATION,
            b,
            "input_grad_hook",
            "embedding",
            "the embedding output (a leaf that requires grad) and its .grad",
        )
        if hook.size_bytes:
            items.append(hook)
        items += self.tr.gradients("embedding", where)
        items += [*em.at("embedding.post_backward", where), free(vocab_grad, b)]
        if self.tied_sum and not self.tr.keeps_root:
            items.append(free(tied_sum, b))
        items += em.at("root.post_backward", where)
        items.append(free(self.embedding_activations(), b))
        if hook.size_bytes:
            items.append(free(hook, b))
        if self.bound is not None:  # Note [litgpt's bound logits]
            size = self.head_blocks[self.bound]
            label = "head activations"
            bound = alloc(size, Cat.ACTIVATION, "forward", f"act/head/{self.bound}", "head", label)
            items.append(free(bound, b))
        return items + em.at("micro_batch.end", where)


class _Builder:
    """The base order of one rank's step, with its transforms' ops at the named points."""

    def __init__(
        self,
        model: ModelSpec,
        training: TrainingConfig,
        rank: PipelineRank,
        layout: StateLayout,
        prof: ActivationProfile,
        workspace_per_handle: int,
    ) -> None:
        L = rank.num_layers
        # pieces that depend only on the model states and this rank's share of them
        pp_fsdp = training.pipeline_parallel_size > 1 and (
            training.zero_stage == 3 and training.sharding_degree > 1
        )
        shared: dict[str, Repeat] = layout.cache.setdefault(
            ("schedule", L, rank.has_embedding, rank.has_head, rank.stage > 0, pp_fsdp), {}
        )
        self.ctx = ctx = RankContext.build(
            model, training, rank, layout, prof, shared, builds_model_states=True
        )
        self.model, self.training, self.rank = model, training, rank
        self.workspace_per_handle = workspace_per_handle
        self.tr = _Transforms(ctx)
        self.layers = _Layers(ctx, self.tr)
        self.shared = shared
        self._cache: dict[str, Repeat] = {}
        self.ends = _Ends(ctx, self.tr)
        self.residual_tmp, self.mask_tmp = self.layers.residual_tmp, self.layers.mask_tmp

    # -- setup ------------------------------------------------------------------------------

    def parameters(self) -> list[Item]:
        flat = deepspeed_flat_buffers(self.ctx)
        # Note [DeepSpeed's flat buffers at init]: the trainable tensors' blocks are gone
        # before the flat one exists (unless it is made beside them)
        replaced = flat is not None and not flat.params_beside
        key = "parameters/flat" if replaced else "parameters"
        cached = self.shared.get(key)
        if cached is None:
            cached = self.shared[key] = Repeat(tuple(self._parameters(replaced)), 1)
        return [cached]

    def _parameters(self, replaced: bool) -> list[Item]:
        """Every parameter tensor's block; ``replaced``: the trainable ones' are DeepSpeed's
        flat block instead."""
        ctx = self.ctx
        items: list[Item] = [
            op
            for op, s in zip(
                outer_parameter_ops(ctx), ctx.emb_states + ctx.head_states, strict=True
            )
            if not (replaced and s.trainable)
        ]
        if ctx.emb_states and self.model.module_buffer_bytes:
            # the model's buffers, with the embeddings (counted with the parameters, as
            # ``torch.cuda.memory_allocated`` does)
            items.append(
                alloc(
                    self.model.module_buffer_bytes,
                    Cat.PARAMETER,
                    "init",
                    "buffers",
                    "(model)",
                    "the model's buffers",
                )
            )
        states = unit_states(ctx, ctx.layer_states)  # Note [FSDP1 flat blocks of a layer unit]
        layer = tuple(
            op
            for op, s in zip(layer_parameter_ops(ctx), states, strict=True)
            if not (replaced and s.trainable)
        )
        items.append(Repeat(layer, ctx.num_layers))
        rope = layer_rope_cache_bytes(self.model, ctx.training)
        if rope and ctx.num_layers:  # each layer's own rotary tables (older transformers)
            label = "a layer's rotary cos / sin buffers"
            op = alloc(rope, Cat.PARAMETER, "init", ROPE_BUFFERS_KEY, "layers.{i}", label)
            items.append(Repeat((op,), ctx.num_layers))
        return items

    # -- one micro-batch --------------------------------------------------------------------

    def micro_batch(
        self, *, new_grads: bool, reduce: bool = False, zero_grad: bool = False
    ) -> Repeat:
        """One micro-batch (built once per kind, shared by the warm-up and measured steps).
        ``reduce``: the last micro-batch of an accumulation whose transform reduces then
        (Note [FSDP gradient accumulation under no_sync]). ``zero_grad``: the previous step's
        gradients are freed between the forward and the backward
        (``TrainingConfig.zero_grad_before_backward``)."""
        key = f"micro/{new_grads}/{reduce}/{zero_grad}"
        cached = self._cache.get(key)
        if cached is None:
            where = Where(new_grads=new_grads, reduce=reduce, zero_grad=zero_grad)
            em = self.tr.emitter()
            body = [*self._forward(em, where), *self._backward(em, where)]
            em.check()
            cached = self._cache[key] = Repeat(tuple(body), 1)
        return cached

    def _forward(self, em: Emitter, where: Where) -> list[Item]:
        """The forward: the embedding, the layers, the head and the loss."""
        f: Phase = "forward"
        items = em.at("micro_batch.begin", where)
        items.append(self.ends.embedding_activations())
        items.append(self.ends.prompted_inputs())
        mask = alloc(
            self.mask_tmp if self.training.activation_checkpointing == "none" else 0,
            Cat.TEMPORARY,
            f,
            "attention_mask",
            "(model)",
            "the additive causal mask of the eager attention",
        )
        items += [mask, *em.at("stack.pre_forward", where), *self.layers.forward()]
        items += [*em.at("stack.post_forward", where), free(mask, f)]
        items += self.ends.head_forward(em, where)
        copies = self.layers.weight_copy_ops(f, "wcopy/{i}", "")
        if copies:
            items.append(Repeat(tuple(free(op, f) for op in copies), self.ctx.num_layers))
        items += em.at("forward.end", where)
        return items

    def _backward(self, em: Emitter, where: Where) -> list[Item]:
        """``loss.backward()``: the loss, the head, the layers in reverse, the embedding."""
        b: Phase = "backward"
        items = self.ends.head_backward(em, where)
        residual = alloc(
            self.residual_tmp,
            Cat.TEMPORARY,
            b,
            "residual_grad",
            "layers",
            "the residual-stream gradient",
        )
        items += [residual, *em.at("stack.pre_backward", where), *self.layers.backward(where)]
        items += [*em.at("stack.post_backward", where), free(residual, b)]
        return items + self.ends.embedding_backward(em, where)

    # -- the step ---------------------------------------------------------------------------

    def optimizer(self, em: Emitter, where: Where) -> list[Item]:
        """States (first step only), then the step (a zero-byte marker opens the phase, so its
        peak exists even when the step allocates nothing)."""
        marker = alloc(
            0, Cat.TEMPORARY, "optimizer", "optimizer/step", "(optimizer)", "optimizer step"
        )
        items = [marker, free(marker, "optimizer"), *em.at("optimizer.begin", where)]
        if self.tr.in_backward:
            return items
        cached = self.shared.get("optimizer")
        if cached is None:
            inner = self.tr.emitter()
            body = (*inner.at("optimizer.step", where), *inner.at("optimizer.end", where))
            inner.check()
            cached = self.shared["optimizer"] = Repeat(body, 1)
        return [*items, cached]

    def step(self, *, first: bool) -> list[Item]:
        """One optimizer step: the micro-batches, the optimizer, zero_grad (when it frees the
        gradients: :func:`~trainmem.analytic.transforms.loop.zero_grad_policy`)."""
        m = self.training.gradient_accumulation_steps
        zero_grad = zero_grad_policy(self.ctx)
        em, where = self.tr.emitter(), Where(first_step=first)
        items: list[Item] = []
        if first:  # the forward thread's and autograd's cuBLAS handles, created at first use
            ws = self.workspace_per_handle
            items += [
                alloc(ws, Cat.TEMPORARY, "forward", "cublas/0", "cublas", "cuBLAS workspace"),
                alloc(ws, Cat.TEMPORARY, "forward", "cublas/1", "cublas", "cuBLAS workspace"),
            ]
        items += em.at("step.begin", where)
        items += em.at("micro_batches.begin", where)
        items.append(
            self.micro_batch(new_grads=not zero_grad.keep, zero_grad=zero_grad.before_backward)
        )
        if self.tr.reduces_last:  # Note [FSDP gradient accumulation under no_sync]
            if m > 2:
                again = self.micro_batch(new_grads=False)
                items.append(Repeat(again.body, m - 2, independent=True))
            items.append(self.micro_batch(new_grads=False, reduce=True))
        elif m > 1:
            again = self.micro_batch(new_grads=False)
            items.append(Repeat(again.body, m - 1, start=1, independent=self.tr.balanced))
        items += em.at("micro_batches.end", where)
        items += em.at("step.post_backward", where)
        items += self.optimizer(em, where)
        items += em.at("step.post_optimizer", where)
        items += em.at("step.end", where)
        em.check()
        return items


def rank_schedule(
    model: ModelSpec,
    training: TrainingConfig,
    rank: PipelineRank,
    *,
    layout: StateLayout,
    prof: ActivationProfile,
    workspace_per_handle: int,
) -> StepSchedule:
    """The step schedule of one rank (Note [Analytic step schedule]).

    Args:
        model / training: what is trained and how.
        rank: the pipeline stage the rank holds (the whole model without pipelining).
        layout: per-tensor model states (:func:`~trainmem.analytic.tensor_states.state_layout`).
        prof: activation terms (:func:`~trainmem.analytic.activations.activation_profile`).
        workspace_per_handle: cuBLAS workspace of one handle, bytes.

    Returns:
        The schedule: setup (weights, warm-up steps) and the steady-state step.
    """
    b = _Builder(model, training, rank, layout, prof, workspace_per_handle)
    setup: list[Item] = b.parameters()
    load = load_items(b.ctx, setup)  # Note [The load phase]: () for most runs
    em = b.tr.emitter()
    setup += em.at("setup", Where(first_step=True))
    em.check()
    setup += b.step(first=True)
    for _ in range(WARMUP_STEPS - 1):
        setup += b.step(first=False)
    suffix = f" stage {rank.stage}" if training.pipeline_parallel_size > 1 else ""
    return StepSchedule(
        setup=tuple(setup),
        step=tuple(b.step(first=False)),
        name=f"{model.name} (analytic{suffix})",
        load=load,
        load_rule=load_rule(training) or "" if load else "",
    )
