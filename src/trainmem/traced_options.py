"""Training options the trace cannot run for real, applied to a traced step as the analytic
engine's rules (issue 26: "every training option on every model path").

Each option here is one :class:`TracedOption`: the settings the trace runs in its place
(:meth:`TracedOption.traced_as`, e.g. one rank without data parallelism) and the rewrite of the
traced :class:`~trainmem.schedule.StepSchedule` into the one the option has, with the same rule
the analytic engine's transform for it uses (:mod:`trainmem.analytic.transforms`). What the
trace runs as it is (FSDP2, DTensor, pipelining, peft, compile) stays in :mod:`trainmem.trace`;
DeepSpeed ZeRO-1/2 and the quantized optimizers are :mod:`trainmem.traced_transforms`;
Unsloth's micro-batches are :mod:`trainmem.traced_unsloth`'s rewrite.

Note [DDP on a traced step]
    torch's ``DistributedDataParallel`` does not wrap a model of fake tensors usefully: its
    ``Reducer`` (C++, torch/csrc/distributed/c10d/reducer.cpp) builds the flat bucket tensors
    outside the Python dispatcher the recorder sees, and its collectives need a process group
    the fake one answers without data. What a DDP rank holds beyond the plain loop is the
    reducer's flat buckets (Note [DDP gradient buckets] in trainmem/analytic/transforms/ddp.py):
    every trainable parameter's gradient bytes in the parameter's dtype, allocated at wrap time
    and never freed. So the plain loop of one rank is traced (``data_parallel_size=1``) and the
    buckets are allocated after the state the step starts from, sized as the most gradient
    bytes the traced step holds (every ``.grad`` before ``zero_grad``: each trainable
    parameter's gradient in its own dtype, fp32 LoRA adapters included), which is what
    :class:`~trainmem.analytic.transforms.ddp.DdpReducer` sums from the analytic layout. It
    needs no ModelSpec, so it applies to every traced model (diffusers, timm, remote code).

Note [Offload on a traced step]
    CPU offload (torchao's ``CPUOffloadOptimizer`` outside ZeRO / FSDP, FSDP2's
    ``CPUOffloadPolicy`` / the optimizer on the CPU beside FSDP) moves model states to host
    memory and runs the optimizer step there; the forward and backward on the GPU are the
    same. So the step is traced with ``offload="none"`` and rewritten with the analytic
    engine's per-tensor rule (:func:`~trainmem.analytic.tensor_states.offloaded`, the one
    ``build_state_layout`` places tensors with):

    * an offloaded tensor's optimizer states (the traced events under the parameter's name)
      and, with ``optimizer+params``, its weights, become 0 bytes on the GPU;
    * the optimizer phase's temporaries become 0 bytes (the step runs on the CPU; the analytic
      ``Optimizer`` transform inserts none under offload);
    * with ``optimizer+gradients`` / ``optimizer+params``, an offloaded gradient stays on the
      GPU only until its layer's gradients are all made (the analytic engine's ``reduce``
      term: a layer's gradients alive through its backward), outside the layers it leaves at
      once; under torchao's ``offload_gradients=True``, which copies each to the CPU in its
      post-accumulate-grad hook and frees it there, it leaves as soon as it is made (Note
      [torchao gradient offload] in trainmem/analytic/transforms/offload.py); ``zero_grad``
      has nothing left to free.

Note [Optimizer in backward on a traced step]
    torchtune's ``optimizer_in_bwd`` steps each parameter in its post-accumulate-grad hook and
    frees its gradient there (torchtune training/_optimizer_in_bwd.py ``register_optim_in_bwd
    _hooks``: ``optim_dict[param].step(); optim_dict[param].zero_grad()``; torch runs the hook
    once the gradient is accumulated into ``.grad``, torch/_tensor.py
    ``register_post_accumulate_grad_hook``), so a gradient lives only from its allocation to
    its own step and no optimizer phase follows. The trace runs the optimizer after the
    backward; the rewrite frees every gradient right after it is made, its own step's
    temporaries between (the analytic ``per_parameter_step_ops``: torchtune builds one
    optimizer per parameter), drops the ``zero_grad`` frees and the step after the backward.
    A tied weight's gradient is the exception: its ``AccumulateGrad`` node has two inputs
    (the head's matmul and the lookup), and the engine runs it, and so the hook, once, when
    the last has arrived (torch/csrc/autograd/engine.cpp ``evaluate_function``: a node is
    ready when its dependencies count reaches zero; the parts are summed in its
    ``InputBuffer``, in place into the head's part, input_buffer.cpp ``InputBuffer::add``;
    accumulate_grad.cpp runs ``tensor_post_acc_grad_hooks`` after ``accumulateGrad``). The
    trace records the head's part as the gradient (its storage becomes ``.grad``), so the
    rewrite steps and frees a gradient made at a module that owns no traced parameter (a tied
    head: its weight is the embedding's) at the end of the backward, after the lookup's part
    is added and freed, as the analytic ``Optimizer`` transform holds it; checked on a real CPU
    run (tests/test_optimizer_in_backward_tied.py: the hook fires once, after the embedding's
    backward). llama-3.2-1b (tied), 2 x 256, generic / formulas - 1: +5.41 -> +0.00 %.
    The optimizer states are the traced ones. With CPU
    offload (no optimizer in backward) a gradient leaves once its layer's are all made.

    A tensor's elements come from its traced bytes in the weight dtype (LoRA adapters in
    theirs), which decides torchao's 4096-element threshold.

Source: torch/nn/parallel/distributed.py, torch/csrc/distributed/c10d/reducer.cpp (cited per
rule in the Notes); the analytic transforms named per option.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from trainmem.analytic.held_outputs import graph_held_input_bytes, previous_output_bytes
from trainmem.analytic.tensor_states import Offloaded, offloaded, state_layout
from trainmem.analytic.transforms.base import alloc, free
from trainmem.analytic.transforms.ddp import bucket_op
from trainmem.analytic.transforms.offload import torchao_gradient_offload
from trainmem.analytic.transforms.optimizer import per_parameter_step_ops
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.errors import UnsupportedError
from trainmem.schedule import Item, Op, Repeat, StepSchedule
from trainmem.specs.frameworks import HF_TRAINER_STACKS, LITGPT_INSTALL, litgpt_last_chunk_rows
from trainmem.specs.model import ModelSpec
from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.specs.training import TrainingConfig
from trainmem.traced_activations import apply_activation_offloading
from trainmem.traced_megatron import (
    apply_megatron,
    megatron_note,
    megatron_traced_as,
    traced_megatron,
)
from trainmem.traced_releases import (
    apply_release,
    litgpt_release_note,
    litgpt_release_traced_as,
    release_note,
    release_traced_as,
    traced_litgpt_release,
    traced_release,
)
from trainmem.traced_transforms import (
    after_state,
    element_bytes,
    forward_allocs_outside_layers,
    layer_of,
    state_and_micro_batches,
    traced_tensor_states,
)
from trainmem.traced_unsloth import apply_unsloth, traced_unsloth, unsloth_traced_as

__all__ = [
    "MEGATRON",
    "OPTIONS",
    "TracedOption",
    "active_options",
    "apply_ddp",
    "apply_offload",
    "apply_previous_loop",
    "paged_states",
    "traced_ddp",
    "traced_offload",
    "traced_previous_loop",
    "traced_settings",
    "untraced_data_parallel",
    "untraced_framework",
    "untraced_fsdp1_quantized",
    "untraced_offload",
]


@dataclass(frozen=True, slots=True)
class TracedOption:
    """One option applied to a traced step.

    Attributes:
        name: what the estimate's note calls it.
        applies: the option is asked for and this rule models it.
        traced_as: the settings the trace runs instead (the option taken out).
        apply: the traced step (of ``traced_as``'s settings) as the run asked for has it;
            given the model's shape when it has a ModelSpec (None otherwise).
        note: one line for the estimate's notes.
    """

    name: str
    applies: Callable[[TrainingConfig], bool]
    traced_as: Callable[[TrainingConfig], TrainingConfig]
    apply: Callable[[StepSchedule, ModelSpec | None, TrainingConfig], StepSchedule]
    note: Callable[[TrainingConfig], str]


# -- Megatron-LM -------------------------------------------------------------------------------

MEGATRON = TracedOption(
    name="megatron",
    applies=traced_megatron,
    traced_as=megatron_traced_as,
    apply=apply_megatron,
    note=megatron_note,
)
"""Megatron's optimizer and gradient buffer on the traced step of one rank (Note [Megatron on
a traced step] in trainmem/traced_megatron.py); its loss runs in the trace
(trainmem/trace/megatron_loss.py)."""

# -- plain DDP ---------------------------------------------------------------------------------


def traced_ddp(training: TrainingConfig) -> bool:
    """Plain data parallelism the traced paths model (Note [DDP on a traced step]): ZeRO stage 0
    over more than one rank under a framework that wraps with torch DDP
    (``FrameworkConventions.ddp_reducer_buckets``), without tensor, context or pipeline
    parallelism (as :class:`~trainmem.analytic.transforms.ddp.DdpReducer`)."""
    t = training
    return (
        t.conventions.ddp_reducer_buckets
        and t.data_parallel_size > 1
        and t.zero_stage == 0
        and t.tensor_parallel_size == 1
        and t.context_parallel_size == 1
        and t.pipeline_parallel_size == 1
    )


def apply_ddp(
    schedule: StepSchedule, model: ModelSpec | None, training: TrainingConfig
) -> StepSchedule:
    """The traced single-rank step with DDP's flat gradient buckets (Note [DDP on a traced
    step]): one allocation of the step's most gradient bytes, after the state the step starts
    from (weights, buffers), kept for the run.

    Args:
        schedule: a traced step of one rank without data parallelism.
        model: unused (the sizes are the traced gradients').
        training: the DDP run.

    Returns:
        The schedule with the buckets in its setup (or its leading state, for a flat one).
    """
    bucket = bucket_op(schedule.category_peak(Cat.GRADIENT))
    if schedule.setup:
        setup = after_state(schedule.setup, bucket)
        return StepSchedule(setup=setup, step=schedule.step, name=schedule.name)
    return StepSchedule(setup=(), step=after_state(schedule.step, bucket), name=schedule.name)


DDP = TracedOption(
    name="ddp",
    applies=traced_ddp,
    traced_as=lambda t: replace(t, data_parallel_size=1),
    apply=apply_ddp,
    note=lambda t: (
        f"DDP over {t.data_parallel_size} ranks: one rank's plain loop was traced and torch "
        "DDP's flat gradient buckets added (every trainable gradient's bytes, kept from wrap "
        "time; Note [DDP on a traced step] in trainmem/traced_options.py)"
    ),
)

# -- CPU offload -------------------------------------------------------------------------------


def traced_offload(training: TrainingConfig) -> bool:
    """CPU offload or optimizer-in-backward the traced paths model (Notes [Offload on a traced
    step], [Optimizer in backward on a traced step]): offload in every mode outside DeepSpeed
    (whose offload lives in its ZeRO optimizer: :func:`~trainmem.traced_transforms.
    apply_deepspeed`)."""
    offload = training.offload != "none" and training.framework != "deepspeed"
    return offload or training.optimizer_in_backward


def apply_offload(
    schedule: StepSchedule, model: ModelSpec | None, training: TrainingConfig
) -> StepSchedule:
    """The traced step without offload and with the step after the backward as
    ``training``'s ``offload`` and ``optimizer_in_backward`` have it (Notes [Offload on a
    traced step] and [Optimizer in backward on a traced step]).

    Args:
        schedule: a traced step of the same run with ``offload="none"`` and the optimizer
            after the backward.
        model: unused (the sizes are the traced tensors').
        training: the run (``offload``, the framework's offload implementation,
            ``optimizer_in_backward``).

    Returns:
        The schedule with the offloaded states, weights and gradients off the GPU, the
        released gradients freed in the backward and the optimizer step's temporaries gone.

    Raises:
        ScheduleError: a rewritten free that pairs with no allocation.
    """
    rewrite = _Release.of(schedule, training)
    out = StepSchedule(
        setup=tuple(rewrite.items(schedule.setup)),
        step=tuple(rewrite.items(schedule.step)),
        name=schedule.name,
    )
    list(out.events())  # every free pairs with its allocation
    return out


@dataclass(slots=True)
class _Release:
    """The offload rule (:func:`~trainmem.analytic.tensor_states.offloaded`) per traced tensor
    (a parameter's elements from its allocation, whose name is the module of its optimizer
    states; a gradient's from its own bytes) and optimizer-in-backward's release of every
    gradient."""

    training: TrainingConfig
    numel: dict[str, int]
    moved: set[str]

    @classmethod
    def of(cls, schedule: StepSchedule, training: TrainingConfig) -> _Release:
        numel = {}
        for op in _ops(schedule.setup + schedule.step):
            if op.action == "alloc" and op.category is Cat.PARAMETER:
                numel[op.module] = op.size_bytes // element_bytes(training, op.module)
        return cls(training, numel, set())

    def _off(self, elements: int) -> Offloaded:
        return offloaded(self.training, elements)

    def _resized(self, op: Op) -> Op:
        cat = op.category
        if cat is Cat.OPTIMIZER_STATE and op.module in self.numel:
            off = self._off(self.numel[op.module]).state
        elif cat is Cat.PARAMETER and op.module in self.numel:
            off = self._off(self.numel[op.module]).param
        else:  # the step's own temporaries: the step runs on the CPU or per gradient
            off = cat is Cat.TEMPORARY and op.phase == "optimizer"
        return op._replace(size_bytes=0) if off else op

    def _leaves(self, op: Op) -> bool:
        """A new gradient that is released in the backward (stepped, or sent to the CPU)."""
        if op.category is not Cat.GRADIENT or op.action != "alloc" or op.phase != "backward":
            return False
        if self.training.optimizer_in_backward:
            return True
        return self._off(op.size_bytes // element_bytes(self.training, op.module)).grad

    def _tied(self, op: Op) -> bool:
        """A gradient made at a module that owns no traced parameter: a tied head's, whose
        weight is the embedding's (Note [Optimizer in backward on a traced step])."""
        if not self.numel or layer_of(op.module):
            return False
        return not any(name.startswith(f"{op.module}.") for name in self.numel)

    def items(self, items: Sequence[Item]) -> list[Item]:
        """``items`` rewritten: a released gradient is freed right after it is made
        (optimizer in backward; a tied one at the end of the backward) or once its layer's
        gradients are all made (offload; outside the layers: at once), and its own later
        free dropped."""
        last: dict[str, int] = {}
        for k, item in enumerate(items):
            if isinstance(item, Op) and self._leaves(item):
                last[layer_of(item.module) or f"#{k}"] = k
        backward_end = max(
            (
                k
                for k, item in enumerate(items)
                if isinstance(item, Op) and item.phase == "backward"
            ),
            default=-1,
        )
        out: list[Item] = []
        pending: list[Op] = []
        tied: list[Op] = []
        for k, item in enumerate(items):
            if k == backward_end + 1:
                out += tied
                tied = []
            if isinstance(item, Repeat):
                body = tuple(self.items(item.body))
                out.append(Repeat(body, item.count, item.reverse, item.start, item.independent))
                continue
            if item.category is Cat.GRADIENT and item.action == "free" and item.key in self.moved:
                continue
            out.append(self._resized(item))
            if self._leaves(item):
                self.moved.add(item.key)
                if self.training.optimizer_in_backward:  # stepped and freed in its own hook
                    stepped = [
                        *per_parameter_step_ops(self.training, item),
                        item._replace(action="free"),
                    ]
                    if self._tied(item) and k < backward_end:
                        tied += stepped
                    else:
                        out += stepped
                    continue
                if torchao_gradient_offload(self.training):  # sent to the CPU by its hook
                    out.append(item._replace(action="free"))
                    continue
                pending.append(item._replace(action="free"))
            group = layer_of(item.module) or f"#{k}"
            if pending and last.get(group) == k:
                out += [op for op in pending if (layer_of(op.module) or f"#{k}") == group]
                pending = [op for op in pending if (layer_of(op.module) or f"#{k}") != group]
        return out + tied + pending


def _ops(items: Sequence[Item]) -> list[Op]:
    out: list[Op] = []
    for item in items:
        out += [item] if isinstance(item, Op) else _ops(item.body)
    return out


def _release_note(t: TrainingConfig) -> str:
    if t.offload == "none":
        return (
            "optimizer_in_backward: the step was traced with the optimizer after the backward, "
            "then each gradient freed once its layer's gradients are made (stepped in its "
            "post-accumulate-grad hook) and the step's temporaries dropped (Note [Optimizer in "
            "backward on a traced step] in trainmem/traced_options.py)"
        )
    return (
        f"offload={t.offload}: the step was traced without offload and the offloaded model "
        "states taken off the GPU by the analytic engine's rule (torchao's CPUOffloadOptimizer "
        "keeps tensors under 4096 elements; gradients leave once their layer's backward is "
        "done, under torchao's offload_gradients as soon as each is made; the step's "
        "temporaries are on the CPU; Note [Offload on a traced step])"
    )


OFFLOAD = TracedOption(
    name="offload",
    applies=traced_offload,
    traced_as=lambda t: replace(t, offload="none", optimizer_in_backward=False),
    apply=apply_offload,
    note=_release_note,
)

# -- paged optimizers -------------------------------------------------------------------------


def paged_states(
    model: str | ModelSpec, training: TrainingConfig, schedule: StepSchedule | None = None
) -> int:
    """Bytes of a bitsandbytes paged optimizer's states in CUDA managed memory, outside the
    caching allocator (:func:`~trainmem.analytic.tensor_states.paged_state_bytes` per tensor:
    tensors of at least 1e5 elements) of the analytic layout, or, for a model without a
    ModelSpec, of the tensors of the traced ``schedule`` (before its optimizer is replaced;
    Note [Traced tensors as model states] in trainmem/traced_transforms.py); 0 for another
    optimizer. The traced step runs a stand-in for the optimizer
    (:func:`~trainmem.traced_transforms.optimizer_standin`) whose states the analytic
    ``Optimizer`` transform replaces with the allocator-side ones."""
    if not OPTIMIZER_TABLE[training.optimizer].paged:
        return 0
    if isinstance(model, ModelSpec):
        return state_layout(model, training).total("paged_state_bytes")
    if schedule is None:
        return 0
    return sum(s.paged_state_bytes for s in traced_tensor_states(schedule, training))


ACTIVATION_OFFLOADING = TracedOption(
    name="activation offloading",
    applies=lambda t: t.activation_offloading,
    traced_as=lambda t: replace(t, activation_offloading=False),
    apply=apply_activation_offloading,
    note=lambda t: (
        "activation offloading: the step was traced without it, then each layer's saved "
        "activations freed once the next layer's forward has run and prefetched when its "
        "backward begins, as the analytic engine's ActivationOffloading transform has them "
        "(Note [Activation offloading on a traced step] in trainmem/traced_activations.py)"
    ),
)

# -- the loop that holds the previous micro-batch ----------------------------------------------


def traced_previous_loop(training: TrainingConfig) -> bool:
    """The ``previous`` loop the traced paths model (Note [The previous loop on a traced step]):
    without pipelining (its stages hand on outputs of their own)."""
    return training.training_loop == "previous" and training.pipeline_parallel_size == 1


def apply_previous_loop(
    schedule: StepSchedule, model: ModelSpec | None, training: TrainingConfig
) -> StepSchedule:
    """The traced step of the ``previous`` loop with the previous micro-batch's hold added.

    Note [The previous loop on a traced step]
        A loop that binds ``logits = model(...)`` in its own scope holds the previous
        micro-batch's output, and what its graph keeps (bitsandbytes linears' inputs stored as
        ``ctx`` attributes), until the next forward returns (Note [The previous micro-batch's
        graph] in trainmem/analytic/held_outputs.py). The traced step runs the loop's own
        binding (``run_step``'s ``hold_output``: each micro-batch's output held through its
        backward, the last one's through ``optimizer.step()``, Note [The current
        micro-batch's bound output] in trainmem/analytic/transforms/loop.py), but one
        micro-batch after another with nothing before the first and each output released
        before the next forward, so each micro-batch (the warm-up step's too, as after an
        earlier step) is given, at its start, the previous one's output
        (:func:`~trainmem.analytic.held_outputs.previous_output_bytes`) and graph-held inputs
        (:func:`~trainmem.analytic.held_outputs.graph_held_input_bytes`), as the analytic
        ``TrainingLoop`` transform allocates them at ``micro_batch.begin``; they are freed once
        this micro-batch's own logits exist (the last forward allocation of the logits' size
        by a module outside the block lists: the head's output, the analytic
        ``head.post_forward``), or when its backward begins if no such tensor is traced. Both
        sizes are read from the model's shape (an LM head's b x s x V logits); a model
        without a ModelSpec has them from its trace (Note [The previous output of a model
        without a ModelSpec]).

    Args:
        schedule: the traced step (each output held through its own backward).
        model: the model's shape.
        training: the run (loop ``previous``).

    Returns:
        The schedule with the previous micro-batch's output and graph in every micro-batch.

    Raises:
        UnsupportedError: a model without a ModelSpec whose traced step holds no output.
    """
    if model is None:
        return _hold_traced_output(schedule)
    output = previous_output_bytes(model, training)
    graph = graph_held_input_bytes(model, training, num_layers=model.num_layers, has_head=True)
    logits = _bound_output_last_bytes(model, training, output)
    held = [
        op
        for op in (
            alloc(graph, Cat.ACTIVATION, "forward", "previous/graph", "layers",
                  "the previous micro-batch's quantized-linear inputs, kept by its graph"),
            alloc(output, Cat.TEMPORARY, "forward", "previous/logits", "head",
                  "the previous micro-batch's logits, held by the loop"),
        )
        if op.size_bytes
    ]  # fmt: skip
    if not held:
        return schedule
    return StepSchedule(
        setup=tuple(_hold_previous(schedule.setup, held, _logits_of(logits))),
        step=tuple(_hold_previous(schedule.step, held, _logits_of(logits))),
        name=schedule.name,
    )


def _hold_traced_output(schedule: StepSchedule) -> StepSchedule:
    """:func:`apply_previous_loop` on a model without a ModelSpec: the previous micro-batch's
    output as its trace has it.

    Note [The previous output of a model without a ModelSpec]
        A diffusers denoiser or a timm classifier has no LM head to size the output from, but
        its traced step holds the output the loop binds: ``run_step``'s ``hold_output`` keeps
        the last micro-batch's output (and the graph behind it, with what its nodes keep as
        ``ctx`` attributes past the backward: bitsandbytes linears' inputs) until
        ``optimizer.step()`` returns, so the forward allocations of the last micro-batch freed
        in the step's optimizer phase are exactly what the binding holds: a denoiser's
        noise / velocity prediction (the latents' shape in the model's output dtype), a
        classifier's b x classes logits. Each micro-batch is given copies of them at its start
        (the warm-up step's too, as after an earlier step), freed once its own output exists
        (after its last forward allocation of the last-made held tensor's size by the same
        module), as the LM rule above does with the formulas' sizes. The loops that do this:
        diffusers' training scripts bind ``model_pred = transformer(...)`` in the loop's scope
        (examples/dreambooth/train_dreambooth_lora_flux.py, v0.40.0 lines 1697-1857: rebound to
        ``FluxPipeline._unpack_latents(model_pred, ...)``, the same bytes, only after the next
        forward returns; so is ``target = noise - model_input``, one more latent-sized tensor,
        which the trace draws inside the loss: Note [diffusers training step]); timm's
        train.py binds ``output = model(input)`` inside its ``_forward()`` closure, which
        returns the loss alone, so timm's own loop holds nothing: ``--loop previous`` is a
        user's loop that keeps ``output`` in its own scope.

    Raises:
        UnsupportedError: the traced step frees no forward tensor in its optimizer phase (a
            forward that returns the loss alone: nothing held to size the previous output by).
    """
    step_held = _traced_held(schedule.step)
    if not step_held:
        raise UnsupportedError(
            "loop=previous: this model's traced step binds no output past its backward (its "
            "forward returns the loss alone), so the previous micro-batch's output cannot be "
            "sized from the trace; use --loop drop or step (traced: drop, step)"
        )
    out = StepSchedule(
        setup=tuple(_hold_copies(schedule.setup, _traced_held(schedule.setup) or step_held)),
        step=tuple(_hold_copies(schedule.step, step_held)),
        name=schedule.name,
    )
    list(out.events())  # every free pairs with its allocation
    return out


def _traced_held(items: Sequence[Item]) -> list[Op]:
    """The last micro-batch's top-level forward allocations ``items`` frees in its optimizer
    phase, in allocation order (Note [The previous output of a model without a ModelSpec])."""
    split = state_and_micro_batches(items)
    if split is None:
        return []
    _, segments, tail = split
    made = [
        x
        for x in segments[-1]
        if isinstance(x, Op) and x.phase == "forward" and x.action == "alloc"
    ]
    freed = {
        x.key for x in tail if isinstance(x, Op) and x.action == "free" and x.phase == "optimizer"
    }
    return [op for op in made if op.key in freed]


def _hold_copies(items: Sequence[Item], held: list[Op]) -> list[Item]:
    """``items`` with a copy of each of ``held`` allocated at each micro-batch's start and
    freed after the micro-batch's own last-made held tensor exists: its last top-level forward
    allocation of that tensor's size by its module."""
    copies = [
        alloc(op.size_bytes, op.category, "forward", f"previous/output/{k}", op.module,
              "the previous micro-batch's output, held by the loop")
        for k, op in enumerate(held)
    ]  # fmt: skip
    last = (held[-1].size_bytes, held[-1].module)

    def own_output(segment: Sequence[Item]) -> list[int]:
        return [
            k
            for k, x in enumerate(segment)
            if isinstance(x, Op)
            and x.phase == "forward"
            and x.action == "alloc"
            and (x.size_bytes, x.module) == last
        ]

    return _hold_previous(items, copies, own_output)


def _bound_output_last_bytes(model: ModelSpec, training: TrainingConfig, output: int) -> int:
    """Bytes of the last allocation of the output the loop binds, after which the previous one
    is released: the logits (``output`` bytes); under a framework that casts the output
    (``fp32_model_output``: Fabric's ``convert_output``) the fp32 copy of the head's last
    chunk (litgpt's ``lm_head_chunk_size`` pieces, ``TrainingConfig.chunked_cross_entropy``
    of them; trainmem/trace/litgpt_model.py)."""
    if not training.conventions.fp32_model_output:
        return output
    b, s = training.micro_batch_size, training.seq_len
    return 4 * b * model.vocab_size * litgpt_last_chunk_rows(s, training.chunked_cross_entropy)


def _hold_previous(
    items: Sequence[Item],
    held: list[Op],
    own_output: Callable[[Sequence[Item]], list[int]],
) -> list[Item]:
    """``items`` (a state, then a step, either may be empty) with ``held`` allocated at each
    micro-batch's start and freed after the last of ``own_output(micro-batch)``'s indices
    (the micro-batch's own output), else at its first backward item."""
    split = state_and_micro_batches(items)
    if split is None:  # a state without a warm-up step
        return list(items)
    out, segments, tail = split
    for seg in segments:
        at = _after(seg, own_output(seg))
        out += [*held, *seg[:at], *(free(op, "forward") for op in reversed(held)), *seg[at:]]
    return out + tail


def _logits_of(logits: int) -> Callable[[Sequence[Item]], list[int]]:
    """A micro-batch's own logits: its forward allocations of ``logits`` bytes by a module
    outside the block lists (the head's output)."""
    return lambda segment: forward_allocs_outside_layers(segment, logits, named=True)


def _after(segment: Sequence[Item], found: list[int]) -> int:
    """The index after the last of ``found``, else ``segment``'s first backward item."""
    if found:
        return found[-1] + 1
    backward = (k for k, x in enumerate(segment) if isinstance(x, Op) and x.phase == "backward")
    return next(backward, len(segment))


PREVIOUS_LOOP = TracedOption(
    name="previous loop",
    applies=traced_previous_loop,
    traced_as=lambda t: replace(t, keep_logits=False),
    apply=apply_previous_loop,
    note=lambda t: (
        "loop=previous: the step was traced with the loop's binding of each output through "
        "its backward, then each micro-batch given the previous one's logits (and the inputs "
        "its graph keeps) until its own logits exist, as the analytic engine's TrainingLoop "
        "transform has them; a model without a ModelSpec (a diffusers or timm model) given "
        "its traced output, a denoiser's prediction or a classifier's logits (Notes "
        "[The previous loop on a traced step], [The previous output of a model without a "
        "ModelSpec] in trainmem/traced_options.py)"
    ),
)

# -- Unsloth ------------------------------------------------------------------------------------

UNSLOTH = TracedOption(
    name="unsloth",
    applies=traced_unsloth,
    traced_as=unsloth_traced_as,  # transformers + peft in Unsloth's dtypes (its conventions)
    apply=apply_unsloth,
    note=lambda t: (
        "Unsloth: its kernels need CUDA, so transformers + peft were traced in Unsloth's dtypes "
        "for the state and the optimizer step, and every micro-batch (its LoRA and norm "
        "kernels, fused cross-entropy, offloaded checkpoint and buffers) is the analytic "
        "engine's schedule of the same run (Note [Unsloth on a traced step] in "
        "trainmem/traced_unsloth.py)"
    ),
)

# -- what is still refused, and what would work ------------------------------------------------

_FRAMEWORKS_UNTRACED = {
    "accelerate-fsdp": (
        "FSDP1 is traced for real at ZeRO stage 3 (FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD), "
        "0 (NO_SHARD) or on one GPU, beside context parallelism too; traced: --framework "
        "accelerate-fsdp --zero-stage 3 or 0, or --engine analytic"
    ),
    "torchtune": (
        "torchtune beside tensor, context or pipeline parallelism (its own TP plans), or over "
        "replicated data-parallel ranks (its distributed recipes shard: --zero-stage 3); "
        "traced: --framework torchtune on one GPU or FSDP2 over --data-parallel-size N with "
        "--zero-stage 3, or --engine analytic"
    ),
    "litgpt": (
        "litgpt's own GPT is traced on one GPU and under DDP (trainmem.trace.litgpt_model, "
        f"needs litgpt: {LITGPT_INSTALL}); Fabric's FSDP and model-parallel strategies "
        "are not; traced: --framework litgpt on one GPU or DDP, or --engine analytic"
    ),
    # the HF Trainer family: its ZeRO is DeepSpeed's engine (``--deepspeed ds_config.json``,
    # transformers integrations/deepspeed.py ``deepspeed_init``) and its FSDP is accelerate's
    # FSDP1 (``--fsdp``), which the traced paths run under those frameworks' names
    **{
        name: (
            "the HF Trainer is traced on one GPU and under DDP; its ZeRO stages run DeepSpeed's "
            "engine (--deepspeed ds_config.json) and its --fsdp accelerate's FSDP1; traced: "
            "--framework deepspeed --zero-stage 1, 2 or 3, --framework accelerate-fsdp "
            "--zero-stage 3, or --engine analytic"
        )
        for name in HF_TRAINER_STACKS
    },
    "fsdp-qlora": (
        "Answer.AI fsdp_qlora's train.py runs FSDP1 (FULL_SHARD, SHARD_GRAD_OP, the hybrids, "
        "NO_SHARD, one GPU) over data-parallel ranks with a bitsandbytes 4-bit base (nf4 / "
        "fp4, double-quantized or not); traced: --framework fsdp-qlora --zero-stage 3 (or 0) "
        "on one GPU or over --data-parallel-size N, or --engine analytic"
    ),
}


def untraced_framework(training: TrainingConfig) -> str:
    """A framework the traced paths refuse, as ``framework=<name> (why; what works)``."""
    why = _FRAMEWORKS_UNTRACED.get(training.framework)
    if training.framework == "fsdp2":
        why = (
            "traced with zero_stage 3 and data_parallel_size or context_parallel_size > 1 "
            "(FSDP2); use --engine analytic"
        )
    return f"framework={training.framework}" + (f" ({why})" if why else "")


def untraced_fsdp1_quantized(training: TrainingConfig) -> str:
    """FSDP1 over a quantized base, which the traced paths refuse, naming what works: FSDP1
    flattens a unit's parameters into one floating-point tensor of one dtype (torch 2.13
    distributed/fsdp/_flat_param.py ``_validate_tensors_to_flatten``: "Cannot flatten integer
    dtype tensors", "Must flatten tensors with uniform dtype"), so FSDP-QLoRA stores the 4-bit
    codes (and fms-acceleration GPTQ's ``qweight`` / ``qzeros``) in the dtype the model is
    loaded in; the trace's stand-in (``trainmem.trace.quantized``) does so wherever
    :func:`~trainmem.specs.quantization.float_quant_storage` names that dtype. It names none
    for a 4-bit base under accelerate's FSDP1 with ``*-mixed`` whose norms, embeddings and
    head peft upcasts to fp32 (``--set prepare-kbit-training=true``): the fp32 norms beside
    16-bit codes in one unit are a flattening FSDP1 refuses, and a model loaded in fp32 stores
    its codes in fp32, which transformers' Trainer makes the policy's dtype
    (``_fsdp_qlora_plugin_updates``) where the formulas gather in the 16-bit dtype."""
    q, f = training.quantize_base, training.framework
    why = (
        f"peft's fp32 upcast of the rest of the base under {training.precision}: fp32 norms "
        "beside 16-bit codes in one FSDP1 unit, which FSDP1 cannot flatten, or an fp32-loaded "
        "model whose fp32 codes transformers' Trainer makes FSDP1's policy dtype; traced: "
        "without --set prepare-kbit-training=true (the model loaded in the 16-bit dtype, as "
        "fms-acceleration and transformers' FSDP-QLoRA recipe load it), or --engine analytic"
    )
    return f"quantize_base={q} under framework={f} ({why})"


def untraced_data_parallel(training: TrainingConfig) -> str:
    """A data-parallel layout the traced paths refuse, as ``data_parallel_size=<n> (why;
    what works)``."""
    n = training.data_parallel_size
    if training.framework == "deepspeed" or training.conventions.hf_trainer_loop:
        return f"data_parallel_size={n}"  # the framework's own refusal says what is traced
    if training.zero_stage == 0 and training.conventions.ddp_reducer_buckets:
        why = (
            "DDP beside tensor, context or pipeline parallelism; traced: DDP alone, or "
            "zero_stage 3 (FSDP2) beside them"
        )
    else:
        why = (
            f"zero_stage {training.zero_stage} under {training.framework}; traced: DDP "
            "(zero_stage 0), FSDP2 (zero_stage 3), DeepSpeed ZeRO-1/2/3 (--framework "
            "deepspeed, or --framework hf-trainer, which shards through DeepSpeed)"
        )
    return f"data_parallel_size={n} ({why})"


def untraced_offload(training: TrainingConfig) -> str:
    """CPU offload the traced paths refuse (DeepSpeed's beyond ZeRO-1/2, another framework's),
    naming what works."""
    return (
        f"offload={training.offload} with framework={training.framework} (traced: offload "
        "under DeepSpeed ZeRO-1/2, pytorch-amp or fsdp2)"
    )


RELEASE = TracedOption(
    name="transformers release",
    applies=traced_release,
    traced_as=release_traced_as,
    apply=apply_release,
    note=release_note,
)
"""Another transformers release than the installed one: the installed code traced, the
release's differences applied (Note [An older transformers release on a traced step] in
trainmem/traced_releases.py; what they do not model is refused in trainmem.estimate)."""

LITGPT_RELEASE = TracedOption(
    name="litgpt release",
    applies=traced_litgpt_release,
    traced_as=litgpt_release_traced_as,
    apply=lambda schedule, model, training: schedule,  # the same rules: nothing to apply
    note=litgpt_release_note,
)
"""A litgpt release other than the installed one whose rules match it (Note [An older litgpt
release on a traced step] in trainmem/traced_releases.py; the rest refused in
trainmem.estimate)."""

OPTIONS: tuple[TracedOption, ...] = (
    UNSLOTH,
    MEGATRON,
    DDP,
    OFFLOAD,
    ACTIVATION_OFFLOADING,
    PREVIOUS_LOOP,
    RELEASE,
    LITGPT_RELEASE,
)
"""Every option, in the order their rewrites apply (each to the previous one's schedule)."""


def active_options(training: TrainingConfig) -> list[TracedOption]:
    """The options of ``training`` this module models, each checked on the settings the
    earlier ones leave (so their stand-ins compose)."""
    out: list[TracedOption] = []
    for option in OPTIONS:
        if option.applies(training):
            out.append(option)
            training = option.traced_as(training)
    return out


def traced_settings(training: TrainingConfig) -> TrainingConfig:
    """The settings the trace runs for ``training``: each active option taken out."""
    for option in active_options(training):
        training = option.traced_as(training)
    return training
