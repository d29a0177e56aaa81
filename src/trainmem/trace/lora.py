"""LoRA through peft: map trainmem's linear names to a model's modules and wrap it.

trainmem names the linears of a transformer layer ``q``, ``k``, ``v``, ``o``, ``gate``, ``up``,
``down`` (``trainmem.specs.training.LORA_TARGETS``) plus ``lm_head``. The HF module names differ
per family (Llama ``q_proj`` ... ``down_proj``; GPT-2 ``c_attn`` / ``attn.c_proj`` / ``c_fc`` /
``mlp.c_proj``; BERT ``query`` ... ``output.dense``; Falcon ``query_key_value`` ...), so the
mapping is read off the built model instead of a table:

Note [LoRA target inference]
    The layer stack is the longest ``nn.ModuleList`` of one module class whose layers hold
    attention linears (a vision-language model's: its ``language_model``'s,
    :func:`_adapted_stack`; not wav2vec2's longer list of feature convolutions). In its first
    layer that holds attention (a hybrid's first attention layer) the linears (``nn.Linear`` or
    transformers' ``Conv1D``) are taken in definition order and split by their path: a linear
    under a path component containing ``attn`` / ``attention`` belongs to that attention module
    (a decoder layer has two, ``self_attn`` and ``encoder_attn``), anything else to the MLP.
    Per attention module: the last linear is ``o`` (or the one named as an output, ``o_proj`` /
    ``out_proj`` / ``dense``..., where Phi-3 defines it first); one other linear is a fused
    q/k/v (any of ``q``, ``k``, ``v`` targets it, as in peft), three are ``q``, ``k``, ``v``: by
    their names (``q_proj`` / ``query`` / ``q`` ...) when each is found once, else in order
    (CLIP and SigLIP define ``k_proj``, ``v_proj``, ``q_proj``); more than four when q, k, v
    and one output are named (Parakeet's ``relative_k_proj`` gets no role); multi-head latent
    attention by its names (:func:`_mla_roles`). A decoder layer's q is its self- and
    cross-attention's q, as peft's name matching adapts both. MLP: the last linear is
    ``down``; two before it are ``gate``, ``up`` (gated MLP, ``act(gate(x)) * up(x)``), one is
    ``up``, or a fused ``gate_up`` when its out_features are twice ``down``'s in_features
    (Phi-3); several feed-forward modules (a conformer's two) each so; other MLP linears (an
    MoE block's router, experts fused into one module's parameters in transformers 5) get no
    role: ``gate`` / ``up`` / ``down`` then adapt the fused experts where peft does
    (:func:`_expert_target`), are refused elsewhere, and attention targets still run.
    The relative paths found are targeted in every layer that has them, the roles of a layer
    list of another class (a speech- or vision-encoder-decoder's BERT decoder beside its
    wav2vec2 / ViT encoder) are read from its own layers, and the modules peft's name matching
    reaches besides (:func:`_peft_matches`) are added; ``lm_head`` is
    ``get_output_embeddings()``. Checked against real peft 0.21.2 on CPU for each family
    (tests/trace/test_lora_peft_counts.py).

peft is applied to the ``meta``-built model (on fake tensors peft's ``.to()`` fails,
shared/notes/tracing-without-a-gpu.md sec. 1) with ``get_peft_model``'s defaults: the adapters
of a 16-bit base are upcast to fp32 (``autocast_adapter_dtype=True``), every base parameter is
frozen, so only ``lora_A`` / ``lora_B`` get gradients and optimizer states.
"""

from __future__ import annotations

import warnings
from collections import Counter
from typing import Any

from trainmem.errors import SpecError, UnsupportedError
from trainmem.specs.training import LORA_TARGETS, LYCORIS_VARIANTS, TrainingConfig
from trainmem.trace._torch import require_torch
from trainmem.trace.quantized import weight_read_directly

torch = require_torch()

__all__ = [
    "ADALORA_TOTAL_STEPS",
    "adapter_config",
    "apply_lora",
    "lokr_module_dropout_off",
    "cast_adapters",
    "layer_linear_roles",
    "layer_stack",
    "lora_linear_names",
    "lora_target_modules",
    "modules_to_save",
    "wrapped_blocks",
]


def _is_linear(module: Any) -> bool:
    return isinstance(module, torch.nn.Linear) or type(module).__name__ == "Conv1D"


def _features(module: Any) -> tuple[int, int]:
    """(in_features, out_features); transformers' Conv1D stores its weight as [in, out]."""
    if isinstance(module, torch.nn.Linear):
        return module.in_features, module.out_features
    w = module.weight
    return int(w.shape[0]), int(w.shape[1])


def layer_stack(model: Any) -> tuple[str, Any]:
    """The transformer layers: the longest ``nn.ModuleList`` of one module class; in a model
    with no ``nn.ModuleList`` (timm's ViT, Swin, ConvNeXt: ``blocks`` / ``stages`` are
    ``nn.Sequential``), the longest ``nn.Sequential`` of one module class.

    Args:
        model: any ``nn.Module``.

    Returns:
        ``(dotted name, ModuleList)``.

    Raises:
        UnsupportedError: the model has no ``nn.ModuleList`` or ``nn.Sequential``.
    """
    best: tuple[int, str, Any] | None = None
    for container in (torch.nn.ModuleList, torch.nn.Sequential):
        for name, module in model.named_modules():
            if not isinstance(module, container) or len(module) == 0:
                continue
            kinds = Counter(type(m) for m in module)
            n = kinds.most_common(1)[0][1]
            if best is None or n > best[0]:
                best = (n, name, module)
        if best is not None:
            break
    if best is None:
        raise UnsupportedError(
            "LoRA tracing needs the transformer layers in an nn.ModuleList; wrap the model with "
            "peft yourself and use trainmem.trace(build_model, ...)"
        )
    return best[1], best[2]


def wrapped_blocks(model: Any, kind: str) -> list[Any]:
    """The blocks that FSDP2 shards or torch.compile compiles one by one, children first.

    A diffusers model names them itself: ``_repeated_blocks`` for ``kind="compile"`` (the
    classes ``ModelMixin.compile_repeated_blocks`` compiles, diffusers
    models/modeling_utils.py: FLUX's double- and single-stream blocks), ``_no_split_modules``
    for ``kind="fsdp"`` (the classes accelerate's FSDP2 transformer-based auto-wrap shards:
    ``accelerate/utils/fsdp_utils.py`` ``fsdp2_prepare_auto_wrap_policy`` wraps the model's
    ``_no_split_modules`` unless told other classes). Any other model, or
    a diffusers class that declares none: :func:`layer_stack`'s layers (torchtitan's
    per-layer wrapping).

    Args:
        model: any ``nn.Module``.
        kind: ``"compile"`` or ``"fsdp"``.

    Returns:
        The modules, a nested one before the block that holds it (``fully_shard`` order).

    Raises:
        UnsupportedError: no declared class and no ``nn.ModuleList``.
    """
    names: tuple[str, ...] = ()
    if type(model).__module__.startswith("diffusers."):
        attribute = "_repeated_blocks" if kind == "compile" else "_no_split_modules"
        names = tuple(getattr(model, attribute, None) or ())
        found = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    elif kind == "fsdp":
        found = _declared_layers(model)
    else:
        found = []
    if not found:
        return list(layer_stack(model)[1])
    depth = {id(m): 0 for m in found}
    for m in found:  # children first: count the declared blocks each one is nested in
        for inner in m.modules():
            if inner is not m and id(inner) in depth:
                depth[id(inner)] += 1
    return sorted(found, key=lambda m: -depth[id(m)])


def _declared_layers(model: Any) -> list[Any]:
    """The layers of every stack of a transformers model: the members of its
    ``nn.ModuleList`` s whose class is one of the model's ``_no_split_modules``, the classes
    accelerate's FSDP auto-wrap takes for transformers models (accelerate/utils/dataclasses.py
    ``FullyShardedDataParallelPlugin.set_auto_wrap_policy``: ``transformer_cls_names_to_wrap``
    defaults to ``model._no_split_modules``; the HF Trainer's FSDP likewise). A
    vision-language model's vision blocks and decoder layers, an encoder-decoder's two stacks
    are each a unit, where :func:`layer_stack` finds one stack only (the rest stayed in the
    root's unit, its gradients unsharded to the end of the backward). Embeddings and pooling
    heads the list also names are left in their parent's unit (torchtitan shards the layers
    only). [] for a model that declares none of its listed layers (Wav2Vec2)."""
    declared = set(getattr(model, "_no_split_modules", None) or ())
    if not declared:
        return []
    return [
        layer
        for stack in model.modules()
        if isinstance(stack, torch.nn.ModuleList)
        for layer in stack
        if type(layer).__name__ in declared
    ]


_QKV_NAMES = (("q_proj", "query", "q"), ("k_proj", "key", "k"), ("v_proj", "value", "v"))


def _qkv_by_name(paths: list[str]) -> tuple[str, str, str] | None:
    """The q, k and v projections among ``paths`` by their last name (``q_proj``, ``query``,
    ``q``...), or None unless each is found exactly once and the output projection is last."""
    found = []
    for names in _QKV_NAMES:
        hits = [p for p in paths if p.rsplit(".", 1)[-1] in names]
        if len(hits) != 1 or hits[0] == paths[-1]:
            return None
        found.append(hits[0])
    return found[0], found[1], found[2]


_OUTPUT_NAMES = frozenset(("o_proj", "out_proj", "c_proj", "dense", "o", "wo"))


def _output_last(paths: list[str]) -> list[str]:
    """The attention linears with the output projection last: a single one named as an output
    (``o_proj``, ``out_proj``, ``dense``...) defined before the others is moved to the end
    (Phi-3 defines ``o_proj`` before its fused ``qkv_proj``: transformers modeling_phi3.py
    ``Phi3Attention.__init__``)."""
    outputs = [p for p in paths if p.rsplit(".", 1)[-1] in _OUTPUT_NAMES]
    if len(outputs) != 1 or outputs[0] == paths[-1]:
        return paths
    return [p for p in paths if p != outputs[0]] + outputs


def _attention_group(parts: list[str]) -> str | None:
    """The attention module a linear at path ``parts`` belongs to: the path up to its first
    component naming an attention (``self_attn``, ``encoder_attn``, BERT's ``attention``,
    T5's ``layer.1.EncDecAttention``), or None for an MLP linear."""
    for i, part in enumerate(parts):
        if "attn" in part.lower() or "attention" in part.lower():
            end = i + 2 if i + 1 < len(parts) - 1 and parts[i + 1].isdigit() else i + 1
            return ".".join(parts[:end])
    return None


_MLA_NAMES = {"q": ("q_a_proj", "q_b_proj"), "kv": ("kv_a_proj_with_mqa", "kv_b_proj")}


def _mla_roles(paths: list[str]) -> dict[str, tuple[str, ...]] | None:
    """Multi-head latent attention's roles (DeepSeek-V2 / V3, transformers
    modeling_deepseek_v3.py ``DeepseekV3Attention``): ``q`` the query's down and up
    projections ``q_a_proj``, ``q_b_proj`` (or one ``q_proj`` without ``q_lora_rank``); ``k``
    and ``v`` both the joint key-value compression and its up projection
    ``kv_a_proj_with_mqa``, ``kv_b_proj`` (each feeds keys and values, as a fused q/k/v module
    serves any of q, k, v); ``o`` ``o_proj``. Other linears get no role (DeepSeek-V3.2's
    sparse-attention ``indexer``, AXK2's ``q_gate_proj``). None when ``paths`` are not MLA's."""
    leaf = {p.rsplit(".", 1)[-1]: p for p in paths}
    q = tuple(leaf[n] for n in ("q_proj", *_MLA_NAMES["q"]) if n in leaf)
    out = [p for p in paths if p.rsplit(".", 1)[-1] in _OUTPUT_NAMES]
    if not all(n in leaf for n in _MLA_NAMES["kv"]) or not q or len(out) != 1:
        return None
    kv = tuple(leaf[n] for n in _MLA_NAMES["kv"])
    return {"q": q, "k": kv, "v": kv, "o": (out[0],)}


def _attention_roles(paths: list[str]) -> dict[str, tuple[str, ...]]:
    """q / k / v / o of one attention module's linears (Note [LoRA target inference]).

    Raises:
        UnsupportedError: none of the patterns fits.
    """
    mla = _mla_roles(paths)
    if mla is not None:
        return mla
    paths = _output_last(paths)
    if len(paths) == 2:
        return {"q": (paths[0],), "k": (paths[0],), "v": (paths[0],), "o": (paths[1],)}
    by_name = _qkv_by_name(paths)
    outputs = [p for p in paths if p.rsplit(".", 1)[-1] in _OUTPUT_NAMES]
    if len(paths) == 4:  # by name where the names say (CLIP defines k_proj, v_proj, q_proj)
        q, k, v = by_name or (paths[0], paths[1], paths[2])
        return {"q": (q,), "k": (k,), "v": (v,), "o": (paths[-1],)}
    if len(paths) > 4 and by_name is not None and len(outputs) == 1:
        # more linears than q/k/v/o, each of those four named (Parakeet's conformer attention
        # adds relative_k_proj, transformers modeling_parakeet.py ParakeetEncoderAttention):
        # the others get no role
        q, k, v = by_name
        return {"q": (q,), "k": (k,), "v": (v,), "o": (outputs[0],)}
    raise UnsupportedError(
        f"cannot tell q/k/v/o apart among the attention linears {paths}; "
        "wrap the model with peft yourself and use trainmem.trace(build_model, ...)"
    )


def _mlp_roles(mlp: list[tuple[str, Any]]) -> dict[str, tuple[str, ...]]:
    """gate / up / down of a layer's MLP linears: the last is ``down``; two before it are
    ``gate``, ``up``, one is ``up`` (or a fused ``gate_up``: out_features twice ``down``'s
    in_features, Phi-3). Linears in several MLP modules (a conformer's two feed-forward modules,
    Parakeet ``feed_forward1`` / ``feed_forward2``) are read per module, by the path's first
    name. Empty when they fit none (an MoE block: a router beside experts fused into one
    module's parameters in transformers 5)."""
    if len(mlp) == 3:
        return {"gate": (mlp[0][0],), "up": (mlp[1][0],), "down": (mlp[2][0],)}
    if len(mlp) == 2:
        roles: dict[str, tuple[str, ...]] = {"up": (mlp[0][0],), "down": (mlp[1][0],)}
        if _features(mlp[0][1])[1] == 2 * _features(mlp[1][1])[0]:
            roles["gate"] = (mlp[0][0],)
        return roles
    groups: dict[str, list[tuple[str, Any]]] = {}
    for path, module in mlp:
        groups.setdefault(path.split(".")[0], []).append((path, module))
    if len(groups) < 2 or any(len(g) not in (2, 3) for g in groups.values()):
        return {}
    out: dict[str, tuple[str, ...]] = {}
    for group in groups.values():
        for role, found in _mlp_roles(group).items():
            out[role] = out.get(role, ()) + found
    return out


def layer_linear_roles(layer: Any) -> dict[str, tuple[str, ...]]:
    """trainmem linear name -> module paths (relative to ``layer``) it targets.

    See Note [LoRA target inference].

    Args:
        layer: one transformer layer (``nn.Module``).

    Returns:
        ``{"q": ("self_attn.q_proj",), ...}``; a fused q/k/v module appears under q, k and v;
        a decoder layer's self- and cross-attention both under each of q, k, v, o.

    Raises:
        UnsupportedError: the attention linears fit none of the patterns. MLP linears that
            fit none (MoE experts) get no role: only a gate / up / down target is refused
            (:func:`lora_target_modules`), attention targets still work.
    """
    attn: dict[str, list[str]] = {}
    mlp: list[tuple[str, Any]] = []
    for path, module in layer.named_modules():
        if not path or not _is_linear(module):
            continue
        group = _attention_group(path.split("."))
        if group is None:
            mlp.append((path, module))
        else:
            attn.setdefault(group, []).append(path)
    if not attn:
        raise UnsupportedError(
            "cannot tell q/k/v/o apart among the attention linears []; "
            "wrap the model with peft yourself and use trainmem.trace(build_model, ...)"
        )
    roles: dict[str, tuple[str, ...]] = {}
    for paths in attn.values():  # self-attention, then a decoder layer's cross-attention
        for role, found in _attention_roles(paths).items():
            roles[role] = roles.get(role, ()) + found
    roles.update(_mlp_roles(mlp))
    return roles


_MLP_ROLES = frozenset(("gate", "up", "down"))


def _adapted_stack(model: Any) -> tuple[str, Any, str]:
    """The layer stack LoRA's roles are read from (its dotted name from ``model``) and the
    scope adapted (the dotted name of the module whose stacks get adapters, "" for the whole
    model): a vision-language model's language model (a ``language_model`` submodule,
    transformers 5's LLaVA / Qwen2-VL layout), as LLaVA's recipe leaves the vision tower and
    projector without adapters (haotian-liu/LLaVA llava/train/train.py
    ``find_all_linear_names``: ``multimodal_keywords``); the longest stack of the whole model
    otherwise, which in a VLM can be the vision tower's (Qwen2-VL-7B: 32 vision blocks, 28
    decoder layers). A stack of stages that each hold a list of blocks (SegFormer) gives its
    first stage's blocks (the others' are adapted at the same paths:
    :func:`_same_paths_in_other_stacks`)."""
    found = [(n, m) for n, m in model.named_modules() if n.split(".")[-1] == "language_model"]
    scope, root = min(found, key=lambda f: f[0].count(".")) if found else ("", model)
    inner, stack = _layers_with_attention(root)
    name = f"{scope}.{inner}" if scope else inner
    if _stage_of_blocks(stack[0]):  # SegFormer's encoder: stages, each a list of blocks
        inner, stack = layer_stack(stack[0])
        name = f"{name}.0.{inner}" if inner else f"{name}.0"
    return name, stack, scope


def _layers_with_attention(root: Any) -> tuple[str, Any]:
    """:func:`layer_stack`'s choice among the ``nn.ModuleList`` s whose first layer holds
    attention linears (or is a stage of blocks): a longer list without any (wav2vec2's 7 feature
    convolutions, Parakeet's subsampling convolutions) holds nothing LoRA's targets name.
    :func:`layer_stack`'s own list when none does (its layer's error then says why)."""
    lists = [
        (Counter(type(m) for m in module).most_common(1)[0][1], name, module)
        for name, module in root.named_modules()
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0
    ]
    for _, name, module in sorted(lists, key=lambda c: -c[0]):  # stable: first of the longest
        if _stage_of_blocks(module[0]) or _role_layer(module) is not None:
            return name, module
    return layer_stack(root)


def _role_layer(layers: Any) -> Any:
    """The first of ``layers`` whose linears :func:`layer_linear_roles` reads: a hybrid
    stack's first attention layer (Jamba, Bamba, Qwen3-Next: layer 0 is a Mamba or
    linear-attention layer, of the same class in Bamba), or None."""
    for layer in layers:
        try:
            layer_linear_roles(layer)
        except UnsupportedError:
            continue
        return layer
    return None


def _stage_of_blocks(layer: Any) -> bool:
    """Whether ``layer`` is a stage holding a list of blocks (SegFormer's ``SegformerStage``:
    a list of blocks of one class, each with its attention), rather than one layer (whose own
    lists are not layers: an MoE block's experts hold no attention, T5's ``T5Block.layer``
    holds sublayers of different classes)."""
    return any(
        isinstance(m, torch.nn.ModuleList)
        and len(m) > 0
        and len({type(b) for b in m}) == 1
        and _role_layer(m) is not None
        for m in layer.modules()
    )


def _other_stacks(model: Any, scope: str, stack: Any) -> list[tuple[str, Any]]:
    """The layer lists within ``scope`` besides ``stack`` whose layers are of another class
    and hold attention linears: an encoder-decoder's decoder beside its encoder when the two
    are different models (speech- and vision-encoder-decoders: a wav2vec2 or ViT encoder's
    ``q_proj``, a BERT decoder's ``query``). Lists inside ``stack``'s layers are not layers."""
    prefix = f"{scope}." if scope else ""
    inside: set[int] = set()  # modules within a layer already taken (T5 T5Block.layer)
    out: list[tuple[str, Any]] = []
    for name, module in model.named_modules():  # a list before the lists its layers hold
        if (
            not name.startswith(prefix)
            or id(module) in inside
            or not isinstance(module, torch.nn.ModuleList)
            or len(module) == 0
            or _stage_of_blocks(module[0])  # its blocks' lists are visited next
        ):
            continue
        if type(module[0]) is type(stack[0]) or _role_layer(module) is not None:
            inside.update(id(m) for layer in module for m in layer.modules() if m is not layer)
            if module is not stack and type(module[0]) is not type(stack[0]):
                out.append((name, module))
    return out


def _peft_matches(model: Any, scope: str, stacks: list[tuple[Any, list[str]]]) -> list[str]:
    """The linears peft's name matching adapts beyond the role stacks, within ``scope``.

    peft adapts every module whose name ends with ``"." + target`` (peft 0.21.2
    tuners/tuners_utils.py ``check_target_module_exists``), so the family's own names for the
    targets (Whisper's ``q_proj``) reach an encoder-decoder's other stack of the same class
    (T5's decoder blocks' ``layer.0.SelfAttention.q``) and its cross-attention (T5
    ``layer.1.EncDecAttention.q``). Each ``(layer, rel)`` of ``stacks`` is a role layer and the
    relative paths targeted in it; the last name of a path is matched across ``scope`` when
    every linear of that layer with that last name is targeted (a decoder layer's
    ``self_attn.q_proj`` and ``encoder_attn.q_proj``). A last name that also names an untargeted
    linear (BERT's ``dense`` in ``attention.output``, ``intermediate`` and ``output``) stands
    for no one role: those linears are matched at the same relative paths in the layers of
    every other ``nn.ModuleList`` only."""
    leaves: set[str] = set()
    for layer, rel in stacks:
        linears = [n for n, m in layer.named_modules() if n and _is_linear(m)]
        for leaf in {p.split(".")[-1] for p in rel}:
            if all(n in rel for n in linears if n.split(".")[-1] == leaf):
                leaves.add(leaf)
    for layer, rel in stacks:  # a leaf some role layer leaves partly untargeted is not one role
        linears = [n for n, m in layer.named_modules() if n and _is_linear(m)]
        leaves -= {n.split(".")[-1] for n in linears if n not in rel}
    out: dict[str, None] = {}
    prefix = f"{scope}." if scope else ""
    for name, module in model.named_modules():
        if not name.startswith(prefix):
            continue
        if _is_linear(module) and name.split(".")[-1] in leaves:
            out[name] = None
        if isinstance(module, torch.nn.ModuleList):
            for i, layer in enumerate(module):
                for _, rel in stacks:
                    for p in rel:
                        found = _submodule(layer, p)
                        if found is not None and _is_linear(found):
                            out[f"{name}.{i}.{p}"] = None
    return list(out)


def _linears_at(name: str, layers: Any, rel: list[str]) -> list[str]:
    """``name.i.p`` for each layer ``i`` of ``layers`` and path ``p`` of ``rel`` that is a
    linear there (a hybrid stack's Mamba layers have no ``self_attn.q_proj``)."""
    return [
        f"{name}.{i}.{p}"
        for i, layer in enumerate(layers)
        for p in rel
        if (found := _submodule(layer, p)) is not None and _is_linear(found)
    ]


def _submodule(module: Any, path: str) -> Any:
    """``module.get_submodule(path)``, or None where ``module`` has no such path."""
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


_EXPERT_NAMES = {
    "mixtral": {"gate": "w1", "up": "w3", "down": "w2"},
    "qwen2_moe": {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"},
}
"""The transformers 4 names of an MoE expert's linears by the pattern peft converts them with
(peft 0.21.2 utils/transformers_weight_conversion.py ``_MOE_TARGET_MODULE_MAPPING``)."""


def _expert_target(model: Any, role: str) -> str | None:
    """The target name that makes peft adapt a transformers 5 MoE's fused experts for
    ``role`` (gate / up / down), or None where peft does not.

    transformers 5 holds the experts as two 3-D parameters, ``gate_up_proj`` and ``down_proj``
    (modeling_mixtral.py ``MixtralExperts``; Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 alike), no
    linear per expert. peft 0.21.2 (utils/transformers_weight_conversion.py
    ``_convert_peft_config_moe``) turns the transformers 4 expert names (Mixtral ``w1`` /
    ``w3`` / ``w2``; the Qwen2-MoE pattern's ``gate_proj`` / ``up_proj`` / ``down_proj``) into
    ``target_parameters``: a LoRA on each 3-D parameter (``ParamWrapper``), rank 2r on the
    fused ``gate_up_proj`` (both of gate and up needed), r on ``down_proj``."""
    try:
        from peft.utils import transformers_weight_conversion as conversion
    except ImportError:  # pragma: no cover - an older peft: no conversion
        return None
    patterns: dict[str, str] = getattr(conversion, "_MODEL_TO_CONVERSION_PATTERN", {})
    base = patterns.get(str(getattr(model.config, "model_type", "")))
    return _EXPERT_NAMES.get(base or "", {}).get(role)


def lora_target_modules(model: Any, targets: tuple[str, ...]) -> list[str]:
    """Full module names of ``model`` that get adapters for trainmem's ``targets``.

    Args:
        model: the HF model (before peft).
        targets: trainmem linear names (``TrainingConfig.lora_targets``).

    Returns:
        Dotted module names, in model order, each once; then, for ``gate`` / ``up`` /
        ``down`` on a transformers 5 MoE whose experts peft adapts (:func:`_expert_target`),
        the transformers 4 expert names peft turns into the fused experts' parameters.

    Raises:
        UnsupportedError: a target the model has no linear for (``gate`` on GPT-2), or no
            layer stack.
    """
    try:
        stack_name, stack, scope = _adapted_stack(model)
        role_layer = _role_layer(stack)
        roles = layer_linear_roles(stack[0] if role_layer is None else role_layer)
    except UnsupportedError as exc:  # no attention to tell q/k/v/o in (Mamba, a CNN)
        if set(LORA_TARGETS) <= set(targets):  # what --lora-targets all-linear gives then
            return peft_all_linear(model)
        raise UnsupportedError(
            f"lora targets {','.join(targets)}: {type(model).__name__} has no attention "
            "q/k/v/o linears to name; --lora-targets all-linear adapts every linear but the "
            "output layer, as peft's target_modules='all-linear' does"
        ) from exc
    rel: list[str] = []
    experts: list[str] = []
    for t in targets:
        if t == "lm_head":
            continue
        moe = t in _MLP_ROLES and not _MLP_ROLES & roles.keys()
        if t not in roles and moe and (name := _expert_target(model, t)) is not None:
            experts.append(name)
            continue
        if t not in roles:
            why = " (its MLP is not a gate/up/down of linears: MoE experts are not targeted)"
            raise UnsupportedError(
                f"lora target {t!r}: {type(model).__name__} has no such linear (it has "
                f"{', '.join(sorted(roles))}){why if moe else ''}; drop it from --lora-targets"
            )
        rel.extend(p for p in roles[t] if p not in rel)
    names = _linears_at(stack_name, stack, rel)
    stacks = [(role_layer, rel)]
    for other_name, other in _other_stacks(model, scope, stack):
        other_layer = _role_layer(other)
        other_roles = layer_linear_roles(other_layer)
        other_rel = list(dict.fromkeys(p for t in targets for p in other_roles.get(t, ())))
        names += [n for n in _linears_at(other_name, other, other_rel) if n not in names]
        stacks.append((other_layer, other_rel))
    names += [n for n in _peft_matches(model, scope, stacks) if n not in names]
    names += experts
    if "lm_head" in targets:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        found = [n for n, m in model.named_modules() if head is not None and m is head]
        if not found:
            raise UnsupportedError(f"lora target 'lm_head': {type(model).__name__} has no head")
        names.append(found[0])
    return names


def modules_to_save(model: Any, names: tuple[str, ...]) -> list[str] | None:
    """peft's ``modules_to_save`` for trainmem's ``lora_modules_to_save`` names: the dotted
    name of ``model.get_input_embeddings()`` for ``embed_tokens`` and of
    ``get_output_embeddings()`` for ``lm_head`` (the module objects, tied weights or not;
    peft 0.21.2 utils/other.py ``_set_trainable`` wraps every module whose name ends with
    one). None for none.

    Raises:
        UnsupportedError: the model has no such module.
    """
    if not names:
        return None
    getters = {"embed_tokens": "get_input_embeddings", "lm_head": "get_output_embeddings"}
    out = []
    for name in names:
        getter = getattr(model, getters[name], None)
        module = getter() if callable(getter) else None
        found = [n for n, m in model.named_modules() if module is not None and m is module]
        if not found:
            raise UnsupportedError(
                f"lora_modules_to_save {name!r}: {type(model).__name__} has no "
                f"{'input embedding' if name == 'embed_tokens' else 'output head'} module"
            )
        out.append(found[0])
    return out


def peft_all_linear(model: Any) -> list[str]:
    """peft's ``target_modules="all-linear"`` (peft 0.21.2 tuners/tuners_utils.py
    ``_maybe_include_all_linear_layers``): every linear module but the output embeddings
    (``get_output_embeddings()``), for a model whose layers have no q / k / v / o to name
    (Mamba's ``in_proj`` / ``x_proj`` / ``dt_proj`` / ``out_proj``, ConvNeXt's point-wise
    linears).

    Raises:
        UnsupportedError: the model has no linear module.
    """
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    names = [n for n, m in model.named_modules() if n and _is_linear(m) and m is not head]
    if not names:
        raise UnsupportedError(f"lora: {type(model).__name__} has no linear module to adapt")
    return names


def lora_linear_names(model: Any) -> tuple[str, ...]:
    """``--lora-targets all-linear`` for a model the formulas do not cover: the
    :data:`~trainmem.specs.training.LORA_TARGETS` names its layers have (Note [LoRA target
    inference]; every layer list's, a speech encoder-decoder's BERT decoder's too), as
    :func:`~trainmem.specs.training.model_lora_linears` gives them from a ModelSpec.

    Raises:
        UnsupportedError: no layer list, or attention linears that fit no pattern.
    """
    _, stack, scope = _adapted_stack(model)
    layer = _role_layer(stack)
    found = set(layer_linear_roles(stack[0] if layer is None else layer))
    for _, other in _other_stacks(model, scope, stack):
        found |= set(layer_linear_roles(_role_layer(other)))
    return tuple(t for t in LORA_TARGETS if t in found)


ADALORA_TOTAL_STEPS = 1000
"""``AdaLoraConfig.total_step`` (required since peft 0.14; it schedules the rank budget, not
memory: the adapters keep their ``init_r`` shapes, pruned ranks are masked in ``lora_E``)."""


def adapter_config(training: TrainingConfig, target_modules: list[str], **lora: Any) -> Any:
    """The peft config of ``training.lora_variant`` for ``target_modules``.

    ``lora`` / ``dora``: ``LoraConfig(r, lora_dropout, use_dora)``; ``adalora``:
    ``AdaLoraConfig(init_r=r, target_r=min(8, r), total_step=ADALORA_TOTAL_STEPS)`` (peft
    tuners/adalora/config.py; ``target_r`` 8 is peft's default); ``lokr`` / ``loha``:
    ``LoKrConfig(r, alpha=r)`` / ``LoHaConfig(r, alpha=r)`` (peft tuners/lokr/config.py,
    tuners/loha/config.py; no input dropout). ``lora`` holds the other ``LoraConfig``
    arguments (``lora_alpha``, ``fan_in_fan_out``, ``init_lora_weights``); for LoKr and LoHa
    only ``lora_alpha`` and ``modules_to_save`` are read.

    Raises:
        UnsupportedError: peft is missing.
    """
    try:
        import peft
    except ImportError as exc:  # pragma: no cover - peft is in the trace extra
        raise UnsupportedError("LoRA tracing needs peft: pip install 'trainmem[trace]'") from exc
    r, variant = training.lora_rank, training.lora_variant
    if variant in ("lokr", "loha"):
        lycoris = peft.LoKrConfig if variant == "lokr" else peft.LoHaConfig
        return lycoris(
            r=r,
            alpha=lora.get("lora_alpha", r),
            target_modules=target_modules,
            modules_to_save=lora.get("modules_to_save"),
        )
    common = dict(lora_dropout=training.lora_dropout, target_modules=target_modules, **lora)
    if variant == "adalora":
        return peft.AdaLoraConfig(
            init_r=r, target_r=min(8, r), total_step=ADALORA_TOTAL_STEPS, **common
        )
    return peft.LoraConfig(r=r, use_dora=variant == "dora", **common)


def lokr_module_dropout_off(model: Any) -> None:
    """Let peft's LoKr and LoHa layers apply their adapter without drawing a random number.

    ``LoKrLayer.forward`` and ``LoHaLayer.forward`` (peft tuners/lokr/layer.py,
    tuners/loha/layer.py) add the adapter when ``not self.training or torch.rand(1) >
    module_dropout``: a value read that fake tensors cannot answer. With ``module_dropout`` 0
    (:func:`adapter_config`) the draw is always above it, so each such layer runs its forward
    with ``training`` False (a forward pre-hook, restored by a forward hook): the same ops, as
    ``rank_dropout`` 0 is the only other use of the flag (``get_delta_weight``). No-op on a
    model without LoKr or LoHa layers.
    """

    def off(module: Any, args: Any) -> None:
        module.training = False

    def on(module: Any, args: Any, output: Any) -> None:
        module.training = True

    for module in model.modules():
        if type(module).__module__.startswith(("peft.tuners.lokr", "peft.tuners.loha")):
            module.register_forward_pre_hook(off)
            module.register_forward_hook(on)


def apply_lora(model: Any, training: TrainingConfig) -> Any:
    """Wrap ``model`` in a peft LoRA model as ``TrainingConfig`` asks (no-op without LoRA).

    Args:
        model: the HF model, built on ``meta`` (or on CPU for the real-run proof).
        training: ``lora_rank``, ``lora_targets``, ``lora_dropout``.

    Returns:
        The ``PeftModel`` (or ``model`` itself when ``lora_rank == 0``).

    Raises:
        UnsupportedError: peft is missing or a target does not exist.
        SpecError: ``lora_variant`` lokr on transformers ``Conv1D`` linears (GPT-2), which
            peft's LoKr refuses; AdaLoRA on biased linears under selective checkpointing;
            ``lora_targets`` up without gate (or gate without up) on a transformers 5 MoE,
            which peft refuses (its experts' fused ``gate_up_proj``); a variant other than
            ``lora`` on those experts.
    """
    if not training.is_lora:
        return model
    import peft

    names = lora_target_modules(model, training.lora_targets)
    conv1d = any(type(m).__name__ == "Conv1D" for n, m in model.named_modules() if n in names)
    if conv1d and training.lora_variant in LYCORIS_VARIANTS:
        name = LYCORIS_VARIANTS[training.lora_variant]
        raise SpecError(
            "lora_variant",
            f"{training.lora_variant}: peft's {name} adapts torch's Linear, Conv1d and Conv2d "
            "only, and "
            f"{type(model).__name__}'s targeted linears are transformers Conv1D (peft "
            "tuners/lycoris_utils.py _create_new_module: 'Target module of type Conv1D not "
            "supported'); allowed: lora, dora, adalora",
        )
    modules = {n for n, _ in model.named_modules()}
    experts = [n for n in names if n not in modules]  # _expert_target's
    if experts and training.lora_variant != "lora":
        raise SpecError(
            "lora_variant",
            f"{training.lora_variant} on {type(model).__name__}'s experts "
            f"({', '.join(experts)}): peft adapts a transformers 5 MoE's fused experts with "
            "LoRA only (peft 0.21.2: its MoE target conversion runs for LoRA, and "
            "lora.ParamWrapper refuses use_dora); allowed: lora, or --lora-targets without "
            "gate / up / down",
        )
    _check_adalora_selective(model, names, training)
    _check_adapters_reached(model, names, training)
    config = adapter_config(
        training,
        names,
        lora_alpha=2 * training.lora_rank,  # alpha only scales values, never memory
        fan_in_fan_out=conv1d,
        # Note [peft modules_to_save] (trainmem.analytic.tensor_states)
        modules_to_save=modules_to_save(model, training.lora_modules_to_save),
    )
    with warnings.catch_warnings():
        # peft warns when it flips fan_in_fan_out for a Conv1D / Linear mix (GPT-2 + lm_head),
        # and reads transformers' deprecated ``is_gradient_checkpointing``; on a transformers 5
        # MoE it turns gate / up / down targets into the fused experts' parameters with a
        # rank_pattern for ``gate_up_proj`` that it then finds on no module (peft 0.21.2
        # utils/transformers_weight_conversion.py ``_convert_peft_config_moe``, a
        # RuntimeWarning from tuners/tuners_utils.py)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            model = peft.get_peft_model(model, config)
        except ValueError as exc:
            if str(exc).startswith("[PEFT:"):  # peft's own refusal (Mamba's out_proj, conv1d)
                raise UnsupportedError(f"peft refuses these adapters: {exc}") from exc
            if "fused into" not in str(exc):
                raise
            # peft renames a transformers 5 MoE's gate / up targets to the experts' fused
            # gate_up_proj and refuses one without the other (peft 0.21.2
            # utils/transformers_weight_conversion.py _convert_peft_config_moe)
            raise SpecError(
                "lora_targets",
                f"{','.join(training.lora_targets)} on {type(model).__name__}: peft refuses "
                f"it ({exc}); allowed: gate and up together, or neither",
            ) from exc
    lokr_module_dropout_off(model)
    cast_adapters(model, training)
    return model


def _check_adapters_reached(model: Any, names: list[str], training: TrainingConfig) -> None:
    """Refuse LoRA targets none of whose adapters the forward reaches
    (:func:`~trainmem.trace.quantized.weight_read_directly`: q / k / v on timm's EVA, BEiT and
    Swin V2 attention with their q / v biases): no parameter is trainable in the graph, and
    ``loss.backward()`` fails on the GPU as in the trace ("element 0 of tensors does not require
    grad").

    Raises:
        SpecError: ``lora_targets``, naming the targets whose adapters run.
    """
    bypassed = [n for n in names if weight_read_directly(model, n)]
    if not bypassed or len(bypassed) < len(names):
        return
    owner = type(model.get_submodule(bypassed[0].rpartition(".")[0])).__name__
    raise SpecError(
        "lora_targets",
        f"{','.join(training.lora_targets)} adapt only {owner}'s fused qkv linear, which its "
        "forward never calls: with its q / v biases it runs F.linear(x, self.qkv.weight, bias) "
        "(timm eva.py / beit.py / swin_transformer_v2.py), so peft's adapter there is bypassed, "
        "no adapter gets a gradient and loss.backward() fails, on a GPU as here; allowed: "
        "targets whose adapters run, o (attn.proj), up / down (the MLP), e.g. --lora-targets "
        "o,up,down",
    )


def _check_adalora_selective(model: Any, names: list[str], training: TrainingConfig) -> None:
    """Refuse AdaLoRA on linears with a bias under selective checkpointing: torchtitan's op
    policy (:mod:`trainmem.trace.sac`) saves a biased linear's ``addmm`` output, the base
    output is a view of it, and peft's AdaLoRA adds its update into that in place (peft
    tuners/adalora/layer.py ``SVDLinear.forward``: ``result += ...``), which torch refuses
    (torch/utils/checkpoint.py: "Tensor cached during selective activation checkpoint has
    been mutated"); LoRA and DoRA add out of place.

    Raises:
        SpecError: ``activation_checkpointing``, naming what runs.
    """
    if training.lora_variant != "adalora" or training.activation_checkpointing != "selective":
        return
    wanted = set(names)
    biased = [
        n for n, m in model.named_modules() if n in wanted and getattr(m, "bias", None) is not None
    ]
    if biased:
        raise SpecError(
            "activation_checkpointing",
            f"selective with lora_variant adalora on linears with a bias ({biased[0]}): the "
            "selective policy saves their addmm output and AdaLoRA adds its update into it "
            "in place, which torch refuses ('Tensor cached during selective activation "
            "checkpoint has been mutated'); allowed: activation_checkpointing none or full, "
            "lora_variant lora or dora, or --lora-targets without a bias",
        )


def cast_adapters(model: Any, training: TrainingConfig) -> None:
    """Cast the LoRA adapters to the model's weight dtype, in place, under a framework that
    keeps them there (``FrameworkConventions.adapter_dtype_follows_weights``: DeepSpeed casts
    every parameter of the module it wraps, runtime/engine.py ``_configure_distributed_model``).
    peft leaves them fp32 on a ``meta`` model (``_move_adapter_to_device_of_base_layer`` skips
    meta adapters), which is what it makes of a 16-bit base elsewhere
    (``autocast_adapter_dtype=True``). TRL's SFTTrainer from 0.26 casts every trainable
    parameter of a bitsandbytes base to bf16 (``TrainingConfig.trl_bf16_adapters``; trl
    v0.26.0 trl/trainer/sft_trainer.py:715-718). An explicit ``lora_adapter_dtype`` casts every
    trainable parameter to it, as diffusers' ``cast_training_params(model, dtype)`` does
    (diffusers 0.42.1 training_utils.py: ``param.data = param.to(dtype)`` where
    ``param.requires_grad``)."""
    if training.lora_adapter_dtype is not None:
        dtype = getattr(torch, training.lora_adapter_dtype)
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(dtype)
        return
    if training.trl_bf16_adapters:
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
        return
    if not training.conventions.adapter_dtype_follows_weights:
        return
    dtype = getattr(torch, training.weight_dtype)
    for name, param in model.named_parameters():
        # peft's prompt encoder too (Note [Prompt encoder tensors] in analytic/prompt_encoder.py)
        if ("lora_" in name or "prompt_encoder." in name) and param.is_floating_point():
            param.data = param.data.to(dtype)
