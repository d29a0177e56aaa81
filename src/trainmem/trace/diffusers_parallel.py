"""Tensor and sequence parallelism of a diffusers model's blocks with DTensor (one traced rank).

Note [Tracing tensor parallelism of diffusers blocks]
    ``tensor_parallel_size=t`` on a diffusers model is traced with
    ``torch.distributed.tensor.parallel`` over the ``tp`` mesh dimension (under torch's fake
    process group, Note [Tracing one rank of a mesh]), in Megatron's layout on diffusers' module
    names, the layout diffusers' own ``_tp_plan`` writes for FLUX's double-stream blocks
    (diffusers models/transformers/transformer_flux.py; applied there by
    hooks/tensor_parallel.py ``apply_tensor_parallel`` with ``parallelize_module``). In every
    block :func:`trainmem.trace.lora.wrapped_blocks` names (``_repeated_blocks``, else the
    longest block list):

    - ``ColwiseParallel``: each attention's ``to_q``, ``to_k``, ``to_v``, ``add_q_proj``,
      ``add_k_proj``, ``add_v_proj`` and each ``FeedForward``'s ``net.0.proj`` (weight rows and
      bias);
    - ``RowwiseParallel``: each attention's ``to_out.0``, ``to_add_out`` and each
      ``FeedForward``'s ``net.2`` (weight columns; the bias whole, added after the all-reduce);
    - each ``Attention``'s ``heads`` divided by t: the classic processors reshape the local
      q / k / v by ``attn.heads`` (``AttnProcessor2_0``: ``head_dim = inner_dim // attn.heads``),
      diffusers' TP-aware ones by ``attn.head_dim`` with ``-1`` heads, so both see t-times fewer
      heads of the full head size;
    - a GEGLU input projection (``ff.net.0.proj`` of SDXL's blocks: hidden and gate halves)
      sharded as one block: each rank holds the shapes diffusers' ``PackedColwiseParallel([1,
      1])`` would give it (the values differ, which a memory trace does not read).

    Everything else (patch and timestep embedders, caption projection, adaLN tables, norms,
    the output projection) is whole on every rank, as plain tensors; the optimizer's foreach
    step then mixes them with the DTensor shards, under DTensor's ``implicit_replication``
    (:func:`mixed_parameters`), which reads a plain tensor as replicated (no copy).

    With ``sequence_parallel`` the residual stream inside a run of blocks is sequence-sharded
    (Korthikanti et al. 2022 sec. 4.2.2): each ``Attention`` and ``FeedForward`` all-gathers
    its ``hidden_states`` along the tokens (dim 1) and its row-parallel outputs reduce-scatter
    back to dim 1 (``output_layouts=Shard(1)``); the first block of each block list takes its
    rank's chunk of the tokens and the last all-gathers them, so the layers outside the blocks
    run on the whole sequence. Norms and the adaLN modulation run on the local tokens.

    LoRA: peft's adapters on these linears are split as peft splits them beside transformers'
    TP plan (Note [LoRA under tensor parallelism] in trainmem/trace/tensor_parallel.py, the
    same plan entries: ``lora_A`` whole and ``lora_B`` column-parallel beside a column-parallel
    base, ``lora_A`` row-parallel and ``lora_B`` whole beside a row-parallel one); what the
    language-model path refuses beside it (sequence parallelism, FSDP2, a quantized base,
    other variants: ``trainmem.estimate``) is refused here too.

    Not modelled (refused by name): a block linear outside attentions and ``FeedForward``s
    (FLUX's single-stream ``proj_mlp`` / packed ``proj_out``, diffusers'
    ``PackedRowwiseParallel``), q / k norms across all heads (Wan's ``rms_norm_across_heads``:
    the norm would need the other ranks' heads), sequence parallelism of joint (MMDiT)
    attention (SD3, FLUX: the text stream's sharding), heads that t does not divide.
"""

from __future__ import annotations

import contextlib
from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.trace._torch import require_torch

torch = require_torch()

__all__ = [
    "COLWISE",
    "ROW_SHARDED",
    "ROWWISE",
    "apply_diffusers_tensor_parallel",
    "denoiser_context_parallel",
    "is_attention",
    "mixed_parameters",
    "output_gather_hook",
    "split_hook",
]

COLWISE = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")
"""An attention's linears sharded by output features (diffusers' ``"colwise"``); a
``FeedForward``'s ``net.0.proj`` too."""
ROWWISE = ("to_out.0", "to_add_out")
"""An attention's linears sharded by input features (diffusers' ``"rowwise"``); a
``FeedForward``'s ``net.2`` too."""


def _is_linear(module: Any) -> bool:
    """An ``nn.Linear``, or a peft LoRA layer wrapping one (its ``base_layer``)."""
    base = getattr(module, "base_layer", None) if hasattr(module, "lora_A") else module
    return isinstance(base, torch.nn.Linear)


def _adapter_part(name: str) -> bool:
    """``name`` is inside a peft LoRA layer (its base layer, adapters or dropout)."""
    return any(p in ("base_layer", "lora_A", "lora_B", "lora_dropout") for p in name.split("."))


def is_attention(module: Any) -> bool:
    """A diffusers attention: ``Attention`` or one of the per-model classes
    (``FluxAttention``, ``WanAttention``...), all with ``heads`` and a ``to_q`` linear (LoRA-
    wrapped or not)."""
    return hasattr(module, "heads") and _is_linear(getattr(module, "to_q", None))


def _roles(block: Any) -> dict[str, str]:
    """Block-relative linear name -> ``colwise`` / ``rowwise``, from its attentions and
    ``FeedForward``s."""
    from diffusers.models.attention import FeedForward

    roles: dict[str, str] = {}
    for path, module in block.named_modules():
        prefix = f"{path}." if path else ""
        if is_attention(module):
            names = {n for n, m in module.named_modules() if _is_linear(m)}
            roles.update({prefix + n: "colwise" for n in COLWISE if n in names})
            roles.update({prefix + n: "rowwise" for n in ROWWISE if n in names})
        elif isinstance(module, FeedForward):
            roles[prefix + "net.0.proj"] = "colwise"
            roles[prefix + "net.2"] = "rowwise"
    return roles


def _refusal(block: Any, why: str) -> UnsupportedError:
    return UnsupportedError(
        f"tensor_parallel_size: {type(block).__name__} {why}, which the traced Megatron layout "
        "cannot shard; shard with FSDP2 instead (zero_stage 3, data_parallel_size)"
    )


def _block_plan(block: Any, sequence_parallel: bool) -> tuple[dict[str, Any], list[Any]]:
    """The ``parallelize_module`` plan of one block and the LoRA adapters it leaves whole
    (Note [LoRA under tensor parallelism]); refuses what the layout cannot place."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from trainmem.trace.tensor_parallel import adapter_plan

    roles = _roles(block)
    plan: dict[str, Any] = {}
    unplaced = []
    for name, module in block.named_modules():
        if _adapter_part(name):
            continue
        if _is_linear(module) and name not in roles and "norm" not in name:
            unplaced.append(name)  # (a norm's own linear, AdaLayerNorm's, stays whole)
        if is_attention(module):
            norm = getattr(module, "norm_q", None)
            weight = getattr(norm, "weight", None)
            if weight is not None and weight.numel() == module.to_q.out_features:
                raise _refusal(block, "normalises q / k across heads (qk_norm across heads)")
            if sequence_parallel and getattr(module, "add_q_proj", None) is not None:
                raise UnsupportedError(
                    "sequence_parallel: the joint (MMDiT) attention of "
                    f"{type(block).__name__} carries a text stream whose sequence sharding is "
                    "not traced; use tensor parallelism without --sequence-parallel"
                )
    if unplaced:
        raise _refusal(
            block, f"has linears outside attention / FeedForward ({', '.join(unplaced[:4])})"
        )
    whole: list[Any] = []
    out = Shard(1) if sequence_parallel else None
    for name, role in roles.items():
        if role == "colwise":
            whole += adapter_plan(block, name, ColwiseParallel(), plan, column=True)
        else:
            style = RowwiseParallel(output_layouts=out) if out else RowwiseParallel()
            whole += adapter_plan(block, name, style, plan, column=False, output_layouts=out)
    return plan, whole


def _gather_hook(mesh: Any) -> Any:
    """A forward pre-hook all-gathering ``hidden_states`` (first positional or keyword) from
    its rank's tokens (dim 1) to the whole sequence, differentiably (backward: the
    reduce-scatter), as ``PrepareModuleInput(Shard(1) -> Replicate)`` does."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def gather(x: Any) -> Any:
        d = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return d.redistribute(mesh, [Replicate()]).to_local()

    def hook(_module: Any, args: Any, kwargs: Any) -> Any:
        if args:
            return (gather(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": gather(kwargs["hidden_states"])}

    return hook


def split_hook(mesh: Any) -> Any:
    """A forward pre-hook keeping this rank's chunk of the tokens of ``hidden_states`` (a
    ``Replicate -> Shard(1)`` redistribution: a local view, backward an all-gather)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def split(x: Any) -> Any:
        d = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return d.redistribute(mesh, [Shard(1)]).to_local()

    def hook(_module: Any, args: Any, kwargs: Any) -> Any:
        if args:
            return (split(args[0]), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": split(kwargs["hidden_states"])}

    return hook


def output_gather_hook(mesh: Any) -> Any:
    """A forward hook all-gathering a block's output tokens (dim 1; a tuple's tensors)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def gather(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        d = DTensor.from_local(x, mesh, [Shard(1)], run_check=False)
        return d.redistribute(mesh, [Replicate()]).to_local()

    def hook(_module: Any, _args: Any, output: Any) -> Any:
        if isinstance(output, tuple):
            return tuple(gather(o) for o in output)
        return gather(output)

    return hook


def _runs_of_blocks(model: Any, blocks: list[Any]) -> list[list[Any]]:
    """``blocks`` grouped by the ``nn.ModuleList`` holding them, in model order (a block
    outside a list is a run of its own)."""
    runs: dict[int, list[Any]] = {}
    ids = {id(b) for b in blocks}
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            inside = [m for m in module if id(m) in ids]
            if inside:
                runs[id(module)] = inside
    grouped = {id(b) for run in runs.values() for b in run}
    return [*runs.values(), *([b] for b in blocks if id(b) not in grouped)]


def apply_diffusers_tensor_parallel(model: Any, tp_mesh: Any, *, sequence_parallel: bool) -> None:
    """Parallelize a diffusers model's blocks in place; see Note [Tracing tensor parallelism of
    diffusers blocks].

    Args:
        model: a diffusers ``ModelMixin`` (fake or real tensors; call inside the fake mode).
        tp_mesh: 1-D ``DeviceMesh`` of the tensor-parallel ranks.
        sequence_parallel: shard the residual stream inside the block lists by tokens.

    Raises:
        UnsupportedError: heads t does not divide, or a block linear outside the layout.
    """
    from diffusers.models.attention import FeedForward
    from torch.distributed.tensor.parallel import parallelize_module

    from trainmem.trace.lora import wrapped_blocks
    from trainmem.trace.tensor_parallel import replicate_adapters

    t = tp_mesh.size()
    blocks = wrapped_blocks(model, "compile")
    plans = [_block_plan(block, sequence_parallel) for block in blocks]  # refuse before changing
    attentions = [m for b in blocks for m in b.modules() if is_attention(m)]
    for attn in attentions:
        if attn.heads % t:
            raise UnsupportedError(
                f"tensor_parallel_size: {t} must divide the attention heads ({attn.heads}); "
                "ColwiseParallel splits them"
            )
    for block, (plan, whole) in zip(blocks, plans, strict=True):
        parallelize_module(block, tp_mesh, plan)
        replicate_adapters(whole, tp_mesh)  # Note [LoRA under tensor parallelism]
    for attn in attentions:
        attn.heads //= t
    if not sequence_parallel:
        return
    for block in blocks:
        for module in block.modules():
            if is_attention(module) or isinstance(module, FeedForward):
                module.register_forward_pre_hook(_gather_hook(tp_mesh), with_kwargs=True)
    for run in _runs_of_blocks(model, blocks):
        run[0].register_forward_pre_hook(split_hook(tp_mesh), with_kwargs=True)
        run[-1].register_forward_hook(output_gather_hook(tp_mesh))


def mixed_parameters(model: Any) -> contextlib.AbstractContextManager[Any]:
    """DTensor's ``implicit_replication`` when ``model`` trains both DTensor shards and plain
    tensors (a diffusers model under :func:`apply_diffusers_tensor_parallel`), so that the
    optimizer's foreach kernels take both in one list; else a no-op.

    Args:
        model: the parallelized model.

    Returns:
        A context manager for the step.
    """
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(p, DTensor) for p in model.parameters() if p.requires_grad}
    if len(kinds) < 2:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication

    return implicit_replication()


ROW_SHARDED = frozenset({"PixArtTransformer2DModel"})
"""Denoisers whose context parallelism is traced (Note [Context parallelism of a denoiser]):
checked to run SDPA self-attention over the image tokens alone and cross-attention to the
caption. (DiT's transformer is of this kind too, but its forward calls block 0's
``norm1.emb`` outside block 0, which FSDP2, required with CP, has not gathered.)"""


def _cross_attention_local(model: Any) -> contextlib.AbstractContextManager[Any]:
    """Inside each cross-attention of ``model`` (``attn.is_cross_attention``), SDPA runs as
    the plain function, not torch's ring: its keys and values are the whole caption on every
    rank (Note [Context parallelism of a denoiser])."""
    import torch.nn.functional as F  # noqa: N812

    inside: list[int] = [0]
    crosses = [m for m in model.modules() if is_attention(m) and m.is_cross_attention]

    @contextlib.contextmanager
    def scope() -> Any:
        plain = F.scaled_dot_product_attention  # torch's CP wrapper inside its context

        def enter(_m: Any, _args: Any) -> None:
            inside[0] += 1

        def leave(_m: Any, _args: Any, _out: Any) -> None:
            inside[0] -= 1

        handles = [h for m in crosses for h in (m.register_forward_pre_hook(enter),
                                                 m.register_forward_hook(leave))]  # fmt: skip
        ring = F.scaled_dot_product_attention
        original = _original_sdpa(ring)

        def sdpa(*args: Any, **kwargs: Any) -> Any:
            return (original if inside[0] else ring)(*args, **kwargs)

        F.scaled_dot_product_attention = sdpa
        try:
            yield
        finally:
            F.scaled_dot_product_attention = plain
            for h in handles:
                h.remove()

    return scope()


def _original_sdpa(wrapped: Any) -> Any:
    """The SDPA function torch's context parallelism replaced by ``wrapped``."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    return _attention._replaced_functions.get(wrapped, (None, wrapped))[1]


def denoiser_context_parallel(
    model: Any, mesh: Any, batches: list[Any], training: Any
) -> contextlib.AbstractContextManager[Any]:
    """torch's context parallelism around a denoiser's step; see Note [Context parallelism of
    a denoiser].

    Note [Context parallelism of a denoiser]
        ``context_parallel_size=c`` on a diffusers transformer runs torch's context
        parallelism as on a language model (``trainmem.trace.parallel.context_parallel``:
        ``torch.distributed.tensor.experimental.context_parallel`` over the ``cp`` mesh
        dimension, the buffers sharded in place with its head-tail load balancing, SDPA
        replaced by its ring attention over the CUDA flash / efficient kernels; FSDP2 shards
        over dp_shard x cp, torchtitan's mesh, HSDP's replicas beside it). The buffer is the
        latent batch ``hidden_states`` [b, c, h, w], sharded along its rows (dim 2): the patch
        embedding then makes the rank's ``h / c`` rows of patches, s / c image tokens (the
        positional table is computed for the local grid, ``PatchEmbed.forward``), every block
        runs on them and the prediction and its loss are the local rows'. The self-attention
        over the image tokens is the ring; a cross-attention (``attn.is_cross_attention``)
        attends to the whole caption on every rank, as diffusers' own context-parallel
        attention does (``WanAttnProcessor`` passes its ``parallel_config`` to self-attention
        only), so its SDPA runs as the plain kernel. diffusers' ``ContextParallelConfig`` /
        ``_cp_plan`` (models/_modeling_parallel.py) shards the same way after the patch
        embedding but ships no plan for PixArt, and its ring needs a class's processor calling
        ``dispatch_attention_fn``: torch's is the one that runs on any SDPA.

        Refused: joint (MMDiT) attention (SD3, FLUX: the text tokens join the image tokens'
        sequence, which a row shard of the latents does not split), UNets (their
        convolutions would need the neighbouring rows, a halo no CP implementation adds),
        latents whose rows ``c`` times the patch size does not divide, and any class not in
        :data:`ROW_SHARDED`: a self-attention that is not SDPA (Sana's linear attention
        would sum its key-value state over the local tokens only) or a caption joined to
        the image tokens without ``add_q_proj`` (Lumina2) would run without the exchange CP
        needs, silently; each class is added once checked.

    Args:
        model: the parallelized diffusers model.
        mesh: the traced mesh (with a ``cp`` dimension).
        batches: the micro-batches (dicts with ``hidden_states``), sharded in place.
        training: ``context_parallel_size``.

    Returns:
        A context manager for both steps.

    Raises:
        UnsupportedError: what is refused above.
    """
    from torch.distributed.tensor.experimental import context_parallel as cp_context

    c = training.context_parallel_size
    name = next(c.__name__ for c in type(model).__mro__ if c.__module__.startswith("diffusers."))
    latents: list[Any] = [b["hidden_states"] for b in batches if "hidden_states" in b]
    if any(getattr(m, "add_q_proj", None) is not None for m in model.modules() if is_attention(m)):
        raise UnsupportedError(
            f"context_parallel_size={c}: {name}'s joint (MMDiT) attention joins the text "
            "tokens to the image tokens' sequence, which sharding the latents' rows does not "
            "split; traced: FSDP2 / HSDP (--zero-stage 3 --data-parallel-size N) or tensor "
            "parallelism"
        )
    if name not in ROW_SHARDED:
        raise UnsupportedError(
            f"context_parallel_size={c}: {name} is not one of the denoisers whose context "
            f"parallelism is traced ({', '.join(sorted(ROW_SHARDED))}: SDPA self-attention "
            "over the image tokens alone, cross-attention to the caption); traced: FSDP2 / "
            "HSDP (--zero-stage 3 --data-parallel-size N)"
        )
    patch = int(dict(model.config).get("patch_size") or 1)
    rows = latents[0].shape[2]
    if rows % (2 * c * patch):  # the head-tail halves of every rank, whole patches each
        raise UnsupportedError(
            f"context_parallel_size={c}: the latents' {rows} rows do not split into 2 x {c} "
            f"chunks of whole {patch}-row patches; pick a resolution whose latent height "
            f"divides by {2 * c * patch}"
        )
    cp_mesh = mesh["cp"] if len(mesh.mesh_dim_names) > 1 else mesh

    @contextlib.contextmanager
    def step() -> Any:
        with cp_context(
            cp_mesh,
            buffers=latents,
            buffer_seq_dims=[2] * len(latents),
            no_restore_buffers=set(latents),
        ):
            with _cross_attention_local(model):
                yield

    return step()
