"""The planner: choose a shard size and an order so that the greedy placement fits.

[Note: the search ("auto")]
0. Upper bound: the better of the naive baseline and "everything in shard 0" (both valid by
   construction). Nothing worse is returned, and no larger shard size is ever tried.
1. Structured sizes (``_ladder``): the smallest admissible multiples of the LCMs of the blocks
   (prefixes largest first, each block, their GCD), checked with the lanes and, failing those,
   with local search and gap filling. Many crossings align at once at such sizes, so a good
   plan is found early and bounds the scan.
2. Scan: every admissible size below that (``bounds.ShardSizes``, from the lower
   bound upwards) in growing batches, each batch checked on all lanes at once: the static
   orders through the vectorised greedy (``greedy.greedy_ends``) and, for groups with few
   kinds, the best order over *all* orders (``multiset.BestOrder``); after each batch, gap
   filling and local search on the smallest failures. The scan never skips an admissible S
   (feasibility is not monotone in S).
3. If the scan's budget runs out first (tiny worlds, big blocks, many small steps), the search
   jumps: the next S tried is the one that would have made the best failing lane fit.

[Note: when "auto" is exact]
``auto`` proves its shard size optimal, and sets ``Plan.optimal``, in exactly two cases:
(a) the shard size equals the lower bound (``lower_bound``: nothing can be smaller), or
(b) the group is *exhaustive* -- ``prod(c_k + 1) * K <= 50,000`` for its K kinds of tensors with
    multiplicities ``c_k`` (``multiset`` Note; e.g. any group of at most 12 tensors, or 40
    tensors of 3 kinds) -- and the scan of step 2 checked every admissible size
    below the returned one within its budget of 4,000,000 kernel steps (states x kinds per size
    for the best-order lane, tensors x static orders for the others).
In case (b) every order is checked at every smaller admissible size, and the greedy is optimal
per order (``greedy`` Note), so no layout with a smaller shard size exists. Otherwise the plan
is valid and never worse than the baselines, and may or may not be optimal.

All budgets count candidates, lanes and placements, never time, so every rank computes the same
plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shard_planner._private.align import aligned_plan
from shard_planner._private.baselines import naive_plan
from shard_planner._private.bounds import (
    IntMode,
    ShardSizes,
    admissible,
    int_mode,
    lower_bound_shard_size,
    round_up,
)
from shard_planner._private.greedy import greedy_ends
from shard_planner._private.heuristics import model_order_plan, paper_plan, trivial_plan
from shard_planner._private.multiset import BestOrder, Kinds
from shard_planner._private.orders import (
    fill_offsets,
    layout_fits,
    local_search,
    make_plan,
    place_in_order,
    static_orders,
)
from shard_planner._private.plan import Plan
from shard_planner._private.spec import TensorSpec, as_count, check_inputs

__all__ = ["METHODS", "lower_bound", "plan"]

METHODS = ("auto", "paper", "exact", "naive", "megatron", "model-order")

# Work budgets (lanes x tensors) of the scan; fixed numbers, so plans are deterministic.
_SCAN_WORK = 4_000_000
_FIRST_BATCH = 16
_MAX_BATCH = 4096
_FILL_WORK = 20_000  # tensors placed by gap filling, all tries together
_FILL_PER_BATCH = 4
_LADDER_STEPS = 64
_LOCAL_COST = 100  # one local search costs about this many gap-filling placements per tensor
_FILL_ORDERS = 2
_FILL_POLICIES = ("keep", "exact", "min")
_JUMP_TRIES = 200
# Groups whose best order over all orders costs at most this many kernel steps per shard size
# (states x kinds, ``multiset`` Note) are scanned exhaustively: every tensor order at every size.
_BEST_ORDER_WORK = 50_000
_SIZE_COST = 32  # budget units charged per accepted size on top of its lanes
_MAX_LANES = 65536  # (orders or states) x sizes per vectorised batch
_LOCAL_MAX_TENSORS = 64


class _Lanes:
    """What the scan checks at each shard size: the static orders (one vectorised lane each)
    and, for groups with few kinds, the best order over all of them (``multiset`` Note)."""

    def __init__(
        self,
        numels: Sequence[int],
        blocks: Sequence[int],
        orders: list[tuple[int, ...]],
        best: BestOrder | None,
        mode: IntMode,
        world_size: int,
    ) -> None:
        self.numels, self.blocks, self.orders, self.best = numels, blocks, orders, best
        self.mode, self.m = mode, world_size
        self.e = mode.array([[numels[i] for i in o] for o in orders])
        self.g = mode.array([[blocks[i] for i in o] for o in orders])
        self.per_size = mode.cost * (
            self.e.shape[0] * self.e.shape[1] + (best.work if best else 0) + _SIZE_COST
        )
        # the best-order lane holds every state per size, the static ones one row per order
        self.width = max(len(orders), best.kinds.states // 8 if best else 0, 1)

    def ends(self, sizes: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """The smallest greedy end over the lanes, per shard size."""
        ends: npt.NDArray[Any] = greedy_ends(self.e, self.g, sizes, self.mode.infeasible).min(
            axis=0
        )
        if self.best is not None:
            ends = np.minimum(ends, self.best.ends(sizes))
        return ends

    def order_at(self, shard: int, *, every_order: bool = True) -> tuple[int, ...] | None:
        """An order that fits at ``shard`` (a static one if any does; else, with
        ``every_order``, the best over all orders), or ``None``."""
        sizes = self.mode.array([shard])
        ends = greedy_ends(self.e, self.g, sizes, self.mode.infeasible)[:, 0]
        hit = np.flatnonzero(ends <= shard * self.m)
        if hit.size:
            return self.orders[int(hit[0])]
        best = self.best if every_order else None
        if best is not None and best.ends(sizes)[0] <= shard * self.m:
            return best.order(shard)
        return None

    def static_ends(self, shard: int) -> int:
        """The static lanes' best greedy end at ``shard`` (cheap: no programme over orders)."""
        sizes = self.mode.array([shard])
        return int(greedy_ends(self.e, self.g, sizes, self.mode.infeasible).min())

    def place(self, shard: int, *, every_order: bool = True) -> dict[int, int] | None:
        order = self.order_at(shard, every_order=every_order)
        return (
            None
            if order is None
            else place_in_order(self.numels, self.blocks, order, shard, self.m)
        )


class _Scanner:
    """The lanes checked on successive batches of admissible shard sizes (vectorised)."""

    def __init__(
        self,
        lanes: _Lanes,
        numels: Sequence[int],
        blocks: Sequence[int],
        *,
        world_size: int,
        align: int,
        limit: int,
    ) -> None:
        self.lanes = lanes
        self.m = world_size
        # sizes strictly below the limit (the limit itself is already a plan)
        self.candidates = ShardSizes(numels, blocks, world_size, align, limit=limit - 1)
        self.limit = limit
        self.max_batch = max(4, min(_MAX_BATCH, _MAX_LANES // lanes.width))
        self.batch = min(_FIRST_BATCH, self.max_batch)
        self.work = 0
        # generating and filtering one candidate (accepted or not): the joint conditions
        self.per_candidate = lanes.mode.cost * (8 + 2 * len(numels))
        self.tried: list[int] = []  # sizes where every lane failed, increasing
        self.best_end: list[int] = []  # the best lane's greedy end at each of them
        self.exhausted = False  # every admissible size below the limit was checked

    def step(self) -> tuple[int, tuple[int, ...]] | None:
        """Check the next batch; the smallest fitting (S, order) in it, if any."""
        # Never overshoot the work budget by more than one candidate's worth of lanes.
        per_size = self.lanes.per_size
        room = max(1, (_SCAN_WORK - self.work) // max(per_size, 1))
        generated = self.candidates.generated
        sizes = self.candidates.take(
            min(self.batch, room), budget=max(1, (_SCAN_WORK - self.work) // self.per_candidate)
        )
        self.work += (self.candidates.generated - generated) * self.per_candidate
        if not sizes.size:
            self.exhausted = self.candidates.done
            return None
        chunk = [int(c) for c in sizes]
        ends = self.lanes.ends(sizes)
        ok = ends <= sizes * self.m
        self.work += len(chunk) * per_size
        if self.candidates.empty:
            self.exhausted = True
        self.batch = min(self.batch * 4, self.max_batch)
        hits = np.flatnonzero(ok)
        j = int(hits[0]) if hits.size else len(chunk)
        self.tried.extend(chunk[:j])
        self.best_end.extend(int(x) for x in ends[:j])
        if j == len(chunk):
            return None
        order = self.lanes.order_at(chunk[j])
        assert order is not None
        return chunk[j], order


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


def auto_plan(specs: Sequence[TensorSpec], world_size: int, align: int) -> Plan:
    numels = [s.numel for s in specs]
    blocks = [s.block for s in specs]
    nonempty = [i for i, e in enumerate(numels) if e > 0]
    m = world_size
    lower = lower_bound_shard_size(numels, blocks, m, align)

    def done(shard: int, offsets: dict[int, int], proven: bool) -> Plan:
        optimal = proven or shard == lower
        return make_plan(
            specs, m, align, shard=shard, offsets=offsets, method="auto", optimal=optimal
        )

    naive = naive_plan(specs, world_size, align)
    trivial = trivial_plan(specs, world_size, align)
    upper = naive if naive.shard_size <= trivial.shard_size else trivial
    upper_offsets = dict(enumerate(upper.offsets))
    if not nonempty or m == 1:
        return done(upper.shard_size, upper_offsets, proven=False)
    mode = int_mode(numels, blocks, m, align)
    kinds = Kinds(numels, blocks, nonempty)
    exhaustive = kinds.states * len(kinds.counts) <= _BEST_ORDER_WORK
    best_order = BestOrder(kinds, mode.dtype, mode.infeasible) if exhaustive else None
    orders = static_orders(numels, blocks, nonempty)
    lanes = _Lanes(numels, blocks, orders, best_order, mode, m)
    fill_work = 0

    def fill(shard: int) -> dict[int, int] | None:
        """Local search, then gap filling (both policies), at one size, within the budget."""
        nonlocal fill_work
        if exhaustive or fill_work >= _FILL_WORK:
            return None  # exhaustive: every order was already checked at this size
        if len(nonempty) <= _LOCAL_MAX_TENSORS:
            fill_work += len(nonempty) * _LOCAL_COST * mode.cost
            order = local_search(numels, blocks, orders, shard, m, mode)
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

    # 1. Structured sizes first: a good plan early bounds the scan.
    best: tuple[int, dict[int, int]] | None = None
    for shard in _ladder(numels, blocks, nonempty, m, align, lower, upper.shard_size):
        offsets = lanes.place(shard) or fill(shard)
        if offsets is not None:
            best = (shard, offsets)
            break
    limit = best[0] if best is not None else upper.shard_size

    # 2. Every admissible size below that, upwards, all lanes vectorised; gap filling on the
    #    smallest failures between batches.
    scan = _Scanner(lanes, numels, blocks, world_size=m, align=align, limit=limit)
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
                return done(shard, offsets, proven=False)
    # Exhaustive lanes and a complete scan: no smaller size fits any order.
    proven = exhaustive and (found is not None or scan.exhausted)
    if found is not None:
        shard, order = found
        placed = place_in_order(numels, blocks, order, shard, m)
        assert placed is not None
        return done(shard, placed, proven)

    # 3. Budgets spent with nothing below the limit: jump from the best failing end.
    if scan.tried and not scan.exhausted:
        shard, need = scan.tried[-1], scan.best_end[-1]
        for _ in range(_JUMP_TRIES):
            shard = max(shard + align, round_up(-(-need // m), align))
            while shard < limit and not admissible(numels, blocks, m, align, shard):
                shard += align
            if shard >= limit:
                break
            # heuristic jumps use the static lanes only: the programme over all orders is for
            # the exhaustive scan (up to 200 single-size runs of it would cost more than it)
            offsets = lanes.place(shard, every_order=False) or fill_offsets(
                numels, blocks, orders[0], shard, m
            )
            if offsets is not None and layout_fits(numels, blocks, offsets, shard, m):
                return done(shard, offsets, proven=False)
            need = lanes.static_ends(shard)
    if best is not None:
        return done(best[0], best[1], proven)
    return done(upper.shard_size, upper_offsets, proven)


def lower_bound(specs: Sequence[TensorSpec], world_size: int, align: int = 1) -> int:
    """A shard size no plan of this group can beat (see ``bounds``): compare plans against it."""
    world_size, align = check_inputs(specs, world_size, align)
    numels = [s.numel for s in specs]
    return lower_bound_shard_size(numels, [s.block for s in specs], world_size, align)


def plan(
    specs: Sequence[TensorSpec],
    world_size: int,
    align: int = 1,
    *,
    method: str = "auto",
    offset_align: int = 1,
) -> Plan:
    """Pack ``specs`` into one buffer of ``world_size`` equal shards without cutting a block.

    ``align``: every shard size is a multiple of it (e.g. 16 bytes / itemsize for NCCL).
    ``offset_align`` (dividing ``align``): every tensor's offset is a multiple of it too, so
    its views are as aligned as the shards (``align`` [Note: the pass]: the method's order and
    shard size, tensors moved to aligned starts, the shard size grown only if they no longer fit).
    ``method``: ``"auto"`` (ours), ``"exact"`` (optimal; small groups only), ``"paper"`` (the
    veScale heuristic as we read it), ``"model-order"``, or the baselines ``"naive"`` and
    ``"megatron"``. The result is deterministic: equal inputs give equal plans on every rank.
    """
    specs = list(specs)
    world_size, align = check_inputs(specs, world_size, align)
    offset_align = as_count(offset_align, "offset_align")
    if align % offset_align:
        raise ValueError(
            f"offset_align {offset_align} must divide align {align} (tensor starts can only be "
            f"aligned where shard boundaries are)"
        )
    result = _plan(specs, world_size, align, method)
    return result if offset_align == 1 else aligned_plan(result, offset_align)


def _plan(specs: list[TensorSpec], world_size: int, align: int, method: str) -> Plan:
    if method == "auto":
        return auto_plan(specs, world_size, align)
    if method == "paper":
        return paper_plan(specs, world_size, align)
    if method == "model-order":
        return model_order_plan(specs, world_size, align)
    if method == "exact":
        from shard_planner._private.exact import exact_plan

        return exact_plan(specs, world_size, align)
    if method == "naive":
        return naive_plan(specs, world_size, align)
    if method == "megatron":
        from shard_planner._private.baselines import megatron_plan

        return megatron_plan(specs, world_size, align)
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
