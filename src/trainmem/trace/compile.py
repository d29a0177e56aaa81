"""``torch.compile`` of each transformer layer, traced: AOTAutograd with inductor's partitioner.

Note [Tracing torch.compile]
    torchtitan compiles every transformer block on its own (``apply_compile``:
    ``torch.compile(block, fullgraph=True)``). What compiling changes in memory is decided by
    AOTAutograd, which traces forward + backward into one joint graph and splits it with
    inductor's partitioner, ``min_cut_rematerialization_partition``
    (``torch/_functorch/partitioners.py``; ``torch/_inductor/compile_fx.py`` passes it as
    ``partition_fn``): the forward graph's extra outputs are the tensors saved for backward,
    chosen by a min-cut that recomputes cheap pointwise ops in the backward instead of saving
    their outputs. Here each layer's ``forward`` is replaced by ``aot_function`` with that
    partitioner; the forward and backward graphs are then run op by op (no inductor codegen),
    on the fake tensors of the trace, so the recorder sees the compiled step's saved tensors and
    the backward's recomputation. Layers with the same signature (class, parameter shapes,
    attention kind) called with inputs that pass the same tensor guards (dtype, shape, strides,
    ``requires_grad``) share one traced graph, as dynamo reuses one compiled frame.

    Inductor also fuses pointwise ops into one kernel, so a pointwise intermediate whose users
    are all pointwise ops of the same graph is never materialised. With ``fuse_pointwise`` the
    graphs are run with those intermediates left out of the recording (see
    :func:`_fusible_nodes`); the rule ignores inductor's heuristics that refuse a fusion (too
    many inputs, reductions fused into pointwise epilogues), so it is an approximation.

    Activation checkpointing is inside the compiled region, as torchtitan applies it (the
    checkpoint wrapper first, then ``torch.compile`` of the wrapped block): dynamo turns the
    checkpoint into a ``tag_activation_checkpoint`` region whose forward ops carry a
    ``recompute`` tag (``PREFER_RECOMPUTE`` for full checkpointing; the selective policy's
    ``MUST_SAVE`` / ``PREFER_RECOMPUTE`` per op) and an ``ac_graph_id``, and the min-cut
    partitioner honours the tags (``torch/_functorch/partitioners.py``: ``must_recompute``
    nodes get an infinite edge to the sink, ``MUST_SAVE`` ones are banned from recomputation).
    Here the layer's checkpoint wrapper is switched off and the eager layer is traced; for
    op-level selective checkpointing the joint graph's forward ops are tagged with the same
    policy before the partition (:func:`_tag_checkpoint_region`). Full checkpointing becomes an
    eager checkpoint around the compiled layer: it saves the same thing (the layer input), and
    tagging every op as recomputed makes AOTAutograd functionalize the RNG of recomputed
    dropout (``run_and_save_rng_state``), which the fake-tensor trace cannot run. (Tracing
    through the checkpoint wrapper, as before, dropped it: AOTAutograd inlines the checkpointed
    function and keeps none of its saved-tensor hooks, so the partitioner chose on its own and
    saved what op-level SAC recomputes, and full checkpointing vanished.)

    The traced layer gets ``past_key_values=None`` (``cache=None`` from transformers 5.24, which
    renamed the layers' keyword behind ``@deprecate_kwarg``): a KV cache is generation-only and
    the cache object cannot enter the graph. Parameters are read when the layer is called, so
    FSDP2's unsharded parameters and TP's DTensors are the graph inputs, as under torch.compile.

Note [Static-lifetime parameters under compile]
    Dynamo lifts a module's parameters and buffers as graph inputs and marks them static
    (``torch/_dynamo/variables/builder.py``: ``mark_static_input`` for every ``nn.Parameter``
    and tensor attribute of an inlined module); AOTAutograd carries them as
    ``fw_metadata.static_input_indices`` (remapped onto the inner tensors of a subclass such as
    a ``DTensor`` or torchao's float8 weight) and passes them to the partition function as
    ``static_lifetime_input_indices`` (``torch/_functorch/_aot_autograd/graph_compile.py``
    ``_partition_joint_graph_into_fw_bw``; inductor's ``compile_fx.py`` calls
    ``min_cut_rematerialization_partition(..., compiler="inductor",
    static_lifetime_input_indices=...)``). With ``treat_parameters_as_free_to_save`` (default
    True, ``torch/_functorch/config.py``) saving such an input costs nothing in the min-cut
    (``partitioners.py`` ``get_node_weight``): it lives anyway. So a tensor computed from a
    weight alone (a float8 cast, its transposed contiguous copy) is recomputed in the backward
    from the saved weight rather than saved. ``aot_function`` has no static inputs, so the
    trace's partitioner marks the primal inputs whose descriptor (``node.meta["desc"]``) goes
    back to a parameter or buffer, as dynamo would (:func:`_static_lifetime_indices`). Without
    it the trace kept each float8 linear's transposed float8 weight (llama-3.2-1b FSDP 2 x
    TP 2 + SP, compile + float8: 29 MiB per layer, 7.24 -> 6.78 GiB); tensors computed from
    activations are unaffected.

Note [Compiled cross-entropy]
    torchtune compiles its chunked loss's per-chunk ``F.cross_entropy(logits.float(), ...)``
    on its own (``training.compile_loss``, torchtune 0.4.0 training/_compile.py);
    :func:`compile_loss` traces it as inductor would: AOTAutograd on inductor's decompositions
    (``torch/_inductor/decomposition.py`` ``select_decomp_table``, which ``compile_fx`` passes
    to AOTAutograd; without them ``_log_softmax`` stays one op whose fp32 output the partition
    saves), split by the min-cut partitioner, which saves the 16-bit input chunk, the row max
    and the log-sum-exp. Inductor then writes only its kernels' outputs: the reductions
    (``amax``, ``sum``) read the upcast and the subtractions inside their own loops, the
    backward's ``full`` + ``scatter`` is one pointwise ``where`` (``fx_passes/post_grad.py``
    ``scatter_upon_const_tensor``) and the rest fuses into the kernel that writes the 16-bit
    gradient. So in these graphs every node but the graph outputs and the reductions runs
    untracked (:func:`_kernel_internal_nodes`), and a graph input read inside a kernel is freed
    after that kernel, not at its last untracked reader (:func:`_free_inputs_after_their_kernel`:
    the 16-bit logits and their gradient are alive together in the backward, as inductor's
    code has them); checked on real CPU tensors with dynamo's
    ``aot_autograd`` backend on the same decompositions, whose forward saves exactly those
    tensors. A rule for loss graphs only: in a layer, inductor also writes the inputs of its
    extern kernels (``mm``, SDPA), which :func:`_fusible_nodes` keeps.

Note [Compiled graphs own their inputs]
    AOTAutograd gives the compiled backward sole ownership of its inputs: it clears the
    autograd context's saved tensors before the call (``ctx.maybe_clear_saved_tensors()``) and
    passes the argument list with ``steal_args=True`` to a boxed function
    (``torch/_functorch/_aot_autograd/runtime_wrappers.py``, ``utils.py``
    ``call_func_at_runtime_with_args``). Inductor's generated ``call(args)`` unpacks the list,
    calls ``args.clear()`` and ``del``s every buffer, inputs included, after its last reader
    (``torch/_inductor/codegen/wrapper.py``). So a saved activation or a recomputed tensor is
    freed inside the backward graph once its last op has run, not when the graph returns. The
    trace's runner does the same: it takes the inputs out of the list, drops the ones no op
    reads, and the FX interpreter frees the rest after their last use.
    ``functorch.compile.make_boxed_func`` would keep the list (``f(*args)``) and with it every
    input to the end of the graph: on llama-3.1-405b shapes (TP 8 + SP, full checkpointing,
    compile) that held three more [t, h] / [t, i / 8] tensors at the layer's backward peak.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import operator
from collections.abc import Iterator
from typing import Any

from trainmem.trace._torch import require_torch
from trainmem.trace.recorder import untracked

torch = require_torch()

__all__ = ["compile_layers", "compile_loss"]

_POINTWISE_TAG = "pointwise"
_CACHE_KWARGS = ("past_key_values", "cache")
"""The decoder layers' KV-cache keyword: ``past_key_values`` up to transformers 5.23, ``cache``
from 5.24 (``modeling_llama.py`` ``LlamaDecoderLayer.forward``)."""


def _is_pointwise(node: Any) -> bool:
    target = node.target
    tags = getattr(target, "tags", ())
    return node.op == "call_function" and any(str(t).endswith(_POINTWISE_TAG) for t in tags)


def _fusible_nodes(gm: Any) -> set[str]:
    """Pointwise nodes whose every user is a pointwise node and which are not graph outputs:
    inductor fuses them into their consumers' kernel, so they get no buffer."""
    out: set[str] = set()
    outputs = {n.name for n in gm.graph.nodes if n.op == "output" for n in n.all_input_nodes}
    for node in gm.graph.nodes:
        if not _is_pointwise(node) or node.name in outputs or not node.users:
            continue
        if all(_is_pointwise(u) for u in node.users):
            out.add(node.name)
    return out


def _kernel_internal_nodes(gm: Any) -> set[str]:
    """Every node of a loss graph but its outputs and its reductions' outputs; see Note
    [Compiled cross-entropy]."""
    outputs = {n.name for n in gm.graph.nodes if n.op == "output" for n in n.all_input_nodes}
    return {
        n.name
        for n in gm.graph.nodes
        if n.op == "call_function"
        and n.name not in outputs
        and torch.Tag.reduction not in getattr(n.target, "tags", ())
    }


def _free_inputs_after_their_kernel(
    gm: Any, fused: set[str], last_uses: dict[Any, list[Any]]
) -> None:
    """Free a graph input that a kernel reads (a node of ``fused`` runs inside the kernel of
    the first nodes not in ``fused`` it flows into) after the last such kernel has run, not
    after its last fused reader: inductor's generated code allocates a kernel's output buffer,
    runs the kernel, and only then ``del``s the inputs it read
    (torch/_inductor/codegen/wrapper.py), so an input and the output written from it are
    alive together. A loss graph's input (the logits) is a forward input, never a donated
    buffer the kernel could write in place (torch/_inductor/ir.py ``DonatedBuffer``: "a saved
    tensor that is not alias to any fwd inputs"). Edits ``last_uses`` (the FX interpreter's
    ``user_to_last_uses``) in place; see Note [Compiled cross-entropy]."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    ends: dict[Any, set[Any]] = {}
    for node in reversed(nodes):  # users come later: their kernel ends are known
        if node.name in fused:
            ends[node] = set().union(*(ends.get(u, {u}) for u in node.users))
    for user, dying in list(last_uses.items()):
        for value in [v for v in dying if v.op == "placeholder" and user.name in fused]:
            kernels = set().union(*(ends.get(u, {u}) for u in value.users))
            last = max(kernels, key=order.__getitem__)
            dying.remove(value)
            last_uses.setdefault(last, []).append(value)


def _graph_runner(fuse_pointwise: bool, *, loss_kernels: bool = False) -> Any:
    """The compiler handed to AOTAutograd: runs each graph op by op on the trace's tensors,
    owning its inputs as inductor's generated code does (Note [Compiled graphs own their
    inputs]); with ``fuse_pointwise`` the fusible pointwise intermediates are run untracked,
    with ``loss_kernels`` every node but the outputs and the reductions (Note [Compiled
    cross-entropy])."""

    def compiler(gm: Any, _example_inputs: Any) -> Any:
        if loss_kernels:
            fused = _kernel_internal_nodes(gm)
        else:
            fused = _fusible_nodes(gm) if fuse_pointwise else set()

        class Interpreter(torch.fx.Interpreter):  # type: ignore[misc,name-defined]
            def __init__(self, inputs: collections.deque[Any]) -> None:
                super().__init__(gm)
                self._inputs = inputs
                if loss_kernels:
                    _free_inputs_after_their_kernel(gm, fused, self.user_to_last_uses)

            def run_node(self, n: Any) -> Any:
                if n.op == "placeholder":
                    value = self._inputs.popleft()
                    # An input no op reads is dropped at once, as inductor's ``args.clear()``
                    # drops it; the interpreter only frees values after their last user.
                    return value if n.users else None
                if n.name in fused:
                    with untracked():
                        return super().run_node(n)
                return super().run_node(n)

        def run(args: list[Any]) -> Any:
            inputs = collections.deque(args)
            args.clear()
            return Interpreter(inputs).run(enable_io_processing=False)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    return compiler


@contextlib.contextmanager
def _allow_fake_constants() -> Iterator[None]:
    """AOTAutograd refuses fake tensors captured as graph constants (a check meant for
    dynamo's real-tensor modules); in the trace every tensor is fake on purpose."""
    import torch._dynamo.utils as dynamo_utils

    orig = dynamo_utils.assert_no_fake_params_or_buffers
    dynamo_utils.assert_no_fake_params_or_buffers = lambda _gm: None  # type: ignore[assignment]
    try:
        yield
    finally:
        dynamo_utils.assert_no_fake_params_or_buffers = orig


def _layer_signature(layer: Any) -> tuple[Any, ...]:
    """What makes two layers' graphs identical: class, parameter shapes / dtypes / types, and
    the attention kind of alternating-attention models (``attention_type``, Gemma-2/3)."""
    params = tuple(
        (n, tuple(p.shape), p.dtype, type(p))
        for n, p in layer.named_parameters(remove_duplicate=False)
    )
    attn = getattr(layer, "attention_type", None) or getattr(
        getattr(layer, "self_attn", None), "sliding_window", None
    )
    return (type(layer), params, repr(attn))


def _input_guards(leaves: list[Any]) -> tuple[Any, ...]:
    """What dynamo's tensor guards check of a compiled frame's tensor inputs (dtype, shape,
    strides, ``requires_grad``; ``torch/_dynamo/guards.py`` ``TENSOR_MATCH``): a call that fails
    them is recompiled into a graph of its own. A PixArt block under bf16 autocast gets the
    patch embedding's bf16 output in block 0 and the fp32 residual stream after it, so block 1
    has a graph of its own, which saves its fp32 input for the LayerNorm's backward (block 0's
    graph saves the fp32 cast of its bf16 input instead)."""
    return tuple(
        (x.dtype, tuple(x.shape), x.stride(), x.requires_grad)
        for x in leaves
        if isinstance(x, torch.Tensor)
    )


def _forward_nodes(gm: Any, num_fwd_outputs: int) -> list[Any]:
    """The joint graph's call_function nodes the forward outputs depend on, in graph order."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    todo = [a for a in output.args[0][:num_fwd_outputs] if hasattr(a, "all_input_nodes")]
    seen: set[Any] = set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        todo.extend(node.all_input_nodes)
    return [n for n in gm.graph.nodes if n in seen and n.op == "call_function"]


def _tag_checkpoint_region(gm: Any, num_fwd_outputs: int, checkpointing: str) -> None:
    """Tag the forward ops as dynamo tags a ``torch.utils.checkpoint`` region
    (``node.meta["recompute"]``, ``node.meta["ac_graph_id"]``): every op ``PREFER_RECOMPUTE``
    under full checkpointing, the selective policy's choice per op under ``selective``
    (:func:`trainmem.trace.sac.selective_policy`, called in forward order as at run time)."""
    from types import SimpleNamespace

    from torch.utils.checkpoint import CheckpointPolicy

    from trainmem.trace.sac import selective_policy

    policy = selective_policy() if checkpointing == "selective" else None
    ctx = SimpleNamespace(is_recompute=False)
    for node in _forward_nodes(gm, num_fwd_outputs):
        tag = CheckpointPolicy.PREFER_RECOMPUTE
        if node.target is operator.getitem:  # an output of a multi-output op: the op's tag
            tag = node.args[0].meta.get("recompute", tag)
        elif policy is not None and isinstance(node.target, torch._ops.OpOverload):
            tag = policy(ctx, node.target)
        node.meta["recompute"] = tag
        node.meta["ac_graph_id"] = 1


def _static_lifetime_indices(joint: Any, num_params_buffers: int) -> list[int]:
    """Positions, among the joint graph's primal inputs, of the tensors that make up the
    layer's parameters and buffers (a tensor subclass such as a ``DTensor`` or a float8 weight
    is unpacked into its inner tensors, each a primal input; see Note [Static-lifetime
    parameters under compile]).

    Args:
        joint: AOTAutograd's joint forward-backward graph.
        num_params_buffers: how many of the flat inputs, first, are parameters and buffers.

    Returns:
        The indices, in primal-input order, as inductor passes them to the partitioner.
    """
    from torch._functorch._aot_autograd.descriptors import (
        PlainAOTInput,
        SubclassGetAttrAOTInput,
    )
    from torch._functorch._aot_autograd.utils import _is_primal

    out: list[int] = []
    for i, node in enumerate(n for n in joint.graph.nodes if _is_primal(n)):
        desc = node.meta.get("desc")
        while isinstance(desc, SubclassGetAttrAOTInput):
            desc = desc.base
        if isinstance(desc, PlainAOTInput) and desc.idx < num_params_buffers:
            out.append(i)
    return out


def _partitioner(checkpointing: str, num_params_buffers: int) -> Any:
    """Inductor's partitioner as inductor calls it: the parameters and buffers as
    static-lifetime inputs (Note [Static-lifetime parameters under compile]), after tagging
    the checkpoint region (Note [Tracing torch.compile])."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        if checkpointing == "selective":
            _tag_checkpoint_region(joint, kwargs["num_fwd_outputs"], checkpointing)
        kwargs["static_lifetime_input_indices"] = _static_lifetime_indices(
            joint, num_params_buffers
        )
        return min_cut_rematerialization_partition(
            joint, joint_inputs, compiler="inductor", **kwargs
        )

    return partition


def _uncheckpointed(layer: Any) -> Any:
    """The layer's forward without its checkpoint wrapper (transformers'
    ``GradientCheckpointingLayer`` flag, or the ``functools.partial(checkpoint, forward)`` of
    :func:`trainmem.trace.engine.apply_activation_checkpointing`)."""
    from torch.utils.checkpoint import checkpoint

    if getattr(layer, "gradient_checkpointing", False):
        layer.gradient_checkpointing = False
    forward = layer.forward
    if isinstance(forward, functools.partial) and forward.func is checkpoint:
        return forward.args[0]
    return forward


def _compile_layer(
    layer: Any, fuse_pointwise: bool, compiled: dict[Any, Any], checkpointing: str
) -> None:
    import torch.utils._pytree as pytree
    from torch._functorch.aot_autograd import aot_function
    from torch.nn.utils.stateless import _reparametrize_module

    eager_forward = _uncheckpointed(layer) if checkpointing != "none" else layer.forward
    runner = _graph_runner(fuse_pointwise)

    def forward(*args: Any, **kwargs: Any) -> Any:
        for name in _CACHE_KWARGS:
            if name in kwargs:
                kwargs[name] = None
        params = dict(layer.named_parameters(remove_duplicate=False))
        buffers = dict(layer.named_buffers(remove_duplicate=False))
        leaves, spec = pytree.tree_flatten((args, kwargs))
        is_tensor = tuple(isinstance(x, torch.Tensor) for x in leaves)
        consts = tuple(None if t else x for x, t in zip(leaves, is_tensor, strict=True))
        key = (
            _layer_signature(layer),
            spec,
            is_tensor,
            tuple(repr(c) for c in consts),
            checkpointing,
            _input_guards(leaves),
        )
        if key not in compiled:

            def functional(params: Any, buffers: Any, tensors: Any) -> Any:
                it = iter(tensors)
                full = [next(it) if t else c for t, c in zip(is_tensor, consts, strict=True)]
                a, k = pytree.tree_unflatten(full, spec)
                with _reparametrize_module(layer, {**params, **buffers}):
                    return eager_forward(*a, **k)

            compiled[key] = aot_function(
                functional,
                fw_compiler=runner,
                bw_compiler=runner,
                partition_fn=_partitioner(checkpointing, len(params) + len(buffers)),
            )
        tensors = [x for x, t in zip(leaves, is_tensor, strict=True) if t]
        with _allow_fake_constants():
            return compiled[key](params, buffers, tensors)

    if checkpointing == "full":
        from torch.utils.checkpoint import checkpoint

        layer.forward = functools.partial(checkpoint, forward, use_reentrant=False)
    else:
        layer.forward = forward


def compile_layers(model: Any, *, fuse_pointwise: bool = True, checkpointing: str = "none") -> None:
    """Replace each transformer layer's ``forward`` by its AOTAutograd-compiled version, in
    place; see Note [Tracing torch.compile].

    Args:
        model: the model (fake or real tensors); the layers are
            ``trainmem.trace.lora.layer_stack``'s.
        fuse_pointwise: leave out of the recording the pointwise intermediates inductor fuses.
        checkpointing: the layers' activation checkpointing (``none``, ``full``,
            ``selective``), applied inside the compiled region as dynamo does.

    Raises:
        UnsupportedError: no layer stack.
    """
    from trainmem.trace.lora import wrapped_blocks

    layers = wrapped_blocks(model, "compile")
    compiled: dict[Any, Any] = {}  # identical layers share one graph, as dynamo's cache does
    for layer in layers:
        _compile_layer(layer, fuse_pointwise, compiled, checkpointing)


def compile_loss(fn: Any) -> Any:
    """``fn`` (a loss on tensors) as ``torch.compile`` with inductor runs it: AOTAutograd on
    inductor's decompositions, split by the min-cut partitioner, each graph run op by op on the
    trace's tensors keeping only the buffers inductor's kernels write (Note [Compiled
    cross-entropy]). One graph per input signature, as dynamo guards on static shapes.

    Args:
        fn: ``fn(*tensors) -> tensor``.

    Returns:
        The compiled ``fn``.
    """
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    runner = _graph_runner(True, loss_kernels=True)
    compiled: dict[Any, Any] = {}

    def forward(*tensors: Any) -> Any:
        key = tuple((tuple(x.shape), x.dtype, x.requires_grad) for x in tensors)
        if key not in compiled:
            compiled[key] = aot_function(
                fn,
                fw_compiler=runner,
                bw_compiler=runner,
                partition_fn=functools.partial(
                    min_cut_rematerialization_partition, compiler="inductor"
                ),
                decompositions=select_decomp_table(),
            )
        with _allow_fake_constants():
            return compiled[key](*tensors)

    return forward
