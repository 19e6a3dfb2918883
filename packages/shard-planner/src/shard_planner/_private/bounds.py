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
alone constrains nothing. The set of tensors "forcing" their block on S shrinks as S grows; the
breakpoints are the ``tau`` values. Between two breakpoints every admissible S is a multiple of
``L = lcm(align, forced blocks)``.

[Note: the lower bound]
Every feasible S is admissible in that sense, a multiple of ``align``, and ``m*S >= total``. The
smallest such S is our lower bound; the candidate generator lists every admissible S upwards
from it, so a scan over candidates skips nothing a feasible plan could use. Feasibility itself is
not monotone in S (a larger S moves every boundary), hence a scan, not a bisection.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

__all__ = ["admissible", "candidate_shard_sizes", "lower_bound_shard_size", "round_up"]


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


def admissible(numels: Sequence[int], blocks: Sequence[int], world_size: int, align: int,
               shard_size: int) -> bool:
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
    return True


def candidate_shard_sizes(numels: Sequence[int], blocks: Sequence[int], world_size: int,
                          align: int) -> Iterator[int]:
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
        lo = max(lo, max(nonempty_blocks))
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


def lower_bound_shard_size(numels: Sequence[int], blocks: Sequence[int], world_size: int,
                           align: int) -> int:
    """The smallest admissible shard size: no plan of this group can have a smaller one."""
    return next(candidate_shard_sizes(numels, blocks, world_size, align))
