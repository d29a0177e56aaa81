"""What of a quantized base (``--quantize-base``) the traced paths model (issue 26).

The trace runs a stand-in for each quantized linear (:mod:`trainmem.trace.quantized`, Note
[Traced quantized base]): its packed weight, the dequantized weight in forward and backward and
the saved input as bitsandbytes has them. What it does not run is refused here, each with what
would work.
"""

from __future__ import annotations

from trainmem.specs.training import TrainingConfig

__all__ = ["quantized_base_refusals"]


def quantized_base_refusals(training: TrainingConfig) -> list[str]:
    """The settings of a quantized-base run the traced paths do not model, as ``field=value``
    with what would (empty without a quantized base, or when they model it). A GPTQ base under
    ``fp8-mixed`` is traced (its stand-ins left out of torchao's conversion, as a GPTQ
    ``QuantLinear`` is: Note [Tracing float8]); a bitsandbytes one is refused by
    :class:`~trainmem.specs.training.TrainingConfig` for both engines (Note [float8 training
    over a bitsandbytes base]).

    * a 16-bit model without autocast under a framework that prepares the base with peft's
      ``prepare_model_for_kbit_training`` (``TrainingConfig.kbit_fp32_upcast``) whose quantized
      matmul saves its input (``TrainingConfig.quantized_matmul_saves_input``: int8, or 4-bit
      before bitsandbytes 0.43.2): each linear then saves its own 16-bit cast of its fp32 input
      (three for q, k and v), which neither engine models; with a current bitsandbytes 4-bit
      base the fp32 layers are traced (Note [fp32 layers over a 16-bit quantized matmul] in
      trainmem/analytic/forward_transients.py).

    The rest of the base in the other 16-bit dtype than autocast's
    (``TrainingConfig.kbit_dense_cast``, Note [A quantized base's other weights in another
    16-bit dtype]) is traced: the rest loaded in that dtype, each stand-in casting its output
    back to its 16-bit input's dtype, the flash stand-in keeping a 16-bit input's dtype
    (trainmem/trace/cuda_sdpa.py, as transformers' flash-attn path does).

    DoRA over a bitsandbytes base (QDoRA) runs peft's DoRA code on the stand-in's dequantized
    weight (Note [Traced quantized base]); over GPTQ peft refuses it, and so does
    :class:`~trainmem.specs.training.TrainingConfig`.
    """
    kind = training.quantize_base
    if kind == "none":
        return []
    out = []
    fp32_layers = training.kbit_fp32_upcast and not training.uses_autocast
    if fp32_layers and training.weight_dtype != "float32" and not training.kbit_fp32_activations:
        out.append(
            f"quantize_base={kind} with precision={training.precision} (peft's fp32 upcast of "
            "the rest of a 16-bit model beside a quantized matmul that saves its input, a "
            "16-bit cast per linear; traced: nf4 / fp4 with bitsandbytes >= 0.43.2, or "
            "--precision bf16-mixed, 16-mixed or 32-true)"
        )
    return out
