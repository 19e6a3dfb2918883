"""The layout protocol, the naive contiguous layout and the per-tensor geometry (no PG)."""

from __future__ import annotations

import itertools
import math
import os

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dbuffer import BufferLayout, ContiguousLayout, contiguous_layout
from dbuffer._private.layout import slots_for

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))


@st.composite
def _groups(draw: st.DrawFn) -> tuple[list[int], list[int], int, int]:
    count = draw(st.integers(1, 8))
    blocks = [draw(st.integers(1, 12)) for _ in range(count)]
    numels = [b * draw(st.integers(0, 20)) for b in blocks]
    world = draw(st.integers(1, 6))
    align = draw(st.sampled_from([1, 2, 4]))
    return numels, blocks, world, align


@settings(max_examples=EXAMPLES, deadline=None)
@given(_groups())
def test_property_contiguous_layout_never_cuts_a_block(
    group: tuple[list[int], list[int], int, int],
) -> None:
    numels, blocks, world, align = group
    layout = contiguous_layout(numels, world, blocks=blocks, align=align)
    size = layout.shard_size
    assert size % align == 0
    assert size * world >= sum(numels)
    spans = sorted(zip(layout.offsets, numels, strict=True))
    for (start_a, n_a), (start_b, _) in itertools.pairwise(spans):
        assert start_a + n_a <= start_b
    for i, (start, numel, block) in enumerate(zip(layout.offsets, numels, blocks, strict=True)):
        assert start % align == 0
        assert start + numel <= size * world
        for boundary in range(size, size * world, size):
            if start < boundary < start + numel:
                assert (boundary - start) % block == 0, (i, boundary)
        units = layout.local_units(i)
        assert len(units) == world
        assert sum(units) * block == numel or (numel == 0 and sum(units) == 1)
    # The geometry derived for every rank tiles each tensor exactly once.
    shapes = [(n,) for n in numels]
    names = [f"t{i}" for i in range(len(numels))]
    covered = [0] * len(numels)
    for rank in range(world):
        for slot in slots_for(layout, shapes, names, rank):
            assert 0 <= slot.local_start <= slot.local_stop <= size
            assert slot.offset + slot.tensor_start == rank * size + slot.local_start or (
                slot.local_numel == 0
            )
            covered[slot.index] += slot.local_numel
    assert covered == numels


def test_contiguous_layout_moves_a_tensor_to_the_boundary_rather_than_cut_a_block() -> None:
    # 2 ranks, tensors of 6 (block 1) and 8 (block 4): S starts at 7 and the second tensor would
    # start at 6 and be cut at 7 (1 element in), so it must move.
    layout = contiguous_layout([6, 8], 2, blocks=[1, 4])
    for boundary in range(layout.shard_size, 2 * layout.shard_size, layout.shard_size):
        start = layout.offsets[1]
        if start < boundary < start + 8:
            assert (boundary - start) % 4 == 0
    assert layout.local_units(1) in {(2, 0), (0, 2), (1, 1)}


def test_contiguous_layout_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="block 4 must be > 0 and divide numel 6"):
        contiguous_layout([6], 2, blocks=[4])
    with pytest.raises(ValueError, match="numel must be >= 0"):
        contiguous_layout([-1], 2)
    with pytest.raises(ValueError, match="world_size"):
        contiguous_layout([4], 0)


def test_fingerprint_is_stable_and_distinguishes_layouts() -> None:
    a = contiguous_layout([10, 6], 2)
    assert a.fingerprint == contiguous_layout([10, 6], 2).fingerprint
    assert a.fingerprint != contiguous_layout([10, 6], 2, align=4).fingerprint
    assert a.fingerprint != contiguous_layout([6, 10], 2).fingerprint


@attrs.frozen
class _PlanLike:
    """A stand-in with the planner's documented names (frozen, extra attributes)."""

    shard_size: int
    world_size: int
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    blocks: tuple[int, ...]
    fingerprint: str

    def local_units(self, i: int) -> tuple[int, ...]:
        return ContiguousLayout(
            self.shard_size, self.world_size, self.offsets, self.numels, self.blocks
        ).local_units(i)


def test_protocol_is_structural() -> None:
    plan = _PlanLike(8, 2, (0, 10), (10, 6), (2, 3), "plan:abc")
    assert isinstance(plan, BufferLayout)
    assert isinstance(contiguous_layout([3], 1), BufferLayout)
    assert not isinstance(object(), BufferLayout)
    slots = slots_for(plan, [(5, 2), (2, 3)], ["w", "b"], 1)
    # w = [0, 10) with rows of 2: rank 1 holds [8, 10) = its last row; b = [10, 16) all on rank 1.
    assert (slots[0].local_start, slots[0].local_stop, slots[0].tensor_start) == (0, 2, 8)
    assert slots[0].placement.local_units == (4, 1)
    assert (slots[1].local_start, slots[1].local_stop) == (2, 8)


def test_slots_choose_the_coarsest_prefix_dims() -> None:
    layout = contiguous_layout([24 * 16, 3 * 2 * 4, 35], 2, blocks=[16, 8, 7])
    slots = slots_for(layout, [(24, 16), (3, 2, 4), (5, 7)], ["a", "b", "c"], 0)
    for slot in slots:
        units = slot.placement.local_units
        assert math.prod(slot.shape[: len(slot.placement.dims)]) % sum(units) == 0
        assert slot.placement.unit_numel(slot.shape) * sum(units) == slot.numel
    assert slots[0].placement.dims == (0,)


def test_slots_name_the_offending_tensor() -> None:
    layout = contiguous_layout([12, 5], 2, blocks=[3, 1])
    with pytest.raises(ValueError, match=r"tensor 'bias' \(index 1\): shape \(6,\) has 6 "):
        slots_for(layout, [(4, 3), (6,)], ["w", "bias"], 0)
    bad = _PlanLike(8, 2, (0, 12), (10, 6), (2, 3), "x")
    with pytest.raises(ValueError, match="lies outside the flat buffer"):
        slots_for(bad, [(10,), (6,)], ["w", "b"], 0)
    overlapping = _PlanLike(10, 2, (0, 4), (10, 6), (1, 1), "x")
    with pytest.raises(ValueError, match="overlaps tensors 'w' and 'b'"):
        slots_for(overlapping, [(10,), (6,)], ["w", "b"], 0)

    @attrs.frozen
    class WrongUnits(_PlanLike):
        def local_units(self, i: int) -> tuple[int, ...]:
            return (1, 1)

    with pytest.raises(ValueError, match=r"tensor 'w' \(index 0\): rank 0 holds 8"):
        slots_for(WrongUnits(8, 2, (0, 10), (10, 6), (2, 3), "x"), [(10,), (6,)], ["w", "b"], 0)
    with pytest.raises(ValueError, match="outside the layout's world_size"):
        slots_for(layout, [(4, 3), (5,)], ["w", "b"], 2)
