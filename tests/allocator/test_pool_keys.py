"""Note [Pool keys]: a free block's ``(stream, size, ptr)`` as one int orders as the tuple does.

The order is the allocator's ``BlockComparatorSize`` (spec section 2.3: stream, then size, then
address), which Python's tuple comparison states directly; the keys must sort the same way for
any stream (negative ones too) and any size and address below 2**64, and a best-fit search must
never leave its stream.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from trainmem.allocator.caching import CachingAllocatorSim, key_fields, pool_key

MiB = 1_048_576

triples = st.tuples(
    st.integers(-(2**70), 2**70),  # stream: any int (a CUDA stream handle is a pointer)
    st.integers(0, 2**64 - 1),  # size
    st.integers(0, 2**64 - 1),  # address
)


@given(st.lists(triples, max_size=40))
def test_keys_sort_as_the_tuples_do(blocks: list[tuple[int, int, int]]) -> None:
    assert sorted(blocks, key=lambda t: pool_key(*t)) == sorted(blocks)


@given(triples)
def test_key_fields_undo_pool_key(block: tuple[int, int, int]) -> None:
    assert key_fields(pool_key(*block)) == block


@pytest.mark.parametrize("other_stream", [-1, 1, 2**64])
def test_best_fit_never_takes_another_streams_block(other_stream: int) -> None:
    """A 32 MiB request on stream 0 with a cached 40 MiB block on ``other_stream`` and a cached
    30 MiB one on stream 0: neither serves it (the 30 MiB is too small, the 40 MiB belongs to
    another stream), so a new 32 MiB segment is made (requests of 10 MiB or more get their own
    segment rounded up to 2 MiB, spec 1.4)."""
    sim = CachingAllocatorSim()
    sim.free(sim.malloc(30 * MiB, stream=0))
    sim.free(sim.malloc(40 * MiB, stream=other_stream))
    assert sim.memory_reserved == 70 * MiB
    handle = sim.malloc(32 * MiB, stream=0)
    assert sim.memory_reserved == 102 * MiB
    assert sim.block_size_of(handle) == 32 * MiB
    sim.check_invariants()
    # and a request that the other stream's block would fit exactly is not served by it either
    sim.malloc(40 * MiB, stream=0)
    assert sim.memory_reserved == 142 * MiB
    sim.check_invariants()


def test_segments_stay_in_a_64_bit_address_space() -> None:
    top = 2**64
    sim = CachingAllocatorSim()
    sim.adopt_segment(top - 2 * MiB, 2 * MiB, small=True)  # ends exactly at 2**64
    with pytest.raises(ValueError, match="64-bit"):
        sim.adopt_segment(top, 2 * MiB, small=True)
    sim.address_hint = lambda size: top - MiB  # a hint that would cross 2**64 is not taken
    handle = sim.malloc(20 * MiB)
    assert handle + 20 * MiB <= top - 2 * MiB
    sim.check_invariants()
