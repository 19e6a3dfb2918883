"""Pure geometry: flat ranges, boxes, validation (no process group)."""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ragged_dtensor import FlatRange, RaggedShard, flat_range_to_boxes

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "200"))


def test_reference_example_from_the_spec() -> None:
    p = RaggedShard((0,), (0, 1, 5, 2))
    shape = (32, 128)
    assert p.unit_numel(shape) == 4 * 128
    assert p.flat_range(shape, 0).numel == 0
    assert p.local_box(shape, 1) == ((4, 128), (0, 0))
    assert p.local_box(shape, 2) == ((20, 128), (4, 0))
    assert p.local_box(shape, 3) == ((8, 128), (24, 0))


def test_placement_value_semantics() -> None:
    a = RaggedShard([0], [1, 2])
    b = RaggedShard((0,), (1, 2))
    assert a == b and hash(a) == hash(b)
    assert a != RaggedShard((0,), (2, 1))
    assert not a.is_shard() and not a.is_replicate() and not a.is_partial()
    assert repr(a) == "RaggedShard(dims=(0,), local_units=(1, 2))"
    code, scope = a.__fx_repr__()
    assert eval(code, scope) == a


@pytest.mark.parametrize(
    ("dims", "units", "message"),
    [
        ((1,), (1, 1), "must be a prefix"),
        ((0, 2), (1, 1), "must be a prefix"),
        ((0,), (1, -1), ">= 0"),
        ((0,), (0, 0), "sum to 0"),
        ((), (1, 1), "one-hot"),
        ((0,), (), "one entry per rank"),
    ],
)
def test_bad_placements_raise(dims: tuple[int, ...], units: tuple[int, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RaggedShard(dims, units)


def test_units_must_divide_prefix_rows() -> None:
    with pytest.raises(ValueError, match="does not divide the 6 prefix rows"):
        RaggedShard((0,), (2, 2)).validate((6, 4))
    with pytest.raises(ValueError, match="exceed"):
        RaggedShard((0, 1, 2), (1, 1)).validate((4, 4))


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    data=st.data(),
)
def test_property_boxes_tile_a_flat_range(shape: list[int], data: st.DataObject) -> None:
    numel = math.prod(shape)
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    boxes = flat_range_to_boxes(shape, FlatRange(start, stop))
    assert len(boxes) <= 2 * len(shape) - 1
    full = torch.arange(numel).reshape(shape)
    pos = start
    for offset, size, sub in boxes:
        assert sub.start == pos
        pos = sub.stop
        index = tuple(slice(o, o + s) for o, s in zip(offset, size, strict=True))
        assert torch.equal(full[index].reshape(-1), torch.arange(sub.start, sub.stop))
    assert pos == stop
