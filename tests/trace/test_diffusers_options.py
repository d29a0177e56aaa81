"""Training options on a diffusers model's traced step (issue 26): LoRA on a class without
diffusers' ``add_adapter``, FSDP2 under the fake process group, compile, and the refusals that
say what runs instead. Expected bytes are counted by hand from the config (tiny PixArt below),
or, for compile, read off torch.compile's own saved tensors on real CPU tensors.

tests/models/diffusers/tiny-pixart.json (``PixArtTransformer2DModel``): width 2 heads x 16 = 32,
2 ``BasicTransformerBlock``s, cross-attention 32, captions 48, 4 -> 8 channels, patch 2, sample
8. Parameters, fp32 elements (diffusers pixart_transformer_2d.py, attention_bias=True):

- ``pos_embed.proj`` Conv2d 4 -> 32, kernel 2: 32*4*2*2 + 32 = 544 (and the non-persistent
  ``pos_embed`` buffer, 16 patches x 32 = 512 elements, which FSDP2 does not shard);
- per block: two attentions of four 32x32 linears with bias, 4 * 4 * 1,056 = 8,448 (with
  ``to_q`` and ``to_v`` at 1,056 each); the feed-forward 32 -> 128 -> 32, 4,224 + 4,128 = 8,352;
  ``scale_shift_table`` [6, 32] = 192: 16,992 per block;
- ``scale_shift_table`` [2, 32] = 64; ``proj_out`` 32 -> 2*2*8, 1,056;
- ``adaln_single``: timestep embedder 256 -> 32 -> 32 (8,224 + 1,056), ``linear`` 32 -> 6*32
  (6,336): 15,616; ``caption_projection`` 48 -> 32 -> 32: 1,568 + 1,056 = 2,624.

Total 544 + 2 * 16,992 + 64 + 1,056 + 15,616 + 2,624 = 53,888.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainmem.breakdown import MemoryCategory
from trainmem.errors import NotApplicableError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

MODELS = Path(__file__).resolve().parents[1] / "models" / "diffusers"
PIXART = str(MODELS / "tiny-pixart.json")
FLUX = str(Path(__file__).parent / "diffusers_configs" / "tiny-flux.json")
PARAMS = 53_888
POS_EMBED_BUFFER = 512 * 4


def _estimate(**settings: Any) -> Any:
    training = TrainingConfig(micro_batch_size=2, precision="32-true", **settings)
    return estimate(PIXART, training, engine="generic", simulate_allocator=False)


def test_lora_on_a_class_without_add_adapter_trains_the_adapters_only() -> None:
    # PixArt has no PeftAdapterMixin: peft's inject_adapter_in_model, as add_adapter calls it.
    # Default targets q and v: to_q and to_v of both attentions of both blocks, 8 linears of
    # 32 -> 32, each A [16, 32] + B [32, 16] = 1,024 elements at rank 16
    lora = 8 * (16 * 32 + 32 * 16)
    est = _estimate(lora_rank=16)
    assert est.num_parameters == PARAMS + lora
    assert est.num_trainable_parameters == lora
    assert est.breakdown.parameters == (PARAMS + lora) * 4 + POS_EMBED_BUFFER
    assert est.breakdown.optimizer_states == 2 * lora * 4  # AdamW exp_avg + exp_avg_sq


def test_fsdp2_shards_every_parameter_over_the_fake_ranks() -> None:
    # FSDP2 on 4 ranks: every parameter chunked on dim 0 into ceil(rows / 4)-row pieces, rank 0
    # holding a full piece: the scale_shift_tables [6, 32] (x2) and [2, 32] keep 2 and 1 rows
    # of 32, i.e. 16 + 16 + 16 padding elements beyond a quarter; every other dim 0 divides
    sharded = PARAMS // 4 + 3 * 16
    est = _estimate(data_parallel_size=4, zero_stage=3, framework="fsdp2")
    assert est.breakdown.parameters == sharded * 4 + POS_EMBED_BUFFER
    assert est.breakdown.optimizer_states == 2 * sharded * 4
    assert est.details["traced_mesh"] == {"dp_shard": 4}


def test_fsdp2_and_compile_wrap_the_blocks_the_model_declares() -> None:
    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.diffusers_model import build_diffusers_model
    from trainmem.trace.lora import wrapped_blocks

    # FLUX declares both block kinds for regional compilation and for FSDP's auto-wrap
    # (transformer_flux.py: _repeated_blocks and _no_split_modules); the longest block list
    # alone would be the single-stream blocks
    flux = build_diffusers_model(load_hf_config(FLUX), TrainingConfig())
    kinds = {"FluxTransformerBlock", "FluxSingleTransformerBlock"}
    for kind in ("compile", "fsdp"):
        blocks = wrapped_blocks(flux, kind)
        assert {type(b).__name__ for b in blocks} == kinds
        assert len(blocks) == len(flux.transformer_blocks) + len(flux.single_transformer_blocks)
    # PixArt declares PatchEmbed besides its blocks for FSDP, nothing for compile: its
    # transformer_blocks, the longest block list
    pixart = build_diffusers_model(load_hf_config(PIXART), TrainingConfig())
    fsdp = [type(b).__name__ for b in wrapped_blocks(pixart, "fsdp")]
    assert sorted(fsdp) == ["BasicTransformerBlock", "BasicTransformerBlock", "PatchEmbed"]
    assert wrapped_blocks(pixart, "compile") == list(pixart.transformer_blocks)


def test_tensor_parallel_rank_holds_its_shards_of_every_block_linear() -> None:
    # TP 2 in Megatron's layout (diffusers' FLUX _tp_plan on PixArt's names): per block, the
    # q / k / v linears of both attentions (1,056 each) and ff.net.0.proj (4,224) keep half
    # their rows and bias; to_out.0 (1,024 + 32) and ff.net.2 (4,096 + 32) half their
    # columns, the bias whole; the scale_shift_table (192) and everything outside the blocks
    # whole: 16,992 -> 2 * (3 * 528 + 512 + 32) + 2,112 + 2,048 + 32 + 192 = 8,640 per block
    per_rank = PARAMS - 2 * (16_992 - 8_640)
    est = _estimate(tensor_parallel_size=2, sequence_parallel=True)
    assert est.breakdown.parameters == per_rank * 4 + POS_EMBED_BUFFER
    assert est.breakdown.optimizer_states == 2 * per_rank * 4
    assert est.details["traced_mesh"] == {"tp": 2}


def _lora_tp(path: str) -> tuple[Any, Any]:
    """(TP 1, TP 2) estimates with rank-16 LoRA on every diffusers target kind."""
    targets = ("q", "k", "v", "o", "up", "down")
    return tuple(  # type: ignore[return-value]
        estimate(
            path,
            TrainingConfig(
                micro_batch_size=2,
                precision="32-true",
                lora_rank=16,
                lora_targets=targets,
                tensor_parallel_size=tp,
            ),  # fmt: skip
            engine="generic",
            simulate_allocator=False,
        )
        for tp in (1, 2)
    )


def test_lora_adapters_are_sharded_beside_the_block_plan() -> None:
    # Note [LoRA under tensor parallelism] on diffusers' layout: beside a column-parallel base
    # (to_q / to_k / to_v, ff.net.0.proj) lora_A [16, in] whole and lora_B [out, 16] split by
    # rows; beside a row-parallel base (to_out.0, ff.net.2) lora_A [16, in] split by columns
    # and lora_B whole. Tiny PixArt, per block (two attentions of 32 -> 32, ff 32 -> 128 -> 32):
    # 6 q / k / v: 16 * 32 + 32 * 16 / 2 = 768 each; 2 to_out.0: 16 * 32 / 2 + 32 * 16 = 768
    # each; net.0.proj: 16 * 32 + 128 * 16 / 2 = 1,536; net.2: 16 * 128 / 2 + 32 * 16 = 1,536
    per_block_tp2 = 6 * 768 + 2 * 768 + 1_536 + 1_536
    per_block = 8 * (16 * 32 + 32 * 16) + 2 * (16 * 32 + 128 * 16)  # whole, TP 1
    whole, split = _lora_tp(PIXART)
    assert whole.num_trainable_parameters == 2 * per_block
    assert whole.breakdown.optimizer_states == 2 * 4 * 2 * per_block
    assert split.breakdown.optimizer_states == 2 * 4 * 2 * per_block_tp2  # AdamW, fp32
    base = PARAMS - 2 * (16_992 - 8_640)  # the blocks' base linears as without LoRA (above)
    assert split.breakdown.parameters == (base + 2 * per_block_tp2) * 4 + POS_EMBED_BUFFER
    assert split.details["traced_mesh"] == {"tp": 2}


def test_lora_under_tensor_parallelism_on_joint_attention() -> None:
    # not PixArt-only: tiny SD3 (MMDiT, width 32, 2 blocks, the last context_pre_only: no
    # to_add_out, no ff_context). Block 0: 6 column q / k / v (image and text streams) and 2
    # row to_out.0 / to_add_out at 768 each, ff and ff_context at 1,536 + 1,536 each; block 1:
    # 6 column, 1 row, ff alone
    sd3 = str(Path(__file__).parent / "diffusers_configs" / "tiny-sd3.json")
    per_rank = (8 * 768 + 2 * 3_072) + (7 * 768 + 3_072)
    whole, split = _lora_tp(sd3)
    assert whole.num_trainable_parameters == 8 * 1_024 + 2 * 5_120 + 7 * 1_024 + 5_120
    assert split.breakdown.optimizer_states == 2 * 4 * per_rank


@pytest.mark.parametrize("sp", [False, True])
def test_sequence_parallel_blocks_keep_their_tokens_shard(sp: bool) -> None:
    # 64 px -> 4 x 4 = 16 tokens of width 32, b = 2, fp32. The LayerNorm before the attention
    # keeps its output and mean / rstd: [b, s, 32] + 2 x [b, s, 1]; sequence parallelism
    # halves s (16 -> 8 tokens per rank). The column-parallel q keeps [b, 16, 32 / 2] either
    # way: the attention gathers the whole sequence
    training = TrainingConfig(
        micro_batch_size=2, precision="32-true", resolution=64, tensor_parallel_size=2,
        sequence_parallel=sp,
    )  # fmt: skip
    acts = _block0_by_module(training)
    s = 8 if sp else 16
    assert acts["transformer_blocks.0.norm1"] == 2 * s * 32 * 4 + 2 * (2 * s * 4)
    assert acts["transformer_blocks.0.attn1.to_q"] == 2 * 16 * 16 * 4


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ("tiny-flux.json", "FluxSingleTransformerBlock has linears outside"),
        ("tiny-wan.json", "qk_norm across heads"),
    ],
)
def test_tensor_parallel_refuses_blocks_it_cannot_shard(config: str, named: str) -> None:
    path = Path(__file__).parent / "diffusers_configs" / config
    training = TrainingConfig(micro_batch_size=1, resolution=64, tensor_parallel_size=2)
    with pytest.raises(UnsupportedError, match=named):
        estimate(str(path), training, engine="generic", simulate_allocator=False)


def test_sequence_parallel_refuses_joint_attention() -> None:
    training = TrainingConfig(
        micro_batch_size=1, resolution=64, tensor_parallel_size=2, sequence_parallel=True
    )
    sd3 = Path(__file__).parent / "diffusers_configs" / "tiny-sd3.json"
    with pytest.raises(UnsupportedError, match="joint \\(MMDiT\\) attention"):
        estimate(str(sd3), training, engine="generic", simulate_allocator=False)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"context_parallel_size": 2, "zero_stage": 3}, "context_parallel_size=2 (the whole"),
        ({"pipeline_parallel_size": 2, "gradient_accumulation_steps": 4}, "--engine generic"),
    ],
)
def test_refusals_say_why_and_what_runs_instead(settings: dict[str, Any], named: str) -> None:
    # the whole-model trace (engine "trace") refuses them, naming the generic path that runs
    training = TrainingConfig(micro_batch_size=2, precision="32-true", **settings)
    with pytest.raises(UnsupportedError) as info:
        estimate(PIXART, training, engine="trace", simulate_allocator=False)
    assert named in str(info.value)
    assert not isinstance(info.value, NotApplicableError)  # a gap, not a meaningless option


@pytest.mark.parametrize(
    ("settings", "instead"),
    [
        ({"chunked_cross_entropy": 8}, "leave it 0"),
        ({"loss": "logits-sum"}, "leave --loss unset"),
        ({"padding_mask": True}, "leave it off"),
        ({"framework": "torchtune"}, "use --framework pytorch-amp"),
        ({"framework": "litgpt"}, "use --framework pytorch-amp"),
    ],
)
def test_language_model_options_are_not_applicable(settings: dict[str, Any], instead: str) -> None:
    # a token loss, a padded token batch, a language-model framework mean nothing for a
    # diffusion model: the refusal says so (NotApplicableError) and names what to use instead
    with pytest.raises(NotApplicableError, match="language[ -]model") as info:
        _estimate(**settings)
    assert instead in str(info.value)


def _block0_kept_by_torch_compile(training: TrainingConfig) -> tuple[int, int]:
    """Bytes block 0 leaves alive for the backward under torch.compile (AOTAutograd's min-cut
    partition, no inductor codegen) on real CPU tensors: the storages its compiled graph saves,
    parameters and the block's inputs left out (tests/trace/test_compile.py's reference, on a
    diffusers block), and its output's bytes when a later autograd node saves that storage
    (else 0); under the trace's CUDA autocast cast lists (``cuda_autocast_policy``), as the
    trace runs them."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from trainmem.trace.cuda_autocast import cuda_autocast_policy
    from trainmem.trace.diffusers_model import build_diffusers_model, make_diffusers_batch

    torch.manual_seed(0)
    model = build_diffusers_model(json.loads(Path(PIXART).read_text()), training, device="cpu")
    batch = make_diffusers_batch(model, training)

    def nop(gm: Any, _inputs: Any) -> Any:
        return make_boxed_func(gm)

    backend = aot_autograd(
        fw_compiler=nop, bw_compiler=nop, partition_fn=min_cut_rematerialization_partition
    )
    for block in model.transformer_blocks:
        block.forward = torch.compile(block.forward, backend=backend, fullgraph=True)
    block = model.transformer_blocks[0]
    outside = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    later: set[int] = set()
    state: dict[str, Any] = {"on": False, "output": None}

    def pre_hook(_mod: Any, args: Any, kwargs: Any) -> None:
        state["on"] = True
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor):
                outside.add(t.untyped_storage().data_ptr())

    def post_hook(_mod: Any, _args: Any, output: Any) -> None:
        state["on"] = False
        state["output"] = output.untyped_storage()

    def pack(t: Any) -> Any:
        ptr = t.untyped_storage().data_ptr()
        if state["on"] and ptr not in outside:
            saved[ptr] = t.untyped_storage().nbytes()
        elif state["output"] is not None:
            later.add(ptr)
        return t

    block.register_forward_pre_hook(pre_hook, with_kwargs=True)
    block.register_forward_hook(post_hook)
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**batch)
    output = state["output"]
    return sum(saved.values()), (output.nbytes() if output.data_ptr() in later else 0)


BF16_COMPILED_BLOCK = 108_800
"""Bytes block 0's compiled graph saves, bf16-mixed, 64 px, micro-batch 2: what
:func:`_block0_kept_by_torch_compile` measured (test_compiled_block_keeps_what_torch_compile_
saves checks the trace against it); eager autograd saves 114,944 B there."""


def _activations_by_module(training: TrainingConfig, *, emulate_cuda: bool) -> dict[str, int]:
    """The trace's activations (bytes alive when the forward ends) by module path."""
    from trainmem.trace import diffusers_model as dm
    from trainmem.trace.engine import run_trace

    raw = json.loads(Path(PIXART).read_text())
    holder: dict[str, Any] = {}

    def build() -> Any:
        holder["m"] = dm.build_diffusers_model(raw, training)
        return holder["m"]

    _, report = run_trace(
        build,
        lambda: dm.make_diffusers_batch(holder["m"], training),
        training,
        loss_fn=dm.diffusers_loss,
        emulate_cuda=emulate_cuda,
    )
    return dict(report.activation_bytes_by_module)


def _block0_by_module(training: TrainingConfig) -> dict[str, int]:
    """Block 0's activations by module path (real CPU kernel choices, ``emulate_cuda=False``,
    as the torch.compile reference runs)."""
    return {
        k: v
        for k, v in _activations_by_module(training, emulate_cuda=False).items()
        if k == "transformer_blocks.0" or k.startswith("transformer_blocks.0.")
    }


def _traced_block0(training: TrainingConfig) -> int:
    return sum(_block0_by_module(training).values())


_COMPILED = {"micro_batch_size": 2, "precision": "bf16-mixed", "resolution": 64}


@pytest.mark.slow  # ~3 s (torch.compile + the trace); fast: test_compiled_block_keeps_its_bytes
def test_compiled_block_keeps_what_torch_compile_saves() -> None:
    # block 0's own saved set is torch.compile's, storage for storage (eager autograd saves
    # 114,944 B), and its output is kept as dynamo keeps it: block 1 gets the fp32 residual
    # stream where block 0 got the patch embedding's bf16 output, so dynamo recompiles it
    # (a dtype guard) into a graph that saves its input for the LayerNorm's backward
    compiled = TrainingConfig(compile=True, **_COMPILED)
    own, output = _block0_kept_by_torch_compile(compiled)
    assert own == BF16_COMPILED_BLOCK
    assert output == 2 * 16 * 32 * 4  # fp32 [2, 4 x 4 tokens, 32]
    assert _traced_block0(compiled) == own + output


def test_compiled_block_keeps_its_bytes() -> None:
    # each BasicTransformerBlock compiled (diffusers' compile_repeated_blocks' regions): what
    # torch.compile keeps of block 0 (the slow test above), its fp32 output included
    compiled = TrainingConfig(compile=True, **_COMPILED)
    assert _traced_block0(compiled) == BF16_COMPILED_BLOCK + 2 * 16 * 32 * 4


def test_untraced_settings_on_a_model_without_formulas_name_what_to_drop() -> None:
    # Found by fuzzing (session 17): the refusal ended "use --engine analytic for this
    # configuration", which refuses a diffusers model itself
    with pytest.raises(UnsupportedError) as info:
        _estimate(zero_stage=2, data_parallel_size=4)
    assert "change or drop data_parallel_size, zero_stage" in str(info.value)
    assert "--engine analytic" not in str(info.value)
    with pytest.raises(UnsupportedError, match="not a formula family"):
        estimate(PIXART, TrainingConfig(), engine="analytic")


def test_auto_keeps_what_the_generic_refusal_says_would_work() -> None:
    # Found by fuzzing (session 17): --engine auto (the CLI's and the page's default) kept the
    # generic refusal only up to its first "; ", which cut what the trace runs instead
    # (session 24: context parallelism runs on PixArt; SD3's joint attention is refused)
    training = TrainingConfig(
        micro_batch_size=2, precision="32-true", context_parallel_size=2, zero_stage=3
    )
    with pytest.raises(UnsupportedError) as info:
        estimate(str(Path(__file__).parent / "diffusers_configs" / "tiny-sd3.json"), training,
                 simulate_allocator=False)  # fmt: skip
    message = str(info.value)
    # issue 26: the generic path's reason alone (no formula family was in question)
    assert "not a formula family" not in message
    assert "SD3Transformer2DModel's joint (MMDiT) attention" in message
    assert message.endswith(
        "; traced: FSDP2 / HSDP (--zero-stage 3 --data-parallel-size N) or tensor parallelism"
    )
    assert "--engine analytic" not in message  # auto has just tried it


def _block0_cp(**settings: Any) -> dict[str, int]:
    """Activations by module with CUDA's SDPA kernels emulated (torch's ring runs the flash /
    efficient kernels only)."""
    training = TrainingConfig(micro_batch_size=2, precision="32-true", resolution=64, **settings)
    return _activations_by_module(training, emulate_cuda=True)


def test_context_parallel_ranks_hold_their_rows_of_image_tokens() -> None:
    # Note [Context parallelism of a denoiser]: the latents [2, 4, 8, 8] sharded by rows over
    # cp 2, 16 -> 8 image tokens of width 32 per rank, fp32. norm1 keeps its output and
    # mean / rstd: 2 x s x 32 x 4 + 2 x (2 x s x 4); attn1's to_q output [2, s, 32]; the
    # cross-attention's keys / values are the whole caption on every rank, [2, 77, 32]
    whole = _block0_cp(data_parallel_size=2, zero_stage=3)
    split = _block0_cp(data_parallel_size=4, zero_stage=3, shard_group_size=2,
                       context_parallel_size=2)  # fmt: skip
    for s, acts in ((16, whole), (8, split)):
        assert acts["transformer_blocks.0.norm1"] == 2 * s * 32 * 4 + 2 * (2 * s * 4)
        assert acts["transformer_blocks.0.attn1.to_q"] == 2 * s * 32 * 4
        assert acts["transformer_blocks.0.attn2.to_k"] == 2 * 77 * 32 * 4


def test_hsdp_beside_context_parallelism_shards_over_the_context_ranks() -> None:
    # torchtitan's mesh: a shard group of 2 = the 2 context ranks (dp_shard_cp), 4 replicas;
    # every dim 0 of tiny PixArt divides by 2. The latents' storage keeps its [2, 4, 8, 8]
    # size (resize_ never shrinks one), captions [2, 77, 48] and timesteps [2] whole
    est = _estimate(data_parallel_size=4, zero_stage=3, shard_group_size=2,
                    context_parallel_size=2)  # fmt: skip
    assert est.details["traced_mesh"] == {"dp_replicate": 4, "cp": 2}
    assert est.breakdown.parameters == PARAMS // 2 * 4 + POS_EMBED_BUFFER
    assert est.breakdown.optimizer_states == 2 * PARAMS // 2 * 4
    assert (
        est.schedules[0].peak().by_category[MemoryCategory.INPUT]
        == (2 * 4 * 64 + 2 * 77 * 48 + 2) * 4
    )


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ("tiny-sd3.json", "joint \\(MMDiT\\) attention"),
        ("tiny-flux.json", "joint \\(MMDiT\\) attention"),
        ("tiny-sdxl-unet.json", "not one of the denoisers whose context parallelism is traced"),
    ],
)
def test_context_parallelism_refuses_what_a_row_shard_cannot_split(config: str, named: str) -> None:
    path = Path(__file__).parent / "diffusers_configs" / config
    training = TrainingConfig(micro_batch_size=1, resolution=64, context_parallel_size=2,
                              zero_stage=3)  # fmt: skip
    with pytest.raises(UnsupportedError, match=named):
        estimate(str(path), training, engine="generic", simulate_allocator=False)


@pytest.mark.parametrize(
    ("precision", "adapter_bytes"),
    [("bf16-true", 2), ("16-true", 4)],
)
def test_lora_adapters_take_the_base_dtype_except_fp16(precision: str, adapter_bytes: int) -> None:
    # Note [diffusers' adapters take the base dtype]: peft's inject_adapter_in_model moves each
    # adapter to its base layer's dtype and never upcasts (a real CPU run of diffusers 0.42.1 +
    # peft 0.21.2 gives bf16 adapters on a bf16 model); the scripts' cast_training_params makes
    # them fp32 for fp16 only. Same 8 linears of 32 -> 32 at rank 16 as above.
    lora = 8 * (16 * 32 + 32 * 16)
    training = TrainingConfig(micro_batch_size=2, precision=precision, lora_rank=16)
    est = estimate(PIXART, training, engine="generic", simulate_allocator=False)
    assert est.breakdown.parameters == PARAMS * 2 + lora * adapter_bytes + POS_EMBED_BUFFER // 2
    assert est.breakdown.optimizer_states == 2 * lora * adapter_bytes


def test_lora_under_mixed_precision_loads_the_frozen_model_in_the_compute_dtype() -> None:
    # Note [diffusers' LoRA scripts cast the frozen model]: train_dreambooth_lora_*.py move the
    # frozen denoiser with dtype=weight_dtype (bf16 here) before add_adapter, whose adapters
    # take that dtype; accelerate autocasts over it. By hand: 2 B per parameter and buffer
    # element, AdamW's two states 2 B per adapter element.
    lora = 8 * (16 * 32 + 32 * 16)
    training = TrainingConfig(micro_batch_size=2, precision="bf16-mixed", lora_rank=16)
    est = estimate(PIXART, training, engine="generic", simulate_allocator=False)
    assert est.breakdown.parameters == (PARAMS + lora) * 2 + POS_EMBED_BUFFER // 2
    assert est.breakdown.optimizer_states == 2 * lora * 2
    assert "weight_dtype" in est.details["assumed"]["load_dtype"]
    assert "LoRA adapters bfloat16" in est.details["assumed"]["framework_means"]
    # a given load dtype wins; full fine-tuning keeps the fp32 trained model
    fp32 = TrainingConfig(
        micro_batch_size=2, precision="bf16-mixed", lora_rank=16, load_dtype="float32"
    )
    est = estimate(PIXART, fp32, engine="generic", simulate_allocator=False)
    assert est.breakdown.parameters == (PARAMS + lora) * 4 + POS_EMBED_BUFFER
    full = TrainingConfig(micro_batch_size=2, precision="bf16-mixed")
    est = estimate(PIXART, full, engine="generic", simulate_allocator=False)
    assert est.breakdown.parameters == PARAMS * 4 + POS_EMBED_BUFFER


def test_eager_attention_runs_diffusers_own_eager_processor() -> None:
    # Note [diffusers' eager attention]: PixArt's AttnProcessor2_0 (SDPA) become AttnProcessor,
    # as its set_default_attn_processor sets; the bytes are checked against a real CPU step in
    # tests/trace/test_diffusers_real_cpu.py
    from diffusers.models.attention_processor import AttnProcessor

    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.diffusers_model import build_diffusers_model

    training = TrainingConfig(micro_batch_size=2, attention="eager")
    model = build_diffusers_model(load_hf_config(PIXART), training)
    assert {type(p) for p in model.attn_processors.values()} == {AttnProcessor}


def test_eager_attention_without_a_diffusers_eager_processor_is_refused() -> None:
    # FLUX's processors call the attention dispatch, which has no eager backend
    from trainmem.specs.hf import load_hf_config
    from trainmem.trace.diffusers_model import build_diffusers_model

    flux = Path(__file__).parent / "diffusers_configs" / "tiny-flux.json"
    training = TrainingConfig(micro_batch_size=2, attention="eager")
    with pytest.raises(UnsupportedError, match="FluxAttnProcessor.*traced: sdpa, flash"):
        build_diffusers_model(load_hf_config(str(flux)), training)
