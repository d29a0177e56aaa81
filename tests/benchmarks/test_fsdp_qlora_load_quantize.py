"""benchmarks/fsdp_qlora_load_quantize.py: fsdp_qlora's ``load_and_quantize`` as the allocator
sees it (issue 24 item 6, session 24). Bytes by hand from bitsandbytes 0.43.0
``functional.quantize_4bit`` / ``quantize_blockwise`` and the allocator spec
(../shared/specs/cuda-caching-allocator.md sections 1-3)."""

from __future__ import annotations

import sys

from conftest import REPO_DIR

sys.path.insert(0, str(REPO_DIR / "benchmarks"))

from fsdp_qlora_load_quantize import layer_weights, quantize_ops, run_load  # noqa: E402

from trainmem.allocator.caching import CachingAllocatorSim  # noqa: E402
from trainmem.specs.quantization import bnb_4bit_statistics_bytes  # noqa: E402

MIB = 1024 * 1024
MLP = 8192 * 28672  # Llama-2-70B gate / up / down
ATTN = 8192 * 8192  # q / o
KV = 8192 * 1024  # k / v (8 key-value heads of 128)


def test_quantize_ops_follow_quantize_4bit() -> None:
    """A 70B MLP weight: bf16 2n, fp32 absmax 4n/64, packed n/2 in bf16 storage, the 16-entry
    code, the 0-d offset, then the double quantization's fp32 absmax (one per 256 blocks) and
    uint8 absmax (one per block); the fp32 absmax, the bf16 weight and the packed data freed."""
    ops = quantize_ops("w", MLP, first=False)
    allocs = [(key.split("/")[1], size) for action, key, size in ops if action == "a"]
    assert allocs == [
        ("bf16", 469_762_048),
        ("absmax", 14_680_064),
        ("packed", 117_440_512),
        ("code", 64),
        ("offset", 4),
        ("absmax2", 57_344),
        ("qabsmax", 3_670_016),
    ]
    assert [key for action, key, _ in ops if action == "f"] == ["w/absmax", "w/bf16", "w/packed"]
    # the kept pieces are trainmem's statistics plus the code and the offset
    assert 57_344 + 3_670_016 == bnb_4bit_statistics_bytes(MLP, "nf4-dq")
    first = quantize_ops("w", MLP, first=True)
    assert ("a", "dynamic-map", 1024) in first and len(first) == len(ops) + 1


def test_layer_weights_in_safetensors_order() -> None:
    """Sorted names: mlp.down / gate / up before self_attn.k / o / q / v; layer 10 after 1."""
    weights = layer_weights("llama-2-70b")
    assert len(weights) == 80 * 7
    assert weights[:7] == [
        ("0.mlp.down_proj", MLP),
        ("0.mlp.gate_proj", MLP),
        ("0.mlp.up_proj", MLP),
        ("0.self_attn.k_proj", KV),
        ("0.self_attn.o_proj", ATTN),
        ("0.self_attn.q_proj", ATTN),
        ("0.self_attn.v_proj", KV),
    ]
    assert [key for key, _ in weights[7::7][:3]] == [
        "1.mlp.down_proj",
        "10.mlp.down_proj",
        "11.mlp.down_proj",
    ]


def test_one_layer_serial_leaves_its_statistics_segments() -> None:
    """One Llama-2-70B layer, serial. By hand: down makes a 448 MiB segment (bf16), 14 MiB
    (absmax), 112 MiB (packed), a 2 MiB small one (code, offset, map, absmax2) and a 20 MiB one
    for the 3.5 MiB uint8 absmax (nothing free is large enough then); gate and up reuse them
    all, their absmaxes packed into the 20 MiB segment (10.5 MiB used); k's 16 MiB bf16 splits
    the 112 MiB block, o's and q's 128 MiB the 448 MiB one; o's 1 MiB uint8 absmax takes the
    first small segment's free 1.7 MiB, q's needs a second small segment. Peak 448 + 14 + 112
    + 20 + 2 + 2 = 598 MiB; after empty_cache the 20 MiB and the two 2 MiB segments stay."""
    sim = CachingAllocatorSim()
    load = run_load(sim, layer_weights("llama-2-70b")[:7], workers=1, seed=None)
    assert load.peak_reserved_bytes == 598 * MIB
    assert load.reserved_bytes == 24 * MIB
    sizes = sorted(sum(b.size for b in seg) for seg in sim.segments())
    assert sizes == [2 * MIB, 2 * MIB, 20 * MIB]
    # kept blocks: uint8 absmax 3 x n/64 (MLP) + 2 x n/64 (q, o) + 2 x n/64 (k, v); fp32
    # absmax of the absmax 4 n/64/256 each; 7 codes and 7 offsets of 512 B; the 1 KiB map
    qabsmax = 3 * 3_670_016 + 2 * 1_048_576 + 2 * 131_072
    absmax2 = 3 * 57_344 + 2 * 16_384 + 2 * 2_048
    assert load.kept_bytes == qabsmax + absmax2 + 14 * 512 + 1024
