"""diffusers' layerwise casting of the trained model's frozen layers (issue 26, helper diffpipe).

Note [diffusers' layerwise casting]
    ``ModelMixin.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn,
    compute_dtype=torch.bfloat16)`` (diffusers 0.42.1 models/modeling_utils.py, hooks/
    layerwise_casting.py) stores each supported leaf layer's weights in the storage dtype and
    casts them for its forward: ``LayerwiseCastingHook.pre_forward`` runs
    ``module.to(dtype=compute_dtype)``, ``post_forward`` ``module.to(dtype=storage_dtype)``.
    ``Module.to`` makes each floating parameter's copy and swaps it in (``param.data =
    param_applied``, torch nn/modules/module.py ``_apply``), so the old storage is freed once
    nothing else holds it. What that does to memory:

    * the layer's weight and bias are 1 byte an element between forwards;
    * in its forward: the compute-dtype copy is made while the stored one lives, then the stored
      one is freed; after the forward a new stored copy is made while the compute copy lives;
    * the compute copy outlives the forward when autograd saved it: ``F.linear`` saves the
      weight (a ``t()`` view of the compute copy's storage, not the parameter, whose data is
      swapped back) for the input's gradient when the input requires grad. So without
      checkpointing every cast layer keeps its compute copy until its backward (more memory
      than no casting: 1 + 2 bytes an element in bf16); under checkpointing the forward saves
      nothing and a block's recomputation in the backward holds its layers' copies until their
      gradients are taken.

    Which layers: ``Conv1d/2d/3d``, ``ConvTranspose1d/2d/3d``, ``Linear`` and ``Embedding``
    (hooks/_common.py ``_GO_LC_SUPPORTED_PYTORCH_LAYERS``) whose module path matches none of
    the skip patterns (``re.search``): ``DEFAULT_SKIP_MODULES_PATTERN`` (``pos_embed``,
    ``patch_embed``, ``norm``, ``^proj_in$``, ``^proj_out$``), the class's
    ``_skip_layerwise_casting_patterns`` and ``_keep_in_fp32_modules``, and peft's adapter
    layer names (``lora_A``, ``lora_B``, ... of ``LoraLayer`` / ``LoHaLayer`` / ``LoKrLayer``:
    ``enable_layerwise_casting`` without user patterns skips them), all read from the installed
    diffusers and peft. Applied after peft's LoRA, as a user calls it on a model with adapters,
    it also disables peft's cast of a LoRA layer's input to the adapters' dtype
    (``_disable_peft_input_autocast``: ``PeftInputAutocastDisableHook``).

    The trace's stand-in (:func:`apply_layerwise_casting`) does the same with forward pre- and
    post-hooks that swap the parameters' data as ``Module.to`` does (diffusers' own hook cannot
    run on fake parameters: ``_apply`` then swaps tensors, "Couldn't swap Linear.weight"), and
    labels each new stored copy a parameter for the recorder. The real CPU execution of
    tests/trace/test_layerwise_casting.py runs diffusers' own ``enable_layerwise_casting``.

    finetrainers (d220aac, Jan 2025, and its current ``sft_trainer``) applies the casting
    before ``add_adapter``, with its own skip patterns (``--layerwise_upcasting_skip_modules_
    pattern``: diffusers' defaults plus ``x_embedder``, ``context_embedder`` and ``time_embed``),
    patches peft's ``_move_adapter_to_device_of_base_layer`` so that the adapters stay out of
    float8, and adds no input-cast hook. So it keeps those few embedders in the load dtype
    (LTX-Video's ``time_embed``: :func:`skip_patterns` casts it), a difference of their bytes.
"""

from __future__ import annotations

import re
from typing import Any

from trainmem.breakdown import MemoryCategory
from trainmem.specs.training import TrainingConfig
from trainmem.trace._torch import require_torch
from trainmem.trace.module_paths import clean_module_path

torch = require_torch()

__all__ = ["apply_layerwise_casting", "skip_patterns"]


def skip_patterns(model: Any) -> tuple[str, ...]:
    """The module-path patterns ``enable_layerwise_casting`` leaves in the load dtype (Note
    [diffusers' layerwise casting]), read from the installed diffusers and peft."""
    from diffusers.hooks.layerwise_casting import DEFAULT_SKIP_MODULES_PATTERN
    from peft.tuners.loha.layer import LoHaLayer
    from peft.tuners.lokr.layer import LoKrLayer
    from peft.tuners.lora.layer import LoraLayer

    patterns = tuple(DEFAULT_SKIP_MODULES_PATTERN)
    patterns += tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
    patterns += tuple(getattr(model, "_skip_layerwise_casting_patterns", None) or ())
    for layer in (LoHaLayer, LoKrLayer, LoraLayer):
        patterns += tuple(layer.adapter_layer_names)
    return tuple(dict.fromkeys(patterns))


def _cast(module: Any, dtype: Any) -> None:
    """``module.to(dtype)`` for a leaf layer: each floating parameter's copy swapped in."""
    with torch.no_grad():
        for param in module._parameters.values():
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                param.data = param.to(dtype)


def _recorder() -> Any:
    """The active :class:`~trainmem.trace.recorder.StorageRecorder`, or None."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from trainmem.trace.recorder import StorageRecorder

    stack = _get_current_dispatch_mode_stack()
    return next((m for m in stack if isinstance(m, StorageRecorder)), None)


def _hook(module: Any, path: str, storage: Any, compute: Any) -> None:
    def pre_forward(mod: Any, args: Any) -> None:
        _cast(mod, compute)

    def post_forward(mod: Any, args: Any, output: Any) -> None:
        _cast(mod, storage)
        recorder = _recorder()
        if recorder is not None:  # the new stored copies are the weights, not activations
            for param in mod._parameters.values():
                if param is not None:
                    recorder.register(param, MemoryCategory.PARAMETER, module=path)

    _cast(module, storage)
    module.register_forward_pre_hook(pre_forward)
    module.register_forward_hook(post_forward)


def apply_layerwise_casting(model: Any, training: TrainingConfig, *, real: bool) -> int:
    """Cast ``model``'s frozen layers as ``enable_layerwise_casting`` does (Note [diffusers'
    layerwise casting]); no-op for ``layerwise_casting="none"``.

    Args:
        model: the diffusers model, LoRA adapters added.
        training: ``layerwise_casting`` (the storage dtype), ``weight_dtype`` (the compute one).
        real: a model with real weights (the CPU proof): diffusers' own hooks run; else the
            stand-in's.

    Returns:
        The number of layers cast.
    """
    if training.layerwise_casting == "none":
        return 0
    from diffusers.hooks._common import _GO_LC_SUPPORTED_PYTORCH_LAYERS

    storage = getattr(torch, training.layerwise_casting)
    compute = getattr(torch, training.weight_dtype)
    patterns = skip_patterns(model)
    cast: list[tuple[str, Any]] = []

    def walk(module: Any, prefix: str) -> None:
        if any(re.search(p, prefix) for p in patterns):
            return
        if isinstance(module, _GO_LC_SUPPORTED_PYTORCH_LAYERS):
            cast.append((prefix, module))
            return
        for name, child in module.named_children():
            walk(child, f"{prefix}.{name}" if prefix else name)

    walk(model, "")
    if real:
        model.enable_layerwise_casting(storage_dtype=storage, compute_dtype=compute)
        return len(cast)
    for path, module in cast:
        _hook(module, clean_module_path(path), storage, compute)
    _disable_peft_input_cast(model, {id(m) for _, m in cast})
    return len(cast)


def _disable_peft_input_cast(model: Any, cast: set[int]) -> None:
    """diffusers' ``_disable_peft_input_autocast``: a LoRA layer over a cast base layer does not
    cast its input to the adapters' dtype (``cast_input_dtype_enabled``, peft's
    ``disable_input_dtype_casting``)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer) and id(module.get_base_layer()) in cast:
            module.cast_input_dtype_enabled = False  # type: ignore[attr-defined]
