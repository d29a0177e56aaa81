"""An fp16 rest of a bitsandbytes base under bf16 autocast, on real CPU tensors (issue 26, helper
quant29): what a forward saves, against the generic path's stand-in (Note [A quantized base's
other weights in another 16-bit dtype] in trainmem/specs/training.py, Note [Traced quantized
base] in trainmem/trace/quantized.py).

The real side: transformers' Llama (tests' 2-layer 128-wide config) built in float16 (what
transformers 4 loads a bitsandbytes model in when no dtype is given), every linear but
``lm_head`` a real bitsandbytes ``Linear4bit`` (nf4, compute dtype bf16, quantized from the
fp16 weight by ``Params4bit``), peft's LoRA r16 on q_proj / v_proj (peft dispatches its
``lora.bnb.Linear4bit``), no k-bit preparation; one forward with loss of 2 x 32 tokens under
``torch.autocast("cpu", bfloat16)`` with CUDA's cast lists (trainmem.trace.cuda_autocast), the
attention as transformers' flash path runs it (q / k / v cast to bf16 only when q is fp32, then a
kernel on no autocast list: here the CPU's SDPA kernel with autocast off, the same on both
sides). The stand-in side: the generic path's model
(``build_hf_training_model``, the same config and settings) on the same real CPU tensors under
the same two emulations. Prints each side's saved bytes per dtype (distinct storages seen by
``saved_tensors_hooks``) and the dtype of the tensor entering each decoder layer.

``--gpu-peft``: peft's ``torch.is_autocast_enabled()`` (no device: CUDA's state, False on a CPU
run) made to answer the CPU autocast's state, as it would on a GPU: peft >= 0.9.0's
``result = result + output`` then adds LoRA's bf16 output to the fp16 base output, an fp32
q / v (peft 0.8.2 and before: ``result += output``, in place, fp16).

Needs bitsandbytes with CPU kernels (0.50.2) beside the project's torch / transformers / peft:
``pip install --no-deps bitsandbytes==0.50.2`` into a throwaway venv and put its site-packages
on PYTHONPATH after src.

    python benchmarks/kbit_fp16_rest_cpu.py [--gpu-peft]

Result (2026-11-29, torch 2.13.0+cpu, transformers 5.24.0, peft 0.21.2, bitsandbytes 0.50.2):
both sides save bf16 225,280 B, fp16 300,032, fp32 265,220, int64 512, every layer and the head
fed fp16 (tests/trace/test_traced_quantized.py holds the stand-in to these). ``--gpu-peft``: the
real side's layers 1.. and head are fed fp32 and it saves bf16 323,584, fp16 5,120, fp32
658,436, int64 512 (987,652 B against 790,532: +25 %), which neither engine models.
"""

from __future__ import annotations

import sys
from typing import Any

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
    "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 512, "tie_word_embeddings": False,
    "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
}  # fmt: skip
B, S = 2, 32


def _real(torch: Any) -> Any:
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{k: v for k, v in CONFIG.items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(torch.float16)
    for name, module in list(model.named_modules()):
        if not isinstance(module, torch.nn.Linear) or name == "lm_head":
            continue
        q = bnb.nn.Linear4bit(
            module.in_features, module.out_features, bias=False,
            compute_dtype=torch.bfloat16, quant_type="nf4",
        )  # fmt: skip
        q.weight = bnb.nn.Params4bit(module.weight.data, requires_grad=False, quant_type="nf4")
        q = q.to("cpu")  # quantizes
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent), leaf, q)
    model.requires_grad_(False)
    model.is_loaded_in_4bit = True  # as from_pretrained sets it: peft's bnb dispatch reads it
    lora = LoraConfig(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"])
    return get_peft_model(model, lora)


def stand_in_model(torch: Any) -> Any:
    """The generic path's model of the same run (quantized stand-ins, fp16 rest), on the CPU."""
    from trainmem.specs.training import TrainingConfig
    from trainmem.trace.hf_model import build_hf_training_model

    training = TrainingConfig(
        framework="hf-trainer", micro_batch_size=B, seq_len=S, lora_rank=16,
        lora_targets=("q", "v"), lora_dropout=0.0, quantize_base="nf4",
        precision="bf16-mixed", prepare_kbit_training=False, load_dtype="float16",
        attention="flash",
    )  # fmt: skip
    assert training.kbit_dense_cast
    return build_hf_training_model(CONFIG, training, device="cpu")


def saved_by_dtype(torch: Any, model: Any) -> tuple[dict[str, int], list[str]]:
    """One forward with loss and its backward on real CPU tensors: the bytes of the distinct
    storages autograd saves, per dtype, and the dtype entering each decoder layer and the head."""
    from trainmem.trace.cuda_autocast import cuda_autocast_policy

    seen: dict[int, tuple[Any, int]] = {}
    streams: list[str] = []

    def pack(t: Any) -> Any:
        storage = t.untyped_storage()
        seen.setdefault(storage.data_ptr(), (t.dtype, storage.nbytes()))
        return t

    base = model.get_base_model()
    hooks = [
        layer.register_forward_pre_hook(lambda _m, args: streams.append(str(args[0].dtype)))
        for layer in base.model.layers
    ]
    hooks.append(
        base.lm_head.register_forward_pre_hook(lambda _m, args: streams.append(str(args[0].dtype)))
    )
    ids = torch.randint(3, 512, (B, S), generator=torch.Generator().manual_seed(1))
    model.train()
    functional = torch.nn.functional
    sdpa = functional.scaled_dot_product_attention

    def flash_like(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:
        # transformers' flash path: q / k / v cast to autocast's dtype only when q is fp32,
        # then a kernel on no autocast list (here the CPU's SDPA kernel, autocast off)
        if q.dtype == torch.float32:
            q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
        with torch.autocast("cpu", enabled=False):
            return sdpa(q, k, v, *args, **kwargs)

    functional.scaled_dot_product_attention = flash_like
    try:
        with cuda_autocast_policy(), torch.autocast("cpu", torch.bfloat16):
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(input_ids=ids, labels=ids)
    finally:
        functional.scaled_dot_product_attention = sdpa
    out.loss.backward()
    for h in hooks:
        h.remove()
    by_dtype: dict[str, int] = {}
    for dtype, nbytes in seen.values():
        by_dtype[str(dtype)] = by_dtype.get(str(dtype), 0) + nbytes
    return dict(sorted(by_dtype.items())), streams


def main() -> None:
    from trainmem.trace._torch import require_torch  # Note [torchvision without its C ops]

    torch = require_torch()

    if "--gpu-peft" in sys.argv:
        plain = torch.is_autocast_enabled

        def on_gpu(device_type: Any = None) -> bool:
            return bool(plain("cpu" if device_type is None else device_type))

        torch.is_autocast_enabled = on_gpu
    real = saved_by_dtype(torch, _real(torch))
    stand_in = saved_by_dtype(torch, stand_in_model(torch))
    print("real bitsandbytes:", real)
    print("stand-in:        ", stand_in)


if __name__ == "__main__":
    main()
