"""Selective checkpointing and tensor / sequence parallelism of a timm model's transformer blocks
(issue 26: every option on the generic path's timm models).

Note [timm's transformer blocks]
    A timm ViT-style model keeps its blocks in ``model.blocks`` (an ``nn.Sequential``; timm 1.0.31
    timm/models/vision_transformer.py ``VisionTransformer``: ``self.blocks =
    nn.Sequential(*[block_fn(...)])``, run as ``x = self.blocks(x)``), each block a
    ``norm1 -> attn -> ls1`` and ``norm2 -> mlp -> ls2`` residual pair (``Block.forward``). The
    attention is timm/layers/attention.py ``Attention``: one fused ``qkv`` linear (d -> 3 *
    ``attn_dim``) reshaped by ``num_heads`` x ``head_dim``, SDPA, the output reshaped to ``[B, N,
    attn_dim]`` and the ``proj`` linear (``attn_dim`` -> d); the MLP is timm/layers/mlp.py ``Mlp``:
    ``fc1 -> act -> norm -> fc2`` (``norm`` an ``Identity`` unless the model names a norm
    layer). A CNN (ResNet, ConvNeXt, EfficientNet) has no such block: no attention and no
    token sequence.

    - Selective checkpointing: each block runs through ``torch.utils.checkpoint.checkpoint``
      with torchtitan's op-level policy (``trainmem.trace.sac``: matmul and attention outputs
      saved, every second ``mm`` and all else recomputed), as timm's own ``checkpoint_seq``
      (timm/models/_manipulate.py, ``every=1``) checkpoints each block under
      ``--grad-checkpointing``, with the policy's ``context_fn`` added. A hybrid's blocks
      without attention (CoAtNet's, MaxViT's convolution stages) are not checkpointed: the
      policy's saves are the attention blocks' matmuls.
    - Tensor parallelism (Megatron's layout, the one torchtitan's Llama plan writes,
      torchtitan/models/llama3/infra/parallelize.py ``apply_tp``, on timm's names): ``attn.qkv``
      and ``mlp.fc1`` ``ColwiseParallel``, ``attn.proj`` and ``mlp.fc2`` ``RowwiseParallel``;
      each ``Attention``'s ``num_heads`` and ``attn_dim`` divided by t, so its reshapes see t
      times fewer heads of the full ``head_dim``. The fused qkv's rows are q, k, v one after
      another; Megatron interleaves them per head so that a rank's shard holds its heads' q, k
      and v. The shapes are the same (3 * attn_dim / t rows), which is all a memory trace
      reads. The norms, the patch embedding, the class token, the position table, the final
      norm and the head stay whole on every rank as plain tensors (the optimizer mixes them
      with the shards under DTensor's ``implicit_replication``,
      :func:`trainmem.trace.diffusers_parallel.mixed_parameters`). LoRA adapters are sharded
      as peft shards them beside a sharded base (Note [LoRA under tensor parallelism]).
    - Sequence parallelism (Korthikanti et al. 2022 sec. 4.2.2; torchtitan's plan): the residual
      stream inside ``model.blocks`` is a ``Shard(1)`` DTensor over the patch tokens (the
      class and register tokens included: DTensor's uneven ``torch.chunk`` split when t does
      not divide them), the norms ``SequenceParallel``, the attention and the MLP all-gather
      their input (``PrepareModuleInput``), the row-parallel outputs reduce-scatter back to
      ``Shard(1)``; the first block takes its rank's chunk of the tokens and the last
      all-gathers them, so the final norm, the pooling and the head run on the whole sequence.

    Refused with the reason: another attention or MLP class (Swin's windowed attention indexes
    a relative-position table by heads; EVA's rotary attention, ``SwiGLU``...), a norm inside
    the MLP or on the attention output (it would normalise the rank's slice), heads t does not
    divide; not applicable: a model without attention blocks (the CNNs).
"""

from __future__ import annotations

import functools
from typing import Any

from trainmem.errors import NotApplicableError, UnsupportedError
from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = [
    "apply_timm_context_parallel",
    "context_parallel_note",
    "apply_timm_selective_checkpointing",
    "apply_timm_tensor_parallel",
    "attention_blocks",
    "base_model",
    "is_timm_model",
    "padded_tokens",
    "transformer_blocks",
    "vit_tokens",
]

TRACED = (
    "traced on timm's CNNs: data parallelism, ZeRO / FSDP (--zero-stage, --data-parallel-size), "
    "full checkpointing (timm's --grad-checkpointing)"
)


def base_model(model: Any) -> Any:
    """The model inside peft's wrapper (``PeftModel.get_base_model``), else ``model``."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) and getattr(model, "peft_config", None) else model


def is_timm_model(model: Any) -> bool:
    """A model timm built (its class in a ``timm.`` module), inside peft's wrapper or not."""
    return type(base_model(model)).__module__.startswith("timm.")


def _is_timm_attention(module: Any) -> bool:
    from timm.layers.attention import Attention

    return type(module) is Attention


def _is_timm_mlp(module: Any) -> bool:
    from timm.layers.mlp import Mlp

    return type(module) is Mlp


def _is_attention(module: Any) -> bool:
    """A timm attention: every one of its classes keeps ``num_heads`` (ViT's ``Attention``,
    Swin's ``WindowAttention``, ``AttentionRope``, ``AttentionPoolLatent``...); its channel
    attentions (``SqueezeExcite``, ``EcaModule``, ``CbamModule``) have none."""
    return isinstance(getattr(module, "num_heads", None), int)


def attention_blocks(model: Any, option: str) -> list[Any]:
    """The transformer blocks of a timm model (Note [timm's transformer blocks]): the modules
    with an attention among their children, outermost only, in model order (ViT's
    ``blocks.i``, Swin's ``layers.i.blocks.j``), not the model itself (its attention pool).

    Args:
        model: the timm model (or peft's wrapper of it).
        option: the option's name and value for the refusal (``"activation_checkpointing=
            selective"``).

    Returns:
        The blocks, in order.

    Raises:
        NotApplicableError: the model has no attention (a CNN): the option has no meaning.
    """
    found = transformer_blocks(model)
    if not found:
        raise NotApplicableError(
            f"{option}: {type(base_model(model)).__name__} has no attention blocks (a "
            "convolutional network); the option acts on a transformer's attention and MLP "
            f"(its matmuls, heads and token sequence); {TRACED}"
        )
    return found


def transformer_blocks(model: Any) -> list[Any]:
    """:func:`attention_blocks`, empty on a CNN."""
    base = base_model(model)
    found: list[Any] = []
    inside: set[int] = set()
    for module in base.modules():
        if module is base or id(module) in inside or _is_attention(module):
            continue
        if any(_is_attention(child) for child in module.children()):
            found.append(module)
            inside.update(id(m) for m in module.modules())
    return found


def apply_timm_selective_checkpointing(model: Any, checkpoint_kwargs: dict[str, Any]) -> None:
    """Checkpoint each transformer block of a timm model with the selective policy's
    ``context_fn`` in ``checkpoint_kwargs`` (Note [timm's transformer blocks]).

    Args:
        model: the timm model (or peft's wrapper of it).
        checkpoint_kwargs: ``torch.utils.checkpoint.checkpoint``'s keyword arguments
            (``use_reentrant=False``, ``context_fn``).

    Raises:
        NotApplicableError: a CNN (no attention blocks).
    """
    from torch.utils.checkpoint import checkpoint

    for block in attention_blocks(model, "activation_checkpointing=selective"):
        block.forward = functools.partial(checkpoint, block.forward, **checkpoint_kwargs)


def _refusal(block: Any, why: str) -> UnsupportedError:
    return UnsupportedError(
        f"tensor_parallel_size: {type(block).__name__} {why}; the traced plan shards timm's "
        "ViT blocks (timm.layers Attention's qkv / proj, Mlp's fc1 / fc2); shard this model "
        "with FSDP instead (--zero-stage 3 --data-parallel-size N)"
    )


def _check_block(block: Any, t: int) -> None:
    attn: Any = getattr(block, "attn", None)
    mlp: Any = getattr(block, "mlp", None)
    if not _is_timm_attention(attn):
        raise _refusal(block, f"has attention {type(attn).__name__}, not timm's Attention")
    if not _is_timm_mlp(mlp):
        raise _refusal(block, f"has MLP {type(mlp).__name__}, not timm's Mlp")
    if not hasattr(attn, "attn_dim"):  # timm before attn_dim reshaped by the input's width
        raise _refusal(block, "reshapes its attention output by the input's width (timm < 1.0)")
    for name, norm in (("attn.norm", attn.norm), ("mlp.norm", mlp.norm)):
        if not isinstance(norm, torch.nn.Identity):
            raise _refusal(block, f"normalises the sharded features ({name})")
    if attn.gate is not None:
        raise _refusal(block, "gates its attention output (attn.gate)")
    if attn.num_heads % t:
        raise UnsupportedError(
            f"tensor_parallel_size: {t} must divide the attention heads ({attn.num_heads}); "
            "ColwiseParallel splits them"
        )


def apply_timm_tensor_parallel(model: Any, tp_mesh: Any, *, sequence_parallel: bool) -> None:
    """Parallelize a timm model's transformer blocks in place over ``tp_mesh``; see Note [timm's
    transformer blocks].

    Args:
        model: the timm model or peft's wrapper of it (call inside the fake mode).
        tp_mesh: 1-D ``DeviceMesh`` of the tensor-parallel ranks.
        sequence_parallel: shard the residual stream inside the blocks by tokens.

    Raises:
        NotApplicableError: a CNN.
        UnsupportedError: a block outside the plan, or heads t does not divide.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    from trainmem.trace.tensor_parallel import adapter_plan, replicate_adapters

    t = tp_mesh.size()
    blocks = attention_blocks(model, f"tensor_parallel_size={t}")
    for block in blocks:  # refuse before changing anything
        _check_block(block, t)
    seq = Shard(1) if sequence_parallel else Replicate()
    local = not sequence_parallel
    for block in blocks:
        plan: dict[str, Any] = {}
        replicated: list[tuple[Any, bool]] = []
        for path in ("attn.qkv", "mlp.fc1"):  # Note [LoRA under tensor parallelism]
            replicated += adapter_plan(block, path, ColwiseParallel(), plan, column=True)
        for path in ("attn.proj", "mlp.fc2"):
            style = RowwiseParallel(output_layouts=seq, use_local_output=local)
            replicated += adapter_plan(
                block, path, style, plan, column=False, output_layouts=seq, local_output=local
            )
        if sequence_parallel:
            plan.update({n: SequenceParallel() for n in ("norm1", "norm2")})
            for name in ("attn", "mlp"):
                plan[name] = PrepareModuleInput(
                    input_layouts=(seq,),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                )
        parallelize_module(block, tp_mesh, plan)
        replicate_adapters(replicated, tp_mesh)
        block.attn.num_heads //= t
        block.attn.attn_dim //= t
    if sequence_parallel:  # the blocks' input split by tokens, their output gathered
        parallelize_module(
            blocks[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=False
            ),
        )
        parallelize_module(
            blocks[-1],
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=(seq,), desired_output_layouts=(Replicate(),), use_local_output=True
            ),
        )


def padded_tokens(tokens: int, cp: int) -> int:
    """``tokens`` rounded up to a multiple of ``cp``: the sequence each context rank's equal
    chunk is cut from (Note [Context parallelism of a ViT's tokens])."""
    return -(-tokens // cp) * cp


def vit_tokens(model: Any) -> int | None:
    """The token count of a ViT's blocks at the size it was built for: its patches plus its class
    / register / distillation tokens (timm 1.0.31 ``VisionTransformer``: ``patch_embed.
    num_patches``, ``num_prefix_tokens``), or None for a model without them."""
    base = base_model(model)
    patches = getattr(getattr(base, "patch_embed", None), "num_patches", None)
    if not isinstance(patches, int):
        return None
    return patches + int(getattr(base, "num_prefix_tokens", 0) or 0)


def context_parallel_note(model: Any, cp: int) -> str | None:
    """What the estimate assumes of a ViT's tokens over ``cp`` context ranks, for its notes (None:
    not a ViT whose tokens are known)."""
    tokens = vit_tokens(model)
    if tokens is None or cp == 1:
        return None
    padded = padded_tokens(tokens, cp)
    if padded == tokens:
        return f"context parallel {cp}: the ViT's {tokens} tokens split {tokens // cp} per rank"
    return (
        f"context parallel {cp}: tokens padded {tokens} -> {padded} ({padded - tokens} zero "
        f"token(s) after the last patch), {padded // cp} per rank: torch's ring attention "
        "all-gathers equal chunks and takes no attention mask, so the pad tokens are keys every "
        f"query sees; trimmed back to {tokens} after the last block"
    )


def apply_timm_context_parallel(model: Any, cp_mesh: Any) -> None:
    """Shard a ViT's patch tokens over the context-parallel ranks inside its blocks (Note [Context
    parallelism of a ViT's tokens]).

    Args:
        model: the timm model or peft's wrapper of it.
        cp_mesh: 1-D ``DeviceMesh`` of the context-parallel ranks.

    Raises:
        NotApplicableError: a CNN (no token sequence).
        UnsupportedError: blocks outside one ``nn.Sequential`` (Swin's stages merge tokens
            between them; EVA and BEiT call theirs in a loop with whole-sequence tables).

    Note [Context parallelism of a ViT's tokens]
        torch's ``context_parallel`` (torch 2.13 distributed/tensor/experimental/
        _context_parallel/_attention.py) shards the step's token buffers along the sequence
        before the step and makes SDPA ring attention (each rank's queries against every
        rank's keys and values, all-gathered by the default ``_AllGatherRotater``). A ViT's
        batch is pixels: its tokens exist after the patch embedding, the class token and the
        position table. So the first block takes its rank's contiguous chunk of the tokens
        (a ``Replicate -> Shard(1)`` redistribution, backward an all-gather) and the last
        all-gathers them, so the final norm, the pooling and the head run on all of them
        (their gradients flow back through the gather: the rank's chunk); inside, SDPA runs
        under the same dispatcher ``context_parallel`` enables, without a buffer to shard
        (:func:`trainmem.trace.parallel.context_parallel`). ViT's attention is non-causal, and
        torch's ring attention refuses load balancing without ``is_causal``
        (``_templated_ring_attention``: "Load balancing requires `is_causal=True`"): the
        chunks stay in order, as ``context_parallel`` leaves them when the sequence does not
        divide by twice the ranks.

        The ring needs equal chunks (``_AllGatherRotater`` all-gathers each rank's keys and
        values with ``all_gather_single`` and cuts the result in ``world_size`` equal pieces),
        and a ViT's count rarely divides (224 x 224 at patch 16: 196 patches + 1 class token =
        197). So the tokens are padded with zeros at the end to the next multiple of the ranks
        (``F.pad``: 197 -> 198 over 2 ranks, 99 each), the blocks run on the equal chunks, and
        their all-gathered output is trimmed back with ``narrow`` (a view of the gathered
        tokens) before the final norm: the sequence-parallel code of the video DiTs does the
        same (VideoSys videosys/core/comm.py ``set_pad``, ``_split_sequence_func``: zeros
        concatenated at the end, equal splits; ``_gather_sequence_func``: all-gather, then
        ``narrow`` off the pad), as TransformerEngine's context-parallel utilities pad each
        sequence to a multiple of 2 cp (NVIDIA/TransformerEngine#2129; diffusers 0.42.1's
        ``EquipartitionSharder`` still asserts divisibility). torch 2.13's ring takes no
        attention mask (``_scaled_dot_product_ring_efficient_attention``: "attn_bias is not
        supported yet"), so the pad tokens are keys every query sees: a small change to the
        attention that a masked kernel would avoid at the cost of a mask, said in the
        estimate's notes (:func:`context_parallel_note`). Every rank holds the same N_pad / cp
        tokens, so rank 0, the one traced, is the largest.
    """
    from trainmem.trace.diffusers_parallel import output_gather_hook, split_hook

    cp = cp_mesh.size()
    blocks = attention_blocks(model, f"context_parallel_size={cp}")
    holder = getattr(base_model(model), "blocks", None)
    if not isinstance(holder, torch.nn.Sequential) or any(b not in holder for b in blocks):
        name = type(base_model(model)).__name__
        looped = isinstance(holder, torch.nn.ModuleList) and all(b in holder for b in blocks)
        why = (
            # timm 1.0.31 eva.py Eva.forward_features: ``blk(x, rope=rot_pos_embed)``; beit.py
            # Beit.forward_features: ``blk(x, shared_rel_pos_bias=rel_pos_bias)``
            f"{name}'s forward calls its blocks in a loop with tables of the whole token "
            "sequence beside the tokens (EVA's rotary embedding, BEiT's relative position "
            "bias), which a rank's chunk of tokens would need cut to its own positions"
            if looped
            else f"{name}'s stages change the token count between them"
        )
        raise UnsupportedError(
            "context_parallel_size: the traced token sharding runs ViT-style blocks called in "
            f"one nn.Sequential (model.blocks) on the tokens alone; {why}; shard this model "
            "with FSDP (--zero-stage 3) instead"
        )
    seen: list[int] = []  # this step's token count, for the trim after the last block

    def pad(_module: Any, args: Any) -> Any:
        tokens = int(args[0].shape[1])
        seen[:] = [tokens]
        extra = padded_tokens(tokens, cp) - tokens
        if not extra:
            return None
        return (torch.nn.functional.pad(args[0], (0, 0, 0, extra)), *args[1:])

    def trim(_module: Any, _args: Any, output: Any) -> Any:
        return output.narrow(1, 0, seen[0]) if output.shape[1] != seen[0] else None

    blocks[0].register_forward_pre_hook(pad)
    blocks[0].register_forward_pre_hook(split_hook(cp_mesh), with_kwargs=True)
    blocks[-1].register_forward_hook(output_gather_hook(cp_mesh))
    holder.register_forward_hook(trim)  # (outside FSDP's block: its output is no view)
