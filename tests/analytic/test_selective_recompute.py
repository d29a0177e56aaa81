"""Op-level selective checkpointing's recompute as the tensors it is (Note [Op-level selective
recompute per tensor], analytic/transforms/checkpointing.py; issue 26).

The agreement model (tests/models/agreement/llama_h2048.json: h = 2048, i = 5632, 16 heads of
128, 4 KV heads) at 2 x 256 tokens (t = 512), bf16-mixed (fp32 residual stream), SDPA.
"""

from __future__ import annotations

from typing import Any

from conftest import MODELS_DIR
from trainmem.estimate import estimate
from trainmem.schedule import Item, Op, Repeat
from trainmem.specs.training import TrainingConfig

AGREEMENT = str(MODELS_DIR / "agreement" / "llama_h2048.json")
T, H, INTER, HEADS = 512, 2048, 5632, 16


def _layer_backward(**changes: Any) -> list[Op]:
    training = TrainingConfig(micro_batch_size=2, seq_len=256, optimizer="sgd", **changes)
    est = estimate(AGREEMENT, training, engine="analytic", simulate_allocator=False)
    bodies: list[tuple[Item, ...]] = []

    def walk(items: tuple[Item, ...]) -> None:
        for x in items:
            if isinstance(x, Repeat):
                if x.reverse or x.count == 1:
                    bodies.append(x.body)
                walk(x.body)

    walk(est.schedules[0].step)
    layer = [b for b in bodies if any(isinstance(op, Op) and op.key == "mlp_tmp" for op in b)]
    return [op for op in layer[0] if isinstance(op, Op)]


def _made(ops: list[Op], prefix: str) -> int:
    return sum(op.size_bytes for op in ops if op.action == "alloc" and op.key.startswith(prefix))


def test_selective_recomputes_the_full_recompute_less_the_cached_terms() -> None:
    selective = _layer_backward(activation_checkpointing="selective")
    full = _layer_backward(activation_checkpointing="full")
    # the policy's cached outputs that are layer terms: the SDPA output (bf16, 2 h t), its
    # logsumexp (fp32, 4 heads t), the gate projection's output (bf16, 2 i t) and v's output
    # (bf16, 2 x 512 t: SDPA's saved value, flash taking v at its 4 heads; Note [The cached q
    # and v outputs in the recompute]); the layer input both keep
    cached = 2 * H * T + 4 * HEADS * T + 2 * INTER * T + 2 * 512 * T
    assert cached == 8_421_376
    assert _made(full, "re/") - _made(selective, "re/") == cached
    # autocast's weight copies made again once (not also inside the recompute): 2 B x (q, o:
    # h x h; k, v: h x 512; gate, up, down: h x i) = 90,177,536 B
    copies = 2 * (2 * H * H + 2 * H * 512 + 3 * H * INTER)
    assert _made(selective, "wcopy/re/") == _made(full, "wcopy/re/") == copies == 90_177_536


def test_recomputed_mlp_tensors_are_freed_before_the_attention_gradients() -> None:
    ops = _layer_backward(activation_checkpointing="selective")
    o_grad = next(
        n for n, op in enumerate(ops) if op.key.startswith("grad/") and op.key.endswith("/3")
    )
    # the MLP's recomputed i-sized tensors (multiples of 2 i t = 5,767,168 B): act(gate) and
    # up's output (the gate's output is cached) and down's input, 3 x 2 i t in all
    mlp = [
        n
        for n, op in enumerate(ops)
        if op.key.startswith("re/") and op.size_bytes % (2 * INTER * T) == 0
    ]
    assert sum(ops[n].size_bytes for n in mlp if ops[n].action == "alloc") == 3 * 2 * INTER * T
    # each freed where its consumer's backward ran, before o's gradient (not at the layer's end)
    frees = [n for n in mlp if ops[n].action == "free"]
    assert len(frees) == len(mlp) // 2 and max(frees) < o_grad
