"""The token embedding and the output head as FSDP units of their own (torchtune's
``custom_sharded_layers``): each gathered around its own forward and backward instead of by the
root, which keeps its gathered parameters from the forward to the end of the backward.

Note [FSDP embedding and head units]
    torchtune's distributed recipes wrap every module whose name is in the config's
    ``custom_sharded_layers`` as an FSDP2 unit of its own (recipes/full_finetune_distributed.py
    @30b8519e, Sep 2024: ``fsdp_shard_conditions += [lambda n, m: n in
    custom_sharded_layers]``; torchtune/training/_distributed.py ``shard_model``:
    ``fully_shard(m, reshard_after_forward=True)`` for each, bottom-up, then
    ``fully_shard(model)`` for the rest), and recipes/configs/llama3_1/70B_full.yaml (and the
    llama3 / llama3_1 8B and 70B full configs) set ``custom_sharded_layers: ['tok_embeddings',
    'output']``. The root then holds only the final norm. FSDP2 gathers a unit in its
    pre-forward and reshards it in its post-forward (torch/distributed/_composable/fsdp/
    _fsdp_param_group.py ``pre_forward`` / ``post_forward`` -> ``reshard``), and gathers it
    again in the pre-backward hook its outputs carry (``pre_backward``, registered on outputs
    that require grad: the embedding's only when its weight is trained) until its
    post-backward (``post_backward`` -> ``reshard``); only the root is exempt
    (_fsdp_state.py ``_lazy_init``: "For the root, do not reshard after forward"). So, for a
    Llama-3.1-70B on 8 ranks in bf16, the root's 2 x 128,256 x 8,192 x 2 B = 4,202,692,608 B
    gathered through the whole step become the embedding's 2,101,346,304 B during its forward
    and its backward, and the output's during its forward and its backward (the head's
    backward, where the chunked loss's weight gradients peak). All-gather outputs are made on
    the all-gather stream (_fsdp_collectives.py ``foreach_all_gather``).
    A trained unit's gradient is unsharded until its post-backward: autograd accumulates the
    weight's gradient (for a chunked head, the chunks' sum in the ``AccumulateGrad`` node's
    input buffer) on the unsharded parameter, and ``post_backward`` copies it into the
    reduce-scatter input (``foreach_reduce``: ``torch.empty`` of the unit's unsharded size,
    the copy-in, then the unsharded gradients released), leaving this rank's shard (on the
    CPU under ``CPUOffloadPolicy``). So from the head's backward to its post-backward its
    unsharded gradient (c V h, 2,101,346,304 B for the 70B) is alive beside the next chunk's
    and their sum, and the reduce-scatter input of the same size beside it at the end.
    Deviations from the source: a head called once per loss chunk (torchtune's
    ``chunked_output``) is resharded after each call and gathered again by the next; one gather
    per pass is kept, the same bytes alive at once. FSDP2 prefetches the embedding's backward
    gather when layer 0's backward starts (``_prefetch_unshard``); it is made when the
    embedding's backward starts, after layer 0's activations are freed. Not modelled with
    FSDP2's post-backward order (:mod:`.fsdp2`: the root group's gradients), under pipelining
    or for a tied head (refused).

Source: torchtune recipes/full_finetune_distributed.py, torchtune/training/_distributed.py
``shard_model`` (@30b8519e); torch/distributed/_composable/fsdp/_fsdp_param_group.py,
_fsdp_state.py, _fsdp_collectives.py (cited per rule above).
"""

from __future__ import annotations

from collections.abc import Sequence

from trainmem.analytic.tensor_states import TensorState
from trainmem.analytic.transforms.base import (
    Emitted,
    Group,
    Lifetime,
    RankContext,
    Transform,
    Where,
    alloc,
    free,
    gradient_ops,
)
from trainmem.analytic.transforms.fsdp2 import post_backward_active
from trainmem.analytic.transforms.points import Point
from trainmem.analytic.transforms.sharding import OWN_UNIT_STATES, own_units_apply, sharding
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.errors import UnsupportedError
from trainmem.schedule import Op
from trainmem.timeline import Phase
from trainmem.units import dtype_bytes


class FsdpEmbeddingHeadUnits(Transform):
    """The embedding's and the head's gathers as units of their own (Note [FSDP embedding and
    head units]).

    Inserts: ``micro_batch.begin`` the embedding's gathered parameters (until
    ``stack.pre_forward``); ``head.forward`` the head's (until ``head.post_forward``);
    ``head.backward`` the head's again (until ``head.post_backward``);
    ``embedding.pre_backward`` the embedding's again when its weight is trained (until
    ``embedding.post_backward``); ``head.post_backward`` / ``embedding.post_backward`` a
    trained unit's reduce-scatter: its input, the unsharded gradients freed, the shards.
    Makes a trained unit's gradients unsharded where the base order makes them.

    Raises:
        UnsupportedError: FSDP2's post-backward order, or a tied head.
    """

    name = "fsdp_units"

    def __init__(self, ctx: RankContext) -> None:
        super().__init__(ctx)
        if post_backward_active(ctx):
            raise UnsupportedError(
                "fsdp_embedding_head_units is modelled with the torchtune recipes' FSDP, not "
                "with FSDP2's post-backward order (--framework fsdp2 / pytorch-amp); drop "
                "--set fsdp-embedding-head-units"
            )
        if ctx.model.tie_word_embeddings:
            raise UnsupportedError(
                "fsdp_embedding_head_units with a tied output head (one weight in two units) "
                "is not modelled; drop --set fsdp-embedding-head-units"
            )
        s = sharding(ctx)
        self.embedding, self.head, self.stream = s.gather_embedding, s.gather_head, s.ag_stream
        self.embedding_trained = any(
            st.name == "embedding/tokens" and st.trainable for st in ctx.emb_states
        )

    @staticmethod
    def applies(ctx: RankContext) -> bool:
        return own_units_apply(ctx)

    def _gather(self, unit: str, size: int, phase: Phase, release: Point) -> tuple[Lifetime, ...]:
        """A unit's gathered parameters, freed at ``release`` (its reshard)."""
        if not size:
            return ()
        label = f"the {unit} unit's gathered parameters"
        op = alloc(size, Cat.TEMPORARY, phase, f"gather/{unit}", unit, label, self.stream)
        return (Lifetime(op, release),)

    def _unit_states(self, group: str) -> list[TensorState]:
        """The trained states of ``group``'s own unit (the head's output weight, the
        embedding's token table); empty where the unit is not one of its own."""
        unit = OWN_UNIT_STATES[group]
        size = self.head if group == "head" else self.embedding
        states = self.ctx.head_grad_states if group == "head" else self.ctx.emb_grad_states
        return [st for st in states if st.name == unit and st.trainable] if size else []

    def _unsharded(self, group: str) -> list[Op]:
        """A unit's unsharded gradients, in the unsharded parameters' dtype."""
        g = dtype_bytes(self.ctx.training.grad_dtype)
        w = dtype_bytes(self.ctx.training.gathered_weight_dtype)
        return [
            alloc(
                w * (st.full_grad_bytes // g),
                Cat.TEMPORARY,
                "backward",
                f"unit_grad/{group}/{n}",
                group,
                f"the {group} unit's unsharded gradients, until its post-backward",
            )
            for n, st in enumerate(self._unit_states(group))
        ]

    def gradients(self, group: Group, where: Where) -> Sequence[Op] | None:
        if group == "layer" or not self._unit_states(group):
            return None
        rest = [st for st in self._group_states(group) if st not in self._unit_states(group)]
        kept = self._shards(group, rest) if where.new_grads else []
        return [*self._unsharded(group), *kept]

    def _shards(self, group: str, states: list[TensorState]) -> list[Op]:
        """This rank's gradients of ``states`` under the base order's keys (``grad/<group>/<n>``,
        n the state's position in the group), so the step's end frees them as it frees the
        others."""
        ops = gradient_ops(self.ctx, states, "backward", group, group)
        where = self._group_states(group)
        return [
            op._replace(key=f"grad/{group}/{where.index(st)}")
            for op, st in zip(ops, states, strict=True)
        ]

    def _group_states(self, group: str) -> list[TensorState]:
        return self.ctx.head_grad_states if group == "head" else self.ctx.emb_grad_states

    def _reduce(self, group: str, where: Where) -> list[Op]:
        """The unit's post-backward: the reduce-scatter input, the unsharded gradients freed,
        this rank's shards (on the first micro-batch), the input freed."""
        bp: Phase = "backward"
        unsharded = self._unsharded(group)
        if not unsharded:
            return []
        rs = alloc(
            sum(op.size_bytes for op in unsharded),
            Cat.TEMPORARY,
            bp,
            f"unit_rs/{group}",
            group,
            f"the {group} unit's reduce-scatter input",
        )
        shards = self._shards(group, self._unit_states(group)) if where.new_grads else []
        return [rs, *(free(op, bp) for op in unsharded), *shards, free(rs, bp)]

    def micro_batch_begin(self, where: Where) -> Sequence[Emitted]:
        return self._gather("embedding", self.embedding, "forward", "stack.pre_forward")

    def head_forward(self, where: Where) -> Sequence[Emitted]:
        return self._gather("head", self.head, "forward", "head.post_forward")

    def head_backward(self, where: Where) -> Sequence[Emitted]:
        return self._gather("head", self.head, "backward", "head.post_backward")

    def head_post_backward(self, where: Where) -> Sequence[Emitted]:
        return self._reduce("head", where)

    def embedding_post_backward(self, where: Where) -> Sequence[Emitted]:
        return self._reduce("embedding", where)

    def embedding_pre_backward(self, where: Where) -> Sequence[Emitted]:
        size = self.embedding if self.embedding_trained else 0
        return self._gather("embedding", size, "backward", "embedding.post_backward")
