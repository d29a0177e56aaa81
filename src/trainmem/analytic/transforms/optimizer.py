"""The optimizer as a transform: its states, made lazily by the first step, the step's own
temporaries, and optimizer-in-backward (each gradient stepped and freed as soon as it is made).

Source: torch/optim/optimizer.py, adam.py ``_init_group`` (lazy states) /
``_multi_tensor_adam`` (foreach temporaries); torchtune's ``optimizer_in_bwd``
(``register_optim_in_bwd_hooks``: the step in each parameter's post-accumulate-grad hook);
sizes :func:`~trainmem.analytic.temporaries.optimizer_step_temporary_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from trainmem.analytic.temporaries import (
    CS336_ADAMW_TEMPORARIES,
    carried_step_bytes,
    optimizer_step_temporary_bytes,
    steps_per_parameter,
)
from trainmem.analytic.tensor_states import TensorState
from trainmem.analytic.transforms.base import (
    Emitted,
    Group,
    RankContext,
    Transform,
    Where,
    alloc,
    free,
    gradient_ops,
    unit_states,
)
from trainmem.analytic.transforms.deepspeed_init import deepspeed_flat_buffers
from trainmem.analytic.transforms.sharding import OWN_UNIT_STATES, own_units_apply
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.optimizers import OPTIMIZER_TABLE
from trainmem.specs.ranks import fsdp1_framework
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes


def per_parameter_step_ops(training: TrainingConfig, grad: Op) -> list[Op]:
    """The step's temporaries of one parameter stepped alone in its hook (optimizer in
    backward: torchtune builds one optimizer per parameter), made and freed after its gradient
    ``grad``: :func:`~trainmem.analytic.temporaries.optimizer_step_temporary_bytes` of a group of
    that one tensor (foreach AdamW: one copy of it). Source: torchtune
    training/_optimizer_in_bwd.py ``OptimizerInBackwardWrapper`` (``optim_dict[p] =
    optimizer([p])``); torch/optim/adamw.py ``_multi_tensor_adamw``."""
    n = grad.size_bytes // max(dtype_bytes(training.grad_dtype), 1)
    size = optimizer_step_temporary_bytes(training, num_trainable_parameters=n, largest_parameter=n)
    if size <= 0:
        return []
    b: Phase = "backward"
    label = "one parameter's step temporaries (optimizer in backward)"
    op = alloc(size, Cat.TEMPORARY, b, f"{grad.key}/step", grad.module, label)
    return [op, free(op, b)]


def flat_parameter_steps(training: TrainingConfig) -> bool:
    """The optimizer steps FSDP1's flat parameters, not the model's tensors: accelerate's and
    fsdp_qlora's FSDP1 (``use_orig_params=False``) hand it each unit's ``FlatParameter``
    (shard) (torch distributed/fsdp/_flat_param.py ``FlatParamHandle``; Note [Factored states
    of flat parameters] in ``analytic/tensor_states.py``). Under LoRA each trainable adapter
    is a unit of its own (peft's ``fsdp_auto_wrap_policy``), so its flat parameter is that
    tensor: False."""
    return fsdp1_framework(training) and not training.is_lora


def partition_steps(training: TrainingConfig) -> bool:
    """The optimizer steps DeepSpeed's flat fp32 partition (one parameter group assumed), not
    the model's tensors: every DeepSpeed optimizer wrapper (Note [Optimizer states of flat
    tensors] in ``analytic/model_states.py``), so a per-parameter loop's temporaries are of
    this rank's whole partition."""
    return training.deepspeed_optimizer not in (None, "none")


class Optimizer(Transform):
    """The optimizer of one rank (states per tensor from the model states).

    Inserts: ``optimizer.begin`` every state (warm-up step, kept); ``optimizer.step`` the
    step's temporaries; with ``optimizer_in_backward`` each gradient freed right after it is
    made (:meth:`gradients`; under ZeRO / FSDP the frees of each group's gradients once made:
    ``stack.pre_backward`` the head's, ``layer.post_backward`` the layer's,
    ``embedding.post_backward`` the embedding's), and no step of its own.
    """

    name = "optimizer"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        self.steps_in_backward = ctx.training.optimizer_in_backward

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return True

    def optimizer_begin(self, where: Where) -> Sequence[Emitted]:
        """Every optimizer state, allocated lazily by the first step (torch ``_init_group``)."""
        if not where.first_step or deepspeed_flat_buffers(self.ctx) is not None:
            return ()  # DeepSpeed's flat states (Note [DeepSpeed's flat buffers at init])
        ctx = self.ctx
        cached = ctx.shared.get("states")
        if isinstance(cached, Repeat):
            return (cached,)
        o: Phase = "optimizer"
        outer = [
            alloc(s.state_bytes, Cat.OPTIMIZER_STATE, o, f"state/{s.owner}/{n}", s.owner)
            for n, s in enumerate(ctx.emb_states + ctx.head_states)
        ]
        layer = tuple(
            alloc(size, Cat.OPTIMIZER_STATE, o, f"state/{{i}}/{n}", "layers.{i}")
            for n, size in enumerate(self._layer_state_blocks())
        )
        states = Repeat((*outer, Repeat(layer, ctx.num_layers)), 1)
        ctx.shared["states"] = states
        return (states,)

    def _layer_state_blocks(self) -> list[int]:
        """A layer's optimizer-state blocks: one per tensor (its states together), or under
        Note [FSDP1 flat blocks of a layer unit] one per state of the unit's flat shard
        (``exp_avg``, ``exp_avg_sq``: torch/optim/adamw.py ``_init_group``) when the
        optimizer keeps plain full-width states (no quantized, factored or paged ones, no
        master copy)."""
        ctx, t = self.ctx, self.ctx.training
        states = unit_states(ctx, ctx.layer_states)
        row = OPTIMIZER_TABLE[t.optimizer]
        plain = not (row.blockwise or row.factored or row.paged or t.fp32_master_copy)
        if states is ctx.layer_states or not plain or row.num_states < 2:
            return [s.state_bytes for s in states]
        k = row.num_states
        return [s.state_bytes // k for s in states for _ in range(k)]

    def _per_parameter(self, where: Where) -> bool:
        """Each gradient is stepped and freed in its own post-accumulate-grad hook, one at a
        time (without sharding: ZeRO / FSDP make and release their gradients themselves)."""
        return self.steps_in_backward and where.new_grads and self.ctx.zero_stage == 0

    def gradients(self, group: Group, where: Where) -> Sequence[Op] | None:
        """With ``optimizer_in_backward`` and no sharding, each of ``group``'s gradients made
        and freed in turn: torchtune's ``register_optim_in_bwd_hooks`` steps a parameter and
        sets its gradient to None in the hook torch runs once that gradient is accumulated
        (torch/_tensor.py ``register_post_accumulate_grad_hook``), so one gradient exists at a
        time, with its own step's temporaries (:func:`per_parameter_step_ops`); a tied
        weight's, made by the head's backward, waits for the lookup's (:meth:`_tied`)."""
        if not self._per_parameter(where):
            return None
        b: Phase = "backward"
        out: list[Op] = []
        for g, tied in zip(self._group_gradients(group), self._tied(group), strict=True):
            out.append(g)
            if not tied:
                out += [*per_parameter_step_ops(self.ctx.training, g), free(g, b)]
        return out

    def _tied(self, group: str) -> list[bool]:
        """Per gradient of ``group``: a tied weight's, made by the head's backward but
        accumulated (and so stepped) only once the lookup's backward has added its part:
        autograd sums every gradient reaching a leaf in the ``AccumulateGrad`` node's input
        buffer before it runs (torch/csrc/autograd/engine.cpp ``evaluate_function``,
        input_buffer.cpp ``add``), and the hook runs after it."""
        if group != "head":
            return [False] * len(self._group_gradients(group))
        return [s.name == "embedding/tokens" for s in self.ctx.head_grad_states]

    def _group_gradients(self, group: str) -> list[Op]:
        ctx = self.ctx
        b: Phase = "backward"
        if group == "head":
            return gradient_ops(ctx, ctx.head_grad_states, b, "head", "head")
        if group == "embedding":
            return gradient_ops(ctx, ctx.emb_grad_states, b, "embedding", "embedding")
        return gradient_ops(ctx, ctx.layer_states, b, "{i}", "layers.{i}")

    def _freed_in_backward(self, where: Where, group: str) -> Sequence[Emitted]:
        """A group's gradients stepped and freed as soon as they exist (under sharding, where
        the sharding transform made them; without, :meth:`gradients` freed each in turn)."""
        if not (self.steps_in_backward and where.new_grads) or self._per_parameter(where):
            return ()
        b: Phase = "backward"
        return [free(op, b) for op in self._group_gradients(group)]

    def stack_pre_backward(self, where: Where) -> Sequence[Emitted]:
        return self._freed_in_backward(where, "head")

    def layer_post_backward(self, where: Where) -> Sequence[Emitted]:
        return self._freed_in_backward(where, "layer")

    def embedding_post_backward(self, where: Where) -> Sequence[Emitted]:
        if not self._per_parameter(where):
            return self._freed_in_backward(where, "embedding")
        b: Phase = "backward"  # a tied weight's gradient, stepped once the lookup's is added
        heads = zip(self._group_gradients("head"), self._tied("head"), strict=True)
        tied = [g for g, t in heads if t]
        return [op for g in tied for op in (*per_parameter_step_ops(self.ctx.training, g),
                                            free(g, b))]  # fmt: skip

    def optimizer_step(self, where: Where) -> Sequence[Emitted]:
        """The step's temporaries: ``foreach``, one per-parameter list alive together
        (``torch._foreach_*``); ``for-loop`` (and the course's AdamW, and torchao's low-bit
        AdamW whatever the implementation: Note [torchao low-bit AdamW step]), one parameter at
        a time; ``fused``, none."""
        ctx, t = self.ctx, self.ctx.training
        outer = [s for s in ctx.emb_states + ctx.head_states if s.trainable]
        layer = [s for s in unit_states(ctx, ctx.layer_states) if s.trainable]
        if t.offload != "none" or not (outer or layer):
            return []
        gb = max(dtype_bytes(t.grad_dtype), 1)
        dp = t.sharding_degree

        def local(s: TensorState) -> int:
            n = s.full_grad_bytes // gb
            return -(-n // dp) if t.optimizer_states_partitioned else n

        n_local = sum(local(s) for s in outer) + ctx.num_layers * sum(local(s) for s in layer)
        # the largest tensor the step sees: its local shard where the states are partitioned
        # (FSDP2's DTensor parameters step their local tensors)
        largest = max(local(s) for s in outer + layer)
        total = optimizer_step_temporary_bytes(
            t, num_trainable_parameters=n_local, largest_parameter=largest
        )
        if total <= 0 or n_local == 0:
            return []
        label = f"the {t.step_implementation} {t.optimizer} step's temporaries"
        if t.step_implementation == "foreach" and not steps_per_parameter(t):
            return self._foreach(total / n_local, local, label)
        outer_units, layer_units = self._step_units(outer, layer, local)
        largest_local = max(n for _, n in outer_units + layer_units)
        if flat_parameter_steps(t) or partition_steps(t):  # flat tensors are the step's
            total = optimizer_step_temporary_bytes(
                t, num_trainable_parameters=n_local, largest_parameter=largest_local
            )
        # the course's AdamW makes its temporaries as separate parameter-sized tensors
        pieces = CS336_ADAMW_TEMPORARIES if t.step_implementation == "cs336" else 1

        def one(n: int, module: str, before: int) -> list[Op]:
            # ``before``: elements of the parameter stepped just before (carried_step_bytes)
            size = round(total * n / max(largest_local, 1)) + carried_step_bytes(t, before)
            o: Phase = "optimizer"
            ops = [
                alloc(size // pieces, Cat.TEMPORARY, o, f"opt/tmp/{k}", module, label)
                for k in range(pieces)
            ]
            return [*ops, *(free(op, o) for op in ops)]

        items: list[Item] = []
        before = 0
        for module, n in outer_units:
            items += one(n, module, before)
            before = n
        body: list[Op] = []
        if layer_units:  # the first layer's first tensor follows the outer ones' or a layer's
            before = max(before, layer_units[-1][1])
        for module, n in layer_units:
            body += one(n, module, before)
            before = n
        items.append(Repeat(tuple(body), ctx.num_layers))
        return items

    def _step_units(
        self,
        outer: list[TensorState],
        layer: list[TensorState],
        local: Callable[[TensorState], int],
    ) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """The tensors a per-parameter step visits, (module, local elements) in order, outside
        the layers and in one layer: each trainable tensor; under FSDP1's flat parameters
        (:func:`flat_parameter_steps`) each unit's flat shard instead: the root's (every outer
        tensor but an embedding or head that is a unit of its own), those own units, and one
        per layer (padded to the sharding degree: torch distributed/fsdp/_flat_param.py
        ``_get_shard``)."""
        t = self.ctx.training
        if partition_steps(t):  # one flat partition: this rank's trainable elements
            owner = (outer or layer)[0].owner
            return [
                (
                    owner,
                    sum(local(s) for s in outer)
                    + self.ctx.num_layers * sum(local(s) for s in layer),
                )
            ], []
        if not flat_parameter_steps(t):
            return [(s.owner, local(s)) for s in outer], [("layers.{i}", local(s)) for s in layer]
        gb = max(dtype_bytes(t.grad_dtype), 1)
        dp = t.sharding_degree if t.optimizer_states_partitioned else 1

        def shard(states: list[TensorState]) -> int:
            return -(-sum(s.full_grad_bytes // gb for s in states) // dp)

        own = OWN_UNIT_STATES.values() if own_units_apply(self.ctx) else ()
        root = [s for s in outer if s.name not in own]
        units = [(s.owner, shard([s])) for s in outer if s.name in own]
        if root:
            units.insert(0, (root[0].owner, shard(root)))
        return units, ([("layers.{i}", shard(layer))] if layer else [])

    def _foreach(
        self, per: float, local: Callable[[TensorState], int], label: str
    ) -> list[Emitted]:
        """``foreach``: every parameter's temporaries alive together."""
        ctx = self.ctx
        o: Phase = "optimizer"
        outer = [s for s in ctx.emb_states + ctx.head_states if s.trainable]
        layer = [s for s in unit_states(ctx, ctx.layer_states) if s.trainable]
        outer_ops = [
            alloc(round(per * local(s)), Cat.TEMPORARY, o, f"opt/{s.owner}/{n}", s.owner, label)
            for n, s in enumerate(outer)
        ]
        layer_ops = [
            alloc(round(per * local(s)), Cat.TEMPORARY, o, f"opt/{{i}}/{n}", "layers.{i}", label)
            for n, s in enumerate(layer)
        ]
        return [
            *outer_ops,
            Repeat(tuple(layer_ops), ctx.num_layers),
            *(free(op, o) for op in outer_ops),
            Repeat(tuple(free(op, o) for op in layer_ops), ctx.num_layers),
        ]
