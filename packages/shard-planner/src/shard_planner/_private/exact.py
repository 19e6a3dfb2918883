"""The exact solver for small groups: every distinct order, every admissible shard size.

[Note: why this is exact]
Any feasible layout lists its non-empty tensors in some order by offset; for that order the
earliest-start greedy fits whenever the layout does (``greedy`` Note). So the optimum is the
smallest admissible S (``bounds`` Note: no feasible S is skipped) for which some order's greedy
fits. We scan S upwards and check all distinct orders at once (one vectorised lane per order);
tensors of equal (numel, block) are interchangeable, so only distinct permutations are tried.
The scan ends: ``S >= total`` always fits (everything in shard 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from shard_planner._private.bounds import ShardSizes, int_mode
from shard_planner._private.greedy import greedy_ends
from shard_planner._private.multiset import Kinds
from shard_planner._private.orders import make_plan, place_in_order
from shard_planner._private.plan import Plan
from shard_planner._private.spec import TensorSpec, check_inputs

__all__ = ["MAX_EXACT_TENSORS", "exact_plan"]

MAX_EXACT_TENSORS = 8


def exact_plan(specs: Sequence[TensorSpec], world_size: int, align: int = 1) -> Plan:
    """The optimal plan (smallest shard size) of a group of at most 8 non-empty tensors."""
    specs = list(specs)
    world_size, align = check_inputs(specs, world_size, align)
    numels = [s.numel for s in specs]
    blocks = [s.block for s in specs]
    nonempty = [i for i, e in enumerate(numels) if e > 0]
    if len(nonempty) > MAX_EXACT_TENSORS:
        raise ValueError(
            f"specs: the exact solver takes at most {MAX_EXACT_TENSORS} non-empty "
            f"tensors ({math.factorial(MAX_EXACT_TENSORS)} orders), got "
            f"{len(nonempty)}"
        )
    m = world_size
    if not nonempty:
        return make_plan(specs, m, align, shard=align, offsets={}, method="exact", optimal=True)
    # Brute force on purpose (every distinct order a lane, ``multiset_orders``): an independent
    # reference for the planner's dynamic programme over multisets.
    orders = list(Kinds(numels, blocks, nonempty).orders())
    mode = int_mode(numels, blocks, m, align)
    e_arr = mode.array([[numels[i] for i in o] for o in orders])
    g_arr = mode.array([[blocks[i] for i in o] for o in orders])
    # Finite: the last candidate is the trivial size, where everything fits in shard 0.
    candidates = ShardSizes(numels, blocks, m, align)
    batch = 8
    while (sizes := candidates.take(batch)).size:
        chunk = [int(c) for c in sizes]
        ok = greedy_ends(e_arr, g_arr, sizes, mode.infeasible) <= sizes[None, :] * m
        hits = np.flatnonzero(ok.any(axis=0))
        if hits.size:
            j = int(hits[0])
            order = orders[int(np.flatnonzero(ok[:, j])[0])]
            placed = place_in_order(numels, blocks, order, chunk[j], m)
            assert placed is not None
            return make_plan(
                specs, m, align, shard=chunk[j], offsets=placed, method="exact", optimal=True
            )
        batch = min(batch * 2, max(8, 65536 // len(orders)))
    raise AssertionError("unreachable: the trivial shard size always fits")  # pragma: no cover
