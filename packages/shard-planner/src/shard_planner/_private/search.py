"""The planner: choose a shard size and an order so that the greedy placement fits.

[Note: the search ("auto")]
1. Upper bound: the naive baseline's plan (valid by construction). Nothing worse is returned.
2. Scan: every admissible shard size (``bounds.candidate_shard_sizes``) from the lower bound
   upwards, in growing batches, each batch checked for several static orders at once with the
   vectorised greedy (``greedy.greedy_ends``). The first S with a fitting order is taken. The
   scan never skips an admissible S, so for the orders tried it finds the smallest S.
3. Gap filling: for the admissible sizes below that S (all failed with static orders), a dynamic
   greedy is tried: at each boundary it picks, among the remaining tensor kinds, the one whose
   crossing wastes least, and fills the gap before it with whole tensors that fit there.
4. If the scan's work budget runs out first (tiny worlds with big blocks and many small steps),
   the search jumps: the next S tried is the one that would have made the best failing order fit.

All budgets count candidates and lanes, never time, so every rank computes the same plan.

[Note: the static orders]
Model order; blocks descending (big-block tensors first, so a divisibility chain of blocks keeps
later starts aligned); sizes descending (big tensors span boundaries, small ones fill the end);
blocks then sizes descending; sizes ascending. Ties keep model order, so the result is
deterministic.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from shard_planner._private.baselines import naive_plan
from shard_planner._private.bounds import (
    admissible,
    admissible_shard_sizes,
    lower_bound_shard_size,
    round_up,
)
from shard_planner._private.greedy import earliest_start, greedy_ends, greedy_offsets
from shard_planner._private.plan import Plan
from shard_planner._private.spec import TensorSpec, check_inputs

__all__ = ["METHODS", "lower_bound", "plan", "static_orders"]

METHODS = ("auto", "paper", "exact", "naive", "megatron", "model-order")

# Work budgets (lanes x tensors) of the scan; fixed numbers, so plans are deterministic.
_SCAN_WORK = 40_000_000
_FIRST_BATCH = 16
_MAX_BATCH = 4096
_FILL_WORK = 40_000  # tensors placed by gap filling, all tries together
_FILL_PER_BATCH = 4
_LADDER_STEPS = 64
_LOCAL_COST = 50  # a local search round costs about this many gap-filling placements
_FILL_ORDERS = 2
_FILL_POLICIES = ("keep", "exact", "min")
_JUMP_TRIES = 200
_ALL_ORDERS = 5040
_MAX_LANES = 65536  # order x size lanes per vectorised batch
_LOCAL_MAX_TENSORS = 64
_LOCAL_ROUNDS = 6


def _distinct_order_count(
    numels: Sequence[int], blocks: Sequence[int], indices: Sequence[int]
) -> int:
    """Multinomial count of distinct orders (tensors of equal numel and block are alike)."""
    counts: dict[tuple[int, int], int] = {}
    for i in indices:
        counts[(numels[i], blocks[i])] = counts.get((numels[i], blocks[i]), 0) + 1
    total = math.factorial(len(indices))
    for c in counts.values():
        total //= math.factorial(c)
    return total


def local_search(
    numels: Sequence[int],
    blocks: Sequence[int],
    orders: Sequence[tuple[int, ...]],
    shard: int,
    world_size: int,
) -> tuple[int, ...] | None:
    """Steepest descent on the greedy's end over swap and move neighbourhoods at one S.

    Starts from the given order whose greedy ends first; each round evaluates every swap of two
    tensors and every move of one tensor to another position (one vectorised lane each) and keeps
    the best. Returns an order that fits in ``world_size * shard``, or ``None``.
    """
    capacity = world_size * shard
    sizes = np.array([shard], dtype=np.int64)
    e_arr = np.array([[numels[i] for i in o] for o in orders], dtype=np.int64)
    g_arr = np.array([[blocks[i] for i in o] for o in orders], dtype=np.int64)
    ends = greedy_ends(e_arr, g_arr, sizes)[:, 0]
    current, end = orders[int(np.argmin(ends))], int(ends.min())
    n = len(current)
    for _ in range(_LOCAL_ROUNDS):
        neighbours: list[tuple[int, ...]] = []
        for a in range(n):
            for b in range(a + 1, n):
                if (numels[current[a]], blocks[current[a]]) == (
                    numels[current[b]],
                    blocks[current[b]],
                ):
                    continue
                swapped = list(current)
                swapped[a], swapped[b] = swapped[b], swapped[a]
                neighbours.append(tuple(swapped))
                moved = list(current)
                moved.insert(b, moved.pop(a))
                neighbours.append(tuple(moved))
        if not neighbours:
            return None
        e_arr = np.array([[numels[i] for i in o] for o in neighbours], dtype=np.int64)
        g_arr = np.array([[blocks[i] for i in o] for o in neighbours], dtype=np.int64)
        ends = greedy_ends(e_arr, g_arr, sizes)[:, 0]
        best = int(np.argmin(ends))
        if int(ends[best]) <= capacity:
            return neighbours[best]
        if int(ends[best]) >= end:
            return None
        current, end = neighbours[best], int(ends[best])
    return None


def static_orders(
    numels: Sequence[int], blocks: Sequence[int], indices: Sequence[int]
) -> list[tuple[int, ...]]:
    """The static candidate orders over ``indices`` (see the module Note), duplicates removed."""
    base = list(indices)
    keys: list[Callable[[int], tuple[int, ...]]] = [
        lambda i: (),
        lambda i: (-blocks[i],),
        lambda i: (-numels[i],),
        lambda i: (-blocks[i], -numels[i]),
        lambda i: (numels[i],),
    ]
    found: list[tuple[int, ...]] = []
    for key in keys:
        order = tuple(sorted(base, key=key))  # stable: ties keep model order
        if order not in found:
            found.append(order)
    return found


def _make_plan(
    specs: Sequence[TensorSpec],
    world_size: int,
    align: int,
    *,
    shard: int,
    offsets: dict[int, int],
    method: str,
) -> Plan:
    capacity = world_size * shard
    full: list[int] = []
    for i, spec in enumerate(specs):
        at = offsets.get(i, 0)
        full.append(min(at, capacity - 1) if spec.numel == 0 else at)
    order = tuple(sorted(range(len(specs)), key=lambda i: (full[i], specs[i].numel > 0, i)))
    return Plan(
        world_size=world_size,
        shard_size=shard,
        align=align,
        numels=tuple(s.numel for s in specs),
        blocks=tuple(s.block for s in specs),
        names=tuple(s.name for s in specs),
        offsets=tuple(full),
        order=order,
        method=method,
    )


def _place(
    numels: Sequence[int], blocks: Sequence[int], order: Sequence[int], shard: int, world_size: int
) -> dict[int, int] | None:
    offsets = greedy_offsets(
        [numels[i] for i in order], [blocks[i] for i in order], shard, world_size * shard
    )
    if offsets is None:
        return None
    return dict(zip(order, offsets, strict=True))


def fill_offsets(
    numels: Sequence[int],
    blocks: Sequence[int],
    order: Sequence[int],
    shard: int,
    world_size: int,
    *,
    policy: str = "keep",
) -> dict[int, int] | None:
    """Dynamic greedy with gap filling for one shard size; ``None`` if it does not fit.

    Tensors of equal (numel, block) are interchangeable "kinds". Block-1 tensors (norms, biases)
    are *fillers*: they can cross a boundary anywhere, so they are kept back for boundaries.
    The other kinds are placed in ``order``. When the next one would cross a boundary with a gap
    (the distance to its earliest aligned start), in turn: a filler long enough to cross the
    boundary is placed instead (no gap); else, if the gap is only an alignment gap (shorter than
    the block), the tensor itself; else the kind with the smallest gap. The gap is first filled
    with the largest whole tensors that fit in it (they stay inside one shard). Leftover fillers
    go last. That is ``policy="keep"``. With ``"exact"`` a kind crossing with no gap at all is
    preferred even to a short alignment gap of the next tensor; with ``"min"`` the kind with the
    smallest gap always is. Which is best depends on whether the kinds taken out of order are
    needed later, so the planner tries all three.
    """
    kinds: dict[tuple[int, int], deque[int]] = {}
    for i in order:
        if numels[i] > 0:
            kinds.setdefault((numels[i], blocks[i]), deque()).append(i)
    mains = [k for k in kinds if k[1] > 1]
    fillers = sorted((k for k in kinds if k[1] == 1), key=lambda k: k[0])
    by_size = sorted(kinds, key=lambda k: -k[0])
    # The preferred sequence: main tensors in ``order``, then fillers; placed ones are skipped.
    sequence = [i for i in order if numels[i] > 0 and blocks[i] > 1]
    sequence += [kinds[k][j] for k in fillers for j in range(len(kinds[k]))]
    capacity = world_size * shard
    offsets: dict[int, int] = {}
    p = 0
    cursor = 0

    def put(key: tuple[int, int], at: int) -> int:
        offsets[kinds[key].popleft()] = at
        return at + key[0]

    while True:
        while cursor < len(sequence) and sequence[cursor] in offsets:
            cursor += 1
        if cursor == len(sequence):
            break
        nxt = sequence[cursor]
        first = (numels[nxt], blocks[nxt])
        b = (p // shard + 1) * shard
        at = earliest_start(p, first[0], first[1], shard)
        if at == p:
            p = put(first, p)
        elif cross := next((k for k in fillers if kinds[k] and p + k[0] > b), None):
            p = put(cross, p)
        else:
            best, best_at = first, at
            # An alignment gap (shorter than a block) is cheap: keep the order (unless the
            # policy asks for exact fits). A longer one means the tensor would skip to the next
            # shard: look for a better kind first.
            look = policy != "keep" or at is None or at - p >= first[1]
            for key in mains if look else ():
                if kinds[key] and key != first:
                    other = earliest_start(p, key[0], key[1], shard)
                    if other is not None and (best_at is None or other < best_at):
                        best, best_at = key, other
                        if other == p:
                            break
            if (
                policy == "exact"
                and best_at is not None
                and best_at > p
                and at is not None
                and at - p < first[1]
            ):
                best, best_at = first, at  # no exact fit found: keep the order after all
            if best_at is None:
                return None
            # Fill [p, best_at) with whole tensors; they cannot cross ``b`` (best_at <= b).
            while best_at > p:
                room = best_at - p
                filler = next(
                    (
                        k
                        for k in by_size
                        if kinds[k] and k[0] <= room and (k != best or len(kinds[k]) > 1)
                    ),
                    None,
                )
                if filler is None:
                    break
                p = put(filler, p)
            at = earliest_start(p, best[0], best[1], shard)
            if at is None:
                return None
            p = put(best, at)
        if p > capacity:
            return None
    return offsets


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
        chunk = _take(self.candidates, self.batch, self.limit)
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
        return _make_plan(
            specs,
            m,
            align,
            shard=upper.shard_size,
            offsets=dict(enumerate(upper.offsets)),
            method="auto",
        )
    orders = static_orders(numels, blocks, nonempty)
    exhaustive = _distinct_order_count(numels, blocks, nonempty) <= _ALL_ORDERS
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
                return _place(numels, blocks, order, shard, m)
        for order in orders[:_FILL_ORDERS]:
            for policy in _FILL_POLICIES:
                fill_work += len(nonempty)
                offsets = fill_offsets(numels, blocks, order, shard, m, policy=policy)
                if offsets is not None:
                    return offsets
        return None

    def static(shard: int) -> dict[int, int] | None:
        ends = greedy_ends(e_arr, g_arr, np.array([shard], dtype=np.int64))[:, 0]
        hit = np.flatnonzero(ends <= shard * m)
        return _place(numels, blocks, orders[int(hit[0])], shard, m) if hit.size else None

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
                return _make_plan(specs, m, align, shard=shard, offsets=offsets, method="auto")
    if found is not None:
        shard, order = found
        placed = _place(numels, blocks, order, shard, m)
        assert placed is not None
        return _make_plan(specs, m, align, shard=shard, offsets=placed, method="auto")

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
            if offsets is not None:
                return _make_plan(specs, m, align, shard=shard, offsets=offsets, method="auto")
            ends = greedy_ends(e_arr, g_arr, np.array([shard], dtype=np.int64))[:, 0]
            need = int(ends.min())
    if best is not None:
        return _make_plan(specs, m, align, shard=best[0], offsets=best[1], method="auto")
    return _make_plan(
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
                if _place(numels, blocks, order, mid * step, m) is None:
                    lo = mid + 1
                else:
                    hi = mid
            shard = lo * step
            if best is None or shard < best[0]:
                best = (shard, order)
    assert best is not None
    placed = _place(numels, blocks, best[1], best[0], m)
    assert placed is not None
    return _make_plan(specs, m, align, shard=best[0], offsets=placed, method="paper")


def _model_order(specs: Sequence[TensorSpec], world_size: int, align: int) -> Plan:
    """Model order only, exhaustive scan over admissible S: isolates the value of reordering."""
    numels = [s.numel for s in specs]
    blocks = [s.block for s in specs]
    order = [i for i, e in enumerate(numels) if e > 0]
    for shard in admissible_shard_sizes(numels, blocks, world_size, align):
        placed = _place(numels, blocks, order, shard, world_size)
        if placed is not None:
            return _make_plan(
                specs, world_size, align, shard=shard, offsets=placed, method="model-order"
            )
    raise AssertionError("unreachable: S >= total always fits")  # pragma: no cover


def lower_bound(specs: Sequence[TensorSpec], world_size: int, align: int = 1) -> int:
    """A shard size no plan of this group can beat (see ``bounds``): compare plans against it."""
    check_inputs(specs, world_size, align)
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
    check_inputs(specs, world_size, align)
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


# Used by tests and the exact solver: distinct permutations of a multiset of tensor kinds.
def distinct_orders(
    numels: Sequence[int], blocks: Sequence[int], indices: Sequence[int]
) -> list[tuple[int, ...]]:
    """All orders of ``indices`` up to swapping tensors of equal (numel, block)."""
    seen: set[tuple[tuple[int, int], ...]] = set()
    found: list[tuple[int, ...]] = []
    for perm in itertools.permutations(indices):
        key = tuple((numels[i], blocks[i]) for i in perm)
        if key not in seen:
            seen.add(key)
            found.append(perm)
    return found
