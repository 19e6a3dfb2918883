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
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt

__all__ = [
    "IntMode",
    "admissible",
    "admissible_mask",
    "ShardSizes",
    "int_mode",
    "lower_bound_shard_size",
    "round_up",
    "trivial_shard_size",
]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# [Note: exact integer arithmetic]
# The vectorised kernels run on int64 when every value they can meet is far from its range,
# else on numpy object arrays of Python ints (exact at any size, slower). The planner never tries
# a shard size above ``trivial_shard_size`` (everything in shard 0 fits there), so positions stay
# below ``(m + 4) * (total + align + max block)``; int64 is used when that is below 2**59, which
# leaves room for the infeasibility sentinel 2**60 and for one more step past it.
_INT64_LIMIT = 1 << 59
INFEASIBLE_INT64 = 1 << 60


@attrs.frozen
class IntMode:
    """The dtype of the planner's integer arrays for one input, and its infeasibility sentinel."""

    dtype: type
    infeasible: int
    cost: int = 1  # relative cost of one kernel step (budgets are divided by it)

    def array(self, values: object) -> npt.NDArray[Any]:
        return np.array(values, dtype=self.dtype)


def int_mode(numels: Sequence[int], blocks: Sequence[int], world_size: int, align: int) -> IntMode:
    """``int64`` when it is exact for this input (see the Note), else Python ints."""
    total = sum(numels)
    reach = (world_size + 4) * (total + align + max(blocks, default=1))
    if reach < _INT64_LIMIT:
        return IntMode(np.int64, INFEASIBLE_INT64)
    # Python-int kernels run ~20-50x slower than int64 ones: budgets shrink accordingly.
    return IntMode(object, 1 << (2 * reach.bit_length() + 8), cost=25)


def trivial_shard_size(numels: Sequence[int], align: int) -> int:
    """Every tensor in shard 0 (no boundary inside any tensor): always feasible."""
    return round_up(max(sum(numels), 1), align)


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
    mode = int_mode(numels, blocks, world_size, align)
    e_arr, g_arr = mode.array(list(numels)), mode.array(list(blocks))
    return bool(admissible_mask(e_arr, g_arr, world_size, mode.array([s]))[0])


def admissible_mask(
    numels: npt.NDArray[Any],
    blocks: npt.NDArray[Any],
    world_size: int,
    shard_sizes: npt.NDArray[Any],
) -> npt.NDArray[np.bool_]:
    """The joint conditions (boundary count, runs of single crossers) for each shard size.

    Assumes the per-tensor conditions hold (sizes from ``ShardSizes``' progressions).
    """
    m = world_size
    if m == 1:
        return np.ones(shard_sizes.shape, dtype=bool)
    s = shard_sizes[:, None]
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
    count = np.arange(1, ordered.shape[1] + 1, dtype=np.int64).astype(ordered.dtype)[None, :]
    by_count = np.where(ordered > 0, -(-count // np.maximum(per_bin, 1)), 0).max(axis=1)
    runs = np.maximum(runs, by_count)
    return np.asarray(ok & (n_single + runs <= m), dtype=bool)


_CHUNK = 4096  # candidate sizes generated and filtered per numpy batch


class ShardSizes:
    """Every shard size passing all necessary conditions, increasing, up to ``limit`` inclusive
    (default ``trivial_shard_size``, which is always one, so the stream is finite and never
    empty), handed out in numpy batches: ``take(count)``.

    Between two breakpoints (``tau`` values of the module Note) the per-tensor conditions leave
    an arithmetic progression (multiples of the LCM of the forced blocks); each progression is
    generated with ``arange`` in chunks and filtered by ``admissible_mask``.
    """

    def __init__(
        self,
        numels: Sequence[int],
        blocks: Sequence[int],
        world_size: int,
        align: int,
        limit: int | None = None,
    ) -> None:
        self.mode = int_mode(numels, blocks, world_size, align)
        self._e = self.mode.array(list(numels))
        self._g = self.mode.array(list(blocks))
        self._m = world_size
        self._stop = trivial_shard_size(numels, align) if limit is None else limit
        self._chunks = self._candidate_chunks(numels, blocks, align)
        self._buffer: list[npt.NDArray[Any]] = []
        self._buffered = 0
        self.done = False  # the stream is exhausted
        self.generated = 0  # candidates generated and filtered so far (the cost of the stream)
        self.unchecked = 1  # every admissible size below this was handed out or buffered

    def _progressions(
        self, numels: Sequence[int], blocks: Sequence[int], align: int
    ) -> Iterator[tuple[int, int, int]]:
        """``(first, stop, step)`` ranges covering the per-tensor admissible sizes, in order."""
        total = sum(numels)
        lo = max(-(-total // self._m), 1)
        if self._m == 1:
            yield round_up(lo, align), self._stop + 1, align
            return
        nonempty_blocks = [g for e, g in zip(numels, blocks, strict=True) if e > 0]
        if nonempty_blocks:
            lo = max(lo, *nonempty_blocks)
        taus = _thresholds(numels, blocks)
        breakpoints = sorted(set(taus.values()))
        s = lo
        while s <= self._stop:
            step = align
            for g, tau in taus.items():
                if tau > s:
                    step = math.lcm(step, g)
            upper = next((t for t in breakpoints if t > s), None)
            end = self._stop + 1 if upper is None else min(upper, self._stop + 1)
            yield round_up(s, step), end, step
            if upper is None:
                return
            s = upper

    def _candidate_chunks(
        self, numels: Sequence[int], blocks: Sequence[int], align: int
    ) -> Iterator[npt.NDArray[Any]]:
        dtype = self.mode.dtype
        # small chunks first (the lower bound needs one size; the joint conditions cost
        # O(tensors log tensors) per candidate), growing to _CHUNK
        size = 64
        for first, stop, step in self._progressions(numels, blocks, align):
            c = first
            while c < stop:
                n = min(size, -(-(stop - c) // step))
                yield np.arange(c, c + n * step, step, dtype=dtype)
                c += n * step
                size = min(2 * size, _CHUNK)

    def take(self, count: int, budget: int | None = None) -> npt.NDArray[Any]:
        """The next ``count`` admissible sizes; fewer when the stream ends, or when ``budget``
        candidates were generated in this call without finding that many."""
        start = self.generated
        while self._buffered < count and not self.done:
            if budget is not None and self.generated - start >= budget:
                break
            chunk = next(self._chunks, None)
            if chunk is None:
                self.done = True
                break
            self.generated += chunk.size
            self.unchecked = int(chunk[-1]) + 1
            kept = chunk[admissible_mask(self._e, self._g, self._m, chunk)]
            if kept.size:
                self._buffer.append(kept)
                self._buffered += kept.size
        if not self._buffer:
            return self.mode.array([])
        joined = np.concatenate(self._buffer)
        out, rest = joined[:count], joined[count:]
        self._buffer = [rest] if rest.size else []
        self._buffered = rest.size
        return out

    @property
    def empty(self) -> bool:
        """Every admissible size up to the limit has been handed out."""
        return self.done and self._buffered == 0

    def __iter__(self) -> Iterator[int]:
        while True:
            chunk = self.take(64)
            if not chunk.size:
                return
            yield from (int(c) for c in chunk)


# Candidates the lower bound examines at most (~0.1 s); see ``lower_bound_shard_size``.
_BOUND_CANDIDATES = 131072


def lower_bound_shard_size(
    numels: Sequence[int], blocks: Sequence[int], world_size: int, align: int
) -> int:
    """No plan of this group can have a smaller shard size.

    The smallest admissible size when one is among the first ``_BOUND_CANDIDATES`` candidates
    (always, in practice); otherwise the first size not examined, rounded up to ``align``, which
    is still below every admissible size (a bounded scan, so the bound costs bounded time).
    """
    sizes = ShardSizes(numels, blocks, world_size, align)
    first = sizes.take(1, budget=_BOUND_CANDIDATES)
    if first.size:
        return int(first[0])
    return round_up(sizes.unchecked, align)
