"""``--framework megatron`` on the generic path (trainmem.traced_megatron, Note [Megatron on a
traced step]; trainmem.trace.megatron_loss; issue 26).

Expected numbers: sizes of the 2-layer 2048-wide agreement Llama derived by hand from its
config (below); Megatron's cross-entropy checked against torch's own ``cross_entropy`` run on
the CPU; the agreement with the formulas (the analytic engine's cited Megatron rules, an
independent derivation of the same run) within 1 %.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import MODELS_DIR
from trainmem.breakdown import MemoryCategory
from trainmem.errors import NotApplicableError, UnsupportedError
from trainmem.estimate import estimate
from trainmem.schedule import Item, Op, StepSchedule
from trainmem.specs.training import TrainingConfig

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
QWEN_7B = str(MODELS_DIR / "remote_code" / "qwen-7b.json")
OLMO2 = MODELS_DIR / "olmo2.json"


def _agreement_params() -> int:
    """Trainable elements of the agreement Llama, by hand from its config: per layer q and o
    h x h, k and v h x (kv_heads x head_dim), gate / up / down h x ffn, two norms h; the
    untied embedding and head V x h each, the final norm h."""
    cfg = json.loads((MODELS_DIR / "agreement" / "llama_h2048.json").read_text())
    h, ffn, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    return cfg["num_hidden_layers"] * layer + 2 * v * h + h


def _training(seq_len: int = 256, **changes: Any) -> TrainingConfig:
    return TrainingConfig(micro_batch_size=2, seq_len=seq_len, framework="megatron", **changes)


def _ops(items: tuple[Item, ...] | list[Item]) -> list[Op]:
    out: list[Op] = []
    for item in items:
        out += [item] if isinstance(item, Op) else _ops(list(item.body))
    return out


def _both(model: str, training: TrainingConfig) -> tuple[StepSchedule, int, int]:
    generic = estimate(model, training, engine="generic", simulate_allocator=False)
    analytic = estimate(model, training, engine="analytic", simulate_allocator=False)
    g, a = generic.breakdown.allocated_bytes, analytic.breakdown.allocated_bytes
    return generic.schedules[0], g, a


@pytest.mark.parametrize(
    "changes",
    [{}, {"data_parallel_size": 2, "zero_stage": 1}],
    ids=["1 gpu bf16-mixed", "distributed optimizer over dp 2"],
)
def test_agrees_with_the_formulas_and_sizes_megatron_states(changes: dict[str, Any]) -> None:
    schedule, generic, analytic = _both(AGREEMENT, _training(**changes))
    assert generic == pytest.approx(analytic, rel=0.01)
    n = _agreement_params()
    ops = _ops(schedule.setup) + _ops(schedule.step)
    # Megatron's contiguous fp32 gradient buffer: 4 bytes per trainable element, whole under
    # the distributed optimizer too, allocated once and never freed
    buffers = [op for op in ops if op.key == "grad/main_grad"]
    assert [op.size_bytes for op in buffers] == [4 * n]
    assert all(op.action == "alloc" for op in buffers)
    # no other gradient is kept: each 16-bit one is a temporary dropped once added
    assert schedule.category_peak(MemoryCategory.GRADIENT) == 4 * n
    # fp32 master weights + Adam's two fp32 moments, 12 B per element, half on each of 2 ranks
    # (every tensor of this model has an even number of elements)
    shards = changes.get("data_parallel_size", 1)
    assert schedule.category_peak(MemoryCategory.OPTIMIZER_STATE) == 12 * n // shards


def _agreement_local_params(tp: int) -> int:
    """Elements one tensor-parallel rank of the agreement Llama holds, by hand: every linear,
    the embedding and the head split over ``tp`` ranks (column / row / vocabulary shards),
    the norms (2 per layer and the final one, h each) whole on every rank."""
    cfg = json.loads((MODELS_DIR / "agreement" / "llama_h2048.json").read_text())
    h = cfg["hidden_size"]
    norms = (2 * cfg["num_hidden_layers"] + 1) * h
    return int((_agreement_params() - norms) // tp + norms)


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"sequence_parallel": True},
        {"data_parallel_size": 2, "zero_stage": 1},
        {"seq_len": 1024},
        {"sequence_parallel": True, "seq_len": 1024},
    ],
    ids=[
        "tp 2",
        "tp 2 + sp",
        "tp 2 x dp 2 distributed optimizer",
        "tp 2 at 2 x 1024 tokens",
        "tp 2 + sp at 2 x 1024 tokens",
    ],
)
def test_tensor_parallel_agrees_with_the_formulas_and_shards_megatrons_buffers(
    changes: dict[str, Any],
) -> None:
    """Note [Megatron's tensor parallelism on a traced step]: DTensor's plan with Megatron's
    shapes, the cross-entropy on the logits' vocabulary shard, the embedding's new gradient one
    shard (V / 2 x h x 2 bytes, VocabParallelEmbedding's lookup in the rank's weight); the
    norms as Megatron's fused kernel (Note [Megatron's fused RMSNorm]: +3.2 % at 2 x 1024
    tokens and +1.4 % beside data parallelism with transformers' norm); with SP the
    column-parallel linears' saved sequence shard (Note [Megatron's column-parallel linears
    save the shard]: +1.77 % at 2 x 1024 tokens while the trace saved DTensor's gathered
    inputs)."""
    cfg = json.loads((MODELS_DIR / "agreement" / "llama_h2048.json").read_text())
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    training = _training(tensor_parallel_size=2, **changes)
    tokens = 2 * training.seq_len
    schedule, generic, analytic = _both(AGREEMENT, training)
    assert generic == pytest.approx(analytic, rel=0.01)
    n = _agreement_local_params(2)
    ops = _ops(schedule.setup) + _ops(schedule.step)
    assert [op.size_bytes for op in ops if op.key == "grad/main_grad"] == [4 * n]
    # fp32 master weights and two moments, 12 B per element, half on each of dp 2 ranks
    dp = changes.get("data_parallel_size", 1)
    assert schedule.category_peak(MemoryCategory.OPTIMIZER_STATE) == 12 * n // dp
    embedding = [
        op.size_bytes
        for op in ops
        if op.action == "alloc" and op.phase == "backward" and op.module.endswith("embed_tokens")
        and op.size_bytes >= h * v // 2
    ]  # fmt: skip
    assert set(embedding) == {v // 2 * h * 2}  # (one per traced step)
    # Megatron's saved softmax: fp32, the tokens x the rank's V / 2 logits
    saved = [op.size_bytes for op in ops if op.action == "alloc" and op.module == ""
             and op.category is MemoryCategory.ACTIVATION]  # fmt: skip
    assert 4 * tokens * v // 2 in saved


@pytest.mark.parametrize(
    "changes",
    [{}, {"activation_checkpointing": "full"}, {"data_parallel_size": 2, "zero_stage": 1}],
    ids=["pp 2", "pp 2 full checkpointing", "pp 2 x distributed optimizer over dp 2"],
)
def test_pipeline_agrees_with_the_formulas_and_keeps_no_logits(changes: dict[str, Any]) -> None:
    """Note [Megatron's last pipeline stage]: each stage's buffer and states are its own
    (stage 0: layer 0 and the embedding; stage 1: layer 1, the final norm and the head), and
    the last stage holds no micro-batch's [b, s, V] logits once its backward is done."""
    cfg = json.loads((MODELS_DIR / "agreement" / "llama_h2048.json").read_text())
    h, ffn, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * (h // cfg["num_attention_heads"])
    layer = 2 * h * h + 2 * h * kv + 3 * h * ffn + 2 * h
    training = _training(pipeline_parallel_size=2, gradient_accumulation_steps=4, **changes)
    generic = estimate(AGREEMENT, training, engine="generic", simulate_allocator=False)
    analytic = estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)
    g, a = generic.breakdown.allocated_bytes, analytic.breakdown.allocated_bytes
    assert g == pytest.approx(a, rel=0.01)
    dp = changes.get("data_parallel_size", 1)
    for schedule, n in zip(generic.schedules, (layer + v * h, layer + h + v * h), strict=True):
        ops = _ops(schedule.setup) + _ops(schedule.step)
        assert [op.size_bytes for op in ops if op.key == "grad/main_grad"] == [4 * n]
        assert schedule.category_peak(MemoryCategory.OPTIMIZER_STATE) == 12 * n // dp
    last = generic.schedules[1]
    logits = 2 * 256 * v * 2  # one micro-batch's bf16 logits
    ops = _ops(last.setup) + _ops(last.step)
    kept = {op.key for op in ops if op.action == "alloc" and op.size_bytes == logits}
    freed_in_step = {op.key for op in ops if op.action == "free" and op.phase != "optimizer"}
    assert kept and kept <= freed_in_step


def test_remote_code_config_agrees_with_the_formulas() -> None:
    training = _training(seq_len=64, data_parallel_size=2, zero_stage=1)
    _, generic, analytic = _both(QWEN_7B, training)
    assert generic == pytest.approx(analytic, rel=0.01)


def test_model_outside_the_formula_families_gets_the_buffer_of_its_traced_tensors() -> None:
    """OLMo-2 (no ModelSpec): the buffer is 4 bytes per parameter of the model transformers
    builds from the config (counted here on the meta device)."""
    import transformers

    config = transformers.AutoConfig.for_model(**json.loads(OLMO2.read_text()))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    training = TrainingConfig(micro_batch_size=2, seq_len=64, framework="megatron")
    est = estimate(str(OLMO2), training, engine="generic", simulate_allocator=False)
    ops = _ops(est.schedules[0].setup) + _ops(est.schedules[0].step)
    assert [op.size_bytes for op in ops if op.key == "grad/main_grad"] == [4 * n]
    assert any("megatron-core's GPTModel" in note for note in est.notes)


def test_formulas_make_megatrons_new_gradients_in_16_bits() -> None:
    """Note [Megatron's new 16-bit gradients]: the down projection's new gradient is bf16,
    h x ffn x 2 bytes, and the output layer's (V x h x 2) is made in the backward too."""
    cfg = json.loads((MODELS_DIR / "agreement" / "llama_h2048.json").read_text())
    h, ffn, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    est = estimate(AGREEMENT, _training(), engine="analytic", simulate_allocator=False)
    new = [
        op
        for op in _ops(est.schedules[0].step)
        if op.action == "alloc" and op.key.startswith("new_grad/")
    ]
    layer = max(op.size_bytes for op in new if op.module.startswith("layers."))
    assert layer == 2 * h * ffn
    assert 2 * v * h in [op.size_bytes for op in new if op.module == "head"]


def test_vocab_parallel_cross_entropy_matches_torch_and_saves_one_fp32_softmax() -> None:
    from trainmem.trace.megatron_loss import _VocabParallelCrossEntropy

    torch.manual_seed(0)
    t, v = 6, 11
    logits = torch.randn(t, v, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, v, (t,))
    saved: list[Any] = []

    def pack(x: Any) -> Any:
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        losses = _VocabParallelCrossEntropy.apply(logits, target)
    expected = torch.nn.functional.cross_entropy(logits.float(), target, reduction="none")
    assert torch.allclose(losses, expected, atol=1e-5)
    floats = [x for x in saved if x.is_floating_point()]
    assert [(x.dtype, tuple(x.shape)) for x in floats] == [(torch.float32, (t, v))]
    losses.sum().backward()
    reference = torch.softmax(logits.float(), -1) - torch.nn.functional.one_hot(target, v)
    assert logits.grad is not None and logits.grad.dtype == torch.bfloat16
    assert torch.allclose(logits.grad.float(), reference, atol=1e-2)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"context_parallel_size": 2}, "context_parallel_size=2"),
        (
            {
                "pipeline_parallel_size": 2,
                "gradient_accumulation_steps": 4,
                "pipeline_schedule": "gpipe",
            },
            "pipeline_schedule=gpipe",
        ),  # fmt: skip
        ({"data_parallel_size": 2, "zero_stage": 2}, "zero_stage=2"),
        ({"lora_rank": 16}, "lora_rank=16"),
    ],
)
def test_refuses_what_it_does_not_model_naming_what_works(
    changes: dict[str, Any], named: str
) -> None:
    with pytest.raises(UnsupportedError) as err:
        estimate(AGREEMENT, _training(**changes), engine="generic", simulate_allocator=False)
    assert named in str(err.value)
    assert "--zero-stage 0 or 1" in str(err.value)


@pytest.mark.parametrize(
    "config",
    [
        MODELS_DIR / "t5.json",
        MODELS_DIR / "whisper.json",
        MODELS_DIR / "mamba.json",
        MODELS_DIR / "formula" / "bert.json",
        MODELS_DIR / "diffusers" / "tiny-pixart.json",
    ],
    ids=lambda p: p.stem,
)
def test_refuses_models_megatrons_gptmodel_does_not_build(config: Any) -> None:
    training = TrainingConfig(micro_batch_size=2, seq_len=64, framework="megatron")
    with pytest.raises(NotApplicableError, match="GPTModel"):
        estimate(str(config), training, engine="generic", simulate_allocator=False)
