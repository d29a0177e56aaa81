"""QLoRA in ``bf16-true`` under peft's ``prepare_model_for_kbit_training``: fp32 layers over a
16-bit quantized matmul (Note [fp32 layers over a 16-bit quantized matmul],
analytic/forward_transients.py; ``TrainingConfig.kbit_fp32_activations``).

Hand derivation on the agreement model (2-layer 2048-wide Llama, i = 5,632, 2 x 256 = 512
tokens), nf4 LoRA on q / v, one GPU, the default framework (pytorch-amp, which calls peft's
preparation): peft casts the embeddings, norms and head to fp32 (peft 0.21.2 utils/other.py),
bitsandbytes returns each linear's output in its fp32 input's dtype (0.45.0 nn/modules.py
``Linear4bit.forward``: ``.to(inp_dtype)``), so every activation is fp32: c = r = 4 B. At layer
1's down projection the forward holds down's output before its cast back, 2 x 512 x 2048 =
2,097,152 B, its input's bf16 copy 2 x 512 x 5632 = 5,767,168 B, the fp32 product ``act(gate) *
up`` 4 x 512 x 5632 = 11,534,336 B (a 4-bit down saves no input) and the fp32 MLP input 4 x 512
x 2048 = 4,194,304 B (gate and up are frozen 4-bit linears: nobody saves it); the residual and
the layer's input are the fp32 norms' saved inputs; ``inputs_embeds``, 4 x 512 x 2048 =
4,194,304 B, is not (the embeddings are frozen: layer 0's norm saves nothing of an input that
needs no grad; a real CPU run, session 23, helper kvcopy). These are the tensors the generic
path's trace holds there (session 22, helper qbf16; inputs_embeds session 23).
"""

from __future__ import annotations

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.activations import activation_profile
from trainmem.analytic.forward_transients import down_projection_held_bytes
from trainmem.analytic.transforms.checkpointing import first_norm_saves_its_input
from trainmem.estimate import resolve_model
from trainmem.specs.training import TrainingConfig

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
T, H, INTER = 2 * 256, 2048, 5632
QLORA = {"lora_rank": 16, "quantize_base": "nf4", "precision": "bf16-true"}


def _training(**changes: object) -> TrainingConfig:
    return TrainingConfig(micro_batch_size=2, seq_len=256, **{**QLORA, **changes})  # type: ignore[arg-type]


@pytest.mark.parametrize("framework", ["pytorch-amp", "hf-trainer", "llama-factory"])
def test_the_stacks_that_call_peft_preparation_have_fp32_layers(framework: str) -> None:
    training = _training(framework=framework)
    assert training.kbit_fp32_upcast and training.kbit_fp32_activations
    assert compute_and_residual_bytes(training) == (4, 4)


@pytest.mark.parametrize(
    "changes",
    [
        {"framework": "unsloth"},  # its own prepare_model_for_training, no fp32 upcast
        # peft's upcast, then norms, embed_tokens and lm_head cast back to the bf16 torch_dtype
        # (axolotl v0.18.0 loaders/model.py:447-477, _convert_embedding_modules_dtype)
        {"framework": "axolotl"},
        {"framework": "fsdp-qlora", "data_parallel_size": 2, "zero_stage": 3},  # train.py
        {"framework": "litgpt"},
        {"framework": "torchtune", "quantize_base": "nf4-dq"},
        {"prepare_kbit_training": False},  # an explicit setting wins
        {"quantize_base": "gptq-int4"},  # peft skips the cast for GPTQ
        {"precision": "bf16-mixed"},  # loaded in fp32 for autocast: the matmuls' output bf16
        {"precision": "32-true"},
        # a matmul that saves its input keeps a 16-bit cast per linear: not modelled (refused
        # on the generic path), the formulas as before
        {"quantize_base": "int8"},
        {"bitsandbytes_version": "0.41.1"},
    ],
)
def test_other_stacks_keep_their_activation_dtype(changes: dict[str, object]) -> None:
    training = _training(**changes)
    assert not training.kbit_fp32_activations
    c, _ = compute_and_residual_bytes(training)
    assert c == (4 if training.precision == "32-true" else 2)


def test_held_tensors_at_an_fp32_layers_down_projection() -> None:
    training = _training()
    model = resolve_model(AGREEMENT)
    terms = activation_profile(model, training).terms
    held = down_projection_held_bytes(
        model,
        training,
        terms,
        input_saved=first_norm_saves_its_input(model, training),
        first_layer=False,
        has_embedding=True,
    )
    assert held == [2 * T * H, 2 * T * INTER, 4 * T * INTER, 4 * T * H, 4 * T * H]
