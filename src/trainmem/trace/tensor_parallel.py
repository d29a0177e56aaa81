"""Tensor and sequence parallelism with DTensor (``parallelize_module``), as torchtitan applies it.

Note [Tracing tensor parallelism]
    ``tensor_parallel_size=t`` is traced with ``torch.distributed.tensor.parallel`` over the
    ``tp`` dimension of the device mesh, following torchtitan's ``apply_tp``
    (``torchtitan/models/llama3/infra/parallelize.py``) on a transformers Llama-shaped model
    (module names ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj input_layernorm
    post_attention_layernorm``, ``embed_tokens``, final ``norm``, ``lm_head``):

    - per layer: q, k, v, gate, up ``ColwiseParallel``; o, down ``RowwiseParallel`` (output
      all-reduced, or reduce-scattered over the sequence with sequence parallelism);
    - with ``sequence_parallel``: both norms ``SequenceParallel`` and a ``PrepareModuleInput``
      on the attention and the MLP that all-gathers the sequence-sharded input (torchtitan's
      plan; torchtitan always runs SP with TP);
    - the token embedding ``RowwiseParallel`` (vocabulary-sharded, output all-reduced or
      reduce-scattered), the final norm ``SequenceParallel`` with SP, ``lm_head``
      ``ColwiseParallel`` with vocabulary-sharded logits (``Shard(-1)``) and the loss under
      ``loss_parallel()`` (torchtitan's default, ``disable_loss_parallel=False``);
    - a tied ``lm_head`` / embedding (both ``Shard(0)`` on the vocabulary) is re-tied;
    - without SP the norms hold replicated ``DTensor`` weights (:func:`_replicate`);
    - with float8 training the layer linears take torchao's ``Float8ColwiseParallel`` /
      ``Float8RowwiseParallel`` / ``PrepareFloat8ModuleInput`` (torchtitan, tensorwise
      scaling); the embedding and ``lm_head`` stay in high precision.

    With SP the residual stream between the modules stays a sequence-sharded ``DTensor``
    (torchtitan hands local tensors between its modules; the storages are the same local
    shards, and transformers' model-level code then reads the global sequence length for the
    positions and the mask).
    The attention's q/k/v outputs are local tensors with ``heads / t`` heads (transformers
    reshapes with ``-1`` heads). Both ``num_attention_heads`` and ``num_key_value_heads``
    must divide by t.

Note [LoRA under tensor parallelism]
    peft wraps each targeted linear (``lora.Linear``: ``base_layer``, ``lora_A``, ``lora_B``)
    and adds ``lora_B(lora_A(x)) * scaling`` to the base output. Under transformers' TP plan
    peft shards the adapters as the base (peft PR #3079, "LoRA and Transformers TP", and
    #3614, its DTensor form): beside a column-parallel base ``lora_A`` is a plain replicated
    linear on the replicated input and ``lora_B`` column-parallel (its output sharded as the
    base's); beside a row-parallel base ``lora_A`` is row-parallel on the sharded input (its
    r-wide output all-reduced, or reduce-scattered over the sequence with SP, as the base's)
    and ``lora_B`` a plain replicated linear. The plan here puts the base's style on
    ``base_layer`` and these on the adapters; the replicated adapters hold replicated
    ``DTensor`` weights (:func:`_replicate`).
"""

from __future__ import annotations

from typing import Any

from trainmem.errors import UnsupportedError
from trainmem.trace._torch import require_torch
from trainmem.trace.sequence_shard import save_sequence_shard

torch = require_torch()

__all__ = ["adapter_plan", "apply_tensor_parallel", "replicate_adapters"]

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


def _child(module: Any, path: str) -> Any:
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _unsupported(why: str) -> UnsupportedError:
    return UnsupportedError(
        f"tensor_parallel_size: the trace applies torchtitan's Llama TP plan, which needs {why}; "
        "use --engine analytic for this model"
    )


_LAYER_PARTS = (*(f"self_attn.{n}" for n in _ATTENTION), *(f"mlp.{n}" for n in _MLP), *_NORMS)


def _llama_stack(model: Any) -> tuple[str, Any] | None:
    """The longest ``nn.ModuleList`` whose layers have the Llama plan's modules, or None: a
    vision-language model's decoder layers, where the longest list may be its vision
    tower's (Pixtral's 24 blocks beside a cut text stack)."""
    best: tuple[str, Any] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        if all(isinstance(_child(module[0], part), torch.nn.Module) for part in _LAYER_PARTS):
            if best is None or len(module) > len(best[1]):
                best = (name, module)
    return best


def _find_parts(model: Any) -> tuple[str, Any, str, str]:
    """(layer stack path, layers, embedding path, final norm path) of a Llama-shaped model."""
    from trainmem.trace.lora import layer_stack

    stack_name, layers = _llama_stack(model) or layer_stack(model)
    first = layers[0]
    for name in _LAYER_PARTS:
        if not isinstance(_child(first, name), torch.nn.Module):
            raise _unsupported(f"a layer module {name!r} (Llama / Mistral / Qwen2 names)")
    parent = stack_name.rsplit(".", 1)[0] if "." in stack_name else ""
    prefix = f"{parent}." if parent else ""
    emb, norm = f"{prefix}embed_tokens", f"{prefix}norm"
    if getattr(model, "pipeline_stage", False):  # a stage holds them or not (trace.pipeline)
        return stack_name, layers, emb, norm
    if _child(model, emb) is None or _child(model, norm) is None:
        raise _unsupported("embed_tokens and norm next to the layers")
    if _child(model, "lm_head") is None:
        raise _unsupported("an lm_head")
    return stack_name, layers, emb, norm


def _has_weights(module: Any) -> bool:
    return module is not None and next(iter(module.parameters()), None) is not None


def check_heads(config: Any, tp: int) -> None:
    """Refuse head counts that do not divide by ``tp``.

    Raises:
        UnsupportedError: ``num_attention_heads`` or ``num_key_value_heads`` % tp != 0.
    """
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    for name, n in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if n is not None and n % tp:
            raise UnsupportedError(
                f"tensor_parallel_size: {tp} must divide {name}={n} (ColwiseParallel splits the "
                "heads)"
            )


def _adapted(layer: Any, path: str) -> bool:
    """The linear at ``path`` is wrapped by a peft LoRA layer (its ``base_layer``)."""
    module = _child(layer, path)
    return module is not None and hasattr(module, "base_layer") and hasattr(module, "lora_A")


def adapter_plan(
    block: Any,
    path: str,
    base_style: Any,
    plan: dict[str, Any],
    *,
    column: bool,
    output_layouts: Any = None,
    local_output: bool = True,
) -> list[tuple[Any, bool]]:
    """Add the ``parallelize_module`` entries of the linear at ``path`` (relative to
    ``block``) to ``plan``: ``base_style`` on the linear itself, or, when peft wraps it, on
    its ``base_layer`` with its adapters split as peft splits them (Note [LoRA under tensor
    parallelism]).

    Args:
        block: the module the plan is applied to.
        path: the linear's path in ``block``.
        base_style: the linear's ``ColwiseParallel`` / ``RowwiseParallel`` style.
        plan: the plan, updated in place.
        column: the base is column-parallel (else row-parallel).
        output_layouts: a row-parallel base's output layout (``Shard(1)`` under sequence
            parallelism), for its ``lora_A``.
        local_output: a row-parallel base returns a local tensor.

    Returns:
        The adapters left whole, with whether their output is made local, for
        :func:`replicate_adapters` after ``parallelize_module``.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not _adapted(block, path):
        plan[path] = base_style
        return []
    plan[f"{path}.base_layer"] = base_style
    if column:  # lora_A whole on the replicated input, lora_B split by its output
        plan[f"{path}.lora_B.default"] = ColwiseParallel()
        return [(_child(block, f"{path}.lora_A.default"), True)]
    # lora_A split by its input (the base's sharded input), its r-wide output reduced as the
    # base's; lora_B whole
    plan[f"{path}.lora_A.default"] = RowwiseParallel(
        output_layouts=output_layouts, use_local_output=local_output
    )
    return [(_child(block, f"{path}.lora_B.default"), local_output)]


def replicate_adapters(adapters: list[tuple[Any, bool]], mesh: Any) -> None:
    """Replicated ``DTensor`` weights for the adapters :func:`adapter_plan` leaves whole."""
    for module, local_output in adapters:
        _replicate(module, mesh, local_output=local_output)


def _replicate(module: Any, mesh: Any, *, local_output: bool = True) -> None:
    """Replicated ``DTensor`` parameters for a module TP leaves whole (a norm without SP, a
    LoRA adapter beside a sharded base: Note [LoRA under tensor parallelism]), with plain
    tensors in (a ``DTensor`` input passes as it is) and out (unless ``local_output`` is
    False): the optimizer's foreach kernels refuse a mix of plain tensors and DTensors
    (Megatron keeps these weights replicated too). Allocates nothing."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

    def to_dtensor(_mod: Any, inputs: Any, mesh: Any) -> Any:
        return tuple(
            DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
            else x
            for x in inputs
        )

    def to_local(_mod: Any, out: Any, _mesh: Any) -> Any:
        return out.to_local() if isinstance(out, DTensor) and local_output else out

    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)


def _styles(float8: bool) -> tuple[Any, Any, Any]:
    """(colwise, rowwise, prepare-input) styles: torchao's float8 ones under float8 training
    (torchtitan ``enable_float8_tensorwise_tp``: inputs cast to float8 before the all-gather)."""
    if float8:
        from torchao.float8.float8_tensor_parallel import (  # type: ignore[import-untyped,import-not-found]
            Float8ColwiseParallel,
            Float8RowwiseParallel,
            PrepareFloat8ModuleInput,
        )

        return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
    )

    return ColwiseParallel, RowwiseParallel, PrepareModuleInput


def apply_tensor_parallel(
    model: Any,
    tp_mesh: Any,
    *,
    sequence_parallel: bool,
    float8: bool = False,
    saves_gathered_input: bool = True,
) -> None:
    """Parallelize ``model`` in place over ``tp_mesh``; see Note [Tracing tensor parallelism].

    Args:
        model: a transformers Llama-shaped causal LM (fake or real tensors; call inside the
            fake mode for fake tensors).
        tp_mesh: 1-D ``DeviceMesh`` of the tensor-parallel ranks.
        sequence_parallel: shard the norms' activations over the sequence (Korthikanti et al.
            2022 sec. 4.2.2).
        float8: the layer linears are torchao ``Float8Linear`` (``trainmem.trace.float8``):
            torchao's float8 TP styles for them (float8 all-gather of their inputs).
        saves_gathered_input: with ``sequence_parallel``, the column-parallel linears save
            their all-gathered input (DTensor's); False: the sequence shard, gathered again in
            backward (Megatron's, Note [Megatron's column-parallel linears save the shard];
            ``TrainingConfig.sequence_parallel_saves_gathered_input``).

    Raises:
        UnsupportedError: the model does not have the Llama module names, or the heads do not
            divide.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    colwise, rowwise, prepare = _styles(float8)

    if getattr(model, "peft_config", None):  # peft's adapters sit in the base model's linears
        model = model.get_base_model()
    _, layers, emb, norm = _find_parts(model)
    config: Any = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):  # a vision-language model's heads are its text's
        config = config.get_text_config()
    check_heads(config, tp_mesh.size())
    seq = Shard(1) if sequence_parallel else Replicate()
    local = not sequence_parallel  # without SP the residual stream is a plain (replicated) tensor
    for layer in layers:
        # a remote-code stand-in's fused q/k/v (trainmem.trace.remote_code): its output split
        # by the shard's widths, each rank's heads' q, k and v as Megatron's fused layout has it
        qkv = ("qkv_proj",) if hasattr(_child(layer, "self_attn"), "qkv_proj") else _ATTENTION[:3]
        columns = [f"self_attn.{n}" for n in qkv] + ["mlp.gate_proj", "mlp.up_proj"]
        rows = ["self_attn.o_proj", "mlp.down_proj"]
        plan: dict[str, Any] = {}
        replicated: list[tuple[Any, bool]] = []
        for path in columns:  # Note [LoRA under tensor parallelism]
            replicated += adapter_plan(layer, path, colwise(), plan, column=True)
        for path in rows:
            style = rowwise(output_layouts=seq, use_local_output=local)
            replicated += adapter_plan(
                layer, path, style, plan, column=False, output_layouts=seq, local_output=local
            )
        if sequence_parallel:
            plan.update({n: SequenceParallel() for n in _NORMS})
            # float8: the input stays a DTensor (torchtitan's use_local_output=False default)
            plan["self_attn"] = prepare(
                input_kwarg_layouts={"hidden_states": seq},
                desired_input_kwarg_layouts={"hidden_states": Replicate()},
                use_local_output=not float8,
            )
            plan["mlp"] = prepare(
                input_layouts=(seq,),
                desired_input_layouts=(Replicate(),),
                use_local_output=not float8,
            )
        parallelize_module(layer, tp_mesh, plan)
        if sequence_parallel and not saves_gathered_input:
            save_sequence_shard(_child(layer, "self_attn"), tp_mesh, "hidden_states")
            save_sequence_shard(_child(layer, "mlp"), tp_mesh)
        replicate_adapters(replicated, tp_mesh)
    # a pipeline stage may lack the embedding, the final norm (an Identity) or the head
    head = getattr(model, "lm_head", None)
    embedding = _child(model, emb)
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    top: dict[str, Any] = {}
    if _has_weights(embedding):
        top[emb] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=local
        )
    if head is not None:
        top["lm_head"] = ColwiseParallel(
            input_layouts=seq, output_layouts=Shard(-1), use_local_output=False
        )
    if sequence_parallel and _has_weights(_child(model, norm)):
        top[norm] = SequenceParallel()
    parallelize_module(model, tp_mesh, top)
    if sequence_parallel and not saves_gathered_input and head is not None:
        save_sequence_shard(head, tp_mesh)
    if not sequence_parallel:
        for layer in layers:
            for name in _NORMS:
                _replicate(_child(layer, name), tp_mesh)
        if _has_weights(_child(model, norm)):
            _replicate(_child(model, norm), tp_mesh)
    if tied:  # both vocabulary-sharded (Shard(0)): one parameter again, as before
        assert head is not None and embedding is not None
        head.weight = embedding.weight
