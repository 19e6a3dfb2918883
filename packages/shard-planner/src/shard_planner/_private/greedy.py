"""Placement of tensors in a fixed order for a fixed shard size: the earliest-start greedy.

[Note: why earliest start is optimal for a fixed order]
Let ``f(p)`` be the smallest feasible start ``l >= p`` of a tensor (feasible: every shard boundary
strictly inside ``[l, l+e)`` is a multiple of the block away from ``l``). ``f`` is non-decreasing
in ``p``, so ending each tensor as early as possible can only let the next one start earlier; by
induction the greedy minimises the end of every prefix, and an order fits in ``m*S`` elements iff
the greedy's end does.

[Note: the earliest feasible start, in closed form]
At position ``p`` let ``b`` be the next boundary strictly above ``p``. Then, in order:
1. ``p + e <= b``: the tensor fits before ``b``; start at ``p``.
2. Otherwise the tensor crosses ``b``; the earliest start with ``b - l`` a multiple of ``g`` is
   ``l1 = p + (b - p) mod g`` (``<= b``). Every further boundary ``b + jS`` inside is fine iff
   ``S mod g == 0``; otherwise ``l1`` works only if the tensor ends by ``b + S``. Later starts of
   the same family only end later, and ``l = b`` with ``e > S`` would cross ``b + S`` unaligned.
3. With ``S mod g != 0`` and the tensor too long for (2): it can cross only ``b + S``, entering
   it aligned: ``l3 = b + S mod g``, valid iff ``l3 + e <= b + 2S``. Past that the pattern repeats
   with period ``S``, so if ``l3`` fails no start is feasible for this ``S``.

The vectorised kernel runs that rule over many (order, S) lanes at once: the loop is over the
tensors, each step a handful of numpy operations on all lanes, which is what makes scanning
hundreds of candidate shard sizes for several orders cheap in Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shard_planner._private.bounds import INFEASIBLE_INT64

__all__ = ["INFEASIBLE", "earliest_start", "greedy_ends", "greedy_offsets", "step_ends"]

# Larger than any buffer the int64 kernels see, small enough that ``(p // S + 1) * S + e`` stays
# inside int64 (``bounds`` [Note: exact integer arithmetic]); object arrays get a larger one.
INFEASIBLE = INFEASIBLE_INT64

IntArray = npt.NDArray[Any]


def earliest_start(p: int, numel: int, block: int, shard_size: int) -> int | None:
    """Smallest feasible start ``>= p`` of one tensor (see the Note above), or ``None``."""
    s = shard_size
    b = (p // s + 1) * s
    if p + numel <= b:
        return p
    l1 = p + (b - p) % block
    if s % block == 0 or l1 + numel <= b + s:
        return l1
    l3 = b + s % block
    if l3 + numel <= b + 2 * s:
        return l3
    return None


def greedy_offsets(
    numels: Sequence[int], blocks: Sequence[int], shard_size: int, capacity: int, start: int = 0
) -> list[int] | None:
    """Offsets of tensors placed in the given order from ``start``, or ``None`` if they overflow.

    Zero-size tensors are placed at the current position (clamped below ``capacity``).
    """
    offsets: list[int] = []
    p = start
    for numel, block in zip(numels, blocks, strict=True):
        if numel == 0:
            offsets.append(min(p, capacity - 1))
            continue
        at = earliest_start(p, numel, block, shard_size)
        if at is None or at + numel > capacity:
            return None
        offsets.append(at)
        p = at + numel
    return offsets


def greedy_ends(
    numels: IntArray, blocks: IntArray, shard_sizes: IntArray, infeasible: int = INFEASIBLE
) -> IntArray:
    """End of the greedy placement for every (order, shard size) lane.

    ``numels`` and ``blocks`` are ``(O, T)``: row ``o`` lists the tensors in order ``o`` (zero-size
    tensors may be included; they change nothing). ``shard_sizes`` is ``(K,)``. Returns ``(O, K)``
    ends, ``>= infeasible`` where some tensor has no feasible start. The caller compares the ends
    with ``m * S``. All arrays share one dtype: int64, or object for exact Python ints
    (``bounds.int_mode`` picks it and the matching ``infeasible``).
    """
    orders, count = numels.shape
    s = shard_sizes[None, :]
    p = np.zeros((orders, s.shape[1]), dtype=np.int64).astype(numels.dtype)
    for i in range(count):
        p = step_ends(p, numels[:, i : i + 1], blocks[:, i : i + 1], s, infeasible)
    return p


def step_ends(p: IntArray, e: IntArray, g: IntArray, s: IntArray, infeasible: int) -> IntArray:
    """The end after placing one more tensor (``e`` elements, block ``g``) at the earliest
    feasible start at or after ``p``, elementwise over broadcast lanes (the Note's rule)."""
    b = (p // s + 1) * s
    end = p + e
    fits = end <= b
    if bool(fits.all()):
        clamped: IntArray = np.minimum(end, infeasible)
        return clamped
    # Aligned on the first crossed boundary (case 2); most lanes end here.
    end1 = end + (b - p) % g
    s_mod_g = s % g
    ok1 = (s_mod_g == 0) | (end1 <= b + s)
    if bool(ok1.all()):
        return np.where(fits, end, np.minimum(end1, infeasible))
    end3 = b + s_mod_g + e
    ok3 = end3 <= b + 2 * s
    out = np.where(fits, end, np.where(ok1, end1, np.where(ok3, end3, infeasible)))
    return np.minimum(out, infeasible)
