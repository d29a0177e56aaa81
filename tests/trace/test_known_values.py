"""Reads of the values trainmem chose for a synthetic batch (trainmem/trace/known_values.py,
Note [Known values of a synthetic batch]): each expected number is counted by hand from the
mask written in the test."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch._subclasses.fake_tensor import (  # noqa: E402
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from trainmem.trace.known_values import known, known_values, value_of  # noqa: E402

# 2 prompts of 5 tokens, the second padded after 3: 8 valid tokens
PROMPT_MASK = [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]


def mask() -> object:
    return known(lambda: torch.tensor(PROMPT_MASK, dtype=torch.bool))


def test_a_forward_reads_counts_and_lengths_from_a_known_mask() -> None:
    with FakeTensorMode():
        m = mask()
        with known_values():
            assert m.sum(dim=1).tolist() == [5, 3]
            assert int(m.sum()) == 8
            assert bool(m.all()) is False
            positions = torch.nonzero(m[1])
            assert tuple(positions.shape) == (3, 1)
            assert positions.view(-1).tolist() == [0, 1, 2]


def test_boolean_indexing_of_unknown_data_by_a_known_mask_has_the_true_count() -> None:
    with FakeTensorMode():
        m = mask()
        x = torch.randn(2, 5, 16)  # data nobody chose
        with known_values():
            assert tuple(x[m].shape) == (8, 16)  # 8 valid tokens
            assert tuple(x[~m].shape) == (2, 16)
            y = torch.zeros(2, 5, 16)
            y[m] = torch.randn(8, 16)  # index_put_ with a known boolean index
            counts = torch.repeat_interleave(torch.arange(2), m.sum(1))
            assert tuple(counts.shape) == (8,)


def test_values_built_from_factories_and_known_tensors_are_known() -> None:
    with FakeTensorMode():
        m = mask()
        with known_values():
            joint = torch.cat([torch.zeros(2, 3, dtype=torch.bool), m], dim=1)  # 2 x 8
            assert int((~joint).sum()) == 6 + 2  # 3 zeros per row + the 2 padded tokens
            keep = joint.new_ones(2, 8)
            keep[:, :3] = False  # an in-place write of a Python scalar
            assert int(keep.sum()) == 10


def test_a_value_nobody_chose_still_refuses() -> None:
    with FakeTensorMode():
        m = mask()  # the mode is active
        x = torch.randn(2, 5)
        with known_values():
            assert int(m.sum()) == 8
            with pytest.raises(DataDependentOutputException):
                int((x > 0).sum())
            with pytest.raises(DynamicOutputShapeException):
                torch.nonzero(x)
            with pytest.raises(DataDependentOutputException):
                int(torch.rand(2).sum())  # random: never known


def test_an_in_place_write_of_unknown_data_forgets_the_value() -> None:
    with FakeTensorMode():
        m = mask()
        x = torch.randn(2, 5)
        with known_values():
            view = m[0]
            assert value_of(view) is not None
            m.logical_and_(x > 0)  # the mask now depends on data nobody chose
            assert value_of(m) is None and value_of(view) is None
            with pytest.raises(DataDependentOutputException):
                int(m.sum())


def test_without_known_tensors_the_mode_is_not_pushed() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    import trainmem.trace.known_values as kv

    with FakeTensorMode():
        depth = len(_get_current_dispatch_mode_stack())
        if not len(kv._VALUES):
            with known_values():
                assert len(_get_current_dispatch_mode_stack()) == depth
        m = mask()
        with known_values():
            assert len(_get_current_dispatch_mode_stack()) == depth + 1
        del m


def test_a_large_known_tensor_keeps_values_through_ops_no_larger_than_it() -> None:
    """Idefics2's ``get_image_features`` drops all-zero padding images by comparing and summing
    the pixels: ``(pixels == 0).sum(dim=(-1, -2, -3)) != values per image``, then indexes the
    pixels with that mask. The batch's pixels (ones here: 3 images of 2^21 values, beyond
    MAX_KNOWN_ELEMENTS) keep their value through the comparison (same size), the sum (smaller)
    and the index (no larger); a result larger than every input with a value has none."""
    from trainmem.trace.known_values import MAX_KNOWN_ELEMENTS

    per_image = 2 * 1024 * 1024
    assert 3 * per_image > MAX_KNOWN_ELEMENTS
    with FakeTensorMode():
        pixels = known(lambda: torch.ones(3, 2, 1024, 1024))
        with known_values():
            real = (pixels == 0.0).sum(dim=(-1, -2, -3)) != per_image
            assert real.tolist() == [True, True, True]  # no image is padding
            assert tuple(pixels[real].shape) == (3, 2, 1024, 1024)
            assert int(real.sum()) == 3
            wide = pixels.view(-1)[: 2**21].unsqueeze(1).expand(-1, 4).contiguous()  # 2^23
            assert value_of(wide) is None
