"""Helpers of the shard-planner tests: an independent invariant checker and strategies."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

from hypothesis import strategies as st

from shard_planner import Plan, TensorSpec

FUZZ_EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))


def check_plan_independently(p: Plan, specs: Sequence[TensorSpec]) -> None:
    """Every invariant of the issue, by brute force over all boundaries (not via Plan.validate)."""
    m, s = p.world_size, p.shard_size
    assert p.numels == tuple(x.numel for x in specs)
    assert p.blocks == tuple(x.block for x in specs)
    assert p.names == tuple(x.name for x in specs)
    assert s >= 1 and s % p.align == 0
    assert m * s >= sum(x.numel for x in specs)
    assert p.padding == m * s - p.total_numel >= 0
    assert sorted(p.order) == list(range(len(specs)))
    intervals = sorted(
        (p.offsets[i], p.offsets[i] + x.numel, i) for i, x in enumerate(specs) if x.numel > 0
    )
    for (_, a1, _), (b0, _, _) in itertools.pairwise(intervals):
        assert a1 <= b0, "intervals overlap"
    for start, stop, i in intervals:
        assert start >= 0 and stop <= m * s
        for k in range(1, m):
            if start < k * s < stop:
                assert (k * s - start) % specs[i].block == 0, f"boundary {k * s} cuts tensor {i}"
    for i, x in enumerate(specs):
        assert 0 <= p.offsets[i] < m * s
        units = p.local_units(i)
        assert len(units) == m and all(u >= 0 for u in units)
        if x.numel == 0:
            assert sum(units) == 1
            continue
        assert sum(units) == x.numel // x.block
        owners = [k for k, u in enumerate(units) if u > 0]
        assert owners == list(range(owners[0], owners[-1] + 1)), "owners not contiguous"
    # rank_slices tile every tensor exactly once, in shard order, inside the shard.
    covered: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(specs))}
    for rank in range(m):
        last = 0
        for sl in p.rank_slices(rank):
            assert 0 <= sl.shard_start < sl.shard_stop <= s and sl.shard_start >= last
            last = sl.shard_stop
            assert sl.shard_stop - sl.shard_start == sl.tensor_stop - sl.tensor_start
            assert rank * s + sl.shard_start == p.offsets[sl.tensor_index] + sl.tensor_start
            covered[sl.tensor_index].append((sl.tensor_start, sl.tensor_stop))
            blk = specs[sl.tensor_index].block
            assert (sl.tensor_stop - sl.tensor_start) % blk == 0
            assert p.local_units(sl.tensor_index)[rank] == (sl.tensor_stop - sl.tensor_start) // blk
    for i, x in enumerate(specs):
        pieces = sorted(covered[i])
        pos = 0
        for a, b in pieces:
            assert a == pos
            pos = b
        assert pos == x.numel


@st.composite
def groups(
    draw: st.DrawFn,
    max_tensors: int = 10,
    max_blocks: int = 24,
    block_choices: Sequence[int] = (1, 2, 3, 4, 5, 6, 8, 12, 16, 32),
) -> tuple[list[TensorSpec], int, int]:
    """(specs, world_size, align) for small random groups, zero-size tensors included."""
    n = draw(st.integers(1, max_tensors))
    specs = []
    for i in range(n):
        block = draw(st.sampled_from(block_choices))
        count = draw(st.integers(0, max_blocks))
        specs.append(TensorSpec(block * count, block, f"t{i}"))
    world = draw(st.sampled_from([1, 2, 3, 4, 5, 7, 8, 16, 32, 64]))
    align = draw(st.sampled_from([1, 1, 2, 4, 8, 3]))
    return specs, world, align
