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

from trainmem.analytic.transforms.base import (
    Emitted,
    Lifetime,
    RankContext,
    Transform,
    Where,
    alloc,
)
from trainmem.analytic.transforms.fsdp2 import post_backward_active
from trainmem.analytic.transforms.points import Point
from trainmem.analytic.transforms.sharding import own_units_apply, sharding
from trainmem.breakdown import MemoryCategory as Cat
from trainmem.errors import UnsupportedError
from trainmem.timeline import Phase


class FsdpEmbeddingHeadUnits(Transform):
    """The embedding's and the head's gathers as units of their own (Note [FSDP embedding and
    head units]).

    Inserts: ``micro_batch.begin`` the embedding's gathered parameters (until
    ``stack.pre_forward``); ``head.forward`` the head's (until ``head.post_forward``);
    ``head.backward`` the head's again (until ``head.post_backward``);
    ``embedding.pre_backward`` the embedding's again when its weight is trained (until
    ``embedding.post_backward``).

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

    def micro_batch_begin(self, where: Where) -> Sequence[Emitted]:
        return self._gather("embedding", self.embedding, "forward", "stack.pre_forward")

    def head_forward(self, where: Where) -> Sequence[Emitted]:
        return self._gather("head", self.head, "forward", "head.post_forward")

    def head_backward(self, where: Where) -> Sequence[Emitted]:
        return self._gather("head", self.head, "backward", "head.post_backward")

    def embedding_pre_backward(self, where: Where) -> Sequence[Emitted]:
        size = self.embedding if self.embedding_trained else 0
        return self._gather("embedding", size, "backward", "embedding.post_backward")
