"""``--framework fsdp-qlora``: Answer.AI's fsdp_qlora train.py (Mar 2024, e4968fd), the stack of
the dev-2 rows GT115-GT131 (benchmarks/dev2_causes.py). Bytes derived by hand from its source:
no ``prepare_model_for_kbit_training`` (16-bit embeddings, norms and residual stream under a
quantized base) and adapters in the base weight's dtype (peft 0.10 ``update_layer``)."""

from __future__ import annotations

from conftest import MODELS_DIR
from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.activations import layer_activation_terms
from trainmem.analytic.tensor_states import tensor_states
from trainmem.estimate import estimate
from trainmem.specs.assumptions import loop_of
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

QLORA = {"lora_rank": 64, "quantize_base": "nf4", "precision": "bf16-true", "seq_len": 512}


def test_no_kbit_preparation_keeps_the_base_in_its_dtype() -> None:
    llama = load_model_spec("llama-2-7b")
    answer = TrainingConfig(framework="fsdp-qlora", **QLORA)  # type: ignore[arg-type]
    peft = TrainingConfig(**QLORA)  # type: ignore[arg-type]
    assert not answer.kbit_fp32_upcast and peft.kbit_fp32_upcast
    ours = {s.name: s for s in tensor_states(llama, answer)}
    assert ours["embedding/tokens"].param_bytes == 2 * 32000 * 4096
    assert compute_and_residual_bytes(answer) == (2, 2)
    # peft's upcast makes the stream fp32 and bitsandbytes returns its input's dtype
    # (bitsandbytes nn/modules.py Linear4bit.forward: ``out.to(inp_dtype)``): fp32 throughout
    assert compute_and_residual_bytes(peft) == (4, 4)


def test_adapters_take_the_base_dtype_so_lora_inputs_are_not_cast() -> None:
    llama = load_model_spec("llama-2-7b")
    answer = TrainingConfig(framework="fsdp-qlora", lora_targets=("q",), **QLORA)  # type: ignore[arg-type]
    # peft without its k-bit preparation: a bf16 stream beside peft's fp32 adapters (with the
    # preparation the stream is fp32 already and nothing is cast)
    peft = TrainingConfig(lora_targets=("q",), prepare_kbit_training=False, **QLORA)  # type: ignore[arg-type]
    assert answer.conventions.adapter_dtype_follows_weights
    ours = layer_activation_terms(llama, answer)
    theirs = layer_activation_terms(llama, peft)
    # peft's fp32 adapters save an fp32 copy of q's [b, s, h] input (x.to(lora_A.weight.dtype))
    assert theirs["lora/q_input_cast"] == 4 * 4096 * 512
    assert ours.get("lora/q_input_cast", 0) == 0
    # FSDP1: neither FSDP2's post-backward order nor its leaf unsharded parameters
    assert not answer.conventions.fsdp2_post_backward
    assert not answer.conventions.fsdp_unsharded_leaf_parameters
    assert not answer.conventions.fsdp_flat_parameter_grads
    # torch 2.2 FSDP1 ``_unshard`` / ``_post_backward_hook`` allocate on their own streams
    assert answer.conventions.fsdp_collective_streams
    assert not peft.conventions.fsdp_collective_streams


def test_the_loop_binds_the_output_through_the_backward_and_the_step() -> None:
    # train.py (e4968fd / 50efa1e): ``output = model(...)``; ``loss = output.loss``;
    # ``loss.backward()``; ``optimizer.step()``; only then ``output = None``: the bf16 logits
    # (b s V values, 2 B each) live through the backward, whose peak is then that much higher.
    # The 2-layer Qwen2 formula config, V = 512, at b x s = 2 x 64: 2 x 128 x 512 = 131,072 B.
    qwen2 = str(MODELS_DIR / "formula" / "qwen2.json")

    def peak(**fields: object) -> int:
        training = TrainingConfig(  # type: ignore[arg-type]
            framework="fsdp-qlora",
            lora_rank=8,
            quantize_base="nf4",
            precision="bf16-true",
            micro_batch_size=2,
            seq_len=64,
            data_parallel_size=2,
            zero_stage=3,
            activation_checkpointing="full",
            **fields,
        )
        est = estimate(qwen2, training, engine="analytic", simulate_allocator=False)
        return est.breakdown.allocated_bytes

    assert TrainingConfig(framework="fsdp-qlora").training_loop == "step"
    assert peak() - peak(loop="drop") == 2 * (2 * 64) * 512 == 131_072
    # ``step`` is modelled for one micro-batch per step; with more, the output is dropped
    many = TrainingConfig(framework="fsdp-qlora", gradient_accumulation_steps=2)
    assert many.training_loop == "drop"
    assert peak(gradient_accumulation_steps=2) == peak(gradient_accumulation_steps=2, loop="drop")
    # and the assumption line says so
    assert "held to the end of the step" in loop_of({"framework": "fsdp-qlora"})
    two = {"framework": "fsdp-qlora", "gradient_accumulation_steps": 2}
    assert "dropped after the loss" in loop_of(two)
