"""The comparison methods of ``plan`` (the veScale heuristic as we read it, model order) and
the trivial plan that caps the ``auto`` search.

The two methods are kept to measure what the ``auto`` search (``search``) adds: ``paper``
bisects over multiples of each block-prefix LCM (assuming a feasibility that is monotone in the
shard size, which it is not), ``model-order`` scans every admissible size with the tensors in
model order only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from shard_planner._private.bounds import ShardSizes, trivial_shard_size
from shard_planner._private.greedy import greedy_ends
from shard_planner._private.orders import make_plan, place_in_order, static_orders
from shard_planner._private.plan import Plan
from shard_planner._private.spec import TensorSpec

__all__ = ["model_order_plan", "paper_plan", "trivial_plan"]

_MAX_BATCH = 4096


def paper_plan(specs: Sequence[TensorSpec], world_size: int, align: int) -> Plan:
    """Our reading of the veScale heuristic (REFERENCE.md §3), kept as a baseline.

    Orders: model order, blocks descending, sizes descending. For every prefix of the distinct
    block sizes sorted descending, ``L = lcm(align, prefix)``; bisect over multiples of ``L`` for
    the smallest S where the greedy fits (bisection assumes feasibility monotone in S, which it is
    not, so this can miss smaller sizes). The best (S, order) over all is returned.
    """
    numels = [s.numel for s in specs]
    blocks = [s.block for s in specs]
    nonempty = [i for i, e in enumerate(numels) if e > 0]
    m = world_size
    total = sum(numels)
    if not nonempty or m == 1:
        from shard_planner._private.search import auto_plan  # the fallback; no import cycle

        return auto_plan(specs, world_size, align)
    orders = static_orders(numels, blocks, nonempty)[:3]
    distinct = sorted({blocks[i] for i in nonempty}, reverse=True)
    steps = [math.lcm(align, *distinct[:j]) for j in range(len(distinct) + 1)]
    best: tuple[int, tuple[int, ...]] | None = None
    for step in dict.fromkeys(steps):
        floor_units = -(-max(-(-total // m), *distinct) // step)
        hi_units = -(-max(total, *distinct) // step)  # everything in shard 0: feasible
        for order in orders:
            lo, hi = floor_units, hi_units
            while lo < hi:
                mid = (lo + hi) // 2
                if place_in_order(numels, blocks, order, mid * step, m) is None:
                    lo = mid + 1
                else:
                    hi = mid
            shard = lo * step
            if best is None or shard < best[0]:
                best = (shard, order)
    assert best is not None
    placed = place_in_order(numels, blocks, best[1], best[0], m)
    assert placed is not None
    return make_plan(specs, m, align, shard=best[0], offsets=placed, method="paper")


def model_order_plan(specs: Sequence[TensorSpec], world_size: int, align: int) -> Plan:
    """Model order only, exhaustive scan over admissible S: isolates the value of reordering."""
    numels = [s.numel for s in specs]
    blocks = [s.block for s in specs]
    order = [i for i, e in enumerate(numels) if e > 0]
    sizes = ShardSizes(numels, blocks, world_size, align)
    mode = sizes.mode
    e = mode.array([[numels[i] for i in order]])
    g = mode.array([[blocks[i] for i in order]])
    batch = 16
    while (chunk := sizes.take(batch)).size:
        fits = np.flatnonzero(greedy_ends(e, g, chunk, mode.infeasible)[0] <= chunk * world_size)
        if fits.size:
            shard = int(chunk[int(fits[0])])
            placed = place_in_order(numels, blocks, order, shard, world_size)
            assert placed is not None
            return make_plan(
                specs, world_size, align, shard=shard, offsets=placed, method="model-order"
            )
        batch = min(batch * 4, _MAX_BATCH)
    raise AssertionError("unreachable: the trivial shard size always fits")  # pragma: no cover


def trivial_plan(specs: Sequence[TensorSpec], world_size: int, align: int) -> Plan:
    """Everything in shard 0 in model order: always valid; caps the search (``bounds`` Note on
    exact integers: no larger shard size is ever tried)."""
    numels = [s.numel for s in specs]
    offsets = dict(zip(range(len(specs)), itertools.accumulate([0, *numels[:-1]]), strict=True))
    shard = trivial_shard_size(numels, align)
    return make_plan(specs, world_size, align, shard=shard, offsets=offsets, method="auto")
