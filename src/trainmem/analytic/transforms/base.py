"""The contract between the base step order and a mechanism's transform (issue 25).

A :class:`Transform` is one mechanism (FSDP, DeepSpeed ZeRO, pipelining, ...). Given a
:class:`RankContext` (what is trained, how, and this rank's model states), it says whether it
:meth:`~Transform.applies`, and at each named point of the step
(:mod:`~trainmem.analytic.transforms.points`) returns the ops it inserts there: allocations and
frees (:class:`~trainmem.schedule.Op`), repeated blocks (:class:`~trainmem.schedule.Repeat`), or
a :class:`Lifetime`, an allocation whose free the :class:`Emitter` places at a later point
(lifetimes from uses: no hand-paired free). A transform computes its tensors from the context's
model states and sizes only, never from the builder, so the same transform applies to a step
recorded by the trace engine (its states measured, :meth:`RankContext.build`).

Source: the lifetime rule is tinygrad's memory planner's (tinygrad/engine/memory.py
``_internal_memory_planner``: a buffer is freed after its last use), here stated per tensor as
the point that releases it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any, ClassVar, Literal, NamedTuple

from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.activations import ActivationProfile
from trainmem.analytic.buffers import gradient_buffer_from_init
from trainmem.analytic.loss import chunked_head_weight_grad_bytes
from trainmem.analytic.tensor_states import StateLayout, TensorState
from trainmem.analytic.transforms.points import PHASE, POINTS, Point
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.errors import ScheduleError
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.model import ModelSpec
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import ALL_GATHER_STREAM as ALL_GATHER_STREAM  # (re-exported)
from trainmem.timeline import PRE_UNSHARD_STREAM as PRE_UNSHARD_STREAM
from trainmem.timeline import REDUCE_SCATTER_STREAM as REDUCE_SCATTER_STREAM
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes

_new_op = tuple.__new__
_trunc = math.trunc


def alloc(
    size: int,
    cat: Cat,
    phase: Phase,
    key: str,
    module: str = "",
    label: str = "",
    stream: int = 0,
) -> Op:
    """An allocation of ``max(size, 0)`` bytes on CUDA stream ``stream``."""
    # int() of a float; trunc keeps a recorded size recorded (Note [Schedule templates])
    size = _trunc(size)
    # NB: tuple.__new__ skips the named tuple's Python-level __new__ (the builder makes about
    # 140 ops per configuration the planner evaluates)
    return _new_op(Op, ("alloc", size if size > 0 else 0, cat, phase, key, module, label, stream))


def free(op: Op, phase: Phase) -> Op:
    """The free of ``op``'s allocation, in ``phase``."""
    _, size, cat, _, key, module, label, stream = op
    return _new_op(Op, ("free", size, cat, phase, key, module, label, stream))


_DOWN_PROJECTIONS = frozenset({"down", "shared_down", "experts_down"})
_MLP_LINEARS = _DOWN_PROJECTIONS | {
    "gate", "up", "router", "experts_gate_up", "shared_gate", "shared_up", "shared_expert_gate",
}  # fmt: skip
_OUTPUT_PROJECTIONS = frozenset({"o"})


@lru_cache(maxsize=256)
def gradient_places(names: tuple[str, ...]) -> tuple[int, ...]:
    """Per layer tensor (its :class:`~trainmem.analytic.tensor_states.TensorState` name: a
    linear's, ``lora_A.<linear>``, ``vector``...), where the layer's backward makes its gradient
    (Note [Gradients where their linear's backward runs]): 0, the MLP's output projection's
    backward (the first to run); 1, the rest of the MLP's; 2, the attention's output
    projection's; 3, the rest of the attention's, with the norms and biases (cached: the same
    names for every configuration of a model).

    Note [Gradients where their linear's backward runs]
        A parameter's ``.grad`` is made by its ``AccumulateGrad`` node, which autograd runs as soon
        as its input is ready (its sequence number is the highest, so the engine's ready queue takes
        it first: torch/csrc/autograd/functions/accumulate_grad.cpp) and which, on the first
        backward after ``zero_grad(set_to_none=True)``, stores the incoming gradient itself as
        ``.grad`` (torch/csrc/autograd/functions/accumulate_grad.h ``accumulateGrad``: an undefined
        ``variable_grad`` takes ``new_grad`` when nothing else refers to it, else a clone). So a
        weight's gradient appears when its linear's backward has run, not all at once at the layer's
        MLP: the down projection's first, then, once the activation's and the product's saved
        tensors and the linears' own autocast copies are freed, the gate's and the up's, then the
        attention's output projection's, then q, k, v and the norms'. Without autocast the gradient
        is the weight-gradient matmul's output, made while the linear's saved input is alive (the
        MLP's pre-norm input is freed after the MLP's gradients); under autocast it is the fp32 cast
        of the 16-bit one, made after the matmul's node released its saved tensors (the 16-bit
        weight gradient is one of the MLP's transients). Each autocast weight copy is freed with its
        linear (trainmem/analytic/schedule.py ``_weight_copy_places``), the recomputed ones under
        checkpointing too (the recompute's autocast region ends with the recompute, so only the
        saved tensors hold them). A later micro-batch of an accumulation makes each new gradient
        at the same place, adds it into the kept ``.grad`` in place and frees it
        (trainmem/analytic/schedule.py ``_accumulated``). Before, a layer's every gradient was
        made with the MLP's
        transients alive and its saved activations and copies not yet freed: on a 2-layer 2048-wide
        Llama (vocabulary 4096, 2 x 256 tokens, bf16-mixed) the formulas were +16.3 % (SGD) / +13.1
        % (adamw-8bit) over the generic path's trace, now -0.5 % / -0.4 %
        (benchmarks/generic_options.py's agreement model). A transform that makes the layer's
        gradients itself (FSDP's flat parameters, its unsharded gradients, the optimizer in
        backward) still makes them all at the MLP's backward, but FSDP1's trainable layer units,
        whose views' gradients take these places (Note [FSDP1 flat gradient of a layer unit],
        trainmem/analytic/transforms/fsdp.py), and FSDP2's unsharded ones (Note [FSDP2
        post-backward], trainmem/analytic/transforms/fsdp2.py: ``places_layer_gradients``).
    """
    out = []
    for name in names:
        linear = name.rsplit(".", 1)[-1]
        if linear in _DOWN_PROJECTIONS:
            out.append(0)
        elif linear in _MLP_LINEARS:
            out.append(1)
        elif linear in _OUTPUT_PROJECTIONS:
            out.append(2)
        else:
            out.append(3)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class PipelineRank:
    """One pipeline stage as a rank sees it.

    Attributes:
        stage: stage index (0 = first).
        num_layers: transformer layers held (all of them without pipelining).
        in_flight: micro-batches whose activations the stage holds at once (Korthikanti et al.
            2022 sec. 4.2.3: the first 1F1B stage holds p; interleaving adds (p - 1) / v; GPipe
            holds all of them).
        has_embedding: holds the input embeddings (first stage; the last stage too for tied
            embeddings, as Megatron keeps a copy for the output layer).
        has_head: holds the final norm, the output layer and the loss (last stage).
    """

    stage: int
    num_layers: int
    in_flight: float
    has_embedding: bool
    has_head: bool


@dataclass(frozen=True, slots=True)
class RankContext:
    """What a transform may read: one rank's model, training setup and model states.

    Attributes:
        model / training: what is trained and how.
        rank: the pipeline stage this rank holds.
        emb_states / head_states / layer_states: this rank's parameter tensors before the
            layers, after them, and of one layer (:class:`~trainmem.analytic.tensor_states.
            TensorState`, bytes on this GPU; from the analytic layout or measured by a trace).
        head_grad_states / emb_grad_states: the tensors whose gradients the head's backward /
            the embedding's backward make (a tied embedding's with the head's).
        num_layers: layers on this rank.
        zero_stage: ZeRO / FSDP stage in effect (0 without sharding).
        grad_stream: CUDA stream the sharded gradients are made on (FSDP2's reduce-scatter
            stream, FSDP1's post-backward stream, with ``fsdp_collective_streams``; 0
            otherwise).
        prof: the activation profile (None for a step whose activations were recorded).
        builds_model_states: the step's model-state blocks are this context's own (the
            analytic builder allocates them from the layout), so a transform may lay them out
            as its framework does (Note [DeepSpeed's flat buffers at init]); False for a
            recorded step, whose traced blocks are re-sized in place
            (trainmem/traced_transforms.py).
        shared: schedule pieces that depend only on the model states (cached per layout).
        memo: terms derived from this context, computed once for the transforms that share them.
    """

    model: ModelSpec
    training: TrainingConfig
    rank: PipelineRank
    emb_states: list[TensorState]
    head_states: list[TensorState]
    layer_states: list[TensorState]
    head_grad_states: list[TensorState]
    emb_grad_states: list[TensorState]
    num_layers: int
    zero_stage: int
    grad_stream: int
    prof: ActivationProfile | None = None
    builds_model_states: bool = False
    shared: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)
    memo: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        model: ModelSpec,
        training: TrainingConfig,
        rank: PipelineRank,
        layout: StateLayout,
        prof: ActivationProfile | None = None,
        shared: dict[Any, Any] | None = None,
        *,
        builds_model_states: bool = False,
    ) -> RankContext:
        """The context of ``rank`` from the per-tensor layout (the analytic one, or one whose
        sizes a trace measured): a later stage holding a tied embedding keeps only the token
        embedding (Megatron's copy for the output layer)."""
        emb = layout.embedding if rank.has_embedding else []
        if rank.has_embedding and rank.stage > 0:
            emb = [s for s in layout.embedding if s.name == "embedding/tokens"]
        head = layout.head if rank.has_head else []
        tied = model.tie_word_embeddings and rank.has_head
        head_grads = head + [s for s in emb if tied and s.name == "embedding/tokens"]
        stage = training.zero_stage if training.sharding_degree > 1 else 0
        if training.zero_stage == 3 and training.conventions.zero_ipg_buckets:
            # DeepSpeed ZeRO-3 partitions and gathers on one rank too (Note [DeepSpeed ZeRO-3
            # parameter gathers])
            stage = 3
        streams = training.conventions.fsdp_collective_streams and stage == 3
        return cls(
            model=model,
            training=training,
            rank=rank,
            emb_states=emb,
            head_states=head,
            layer_states=layout.layer,
            head_grad_states=head_grads,
            emb_grad_states=[s for s in emb if s not in head_grads],
            num_layers=rank.num_layers,
            zero_stage=stage,
            grad_stream=REDUCE_SCATTER_STREAM if streams else 0,
            prof=prof,
            builds_model_states=builds_model_states,
            shared={} if shared is None else shared,
        )

    @property
    def profile(self) -> ActivationProfile:
        """The activation profile.

        Raises:
            ScheduleError: the context has none (a recorded step).
        """
        if self.prof is None:
            raise ScheduleError("this transform needs the analytic activation profile")
        return self.prof

    def trainable_elements(self) -> int:
        """Trainable elements on this rank before data-parallel sharding (its tensor-parallel
        slice of the embedding, head and layers)."""
        gb = max(dtype_bytes(self.training.grad_dtype), 1)
        outer = sum(s.full_grad_bytes for s in self.emb_states + self.head_states if s.trainable)
        layer = sum(s.full_grad_bytes for s in self.layer_states if s.trainable)
        return (outer + self.num_layers * layer) // gb


def keeps_gradients(training: TrainingConfig) -> bool:
    """The gradients are never freed: ``zero_grad(set_to_none=False)``, or a gradient buffer
    the framework allocates at wrap time (Megatron's ``grad_data``, DeepSpeed ZeRO-3's
    partition: :func:`~trainmem.analytic.buffers.gradient_buffer_from_init`), or DeepSpeed
    ``BF16_Optimizer``'s bf16 ones where it never frees them (Note [BF16_Optimizer's two
    gradients])."""
    never = training.bf16_optimizer_grads_released == "never"
    return not training.zero_grad_set_to_none or gradient_buffer_from_init(training) or never


class EmbeddingGradients(NamedTuple):
    """The token embedding's gradient transients on one rank, bytes.

    Attributes:
        vocab: the lookup's whole-vocabulary weight gradient (DTensor's partial one under a
            vocabulary-parallel embedding; the compute-dtype one before FSDP2 accumulates
            under pipelining).
        tied_lookup: the lookup's gradient of a tied weight (added into the head's).
        tied_sum: each of the redistributed shard and the out-of-place sum of a tied,
            vocabulary-parallel weight (Note [Tied embedding gradient under DTensor]).
        vocab_factor: how many times its tensor-parallel slice the token embedding's
            accumulated gradient is (the vocabulary-parallel degree, else 1).
        grad_factor: how many times its tensor-parallel slice the token embedding's kept
            ``.grad`` is (Note [Whole-vocabulary embedding gradient without FSDP]: the
            vocabulary-parallel degree, else 1).
    """

    vocab: int
    tied_lookup: int
    tied_sum: int
    vocab_factor: int
    grad_factor: int = 1


def embedding_gradients(ctx: RankContext) -> EmbeddingGradients:
    """The token embedding's gradient transients (``FrameworkConventions.
    dtensor_vocab_parallel_embedding``: a [V, h] partial gradient on each tensor-parallel
    rank; Note [Tied embedding gradient under DTensor]: whole-vocabulary on the rank that runs
    the lookup, tied to the head or not). The lookup reads the weight as gathered (bf16 under
    FSDP2's policy, the fp32 weight under autocast, whose embedding is not cast), and its
    gradient has that dtype.

    Note [Whole-vocabulary embedding gradient without FSDP]
        Without FSDP to reduce-scatter it (tensor parallelism alone, or beside pipelining),
        the untied lookup's whole-vocabulary gradient is the weight's ``.grad`` itself: a
        ``Replicate`` [V, h] DTensor beside the [V / t, h] ``Shard(0)`` weight, kept to the
        optimizer step (whose foreach ops take their shard of it) and freed by
        ``zero_grad``. torch 2.13's ``embedding_dense_backward_strategy``
        (torch/distributed/tensor/_ops/_embedding_ops.py) offers no ``Shard(0)`` output, and
        ``AccumulateGrad`` steals the incoming gradient as it is (accumulate_grad.h). Checked
        on torch 2.13.0: ``RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))``
        on a 64 x 8 ``nn.Embedding`` over 2 ranks (fake process group) leaves
        ``weight.grad`` ``Replicate()`` with a 64 x 8 local tensor, the weight 32 x 8. So no
        separate transient: the gradient is ``t`` times its slice (``grad_factor``). A tied
        weight's gradient is the out-of-place sum in the head's ``Shard(0)`` placement (Note
        [Tied embedding gradient under DTensor]) and keeps its slice.
    """
    cached = ctx.memo.get("embedding_gradients")
    if isinstance(cached, EmbeddingGradients):
        return cached
    t = ctx.training
    tp = t.tensor_parallel_size
    vocab_parallel = tp > 1 and t.conventions.dtensor_vocab_parallel_embedding

    def tokens(states: list[TensorState]) -> list[TensorState]:
        return [s for s in states if s.name == "embedding/tokens" and s.trainable]

    looked_up = tokens(ctx.emb_states) if ctx.rank.stage == 0 else []
    tied_here = bool(looked_up) and looked_up[0] in ctx.head_grad_states
    w_bytes = dtype_bytes(t.gathered_weight_dtype)
    tied_lookup = w_bytes * looked_up[0].numel if tied_here else 0
    vocab = w_bytes * looked_up[0].numel if vocab_parallel and looked_up else 0
    tied_sum = vocab // tp if tied_here else 0
    # FSDP's transforms size a tied lookup's gradient of its gathered weight themselves
    # (vocab_gradient_bytes); DeepSpeed's ZeRO-3 hooks run after AccumulateGrad as ZeRO-2's
    # (Note [A tied gradient under DeepSpeed ZeRO-2/3])
    fsdp = ctx.zero_stage >= 3 and not t.conventions.zero_ipg_buckets
    if tied_here and not vocab_parallel and not fsdp and head_reads_embedding(ctx):
        # Note [New gradients of the head and the embedding]: the lookup's gradient, added
        # into the head's in place only when that is a fresh tensor: the fp32 cast of an
        # autocast one, or a chunked head's sum of its chunks'
        vocab = tied_lookup
        cast = t.uses_autocast and t.gathered_weight_dtype != t.compute_dtype
        fresh = cast or chunked_head_weight_grad_bytes(ctx.model, t) > 0
        tied_sum = 0 if fresh else tied_lookup
    own = tokens(ctx.emb_grad_states)
    if own and tp == 1 and t.pipeline_parallel_size > 1 and t.zero_stage == 3:
        # FSDP2 under PP: the embedding's compute-dtype gradient exists before it is added
        # into the fp32 one accumulated over the micro-batches (to_accumulated_grad_if_needed)
        vocab = compute_and_residual_bytes(t)[0] * own[0].numel
    # Note [Whole-vocabulary embedding gradient without FSDP]
    whole = bool(vocab) and not tied_here and ctx.zero_stage < 3
    if whole:
        vocab = 0
    factors = (tp if vocab_parallel else 1, tp if whole else 1)
    out = EmbeddingGradients(vocab, tied_lookup, tied_sum, *factors)
    ctx.memo["embedding_gradients"] = out
    return out


_LM_HEADS = frozenset({"causal-lm", "masked-lm", "seq2seq-lm"})


def head_reads_embedding(ctx: RankContext) -> bool:
    """The output layer is a language-model head, the one that can read a tied token
    embedding (a classification head never does, whatever ``tie_word_embeddings`` says:
    transformers ``BertForSequenceClassification`` has no output embedding to tie)."""
    return ctx.model.head in _LM_HEADS


class Where(NamedTuple):
    """Where in the step a point is reached.

    Attributes:
        first_step: the warm-up step (buffers made lazily once are allocated in it).
        new_grads: this micro-batch's backward makes the gradients (the first of the step);
            later ones accumulate into them.
        reduce: the last micro-batch of a ``no_sync`` accumulation (it reduces the gradients).
        zero_grad: ``zero_grad()`` runs between this micro-batch's forward and backward.
        first_layer / last_layer: the layer runs first / last of the stack in this pass
            (execution order: the backward's first layer is the last one).
    """

    first_step: bool = False
    new_grads: bool = True
    reduce: bool = False
    zero_grad: bool = False
    first_layer: bool = False
    last_layer: bool = False


@dataclass(frozen=True, slots=True)
class Lifetime:
    """An allocation that lives until point ``release``: the :class:`Emitter` emits ``op`` where
    the transform returns it and its free (in the release point's phase) when ``release`` is
    reached, the tensors released at one point freed last-allocated first."""

    op: Op
    release: Point


Emitted = Op | Repeat | Lifetime

Group = Literal["head", "layer", "embedding"]
"""A parameter group whose gradients the base order makes."""


class Transform:
    """One mechanism as insertions into the base step order.

    Subclasses set :attr:`name`, override :meth:`applies` and the methods of the points they
    insert at (``step_begin`` for ``step.begin``, ``layer_mlp_post_backward`` for
    ``layer.mlp.post_backward`` ...), each returning the ops in insertion order. At a point the
    transforms emit in :data:`~trainmem.analytic.transforms.ORDER`, those that list the point in
    :attr:`late` after the others. The traits and the three hooks below (:meth:`gradients`,
    :meth:`vocab_gradient_bytes`, :meth:`first_layer_saved`) are the questions the base order
    asks of a mechanism.
    """

    name: ClassVar[str] = "transform"
    #: points where this transform's ops follow the other transforms'
    late: ClassVar[frozenset[Point]] = frozenset()
    #: steps each gradient in the backward: no optimizer phase of its own
    steps_in_backward: bool = False
    #: bytes of the logits it holds past the loss (taken from the loss's forward transients)
    held_logits: int = 0
    #: bytes of the returned KV cache / presents it holds past the loss (the base order then
    #: allocates none of its own)
    held_cache: int = 0
    #: every micro-batch frees what it allocates (Note [Balanced repeats])
    balanced_micro_batches: bool = True
    #: the last micro-batch of an accumulation reduces the gradients (``Where.reduce``)
    reduces_last_micro_batch: bool = False
    #: the root group's gradients (a tied weight's sum included) are released by this
    #: transform, not freed by the base order once made
    keeps_root_gradients: bool = False
    #: its layer ops differ at the ``"first"`` / ``"last"`` layer run (``Where.first_layer`` /
    #: ``last_layer``)
    layer_position: ClassVar[frozenset[str]] = frozenset()
    #: the layer gradient ops :meth:`gradients` returns are the same number per layer tensor,
    #: in the tensors' order, each tensor's placed where its linear's backward runs (Note
    #: [Gradients where their linear's backward runs]), not all at the MLP's backward
    places_layer_gradients: ClassVar[bool] = False

    def __init__(self, ctx: RankContext) -> None:
        self.ctx = ctx

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        """The mechanism is active on this rank."""
        return False

    def ops(self, point: Point, where: Where) -> Sequence[Emitted]:
        """The ops inserted at ``point``."""
        method: Callable[[Where], Sequence[Emitted]] = getattr(self, _METHOD[point])
        return method(where)

    def gradients(self, group: Group, where: Where) -> Sequence[Op] | None:
        """The ops that make ``group``'s gradients where the base order makes them (the head's
        in its backward, the layer's in its MLP's backward, the embedding's in its backward),
        replacing the base's; None: the base's (:func:`gradient_ops` when
        ``where.new_grads``). The first transform in order that answers decides."""
        return None

    def vocab_gradient_bytes(self, base: int) -> int:
        """Bytes of the token embedding's whole-vocabulary weight gradient, a transient of the
        embedding's backward, given the base order's (``base``)."""
        return base

    def tied_sum_bytes(self, base: int) -> int:
        """Bytes of a tied weight's gradient summed out of place at the embedding's backward
        (the head's and the lookup's), given the base order's (``base``: Note [Tied embedding
        gradient under DTensor])."""
        return base

    def first_layer_saved(
        self, saved: Sequence[tuple[str, int]]
    ) -> Sequence[tuple[str, int]] | None:
        """The blocks (term, bytes) the stack's first layer on this rank saves (its first
        layer run in the forward, its last in the backward), given those every other layer
        saves (``saved``); None: the same. The first transform in order that answers
        decides; it lists ``"first"`` and ``"last"`` in :attr:`layer_position`."""
        return None

    def setup(self, where: Where) -> Sequence[Emitted]:
        return ()

    def step_begin(self, where: Where) -> Sequence[Emitted]:
        return ()

    def micro_batches_begin(self, where: Where) -> Sequence[Emitted]:
        return ()

    def micro_batch_begin(self, where: Where) -> Sequence[Emitted]:
        return ()

    def stack_pre_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_pre_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_o_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_mlp_up_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_mlp_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_post_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def stack_post_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def head_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def head_post_forward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def forward_end(self, where: Where) -> Sequence[Emitted]:
        return ()

    def backward_begin(self, where: Where) -> Sequence[Emitted]:
        return ()

    def head_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def head_post_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def stack_pre_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_pre_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_o_recompute(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_mlp_up_recompute(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_mlp_pre_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_mlp_down_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_mlp_down_weight_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_mlp_post_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_attention_pre_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_attention_post_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def layer_post_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def stack_post_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def embedding_pre_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def embedding_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def embedding_post_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def root_post_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def micro_batch_end(self, where: Where) -> Sequence[Emitted]:
        return ()

    def micro_batches_end(self, where: Where) -> Sequence[Emitted]:
        return ()

    def step_post_backward(self, where: Where) -> Sequence[Emitted]:
        return ()

    def optimizer_begin(self, where: Where) -> Sequence[Emitted]:
        return ()

    def optimizer_step(self, where: Where) -> Sequence[Emitted]:
        return ()

    def optimizer_end(self, where: Where) -> Sequence[Emitted]:
        return ()

    def step_post_optimizer(self, where: Where) -> Sequence[Emitted]:
        return ()

    def step_end(self, where: Where) -> Sequence[Emitted]:
        return ()


_METHOD: dict[Point, str] = {p: p.replace(".", "_") for p in POINTS}


class Emitter:
    """The ops of a list of transforms at each point, with the frees their lifetimes imply.

    Use one emitter per piece built (a micro-batch, a step): every :class:`Lifetime` begun in
    it must reach its release point in it (:meth:`check`)."""

    def __init__(
        self, transforms: Sequence[Transform], table: Mapping[Point, tuple[int, ...]] | None = None
    ) -> None:
        """``table``: :func:`point_table` of ``transforms`` when the caller has it (a builder
        makes about twelve emitters of one list)."""
        self.transforms = transforms
        self._pending: dict[Point, list[Op]] = {}
        self._at = point_table(transforms) if table is None else table

    def at(self, point: Point, where: Where) -> list[Item]:
        """The transforms' ops at ``point`` in order, then the frees of the lifetimes that end
        there (last allocated first)."""
        out: list[Item] = []
        here = self._at[point]
        if not here and point not in self._pending:  # NB: most points of most ranks
            return out
        for k in here:
            for item in self.transforms[k].ops(point, where):
                if isinstance(item, Lifetime):
                    out.append(item.op)
                    self._pending.setdefault(item.release, []).append(item.op)
                else:
                    out.append(item)
        ending = self._pending.pop(point, None)
        if ending:
            phase = PHASE[point]
            out += [free(op, phase) for op in reversed(ending)]
        return out

    def check(self) -> None:
        """Every lifetime begun has ended.

        Raises:
            ScheduleError: one has not (its release point was never reached).
        """
        if self._pending:
            raise ScheduleError(f"lifetimes never released: {sorted(self._pending)}")


def point_table(transforms: Sequence[Transform]) -> Mapping[Point, tuple[int, ...]]:
    """Per point, the indices of ``transforms`` that insert there (:func:`_point_table`)."""
    return _point_table(tuple(type(t) for t in transforms))


@cache
def _point_table(kinds: tuple[type[Transform], ...]) -> dict[Point, tuple[int, ...]]:
    """Per point, the indices of the transforms that insert there (override its method), the
    late ones last (NB: the builder asks about forty points per layer body)."""
    table: dict[Point, tuple[int, ...]] = {}
    for point in POINTS:
        method = _METHOD[point]
        here = [
            k
            for k, kind in enumerate(kinds)
            if getattr(kind, method) is not getattr(Transform, method)
        ]
        early = [k for k in here if point not in kinds[k].late]
        table[point] = tuple(early + [k for k in here if point in kinds[k].late])
    return table


def flat_layer_unit(ctx: RankContext) -> bool:
    """Whether a layer unit's sharded parameters, gradients and optimizer states are each one
    flat tensor (Note [FSDP1 flat blocks of a layer unit]): FSDP1 with ``use_orig_params=False``
    (accelerate's FSDP, fsdp_qlora, torchtune before 0.3) sharding a full fine-tune's layers
    (ZeRO-2/3 over more than one rank), without pipelining, tensor parallelism or offload.

    Note [FSDP1 flat blocks of a layer unit]
        FSDP1 flattens a unit's parameters into one ``FlatParameter`` and keeps this rank's
        shard of it as one tensor (torch 2.13 distributed/fsdp/_flat_param.py
        ``FlatParamHandle.flatten_tensors`` / ``shard``: ``flat_param._local_shard``, the
        unsharded numel padded to a multiple of the world size, ``_get_unpadded_shard``; no
        padding between tensors with ``use_orig_params=False``: ``_aligned_numel`` 0), so its
        sharded gradient is one tensor too (``_post_backward_hook`` -> ``_reduce_grad``: the
        reduce-scatter's output, one chunk of the padded flat gradient, becomes
        ``flat_param.grad``), and the optimizer, which sees one parameter per unit, keeps one
        tensor per state of it (torch/optim/adamw.py ``_init_group``: ``state["exp_avg"] =
        torch.zeros_like(p)``, ``state["exp_avg_sq"]`` likewise, per parameter); its foreach
        step's temporaries are the flat shard's. The formulas' per-tensor blocks would sum to
        the same bytes (to within the padding) but the caching allocator packs many small
        blocks into shared 20 MiB segments where the flat ones take a segment each: traced
        (torch's FSDP1 on fake tensors, trainmem.trace.fsdp) on a 4-layer 1024-wide Qwen2
        full fine-tune, 4 ranks: 11,275,776 B per layer state, one 12 MiB segment each.
    """
    t = ctx.training
    fsdp1 = t.framework in ("fsdp-qlora", "accelerate-fsdp") or (
        t.framework == "torchtune" and t.torchtune_release < (0, 3, 0)
    )
    return (
        fsdp1
        and not t.is_lora
        and ctx.zero_stage >= 2
        and t.sharding_degree > 1
        and t.pipeline_parallel_size == 1
        and t.tensor_parallel_size == 1
        and t.offload == "none"
    )


def _flat_bytes(values: Sequence[int], locals_: Sequence[int], dp: int) -> int:
    """One flat shard's bytes from its tensors' shard bytes ``values`` (elements ``locals_``
    before sharding over ``dp`` ranks): the padded flat shard's ``ceil(sum / dp)`` elements at
    the tensors' common bytes per shard element, or the plain sum when they have none (an
    unsharded field, or mixed widths)."""
    shards = [-(-n // dp) for n in locals_]
    first = values[0] / shards[0] if shards[0] else 0.0
    uniform = all(v * shards[0] == values[0] * s for v, s in zip(values, shards, strict=True))
    if not uniform or not first:
        return sum(values)
    return round(first * -(-sum(locals_) // dp))


def unit_states(ctx: RankContext, states: Sequence[TensorState]) -> Sequence[TensorState]:
    """``states``, or, when they are a layer's under :func:`flat_layer_unit`, one state for
    the whole unit (name ``flat``; its bytes :func:`_flat_bytes` of each field; computed once
    per context)."""
    if states is not ctx.layer_states or not states or not flat_layer_unit(ctx):
        return states
    cached = ctx.memo.get("flat_unit")
    if isinstance(cached, list):
        return cached
    dp = ctx.training.sharding_degree
    locals_ = [s.local_numel or s.numel for s in states]

    def flat(name: str) -> int:
        return _flat_bytes([getattr(s, name) for s in states], locals_, dp)

    merged = TensorState(
        states[0].owner, "flat", sum(s.numel for s in states),
        any(s.trainable for s in states), flat("param_bytes"), flat("grad_bytes"),
        flat("state_bytes"), sum(s.full_param_bytes for s in states),
        sum(s.full_grad_bytes for s in states), flat("paged_state_bytes"), sum(locals_),
    )  # fmt: skip
    ctx.memo["flat_unit"] = out = [merged]
    return out


def outer_parameter_ops(ctx: RankContext) -> list[Op]:
    """The parameters outside the layers (embedding, head) as the step's setup allocates
    them, one block per tensor (key ``param/<owner>/<n>``)."""
    return [
        alloc(s.param_bytes, Cat.PARAMETER, "init", f"param/{s.owner}/{n}", s.owner)
        for n, s in enumerate(ctx.emb_states + ctx.head_states)
    ]


def layer_parameter_ops(ctx: RankContext) -> list[Op]:
    """One layer's parameters as the step's setup allocates them (key ``param/{i}/<n>``; one
    flat shard per unit: Note [FSDP1 flat blocks of a layer unit])."""
    return [
        alloc(s.param_bytes, Cat.PARAMETER, "init", f"param/{{i}}/{n}", "layers.{i}")
        for n, s in enumerate(unit_states(ctx, ctx.layer_states))
    ]


def gradient_ops(
    ctx: RankContext, states: Sequence[TensorState], phase: Phase, key: str, module: str
) -> list[Op]:
    """The gradients of ``states`` as this rank holds them between backward and step (one per
    tensor, or one per FSDP1 layer unit: :func:`unit_states`; key ``grad/<key>/<n>``; the
    token embedding's whole-vocabulary one: Note [Whole-vocabulary embedding gradient without
    FSDP])."""
    whole = embedding_gradients(ctx).grad_factor if ctx.emb_grad_states else 1

    def factor(s: TensorState) -> int:
        return whole if s.name == "embedding/tokens" and s in ctx.emb_grad_states else 1

    return [
        alloc(s.grad_bytes * factor(s), Cat.GRADIENT, phase, f"grad/{key}/{n}", module,
              "gradients", ctx.grad_stream)
        for n, s in enumerate(unit_states(ctx, states))
    ]  # fmt: skip


def all_gradients(ctx: RankContext, phase: Phase) -> list[Item]:
    """Every gradient allocated at once (kept by ``zero_grad(set_to_none=False)``)."""
    layer = gradient_ops(ctx, ctx.layer_states, phase, "{i}", "layers.{i}")
    return [
        *gradient_ops(ctx, ctx.head_grad_states, phase, "head", "head"),
        Repeat(tuple(layer), ctx.num_layers),
        *gradient_ops(ctx, ctx.emb_grad_states, phase, "embedding", "embedding"),
    ]


def free_gradients(ctx: RankContext, phase: Phase) -> list[Item]:
    """The frees of :func:`all_gradients`, in the same order."""
    head = gradient_ops(ctx, ctx.head_grad_states, phase, "head", "head")
    layer = gradient_ops(ctx, ctx.layer_states, phase, "{i}", "layers.{i}")
    emb = gradient_ops(ctx, ctx.emb_grad_states, phase, "embedding", "embedding")
    return [
        *(free(op, phase) for op in head),
        Repeat(tuple(free(op, phase) for op in layer), ctx.num_layers),
        *(free(op, phase) for op in emb),
    ]


def splice(
    ops: Sequence[Item],
    positions: Mapping[Point, int],
    transforms: Sequence[Transform],
    where: Where | None = None,
) -> list[Item]:
    """``ops`` (a recorded step, e.g. :meth:`~trainmem.schedule.StepSchedule.from_timeline`'s
    ``step``) with the transforms' ops inserted: the ops of point ``p`` go before
    ``ops[positions[p]]`` (``len(ops)``: at the end), points met in step order
    (:data:`~trainmem.analytic.transforms.points.POINTS`) at one position, points not in
    ``positions`` are skipped. The trace engine's steps are one flat run of ops, so the layer
    points (whose ops a ``Repeat`` body would carry) are for the analytic builder.

    Raises:
        ScheduleError: a position outside ``ops`` or before an earlier point's, or a lifetime
            whose release point is not in ``positions``.
    """
    where = Where() if where is None else where
    em = Emitter(transforms)
    at: dict[int, list[Item]] = {}
    last = 0
    for point in POINTS:
        if point not in positions:
            continue
        index = positions[point]
        if not last <= index <= len(ops):
            raise ScheduleError(
                f"point {point}: position {index} outside {last}..{len(ops)} (points go in "
                "step order)"
            )
        last = index
        at.setdefault(index, []).extend(em.at(point, where))
    em.check()
    out: list[Item] = []
    for index, item in enumerate(ops):
        out += at.get(index, [])
        out.append(item)
    out += at.get(len(ops), [])
    return out


def tied_sum_op(size: int) -> Op:
    """The tied weight's gradient: the head's plus the lookup's, added out of place (Note
    [Tied embedding gradient under DTensor])."""
    return alloc(
        size,
        Cat.TEMPORARY,
        "backward",
        "grad/embedding/tied_sum",
        "embedding",
        "the tied weight's gradient: the head's plus the lookup's, added out of place",
    )
