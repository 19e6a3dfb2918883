"""Necessary conditions on the shard size, the lower bound, and the candidate shard sizes.

[Note: what one tensor alone forces on S]
Take a non-empty tensor of ``e = n*g`` elements (``n`` blocks of ``g``) and ``m >= 2`` ranks.
- A block never spans a boundary, and any open interval longer than ``S`` inside ``[0, m*S)``
  contains a boundary, so ``g <= S``.
- If the tensor contains two boundaries ``b`` and ``b + S``, both are multiples of ``g`` away from
  its start, so ``S mod g == 0``.
- If ``S mod g != 0`` it contains at most one boundary; the parts before and after it are whole
  blocks of at most ``S`` elements each, so ``e <= 2*g*floor(S/g)``, i.e. ``S >= tau``, with
  ``tau = g*ceil(n/2)``.
So for ``S < tau`` the shard size must be a multiple of ``g``, and for ``S >= tau`` the tensor
alone constrains nothing (beyond ``g <= S``). The set of tensors "forcing" their block on S
shrinks as S grows; the breakpoints are the ``tau`` values. Between two breakpoints every
admissible S is a multiple of ``L = lcm(align, forced blocks)``.

[Note: what the tensors force together: boundaries and runs]
A boundary lies strictly inside at most one tensor. A tensor longer than S contains at least
``ceil(e/S) - 1`` boundaries, so these counts sum to at most ``m - 1``. Sharper, for the
*single crossers* C (``e > S`` and ``S mod g != 0``: exactly one boundary each): call
``x = e - S`` a crosser's excess. In a maximal run of consecutive boundaries ``b_1..b_k`` crossed
by crossers, the shard between ``b_i`` and ``b_(i+1)`` holds the tail of crosser ``i`` and the head
of crosser ``i+1``: ``tail_i + head_(i+1) <= S``; with ``head_1 <= S`` and ``tail_k <= S`` this
telescopes to ``x_1 + ... + x_k <= S``. A run of k crossers touches k+1 shards and runs touch
disjoint shards, so ``|C| + R <= m`` where R, the number of runs, is at least the number of bins
of size S the excesses need: at least ``ceil(sum(x) / S)`` and, for every threshold ``x_j``, the
count of excesses ``>= x_j`` over ``floor(S / x_j)``. (Example: DeepSeek-V3's 771 expert
matrices at 1024 ranks are 1.3 shards long, so runs hold at most 3 of them, 4 shards per run:
that rules out the sizes where capacity alone would allow 0.16% padding.)

[Note: the lower bound]
Every feasible S is admissible in those senses, a multiple of ``align``, and ``m*S >= total``.
The smallest such S is our lower bound; the candidate generator lists every S passing the
per-tensor conditions upwards, ``admissible_mask`` filters them with the joint ones, so a scan
over candidates skips nothing a feasible plan could use. Feasibility itself is
not monotone in S (a larger S moves every boundary), hence a scan, not a bisection.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

__all__ = [
    "admissible",
    "admissible_mask",
    "admissible_shard_sizes",
    "candidate_shard_sizes",
    "lower_bound_shard_size",
    "round_up",
]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _thresholds(numels: Sequence[int], blocks: Sequence[int]) -> dict[int, int]:
    """For every block size, the largest ``tau`` of its tensors (see the Note)."""
    taus: dict[int, int] = {}
    for e, g in zip(numels, blocks, strict=True):
        if e == 0:
            continue
        tau = g * (-(-(e // g) // 2))
        taus[g] = max(taus.get(g, 0), tau)
    return taus


def admissible(
    numels: Sequence[int], blocks: Sequence[int], world_size: int, align: int, shard_size: int
) -> bool:
    """Whether ``shard_size`` passes every necessary condition of the module Note."""
    s = shard_size
    if s < 1 or s % align != 0 or world_size * s < sum(numels):
        return False
    if world_size == 1:
        return True
    for e, g in zip(numels, blocks, strict=True):
        if e == 0:
            continue
        if g > s:
            return False
        if s % g != 0 and e > 2 * g * (s // g):
            return False
    e_arr = np.asarray(numels, dtype=np.int64)
    g_arr = np.asarray(blocks, dtype=np.int64)
    return bool(admissible_mask(e_arr, g_arr, world_size, np.array([s], dtype=np.int64))[0])


def admissible_mask(
    numels: npt.NDArray[np.int64],
    blocks: npt.NDArray[np.int64],
    world_size: int,
    shard_sizes: npt.NDArray[np.int64],
) -> npt.NDArray[np.bool_]:
    """The joint conditions (boundary count, runs of single crossers) for each shard size.

    Assumes the per-tensor conditions hold (sizes from ``candidate_shard_sizes``).
    """
    m = world_size
    if m == 1:
        return np.ones(shard_sizes.shape, dtype=bool)
    s = shard_sizes.astype(np.int64)[:, None]
    e, g = numels[None, :], blocks[None, :]
    big = e > s
    single = big & (s % g != 0)
    n_single = single.sum(axis=1)
    multi = np.where(big & ~single, -(-e // s) - 1, 0).sum(axis=1)
    ok = n_single + multi <= m - 1
    if not bool(n_single.any()):
        return np.asarray(ok, dtype=bool)
    excess = np.where(single, e - s, 0)
    runs = -(-excess.sum(axis=1) // s[:, 0])
    ordered = -np.sort(-excess, axis=1)
    per_bin = s // np.maximum(ordered, 1)
    count = np.arange(1, ordered.shape[1] + 1, dtype=np.int64)[None, :]
    by_count = np.where(ordered > 0, -(-count // np.maximum(per_bin, 1)), 0).max(axis=1)
    runs = np.maximum(runs, by_count)
    return np.asarray(ok & (n_single + runs <= m), dtype=bool)


def admissible_shard_sizes(
    numels: Sequence[int], blocks: Sequence[int], world_size: int, align: int, batch: int = 64
) -> Iterator[int]:
    """Every shard size passing all necessary conditions, increasing (infinite generator)."""
    sizes = candidate_shard_sizes(numels, blocks, world_size, align)
    e_arr = np.asarray(numels, dtype=np.int64)
    g_arr = np.asarray(blocks, dtype=np.int64)
    while True:
        chunk = np.array([next(sizes) for _ in range(batch)], dtype=np.int64)
        yield from (int(c) for c in chunk[admissible_mask(e_arr, g_arr, world_size, chunk)])


def candidate_shard_sizes(
    numels: Sequence[int], blocks: Sequence[int], world_size: int, align: int
) -> Iterator[int]:
    """Every admissible shard size in increasing order (an infinite generator)."""
    total = sum(numels)
    lo = max(-(-total // world_size), 1)
    if world_size == 1:
        s = round_up(lo, align)
        while True:
            yield s
            s += align
    nonempty_blocks = [g for e, g in zip(numels, blocks, strict=True) if e > 0]
    if nonempty_blocks:
        lo = max(lo, *nonempty_blocks)
    taus = _thresholds(numels, blocks)
    breakpoints = sorted(set(taus.values()))
    s = lo
    while True:
        step = align
        for g, tau in taus.items():
            if tau > s:
                step = math.lcm(step, g)
        upper = next((t for t in breakpoints if t > s), None)
        c = round_up(s, step)
        while upper is None or c < upper:
            yield c
            c += step
        s = upper


def lower_bound_shard_size(
    numels: Sequence[int], blocks: Sequence[int], world_size: int, align: int
) -> int:
    """The smallest admissible shard size: no plan of this group can have a smaller one."""
    return next(admissible_shard_sizes(numels, blocks, world_size, align))
