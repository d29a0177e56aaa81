"""The token embedding's gradient under DTensor tensor parallelism without FSDP (Note
[Whole-vocabulary embedding gradient without FSDP], analytic/transforms/base.py; issue 26:
the generic path, which runs torch's DTensor for real, held 16 MiB more gradient than the
formulas on the agreement model at TP 2 + SP, +1.5 %).

Hand derivation on the agreement model (vocabulary V = 4096, hidden h = 2048, untied,
fp32 weights under bf16 autocast): torch 2.13 leaves the lookup's gradient ``Replicate``, so
each of the 2 tensor-parallel ranks keeps V h 4 = 33,554,432 B as the embedding's ``.grad``,
not its V / 2 slice (16,777,216 B); a tied weight's gradient is the sum in the head's
vocabulary shard, V h 4 / 2.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import MODELS_DIR
from trainmem.estimate import estimate
from trainmem.specs.training import TrainingConfig
from trainmem.timeline import MemoryCategory

AGREEMENT = MODELS_DIR / "agreement" / "llama_h2048.json"
V, H = 4096, 2048


def _allocs(model: str, module: str, category: MemoryCategory, **changes: object) -> list[int]:
    training = TrainingConfig(micro_batch_size=2, seq_len=256, **changes)  # type: ignore[arg-type]
    est = estimate(model, training, engine="analytic", simulate_allocator=False)
    return [
        ev.size_bytes
        for ev in est.schedules[0].expand().events
        if ev.action == "alloc" and ev.category == category and ev.module == module
    ]


TP = {"tensor_parallel_size": 2, "sequence_parallel": True}


def test_untied_lookup_keeps_the_whole_vocabulary_gradient() -> None:
    grads = _allocs(str(AGREEMENT), "embedding", MemoryCategory.GRADIENT, **TP)
    assert set(grads) == {V * H * 4}
    # no separate whole-vocabulary transient beside it
    assert V * H * 4 not in _allocs(str(AGREEMENT), "embedding", MemoryCategory.TEMPORARY, **TP)


def test_tied_lookup_keeps_the_head_shard(tmp_path: Path) -> None:
    config = json.loads(AGREEMENT.read_text()) | {"tie_word_embeddings": True}
    tied = tmp_path / "tied.json"
    tied.write_text(json.dumps(config))
    head = _allocs(str(tied), "head", MemoryCategory.GRADIENT, **TP)  # the final norm's too
    assert max(head) == V * H * 4 // 2
    # the lookup's whole-vocabulary gradient is a transient, summed into the head's shard
    assert V * H * 4 in _allocs(str(tied), "embedding", MemoryCategory.TEMPORARY, **TP)


def test_fsdp2_reduce_scatters_it() -> None:
    # FSDP2 over 2 ranks beside TP 2: the partial gradient is reduce-scattered to
    # V / 2 / 2 rows, V h 4 / 4 bytes
    sizes = _allocs(
        str(AGREEMENT),
        "embedding",
        MemoryCategory.GRADIENT,
        tensor_parallel_size=2,
        data_parallel_size=2,
        zero_stage=3,
        framework="fsdp2",
    )
    assert set(sizes) == {V * H * 4 // 4}
