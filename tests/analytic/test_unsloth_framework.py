"""``--framework unsloth``: Unsloth 2026.3.5 (tag March-2026) with unsloth_zoo 2026.3.4 on one
GPU. Bytes derived by hand from that code: unsloth_zoo training_utils.py
``prepare_model_for_training`` (LoRA A / B upcast to fp32, embeddings / norms / head left in
the 16-bit model dtype), gradient_checkpointing.py ``UnslothCheckpointFunction`` and
``initialize_unsloth_gradient_checkpointing`` (Note [Unsloth's offloaded gradient
checkpointing])."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from trainmem.analytic.activation_shapes import compute_and_residual_bytes
from trainmem.analytic.tensor_states import tensor_states
from trainmem.analytic.transforms.unsloth import unsloth_buffer_bytes, unsloth_offloads_inputs
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.schedule import Item, Repeat, _format_index
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

QLORA = {"lora_rank": 16, "quantize_base": "nf4", "seq_len": 2048, "micro_batch_size": 2}


def _unsloth(**kw: object) -> TrainingConfig:
    return TrainingConfig(framework="unsloth", **{**QLORA, **kw})  # type: ignore[arg-type]


def test_defaults_are_unsloths_and_an_explicit_setting_wins() -> None:
    t = _unsloth()
    # dtype=None -> bf16; notebooks' optim="adamw_8bit"; use_gradient_checkpointing="unsloth"
    assert (t.precision, t.optimizer, t.activation_checkpointing) == (
        "bf16-true",
        "adamw-8bit",
        "full",
    )
    given = _unsloth(precision="16-true", optimizer="adamw", activation_checkpointing="none")
    assert (given.precision, given.optimizer, given.activation_checkpointing) == (
        "16-true",
        "adamw",
        "none",
    )
    plain = TrainingConfig()
    assert (plain.optimizer, plain.activation_checkpointing) == ("adamw", "none")


def test_adapters_fp32_while_embeddings_and_the_stream_stay_16_bit() -> None:
    llama = load_model_spec("llama-2-7b")
    t = _unsloth(lora_targets=("q",))
    assert not t.kbit_fp32_upcast  # not peft's prepare_model_for_kbit_training
    assert compute_and_residual_bytes(t) == (2, 2)
    states = {s.name: s for s in tensor_states(llama, t)}
    assert states["embedding/tokens"].param_bytes == 2 * 32000 * 4096
    # lora_A of q: r x h = 16 x 4096 fp32 (``upcast = True`` for ".lora_A." names)
    lora = [s for s in states.values() if s.trainable and s.numel == 16 * 4096]
    assert lora and all(s.param_bytes == 4 * 16 * 4096 for s in lora)


def test_buffer_sizes_and_when_inputs_leave_for_the_cpu() -> None:
    llama = load_model_spec("llama-2-7b")
    # torch.empty(2*256*2048, bf16) = 2,097,152 B; grown to b s h = 2 x 2048 x 4096 x 2 B
    assert unsloth_buffer_bytes(llama, _unsloth()) == (2_097_152, 33_554_432)
    assert unsloth_offloads_inputs(llama, _unsloth())
    # max_seq_length < 512: plain checkpointing, nothing patched
    assert unsloth_buffer_bytes(llama, _unsloth(seq_len=511)) == (0, 0)
    assert not unsloth_offloads_inputs(llama, _unsloth(seq_len=511))
    # 1 x 512 x 2048 = 1,048,576 elements is not more than MINIMUM_SIZE = 2 MiB // 2: kept
    small = load_model_spec("llama-3.2-1b")
    assert not unsloth_offloads_inputs(small, _unsloth(seq_len=512, micro_batch_size=1))
    assert unsloth_offloads_inputs(small, _unsloth(seq_len=513, micro_batch_size=1))
    # other frameworks never patch it
    hf = TrainingConfig(activation_checkpointing="full", **QLORA)  # type: ignore[arg-type]
    assert unsloth_buffer_bytes(llama, hf) == (0, 0)


def _walk(items: list[Item], i: int = 0) -> Iterator[tuple[str, str, int, str]]:
    for item in items:
        if isinstance(item, Repeat):
            for k in range(item.count):
                yield from _walk(list(item.body), item.index(k))
        else:
            yield item.action, _format_index(item.key, i), item.size_bytes, item.phase


def test_schedule_offloads_every_layer_input_but_the_last() -> None:
    # llama-2-7b, 32 layers, b s h = 2 x 2048 x 4096: u = 33,554,432 B per layer input; layer
    # 0's input is the embedding output, a leaf its AccumulateGrad node holds (Note [Unsloth's
    # offloaded layer 0 input]): offloaded but never freed on the GPU
    est = estimate("llama-2-7b", _unsloth(), simulate_allocator=False)
    u = 33_554_432
    setup = list(_walk(list(est.schedules[0].setup)))
    setup = [op for op in setup if op[1].startswith("unsloth_gc/buffer")]
    assert setup[:4] == [
        ("alloc", "unsloth_gc/buffer0", 2_097_152, "init"),  # at patch time
        ("alloc", "unsloth_gc/buffer", u, "forward"),  # resize_ in the first forward
        ("free", "unsloth_gc/buffer0", 2_097_152, "forward"),
        ("free", "unsloth_gc/buffer", u, "backward"),  # swapped for layer 30's input
    ]
    step = list(_walk(list(est.schedules[0].step)))
    forward_frees = [key for action, key, _, phase in step
                     if action == "free" and phase == "forward" and key.startswith("act/")
                     and key != "act/embedding"]  # fmt: skip
    assert forward_frees == [f"act/{i}/0" for i in range(1, 31)]  # not layer 31's nor 0's
    swaps = [op for op in step if op[1] == "unsloth_gc/buffer"]
    assert len(swaps) == 2 * 30 and {op[2] for op in swaps} == {u}  # layers 30 .. 1
    assert swaps[0][0] == "free" and swaps[-1][0] == "alloc"  # held again after the backward


def test_single_gpu_only() -> None:
    with pytest.raises(SpecError, match="data_parallel_size"):
        _unsloth(data_parallel_size=2)
    with pytest.raises(SpecError, match="zero_stage"):
        _unsloth(zero_stage=2)
    with pytest.raises(SpecError, match="activation_offloading"):
        _unsloth(activation_offloading=True)  # its own offload is -c full


def test_fused_cross_entropy_saves_the_input_gradient_and_no_logits() -> None:
    # Note [Unsloth's fused cross-entropy]; llama-2-7b, t = 2 x 2048 = 4096 tokens, V 32000,
    # h 4096, bf16 (c = r = 2)
    from trainmem.analytic.head import head_activation_bytes
    from trainmem.analytic.loss import (
        loss_backward_transient_bytes,
        loss_forward_transient_bytes,
        loss_saved_terms,
        unsloth_fused_loss,
    )

    llama = load_model_spec("llama-2-7b")
    t = _unsloth()
    assert unsloth_fused_loss(llama, t)
    # grad_inputs = torch.empty_like(hidden_states): 2 x 4096 x 4096; the head is frozen
    assert loss_saved_terms(llama, t, t=4096) == {"fused_grad_input": 33_554_432}
    # one piece: the bf16 logits and their bf16 gradient (2 x 2 x 32000 x 4096) and the
    # piece's input gradient before its copy (2 x 4096 x 4096)
    assert loss_forward_transient_bytes(llama, t) == 524_288_000 + 33_554_432
    assert loss_backward_transient_bytes(llama, t) == 0  # made in the forward
    head = head_activation_bytes(llama, t)
    assert "lm_head_input" not in head and "log_softmax" not in head
    # a full fine-tune's head: grad_lm_head = torch.zeros_like(lm_head_weight), bf16 V x h
    full = _unsloth(lora_rank=0, quantize_base="none")
    assert loss_saved_terms(llama, full, t=4096) == {
        "fused_grad_input": 33_554_432,
        "fused_grad_lm_head": 2 * 32000 * 4096,
    }
    # the HF Trainer's ForCausalLMLoss on the same run: two fp32 (t, V) gradients
    hf = TrainingConfig(precision="bf16-true", prepare_kbit_training=False, **QLORA)  # type: ignore[arg-type]
    assert not unsloth_fused_loss(llama, hf)
    assert loss_backward_transient_bytes(llama, hf) == 2 * 4 * 32000 * 4096
    # and a piece's V h weight gradient before grad_lm_head.add_ (2 x 32000 x 4096)
    assert loss_forward_transient_bytes(llama, full) == 524_288_000 + 33_554_432 + 262_144_000
    # --chunked-cross-entropy 8 is UNSLOTH_CE_LOSS_N_CHUNKS=8: 512 tokens a piece
    pieces = _unsloth(chunked_cross_entropy=8)
    assert unsloth_fused_loss(llama, pieces)
    assert loss_forward_transient_bytes(llama, pieces) == (2 * 2 * 32000 + 2 * 4096) * 512
    assert loss_backward_transient_bytes(llama, pieces) == 0


def test_fast_rms_layernorm_final_norm() -> None:
    # Fast_RMS_Layernorm: save_for_backward(X, W, r): X bf16 (2 h) + r fp32 (4) per token; its
    # backward writes dX into dY: no transients
    from trainmem.analytic.head import final_norm_backward_bytes, head_activation_bytes

    llama = load_model_spec("llama-2-7b")
    t = _unsloth()
    assert head_activation_bytes(llama, t)["final_norm"] == (2 * 4096 + 4) * 4096
    assert final_norm_backward_bytes(llama, t) == 0
    hf = TrainingConfig(precision="bf16-true", prepare_kbit_training=False, **QLORA)  # type: ignore[arg-type]
    # transformers' LlamaRMSNorm: x.float() (4 h) + rstd (4), frozen; five fp32 temporaries
    assert head_activation_bytes(llama, hf)["final_norm"] == (4 * 4096 + 4) * 4096
    assert final_norm_backward_bytes(llama, hf) == 5 * 4 * 4096 * 4096


ALL_LINEAR = ("q", "k", "v", "o", "gate", "up", "down")


def test_fast_lora_casts_adapters_not_inputs() -> None:
    # Note [Unsloth's fast LoRA]: matmul_lora's ``X @ A.to(dtype)``; peft's fp32 adapters
    # would save x.to(float32) of each targeted linear's input instead
    from trainmem.analytic.activations import layer_activation_terms
    from trainmem.analytic.lora import unsloth_fast_lora

    llama = load_model_spec("llama-2-7b")
    fast = _unsloth(lora_targets=ALL_LINEAR)
    assert unsloth_fast_lora(llama, fast)
    assert unsloth_fast_lora(llama, _unsloth())  # Unsloth's default targets: all seven
    # q, v only: peft's forward (no group), also when given under unsloth
    assert not unsloth_fast_lora(llama, _unsloth(lora_targets=("q", "v")))
    assert not unsloth_fast_lora(llama, _unsloth(lora_targets=ALL_LINEAR, lora_dropout=0.05))
    # patch_peft_model leaves a group with biases to peft: Qwen2's q / k / v
    qwen = load_model_spec("qwen2.5-7b")
    assert qwen.attention_bias and not unsloth_fast_lora(qwen, fast)
    ours = layer_activation_terms(llama, fast)
    assert not any(k.endswith("_input_cast") for k in ours)
    peft = layer_activation_terms(llama, _unsloth(lora_targets=ALL_LINEAR, lora_dropout=0.0001))
    assert peft["lora/q_input_cast"] == 4 * 4096 * 4096  # fp32 x of 4,096 tokens


def test_dora_keeps_peft_forward_under_unsloth() -> None:
    # unsloth 2026.3.5 models/llama.py patch_peft_model patches a group only when its linears'
    # lora_magnitude_vector is empty: get_peft_model(use_dora=True) (**kwargs -> LoraConfig)
    # keeps peft's forward, so peft's fp32 cast of each targeted linear's input is saved
    from trainmem.analytic.activations import layer_activation_terms
    from trainmem.analytic.lora import unsloth_fast_lora

    llama = load_model_spec("llama-2-7b")
    dora = _unsloth(lora_targets=ALL_LINEAR, lora_variant="dora")
    assert not unsloth_fast_lora(llama, dora)
    assert layer_activation_terms(llama, dora)["lora/q_input_cast"] == 4 * 4096 * 4096


def test_dequantized_weights_go_into_one_kept_buffer() -> None:
    # fast_dequantize(..., use_global_buffer=True): WEIGHT_BUFFER of the largest weight
    # (gate / up / down: 11008 x 4096 bf16) and ABSMAX_BUFFER (fp32, one per 64 values)
    est = estimate("llama-2-7b", _unsloth(lora_targets=ALL_LINEAR), simulate_allocator=False)
    setup = [op for op in _walk(list(est.schedules[0].setup)) if op[1].startswith("unsloth/")]
    assert setup == [
        ("alloc", "unsloth/WEIGHT_BUFFER", 2 * 11008 * 4096, "forward"),
        ("alloc", "unsloth/ABSMAX_BUFFER", 4 * 11008 * 4096 // 64, "forward"),
    ]
    step = list(_walk(list(est.schedules[0].step)))
    dequant = [op for op in step if op[1] == "dequant" and op[0] == "alloc"]
    # forward: none (the buffer); backward: a fresh one per layer for the input gradient
    assert {op[3] for op in dequant} == {"backward"} and len(dequant) == 32
    assert {op[2] for op in dequant} == {2 * 11008 * 4096}


def test_kernels_save_x_e_g_and_fast_norms_their_input() -> None:
    # LoRA_MLP: save_for_backward(..., X, e, g): e, g are 2 x (2 x 11008) per token of 4,096;
    # h (the SwiGLU output, down's input) is remade in backward; no X @ A kept; each
    # Fast_RMS_Layernorm saves X (2 x 4096) and rstd (4) per token
    from trainmem.analytic.activations import layer_activation_terms

    llama = load_model_spec("llama-2-7b")
    ours = layer_activation_terms(llama, _unsloth(lora_targets=ALL_LINEAR))
    assert ours["mlp/gated"] == 2 * 2 * 11008 * 4096
    assert ours["mlp/down_input"] == 0
    assert ours["lora/q"] == ours["lora/down"] == 0
    assert ours["attention/norm"] == ours["mlp/norm"] == (2 * 4096 + 4) * 4096
    # peft's modules and transformers' RMSNorm on the same run (the HF Trainer)
    # transformers' own kernels on the 16-bit stream (no peft k-bit upcast, which makes it fp32)
    hf = TrainingConfig(
        precision="bf16-true", prepare_kbit_training=False, **{**QLORA, "lora_targets": ALL_LINEAR}
    )  # type: ignore[arg-type]
    theirs = layer_activation_terms(llama, hf)
    assert theirs["mlp/gated"] == 3 * 2 * 11008 * 4096  # gate's, act's and up's outputs
    assert theirs["lora/q"] == 4 * 16 * 4096  # A's fp32 output, saved by B
    assert theirs["attention/norm"] == (4 * 4096 + 4) * 4096  # x.float() and rstd


def test_unsloths_allocator_settings_unless_given() -> None:
    # unsloth_zoo/__init__.py: PYTORCH_ALLOC_CONF="expandable_segments:True" from torch 2.9,
    # before it PYTORCH_CUDA_ALLOC_CONF with roundup_power2_divisions too; only when unset
    from trainmem.specs.frameworks import FRAMEWORK_CONVENTIONS

    row = FRAMEWORK_CONVENTIONS["unsloth"]
    assert row.default_alloc_conf((2, 9)) == "expandable_segments:True"
    assert row.default_alloc_conf((2, 8)) == (
        "expandable_segments:True,roundup_power2_divisions:[32:256,64:128,256:64,>:32]"
    )
    assert FRAMEWORK_CONVENTIONS["hf-trainer"].default_alloc_conf((2, 9)) == ""
    t = _unsloth(torch_version="2.9")
    default = estimate("llama-2-7b", t).breakdown
    given = estimate("llama-2-7b", t, alloc_conf="expandable_segments:True").breakdown
    plain = estimate("llama-2-7b", t, alloc_conf="expandable_segments:False").breakdown
    assert default.reserved_bytes == given.reserved_bytes != plain.reserved_bytes


def test_lora_mlp_backward_makes_one_intermediate_gradient() -> None:
    # LoRA_MLP.backward: DW = dY @ down (t x i, bf16), the SwiGLU backward in place into DW,
    # e, g, the input gradient into the saved X: one (t, i) tensor; transformers' MLP holds
    # three (the product's, the activation's and gate's gradients)
    from trainmem.analytic.backward_transients import backward_layer_transients

    llama = load_model_spec("llama-2-7b")
    ours = backward_layer_transients(llama, _unsloth(lora_targets=ALL_LINEAR))
    assert ours[0] == 2 * 11008 * 4096
    # transformers' own kernels on the 16-bit stream (no peft k-bit upcast, which makes it fp32)
    hf = TrainingConfig(
        precision="bf16-true", prepare_kbit_training=False, **{**QLORA, "lora_targets": ALL_LINEAR}
    )  # type: ignore[arg-type]
    assert backward_layer_transients(llama, hf)[0] == 3 * 2 * 11008 * 4096


def test_loss_pieces_by_unsloths_rule_on_a_given_gpu() -> None:
    # get_chunk_size: max(4 * round(2 V t / free), 1), Python's round (half to even)
    from trainmem.estimate import unsloth_chunk_count

    assert unsloth_chunk_count(128256, 40000, 17 * 10**9) == 4  # 0.60 -> 1 -> 4
    assert unsloth_chunk_count(32000, 4096, 60 * 10**9) == 1  # 0.0044 -> 0 -> 1
    assert unsloth_chunk_count(5, 1, 4) == 8  # 2.5 -> 2 -> 8
    assert unsloth_chunk_count(5, 1, 0) == 1
    long = {**QLORA, "lora_rank": 32, "lora_targets": ALL_LINEAR, "quantize_base": "nf4-dq"}
    long |= {"micro_batch_size": 1, "seq_len": 40000}
    t = TrainingConfig(framework="unsloth", **long)  # type: ignore[arg-type]
    est = estimate("llama-3.1-8b", t, gpu="24GB")
    # 2 V t = 10.26e9 B: 4 pieces for any free memory in (6.84e9, 20.5e9], 24 GB less ~7 GB
    assert est.config["chunked_cross_entropy"] == 4
    assert any("fused loss runs in 4 pieces" in n for n in est.notes)
    given = estimate(
        "llama-3.1-8b",
        TrainingConfig(framework="unsloth", chunked_cross_entropy=1, **long),
        gpu="24GB",
    )  # type: ignore[arg-type]
    assert given.config["chunked_cross_entropy"] == 1  # UNSLOTH_CE_LOSS_N_CHUNKS wins
    assert estimate("llama-3.1-8b", t).config["chunked_cross_entropy"] == 0  # no GPU: one piece


def test_fused_loss_soft_caps_inside_its_piece() -> None:
    # compute_fused_ce_loss: tanh(logits / softcap) * softcap inside the compiled piece: no
    # tanh output saved (transformers' Gemma-2 head saves c V t of it)
    import dataclasses

    from trainmem.analytic.head import head_activation_bytes

    capped = dataclasses.replace(load_model_spec("gemma-3-1b"), final_logit_softcap=30.0)
    assert "final_logit_softcap_tanh" not in head_activation_bytes(capped, _unsloth())
    hf = TrainingConfig(precision="bf16-true", prepare_kbit_training=False, **QLORA)  # type: ignore[arg-type]
    assert head_activation_bytes(capped, hf)["final_logit_softcap_tanh"] == 2 * 262144 * 4096


def test_recomputed_output_held_through_each_layer_backward() -> None:
    # UnslothCheckpointFunction.backward: ``outputs = ctx.run_function(...)`` stays bound while
    # ``torch.autograd.backward(outputs_with_grad, args_with_grad)`` runs: the layer's
    # ``residual + hidden_states``, b s h bf16 = 2 x 2048 x 4096 x 2 B, from the recompute's
    # end to the layer's backward end, every one of the 32 layers
    est = estimate("llama-2-7b", _unsloth(), simulate_allocator=False)
    step = list(_walk(list(est.schedules[0].step)))
    held = [(i, op) for i, op in enumerate(step) if op[1] == "unsloth_gc/output"]
    assert [op[0] for _, op in held] == ["alloc", "free"] * 32
    assert {op[2] for _, op in held} == {33_554_432} and {op[3] for _, op in held} == {"backward"}
    for (made, _), (freed, _) in zip(held[::2], held[1::2], strict=True):
        # after its recompute ("re/..."), nothing of the next layer's recompute in between
        assert step[made - 1][1].startswith("re/") or step[made - 1][1].startswith("act/")
        assert not any(op[1].startswith("re/") and op[0] == "alloc" for op in step[made:freed])


# The README's context table's release (e3162dc5, 2025-01-14): Note [Unsloth before 2025.3]
TABLE = {**QLORA, "lora_targets": ALL_LINEAR, "unsloth_version": "2025.1.5"}


def test_the_release_is_an_input_defaulting_to_the_one_read() -> None:
    from trainmem.specs.assumptions import assumptions

    assert _unsloth().unsloth_release == (2026, 3, 5)
    assert _unsloth(unsloth_version="2025.1").unsloth_release == (2025, 1, 0)
    assert assumptions({"framework": "unsloth"})["unsloth"] == (
        "2026.3.5 (default; unsloth_zoo 2026.3.4)"
    )
    assert assumptions({"framework": "unsloth", "unsloth_version": "2025.1.5"})["unsloth"] == (
        "2025.1.5"
    )
    with pytest.raises(SpecError, match="unsloth_version"):
        _unsloth(unsloth_version="2024.6")  # before the oldest tag read (July-2024)
    with pytest.raises(SpecError, match="chunked_cross_entropy"):
        _unsloth(unsloth_version="2025.4.4", chunked_cross_entropy=4)  # no pieces before 2025.8.5


def test_older_checkpoint_offloads_every_input_without_a_buffer() -> None:
    # Unsloth_Offloaded_Gradient_Checkpointer: every layer's input to the CPU (the last too),
    # back into a new tensor per backward; no GPU_BUFFERS; layer 0's input (the leaf) stays and
    # its CPU copy still comes back beside it
    est = estimate(
        "llama-2-7b", TrainingConfig(framework="unsloth", **TABLE), simulate_allocator=False
    )  # type: ignore[arg-type]
    u = 33_554_432
    every = list(_walk([*est.schedules[0].setup, *est.schedules[0].step]))
    assert not [op for op in every if op[1].startswith("unsloth_gc/buffer")]
    step = list(_walk(list(est.schedules[0].step)))
    forward_frees = [key for action, key, _, phase in step
                     if action == "free" and phase == "forward" and key.startswith("act/")
                     and key != "act/embedding"]  # fmt: skip
    assert forward_frees == [f"act/{i}/0" for i in range(1, 32)]
    made = [key for action, key, _, phase in step
            if action == "alloc" and phase == "backward" and key.startswith("act/")]  # fmt: skip
    assert made == [f"act/{i}/0" for i in range(31, 0, -1)]
    upload = [op for op in step if op[1] == "unsloth_gc/upload"]
    assert [(action, size) for action, _, size, _ in upload] == [("alloc", u), ("free", u)]


def test_older_kernels_add_the_adapters_out_of_place_and_dequantize_anew() -> None:
    # matmul_lora before 2025.3.1: ``out += (X @ A) @ (s * B)``: DW's product is a second
    # (t, i) bf16 tensor, 2 x 11008 x 4096 x 2 B each; fast_dequantize without the global
    # buffer before 2025.2.1: no WEIGHT_BUFFER / ABSMAX_BUFFER
    from trainmem.analytic.backward_transients import backward_layer_transients

    llama = load_model_spec("llama-2-7b")
    old = TrainingConfig(framework="unsloth", **TABLE)  # type: ignore[arg-type]
    assert backward_layer_transients(llama, old)[0] == 2 * (2 * 11008 * 4096)
    est = estimate(llama, old, simulate_allocator=False)
    every = list(_walk([*est.schedules[0].setup, *est.schedules[0].step]))
    assert not [op for op in every if op[1].startswith("unsloth/")]
    mid = _unsloth(lora_targets=ALL_LINEAR, unsloth_version="2025.2.1")
    est = estimate(llama, mid, simulate_allocator=False)
    every = list(_walk([*est.schedules[0].setup, *est.schedules[0].step]))
    assert [op[1] for op in every if op[1].startswith("unsloth/")] == [
        "unsloth/WEIGHT_BUFFER",
        "unsloth/ABSMAX_BUFFER",
    ]
    assert backward_layer_transients(llama, mid)[0] == 2 * (2 * 11008 * 4096)


def test_cut_cross_entropy_before_the_fused_loss() -> None:
    # cut_cross_entropy 1f3ebdb LinearCrossEntropyFunction: saves e (the final norm's output,
    # bf16, 2 h per token), lse (fp32 per token) and logit_avg (fp32 per vocabulary entry); no
    # logits; backward de (2 h per token) and, before 2025.3, dc = zeros_like(c): V h bf16.
    # llama-2-7b, t = 4096, h 4096, V 32000
    from trainmem.analytic.head import head_activation_bytes
    from trainmem.analytic.loss import (
        loss_backward_transient_bytes,
        loss_forward_transient_bytes,
    )

    llama = load_model_spec("llama-2-7b")
    for release, dc in (("2025.1.5", 2 * 32000 * 4096), ("2025.4.4", 0)):
        t = _unsloth(lora_targets=ALL_LINEAR, unsloth_version=release)
        head = head_activation_bytes(llama, t)
        assert head["lm_head_input"] == 2 * 4096 * 4096
        assert (head["cut_ce_lse"], head["cut_ce_logit_avg"]) == (4 * 4096, 4 * 32000)
        assert "fused_grad_input" not in head
        assert loss_forward_transient_bytes(llama, t) == 0
        assert loss_backward_transient_bytes(llama, t) == 2 * 4096 * 4096 + dc
    est = estimate(llama, _unsloth(unsloth_version="2025.4.4"), gpu="24GB")
    assert not any("pieces" in n for n in est.notes)


def test_cross_entropy_on_the_returned_logits_before_cut_cross_entropy() -> None:
    # Fast_CrossEntropyLoss (October-2024): saves the bf16 logits themselves (2 V per token)
    # and the fp32 log-sum-exp; no fp32 copy; its backward writes into the saved logits.
    # llama-2-7b, t = 4096, V 32000; a frozen head saves no input
    from trainmem.analytic.head import head_activation_bytes
    from trainmem.analytic.loss import (
        loss_backward_transient_bytes,
        loss_forward_transient_bytes,
    )

    llama = load_model_spec("llama-2-7b")
    t = _unsloth(lora_targets=ALL_LINEAR, unsloth_version="2024.10.7")
    head = head_activation_bytes(llama, t)
    assert (head["unsloth_ce_logits"], head["unsloth_ce_lse"]) == (2 * 32000 * 4096, 4 * 4096)
    assert "lm_head_input" not in head and "cut_ce_lse" not in head
    assert loss_forward_transient_bytes(llama, t) == 0
    assert loss_backward_transient_bytes(llama, t) == 0


def test_attention_before_the_dispatcher_saves_expanded_keys_and_values() -> None:
    # llama-3.1-8b: 32 query heads, 8 kv heads of 128. Before 2025.12.2 xformers (and the SDPA
    # fallback) save K and V expanded to 32 heads: q 32 x 128, k 32 x 128, v 32 x 128 values
    # per token; flash-attn and 2026.3.5's SDPA (enable_gqa) k and v at 8 heads
    from trainmem.analytic.activations import layer_activation_terms

    llama = load_model_spec("llama-3.1-8b")
    t = 2 * 2048
    for release, attention, kv in (
        ("2025.1.5", "sdpa", 32),
        ("2025.11.6", "sdpa", 32),
        ("2025.1.5", "flash", 8),
        ("2025.12.2", "sdpa", 8),
    ):
        cfg = _unsloth(unsloth_version=release, attention=attention)
        terms = layer_activation_terms(llama, cfg)
        assert terms["attention/q_k"] == 2 * (32 + kv) * 128 * t
        assert terms["attention/v"] == 2 * kv * 128 * t
