"""The planner: choose a shard size and an order so that the greedy placement fits.

[Note: the search ("auto")]
0. Upper bound: the naive baseline's plan (valid by construction). Nothing worse is returned.
1. Structured sizes (``_ladder``): the smallest admissible multiples of the LCMs of the blocks
   (prefixes largest first, each block, their GCD), checked with the static orders and, failing
   those, with local search and gap filling. Many crossings align at once at such sizes, so a
   good plan is found early and bounds the scan.
2. Scan: every admissible size below that (``bounds.admissible_shard_sizes``, from the lower
   bound upwards) in growing batches, each batch checked for all static orders at once with the
   vectorised greedy (``greedy.greedy_ends``); after each batch, gap filling and local search on
   the smallest failures. The scan never skips an admissible S (feasibility is not monotone in
   S), so for the orders tried it finds the smallest S.
3. If the scan's budget runs out first (tiny worlds, big blocks, many small steps), the search
   jumps: the next S tried is the one that would have made the best failing order fit.
Groups with at most ``_ALL_ORDERS`` distinct orders put every order in the scan: exact.

All budgets count candidates, lanes and placements, never time, so every rank computes the same
plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np

from shard_planner._private.baselines import naive_plan
from shard_planner._private.bounds import (
    admissible,
    admissible_shard_sizes,
    lower_bound_shard_size,
    round_up,
)
from shard_planner._private.greedy import greedy_ends
from shard_planner._private.orders import (
    distinct_order_count,
    distinct_orders,
    fill_offsets,
    layout_fits,
    local_search,
    make_plan,
    place_in_order,
    static_orders,
)
from shard_planner._private.plan import Plan
from shard_planner._private.spec import TensorSpec, check_inputs

__all__ = ["METHODS", "lower_bound", "plan"]

METHODS = ("auto", "paper", "exact", "naive", "megatron", "model-order")

# Work budgets (lanes x tensors) of the scan; fixed numbers, so plans are deterministic.
_SCAN_WORK = 4_000_000
_FIRST_BATCH = 16
_MAX_BATCH = 4096
_FILL_WORK = 20_000  # tensors placed by gap filling, all tries together
_FILL_PER_BATCH = 4
_LADDER_STEPS = 64
_LOCAL_COST = 50  # a local search round costs about this many gap-filling placements
_FILL_ORDERS = 2
_FILL_POLICIES = ("keep", "exact", "min")
_JUMP_TRIES = 200
_ALL_ORDERS = 5040
_MAX_LANES = 65536  # order x size lanes per vectorised batch
_LOCAL_MAX_TENSORS = 64


def _take(iterator: Iterator[int], count: int, limit: int) -> list[int]:
    out: list[int] = []
    for c in iterator:
        if c >= limit:
            break
        out.append(c)
        if len(out) == count:
            break
    return out


class _Scanner:
    """Static orders checked on successive batches of admissible shard sizes (vectorised)."""

    def __init__(
        self,
        numels: Sequence[int],
        blocks: Sequence[int],
        orders: list[tuple[int, ...]],
        *,
        world_size: int,
        align: int,
        limit: int,
    ) -> None:
        self.orders = orders
        self.m = world_size
        self.e = np.array([[numels[i] for i in o] for o in orders], dtype=np.int64)
        self.g = np.array([[blocks[i] for i in o] for o in orders], dtype=np.int64)
        self.candidates = admissible_shard_sizes(numels, blocks, world_size, align)
        self.limit = limit
        self.max_batch = max(4, min(_MAX_BATCH, _MAX_LANES // len(orders)))
        self.batch = min(_FIRST_BATCH, self.max_batch)
        self.work = 0
        self.tried: list[int] = []  # sizes where every static order failed, increasing
        self.best_end: list[int] = []  # the best order's greedy end at each of them
        self.exhausted = False

    def step(self) -> tuple[int, tuple[int, ...]] | None:
        """Check the next batch; the smallest fitting (S, order) in it, if any."""
        # Never overshoot the work budget by more than one candidate's worth of lanes.
        per_size = self.e.shape[0] * self.e.shape[1]
        room = max(1, (_SCAN_WORK - self.work) // max(per_size, 1))
        chunk = _take(self.candidates, min(self.batch, room), self.limit)
        if not chunk:
            self.exhausted = True
            return None
        sizes = np.array(chunk, dtype=np.int64)
        ends = greedy_ends(self.e, self.g, sizes)
        ok = ends <= sizes[None, :] * self.m
        self.work += ends.size * self.e.shape[1]
        self.batch = min(self.batch * 4, self.max_batch)
        hits = np.flatnonzero(ok.any(axis=0))
        j = int(hits[0]) if hits.size else len(chunk)
        self.tried.extend(chunk[:j])
        self.best_end.extend(int(x) for x in ends[:, :j].min(axis=0))
        if j == len(chunk):
            return None
        self.exhausted = True
        return chunk[j], self.orders[int(np.flatnonzero(ok[:, j])[0])]


def _ladder(
    numels: Sequence[int],
    blocks: Sequence[int],
    indices: Sequence[int],
    world_size: int,
    align: int,
    lower: int,
    limit: int,
) -> list[int]:
    """Structured shard sizes to try first: the smallest admissible multiples of block LCMs.

    The LCMs of growing prefixes of the distinct blocks (largest first, as the paper searches),
    each block alone, and the GCD of the blocks: sizes where many crossings align at once.
    """
    distinct = sorted({blocks[i] for i in indices if blocks[i] > 1}, reverse=True)
    units = {math.lcm(align, *distinct[:j]) for j in range(1, len(distinct) + 1)}
    units |= {math.lcm(align, g) for g in distinct}
    if distinct:
        units.add(math.lcm(align, math.gcd(*distinct)))
    found: set[int] = set()
    for unit in units:
        c = round_up(lower, unit)
        for _ in range(_LADDER_STEPS):
            if c >= limit:
                break
            if admissible(numels, blocks, world_size, align, c):
                found.add(c)
                break
            c += unit
    return sorted(found)


def _auto(specs: Sequence[TensorSpec], world_size: int, align: int) -> Plan:
    numels = [s.numel for s in specs]
    blocks = [s.block for s in specs]
    nonempty = [i for i, e in enumerate(numels) if e > 0]
    m = world_size
    upper = naive_plan(specs, world_size, align)
    if not nonempty or m == 1:
        return make_plan(
            specs,
            m,
            align,
            shard=upper.shard_size,
            offsets=dict(enumerate(upper.offsets)),
            method="auto",
        )
    orders = static_orders(numels, blocks, nonempty)
    exhaustive = distinct_order_count(numels, blocks, nonempty) <= _ALL_ORDERS
    if exhaustive:
        # Small groups: every distinct order is a lane, so the scan is exact.
        orders += [o for o in distinct_orders(numels, blocks, nonempty) if o not in orders]
    e_arr = np.array([[numels[i] for i in o] for o in orders], dtype=np.int64)
    g_arr = np.array([[blocks[i] for i in o] for o in orders], dtype=np.int64)
    fill_work = 0

    def fill(shard: int) -> dict[int, int] | None:
        """Local search, then gap filling (both policies), at one size, within the budget."""
        nonlocal fill_work
        if exhaustive or fill_work >= _FILL_WORK:
            return None
        if len(nonempty) <= _LOCAL_MAX_TENSORS:
            fill_work += len(nonempty) * _LOCAL_COST
            order = local_search(numels, blocks, orders, shard, m)
            if order is not None:
                return place_in_order(numels, blocks, order, shard, m)
        for order in orders[:_FILL_ORDERS]:
            for policy in _FILL_POLICIES:
                fill_work += len(nonempty)
                offsets = fill_offsets(numels, blocks, order, shard, m, policy=policy)
                # The guard never fails in the tests; it keeps a heuristic slip from ever
                # producing an invalid plan.
                if offsets is not None and layout_fits(numels, blocks, offsets, shard, m):
                    return offsets
        return None

    def static(shard: int) -> dict[int, int] | None:
        ends = greedy_ends(e_arr, g_arr, np.array([shard], dtype=np.int64))[:, 0]
        hit = np.flatnonzero(ends <= shard * m)
        return place_in_order(numels, blocks, orders[int(hit[0])], shard, m) if hit.size else None

    # 1. Structured sizes first: a good plan early bounds the scan.
    lower = lower_bound_shard_size(numels, blocks, m, align)
    best: tuple[int, dict[int, int]] | None = None
    for shard in _ladder(numels, blocks, nonempty, m, align, lower, upper.shard_size):
        offsets = static(shard) or fill(shard)
        if offsets is not None:
            best = (shard, offsets)
            break
    limit = best[0] if best is not None else upper.shard_size

    # 2. Every admissible size below that, upwards, static orders vectorised; gap filling on
    #    the smallest failures between batches.
    scan = _Scanner(numels, blocks, orders, world_size=m, align=align, limit=limit)
    filled = 0
    found = None
    while found is None and not scan.exhausted and scan.work < _SCAN_WORK:
        found = scan.step()
        stop = len(scan.tried) if found is not None else filled + _FILL_PER_BATCH
        while filled < min(stop, len(scan.tried)) and fill_work < _FILL_WORK:
            shard = scan.tried[filled]
            filled += 1
            offsets = fill(shard)
            if offsets is not None:
                return make_plan(specs, m, align, shard=shard, offsets=offsets, method="auto")
    if found is not None:
        shard, order = found
        placed = place_in_order(numels, blocks, order, shard, m)
        assert placed is not None
        return make_plan(specs, m, align, shard=shard, offsets=placed, method="auto")

    # 3. Budgets spent with nothing below the limit: jump from the best failing end.
    if scan.tried and not scan.exhausted:
        shard, need = scan.tried[-1], scan.best_end[-1]
        for _ in range(_JUMP_TRIES):
            shard = max(shard + align, round_up(-(-need // m), align))
            while not admissible(numels, blocks, m, align, shard):
                shard += align
            if shard >= limit:
                break
            offsets = static(shard) or fill_offsets(numels, blocks, orders[0], shard, m)
            if offsets is not None and layout_fits(numels, blocks, offsets, shard, m):
                return make_plan(specs, m, align, shard=shard, offsets=offsets, method="auto")
            ends = greedy_ends(e_arr, g_arr, np.array([shard], dtype=np.int64))[:, 0]
            need = int(ends.min())
    if best is not None:
        return make_plan(specs, m, align, shard=best[0], offsets=best[1], method="auto")
    return make_plan(
        specs,
        m,
        align,
        shard=upper.shard_size,
        offsets=dict(enumerate(upper.offsets)),
        method="auto",
    )


def _paper(specs: Sequence[TensorSpec], world_size: int, align: int) -> Plan:
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
        return _auto(specs, world_size, align)
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


def _model_order(specs: Sequence[TensorSpec], world_size: int, align: int) -> Plan:
    """Model order only, exhaustive scan over admissible S: isolates the value of reordering."""
    numels = [s.numel for s in specs]
    blocks = [s.block for s in specs]
    order = [i for i, e in enumerate(numels) if e > 0]
    for shard in admissible_shard_sizes(numels, blocks, world_size, align):
        placed = place_in_order(numels, blocks, order, shard, world_size)
        if placed is not None:
            return make_plan(
                specs, world_size, align, shard=shard, offsets=placed, method="model-order"
            )
    raise AssertionError("unreachable: S >= total always fits")  # pragma: no cover


def lower_bound(specs: Sequence[TensorSpec], world_size: int, align: int = 1) -> int:
    """A shard size no plan of this group can beat (see ``bounds``): compare plans against it."""
    world_size, align = check_inputs(specs, world_size, align)
    numels = [s.numel for s in specs]
    return lower_bound_shard_size(numels, [s.block for s in specs], world_size, align)


def plan(
    specs: Sequence[TensorSpec], world_size: int, align: int = 1, *, method: str = "auto"
) -> Plan:
    """Pack ``specs`` into one buffer of ``world_size`` equal shards without cutting a block.

    ``align``: every shard size is a multiple of it (e.g. 16 bytes / itemsize for NCCL).
    ``method``: ``"auto"`` (ours), ``"exact"`` (optimal; small groups only), ``"paper"`` (the
    veScale heuristic as we read it), ``"model-order"``, or the baselines ``"naive"`` and
    ``"megatron"``. The result is deterministic: equal inputs give equal plans on every rank.
    """
    specs = list(specs)
    world_size, align = check_inputs(specs, world_size, align)
    if method == "auto":
        return _auto(specs, world_size, align)
    if method == "paper":
        return _paper(specs, world_size, align)
    if method == "model-order":
        return _model_order(specs, world_size, align)
    if method == "exact":
        from shard_planner._private.exact import exact_plan

        return exact_plan(specs, world_size, align)
    if method == "naive":
        return naive_plan(specs, world_size, align)
    if method == "megatron":
        from shard_planner._private.baselines import megatron_plan

        return megatron_plan(specs, world_size, align)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
