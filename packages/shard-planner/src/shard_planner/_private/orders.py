"""Tensor orders for the planner: static keys, local search, gap filling (every distinct order:
``multiset``).

[Note: the static orders]
Model order; blocks descending (big-block tensors first, so a divisibility chain of blocks keeps
later starts aligned); sizes descending (big tensors span boundaries, small ones fill the end);
blocks then sizes descending; sizes ascending. Ties keep model order, so the result is
deterministic.

[Note: gap filling]
A static order fixes which tensor meets each boundary, however badly it aligns there. The dynamic
greedy of ``fill_offsets`` decides at each boundary instead, among the remaining *kinds* (tensors
of equal numel and block are interchangeable), and keeps block-1 tensors back to cross
boundaries for free. It is run per shard size, so the search uses it on few sizes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from shard_planner._private.bounds import IntMode
from shard_planner._private.greedy import earliest_start, greedy_ends, greedy_offsets
from shard_planner._private.plan import Plan, first_bad_boundary
from shard_planner._private.spec import TensorSpec

__all__ = [
    "fill_offsets",
    "layout_fits",
    "local_search",
    "make_plan",
    "place_in_order",
    "static_orders",
]

LOCAL_ROUNDS = 6


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


def _neighbourhood(n: int) -> npt.NDArray[np.int64]:
    """Position maps of every swap and every forward move of two positions ``a < b``.

    Row ``r`` maps new positions to old ones: the swap exchanges ``a`` and ``b``; the move takes
    the tensor at ``a`` out and reinserts it at ``b`` (the ones between shift down by one).
    """
    a, b = np.triu_indices(n, 1)
    j = np.arange(n, dtype=np.int64)[None, :]
    swap = np.where(j == a[:, None], b[:, None], np.where(j == b[:, None], a[:, None], j))
    between = (j >= a[:, None]) & (j < b[:, None])
    move = np.where(j == b[:, None], a[:, None], np.where(between, j + 1, j))
    return np.concatenate([swap, move]).astype(np.int64)


def local_search(
    numels: Sequence[int],
    blocks: Sequence[int],
    orders: Sequence[tuple[int, ...]],
    shard: int,
    world_size: int,
    mode: IntMode,
) -> tuple[int, ...] | None:
    """Steepest descent on the greedy's end over swap and move neighbourhoods at one S.

    Starts from the given order whose greedy ends first; each round evaluates every swap of two
    tensors and every move of one tensor to a later position (one vectorised lane each) and keeps
    the best. Returns an order that fits in ``world_size * shard``, or ``None``.
    """
    capacity = world_size * shard
    sizes = mode.array([shard])
    e_all = mode.array(list(numels))
    g_all = mode.array(list(blocks))
    start = np.array(orders, dtype=np.int64)
    ends = greedy_ends(e_all[start], g_all[start], sizes, mode.infeasible)[:, 0]
    current, end = start[int(np.argmin(ends))], int(ends.min())
    maps = _neighbourhood(len(current))
    for _ in range(LOCAL_ROUNDS):
        candidates = current[maps]
        # Rows that only exchange interchangeable tensors change nothing.
        e, g = e_all[candidates], g_all[candidates]
        useful = ((e != e_all[current]) | (g != g_all[current])).any(axis=1)
        if not bool(useful.any()):
            return None
        candidates, e, g = candidates[useful], e[useful], g[useful]
        ends = greedy_ends(e, g, sizes, mode.infeasible)[:, 0]
        best = int(np.argmin(ends))
        if int(ends[best]) <= capacity:
            return tuple(int(x) for x in candidates[best])
        if int(ends[best]) >= end:
            return None
        current, end = candidates[best], int(ends[best])
    return None


def make_plan(
    specs: Sequence[TensorSpec],
    world_size: int,
    align: int,
    *,
    shard: int,
    offsets: dict[int, int],
    method: str,
    optimal: bool = False,
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
        optimal=optimal,
    )


def place_in_order(
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
            # Fill [p, best_at) with whole tensors that may start at p: the gap can contain a
            # boundary (when the best start is in the next shard), so each is checked.
            while best_at > p:
                room = best_at - p
                filler = next(
                    (
                        k
                        for k in by_size
                        if kinds[k]
                        and k[0] <= room
                        and (k != best or len(kinds[k]) > 1)
                        and earliest_start(p, k[0], k[1], shard) == p
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


def layout_fits(
    numels: Sequence[int],
    blocks: Sequence[int],
    offsets: dict[int, int],
    shard: int,
    world_size: int,
) -> bool:
    """Whether ``offsets`` place every non-empty tensor validly (a guard on the heuristics)."""
    placed = sorted((offsets[i], i) for i, e in enumerate(numels) if e > 0 and i in offsets)
    if len(placed) != sum(1 for e in numels if e > 0):
        return False
    stop = 0
    for start, i in placed:
        if start < stop or first_bad_boundary(start, numels[i], blocks[i], shard) is not None:
            return False
        stop = start + numels[i]
    return stop <= world_size * shard
