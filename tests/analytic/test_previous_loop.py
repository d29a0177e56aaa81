"""The ``previous`` loop (Note [The previous micro-batch's graph]): litgpt's ``fit`` binds
``logits = model(...)`` in its loop, so the previous micro-batch's output, and through its
``grad_fn`` its graph, live until the next forward returns; after its backward that graph
keeps only what custom autograd functions store as ``ctx`` attributes: bitsandbytes
``MatMul4Bit``'s 16-bit input before 0.43.2 (``ctx.tensors = (A, B)``, 0.42.0
autograd/_functions.py), ``MatMul8bitLt``'s input A always and its int8 copy CAt when a
gradient is needed.

Expected bytes by hand from the shapes (no code output pasted back):

* the 2-layer Qwen2 formula config (h 64, intermediate 128, 4 heads of 16, 2 key/value heads,
  V 512): one layer's distinct quantized-linear inputs are the attention's (64 values per
  token, read by q, k and v), o's (4 x 16 = 64), the MLP's (64, read by gate and up) and
  down's (128): 320 per token; in layer 0 the attention's input is the normed frozen
  embedding, which needs no gradient (64); lit-gpt quantizes the LM head too, whose input is
  the final norm's output (64). So 2 x 320 - 64 + 64 = 640 values, 2 bytes each in bf16-true,
  over b x s = 2 x 64 = 128 tokens: 163,840 bytes. Fabric's fp32 output: 4 x 512 x 128 =
  262,144 bytes.
* Falcon-7B (h 4544, 71 heads of 64, intermediate 18176, one shared norm for attention and
  MLP): per layer 4544 (attention and MLP input, one tensor) + 4544 (o) + 18176 (down) =
  27,264; in layer 0 the shared input and, without MLP adapters, down's input need none:
  4544 + 18176 = 22,720; 32 x 27,264 - 22,720 + 4544 (head) = 854,272 values, x 2 bytes x 512
  tokens = 874,774,528 bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import MODELS_DIR
from trainmem.analytic.held_outputs import graph_held_input_bytes, previous_output_bytes
from trainmem.analytic.transforms.base import Lifetime, PipelineRank, RankContext, Where
from trainmem.analytic.transforms.loop import TrainingLoop
from trainmem.errors import SpecError
from trainmem.estimate import estimate
from trainmem.specs.assumptions import loop_of
from trainmem.specs.hf import load_model_spec
from trainmem.specs.training import TrainingConfig

QWEN2 = str(MODELS_DIR / "formula" / "qwen2.json")
QLORA = {
    "micro_batch_size": 2,
    "seq_len": 64,
    "precision": "bf16-true",
    "lora_rank": 8,
    "lora_targets": ("q", "v"),
    "quantize_base": "nf4",
    "bitsandbytes_version": "0.42.0",
    "framework": "litgpt",
}
GRAPH = 163_840
OUTPUT = 262_144


def _training(**fields: object) -> TrainingConfig:
    return TrainingConfig(**{**QLORA, **fields})  # type: ignore[arg-type]


def test_the_loop_each_framework_assumes() -> None:
    assert _training().training_loop == "previous"  # litgpt's fit
    assert _training(framework="hf-trainer").training_loop == "drop"
    assert TrainingConfig().training_loop == "drop"
    assert TrainingConfig(keep_logits=True).training_loop == "step"
    assert _training(loop="drop").training_loop == "drop"  # an explicit value wins
    assert TrainingConfig(loop="previous").training_loop == "previous"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"keep_logits": True, "loop": "previous"}, "loop"),
        ({"loop": "step", "gradient_accumulation_steps": 2}, "loop"),
        ({"loop": "previous", "pipeline_parallel_size": 2, "gradient_accumulation_steps": 2},
         "loop"),
    ],
)  # fmt: skip
def test_loop_settings_that_contradict_are_refused(fields: dict, field: str) -> None:
    with pytest.raises(SpecError) as err:
        TrainingConfig(**fields)
    assert err.value.field == field


def test_qwen2_previous_graph_and_output_bytes_by_hand() -> None:
    model = load_model_spec(QWEN2)
    training = _training()
    assert graph_held_input_bytes(model, training, num_layers=2, has_head=True) == GRAPH
    assert previous_output_bytes(model, training) == OUTPUT
    # bitsandbytes 0.43.2 keeps (None, B): nothing of the input outlives the backward
    fixed = _training(bitsandbytes_version="0.43.2")
    assert graph_held_input_bytes(model, fixed, num_layers=2, has_head=True) == 0
    assert previous_output_bytes(model, fixed) == OUTPUT
    # the HF Trainer drops its outputs after the loss
    hf = _training(framework="hf-trainer")
    assert graph_held_input_bytes(model, hf, num_layers=2, has_head=True) == 0
    assert previous_output_bytes(model, hf) == 0
    # a plain loop told to hold them: peft's head is not quantized (640 - 64 values) and the
    # transformers output is the 16-bit lm_head output (2 x 512 x 128)
    plain = _training(framework="hf-trainer", loop="previous")
    assert graph_held_input_bytes(model, plain, num_layers=2, has_head=True) == 576 * 2 * 128
    assert previous_output_bytes(model, plain) == 2 * 512 * 128


def test_int8_keeps_its_input_and_its_int8_copy() -> None:
    # MatMul8bitLt before bitsandbytes 0.45.0: A always (2 bytes), CAt (1 byte) where a
    # gradient is needed: 576 + 64 graded values x 3 bytes, the 64 of layer 0's attention input
    # x 2 bytes (0.44.1 autograd/_functions.py: ``F.double_quant``, ``[None, None, A]``)
    model = load_model_spec(QWEN2)
    training = _training(quantize_base="int8", precision="16-true", bitsandbytes_version="0.44.1")
    held = graph_held_input_bytes(model, training, num_layers=2, has_head=True)
    assert held == (640 * 3 + 64 * 2) * 128
    # from 0.45.0 a frozen weight makes no CAt, and a node needing no gradient keeps nothing
    # (0.45.0: ``CAt = SCAt = None`` unless the weight needs one; ``[None, None, None]``)
    current = _training(quantize_base="int8", precision="16-true", bitsandbytes_version="0.45.0")
    assert graph_held_input_bytes(model, current, num_layers=2, has_head=True) == 640 * 2 * 128


def test_falcon_parallel_block_bytes_by_hand() -> None:
    model = load_model_spec("falcon-7b")
    training = _training(micro_batch_size=1, seq_len=512)
    held = graph_held_input_bytes(model, training, num_layers=32, has_head=True)
    assert held == 874_774_528


def _context(training: TrainingConfig) -> RankContext:
    model = load_model_spec(QWEN2)
    return RankContext(
        model=model,
        training=training,
        rank=PipelineRank(0, 2, 1, True, True),
        emb_states=[],
        head_states=[],
        layer_states=[],
        head_grad_states=[],
        emb_grad_states=[],
        num_layers=2,
        zero_stage=0,
        grad_stream=0,
    )


def test_the_previous_micro_batch_is_held_until_the_next_forward_returns() -> None:
    ops = TrainingLoop(_context(_training())).ops("micro_batch.begin", Where())
    held = {item.op.key: (item.op.size_bytes, item.release) for item in ops
            if isinstance(item, Lifetime)}  # fmt: skip
    assert held == {
        "previous/graph": (GRAPH, "head.post_forward"),
        "previous/logits": (OUTPUT, "head.post_forward"),
    }
    assert not TrainingLoop(_context(_training(loop="drop"))).ops("micro_batch.begin", Where())


def test_the_previous_micro_batch_raises_the_forward_only(tmp_path: Path) -> None:
    # the Qwen2 config widened (h 256, intermediate 1024, V 128) so that the held inputs, not
    # the loss on the logits, decide the forward's peak: 2 x (256 + 256 + 256 + 1024) - 256 +
    # 256 (head) = 3584 values x 2 bytes per token; the output 4 x 128 per token
    config = json.loads(Path(QWEN2).read_text())
    config.update(hidden_size=256, intermediate_size=1024, vocab_size=128)
    wide = tmp_path / "config.json"
    wide.write_text(json.dumps(config))
    tokens = 2 * 64
    graph, output = 3584 * 2 * tokens, 4 * 128 * tokens

    def phases(**fields: object) -> dict[str, int]:
        training = _training(**fields)
        est = estimate(str(wide), training, engine="analytic", simulate_allocator=False)
        return dict(est.details["phase_peaks_bytes"])  # type: ignore[arg-type]

    held, dropped = phases(), phases(loop="drop")
    assert 0 < held["forward"] - dropped["forward"] <= graph + output
    for phase in ("backward", "optimizer"):  # freed before the backward starts
        assert held[phase] == dropped[phase]


def test_the_assumed_loop_is_reported() -> None:
    assert "previous micro-batch" in loop_of({"framework": "litgpt"})
    assert "dropped after the loss" in loop_of({"framework": "litgpt", "loop": "drop"})
    assert "held to the end of the step" in loop_of({"keep_logits": True})


def test_the_current_output_and_its_cache_live_to_the_micro_batch_end() -> None:
    # Note [The current micro-batch's bound output], bytes by hand in test_bound_output.py:
    # the HF Trainer's accelerate fp32 logits 4 x 512 x 128 and the KV cache 2 layers x (k, v)
    # x 2 heads x 16 x 128 tokens x 2 B, through the backward, the last through the step
    logits, cache = 4 * 512 * 128, 2 * 2 * 2 * 16 * 128 * 2
    hf = {"framework": "hf-trainer", "precision": "bf16-mixed", "lora_rank": 0,
          "quantize_base": "none", "gradient_accumulation_steps": 2}  # fmt: skip
    loop = TrainingLoop(_context(_training(loop="previous", **hf)))
    held = {x.op.key: (x.op.size_bytes, x.release) for x in loop.ops("head.forward", Where())
            if isinstance(x, Lifetime)}  # fmt: skip
    assert held == {
        "logits_kept": (logits, "micro_batch.end"),
        "loop/cache": (cache, "micro_batch.end"),
    }
    bound = [x for x in loop.ops("optimizer.begin", Where()) if isinstance(x, Lifetime)]
    assert [(x.op.size_bytes, x.release) for x in bound] == [
        (logits + cache, "step.post_optimizer")
    ]
    dropped = TrainingLoop(_context(_training(loop="drop", **hf)))
    assert not dropped.ops("optimizer.begin", Where())
    assert not dropped.ops("head.forward", Where())
