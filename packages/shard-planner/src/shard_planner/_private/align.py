"""Aligned tensor starts: every offset a multiple of ``offset_align`` elements.

[Note: why offsets, not only shard sizes]
``align`` makes every shard size, hence every rank's shard start ``k*S``, a multiple of the
collective's unit. The tensors inside the buffer start wherever the packing put them, so a
parameter's full view (and its share inside a shard) may begin at an odd element: fine for
correctness, but GEMMs and multi-tensor kernels on GPUs want 16-byte aligned pointers, and
compilers guard on it. With ``offset_align`` (dividing ``align``) every tensor starts on a
multiple of it too, so every view of the buffer, in any dtype whose item size divides
``16 / offset_align``-byte steps, is 16-byte aligned.

[Note: the earliest aligned start]
The greedy's rule (``greedy`` [Note: the earliest feasible start, in closed form]) with two
changes, for alignment ``a`` dividing ``S``: the position is first rounded up to a multiple of
``a``; and where the rule steps back from boundary ``b`` by whole blocks (``(b - l) % g == 0``),
``l`` must also be a multiple of ``a``, and ``b`` is one, so it steps by ``L = lcm(g, a)``:
``l1 = p + (b - p) % L`` and ``l3 = b + S % L``. The validity tests (does the tensor reach
``b + S``, is ``S`` a multiple of ``g``) are the greedy's. The same argument as there makes the
earliest aligned start optimal for a fixed order.

[Note: the pass]
``aligned_plan`` starts from what a method chose (its placement order and shard size) and
re-places the tensors in that order at their earliest aligned starts; if they no longer fit (the
alignment gaps, at most ``a - 1`` elements per tensor, pushed the end past ``m * S``), the static
orders (``orders`` [Note: the static orders]) are tried at the same size, and failing those the
shard size grows to the next multiple of ``align`` that the best greedy end asks for, until one
fits (one does once everything fits in one shard). One self-contained pass after any method, so
every method honours the parameter the same way; a plan whose offsets are aligned already is
kept as it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from shard_planner._private.bounds import round_up
from shard_planner._private.orders import static_orders
from shard_planner._private.plan import Plan

__all__ = ["aligned_greedy", "aligned_plan", "aligned_start"]


def aligned_start(p: int, numel: int, block: int, shard_size: int, offset_align: int) -> int | None:
    """Smallest feasible start ``>= p`` that is a multiple of ``offset_align`` (module Note),
    or ``None`` if no start works for this shard size."""
    s = shard_size
    p = round_up(p, offset_align)
    b = (p // s + 1) * s
    if p + numel <= b:
        return p
    step = math.lcm(block, offset_align)
    l1 = p + (b - p) % step
    if s % block == 0 or l1 + numel <= b + s:
        return l1
    l3 = b + s % step
    if l3 + numel <= b + 2 * s:
        return l3
    return None


def aligned_greedy(
    numels: Sequence[int],
    blocks: Sequence[int],
    order: Sequence[int],
    shard_size: int,
    world_size: int,
    offset_align: int,
) -> tuple[dict[int, int] | None, int]:
    """Aligned offsets of the tensors in ``order`` (``None`` if they overflow ``m * S``), and the
    end the greedy reached (for choosing the next shard size to try)."""
    capacity = world_size * shard_size
    offsets: dict[int, int] = {}
    p = 0
    for i in order:
        if numels[i] == 0:
            # Nothing to hold; an aligned position inside the buffer, as the methods do.
            offsets[i] = min(p, capacity - 1) // offset_align * offset_align
            continue
        at = aligned_start(p, numels[i], blocks[i], shard_size, offset_align)
        if at is None:
            return None, capacity + shard_size + p + numels[i]
        p = at + numels[i]
        if p > capacity:
            return None, p
        offsets[i] = at
    return offsets, p


def aligned_plan(plan: Plan, offset_align: int) -> Plan:
    """``plan`` with every tensor's offset a multiple of ``offset_align`` (module Note: the
    pass). ``offset_align`` must divide the plan's ``align``."""
    a = offset_align
    if a < 1 or plan.align % a:
        raise ValueError(
            f"offset_align {offset_align} must be >= 1 and divide align {plan.align} (shard "
            f"boundaries must be aligned for tensor starts to be)"
        )
    if all(off % a == 0 for off in plan.offsets):
        return attrs.evolve(plan, offset_align=a)
    numels, blocks, m = plan.numels, plan.blocks, plan.world_size
    nonempty = [i for i in plan.order if numels[i] > 0]
    empty = [i for i in plan.order if numels[i] == 0]
    orders = [plan.order]
    orders += [(*o, *empty) for o in static_orders(numels, blocks, nonempty)]
    shard = plan.shard_size
    # Everything fits in shard 0 at this size (each start at most a - 1 past the last end).
    trivial = round_up(sum(numels) + len(numels) * a, plan.align)
    offsets: dict[int, int] | None = None
    while offsets is None:
        best = None
        for order in orders:
            offsets, end = aligned_greedy(numels, blocks, order, shard, m, a)
            if offsets is not None:
                break
            best = end if best is None else min(best, end)
        if offsets is None:
            assert best is not None and shard < trivial
            # The end asks for at least ceil(end / m) per shard; always move forward.
            shard = min(max(shard + plan.align, round_up(-(-best // m), plan.align)), trivial)
    full = tuple(offsets[i] for i in range(len(numels)))
    return Plan(
        world_size=m,
        shard_size=shard,
        align=plan.align,
        numels=numels,
        blocks=blocks,
        names=plan.names,
        offsets=full,
        order=tuple(sorted(range(len(numels)), key=lambda i: (full[i], numels[i] > 0, i))),
        method=plan.method,
        optimal=plan.optimal and shard == plan.shard_size,
        offset_align=a,
    )
